#include "bench/ring/machine_floor.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <system_error>
#include <thread>

#include "absl/status/status.h"
#include "bench/method.h"
#include "bench/ring/common.h"

namespace tmem::bench::ring {

namespace {

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

void FloorBatch(FloorMode mode, size_t n, std::chrono::microseconds gap,
                const Page& answer, std::vector<double>* samples) {
  const bool sleeping = mode != FloorMode::kSpinning;
  constexpr uint64_t kStop = ~uint64_t{0};
  alignas(64) std::atomic<uint64_t> req{0};
  alignas(64) std::atomic<uint64_t> resp{0};
  const int doorbell = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int irq = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  epoll_event reg{};
  reg.events = EPOLLIN;
  if (doorbell < 0 || irq < 0 || ep < 0 ||
      epoll_ctl(ep, EPOLL_CTL_ADD, doorbell, &reg) != 0) {
    Die("floor probe",
        absl::InternalError(std::generic_category().message(errno)));
  }
  const uint64_t one = 1;
  uint64_t drained = 0;
  auto shared = std::make_unique<Page>();
  auto out = std::make_unique<Page>();
  cpu_set_t saved;
  CPU_ZERO(&saved);
  const bool pin = mode != FloorMode::kSleepingAnyCpu &&
                   sched_getaffinity(0, sizeof(saved), &saved) == 0 &&
                   CPU_COUNT(&saved) >= 2;
  cpu_set_t mine, theirs;
  CPU_ZERO(&mine);
  CPU_ZERO(&theirs);
  if (pin) {
    const int here = sched_getcpu();
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &saved) && c != here) {
        CPU_SET(c, &theirs);
        break;
      }
    }
    CPU_SET(here, &mine);
    sched_setaffinity(0, sizeof(mine), &mine);
  }
  std::thread responder([&] {
    if (pin) sched_setaffinity(0, sizeof(theirs), &theirs);
    uint64_t last = 0;
    for (;;) {
      uint64_t r;
      if (sleeping) {
        epoll_event ev{};
        if (epoll_wait(ep, &ev, 1, -1) <= 0) continue;
        uint64_t v;
        (void)!read(doorbell, &v, sizeof(v));
        r = req.load(std::memory_order_acquire);
        if (r == last) continue;
      } else {
        while ((r = req.load(std::memory_order_acquire)) == last) CpuRelax();
      }
      if (r == kStop) return;
      last = r;
      std::memcpy(shared->bytes.data(), answer.bytes.data(), kPageSize);
      resp.store(r, std::memory_order_release);
      if (sleeping) (void)!write(irq, &one, sizeof(one));
    }
  });
  for (uint64_t i = 1; i <= n; ++i) {
    if (sleeping) {
      std::this_thread::sleep_for(gap);
      (void)!read(irq, &drained, sizeof(drained));
    }
    const Clock::time_point t0 = Clock::now();
    req.store(i, std::memory_order_release);
    if (sleeping) (void)!write(doorbell, &one, sizeof(one));
    const Clock::time_point spin_until = t0 + kGetSpin;
    while (resp.load(std::memory_order_acquire) != i) {
      if (!sleeping || Clock::now() < spin_until) {
        CpuRelax();
        continue;
      }
      pollfd p{irq, POLLIN, 0};
      const timespec slice{0, 1000000};
      if (ppoll(&p, 1, &slice, nullptr) > 0) {
        (void)!read(irq, &drained, sizeof(drained));
      }
    }
    std::memcpy(out->bytes.data(), shared->bytes.data(), kPageSize);
    // Keep the copy: the compiler may not drop it.
    asm volatile("" : : "r"(out->bytes.data()) : "memory");
    const Clock::time_point t1 = Clock::now();
    if (samples != nullptr) samples->push_back(NsBetween(t0, t1));
  }
  req.store(kStop, std::memory_order_release);
  if (sleeping) (void)!write(doorbell, &one, sizeof(one));
  responder.join();
  if (pin) sched_setaffinity(0, sizeof(saved), &saved);
  close(ep);
  close(irq);
  close(doorbell);
}

}  // namespace tmem::bench::ring
