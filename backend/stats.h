// Counters kept per host, per VM and per pool.
//
// A CounterSet is a fixed array of relaxed atomics indexed by `Counter`, so
// every consumer (tests, gRPC, Prometheus) can iterate the same names and no
// counter is forgotten in a hand-written copy. Counters only grow; gauges
// (pages and bytes held) go up and down. Thread-safe: any thread may bump or
// read at any time; a snapshot is not atomic across counters.
#ifndef TMEMD_BACKEND_STATS_H_
#define TMEMD_BACKEND_STATS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

#include "backend/types.h"

namespace tmem {

enum class Counter : int {
  // Puts, by how the page was stored.
  kPutsCompressed = 0,  // stored as an LZ4 block
  kPutsRaw,             // stored verbatim (poor compression or PutMode::kRaw)
  kPutsZero,            // all-zero page: metadata only
  kPutsSameFilled,      // repeated 64-bit word: metadata only
  // Puts refused, one per RefuseReason (same order as the enum).
  kPutsRefusedQuota,
  kPutsRefusedPoorCompression,
  kPutsRefusedNoMemory,
  kPutsRefusedPolicy,
  // Gets.
  kGetsHit,
  kGetsMiss,
  // Invalidate calls (not pages removed).
  kInvalidatePage,
  kInvalidateObject,
  kInvalidatePool,
  // Pages removed by invalidates (page, object, pool, destroy).
  kPagesInvalidated,
  // Pages evicted to keep the host cap, and to keep the VM's own quota.
  kEvictionsHostCap,
  kEvictionsQuota,
  // Gauges.
  kPagesHeld,
  kStoredBytes,   // blob slot bytes held (0 for zero/same-filled pages)
  kChargedBytes,  // stored bytes + per-page metadata charge (what quotas see)
  // Of which, in persistent pools (never evicted; the rest may be).
  kPersistentPagesHeld,
  kPersistentChargedBytes,
  // Puts to persistent pools refused for room (quota or no_memory, also
  // counted there): pages the caller had to keep elsewhere. Puts, gets and
  // invalidates of persistent pools are counted by the counters above; a
  // pool's own counters tell its kind apart.
  kPersistentPutsRefusedForRoom,
  // Puts to persistent pools refused at the VM's swap quota (quota, also
  // counted there; not in kPersistentPutsRefusedForRoom): the VM's swap
  // pages already hold what the operator allows them.
  kPersistentPutsRefusedForSwapQuota,
  kNumCounters,
};
inline constexpr int kNumCounters = static_cast<int>(Counter::kNumCounters);

std::string_view CounterName(Counter c);
bool CounterIsGauge(Counter c);
Counter RefusedCounter(RefuseReason reason);

using CounterValues = std::array<uint64_t, kNumCounters>;

// The value of counter `c` in `v`.
inline uint64_t CounterValueOf(const CounterValues& v, Counter c) {
  return v[static_cast<int>(c)];
}

// Derived figure: logical bytes (pages held x 4096) over charged bytes
// (blob slots plus per-page metadata). Returns 0 when nothing is held.
double CompressionRatio(const CounterValues& v);

class CounterSet {
 public:
  void Add(Counter c, int64_t delta) {
    values_[static_cast<int>(c)].fetch_add(static_cast<uint64_t>(delta),
                                           std::memory_order_relaxed);
  }
  void Inc(Counter c) { Add(c, 1); }
  uint64_t Get(Counter c) const {
    return values_[static_cast<int>(c)].load(std::memory_order_relaxed);
  }
  CounterValues Snapshot() const {
    CounterValues out{};
    for (int i = 0; i < kNumCounters; ++i) {
      out[i] = values_[i].load(std::memory_order_relaxed);
    }
    return out;
  }
  // Zeroes every counter (a reused VM struct starts afresh).
  void Reset() {
    for (auto& v : values_) v.store(0, std::memory_order_relaxed);
  }
  // Adds this set's values into `sum` (for host totals).
  void AccumulateInto(CounterValues& sum) const {
    for (int i = 0; i < kNumCounters; ++i) {
      sum[i] += values_[i].load(std::memory_order_relaxed);
    }
  }

 private:
  std::array<std::atomic<uint64_t>, kNumCounters> values_{};
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_STATS_H_
