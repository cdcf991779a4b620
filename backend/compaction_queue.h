// CompactionQueue: the bounded queue of pages stored raw whose compression
// was deferred to the compactor (compactor.h), oldest first.
//
// A put the valve would compress (PutMode::kDefer) is stored raw at once;
// the store then pushes a ticket naming that page and that put (a stamp
// unique for the queue's life) and marks the page pending under its shard
// lock. The compactor pops tickets in put order (first in, first out: a
// first slice; no reuse or age ranking), compresses each page and swaps the
// compressed block in if the page is still the one the ticket names
// (TmemStore::CompleteDeferred). A page that is read (private pool),
// invalidated, evicted or re-put before its turn leaves the pending set when
// it goes, counted here by cause, and its ticket is then stale: no work.
//
// Bounds: at most `capacity` tickets (fixed at construction, allocated once;
// not charged to the store's memory cap, like the store's fixed per-VM
// descriptors). A push to a full queue is refused and counted (overflow):
// that page simply stays raw.
//
// Threads: thread-safe. TryPush is called by puts under a shard lock, so the
// queue's mutex is a leaf (store lock order: ... shard -> queue); it is held
// only for a ring-buffer step. TryPush wakes nobody: a wake-up would run the
// compactor at once at normal priority (and with the scheduler's sleeper
// credit), which is exactly the CPU it must not take from a busy host. The
// compactor polls length() (lock-free) while it sleeps at SCHED_IDLE.
#ifndef TMEMD_BACKEND_COMPACTION_QUEUE_H_
#define TMEMD_BACKEND_COMPACTION_QUEUE_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "backend/types.h"

namespace tmem {

// One deferred page: the key as its putter names it, and the put's stamp.
struct CompactionTicket {
  uint32_t vm = 0;  // VmId of the putting VM
  PoolId pool = -1;
  ObjectId oid;
  PageIndex index = 0;
  uint64_t stamp = 0;     // unique per put, never 0
  int64_t put_nanos = 0;  // the store's clock at the put
  // PutMode::kDeferIdle: compressed at SCHED_IDLE even under memory
  // pressure (compactor.h).
  bool idle_only = false;
  // A persistent pool's page (swap): it always comes back, so it is
  // compressed whatever its VM's cleancache reuse.
  bool persistent = false;
};

// Why a pending page left the store before the compactor reached it.
enum class CompactionSkip : uint8_t {
  kRead = 0,     // a get took it (private pools are exclusive)
  kInvalidated,  // invalidated, its pool destroyed or its VM forgotten
  kEvicted,      // evicted (host cap or quota)
  kReplaced,     // a later put of the same key (stored or refused)
};
inline constexpr int kNumCompactionSkips = 4;
std::string_view CompactionSkipName(CompactionSkip why);

struct CompactionQueueStats {
  uint64_t capacity = 0;
  uint64_t length = 0;     // tickets waiting now
  uint64_t pushed = 0;     // tickets accepted
  uint64_t overflows = 0;  // pushes refused, queue full: page stays raw
  std::array<uint64_t, kNumCompactionSkips> skipped{};  // by CompactionSkip
};

class CompactionQueue {
 public:
  // capacity: 1 .. kMaxCapacity tickets.
  static constexpr size_t kMaxCapacity = size_t{1} << 22;
  explicit CompactionQueue(size_t capacity);
  CompactionQueue(const CompactionQueue&) = delete;
  CompactionQueue& operator=(const CompactionQueue&) = delete;

  // A stamp no earlier call returned; never 0.
  uint64_t NextStamp() {
    return next_stamp_.fetch_add(1, std::memory_order_relaxed);
  }
  // Appends; false (and counted as an overflow) when full.
  bool TryPush(const CompactionTicket& ticket);
  // Moves up to out.size() oldest tickets into `out`; returns how many.
  // Never blocks on an empty queue.
  size_t PopBatch(std::span<CompactionTicket> out);
  // Tickets waiting (lock-free; may be stale by the time it is used).
  size_t length() const {
    return approx_length_.load(std::memory_order_relaxed);
  }
  // A pending page left the store before its turn (called by the store).
  void CountSkipped(CompactionSkip why) {
    skipped_[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
  }

  size_t capacity() const { return ring_.size(); }
  CompactionQueueStats Stats() const;

 private:
  std::vector<CompactionTicket> ring_;  // fixed size: the capacity
  mutable std::mutex mu_;
  size_t head_ = 0;                       // oldest ticket (guarded by mu_)
  size_t length_ = 0;                     // (guarded by mu_)
  std::atomic<size_t> approx_length_{0};  // length_, for lock-free polls
  std::atomic<uint64_t> next_stamp_{1};
  std::atomic<uint64_t> pushed_{0};
  std::atomic<uint64_t> overflows_{0};
  std::array<std::atomic<uint64_t>, kNumCompactionSkips> skipped_{};
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_COMPACTION_QUEUE_H_
