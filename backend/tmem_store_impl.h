// TmemStore::Impl: the store's state and the declarations its files share.
// tmem_store.cc implements VMs, pools and page ops; tmem_store_eviction.cc
// implements eviction (victim choice, slab choice, the steps a put takes to
// find room). Private to backend/: include only from those files.
//
// Thread safety, lock order and bounded work: tmem_store.h.
#ifndef TMEMD_BACKEND_TMEM_STORE_IMPL_H_
#define TMEMD_BACKEND_TMEM_STORE_IMPL_H_

#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/blob_arena.h"
#include "backend/compaction_queue.h"
#include "backend/fair_share.h"
#include "backend/memory_budget.h"
#include "backend/mutex.h"
#include "backend/shard_table.h"
#include "backend/slab_pool.h"
#include "backend/tmem_store.h"

namespace tmem {

// What a put's page became before any lock is taken: compression runs with
// no lock held so that shards are held only for bookkeeping.
struct EncodedPage {
  StorageKind kind = StorageKind::kRaw;
  uint64_t fill_word = 0;            // kZero / kSameFilled
  std::span<const uint8_t> bytes;    // kLz4 / kRaw: what goes in the blob
  bool poorly_compressible = false;  // LZ4 missed the threshold
};

// Work done by the store operation running on this thread: entries, nodes
// and slab candidates visited, pages evicted, entries moved. Each operation
// resets it at its start; what one operation did is bounded (tmem_store.h:
// "Bounded work").
inline thread_local uint64_t t_op_work = 0;

class TmemStore::Impl {
 public:
  struct Pool {
    bool shared = false;
    PoolKind kind = PoolKind::kEphemeral;  // fixed at NewPool
    PoolUuid uuid;
    CounterSet counters;
    int members = 0;  // shared pools: VMs that hold it (pools_mu_)
    // Pages are keyed by the pool's address: all of a pool's pages are
    // removed before it is freed, so a reused address never meets a stale
    // page.
    uint64_t key() const { return reinterpret_cast<uint64_t>(this); }
    // Its pages are pinned (ShardTable): never evicted, gets not exclusive.
    bool persistent() const { return kind == PoolKind::kPersistent; }
  };

  struct Vm {
    explicit Vm(uint16_t slot_index) : slot(slot_index) {}
    // Changes only when a forgotten VM's struct is reused for a new VM
    // (under op_mu exclusive); read lock-free by LookupVm.
    std::atomic<VmId> id{0};
    const uint16_t slot;  // the struct belongs to its slot for good
    // Written by AddVm under vms_mu_ and op_mu (exclusive): read under
    // either.
    std::string name;
    // Shared by page ops, policy calls and GetVmStats; exclusive for pool
    // ops, ForgetVm and AddVm's reset of a reused struct, so an op never
    // races with its own pool table changing or the VM going away. Taken
    // after vms_mu_ and before pools_mu_ (tmem_store.h: lock order); the
    // annotations cannot name another object's member, so that order is
    // kept by ForgetVm dropping this lock before it takes vms_mu_.
    mutable SharedMutex op_mu;
    bool gone ABSL_GUARDED_BY(op_mu) = false;
    std::vector<Pool*> pools ABSL_GUARDED_BY(op_mu);  // index = PoolId
    // Policy is read on every put without a lock.
    std::atomic<uint64_t> quota{kUnlimitedQuota};
    // Cap on the persistent (swap) charge; see "Persistent pools".
    std::atomic<uint64_t> swap_quota{kUnlimitedQuota};
    std::atomic<uint32_t> weight{100};
    // Divides the weight when choosing whom to evict (SetEvictionBias).
    std::atomic<uint32_t> eviction_bias{1};
    std::atomic<bool> enabled{true};
    std::atomic<bool> frozen{false};
    std::atomic<uint32_t> evict_cursor{0};
    CounterSet counters;
    uint64_t charged() const { return counters.Get(Counter::kChargedBytes); }
    uint64_t persistent_charged() const {
      return counters.Get(Counter::kPersistentChargedBytes);
    }
    // Whether it may hold a page eviction can take (not only persistent
    // ones). Read without a lock: a hint for victim choice.
    bool MayHoldEvictable() const {
      return counters.Get(Counter::kPagesHeld) >
             counters.Get(Counter::kPersistentPagesHeld);
    }
  };

  struct Shard {
    explicit Shard(MemoryBudget* budget) : table(budget) {}
    Mutex mu;
    ShardTable table ABSL_GUARDED_BY(mu);
    // Pages stored raw and queued for the compactor: entry -> the stamp of
    // the put that stored it (tmem_store.h: deferred compression).
    absl::flat_hash_map<uint32_t, uint64_t> deferred ABSL_GUARDED_BY(mu);
  };

  Impl(const StoreOptions& options, std::unique_ptr<SlabPool> slabs,
       std::unique_ptr<MemoryBudget> budget)
      : options_(options),
        clock_(options.clock != nullptr ? options.clock
                                        : SteadyClock::Default()),
        start_nanos_(clock_->NowNanos()),
        budget_(std::move(budget)),
        slabs_(std::move(slabs)),
        arena_(slabs_.get(), budget_.get()) {
    shards_.reserve(options.num_shards);
    for (int i = 0; i < options.num_shards; ++i) {
      shards_.push_back(std::make_unique<Shard>(budget_.get()));
    }
    for (auto& s : slots_) s.store(nullptr, std::memory_order_relaxed);
  }

  ~Impl() {
    // Shards release their slabs and tables into the budget; then the pools
    // and VMs go. Order matters only for the budget's arithmetic.
    shards_.clear();
  }

  // ---------------------------------------------------------------- VMs
  absl::StatusOr<VmId> AddVm(const std::string& name, const VmPolicy& policy)
      ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_);
  absl::StatusOr<VmId> FindVm(const std::string& name) const;
  std::vector<VmId> ListVms() const;

  // Vm structs are never freed before the store (a forgotten VM's is reused
  // by its slot's next VM), so a pointer read from a slot stays
  // dereferenceable even if the VM is forgotten meanwhile; the id check
  // (slot + generation) rejects stale handles, and callers check it again
  // under the op lock (Gone), where a reuse cannot be half done.
  absl::StatusOr<Vm*> LookupVm(VmId id) const;

  // The VM was forgotten, or its struct now serves a later VM.
  static bool Gone(const Vm& vm, VmId id) ABSL_SHARED_LOCKS_REQUIRED(vm.op_mu);

  // Every refusal of an id that names no live VM (never added, forgotten,
  // or its slot's struct now serves a later VM) is counted.
  absl::Status UnknownVm(VmId id) const;
  static void ApplyPolicy(Vm& vm, const VmPolicy& policy);
  absl::Status SetVmPolicy(VmId id, const VmPolicy& policy);
  absl::Status SetEvictionBias(VmId id, uint32_t divisor);
  absl::StatusOr<VmPolicy> GetVmPolicy(VmId id) const;
  absl::Status ForgetVm(VmId id) ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_);
  void AuthorizeSharedPool(const PoolUuid& uuid, const std::string& vm_name);
  void RevokeSharedPool(const PoolUuid& uuid, const std::string& vm_name);

  // -------------------------------------------------------------- pools
  absl::StatusOr<PoolId> NewPool(VmId id, const PoolUuid* shared, PoolKind kind)
      ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_);
  absl::Status DestroyPool(VmId id, PoolId pid)
      ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_);

  // Drops one VM's hold on a pool; frees it (and its pages) on the last.
  // Returns the pages removed with it.
  int64_t ReleasePoolLocked(Pool* pool)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pools_mu_);
  static absl::StatusOr<Pool*> PoolOf(const Vm& vm, PoolId pid)
      ABSL_SHARED_LOCKS_REQUIRED(vm.op_mu);

  // -------------------------------------------------------------- pages
  Shard& ShardFor(const Pool& pool, const ObjectId& oid);

  // Gives back the entry and object chunks that removals freed (ShardTable::
  // Compact). Called after removals, while no entry number is held; pending
  // deferred pages follow their entries.
  void CompactLocked(Shard& shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

  // Adds `delta` to what a page of `pool` owned by `owner` (nullptr: a VM
  // being forgotten) is charged: the owner's and the pool's gauges, and
  // their persistent share if the page is pinned.
  static void AddCharge(Vm* owner, Pool& pool, bool pinned, int64_t delta);

  // Removes an entry and settles every account it touched: blob, owner VM's
  // gauges, pool gauges. Callers count why (eviction, invalidate, ...).
  // Returns the pool the page belonged to.
  // With `keep_blob`, the caller takes over the blob and frees it later.
  // `why` says, for a page still pending compaction, why it went.
  Pool& RemoveEntryLocked(Shard& shard, uint32_t e, bool keep_blob = false,
                          CompactionSkip why = CompactionSkip::kInvalidated)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  void RemoveKeyLocked(Shard& shard, Pool& pool, const ObjectId& oid,
                       PageIndex index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  int64_t RemovePoolPages(Pool& pool);
  EncodedPage Encode(ConstPage page, PutMode mode,
                     std::span<uint8_t> scratch) const;
  absl::StatusOr<PutResult> Put(VmId id, PoolId pid, const ObjectId& oid,
                                PageIndex index, ConstPage page, PutMode mode);

  // Keeps the most work one operation did (HostStats::max_op_work).
  void RecordOpWork();
  absl::StatusOr<PutResult> PutWork(VmId id, PoolId pid, const ObjectId& oid,
                                    PageIndex index, ConstPage page,
                                    PutMode mode);

  // Queues a page just stored raw for the compactor and marks it pending.
  // A full queue leaves it raw (counted by the queue).
  bool QueueDeferredLocked(Shard& shard, uint32_t entry, VmId id,
                           const Pool& pool, PoolId pid, const ObjectId& oid,
                           PageIndex index, bool idle_only)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

  // The entry holding the ticket's pending raw page, or kNoEntry.
  static uint32_t PendingEntryLocked(Shard& shard, const Pool& pool,
                                     const CompactionTicket& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

  // Runs fn(vm, pool, shard) under the ticket's VM op lock (shared), if its
  // VM and pool still exist; false otherwise.
  template <typename Fn>
  bool WithTicket(const CompactionTicket& t, Fn fn);
  bool ReadDeferred(const CompactionTicket& t, MutablePage out);
  DeferredOutcome CompleteDeferred(const CompactionTicket& t,
                                   std::span<const uint8_t> block);
  absl::StatusOr<bool> Get(VmId id, PoolId pid, const ObjectId& oid,
                           PageIndex index, MutablePage out);
  absl::StatusOr<bool> GetWork(VmId id, PoolId pid, const ObjectId& oid,
                               PageIndex index, MutablePage out);
  absl::StatusOr<uint64_t> GetRun(VmId id, PoolId pid, const ObjectId& oid,
                                  PageIndex first, size_t n,
                                  std::span<uint8_t> out);

  // Counts a get run's hits and misses (n pages, `hits` their bits); a
  // corrupt block makes it DATA_LOSS.
  absl::StatusOr<uint64_t> CountGetRun(Vm& vm, Pool& pool, size_t n,
                                       uint64_t hits, bool corrupt);
  // GetRun of a persistent pool: hits stay (not exclusive), decoded under
  // the shard lock.
  absl::StatusOr<uint64_t> GetRunKept(Vm& vm, Pool& pool, Shard& shard,
                                      const ObjectId& oid, PageIndex first,
                                      size_t n, std::span<uint8_t> out)
      ABSL_SHARED_LOCKS_REQUIRED(vm.op_mu) ABSL_LOCKS_EXCLUDED(shard.mu);

  // Fills `out` from an entry whose blob is live. False on a corrupt block
  // (which only memory corruption could produce).
  bool DecodeEntry(const PageEntry& entry, MutablePage out) const;
  template <typename Fn>
  absl::Status WithPool(VmId id, PoolId pid, Fn fn);
  absl::Status InvalidatePage(VmId id, PoolId pid, const ObjectId& oid,
                              PageIndex index);
  absl::Status InvalidateObject(VmId id, PoolId pid, const ObjectId& oid);
  absl::Status InvalidatePool(VmId id, PoolId pid);

  // ----------------------------------------------------------- eviction
  // How far from the LRU tail a class-targeted eviction looks, per shard.
  static constexpr int kScanDepth = 32;
  // Evictions from the put's own shard when its table lacks room: one frees
  // an entry, or takes the page index back under its growth threshold; a
  // missing object node or index growth needs room from the budget.
  static constexpr int kInShardEvictions = 4;
  // Bounded work (tmem_store.h): pages a slab choice looks at, in all and
  // at least per shard; candidate slabs it confirms; pages a metadata-room
  // batch evicts from one shard (two entry chunks: with the chunk slack
  // ShardTable keeps, at least one chunk of entries goes back); and rounds
  // of whole-slab eviction a put runs before it is refused for memory.
  static constexpr uint64_t kSlabChoicePages = 8192;
  static constexpr uint64_t kMinSlabChoicePagesPerShard = 16;
  static constexpr size_t kSlabChoiceTries = 4;
  static constexpr uint32_t kEvictBatch = 512;
  static constexpr int kMaxRoomRounds = 8;

  // What an eviction is to free.
  enum class Room {
    kSlotOfClass,  // a slot of one size class, which a put takes at once
    // Budget bytes (a table's growth, a fresh slab, a lowered cap). A freed
    // slot returns none until its whole 64 KiB slab is empty, so a whole
    // slab is emptied, the one with the fewest live blobs. In plain LRU
    // order a put that needed tens of bytes for an index evicted 878-1,359
    // pages of ~2,000 before any slab emptied.
    kWholeSlab,
  };
  static bool HoldsBlob(StorageKind kind);
  // Tells the eviction listener which key entry `e` held.
  void NotifyEvictionLocked(Shard& shard, uint32_t e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

  // Evicts one page of `vm`; false if it holds none. The least recently
  // used page of the next shard (round robin) that holds one; with
  // `slot_bytes`, first a page within kScanDepth of a shard's LRU tail
  // whose blob has that slot size (freeing other classes' slots only helps
  // when a whole slab empties: size-class fragmentation).
  // `found_class` (optional) is set when the page evicted was of that class.
  bool EvictFromVm(Vm& vm, Counter reason, size_t slot_bytes = 0,
                   bool* found_class = nullptr);
  // Evicts entry `e`, never a pinned (persistent) one: callers find their
  // victims on LRU lists, which hold no pinned entry.
  void EvictLocked(Shard& shard, uint32_t e, Vm& owner, Counter reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

  // Evicts the pages of the slab with the fewest live blobs among the
  // slabs whose every live blob was seen near the LRU tails of VMs marked
  // in `evictable` (by VM slot), so that slab goes back to the pool; the
  // number evicted (0: no such slab). Bounded: it looks at most
  // kSlabChoicePages pages (spread over the shards, one shard lock at a
  // time) and counts a slab only if the arena's live count for it equals
  // the pages seen in it, so pages of other VMs and blobs of puts in flight
  // keep a slab out. Evicting its pages then empties it.
  uint32_t EvictEmptiestSlab(const std::vector<Vm*>& vms,
                             const std::vector<bool>& evictable);

  // Evicts up to `count` least recently used pages of `vm` from one shard
  // (the next, round robin, that holds one), then gives back the chunks
  // they freed: metadata room comes a chunk of one shard at a time, so the
  // pages it takes are concentrated there. The number evicted.
  uint32_t EvictBatchFromVm(Vm& vm, uint32_t count);

  // Share inputs of every live VM, for victim choice.
  void CollectShares(std::vector<Vm*>& vms, std::vector<ShareInput>& inputs);

  // Evicts, from this shard, the LRU page of the VM furthest over its share
  // among those holding pages here. Used when the shard itself needs an
  // entry: only a page of this shard frees one.
  bool EvictInShardLocked(Shard& shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

  // Evicts for `room`; the number of pages evicted (0: none left).
  // kSlotOfClass: a page of the class of the VM furthest over its weighted
  // fair share, if one is in reach, else that VM's LRU page. kWholeSlab:
  // every page of the emptiest slab whose pages all belong to VMs within a
  // slab (64 KiB) of their fair share or over it (the one furthest over
  // always counts): a VM further within its share is never robbed while
  // another is over, and one near its share loses at most about a slab's
  // worth, the step its charge moves in anyway. With no such slab, the LRU
  // page of the VM furthest over.
  // With no such slab the room is metadata, or blobs too scattered for any
  // slab to empty in reach: a batch of up to kEvictBatch LRU pages of the VM
  // furthest over, from one shard, whose freed entries and object nodes go
  // back a chunk at a time. `found_class`: as EvictFromVm's.
  uint32_t EvictForHost(Room room, size_t slot_bytes = 0,
                        bool* found_class = nullptr);

  // Evicts until the budget is within a (lowered) cap or nothing is left to
  // evict; the number evicted. Each emptied slab is handed back at once:
  // cached, it would still be charged.
  uint32_t EvictUntilWithinCap(int max_rounds = INT_MAX);

  // --------------------------------------------------------------- host
  absl::Status SetMemoryCap(uint64_t cap);
  size_t TrimIdleSlabs() { return slabs_->TrimCacheTo(SlabPool::kCachedSlabs); }

  HostStats GetHostStats() const;
  absl::StatusOr<VmStats> GetVmStats(VmId id) const;
  absl::StatusOr<PersistentExcess> PersistentExcessBytes(VmId id) const;
  MemoryBudget& budget() { return *budget_; }

 private:
  const StoreOptions options_;
  const Clock* const clock_;
  const int64_t start_nanos_;
  // Declared before the shards: they release into it when destroyed.
  std::unique_ptr<MemoryBudget> budget_;
  std::unique_ptr<SlabPool> slabs_;
  BlobArena arena_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::array<std::atomic<Vm*>, kMaxVms> slots_;
  std::atomic<int> max_slot_{-1};
  std::atomic<uint64_t> pool_scan_objects_visited_{0};
  std::atomic<uint64_t> slabs_emptied_for_room_{0};
  std::atomic<uint64_t> slab_choice_pages_walked_{0};
  std::atomic<uint64_t> max_op_work_{0};
  std::atomic<uint64_t> entries_moved_{0};
  std::atomic<uint64_t> metadata_chunks_released_{0};
  std::atomic<uint64_t> puts_refused_at_work_bound_{0};
  mutable std::atomic<uint64_t> unknown_vm_ids_refused_{0};

  // Lock order (tmem_store.h): vms_mu_ -> a VM's op_mu -> pools_mu_ ->
  // shard -> blob class -> SlabPool.
  // The VM registry.
  mutable Mutex vms_mu_ ABSL_ACQUIRED_BEFORE(pools_mu_);
  std::array<uint16_t, kMaxVms> generations_ ABSL_GUARDED_BY(vms_mu_){};
  // One struct per slot, reused by the slot's next VM (see AddVm).
  std::array<std::unique_ptr<Vm>, kMaxVms> vm_structs_ ABSL_GUARDED_BY(vms_mu_);
  absl::flat_hash_map<std::string, Vm*> by_name_ ABSL_GUARDED_BY(vms_mu_);
  CounterValues retired_counters_ ABSL_GUARDED_BY(vms_mu_){};
  // The pool registry.
  mutable Mutex pools_mu_ ABSL_ACQUIRED_AFTER(vms_mu_);
  absl::flat_hash_map<Pool*, std::unique_ptr<Pool>> pools_
      ABSL_GUARDED_BY(pools_mu_);
  absl::flat_hash_map<PoolUuid, Pool*> shared_pools_ ABSL_GUARDED_BY(pools_mu_);
  absl::flat_hash_map<PoolUuid, absl::flat_hash_set<std::string>> shared_auth_
      ABSL_GUARDED_BY(pools_mu_);
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_TMEM_STORE_IMPL_H_
