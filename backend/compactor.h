// Compactor: compresses pages stored raw by deferred puts (PutMode::kDefer)
// in the background, with cycles no one else wants.
//
// Each thread polls the queue's length every 10 ms while it sleeps at
// SCHED_IDLE (puts wake nobody), pops a batch of tickets (oldest first,
// compaction_queue.h),
// copies each still-pending page out of the store, compresses the copies
// with no lock held, and swaps each block in (TmemStore::CompleteDeferred),
// which re-checks under the shard lock that the page is still that put's.
//
// Priority: the threads compress at SCHED_IDLE, so on a busy host they get
// (almost) no CPU and on an idle host they use what is left. They hold no
// lock at SCHED_IDLE: popping, copying and swapping run at normal priority
// (thread_priority.h explains the inversion this avoids), two class changes
// per batch. Start() first checks in a throwaway thread that the process may
// leave SCHED_IDLE again (CAP_SYS_NICE or RLIMIT_NICE); if not, or if a
// class change fails later, the failure is counted and reported once
// (on_priority_error) and the threads run at normal priority in "budget"
// mode below instead.
//
// Memory pressure closes the loop: while memory_tight() says the cap's
// headroom is short, raw pages cost twice what they would compressed, so
// the threads compress at normal priority, within the CPU budget
// cpu_budget_cores() allows (a duty cycle: after compressing for t they
// rest t * (threads / budget - 1)), and charge that CPU to the page's VM
// (charge_cpu, the valve's token buckets). When even that cannot keep up,
// the valve drops instead of storing raw (its out-of-tokens rule), and a
// full queue leaves pages raw (counted). Not for a batch of pages deferred
// only to spare a neighbour (PutMode::kDeferIdle): those stay at SCHED_IDLE,
// their raw size charged to their own VM (idle_only_batches).
//
// Pages of a VM that shows no reuse (expects_no_reuse) are left raw
// unread: compressing what will not be read back is the work the 2011
// report asked to avoid, and on a saturated host even the batch's copy at
// normal priority comes out of a VM's CPU.
//
// Counters: pages compressed in the background, kept raw (poorly
// compressible), skipped for no reuse, stale tickets, no room; CPU by priority
// class; the time from put to compressed (a histogram); the queue's own
// (length, overflows, pages gone before their turn by cause).
//
// Threads: Start/Stop from one thread; Stats from any.
#ifndef TMEMD_BACKEND_COMPACTOR_H_
#define TMEMD_BACKEND_COMPACTOR_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "backend/clock.h"
#include "backend/compaction_queue.h"
#include "backend/thread_priority.h"
#include "backend/tmem_store.h"

namespace tmem {

struct CompactorOptions {
  int threads = 1;            // 1 .. 64
  int batch_pages = 16;       // 1 .. 256: tickets per pop
  bool idle_priority = true;  // false: never SCHED_IDLE (budget mode always)
  // Optional hooks (empty: memory never tight / unlimited budget / no
  // charging). Called from the compactor threads at normal priority.
  std::function<bool()> memory_tight;
  std::function<double()> cpu_budget_cores;  // CPU for compaction, in cores
  std::function<void(VmId, int64_t)> charge_cpu;  // nanoseconds, per VM
  // A VM whose pages are not expected back (the valve throttled it for no
  // reuse, or its guest stands aside): its queued pages are left raw
  // unread (skipped_no_reuse), no copy and no LZ4 spent on them. They are
  // the first the store evicts anyway. Persistent (swap) pages are never
  // skipped: they always come back, and the store never evicts them.
  std::function<bool(VmId)> expects_no_reuse;
  // Told once about the first priority failure (the caller logs it).
  std::function<void(const absl::Status&)> on_priority_error;
};

// Put-to-compressed latency buckets: upper bounds in milliseconds; the last
// bucket takes everything slower.
inline constexpr std::array<int64_t, 7> kCompactLatencyBoundsMs = {
    1, 10, 100, 1000, 2000, 10000, INT64_MAX};

struct CompactorStats {
  uint64_t compressed = 0;         // raw copies replaced by LZ4 blocks
  uint64_t kept_raw = 0;           // poorly compressible: stayed raw
  uint64_t skipped_no_reuse = 0;   // its VM's pages are not expected back
  uint64_t stale = 0;              // tickets whose page had gone or been re-put
  uint64_t no_room = 0;            // no memory for the block: stayed raw
  uint64_t idle_cpu_ns = 0;        // CPU at SCHED_IDLE (compression)
  uint64_t normal_cpu_ns = 0;      // CPU at normal priority (locks, copies,
                                   // and compression under memory pressure)
  uint64_t pressure_batches = 0;   // batches compressed at normal priority
  uint64_t idle_only_batches = 0;  // memory tight, but every ticket was
                                   // kDeferIdle: compressed at SCHED_IDLE
  uint64_t priority_failures = 0;  // class changes that failed
  bool idle_class_available = false;  // the SCHED_IDLE round trip works
  std::array<uint64_t, kCompactLatencyBoundsMs.size()> latency{};
  uint64_t latency_sum_ns = 0;  // over the pages in `latency`
  CompactionQueueStats queue;
};

class Compactor {
 public:
  static absl::Status ValidateOptions(const CompactorOptions& options);
  // `store` and `queue` must outlive the compactor; `queue` must be the
  // store's StoreOptions::compaction_queue.
  Compactor(TmemStore* store, CompactionQueue* queue, CompactorOptions options);
  ~Compactor();  // Stop()
  Compactor(const Compactor&) = delete;
  Compactor& operator=(const Compactor&) = delete;

  absl::Status Start();
  void Stop();  // idempotent; tickets left in the queue stay raw pages
  CompactorStats Stats() const;
  // Linux thread ids of the compactor threads (for /proc schedstat).
  std::vector<int> ThreadIds() const;

 private:
  void Run(int index);
  // Settles the tickets of VMs that show no reuse as raw; moves the rest
  // to the front and returns how many.
  size_t SkipNoReuse(std::span<CompactionTicket> batch);
  void Compact(std::span<const CompactionTicket> batch, bool pressure);
  bool SetPriority(ThreadPriority priority);
  void RestUnderBudget(int64_t cpu_ns);

  TmemStore* const store_;
  CompactionQueue* const queue_;
  const CompactorOptions options_;
  const Clock* const clock_;           // the store's: tickets carry its time
  std::atomic<bool> use_idle_{false};  // set by Start before the threads run
  std::vector<std::thread> threads_;
  std::unique_ptr<std::atomic<int>[]> tids_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by stop_mu_
  std::atomic<bool> stopping_{false};
  std::atomic<bool> priority_error_reported_{false};

  std::atomic<uint64_t> compressed_{0};
  std::atomic<uint64_t> kept_raw_{0};
  std::atomic<uint64_t> skipped_no_reuse_{0};
  std::atomic<uint64_t> stale_{0};
  std::atomic<uint64_t> no_room_{0};
  std::atomic<uint64_t> idle_cpu_ns_{0};
  std::atomic<uint64_t> normal_cpu_ns_{0};
  std::atomic<uint64_t> pressure_batches_{0};
  std::atomic<uint64_t> idle_only_batches_{0};
  std::atomic<uint64_t> priority_failures_{0};
  std::array<std::atomic<uint64_t>, kCompactLatencyBoundsMs.size()> latency_{};
  std::atomic<uint64_t> latency_sum_ns_{0};
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_COMPACTOR_H_
