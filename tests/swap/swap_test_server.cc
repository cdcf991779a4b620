// swap_test_server: one SwapDevice over a MemorySwapBacking, for tests that
// attach a real QEMU (vhost-user-blk-pci) to it.
//
//   swap_test_server --socket PATH --mib N [--queues Q]
//
// Prints "READY <path>" once the socket listens; serves until SIGTERM or
// SIGINT; on SIGUSR1 and at exit prints one line "STATS {json}" with every
// counter and the stored page count. Events (dropped sessions) go to
// stderr. Exit status 0 after a clean stop.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "host-agent/swap/memory_swap_backing.h"
#include "host-agent/swap/swap_device.h"

namespace {

void PrintStats(const tmem::swap::SwapDevice& dev,
                const tmem::swap::MemorySwapBacking& backing) {
  std::string json = "{";
  for (int i = 0; i < tmem::swap::kNumSwapCounters; ++i) {
    const auto c = static_cast<tmem::swap::SwapCounter>(i);
    absl::StrAppend(&json, "\"", std::string(tmem::swap::SwapCounterName(c)),
                    "\":", dev.metrics().Get(c), ",");
  }
  absl::StrAppend(&json, "\"stored_pages\":", backing.stored_pages(), "}");
  std::printf("STATS %s\n", json.c_str());
  std::fflush(stdout);
}

int Usage() {
  std::fprintf(stderr,
               "usage: swap_test_server --socket PATH --mib N [--queues Q]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket_path;
  uint64_t mib = 0;
  int queues = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--socket") {
      socket_path = argv[i + 1];
    } else if (flag == "--mib") {
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--queues") {
      queues = std::atoi(argv[i + 1]);
    } else {
      return Usage();
    }
  }
  if (socket_path.empty() || mib == 0 || argc % 2 == 0) return Usage();

  // Signals are taken synchronously by this thread; block them before the
  // device's thread starts so it inherits the mask.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  tmem::swap::MemorySwapBacking backing(mib * 256);
  tmem::swap::SwapDeviceOptions options;
  options.socket_path = socket_path;
  options.blk.num_queues = static_cast<uint16_t>(queues);
  options.on_event = [](std::string_view event, std::string_view reason) {
    std::fprintf(stderr, "event=%.*s reason=\"%.*s\"\n",
                 static_cast<int>(event.size()), event.data(),
                 static_cast<int>(reason.size()), reason.data());
  };
  auto dev = tmem::swap::SwapDevice::Start(options, &backing);
  if (!dev.ok()) {
    std::fprintf(stderr, "swap_test_server: %s\n",
                 std::string(dev.status().message()).c_str());
    return 1;
  }
  std::printf("READY %s\n", socket_path.c_str());
  std::fflush(stdout);
  while (true) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (sig == SIGUSR1) {
      PrintStats(**dev, backing);
      continue;
    }
    break;
  }
  (*dev)->Stop();
  PrintStats(**dev, backing);
  return 0;
}
