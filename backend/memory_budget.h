// MemoryBudget: the host memory cap, as one atomic counter of bytes.
//
// Every byte the store takes from the OS (blob slabs, page entries, hash
// indexes, object tables) is charged here before or, for hash-index growth,
// right after it is taken (see TmemStore's header for the stated slack).
// Lock-free; safe from any thread.
#ifndef TMEMD_BACKEND_MEMORY_BUDGET_H_
#define TMEMD_BACKEND_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>

namespace tmem {

class MemoryBudget {
 public:
  explicit MemoryBudget(uint64_t cap_bytes) : cap_(cap_bytes) {}

  // Charges `bytes` if the total stays within the cap; otherwise changes
  // nothing and returns false.
  bool TryCharge(uint64_t bytes) {
    uint64_t used = used_.load(std::memory_order_relaxed);
    const uint64_t cap = cap_.load(std::memory_order_relaxed);
    do {
      if (bytes > cap || used > cap - bytes) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes,
                                          std::memory_order_relaxed));
    return true;
  }
  // Charges unconditionally (memory already taken; the caller then evicts).
  void ForceCharge(uint64_t bytes) {
    used_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void Release(uint64_t bytes) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
  }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t cap() const { return cap_.load(std::memory_order_relaxed); }
  bool OverCap() const { return used() > cap(); }
  // Lowering the cap below `used` is allowed; the store then evicts down.
  void set_cap(uint64_t cap_bytes) {
    cap_.store(cap_bytes, std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> cap_;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_MEMORY_BUDGET_H_
