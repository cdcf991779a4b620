// Time enters the store only through Clock, so tests drive it by hand.
// Thread-safe: NowNanos may be called from any thread.
#ifndef TMEMD_BACKEND_CLOCK_H_
#define TMEMD_BACKEND_CLOCK_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace tmem {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic nanoseconds since an arbitrary origin.
  virtual int64_t NowNanos() const = 0;
};

class SteadyClock final : public Clock {
 public:
  int64_t NowNanos() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // Process-wide instance for callers that do not inject one.
  static SteadyClock* Default();
};

// A clock that moves only when told to. For tests.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(int64_t start_nanos = 0) : now_(start_nanos) {}
  int64_t NowNanos() const override {
    return now_.load(std::memory_order_acquire);
  }
  void Advance(int64_t nanos) {
    now_.fetch_add(nanos, std::memory_order_acq_rel);
  }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_CLOCK_H_
