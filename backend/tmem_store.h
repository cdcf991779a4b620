// TmemStore: the host-side transcendent-memory store. No I/O.
//
// Semantics (cleancache's, Linux 5.10):
//  * A VM registers, then creates pools: private, or shared by filesystem UUID
//    among VMs the operator authorized for that UUID.
//  * Put stores a 4096-byte page under (pool, object, index), replacing any
//    earlier page of that key. A put that is refused for any reason still
//    removes the earlier page, so a later get can never return stale bytes.
//  * Get copies the page out. In a private pool a hit is exclusive (the page
//    is removed); in a shared pool it stays.
//  * Invalidate page/object/pool remove pages; DestroyPool removes the pool
//    (a shared pool's pages go when its last member leaves); ForgetVm removes
//    the VM, its pools and every page it put anywhere.
//  * Coherency: every op on a key is linearizable; a get returns a miss or the
//    bytes of the latest put of that key, honouring every earlier invalidate.
//  * Ephemeral: any page may disappear at any time (eviction).
//
// Persistent pools (PoolKind::kPersistent; frontswap's semantics, a swap
// device's store), private only:
//  * A stored page stays until its key is put again or invalidated: nothing
//    evicts it (not a put at the cap or at quota, not a lowered cap or
//    quota, not the compactor's room-finding, not slab emptying). Its pages
//    are kept off the per-VM LRU lists eviction walks (ShardTable's pinned
//    lists), so no eviction step meets them or spends work on them.
//  * Get and GetRun are not exclusive: the page stays after a hit.
//  * A put that lacks room evicts ephemeral pages exactly as an ephemeral
//    put does (the VM's own at quota, the fair-share victim's at the cap);
//    if that finds none it is refused (quota / no_memory, and
//    persistent_puts_refused_for_room): the caller keeps the page elsewhere
//    (the swap backing's spill image). As in any pool, a refused put still
//    removes the earlier page of its key, so the caller's copy is the only
//    one and a get can never return the older bytes.
//  * Invalidate page/object/pool free the pages and their charge at once
//    (DISCARD and WRITE_ZEROES of the device); a never-written key misses.
//  * Zero and same-filled pages cost metadata only, as everywhere.
//  * Charged exactly like ephemeral pages: quota, weight and fair share,
//    the cap. A VM whose persistent pages alone exceed its (lowered) quota,
//    or a host whose persistent pages alone exceed its (lowered) cap, keeps
//    them: the store is over until they are invalidated, every new put
//    lacking room is refused, and the excess is visible
//    (persistent_pages_held / persistent_charged_bytes per VM and pool,
//    HostStats::persistent_*). Eviction victims are the VMs holding
//    ephemeral pages, furthest over their weighted fair share first (their
//    persistent charge counts toward how far over they are).
//  * Swap quota (VmPolicy::swap_quota_bytes, within quota_bytes): a cap on
//    the VM's persistent charge (persistent_charged_bytes). A persistent put
//    that would take it past the cap is refused (quota, and
//    persistent_puts_refused_for_swap_quota, not ..._for_room) and evicts
//    nothing: evicting ephemeral pages cannot make room in it. The page's
//    charge is reserved against it before anything else (add then check,
//    given back on every path that does not store it), so concurrent puts
//    of one VM never take it over together. A lowered swap quota keeps the
//    pages held (they are never evicted): the persistent charge shows over
//    it and new persistent puts are refused until invalidates bring it
//    under. Ephemeral pages are neither limited by it nor count toward it.
//  * Deferred compression works as for ephemeral pages (the page is
//    re-charged at its compressed size, the persistent charge with it); a
//    block with no room leaves the page raw, never dropped.
//
// Memory: every byte taken from the OS (blob slabs and their descriptors,
// page entries, hash indexes, object tables, free lists) is charged to one
// budget whose limit is the host cap, and charged before it is taken: a
// container grows only after the budget accepted its new size (while its old
// size is still charged, so the moment of a resize, when both exist, is
// covered). So the cap holds at every moment with zero slack for what the
// store allocates. Not counted: the allocator's own per-allocation headers
// (a few dozen allocations per shard, not per page), the fixed per-VM and
// per-pool descriptors, and the blob arena's 64 size-class heads. Lowering
// the cap below what is held evicts back under it. An empty shard returns its
// entry chunks and tables beyond the first chunk, and up to 8 empty slabs are
// kept (charged) for reuse.
//
// Quotas: a VM is charged what its pages really cost, all-in
// (page_charge.h): per page its blob's slot and slab-tail share plus
// kPageEntryCharge, plus kObjectCharge for each object and
// kPoolInShardCharge for each (pool, shard) its pages brought in. A put
// reserves the most a page can cost (blob + kMaxPageMetadataCharge) and keeps
// what it used. A put that would take the VM over its quota first evicts the
// VM's own least recently used (ephemeral) pages; a page that cannot fit even
// in an empty quota is refused (quota). In a shared pool, when the page paying
// for its object or pool slot goes, another page of that pool (possibly another
// VM's) takes the charge over: that VM may then be over its quota by that
// charge (at most kObjectCharge + kPoolInShardCharge) until its next put.
//
// Eviction when the host is full: from the VM with the largest
// charged/weight (furthest over its weighted fair share), least recently used
// first within a shard, shards taken round robin.
//
// Bounded work: every put and get does at most a fixed amount of work
// (HostStats::max_op_work counts it), whatever the store holds. A put that
// lacks room evicts for it in steps, each of which evicts at least one page:
//  * a slot of its size class: a page of that class within 32 of a shard's
//    LRU tail of the VM furthest over its weighted fair share, while one is
//    found (at most max_evictions_per_put);
//  * a table's entry: up to 4 pages of the put's own shard;
//  * budget bytes (a fresh slab, a table's growth, a lowered cap), at most
//    8 rounds: the slab with the fewest live blobs among those whose every
//    blob was seen in a sample of at most 8192 pages near the LRU tails of
//    VMs over (or within a slab of) their fair share; if the VM furthest
//    over holds blobs and no such slab exists, any VM's; otherwise a batch
//    of up to 512 LRU pages of the VM furthest over, from one shard.
// Removals give entry and object-node chunks back as they free them
// (ShardTable::Compact: at most 1.25 chunks of each stay free per shard), so
// evicting metadata-only pages (zero and same-filled) frees budget bytes at
// once, not only when a whole shard empties. A put whose steps found no room
// is refused for memory (no_memory; HostStats::puts_refused_at_work_bound);
// the pages it evicted stay evicted, so the room they freed serves the next
// put. Operator calls (SetMemoryCap, SetVmPolicy) evict all the way down.
// Persistent pages are kept off the per-VM LRU lists the eviction steps
// walk, and a VM holding none but persistent pages is never a victim, so
// they add no work to any step.
//
// Host overhead: memory_used_bytes = what live VMs are charged
// (HostStats::vm_charged_bytes) + the host's own overhead
// (host_overhead_bytes), which is at most slab slack (slab_bytes -
// blob_slot_bytes: free slots of partly used slabs and cached empty slabs)
// plus kShardOverheadBytes per shard. VM charges count index slots at their
// worst load, so the sum of charges may exceed what is used by a little;
// host_overhead_bytes is then 0.
//
// Deferred compression (PutMode::kDefer, with a compaction_queue): the put
// stores the page raw, marks it pending with its put's stamp and queues a
// ticket. The compactor copies the raw bytes (ReadDeferred), compresses with
// no lock held, and swaps the block in (CompleteDeferred) only if, under the
// shard lock, the key still holds that same put's pending raw page; then it
// re-charges the page at its new size (quota, fair share and cap all see the
// smaller charge at once) and frees the raw blob. A page removed before its
// turn leaves the pending set at removal, counted by cause
// (CompactionQueue::CountSkipped). So a get, invalidate, eviction or re-put
// concurrent with compaction sees either the raw page or the compressed one,
// both exact, never a missing or older page. Not charged to the cap: each
// shard's pending set (at most the queue's capacity of entries in all, plus
// pages of shared pools whose putter left the pool).
//
// Threads: every method is thread-safe. Put/Get/Invalidate* of different VMs
// run in parallel: they take the VM's op lock shared, then one shard lock.
// Compression and the copy into a blob slot run with no lock held.
//
// Lock order: a thread takes a lock only after every lock it holds that
// comes earlier in this list, never one that comes later:
//   1. VM registry lock (names, slots, id generations, VM structs, retired
//      counters): AddVm, FindVm, ListVms, GetHostStats, ForgetVm's end.
//   2. one VM's op lock: shared for page ops, policy calls and GetVmStats;
//      exclusive for NewPool, DestroyPool, ForgetVm, and AddVm resetting a
//      reused VM struct (the one place 1 is held while 2 is taken). Never
//      two VMs' op locks at once.
//   3. pool registry lock (pools, shared pools, authorizations): NewPool,
//      DestroyPool and ForgetVm under the op lock; (Revoke)Authorize alone.
//   4. one shard lock (never two at once; eviction takes one at a time with
//      none held by the evicting thread, except in-shard eviction of a put).
//   5. a blob size-class lock, then 6. the SlabPool lock.
//   (The compaction queue's lock is a leaf taken under a shard lock.)
// ForgetVm therefore drops the VM's op lock before it takes the registry
// lock to retire the VM's counters, name and slot. 1 and 3 carry
// ABSL_ACQUIRED_BEFORE/AFTER; the op and shard locks are per-object, which
// clang's annotations cannot order, so TSan's lock-order checking of the
// store tests is what proves them.
//
// VM ids: (slot, 16-bit generation); a slot retires at generation 65535, so
// no id is issued twice (4096 x 65535 adds before RESOURCE_EXHAUSTED). A
// forgotten VM's struct is reused by its slot's next VM, so VM churn does
// not grow memory (HostStats::vm_structs stays at the most VMs ever held at
// once). Every call with an id that names no live VM is NOT_FOUND and
// counted (HostStats::unknown_vm_ids_refused); policy calls check the id
// under the VM's op lock, so none reaches a later VM of the same slot.
#ifndef TMEMD_BACKEND_TMEM_STORE_H_
#define TMEMD_BACKEND_TMEM_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/clock.h"
#include "backend/eviction_listener.h"
#include "backend/page_charge.h"
#include "backend/page_codec.h"
#include "backend/stats.h"
#include "backend/types.h"

namespace tmem {

inline constexpr int kMaxVms = 4096;
inline constexpr int kMaxPoolsPerVm = 1024;

enum class PoorCompressionAction : uint8_t { kStoreRaw, kRefuse };

class CompactionQueue;
struct CompactionTicket;

struct StoreOptions {
  uint64_t memory_cap_bytes = uint64_t{1} << 30;
  // Virtual address space reserved for blobs; bounds later cap raises.
  // 0: the machine's physical memory.
  uint64_t address_space_bytes = 0;
  int num_shards = 64;
  // An LZ4 block larger than this is "poorly compressible" (zswap's idea of
  // a page not worth compressing). 3584 = 7/8 of a page.
  size_t poor_compression_threshold_bytes = 3584;
  PoorCompressionAction poor_compression_action =
      PoorCompressionAction::kStoreRaw;
  // Evictions a put chooses for a slot of its size class (see "Bounded
  // work" above).
  int max_evictions_per_put = 256;
  const Clock* clock = nullptr;  // nullptr: SteadyClock::Default()
  EvictionListener* eviction_listener = nullptr;  // optional; must outlive
  // Where PutMode::kDefer and kDeferIdle puts queue their pages (optional;
  // must outlive). nullptr: they compress in the put, like kCompress.
  CompactionQueue* compaction_queue = nullptr;
};

// What CompleteDeferred did with a ticket.
enum class DeferredOutcome : uint8_t {
  kCompressed,  // the raw copy was replaced by the compressed block
  kKeptRaw,     // no block given (poorly compressible): page stays raw
  kStale,       // the ticket's page is gone or was re-put: nothing done
  kNoRoom,      // no memory for the block even after evicting: stays raw
};

struct PutResult {
  bool stored = false;
  StorageKind kind = StorageKind::kRaw;         // valid when stored
  RefuseReason reason = RefuseReason::kPolicy;  // valid when !stored
  uint32_t evicted = 0;   // pages this put evicted (any VM)
  bool deferred = false;  // stored raw and queued for the compactor
};

struct PoolStats {
  PoolId id = -1;
  bool shared = false;
  PoolKind kind = PoolKind::kEphemeral;
  PoolUuid uuid;
  CounterValues counters{};
};

struct VmStats {
  VmId id = 0;
  std::string name;
  VmPolicy policy;  // the store's fields; mode and swap_mode are the valve's
  CounterValues counters{};
  std::vector<PoolStats> pools;
  // Pages held in the VM's persistent pools and what they are charged
  // (also in counters; they never shrink by eviction).
  uint64_t persistent_pages = 0;
  uint64_t persistent_bytes = 0;
};

// How much of a VM's persistent (swap) charge is more than it may hold now,
// by the limit that asks for it (each at most the VM's persistent charge;
// the owner moves pages out until `bytes` is 0). See
// TmemStore::PersistentExcessBytes.
struct PersistentExcess {
  uint64_t bytes = 0;             // the largest of the three below
  uint64_t over_quota = 0;        // charged beyond quota_bytes
  uint64_t over_swap_quota = 0;   // persistent charge beyond swap_quota_bytes
  uint64_t host_cap_share = 0;    // this VM's part of the host's excess
  uint64_t persistent_bytes = 0;  // the VM's persistent charge now
};

struct HostStats {
  uint64_t memory_cap_bytes = 0;
  uint64_t memory_used_bytes = 0;  // everything charged to the budget
  uint64_t slab_bytes = 0;         // of which: blob slabs
  uint64_t metadata_bytes = 0;     // of which: entries, indexes, tables
  uint64_t blob_slot_bytes = 0;    // slot bytes of live blobs (<= slab_bytes;
                                   // the gap is slab fragmentation)
  uint64_t vms = 0;
  // VM structs allocated: one per slot ever used, reused by later VMs.
  uint64_t vm_structs = 0;
  // Calls refused because their VM id names no live VM (never added,
  // forgotten, or a stale handle of a slot's earlier VM).
  uint64_t unknown_vm_ids_refused = 0;
  // Object nodes looked at by pool-wide removals (invalidate pool, destroy
  // pool): grows with the pools' own objects only, never with other VMs'.
  uint64_t pool_scan_objects_visited = 0;
  // Slabs emptied whole to free budget bytes, and the pages walked to
  // choose and empty them ("Eviction when the host is full").
  uint64_t slabs_emptied_for_room = 0;
  uint64_t slab_choice_pages_walked = 0;
  // The most work one put or get did ("Bounded work"): entries, nodes and
  // slab candidates visited, pages evicted, entries re-homed.
  uint64_t max_op_work = 0;
  // Entry and object chunks given back after removals, and the entries,
  // nodes and re-indexed pages their compaction moved.
  uint64_t metadata_chunks_released = 0;
  uint64_t metadata_entries_moved = 0;
  // Puts refused for memory because their bounded eviction found no room.
  uint64_t puts_refused_at_work_bound = 0;
  // What live VMs are charged (their quotas' measure), and the rest of
  // memory_used_bytes: the host's own overhead, charged to no VM (see
  // "Host overhead" above).
  uint64_t vm_charged_bytes = 0;
  uint64_t host_overhead_bytes = 0;
  // Pages held in persistent pools by live VMs, what they are charged (of
  // vm_charged_bytes), and persistent puts refused for room since start:
  // persistent pages are never evicted, so a cap they alone exceed stays
  // exceeded (memory_used_bytes > memory_cap_bytes) until they go.
  uint64_t persistent_pages = 0;
  uint64_t persistent_bytes = 0;
  uint64_t persistent_puts_refused_for_room = 0;
  // Persistent puts refused at their VM's swap quota since start.
  uint64_t persistent_puts_refused_for_swap_quota = 0;
  int64_t uptime_nanos = 0;
  CounterValues counters{};  // sum over VMs, including forgotten ones
};

class TmemStore {
 public:
  // Host overhead per shard beyond slab slack (HostStats::
  // host_overhead_bytes): up to 1.25 chunks of free entries and object
  // nodes plus the partly used chunk of each (ShardTable::Compact), and the
  // shard's small tables (indexes of up to 255 slots, the pool-head map,
  // the per-VM LRU and pinned-list heads: 8 bytes per VM slot each, the
  // pinned ones only up to the highest slot of a VM with persistent pages
  // in the shard).
  static constexpr uint64_t kShardOverheadBytes =
      2ull * 256 * (kPageEntryBytes + kObjectNodeBytes) + 16ull * 1024;

  static absl::StatusOr<std::unique_ptr<TmemStore>> Create(
      StoreOptions options);
  ~TmemStore();
  TmemStore(const TmemStore&) = delete;
  TmemStore& operator=(const TmemStore&) = delete;

  // --- VMs -------------------------------------------------------------
  // ALREADY_EXISTS for a name in use, RESOURCE_EXHAUSTED past kMaxVms,
  // INVALID_ARGUMENT for an empty name.
  absl::StatusOr<VmId> AddVm(const std::string& name, const VmPolicy& policy);
  absl::StatusOr<VmId> FindVm(const std::string& name) const;
  std::vector<VmId> ListVms() const;
  // Takes effect for the next put; a lowered quota evicts at once.
  absl::Status SetVmPolicy(VmId vm, const VmPolicy& policy);
  absl::StatusOr<VmPolicy> GetVmPolicy(VmId vm) const;
  // When the host is full, the victim is the VM with the largest
  // charged / (weight / divisor): a divisor above 1 makes this VM's pages go
  // first (the valve sets it for VMs whose pages do not come back). 1 is
  // neutral; 0 is taken as 1.
  absl::Status SetEvictionBias(VmId vm, uint32_t divisor);
  // Drops every page the VM put, its pools and its slot.
  absl::Status ForgetVm(VmId vm);

  // --- Shared-pool authorization (by VM name, so it outlives VM restarts).
  void AuthorizeSharedPool(const PoolUuid& uuid, const std::string& vm_name);
  void RevokeSharedPool(const PoolUuid& uuid, const std::string& vm_name);

  // --- Pools -----------------------------------------------------------
  // shared == nullptr: a private pool. Otherwise joins (or creates) the
  // shared pool of that UUID: PERMISSION_DENIED if the VM is not authorized.
  // `kind`: see "Persistent pools" above; a persistent pool is private
  // (INVALID_ARGUMENT with `shared`, or for a kind that is neither).
  absl::StatusOr<PoolId> NewPool(VmId vm, const PoolUuid* shared,
                                 PoolKind kind = PoolKind::kEphemeral);
  absl::Status DestroyPool(VmId vm, PoolId pool);

  // --- Pages -----------------------------------------------------------
  // NOT_FOUND for an unknown VM or pool. A refused put is not an error.
  absl::StatusOr<PutResult> Put(VmId vm, PoolId pool, const ObjectId& oid,
                                PageIndex index, ConstPage page,
                                PutMode mode = PutMode::kCompress);
  // true: hit, `out` holds the page. false: miss, `out` unspecified.
  // Exclusive in a private ephemeral pool (the hit removes the page).
  absl::StatusOr<bool> Get(VmId vm, PoolId pool, const ObjectId& oid,
                           PageIndex index, MutablePage out);
  // Gets pages first .. first + count - 1 of one object of a private pool
  // in one call (the run of a readahead window): one VM and pool lookup and
  // one shard lock for the whole run, each hit exclusive exactly as Get's
  // (in a persistent pool not exclusive, as Get's) and counted as one get. Page
  // first + k goes to out[k * kPageSize, (k + 1) * kPageSize). Bit k of the
  // result set: page first + k hit and its bytes are there; clear: miss (those
  // bytes unspecified). INVALID_ARGUMENT for a shared pool (its gets are not
  // exclusive), for 0 or more than kMaxGetRun pages, indices that wrap, or
  // `out` smaller than count pages; NOT_FOUND for an unknown VM or pool.
  // DATA_LOSS if a stored block was corrupt (the whole run's pages are then
  // dropped).
  static constexpr size_t kMaxGetRun = 64;
  absl::StatusOr<uint64_t> GetRun(VmId vm, PoolId pool, const ObjectId& oid,
                                  PageIndex first, size_t count,
                                  std::span<uint8_t> out);
  absl::Status InvalidatePage(VmId vm, PoolId pool, const ObjectId& oid,
                              PageIndex index);
  absl::Status InvalidateObject(VmId vm, PoolId pool, const ObjectId& oid);
  absl::Status InvalidatePool(VmId vm, PoolId pool);

  // --- Deferred compression (for the compactor) -------------------------
  // Copies the raw bytes of the page `ticket` names if the key still holds
  // that put's pending raw page; false otherwise (stale ticket).
  bool ReadDeferred(const CompactionTicket& ticket, MutablePage out);
  // Replaces that page's raw copy by `block`, an LZ4 block of exactly the
  // bytes ReadDeferred gave (empty: leave it raw, it compresses poorly), if
  // it is still that put's pending page. Either way the page stops being
  // pending. May evict (as a put does) to find room for the block.
  DeferredOutcome CompleteDeferred(const CompactionTicket& ticket,
                                   std::span<const uint8_t> block);

  // --- Host ------------------------------------------------------------
  // Raising past the address-space reservation is INVALID_ARGUMENT.
  // Lowering evicts until the held bytes fit.
  absl::Status SetMemoryCap(uint64_t cap_bytes);
  // Gives back to the OS the empty slabs kept for reuse beyond a few, off
  // the data path (the agent calls it every valve period): freeing and
  // refaulting slab memory on every put and get is what keeping them saves.
  // The number of slabs returned.
  size_t TrimIdleSlabs();
  HostStats GetHostStats() const;
  absl::StatusOr<VmStats> GetVmStats(VmId vm) const;
  const StoreOptions& options() const { return options_; }

  // What the VM's persistent pages hold beyond what it may hold now. The
  // store never evicts them, so the owner (the swap backing) moves pages
  // out until this is 0. Three limits, each capped at the VM's persistent
  // charge:
  //  * quota: charged - quota_bytes (ephemeral pages over a lowered quota
  //    are evicted at once, so what is left over is persistent);
  //  * swap quota: persistent charge - swap_quota_bytes;
  //  * host cap: the bytes the store is over its cap, measured in what VMs
  //    are charged (min(used, charged) - cap: a slot freed inside a slab
  //    returns budget only when the whole slab empties, so chasing bytes in
  //    use would move far more pages than the excess), split among VMs by
  //    weighted fair share: the VMs furthest over their share (charged /
  //    weight) give first, down to a common level, as eviction chooses its
  //    victims; a VM within its share gives nothing while another is over.
  // Reads counters only (no shard lock): a snapshot, exact when nothing
  // else changes. NOT_FOUND for an unknown VM.
  absl::StatusOr<PersistentExcess> PersistentExcessBytes(VmId vm) const;

 private:
  explicit TmemStore(const StoreOptions& options);
  class Impl;
  std::unique_ptr<Impl> impl_;
  StoreOptions options_;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_TMEM_STORE_H_
