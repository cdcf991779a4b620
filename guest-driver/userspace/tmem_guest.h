// TmemGuest: the cleancache-like guest frontend of tmemd's data plane, in
// userspace: a thin C++ wrapper over the guest protocol core
// (guest-driver/core/) that the kernel module runs too, over a
// GuestDevice (IvshmemClient for a real tmemd, a fake in tests).
//
// Contract (cleancache semantics; ABI in proto/tmem_abi.h):
//  * Put never blocks and may be dropped. Get may wait, at most
//    get_timeout, and a timeout is a miss; after a run of timeouts without
//    host progress (a dead tmemd leaves READY behind) Gets miss at once
//    until the host moves again. Invalidates never block and are never lost.
//  * No stale data: a Get returns a miss or the bytes of the latest Put of
//    that key, honouring every earlier invalidate. In particular a Put that
//    is not sent (admission hint, full ring) still kills the key's older
//    page on the host: an INVAL_PAGE is sent in its place (cleancache's
//    put-put-get coherency: after puts of AAA then BBB, a get never returns
//    AAA, even when BBB was dropped). Unless the key was never sent: each
//    private pool keeps a Bloom filter of the keys sent since the host last
//    held nothing of the pool (no false negatives), so dropping a put of a
//    new key, the streaming case, costs no ring entry at all. Shared pools
//    always invalidate (other VMs may have put the key).
//  * Ring order is op order: the host executes SQEs in order, so an op
//    posted after an invalidate sees it. When even the ring's reserve for
//    invalidates is full, the pool's flush barrier (tmem_abi.h) stands in for
//    the invalidate; until the host acknowledges it, Gets of that pool miss
//    and its Puts are dropped without touching the ring.
//  * Slots: a slot is owned from the op that takes it until that op's CQE is
//    reaped (a Get that timed out keeps its slot until then).
//  * Generations: at every attach the guest writes a fresh, non-zero
//    guest_generation (the host then forgets this VM's pools and pages).
//    When host_state leaves READY or host_generation changes (tmemd reset or
//    restarted), every host pool id is void: Gets miss and Puts drop until
//    the host is READY again, then pools are re-created lazily on next use.
//    Caller handles from InitFs/InitSharedFs stay valid throughout.
//    Why re-creation is safe although the host may still execute entries
//    posted before: every op that names a pool (and uses a slot) is posted
//    after that pool's NEW_POOL completed in the current generation, and the
//    host executes in ring order, so all older entries were already done.
//  * Everything read from shared memory is validated (the core); a host
//    that corrupts its ring indices makes the guest stop using the ring
//    (all ops miss or drop, counted as errors) until the host resets it.
//
// Thread safety: none. One TmemGuest is one guest's frontend and must be
// used by one thread at a time (tmem-guestsim runs one thread per simulated
// guest, each with its own device); wrap it in a mutex to share it.
#ifndef TMEMD_GUEST_DRIVER_USERSPACE_TMEM_GUEST_H_
#define TMEMD_GUEST_DRIVER_USERSPACE_TMEM_GUEST_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "guest-driver/core/tmem_core.h"
#include "guest-driver/userspace/guest_device.h"
#include "proto/tmem_abi.h"

namespace tmem {

struct TmemGuestOptions {
  // A Get first spins reaping the CQ (the host is usually polling and fast),
  // get_spin per page it waits for and at least get_spin_min, then sleeps
  // on the completion interrupt; past get_timeout it is a miss. The kernel
  // module spins at least 80 us (a guest vCPU that sleeps pays an interrupt
  // and its wake-up); here a sleep is a ppoll, so no minimum by default.
  std::chrono::microseconds get_spin{20};
  std::chrono::microseconds get_spin_min{0};
  std::chrono::microseconds get_timeout{50'000};
  // Create() waits this long for the host to publish READY.
  std::chrono::milliseconds attach_timeout{2000};
  // InitFs/InitSharedFs wait this long for NEW_POOL; later, lazily.
  std::chrono::milliseconds pool_create_timeout{1000};
  // After the host refused a NEW_POOL, wait before asking again.
  std::chrono::milliseconds pool_retry_interval{1000};
  // SQ entries only invalidates may use, so a burst of puts cannot push an
  // invalidate onto the (coarse) flush barrier. 0: sq_entries / 8, >= 1.
  uint32_t invalidate_reserve = 0;
  // Page invalidates that find not even the reserve free wait for room,
  // at most this many (<= TMEM_CORE_MAX_DEFERRED_INVALIDATES); beyond
  // that, or with 0, the pool falls back to the flush barrier.
  uint32_t deferred_invalidates = TMEM_CORE_MAX_DEFERRED_INVALIDATES;
  // After this many Gets in a row timed out with the host making no
  // progress (sq_head still), the host is taken as stalled or dead (a
  // killed tmemd leaves host_state READY behind): Gets miss at once instead
  // of each waiting get_timeout, except one probe per stall_probe_interval.
  // Any host progress ends it. 0 disables.
  uint32_t stall_after_timeouts = 3;
  std::chrono::milliseconds stall_probe_interval{1000};
  // Bits of each private pool's sent-keys filter (a power of two; 2^20 is
  // 128 KiB, ~3% false positives after 100k distinct keys). 0 disables it:
  // every dropped put then sends an INVAL_PAGE.
  uint32_t sent_filter_bits = 1u << 20;
  // Gets of keys the filter says were never sent miss at once, without a
  // round trip (false only for tests that need gets to reach the host).
  bool skip_unsent_gets = true;
  // Puts and invalidates (nothing waits on them) wake a sleeping host only
  // once this many entries are posted unrung; the host's timer re-check
  // (tmemd's idle_check_ms) takes fewer, and any waited-on entry (a get, a
  // pool op) rings for everything before it. A guest that puts rarely (a
  // throttled streamer) then costs the host no wake-up per put.
  // 0: min(sq_entries, slots) / 16, >= 1; 1: ring for every entry.
  uint32_t posted_doorbell_batch = 0;
  // Batched gets, when the host offers TMEM_FEAT_GET_BATCH: a Get on a
  // private pool asks for up to get_batch_pages pages of the object from
  // its index on in one round trip, into one of prefetch_windows windows of
  // slots; later Gets of those pages are served from there (or answered as
  // misses) without a round trip. 0 or 1: plain gets.
  uint32_t get_batch_pages = TMEM_GET_BATCH_MAX;
  uint32_t prefetch_windows = 8;
  // A Get served from a full window asks for the object's next
  // readahead_windows windows at once, without waiting (0: off).
  uint32_t readahead_windows = 2;
  // Never slower (the kernel module's miss_cost_ns, default 18 us): over
  // every aside_sample_gets Gets served by the host or a prefetch window,
  // the time spent in them is compared with what the pages served would
  // have cost on a miss (miss_cost each). When tmem costs more, the guest
  // stands aside (invalidates its private pools, sets
  // TMEM_GUEST_STANDING_ASIDE, then sends no puts, gets or private-pool
  // invalidates) for aside_probe_interval, doubling up to 64x while it
  // keeps not paying, then resumes and measures again; 64x at once when
  // even a hit for every get and every put would not pay (a miss that
  // comes to cost twice as much ends the wait). 0: never.
  std::chrono::nanoseconds miss_cost{0};
  uint32_t aside_sample_gets = 1024;
  // Resumed after standing aside, puts go out for this share of the blocks
  // (of TMEM_ADMIT_ALL) until a sample says tmem pays.
  uint32_t aside_probe_share = TMEM_ADMIT_ALL / 8;
  std::chrono::milliseconds aside_probe_interval{1000};
  // Sampled for nothing (the kernel module's aside_unused_evictions): while
  // the host admits less than aside_probe_share of the puts, this many
  // evictions with no Get of a page the host may hold make the guest stand
  // aside as above (aside_probe_interval, doubling up to 8x), whatever
  // miss_cost says. 0: never.
  uint64_t aside_unused_evictions = 8192;
  // The guest's RAM in pages, told to the host (guest_ram_pages): it judges
  // this VM's reuse only after about twice that many evictions. 0: unsaid.
  uint64_t ram_pages = 0;
};

// Every counter has one meaning; see the comments for which add up.
struct GuestCounters {
  // Every Put() lands in exactly one of these five.
  uint64_t puts_sent = 0;
  uint64_t puts_skipped_by_hint = 0;        // admission hint said no
  uint64_t puts_dropped_ring_full = 0;      // no slot / SQ entry after a reap
  uint64_t puts_dropped_no_pool = 0;        // channel down, pool (re)creating
  uint64_t puts_dropped_flush_pending = 0;  // pool's flush barrier pending
  // Of puts_sent: the host completed them with TMEM_ERR_DROPPED.
  uint64_t puts_dropped_by_host = 0;
  // gets_hit + gets_miss = Get() calls.
  uint64_t gets_hit = 0;
  uint64_t gets_miss = 0;
  uint64_t gets_timeout = 0;          // of gets_miss: no CQE within get_timeout
  uint64_t gets_miss_local = 0;       // of gets_miss: decided without the host
  uint64_t gets_skipped_stalled = 0;  // of gets_miss_local: host stalled
  // Of gets_miss_local: the sent-keys filter says this key was never put.
  uint64_t gets_skipped_never_sent = 0;
  // Of gets_miss_local: the key's INVAL_PAGE still waits for ring room.
  uint64_t gets_skipped_invalidating = 0;
  uint64_t host_stalls = 0;  // times Gets timed out into the stalled state
  uint64_t invalidates = 0;  // Invalidate*() calls
  // Of invalidates: the filter says nothing of the key was ever sent.
  uint64_t invalidates_skipped_never_sent = 0;
  uint64_t invalidates_for_dropped_puts = 0;  // INVAL_PAGE for unsent puts
  // Unsent puts of keys the filter says were never sent: nothing to kill.
  uint64_t drop_invalidates_avoided = 0;
  uint64_t flush_fallbacks = 0;       // flush barriers requested (ring full)
  uint64_t invalidates_deferred = 0;  // INVAL_PAGEs that waited for room
  uint64_t guest_resets = 0;      // guest_generation bumped to void all pools
  uint64_t host_resets_seen = 0;  // host left READY or changed generation
  uint64_t pools_created = 0;     // NEW_POOL successes, re-creations too
  // InitFs/InitSharedFs stopped waiting for NEW_POOL (pool_create_timeout):
  // the handle works, its pool is made by the late CQE or on first use.
  uint64_t pool_create_timeouts = 0;
  uint64_t doorbells = 0;
  // Puts and invalidates posted to a sleeping host without a doorbell
  // (posted_doorbell_batch): the host's timer or a later doorbell takes them.
  uint64_t doorbells_deferred = 0;
  uint64_t interrupt_waits = 0;    // a Get slept on the interrupt fd
  uint64_t stale_completions = 0;  // CQEs of entries from before a reset
  // Every SQE published to the host, and every CQE matched to one of them:
  // the host processed at least completions_reaped and at most sqes_posted
  // of this guest's entries, whatever the load (tests derive volume checks
  // from these instead of guessing what a fast machine reaches).
  uint64_t sqes_posted = 0;
  uint64_t completions_reaped = 0;
  uint64_t errors = 0;  // host error CQEs, corrupt indices, bad handles
  // Batched gets.
  uint64_t get_batches = 0;  // GET_BATCH entries sent
  // Plain GETs because the get did not follow the last one (random
  // access): batches are for sequential reads only.
  uint64_t gets_not_sequential = 0;
  uint64_t prefetch_used = 0;    // of gets_hit: served from a window
  uint64_t prefetch_unused = 0;  // prefetched pages dropped unread
  // Of gets_miss_local: a batch said the host had no such page.
  uint64_t gets_negative_cached = 0;
  uint64_t readaheads = 0;         // of get_batches: asked ahead, no waiter
  uint64_t readahead_waits = 0;    // Gets that waited for a window filling
  uint64_t readahead_wait_ns = 0;  // time in those waits
  // Standing aside (TmemGuestOptions::miss_cost).
  uint64_t stood_aside = 0;                // times the guest stood aside
  uint64_t stood_aside_longest = 0;        // of those: no hit ratio would pay
  uint64_t stood_aside_unused = 0;         // of those: sampled for nothing
  uint64_t gets_skipped_aside = 0;         // of gets_miss_local
  uint64_t puts_skipped_aside = 0;         // of puts_skipped_by_hint
  uint64_t puts_refused_unlocked = 0;      // of puts_skipped_by_hint, no lock
  uint64_t invalidates_skipped_aside = 0;  // private pools hold nothing
  uint64_t aside_samples_discarded = 0;    // under a hint, or stale
  uint64_t aside_cost_rose = 0;  // resumed early: a miss costs 2x more
};

// Calls fn(name, field) for every counter in declaration order; `c` may be
// const. The one list of names, so reports and sums never miss a counter.
template <typename Counters, typename Fn>
void ForEachCounter(Counters& c, Fn&& fn) {
  fn("puts_sent", c.puts_sent);
  fn("puts_skipped_by_hint", c.puts_skipped_by_hint);
  fn("puts_dropped_ring_full", c.puts_dropped_ring_full);
  fn("puts_dropped_no_pool", c.puts_dropped_no_pool);
  fn("puts_dropped_flush_pending", c.puts_dropped_flush_pending);
  fn("puts_dropped_by_host", c.puts_dropped_by_host);
  fn("gets_hit", c.gets_hit);
  fn("gets_miss", c.gets_miss);
  fn("gets_timeout", c.gets_timeout);
  fn("gets_miss_local", c.gets_miss_local);
  fn("gets_skipped_never_sent", c.gets_skipped_never_sent);
  fn("gets_skipped_stalled", c.gets_skipped_stalled);
  fn("gets_skipped_invalidating", c.gets_skipped_invalidating);
  fn("host_stalls", c.host_stalls);
  fn("invalidates", c.invalidates);
  fn("invalidates_skipped_never_sent", c.invalidates_skipped_never_sent);
  fn("invalidates_for_dropped_puts", c.invalidates_for_dropped_puts);
  fn("drop_invalidates_avoided", c.drop_invalidates_avoided);
  fn("flush_fallbacks", c.flush_fallbacks);
  fn("invalidates_deferred", c.invalidates_deferred);
  fn("guest_resets", c.guest_resets);
  fn("host_resets_seen", c.host_resets_seen);
  fn("pools_created", c.pools_created);
  fn("pool_create_timeouts", c.pool_create_timeouts);
  fn("doorbells", c.doorbells);
  fn("doorbells_deferred", c.doorbells_deferred);
  fn("interrupt_waits", c.interrupt_waits);
  fn("stale_completions", c.stale_completions);
  fn("sqes_posted", c.sqes_posted);
  fn("completions_reaped", c.completions_reaped);
  fn("errors", c.errors);
  fn("get_batches", c.get_batches);
  fn("gets_not_sequential", c.gets_not_sequential);
  fn("prefetch_used", c.prefetch_used);
  fn("prefetch_unused", c.prefetch_unused);
  fn("gets_negative_cached", c.gets_negative_cached);
  fn("readaheads", c.readaheads);
  fn("readahead_waits", c.readahead_waits);
  fn("readahead_wait_ns", c.readahead_wait_ns);
  fn("stood_aside", c.stood_aside);
  fn("stood_aside_longest", c.stood_aside_longest);
  fn("stood_aside_unused", c.stood_aside_unused);
  fn("gets_skipped_aside", c.gets_skipped_aside);
  fn("puts_skipped_aside", c.puts_skipped_aside);
  fn("puts_refused_unlocked", c.puts_refused_unlocked);
  fn("invalidates_skipped_aside", c.invalidates_skipped_aside);
  fn("aside_samples_discarded", c.aside_samples_discarded);
  fn("aside_cost_rose", c.aside_cost_rose);
}

// (name, value) pairs in declaration order, for reports.
std::vector<std::pair<std::string_view, uint64_t>> CounterList(
    const GuestCounters& c);
// total += c, field by field.
void AddCounters(GuestCounters* total, const GuestCounters& c);

class TmemGuest {
 public:
  using PoolHandle = int;
  using ObjectId = std::array<uint32_t, TMEM_OBJECT_WORDS>;  // filekey
  using Uuid = std::array<uint8_t, 16>;
  using Page = std::span<const uint8_t, TMEM_PAGE_SIZE>;
  using MutablePage = std::span<uint8_t, TMEM_PAGE_SIZE>;

  // Attaches to the region behind `device` (which must outlive the guest):
  // waits up to attach_timeout for READY. FAILED_PRECONDITION for a region
  // that is not tmem ABI v1 or has an impossible layout, UNAVAILABLE if the
  // host never became READY.
  static absl::StatusOr<std::unique_ptr<TmemGuest>> Create(
      GuestDevice* device, const TmemGuestOptions& options = {});
  TmemGuest(const TmemGuest&) = delete;
  TmemGuest& operator=(const TmemGuest&) = delete;

  // cleancache's init_fs / init_shared_fs: a handle valid for the guest's
  // lifetime. Waits up to pool_create_timeout for the host's pool; if the
  // channel is down or slow the handle is still returned and the pool made
  // on first use. An explicit refusal by the host is an error
  // (PERMISSION_DENIED: shared pool not authorized; RESOURCE_EXHAUSTED: too
  // many pools; FAILED_PRECONDITION: no shared pools offered), as is running
  // out of handles (TMEM_MAX_POOLS).
  absl::StatusOr<PoolHandle> InitFs();
  absl::StatusOr<PoolHandle> InitSharedFs(const Uuid& uuid);

  // Never blocks. The page is copied before Put returns.
  void Put(PoolHandle pool, const ObjectId& oid, uint64_t index, Page page);
  // true: hit, `out` holds the page (a private pool forgets it). false:
  // miss, `out` unspecified. pages_to_end: pages the object has from index
  // on (the file's end; 0: unknown), bounding a batched get.
  bool Get(PoolHandle pool, const ObjectId& oid, uint64_t index,
           MutablePage out, uint32_t pages_to_end = 0);
  // Never block, never lost.
  void InvalidatePage(PoolHandle pool, const ObjectId& oid, uint64_t index);
  void InvalidateObject(PoolHandle pool, const ObjectId& oid);
  void InvalidatePool(PoolHandle pool);
  // Reaps completions and notices resets; for callers that go idle.
  void Poll();
  // What a miss costs per page as measured now (the kernel module takes it
  // from the block device): replaces TmemGuestOptions::miss_cost, and a
  // rise to twice what it was when the guest stood aside ends the wait.
  void SetMeasuredMissCost(std::chrono::nanoseconds per_page);
  // The same for small random reads, per read: plain Gets are weighed
  // against it (tmem_core_set_random_miss_cost).
  void SetMeasuredRandomMissCost(std::chrono::nanoseconds per_read);

  // The core's counters as of now. Read on demand, not after every call:
  // a copy per Get and Put was a measurable share of a streaming guest's
  // CPU per page. A reference held across later calls is stale
  // until counters() is called again.
  const GuestCounters& counters() const {
    SyncCounters();
    return counters_;
  }
  // For tests and reports.
  bool attached() const { return core_.attached && !core_.broken; }
  uint64_t guest_generation() const { return core_.guest_generation; }
  uint64_t host_generation() const { return core_.host_generation; }
  uint32_t free_slots() const { return core_.nfree_slots; }
  uint32_t slots_usable() const { return core_.slots_usable; }
  uint32_t in_flight() const { return core_.pending_cap - core_.nfree_pending; }
  uint32_t invalidate_reserve() const { return core_.reserve; }
  uint32_t prefetch_windows() const { return core_.nwin; }
  bool standing_aside() const { return core_.aside; }
  // The last sample's guest time per page served (see miss_cost).
  uint64_t get_ns_per_hit() const { return core_.get_ns_per_hit; }
  // Time in Get() and Put(), as the core times them (not the calls it
  // decides before reading the clock).
  uint64_t get_ns() const { return core_.c.get_ns; }
  uint64_t put_ns() const { return core_.c.put_ns; }
  bool flush_pending() const {
    return (core_.flush_bits | core_.wanted_bits) != 0;
  }
  // The host pool id behind a handle, or -1 while it has none.
  int host_pool_id(PoolHandle pool);

 private:
  TmemGuest(GuestDevice* device, const TmemGuestOptions& options);
  absl::StatusOr<PoolHandle> NewHandle(bool shared, const Uuid& uuid);
  // Copies the core's counters into counters_ (by counters()).
  void SyncCounters() const;

  static const tmem_core_ops kOps;

  GuestDevice* device_;
  TmemGuestOptions options_;
  tmem_core_config config_{};
  tmem_core core_{};
  mutable GuestCounters counters_;
  // Tables the core works in (it allocates nothing).
  std::vector<tmem_core_pending> pending_;
  std::vector<uint32_t> free_pending_;
  std::vector<uint32_t> free_slots_;
  // Each handle's sent-keys filter (private pools), owned here.
  std::array<std::vector<unsigned long>, TMEM_MAX_POOLS> filters_;
};

}  // namespace tmem

#endif  // TMEMD_GUEST_DRIVER_USERSPACE_TMEM_GUEST_H_
