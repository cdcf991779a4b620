#include "backend/compactor.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "backend/page_codec.h"

namespace tmem {

namespace {

// How often an idle compactor looks at the queue's length (lock-free).
constexpr auto kPollInterval = std::chrono::milliseconds(10);

int64_t ThreadCpuNanos() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// Whether this process may put a thread at SCHED_IDLE and take it back:
// tried on a throwaway thread, since a thread that cannot leave SCHED_IDLE
// stays there.
absl::Status ProbeIdleRoundTrip() {
  absl::Status result;
  std::thread probe([&result] {
    result = SetCurrentThreadPriority(ThreadPriority::kIdle);
    if (result.ok()) result = SetCurrentThreadPriority(ThreadPriority::kNormal);
  });
  probe.join();
  return result;
}

}  // namespace

absl::Status Compactor::ValidateOptions(const CompactorOptions& options) {
  if (options.threads < 1 || options.threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("compactor threads must be 1..64, got ", options.threads));
  }
  if (options.batch_pages < 1 || options.batch_pages > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compactor batch_pages must be 1..256, got ", options.batch_pages));
  }
  return absl::OkStatus();
}

Compactor::Compactor(TmemStore* store, CompactionQueue* queue,
                     CompactorOptions options)
    : store_(store),
      queue_(queue),
      options_(std::move(options)),
      clock_(store->options().clock != nullptr ? store->options().clock
                                               : SteadyClock::Default()),
      tids_(new std::atomic<int>[64]) {
  for (int i = 0; i < 64; ++i) tids_[i].store(0, std::memory_order_relaxed);
}

Compactor::~Compactor() { Stop(); }

absl::Status Compactor::Start() {
  if (absl::Status s = ValidateOptions(options_); !s.ok()) return s;
  if (!threads_.empty()) {
    return absl::FailedPreconditionError("compactor already started");
  }
  use_idle_.store(false);
  if (options_.idle_priority) {
    absl::Status probe = ProbeIdleRoundTrip();
    if (probe.ok()) {
      use_idle_.store(true);
    } else {
      priority_failures_.fetch_add(1, std::memory_order_relaxed);
      if (!priority_error_reported_.exchange(true) &&
          options_.on_priority_error) {
        options_.on_priority_error(absl::Status(
            probe.code(),
            absl::StrCat("compactor cannot use SCHED_IDLE and leave it again "
                         "(needs CAP_SYS_NICE or RLIMIT_NICE); it compresses "
                         "at normal priority within the CPU budget: ",
                         probe.message())));
      }
    }
  }
  for (int i = 0; i < options_.threads; ++i) {
    threads_.emplace_back([this, i] { Run(i); });
  }
  return absl::OkStatus();
}

void Compactor::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stopping_.store(true, std::memory_order_relaxed);
  stop_cv_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

std::vector<int> Compactor::ThreadIds() const {
  std::vector<int> out;
  for (size_t i = 0; i < threads_.size(); ++i) {
    out.push_back(tids_[i].load(std::memory_order_relaxed));
  }
  return out;
}

bool Compactor::SetPriority(ThreadPriority priority) {
  absl::Status s = SetCurrentThreadPriority(priority);
  if (s.ok()) return true;
  priority_failures_.fetch_add(1, std::memory_order_relaxed);
  if (!priority_error_reported_.exchange(true) && options_.on_priority_error) {
    options_.on_priority_error(s);
  }
  return false;
}

void Compactor::Run(int index) {
  tids_[index].store(static_cast<int>(gettid()), std::memory_order_relaxed);
  // Named, so /proc/PID/task/*/comm finds it (tests read its schedstat).
  pthread_setname_np(pthread_self(), "tmem-compact");
  std::vector<CompactionTicket> batch(options_.batch_pages);
  // Idle between batches: a thread that sleeps and wakes at SCHED_IDLE
  // preempts nobody; one that woke at normal priority would run at once.
  bool idle = use_idle_ && SetPriority(ThreadPriority::kIdle);
  while (!stopping_.load(std::memory_order_relaxed)) {
    if (queue_->length() == 0) {
      if (use_idle_ && !idle) idle = SetPriority(ThreadPriority::kIdle);
      std::unique_lock<std::mutex> lock(stop_mu_);
      stop_cv_.wait_for(lock, kPollInterval, [this] { return stop_; });
      continue;
    }
    // Every lock is taken at normal priority (thread_priority.h).
    if (idle) idle = !SetPriority(ThreadPriority::kNormal);
    const size_t n = SkipNoReuse(
        std::span<CompactionTicket>(batch.data(), queue_->PopBatch(batch)));
    if (n == 0) continue;
    // Pages deferred only to spare a neighbour (PutMode::kDeferIdle) stay
    // at SCHED_IDLE under pressure too: compressing them at normal priority
    // would take back from that neighbour the CPU the deferral gave it.
    const bool idle_only = std::all_of(
        batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(n),
        [](const CompactionTicket& t) { return t.idle_only; });
    const bool tight = options_.memory_tight && options_.memory_tight();
    if (use_idle_ && tight && idle_only) {
      idle_only_batches_.fetch_add(1, std::memory_order_relaxed);
    }
    const bool pressure = !use_idle_ || (tight && !idle_only);
    Compact(std::span<const CompactionTicket>(batch.data(), n), pressure);
  }
}

size_t Compactor::SkipNoReuse(std::span<CompactionTicket> batch) {
  if (!options_.expects_no_reuse) return batch.size();
  size_t kept = 0;
  for (const CompactionTicket& t : batch) {
    if (t.persistent || !options_.expects_no_reuse(t.vm)) {
      batch[kept++] = t;
      continue;
    }
    // Settled as raw (an empty block): the store stops tracking it as
    // pending, exactly as for a page LZ4 could not shrink.
    const DeferredOutcome outcome = store_->CompleteDeferred(t, {});
    if (outcome == DeferredOutcome::kKeptRaw) {
      skipped_no_reuse_.fetch_add(1, std::memory_order_relaxed);
    } else {
      stale_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return kept;
}

void Compactor::Compact(std::span<const CompactionTicket> batch,
                        bool pressure) {
  const size_t n = batch.size();
  // Per thread, reused across batches.
  thread_local std::vector<uint8_t> pages;
  thread_local std::vector<uint8_t> blocks;
  thread_local std::vector<size_t> lengths;
  pages.resize(n * kPageSize);
  blocks.resize(n * kMaxCompressedPage);
  lengths.assign(n, 0);
  std::vector<bool> have(n, false);
  const int64_t cpu_start = ThreadCpuNanos();

  // 1. Copy the pages still pending (normal priority: shard locks).
  for (size_t i = 0; i < n; ++i) {
    have[i] = store_->ReadDeferred(
        batch[i], MutablePage(pages.data() + i * kPageSize, kPageSize));
    if (!have[i]) stale_.fetch_add(1, std::memory_order_relaxed);
  }

  // 2. Compress with no lock held, at SCHED_IDLE unless under pressure.
  const bool idle = !pressure && SetPriority(ThreadPriority::kIdle);
  const int64_t compress_start = ThreadCpuNanos();
  const size_t threshold = store_->options().poor_compression_threshold_bytes;
  for (size_t i = 0; i < n; ++i) {
    if (!have[i]) continue;
    const size_t len =
        CompressPage(ConstPage(pages.data() + i * kPageSize, kPageSize),
                     std::span<uint8_t>(blocks.data() + i * kMaxCompressedPage,
                                        kMaxCompressedPage));
    lengths[i] = len <= threshold ? len : 0;  // 0: keep raw
  }
  const int64_t compress_ns = ThreadCpuNanos() - compress_start;
  if (idle) {
    // Back to normal before any lock. If this fails the thread is stuck at
    // SCHED_IDLE (counted and reported); it still finishes the batch.
    SetPriority(ThreadPriority::kNormal);
  }

  // 3. Swap the blocks in (normal priority: shard and arena locks).
  const int64_t now = clock_->NowNanos();
  size_t compressed_here = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!have[i]) continue;
    const DeferredOutcome outcome = store_->CompleteDeferred(
        batch[i], std::span<const uint8_t>(
                      blocks.data() + i * kMaxCompressedPage, lengths[i]));
    switch (outcome) {
      case DeferredOutcome::kCompressed: {
        compressed_.fetch_add(1, std::memory_order_relaxed);
        ++compressed_here;
        const int64_t waited = std::max<int64_t>(0, now - batch[i].put_nanos);
        latency_sum_ns_.fetch_add(static_cast<uint64_t>(waited),
                                  std::memory_order_relaxed);
        const int64_t ms = waited / 1'000'000;
        size_t b = 0;
        while (ms >= kCompactLatencyBoundsMs[b] &&
               b + 1 < kCompactLatencyBoundsMs.size()) {
          ++b;
        }
        latency_[b].fetch_add(1, std::memory_order_relaxed);
        break;
      }
      case DeferredOutcome::kKeptRaw:
        kept_raw_.fetch_add(1, std::memory_order_relaxed);
        break;
      case DeferredOutcome::kStale:
        stale_.fetch_add(1, std::memory_order_relaxed);
        break;
      case DeferredOutcome::kNoRoom:
        no_room_.fetch_add(1, std::memory_order_relaxed);
        break;
    }
  }
  const int64_t total_ns = ThreadCpuNanos() - cpu_start;
  if (idle) {
    idle_cpu_ns_.fetch_add(static_cast<uint64_t>(compress_ns),
                           std::memory_order_relaxed);
    normal_cpu_ns_.fetch_add(static_cast<uint64_t>(total_ns - compress_ns),
                             std::memory_order_relaxed);
    return;
  }
  normal_cpu_ns_.fetch_add(static_cast<uint64_t>(total_ns),
                           std::memory_order_relaxed);
  if (!pressure) return;  // SCHED_IDLE failed this once: counted above
  pressure_batches_.fetch_add(1, std::memory_order_relaxed);
  // Normal-priority compression is the VMs' CPU: charge it, page by page.
  if (options_.charge_cpu) {
    const size_t pages_done = std::max<size_t>(1, compressed_here);
    const int64_t per_page = total_ns / static_cast<int64_t>(pages_done);
    for (size_t i = 0; i < n; ++i) {
      if (have[i]) options_.charge_cpu(batch[i].vm, per_page);
    }
  }
  RestUnderBudget(total_ns);
}

void Compactor::RestUnderBudget(int64_t cpu_ns) {
  if (!options_.cpu_budget_cores) return;
  const double per_thread =
      options_.cpu_budget_cores() / static_cast<double>(options_.threads);
  if (per_thread >= 1.0) return;
  // At least 1% of a core, so a zero budget still drains slowly.
  const double share = std::max(per_thread, 0.01);
  const auto rest_ns = static_cast<int64_t>(
      std::min(static_cast<double>(cpu_ns) * (1.0 / share - 1.0), 1e9));
  std::unique_lock<std::mutex> lock(stop_mu_);
  stop_cv_.wait_for(lock, std::chrono::nanoseconds(rest_ns),
                    [this] { return stop_; });
}

CompactorStats Compactor::Stats() const {
  CompactorStats s;
  s.compressed = compressed_.load(std::memory_order_relaxed);
  s.kept_raw = kept_raw_.load(std::memory_order_relaxed);
  s.skipped_no_reuse = skipped_no_reuse_.load(std::memory_order_relaxed);
  s.stale = stale_.load(std::memory_order_relaxed);
  s.no_room = no_room_.load(std::memory_order_relaxed);
  s.idle_cpu_ns = idle_cpu_ns_.load(std::memory_order_relaxed);
  s.normal_cpu_ns = normal_cpu_ns_.load(std::memory_order_relaxed);
  s.pressure_batches = pressure_batches_.load(std::memory_order_relaxed);
  s.idle_only_batches = idle_only_batches_.load(std::memory_order_relaxed);
  s.priority_failures = priority_failures_.load(std::memory_order_relaxed);
  s.idle_class_available = use_idle_.load();
  for (size_t i = 0; i < s.latency.size(); ++i) {
    s.latency[i] = latency_[i].load(std::memory_order_relaxed);
  }
  s.latency_sum_ns = latency_sum_ns_.load(std::memory_order_relaxed);
  s.queue = queue_->Stats();
  return s;
}

}  // namespace tmem
