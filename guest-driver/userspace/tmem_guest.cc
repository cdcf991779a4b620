#include "guest-driver/userspace/tmem_guest.h"

#include <poll.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

// Entries in flight at once (tmemd's rings hold at most 4096 + 4096) and
// page slots the guest uses; the core caps both by the host's geometry.
constexpr uint32_t kMaxPending = 8192;
constexpr uint32_t kMaxSlots = 8192;
// A Get waiting on the interrupt re-checks the ring at least this often:
// interrupts can be lost (before MSI-X is enabled, across resets).
constexpr uint64_t kWaitSliceNs = 1'000'000;
// Without an interrupt fd, a waiting Get polls this often.
constexpr uint64_t kPollSliceNs = 50'000;

// --- The core's platform (tmem_core_ops) in userspace.

// No lock: a TmemGuest is used by one thread at a time (see the header),
// and the host never touches the core's state.
void OpsLock(void* /*ctx*/, unsigned long* /*flags*/) {}
void OpsUnlock(void* /*ctx*/, unsigned long /*flags*/) {}

uint64_t OpsNowNs(void* /*ctx*/) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

uint64_t OpsCoarseNowNs(void* /*ctx*/) {
  timespec ts{};
  // CLOCK_MONOTONIC_COARSE: steady_clock's clock, read without the TSC.
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u +
         static_cast<uint64_t>(ts.tv_nsec);
}

void OpsDoorbell(void* ctx, uint32_t value) {
  static_cast<GuestDevice*>(ctx)->DoorbellPeer(value >> 16,
                                               static_cast<int>(value & 0xff));
}

// The interrupt is an eventfd: level-triggered, so one raised before the
// poll is not lost and `done` needs no re-check here.
bool OpsWait(void* ctx, bool (* /*done*/)(void*), void* /*arg*/,
             uint64_t timeout_ns) {
  auto* device = static_cast<GuestDevice*>(ctx);
  const int fd = device->interrupt_fd(TMEM_VEC_COMPLETE);
  if (fd < 0) {
    std::this_thread::sleep_for(
        std::chrono::nanoseconds(std::min(timeout_ns, kPollSliceNs)));
    return false;
  }
  const uint64_t ns = std::min(timeout_ns, kWaitSliceNs);
  timespec ts{static_cast<time_t>(ns / 1'000'000'000),
              static_cast<long>(ns % 1'000'000'000)};
  pollfd pfd{fd, POLLIN, 0};
  if (ppoll(&pfd, 1, &ts, nullptr) > 0 && (pfd.revents & POLLIN) != 0) {
    uint64_t count;
    // Clears the eventfd (non-blocking: EAGAIN if someone else did).
    (void)!read(fd, &count, sizeof(count));
  }
  return true;
}

void OpsCopyToSlot(void* /*ctx*/, void* slot, const void* page) {
  auto* dst = static_cast<uint8_t*>(slot);
#if defined(__SSE2__)
  // Streaming stores: the host's worker, on another CPU, read this slot
  // last, so ordinary stores would first pull every line back from its
  // cache; and the guest never reads the slot again. The release that
  // publishes the SQE orders them (sfence below, as streaming stores are
  // weakly ordered).
  auto* d = reinterpret_cast<__m128i*>(dst);
  const auto* s = static_cast<const __m128i*>(page);
  for (size_t i = 0; i < TMEM_PAGE_SIZE / sizeof(__m128i); i += 4) {
    const __m128i a = _mm_loadu_si128(s + i);
    const __m128i b = _mm_loadu_si128(s + i + 1);
    const __m128i c = _mm_loadu_si128(s + i + 2);
    const __m128i e = _mm_loadu_si128(s + i + 3);
    _mm_stream_si128(d + i, a);
    _mm_stream_si128(d + i + 1, b);
    _mm_stream_si128(d + i + 2, c);
    _mm_stream_si128(d + i + 3, e);
  }
  _mm_sfence();
#else
  std::memcpy(dst, page, TMEM_PAGE_SIZE);
#endif
}

void OpsCopyFromSlot(void* /*ctx*/, void* page, const void* slot) {
  std::memcpy(page, slot, TMEM_PAGE_SIZE);
}

// The host compares generations for equality only, so any fresh value
// works; random plus the clock makes a restarted guestsim differ from its
// predecessor.
uint64_t OpsRandomU64(void* /*ctx*/) {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ uint64_t { rd() } ^ OpsNowNs(nullptr);
}

uint64_t Ns(std::chrono::nanoseconds d) {
  return d.count() < 0 ? 0 : static_cast<uint64_t>(d.count());
}

absl::Status RefusalStatus(int32_t status, bool shared) {
  switch (status) {
    case TMEM_CORE_ERR_NO_HANDLE:
      return absl::ResourceExhaustedError(absl::StrCat(
          "a guest has at most ", TMEM_MAX_POOLS, " pools (TMEM_MAX_POOLS)"));
    case TMEM_CORE_ERR_NO_SHARED:
      return absl::FailedPreconditionError(
          "the host does not offer shared pools (TMEM_FEAT_SHARED_POOLS)");
    case TMEM_ERR_PERM:
      return absl::PermissionDeniedError(
          "the host refused the shared pool: this VM is not authorized for "
          "its UUID");
    case TMEM_ERR_NOSPC:
      return absl::ResourceExhaustedError(
          "the host refused a new pool: this VM has too many");
    default:
      return absl::InternalError(absl::StrCat("the host refused NEW_POOL",
                                              shared ? " (shared)" : "",
                                              " with status ", status));
  }
}

}  // namespace

std::vector<std::pair<std::string_view, uint64_t>> CounterList(
    const GuestCounters& c) {
  std::vector<std::pair<std::string_view, uint64_t>> out;
  ForEachCounter(c, [&out](std::string_view name, uint64_t value) {
    out.emplace_back(name, value);
  });
  return out;
}

void AddCounters(GuestCounters* total, const GuestCounters& c) {
  std::vector<uint64_t> values;
  ForEachCounter(
      c, [&values](std::string_view, uint64_t v) { values.push_back(v); });
  size_t i = 0;
  ForEachCounter(
      *total, [&](std::string_view, uint64_t& field) { field += values[i++]; });
}

const tmem_core_ops TmemGuest::kOps = {
    .lock = OpsLock,
    .unlock = OpsUnlock,
    .now_ns = OpsNowNs,
    .coarse_now_ns = OpsCoarseNowNs,
    .doorbell = OpsDoorbell,
    .wait = OpsWait,
    .copy_to_slot = OpsCopyToSlot,
    .copy_from_slot = OpsCopyFromSlot,
    .random_u64 = OpsRandomU64,
};

TmemGuest::TmemGuest(GuestDevice* device, const TmemGuestOptions& options)
    : device_(device), options_(options) {
  config_.get_spin_ns = Ns(options.get_spin);
  config_.get_spin_min_ns = Ns(options.get_spin_min);
  config_.get_timeout_ns = Ns(options.get_timeout);
  config_.pool_create_timeout_ns = Ns(options.pool_create_timeout);
  config_.pool_retry_ns = Ns(options.pool_retry_interval);
  config_.stall_probe_ns = Ns(options.stall_probe_interval);
  config_.ring_full_spin_ns = 0;  // a userspace host is a thread: no spin
  config_.stall_after_timeouts = options.stall_after_timeouts;
  config_.invalidate_reserve = options.invalidate_reserve;
  config_.deferred_invalidates = options.deferred_invalidates;
  config_.doorbell_batch = options.posted_doorbell_batch;
  config_.skip_unsent_gets = options.skip_unsent_gets;
  config_.batch_pages = options.get_batch_pages;
  config_.prefetch_windows = options.prefetch_windows;
  config_.readahead_windows = options.readahead_windows;
  config_.miss_cost_ns = Ns(options.miss_cost);
  config_.aside_sample_gets = options.aside_sample_gets;
  config_.aside_probe_share = options.aside_probe_share;
  config_.aside_unused_evictions = options.aside_unused_evictions;
  config_.ram_pages = options.ram_pages;
  config_.aside_probe_ns = Ns(options.aside_probe_interval);
  tmem_core_init(&core_, &kOps, device, &config_);
  pending_.resize(kMaxPending);
  free_pending_.resize(kMaxPending);
  const uint32_t slots = static_cast<uint32_t>(
      std::min<uint64_t>(device->shm_size() / TMEM_PAGE_SIZE, kMaxSlots));
  free_slots_.resize(slots);
}

absl::StatusOr<std::unique_ptr<TmemGuest>> TmemGuest::Create(
    GuestDevice* device, const TmemGuestOptions& options) {
  if (device == nullptr || device->shm_base() == nullptr) {
    return absl::InvalidArgumentError("TmemGuest needs a mapped device");
  }
  std::unique_ptr<TmemGuest> guest(new TmemGuest(device, options));
  TmemGuest& g = *guest;
  int err = tmem_core_bind(
      &g.core_, device->shm_base(), device->shm_size(), g.pending_.data(),
      g.free_pending_.data(), static_cast<uint32_t>(g.pending_.size()),
      g.free_slots_.data(), static_cast<uint32_t>(g.free_slots_.size()));
  const auto deadline =
      std::chrono::steady_clock::now() + options.attach_timeout;
  // Only "not READY yet" is worth waiting for; a bad header stays bad.
  while (err == -EAGAIN && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    err = tmem_core_try_attach(&g.core_);
  }
  g.SyncCounters();
  if (err == -EPROTO) {
    return absl::FailedPreconditionError(
        "the region is not a tmem ABI v2 region or its layout is impossible "
        "(bad magic or version, header or region size, rings not a power of "
        "two, or rings or slots outside the mapping)");
  }
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat(
        "the host did not publish READY within ",
        options.attach_timeout.count(), " ms (is tmemd serving this VM?)"));
  }
  return guest;
}

void TmemGuest::SyncCounters() const {
  tmem_core_counters k{};
  tmem_core_read_counters(&core_, &k);
  GuestCounters& c = counters_;
  c.puts_sent = k.puts_sent;
  c.puts_skipped_by_hint = k.puts_skipped_by_hint;
  c.puts_dropped_ring_full = k.puts_dropped_ring_full;
  c.puts_dropped_no_pool = k.puts_dropped_no_pool;
  c.puts_dropped_flush_pending = k.puts_dropped_flush_pending;
  c.puts_dropped_by_host = k.puts_dropped_by_host;
  c.gets_hit = k.gets_hit;
  c.gets_miss = k.gets_miss;
  c.gets_timeout = k.gets_timeout;
  c.gets_miss_local = k.gets_miss_local;
  c.gets_skipped_stalled = k.gets_skipped_stalled;
  c.gets_skipped_never_sent = k.gets_skipped_never_sent;
  c.gets_skipped_invalidating = k.gets_skipped_invalidating;
  c.host_stalls = k.host_stalls;
  c.invalidates = k.invalidates;
  c.invalidates_skipped_never_sent = k.invalidates_skipped_never_sent;
  c.invalidates_for_dropped_puts = k.invalidates_for_dropped_puts;
  c.drop_invalidates_avoided = k.drop_invalidates_avoided;
  c.flush_fallbacks = k.flush_fallbacks;
  c.invalidates_deferred = k.invalidates_deferred;
  c.guest_resets = k.guest_resets;
  c.host_resets_seen = k.host_resets_seen;
  c.pools_created = k.pools_created;
  c.pool_create_timeouts = k.pool_create_timeouts;
  c.doorbells = k.doorbells;
  c.doorbells_deferred = k.doorbells_deferred;
  c.interrupt_waits = k.interrupt_waits;
  c.stale_completions = k.stale_completions;
  c.sqes_posted = k.sqes_posted;
  c.completions_reaped = k.completions_reaped;
  c.errors = k.errors;
  c.get_batches = k.get_batches;
  c.gets_not_sequential = k.gets_not_sequential;
  c.prefetch_used = k.prefetch_used;
  c.prefetch_unused = k.prefetch_unused;
  c.gets_negative_cached = k.gets_negative_cached;
  c.readaheads = k.readaheads;
  c.readahead_waits = k.readahead_waits;
  c.readahead_wait_ns = k.readahead_wait_ns;
  c.stood_aside = k.stood_aside;
  c.stood_aside_longest = k.stood_aside_longest;
  c.stood_aside_unused = k.stood_aside_unused;
  c.gets_skipped_aside = k.gets_skipped_aside;
  c.puts_skipped_aside = k.puts_skipped_aside;
  c.puts_refused_unlocked = k.puts_refused_unlocked;
  c.invalidates_skipped_aside = k.invalidates_skipped_aside;
  c.aside_cost_rose = k.aside_cost_rose;
  c.aside_samples_discarded = k.aside_samples_discarded;
}

absl::StatusOr<TmemGuest::PoolHandle> TmemGuest::InitFs() {
  return NewHandle(/*shared=*/false, Uuid{});
}

absl::StatusOr<TmemGuest::PoolHandle> TmemGuest::InitSharedFs(
    const Uuid& uuid) {
  return NewHandle(/*shared=*/true, uuid);
}

absl::StatusOr<TmemGuest::PoolHandle> TmemGuest::NewHandle(bool shared,
                                                           const Uuid& uuid) {
  // Shared pools get no filter: other VMs' puts of a key are invisible.
  std::vector<unsigned long> filter;
  const uint32_t bits = options_.sent_filter_bits;
  if (!shared && bits >= 64 && std::has_single_bit(bits)) {
    filter.assign(bits / (sizeof(unsigned long) * 8), 0);
  }
  unsigned long* old = nullptr;
  const int h = tmem_core_new_handle(&core_, shared, uuid.data(),
                                     filter.empty() ? nullptr : filter.data(),
                                     filter.empty() ? 0 : bits, &old);
  if (h < 0) return RefusalStatus(h, shared);
  // The core now uses `filter`; the handle's previous one (`old`) is freed.
  filters_[h].swap(filter);
  return h;
}

void TmemGuest::Put(PoolHandle pool, const ObjectId& oid, uint64_t index,
                    Page page) {
  tmem_core_put(&core_, pool, oid.data(), index, page.data());
}

bool TmemGuest::Get(PoolHandle pool, const ObjectId& oid, uint64_t index,
                    MutablePage out, uint32_t pages_to_end) {
  return tmem_core_get(&core_, pool, oid.data(), index, pages_to_end,
                       out.data()) != 0;
}

void TmemGuest::InvalidatePage(PoolHandle pool, const ObjectId& oid,
                               uint64_t index) {
  tmem_core_invalidate_page(&core_, pool, oid.data(), index);
}

void TmemGuest::InvalidateObject(PoolHandle pool, const ObjectId& oid) {
  tmem_core_invalidate_object(&core_, pool, oid.data());
}

void TmemGuest::InvalidatePool(PoolHandle pool) {
  tmem_core_invalidate_pool(&core_, pool);
}

void TmemGuest::Poll() { tmem_core_poll(&core_); }

void TmemGuest::SetMeasuredMissCost(std::chrono::nanoseconds per_page) {
  tmem_core_set_miss_cost(
      &core_, static_cast<uint64_t>(std::max<int64_t>(per_page.count(), 0)));
}

void TmemGuest::SetMeasuredRandomMissCost(std::chrono::nanoseconds per_read) {
  tmem_core_set_random_miss_cost(
      &core_, static_cast<uint64_t>(std::max<int64_t>(per_read.count(), 0)));
}

int TmemGuest::host_pool_id(PoolHandle pool) {
  return tmem_core_host_pool_id(&core_, pool);
}

}  // namespace tmem
