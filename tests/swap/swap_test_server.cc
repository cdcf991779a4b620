// swap_test_server: one SwapDevice, for tests that attach a real QEMU
// (vhost-user-blk-pci) to it.
//
//   swap_test_server --socket PATH --mib N [--queues Q]
//                    [--backing memory|tmem] [--image-dir DIR]
//                    [--quota-mib Q] [--cap-mib C]
//
// --backing memory (default): a MemorySwapBacking. --backing tmem: a
// TmemSwapBacking over a real TmemStore (cap C MiB, default 1024) holding
// one VM (quota Q MiB, default unlimited) with a persistent pool, spilling
// to DIR/vm.swap.img; at a clean stop it writes the store's pages back into
// the image (a graceful stop) and reports how many.
//
// Prints "READY <path>" once the socket listens; serves until SIGTERM or
// SIGINT; on SIGUSR1 and at exit prints one line "STATS {json}" with every
// counter and the stored page count (tmem: also the backing's counters,
// prefixed "tmem_"). Events (dropped sessions) go to stderr. Exit status 0
// after a clean stop.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "backend/tmem_store.h"
#include "host-agent/swap/memory_swap_backing.h"
#include "host-agent/swap/swap_device.h"
#include "host-agent/swap/tmem_swap_backing.h"

namespace {

void PrintStats(const tmem::swap::SwapDevice& dev,
                const tmem::swap::MemorySwapBacking* memory,
                const tmem::swap::TmemSwapBacking* tmem_backing) {
  std::string json = "{";
  for (int i = 0; i < tmem::swap::kNumSwapCounters; ++i) {
    const auto c = static_cast<tmem::swap::SwapCounter>(i);
    absl::StrAppend(&json, "\"", std::string(tmem::swap::SwapCounterName(c)),
                    "\":", dev.metrics().Get(c), ",");
  }
  if (tmem_backing != nullptr) {
    const tmem::swap::TmemSwapStats st = tmem_backing->Stats();
    for (int i = 0; i < tmem::swap::kNumTmemSwapCounters; ++i) {
      const auto c = static_cast<tmem::swap::TmemSwapCounter>(i);
      absl::StrAppend(&json, "\"tmem_",
                      std::string(tmem::swap::TmemSwapCounterName(c)),
                      "\":", st.counters[i], ",");
    }
    absl::StrAppend(
        &json, "\"tmem_pages_in_store\":", st.pages_in_store,
        ",\"tmem_pages_in_image\":", st.pages_in_image,
        ",\"tmem_pages_lost\":", st.pages_lost,
        ",\"tmem_image_allocated_bytes\":", st.image_allocated_bytes,
        ",\"tmem_image_direct_io\":", st.image_direct_io ? 1 : 0,
        ",\"tmem_image_page_writes\":", st.image_page_writes,
        ",\"tmem_image_page_reads\":", st.image_page_reads,
        ",\"tmem_image_io_errors\":", st.image_io_errors,
        ",\"tmem_pool_puts_compressed\":",
        tmem::CounterValueOf(st.pool, tmem::Counter::kPutsCompressed),
        ",\"tmem_pool_puts_raw\":",
        tmem::CounterValueOf(st.pool, tmem::Counter::kPutsRaw),
        ",\"tmem_pool_charged_bytes\":",
        tmem::CounterValueOf(st.pool, tmem::Counter::kChargedBytes), ",");
    absl::StrAppend(
        &json, "\"stored_pages\":", st.pages_in_store + st.pages_in_image, "}");
  } else {
    absl::StrAppend(&json, "\"stored_pages\":", memory->stored_pages(), "}");
  }
  std::printf("STATS %s\n", json.c_str());
  std::fflush(stdout);
}

absl::Status OpenTmemBacking(
    uint64_t mib, const std::string& image_dir, uint64_t quota_mib,
    uint64_t cap_mib, std::unique_ptr<tmem::TmemStore>* store,
    std::unique_ptr<tmem::swap::TmemSwapBacking>* backing) {
  tmem::StoreOptions so;
  so.memory_cap_bytes = cap_mib << 20;
  absl::StatusOr<std::unique_ptr<tmem::TmemStore>> st =
      tmem::TmemStore::Create(so);
  if (!st.ok()) return st.status();
  *store = std::move(*st);
  tmem::VmPolicy policy;
  if (quota_mib > 0) policy.quota_bytes = quota_mib << 20;
  absl::StatusOr<tmem::VmId> vm = (*store)->AddVm("vm1", policy);
  if (!vm.ok()) return vm.status();
  absl::StatusOr<tmem::PoolId> pool =
      (*store)->NewPool(*vm, nullptr, tmem::PoolKind::kPersistent);
  if (!pool.ok()) return pool.status();
  tmem::swap::SpillImageOptions io;
  io.path = image_dir + "/vm1.swap.img";
  io.page_count = mib * 256;
  io.on_event = [](std::string_view event, std::string_view detail) {
    std::fprintf(stderr, "event=%.*s detail=\"%.*s\"\n",
                 static_cast<int>(event.size()), event.data(),
                 static_cast<int>(detail.size()), detail.data());
  };
  absl::StatusOr<std::unique_ptr<tmem::swap::SpillImage>> image =
      tmem::swap::SpillImage::Open(io);
  if (!image.ok()) return image.status();
  tmem::swap::TmemSwapBackingOptions o;
  o.store = store->get();
  o.vm = *vm;
  o.pool = *pool;
  absl::StatusOr<std::unique_ptr<tmem::swap::TmemSwapBacking>> b =
      tmem::swap::TmemSwapBacking::Open(o, std::move(*image));
  if (!b.ok()) return b.status();
  *backing = std::move(*b);
  return absl::OkStatus();
}

int Usage() {
  std::fprintf(stderr,
               "usage: swap_test_server --socket PATH --mib N [--queues Q] "
               "[--backing memory|tmem] [--image-dir DIR] [--quota-mib Q] "
               "[--cap-mib C]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket_path;
  uint64_t mib = 0;
  int queues = 1;
  std::string backing_kind = "memory";
  std::string image_dir;
  uint64_t quota_mib = 0;  // 0: unlimited
  uint64_t cap_mib = 1024;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--socket") {
      socket_path = argv[i + 1];
    } else if (flag == "--mib") {
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--queues") {
      queues = std::atoi(argv[i + 1]);
    } else if (flag == "--backing") {
      backing_kind = argv[i + 1];
    } else if (flag == "--image-dir") {
      image_dir = argv[i + 1];
    } else if (flag == "--quota-mib") {
      quota_mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--cap-mib") {
      cap_mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else {
      return Usage();
    }
  }
  if (socket_path.empty() || mib == 0 || argc % 2 == 0) return Usage();
  if (backing_kind != "memory" &&
      (backing_kind != "tmem" || image_dir.empty())) {
    return Usage();
  }

  // Signals are taken synchronously by this thread; block them before the
  // device's thread starts so it inherits the mask.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  std::unique_ptr<tmem::swap::MemorySwapBacking> memory;
  std::unique_ptr<tmem::TmemStore> store;
  std::unique_ptr<tmem::swap::TmemSwapBacking> tmem_backing;
  tmem::swap::SwapBacking* backing = nullptr;
  if (backing_kind == "memory") {
    memory = std::make_unique<tmem::swap::MemorySwapBacking>(mib * 256);
    backing = memory.get();
  } else {
    absl::Status s = OpenTmemBacking(mib, image_dir, quota_mib, cap_mib, &store,
                                     &tmem_backing);
    if (!s.ok()) {
      std::fprintf(stderr, "swap_test_server: %s\n",
                   std::string(s.message()).c_str());
      return 1;
    }
    backing = tmem_backing.get();
  }
  tmem::swap::SwapDeviceOptions options;
  options.socket_path = socket_path;
  options.blk.num_queues = static_cast<uint16_t>(queues);
  options.on_event = [](std::string_view event, std::string_view reason) {
    std::fprintf(stderr, "event=%.*s reason=\"%.*s\"\n",
                 static_cast<int>(event.size()), event.data(),
                 static_cast<int>(reason.size()), reason.data());
  };
  auto dev = tmem::swap::SwapDevice::Start(options, backing);
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
      PrintStats(**dev, memory.get(), tmem_backing.get());
      continue;
    }
    break;
  }
  (*dev)->Stop();
  int rc = 0;
  if (tmem_backing != nullptr) {
    // The graceful stop: what the store holds goes into the image.
    absl::StatusOr<uint64_t> n = tmem_backing->WriteBackAll();
    if (n.ok()) {
      std::fprintf(stderr, "event=written_back pages=%llu\n",
                   static_cast<unsigned long long>(*n));
    } else {
      std::fprintf(stderr, "swap_test_server: write-back: %s\n",
                   std::string(n.status().message()).c_str());
      rc = 1;
    }
  }
  PrintStats(**dev, memory.get(), tmem_backing.get());
  return rc;
}
