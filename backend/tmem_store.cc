#include "backend/tmem_store.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <climits>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "backend/blob_arena.h"
#include "backend/compaction_queue.h"
#include "backend/fair_share.h"
#include "backend/memory_budget.h"
#include "backend/mutex.h"
#include "backend/shard_table.h"
#include "backend/slab_pool.h"

namespace tmem {

namespace {

// What a put's page became before any lock is taken: compression runs with
// no lock held so that shards are held only for bookkeeping.
struct EncodedPage {
  StorageKind kind = StorageKind::kRaw;
  uint64_t fill_word = 0;            // kZero / kSameFilled
  std::span<const uint8_t> bytes;    // kLz4 / kRaw: what goes in the blob
  bool poorly_compressible = false;  // LZ4 missed the threshold
};

uint64_t SlotBytesOf(const EncodedPage& p) {
  return p.bytes.empty() ? 0 : BlobSlotBytes(p.bytes.size());
}

// What a page costs, all-in (page_charge.h).
uint64_t ChargeOf(const PageEntry& e) {
  if (e.kind == StorageKind::kZero || e.kind == StorageKind::kSameFilled) {
    return MetadataCharge(e.charges);
  }
  return BlobCharge(BlobSlotBytes(BlobRef::Unpack(e.payload).bytes())) +
         MetadataCharge(e.charges);
}

uint64_t StoredBytesOf(const PageEntry& e) {
  if (e.kind == StorageKind::kZero || e.kind == StorageKind::kSameFilled) {
    return 0;
  }
  return BlobSlotBytes(BlobRef::Unpack(e.payload).bytes());
}

Counter PutCounterFor(StorageKind kind) {
  switch (kind) {
    case StorageKind::kZero:
      return Counter::kPutsZero;
    case StorageKind::kSameFilled:
      return Counter::kPutsSameFilled;
    case StorageKind::kLz4:
      return Counter::kPutsCompressed;
    case StorageKind::kRaw:
      return Counter::kPutsRaw;
  }
  return Counter::kPutsRaw;
}

// Work done by the store operation running on this thread: entries, nodes
// and slab candidates visited, pages evicted, entries moved. Each operation
// resets it at its start; what one operation did is bounded (tmem_store.h:
// "Bounded work").
thread_local uint64_t t_op_work = 0;

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return uint64_t{16} << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

}  // namespace

class TmemStore::Impl {
 public:
  struct Pool {
    bool shared = false;
    PoolUuid uuid;
    CounterSet counters;
    int members = 0;  // shared pools: VMs that hold it (pools_mu_)
    // Pages are keyed by the pool's address: all of a pool's pages are
    // removed before it is freed, so a reused address never meets a stale
    // page.
    uint64_t key() const { return reinterpret_cast<uint64_t>(this); }
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
    std::atomic<uint32_t> weight{100};
    // Divides the weight when choosing whom to evict (SetEvictionBias).
    std::atomic<uint32_t> eviction_bias{1};
    std::atomic<bool> enabled{true};
    std::atomic<bool> frozen{false};
    std::atomic<uint32_t> evict_cursor{0};
    CounterSet counters;

    uint64_t charged() const { return counters.Get(Counter::kChargedBytes); }
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
      ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_) {
    if (name.empty()) return absl::InvalidArgumentError("VM name is empty");
    MutexLock lock(&vms_mu_);
    if (by_name_.contains(name)) {
      return absl::AlreadyExistsError(
          absl::StrCat("a VM named '", name, "' is already registered"));
    }
    // The lowest free slot whose generation can still grow: a slot retires
    // at generation 65535, so an id (slot, generation) is never issued twice
    // and a stale handle never reaches a later VM (4096 x 65535 adds before
    // RESOURCE_EXHAUSTED: 8 years at one VM start per second).
    int slot = -1;
    bool free_slot_left = false;
    for (int i = 0; i < kMaxVms; ++i) {
      if (slots_[i].load(std::memory_order_relaxed) != nullptr) continue;
      free_slot_left = true;
      if (generations_[i] == UINT16_MAX) continue;  // retired
      slot = i;
      break;
    }
    if (slot < 0) {
      return absl::ResourceExhaustedError(
          free_slot_left
              ? absl::StrCat("every free VM id has been used (", kMaxVms,
                             " slots x 65535 generations); restart tmemd")
              : absl::StrCat("too many VMs (", kMaxVms, "); forget one first"));
    }
    const VmId id = (static_cast<VmId>(++generations_[slot]) << 16) |
                    static_cast<VmId>(slot);
    // A slot's struct is reused, never freed: LookupVm may still hold a
    // pointer to it, and reuse bounds the VM structs to kMaxVms however
    // often VMs come and go.
    std::unique_ptr<Vm>& owned = vm_structs_[slot];
    if (owned == nullptr) {
      owned = std::make_unique<Vm>(static_cast<uint16_t>(slot));
    }
    Vm* raw = owned.get();
    {
      // vms_mu_ -> op_mu, the documented order. Whoever still holds this
      // op lock is an op of the forgotten VM: it sees Gone and lets go
      // without taking vms_mu_.
      WriterMutexLock op_lock(&raw->op_mu);
      raw->name = name;
      raw->gone = false;
      raw->pools.clear();
      raw->eviction_bias.store(1, std::memory_order_relaxed);
      raw->evict_cursor.store(0, std::memory_order_relaxed);
      raw->counters.Reset();
      ApplyPolicy(*raw, policy);
      raw->id.store(id, std::memory_order_release);
    }
    by_name_[name] = raw;
    slots_[slot].store(raw, std::memory_order_release);
    int high = max_slot_.load(std::memory_order_relaxed);
    while (slot > high && !max_slot_.compare_exchange_weak(
                              high, slot, std::memory_order_relaxed)) {
    }
    return id;
  }

  absl::StatusOr<VmId> FindVm(const std::string& name) const {
    MutexLock lock(&vms_mu_);
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      return absl::NotFoundError(absl::StrCat("no VM named '", name, "'"));
    }
    return it->second->id.load(std::memory_order_relaxed);
  }

  std::vector<VmId> ListVms() const {
    MutexLock lock(&vms_mu_);
    std::vector<VmId> out;
    for (const auto& [name, vm] : by_name_) {
      out.push_back(vm->id.load(std::memory_order_relaxed));
    }
    std::sort(out.begin(), out.end(),
              [](VmId a, VmId b) { return (a & 0xFFFF) < (b & 0xFFFF); });
    return out;
  }

  // Vm structs are never freed before the store (a forgotten VM's is reused
  // by its slot's next VM), so a pointer read from a slot stays
  // dereferenceable even if the VM is forgotten meanwhile; the id check
  // (slot + generation) rejects stale handles, and callers check it again
  // under the op lock (Gone), where a reuse cannot be half done.
  absl::StatusOr<Vm*> LookupVm(VmId id) const {
    const uint32_t slot = id & 0xFFFF;
    if (slot >= static_cast<uint32_t>(kMaxVms)) return UnknownVm(id);
    Vm* vm = slots_[slot].load(std::memory_order_acquire);
    if (vm == nullptr || vm->id.load(std::memory_order_acquire) != id) {
      return UnknownVm(id);
    }
    return vm;
  }

  // The VM was forgotten, or its struct now serves a later VM.
  static bool Gone(const Vm& vm, VmId id) ABSL_SHARED_LOCKS_REQUIRED(vm.op_mu) {
    return vm.gone || vm.id.load(std::memory_order_relaxed) != id;
  }

  // Every refusal of an id that names no live VM (never added, forgotten,
  // or its slot's struct now serves a later VM) is counted.
  absl::Status UnknownVm(VmId id) const {
    unknown_vm_ids_refused_.fetch_add(1, std::memory_order_relaxed);
    return absl::NotFoundError(
        absl::StrCat("unknown VM id ", id, " (never added, or forgotten)"));
  }

  static void ApplyPolicy(Vm& vm, const VmPolicy& policy) {
    vm.quota.store(policy.quota_bytes, std::memory_order_relaxed);
    vm.weight.store(policy.weight, std::memory_order_relaxed);
    vm.enabled.store(policy.enabled, std::memory_order_relaxed);
    vm.frozen.store(policy.frozen, std::memory_order_relaxed);
  }

  absl::Status SetVmPolicy(VmId id, const VmPolicy& policy) {
    absl::StatusOr<Vm*> vm = LookupVm(id);
    if (!vm.ok()) return vm.status();
    ReaderMutexLock op_lock(&(*vm)->op_mu);
    if (Gone(**vm, id)) return UnknownVm(id);
    ApplyPolicy(**vm, policy);
    // A lowered quota holds from now on: evict the VM's oldest pages.
    while ((*vm)->charged() > policy.quota_bytes) {
      if (!EvictFromVm(**vm, Counter::kEvictionsQuota)) break;
    }
    return absl::OkStatus();
  }

  absl::Status SetEvictionBias(VmId id, uint32_t divisor) {
    absl::StatusOr<Vm*> vm = LookupVm(id);
    if (!vm.ok()) return vm.status();
    ReaderMutexLock op_lock(&(*vm)->op_mu);
    if (Gone(**vm, id)) return UnknownVm(id);
    (*vm)->eviction_bias.store(std::max<uint32_t>(divisor, 1),
                               std::memory_order_relaxed);
    return absl::OkStatus();
  }

  absl::StatusOr<VmPolicy> GetVmPolicy(VmId id) const {
    absl::StatusOr<Vm*> vm = LookupVm(id);
    if (!vm.ok()) return vm.status();
    ReaderMutexLock op_lock(&(*vm)->op_mu);
    if (Gone(**vm, id)) return UnknownVm(id);
    VmPolicy p;
    p.quota_bytes = (*vm)->quota.load(std::memory_order_relaxed);
    p.weight = (*vm)->weight.load(std::memory_order_relaxed);
    p.enabled = (*vm)->enabled.load(std::memory_order_relaxed);
    p.frozen = (*vm)->frozen.load(std::memory_order_relaxed);
    return p;
  }

  absl::Status ForgetVm(VmId id) ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_) {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    {
      WriterMutexLock op_lock(&vm.op_mu);
      if (Gone(vm, id)) return UnknownVm(id);
      vm.gone = true;
      // Every page the VM put, in any pool (its LRU lists enumerate them).
      for (auto& shard : shards_) {
        MutexLock lock(&shard->mu);
        for (uint32_t e = shard->table.LruTail(vm.slot); e != kNoEntry;
             e = shard->table.LruTail(vm.slot)) {
          RemoveEntryLocked(*shard, e);
        }
        CompactLocked(*shard);
      }
      MutexLock lock(&pools_mu_);
      for (Pool*& pool : vm.pools) {
        if (pool != nullptr) ReleasePoolLocked(pool);
        pool = nullptr;
      }
      vm.pools.clear();
    }
    // The op lock is dropped before vms_mu_ (lock order). Meanwhile the VM
    // is gone, so no op of it changes its counters, and its slot stays
    // taken, so AddVm cannot reuse the struct before the counters retire.
    MutexLock lock(&vms_mu_);
    vm.counters.AccumulateInto(retired_counters_);
    by_name_.erase(vm.name);
    slots_[vm.slot].store(nullptr, std::memory_order_release);
    return absl::OkStatus();
  }

  void AuthorizeSharedPool(const PoolUuid& uuid, const std::string& vm_name) {
    MutexLock lock(&pools_mu_);
    shared_auth_[uuid].insert(vm_name);
  }

  void RevokeSharedPool(const PoolUuid& uuid, const std::string& vm_name) {
    MutexLock lock(&pools_mu_);
    auto it = shared_auth_.find(uuid);
    if (it == shared_auth_.end()) return;
    it->second.erase(vm_name);
    if (it->second.empty()) shared_auth_.erase(it);
  }

  // -------------------------------------------------------------- pools
  absl::StatusOr<PoolId> NewPool(VmId id, const PoolUuid* shared)
      ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_) {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    WriterMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    PoolId pid = 0;
    while (pid < static_cast<PoolId>(vm.pools.size()) &&
           vm.pools[pid] != nullptr) {
      ++pid;
    }
    if (pid >= kMaxPoolsPerVm) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "VM '", vm.name, "' already has ", kMaxPoolsPerVm, " pools"));
    }
    Pool* pool;
    {
      MutexLock lock(&pools_mu_);
      if (shared == nullptr) {
        auto owned = std::make_unique<Pool>();
        pool = owned.get();
        pools_[pool] = std::move(owned);
      } else {
        auto auth = shared_auth_.find(*shared);
        if (auth == shared_auth_.end() || !auth->second.contains(vm.name)) {
          return absl::PermissionDeniedError(absl::StrCat(
              "VM '", vm.name,
              "' is not authorized for this shared pool; authorize it first"));
        }
        auto it = shared_pools_.find(*shared);
        if (it != shared_pools_.end()) {
          pool = it->second;
        } else {
          auto owned = std::make_unique<Pool>();
          pool = owned.get();
          pool->shared = true;
          pool->uuid = *shared;
          pools_[pool] = std::move(owned);
          shared_pools_[*shared] = pool;
        }
        ++pool->members;
      }
    }
    if (pid == static_cast<PoolId>(vm.pools.size()))
      vm.pools.push_back(nullptr);
    vm.pools[pid] = pool;
    return pid;
  }

  absl::Status DestroyPool(VmId id, PoolId pid)
      ABSL_LOCKS_EXCLUDED(vms_mu_, pools_mu_) {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    WriterMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    absl::StatusOr<Pool*> pool = PoolOf(vm, pid);
    if (!pool.ok()) return pool.status();
    vm.pools[pid] = nullptr;
    MutexLock lock(&pools_mu_);
    // Counted as invalidated: the guest dropped them, nothing evicted them.
    vm.counters.Add(Counter::kPagesInvalidated, ReleasePoolLocked(*pool));
    return absl::OkStatus();
  }

  // Drops one VM's hold on a pool; frees it (and its pages) on the last.
  // Returns the pages removed with it.
  int64_t ReleasePoolLocked(Pool* pool)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pools_mu_) {
    if (pool->shared && --pool->members > 0) return 0;
    const int64_t removed = RemovePoolPages(*pool);
    if (pool->shared) shared_pools_.erase(pool->uuid);
    pools_.erase(pool);
    return removed;
  }

  static absl::StatusOr<Pool*> PoolOf(const Vm& vm, PoolId pid)
      ABSL_SHARED_LOCKS_REQUIRED(vm.op_mu) {
    if (pid < 0 || pid >= static_cast<PoolId>(vm.pools.size()) ||
        vm.pools[pid] == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("VM '", vm.name, "' has no pool ", pid));
    }
    return vm.pools[pid];
  }

  // -------------------------------------------------------------- pages
  Shard& ShardFor(const Pool& pool, const ObjectId& oid) {
    const size_t h =
        absl::Hash<std::pair<uint64_t, ObjectId>>{}({pool.key(), oid});
    return *shards_[h % shards_.size()];
  }

  // Removes an entry and settles every account it touched: blob, owner VM's
  // gauges, pool gauges. Callers count why (eviction, invalidate, ...).
  // Returns the pool the page belonged to.
  // With `keep_blob`, the caller takes over the blob and frees it later.
  // Tells the eviction listener which key entry `e` held.
  void NotifyEvictionLocked(Shard& shard, uint32_t e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    if (options_.eviction_listener == nullptr) return;
    const PageEntry& entry = shard.table.entry(e);
    const Vm* owner = slots_[entry.vm_slot].load(std::memory_order_acquire);
    if (owner == nullptr) return;
    options_.eviction_listener->OnEvicted(
        owner->id.load(std::memory_order_relaxed),
        KeyHash(shard.table.object(entry.object).oid, entry.index));
  }

  // Gives back the entry and object chunks that removals freed (ShardTable::
  // Compact). Called after removals, while no entry number is held; pending
  // deferred pages follow their entries.
  void CompactLocked(Shard& shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    const uint64_t released_before = shard.table.chunks_released();
    // Moves are applied to the pending map after Compact returns: clang's
    // analysis does not see the lambda run under this lock.
    std::vector<std::pair<uint32_t, uint32_t>> moves;
    const uint64_t work = shard.table.Compact(
        [&](uint32_t from, uint32_t to) { moves.emplace_back(from, to); });
    if (!shard.deferred.empty()) {
      for (const auto& [from, to] : moves) {
        auto it = shard.deferred.find(from);
        if (it == shard.deferred.end()) continue;
        const uint64_t stamp = it->second;
        shard.deferred.erase(it);
        shard.deferred[to] = stamp;
      }
    }
    t_op_work += work;
    entries_moved_.fetch_add(work, std::memory_order_relaxed);
    metadata_chunks_released_.fetch_add(
        shard.table.chunks_released() - released_before,
        std::memory_order_relaxed);
  }

  // `why` says, for a page still pending compaction, why it went.
  Pool& RemoveEntryLocked(Shard& shard, uint32_t e, bool keep_blob = false,
                          CompactionSkip why = CompactionSkip::kInvalidated)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    if (!shard.deferred.empty() && shard.deferred.erase(e) > 0) {
      options_.compaction_queue->CountSkipped(why);
    }
    // NOLINTNEXTLINE(performance-no-int-to-ptr): pool keys are Pool addresses.
    Pool& pool = *reinterpret_cast<Pool*>(
        shard.table.object(shard.table.entry(e).object).pool_key);
    const RemovedPage gone = shard.table.RemovePage(e);
    const PageEntry& removed = gone.entry;
    if (!keep_blob && HoldsBlob(removed.kind)) {
      arena_.Free(BlobRef::Unpack(removed.payload));
    }
    const auto charge = static_cast<int64_t>(ChargeOf(removed));
    const auto stored = static_cast<int64_t>(StoredBytesOf(removed));
    Vm* owner = slots_[removed.vm_slot].load(std::memory_order_acquire);
    if (owner != nullptr) {
      owner->counters.Add(Counter::kPagesHeld, -1);
      owner->counters.Add(Counter::kChargedBytes, -charge);
      owner->counters.Add(Counter::kStoredBytes, -stored);
    }
    pool.counters.Add(Counter::kPagesHeld, -1);
    pool.counters.Add(Counter::kChargedBytes, -charge);
    pool.counters.Add(Counter::kStoredBytes, -stored);
    if (gone.heir != kNoEntry) {
      // A page of the same pool now pays the object or pool slot this one
      // paid; its owner (possibly another VM sharing the pool) is charged.
      const auto moved = static_cast<int64_t>(SharedCharge(gone.heir_gained));
      Vm* heir_owner = slots_[shard.table.entry(gone.heir).vm_slot].load(
          std::memory_order_acquire);
      if (heir_owner != nullptr) {
        heir_owner->counters.Add(Counter::kChargedBytes, moved);
      }
      pool.counters.Add(Counter::kChargedBytes, moved);
    }
    return pool;
  }

  void RemoveKeyLocked(Shard& shard, Pool& pool, const ObjectId& oid,
                       PageIndex index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    const uint32_t e = shard.table.FindPage(pool.key(), oid, index);
    if (e == kNoEntry) return;
    RemoveEntryLocked(shard, e, /*keep_blob=*/false, CompactionSkip::kReplaced);
    CompactLocked(shard);
  }

  int64_t RemovePoolPages(Pool& pool) {
    int64_t removed = 0;
    for (auto& shard : shards_) {
      MutexLock lock(&shard->mu);
      const uint64_t visited_before = shard->table.objects_visited();
      for (uint32_t e : shard->table.PagesOfPool(pool.key())) {
        RemoveEntryLocked(*shard, e);
        ++removed;
      }
      CompactLocked(*shard);
      pool_scan_objects_visited_.fetch_add(
          shard->table.objects_visited() - visited_before,
          std::memory_order_relaxed);
    }
    return removed;
  }

  EncodedPage Encode(ConstPage page, PutMode mode,
                     std::span<uint8_t> scratch) const {
    EncodedPage out;
    if (DetectSameFilled(page, &out.fill_word)) {
      out.kind =
          out.fill_word == 0 ? StorageKind::kZero : StorageKind::kSameFilled;
      return out;
    }
    if (mode == PutMode::kCompress) {
      const size_t n = CompressPage(page, scratch);
      if (n > 0 && n <= options_.poor_compression_threshold_bytes) {
        out.kind = StorageKind::kLz4;
        out.bytes = scratch.first(n);
        return out;
      }
      out.poorly_compressible = true;
    }
    out.kind = StorageKind::kRaw;
    out.bytes = page;
    return out;
  }

  absl::StatusOr<PutResult> Put(VmId id, PoolId pid, const ObjectId& oid,
                                PageIndex index, ConstPage page, PutMode mode) {
    t_op_work = 0;
    absl::StatusOr<PutResult> result = PutWork(id, pid, oid, index, page, mode);
    RecordOpWork();
    return result;
  }

  // Keeps the most work one operation did (HostStats::max_op_work).
  void RecordOpWork() {
    const uint64_t work = t_op_work;
    uint64_t seen = max_op_work_.load(std::memory_order_relaxed);
    while (work > seen && !max_op_work_.compare_exchange_weak(
                              seen, work, std::memory_order_relaxed)) {
    }
  }

  absl::StatusOr<PutResult> PutWork(VmId id, PoolId pid, const ObjectId& oid,
                                    PageIndex index, ConstPage page,
                                    PutMode mode) {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;

    // A deferred put stores the page raw now and queues it; without a
    // queue it compresses here.
    bool deferred_mode = mode == PutMode::kDefer || mode == PutMode::kDeferIdle;
    const bool idle_only = mode == PutMode::kDeferIdle;
    if (deferred_mode && options_.compaction_queue == nullptr) {
      mode = PutMode::kCompress;
      deferred_mode = false;
    }
    // Compression first, with no lock held (the lookup above is lock-free).
    thread_local std::array<uint8_t, kMaxCompressedPage> scratch;
    const EncodedPage enc =
        mode == PutMode::kDrop
            ? EncodedPage{}
            : Encode(page, deferred_mode ? PutMode::kRaw : mode, scratch);
    const bool defer = deferred_mode && enc.kind == StorageKind::kRaw;

    ReaderMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    absl::StatusOr<Pool*> found_pool = PoolOf(vm, pid);
    if (!found_pool.ok()) return found_pool.status();
    Pool& pool = **found_pool;
    Shard& shard = ShardFor(pool, oid);

    PutResult result;
    // Evictions chosen for the room they free (a page of the put's size
    // class, a page of its shard) stop after max_evictions_per_put: such a
    // page frees a slot or an entry, which is not always the room the put
    // lacks (a fresh slab, a table's growth), so past the bound only plain
    // fair-share eviction runs.
    auto targeted = [&] {
      return result.evicted <
             static_cast<uint32_t>(options_.max_evictions_per_put);
    };
    // A refused put still removes the key's earlier page: the guest's copy
    // changed, so the old bytes must never come back.
    auto refuse = [&](RefuseReason reason) {
      {
        MutexLock lock(&shard.mu);
        RemoveKeyLocked(shard, pool, oid, index);
      }
      vm.counters.Inc(RefusedCounter(reason));
      pool.counters.Inc(RefusedCounter(reason));
      result.stored = false;
      result.reason = reason;
      return result;
    };

    if (mode == PutMode::kDrop || !vm.enabled.load(std::memory_order_relaxed) ||
        vm.frozen.load(std::memory_order_relaxed)) {
      return refuse(RefuseReason::kPolicy);
    }
    if (enc.poorly_compressible &&
        options_.poor_compression_action == PoorCompressionAction::kRefuse) {
      return refuse(RefuseReason::kPoorCompression);
    }
    // Reserved at the most a page can cost (it may create an object and
    // bring its pool into the shard); the unused part is given back once
    // the table says what the page pays.
    const uint64_t charge =
        BlobCharge(SlotBytesOf(enc)) + kMaxPageMetadataCharge;
    if (charge > vm.quota.load(std::memory_order_relaxed)) {
      return refuse(RefuseReason::kQuota);
    }

    bool class_out_of_reach = false;
    int room_rounds = 0;
    for (;;) {
      // Reserve the charge against the quota first: add then check keeps
      // concurrent puts of one VM from overshooting together.
      const uint64_t quota = vm.quota.load(std::memory_order_relaxed);
      vm.counters.Add(Counter::kChargedBytes, static_cast<int64_t>(charge));
      if (vm.charged() > quota) {
        vm.counters.Add(Counter::kChargedBytes, -static_cast<int64_t>(charge));
        if (result.evicted >=
                static_cast<uint32_t>(options_.max_evictions_per_put) ||
            !EvictFromVm(vm, Counter::kEvictionsQuota)) {
          return refuse(RefuseReason::kQuota);
        }
        ++result.evicted;
        continue;
      }
      // The blob is allocated and filled before the shard lock, which then
      // covers only the table update.
      uint64_t payload = enc.fill_word;
      std::optional<BlobRef> blob;
      bool stored = false;
      if (!enc.bytes.empty()) {
        blob = arena_.Store(enc.bytes);
        if (blob) payload = blob->Pack();
      }
      if (enc.bytes.empty() || blob) {
        MutexLock lock(&shard.mu);
        RemoveKeyLocked(shard, pool, oid, index);
        // The table may need metadata memory (an entry chunk, an index
        // doubling). A page removed from this same shard gives its entry
        // and index slot back here, so evict locally first (a few pages,
        // while targeted); what only budget can pay for (an object node or
        // index, a pool slot, a VM's LRU head, a shard emptied and
        // shrunk) is left to the host-wide eviction below.
        uint32_t entry = kNoEntry;
        for (int in_shard = 0;; ++in_shard) {
          entry = shard.table.InsertPage(pool.key(), oid, index, vm.slot,
                                         enc.kind, payload);
          stored = entry != kNoEntry;
          if (stored || in_shard == kInShardEvictions || !targeted() ||
              !EvictInShardLocked(shard)) {
            break;
          }
          ++result.evicted;
        }
        if (stored) {
          // Gauges move under the shard lock so that a concurrent removal
          // of this page never sees them before the insert.
          const auto stored_bytes = static_cast<int64_t>(SlotBytesOf(enc));
          const uint64_t actual = ChargeOf(shard.table.entry(entry));
          vm.counters.Add(Counter::kChargedBytes,
                          -static_cast<int64_t>(charge - actual));
          vm.counters.Inc(PutCounterFor(enc.kind));
          vm.counters.Inc(Counter::kPagesHeld);
          vm.counters.Add(Counter::kStoredBytes, stored_bytes);
          pool.counters.Inc(PutCounterFor(enc.kind));
          pool.counters.Inc(Counter::kPagesHeld);
          pool.counters.Add(Counter::kStoredBytes, stored_bytes);
          pool.counters.Add(Counter::kChargedBytes,
                            static_cast<int64_t>(actual));
          if (defer)
            result.deferred = QueueDeferredLocked(shard, entry, id, pid, oid,
                                                  index, idle_only);
        }
      }
      if (stored) break;
      const bool slot_missing = !enc.bytes.empty() && !blob;
      if (blob) arena_.Free(*blob);
      vm.counters.Add(Counter::kChargedBytes, -static_cast<int64_t>(charge));
      // Cached empty slabs are charged; metadata cannot use them.
      if (!slot_missing) slabs_->TrimCache();
      // No slot of this size class and no free slab: while targeted, evict
      // a page of that class (its slot is the room). Otherwise the room is
      // budget bytes (a table's growth, or a fresh slab once no page of the
      // class was near an LRU tail), which come back a whole slab at a
      // time: evict from the emptiest slab. Either ends with room or with
      // no page left to evict: every slab and table of an emptied store is
      // given back (tmem_store.h).
      // Bounded: evictions for a slot stop once one found no page of the
      // class in reach (the victim's LRU page it took instead frees budget
      // bytes only with its whole slab or chunk), and whole-slab rounds stop
      // after kMaxRoomRounds. A put refused then leaves its evictions done:
      // the room they freed serves the next put.
      uint32_t evicted = 0;
      if (slot_missing && targeted() && !class_out_of_reach) {
        bool found_class = false;
        evicted =
            EvictForHost(Room::kSlotOfClass, SlotBytesOf(enc), &found_class);
        class_out_of_reach = !found_class;
      } else if (++room_rounds <= kMaxRoomRounds) {
        evicted = EvictForHost(Room::kWholeSlab);
      } else {
        puts_refused_at_work_bound_.fetch_add(1, std::memory_order_relaxed);
      }
      if (evicted == 0) return refuse(RefuseReason::kNoMemory);
      result.evicted += evicted;
      // The slab that eviction emptied sits in the cache, still charged.
      if (!slot_missing) slabs_->TrimCache();
    }
    // A lowered cap (SetMemoryCap racing with this put) is met here too,
    // in at most kMaxRoomRounds rounds (SetMemoryCap itself evicts all the
    // way down).
    result.evicted += EvictUntilWithinCap(kMaxRoomRounds);
    result.stored = true;
    result.kind = enc.kind;
    return result;
  }

  // Queues a page just stored raw for the compactor and marks it pending.
  // A full queue leaves it raw (counted by the queue).
  bool QueueDeferredLocked(Shard& shard, uint32_t entry, VmId id, PoolId pid,
                           const ObjectId& oid, PageIndex index, bool idle_only)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    CompactionQueue& queue = *options_.compaction_queue;
    CompactionTicket ticket;
    ticket.idle_only = idle_only;
    ticket.vm = id;
    ticket.pool = pid;
    ticket.oid = oid;
    ticket.index = index;
    ticket.stamp = queue.NextStamp();
    ticket.put_nanos = clock_->NowNanos();
    if (!queue.TryPush(ticket)) return false;
    shard.deferred[entry] = ticket.stamp;
    return true;
  }

  // The entry holding the ticket's pending raw page, or kNoEntry.
  static uint32_t PendingEntryLocked(Shard& shard, const Pool& pool,
                                     const CompactionTicket& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    const uint32_t e = shard.table.FindPage(pool.key(), t.oid, t.index);
    if (e == kNoEntry) return kNoEntry;
    auto it = shard.deferred.find(e);
    if (it == shard.deferred.end() || it->second != t.stamp) return kNoEntry;
    return e;
  }

  // Runs fn(vm, pool, shard) under the ticket's VM op lock (shared), if its
  // VM and pool still exist; false otherwise.
  template <typename Fn>
  bool WithTicket(const CompactionTicket& t, Fn fn) {
    absl::StatusOr<Vm*> found = LookupVm(t.vm);
    if (!found.ok()) return false;
    Vm& vm = **found;
    ReaderMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, t.vm)) return false;
    if (t.pool < 0 || t.pool >= static_cast<PoolId>(vm.pools.size()) ||
        vm.pools[t.pool] == nullptr) {
      return false;
    }
    Pool& pool = *vm.pools[t.pool];
    return fn(vm, pool, ShardFor(pool, t.oid));
  }

  bool ReadDeferred(const CompactionTicket& t, MutablePage out) {
    return WithTicket(t, [&](Vm&, Pool& pool, Shard& shard) {
      MutexLock lock(&shard.mu);
      const uint32_t e = PendingEntryLocked(shard, pool, t);
      if (e == kNoEntry) return false;
      const auto bytes =
          arena_.Read(BlobRef::Unpack(shard.table.entry(e).payload));
      std::copy(bytes.begin(), bytes.end(), out.begin());
      return true;
    });
  }

  DeferredOutcome CompleteDeferred(const CompactionTicket& t,
                                   std::span<const uint8_t> block) {
    DeferredOutcome outcome = DeferredOutcome::kStale;
    WithTicket(t, [&](Vm& vm, Pool& pool, Shard& shard) {
      std::optional<BlobRef> blob;
      if (!block.empty()) {
        // Room for the block first, as a put finds it: the raw slot it
        // replaces is freed only after the swap.
        blob = arena_.Store(block);
        for (int tries = 0;
             !blob && tries < options_.max_evictions_per_put &&
             EvictForHost(Room::kSlotOfClass, BlobSlotBytes(block.size())) > 0;
             ++tries) {
          blob = arena_.Store(block);
        }
      }
      std::optional<BlobRef> raw;
      {
        MutexLock lock(&shard.mu);
        const uint32_t e = PendingEntryLocked(shard, pool, t);
        if (e == kNoEntry) {
          outcome = DeferredOutcome::kStale;
        } else if (block.empty() || !blob) {
          shard.deferred.erase(e);
          outcome = block.empty() ? DeferredOutcome::kKeptRaw
                                  : DeferredOutcome::kNoRoom;
        } else {
          shard.deferred.erase(e);
          const PageEntry before = shard.table.entry(e);
          shard.table.SetStorage(e, StorageKind::kLz4, blob->Pack());
          const PageEntry& after = shard.table.entry(e);
          // Re-charged at its new size, under the shard lock like every
          // other change of this page's accounts.
          const auto charge_delta = static_cast<int64_t>(ChargeOf(after)) -
                                    static_cast<int64_t>(ChargeOf(before));
          const auto stored_delta = static_cast<int64_t>(StoredBytesOf(after)) -
                                    static_cast<int64_t>(StoredBytesOf(before));
          Vm* owner = slots_[before.vm_slot].load(std::memory_order_acquire);
          if (owner != nullptr) {
            owner->counters.Add(Counter::kChargedBytes, charge_delta);
            owner->counters.Add(Counter::kStoredBytes, stored_delta);
          }
          pool.counters.Add(Counter::kChargedBytes, charge_delta);
          pool.counters.Add(Counter::kStoredBytes, stored_delta);
          raw = BlobRef::Unpack(before.payload);
          blob.reset();  // the page owns it now
          outcome = DeferredOutcome::kCompressed;
        }
      }
      (void)vm;
      if (blob) arena_.Free(*blob);
      if (raw) arena_.Free(*raw);
      return true;
    });
    return outcome;
  }

  absl::StatusOr<bool> Get(VmId id, PoolId pid, const ObjectId& oid,
                           PageIndex index, MutablePage out) {
    t_op_work = 0;
    absl::StatusOr<bool> hit = GetWork(id, pid, oid, index, out);
    RecordOpWork();
    return hit;
  }

  absl::StatusOr<bool> GetWork(VmId id, PoolId pid, const ObjectId& oid,
                               PageIndex index, MutablePage out) {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    ReaderMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    absl::StatusOr<Pool*> found_pool = PoolOf(vm, pid);
    if (!found_pool.ok()) return found_pool.status();
    Pool& pool = **found_pool;
    Shard& shard = ShardFor(pool, oid);
    bool hit = false;
    bool corrupt = false;
    std::optional<PageEntry> taken;  // a private page this get removed
    {
      MutexLock lock(&shard.mu);
      const uint32_t e = shard.table.FindPage(pool.key(), oid, index);
      if (e != kNoEntry) {
        hit = true;
        if (!pool.shared) {
          // Private pools are exclusive: the guest now holds the only copy.
          // The entry goes now; its blob is decoded after the lock drops.
          taken = shard.table.entry(e);
          RemoveEntryLocked(shard, e, /*keep_blob=*/true,
                            CompactionSkip::kRead);
          CompactLocked(shard);
        } else {
          // Shared pages stay, so another VM may free the blob once the
          // lock drops: decode under the lock.
          shard.table.Touch(e);
          corrupt = !DecodeEntry(shard.table.entry(e), out);
          if (corrupt) {
            RemoveEntryLocked(shard, e);
            CompactLocked(shard);
          }
        }
      }
    }
    if (taken) {
      corrupt = !DecodeEntry(*taken, out);
      if (HoldsBlob(taken->kind)) {
        arena_.Free(BlobRef::Unpack(taken->payload));
      }
    }
    if (corrupt) hit = false;
    const Counter c = hit ? Counter::kGetsHit : Counter::kGetsMiss;
    vm.counters.Inc(c);
    pool.counters.Inc(c);
    if (corrupt) {
      return absl::DataLossError(
          "stored LZ4 block failed to decompress; page dropped");
    }
    return hit;
  }

  absl::StatusOr<uint64_t> GetRun(VmId id, PoolId pid, const ObjectId& oid,
                                  PageIndex first, size_t n,
                                  std::span<uint8_t> out) {
    if (n == 0 || n > TmemStore::kMaxGetRun || first + (n - 1) < first ||
        out.size() / kPageSize < n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a get run takes 1 to ", TmemStore::kMaxGetRun,
          " pages whose indices do not wrap, into room for as many; asked "
          "for ",
          n, " from ", first, " into ", out.size(), " bytes"));
    }
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    ReaderMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    absl::StatusOr<Pool*> found_pool = PoolOf(vm, pid);
    if (!found_pool.ok()) return found_pool.status();
    Pool& pool = **found_pool;
    if (pool.shared) {
      return absl::InvalidArgumentError(
          "a get run is exclusive: private pools only");
    }
    // Every page of one object lives in one shard.
    Shard& shard = ShardFor(pool, oid);
    // Only the entries of hits are read (bit k of `hits`).
    // NOLINTNEXTLINE(*-member-init)
    std::array<PageEntry, TmemStore::kMaxGetRun> taken;
    uint64_t hits = 0;
    {
      MutexLock lock(&shard.mu);
      for (size_t k = 0; k < n; ++k) {
        const uint32_t e = shard.table.FindPage(pool.key(), oid, first + k);
        if (e == kNoEntry) continue;
        // Exclusive, as Get: the entry goes now, its blob is decoded after
        // the lock drops.
        taken[k] = shard.table.entry(e);
        RemoveEntryLocked(shard, e, /*keep_blob=*/true, CompactionSkip::kRead);
        hits |= uint64_t{1} << k;
      }
      CompactLocked(shard);
    }
    bool corrupt = false;
    for (size_t k = 0; k < n; ++k) {
      if (((hits >> k) & 1) == 0) continue;
      if (!DecodeEntry(taken[k],
                       MutablePage(out.data() + k * kPageSize, kPageSize))) {
        corrupt = true;
        hits &= ~(uint64_t{1} << k);
      }
      if (HoldsBlob(taken[k].kind)) {
        arena_.Free(BlobRef::Unpack(taken[k].payload));
      }
    }
    const auto hit_count = static_cast<int64_t>(std::popcount(hits));
    const auto miss_count = static_cast<int64_t>(n) - hit_count;
    vm.counters.Add(Counter::kGetsHit, hit_count);
    vm.counters.Add(Counter::kGetsMiss, miss_count);
    pool.counters.Add(Counter::kGetsHit, hit_count);
    pool.counters.Add(Counter::kGetsMiss, miss_count);
    if (corrupt) {
      return absl::DataLossError(
          "stored LZ4 block failed to decompress; page dropped");
    }
    return hits;
  }

  // Fills `out` from an entry whose blob is live. False on a corrupt block
  // (which only memory corruption could produce).
  bool DecodeEntry(const PageEntry& entry, MutablePage out) const {
    switch (entry.kind) {
      case StorageKind::kZero:
      case StorageKind::kSameFilled:
        FillPage(entry.payload, out);
        return true;
      case StorageKind::kRaw: {
        const auto bytes = arena_.Read(BlobRef::Unpack(entry.payload));
        std::copy(bytes.begin(), bytes.end(), out.begin());
        return true;
      }
      case StorageKind::kLz4:
        return DecompressPage(arena_.Read(BlobRef::Unpack(entry.payload)), out);
    }
    return false;
  }

  template <typename Fn>
  absl::Status WithPool(VmId id, PoolId pid, Fn fn) {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    ReaderMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    absl::StatusOr<Pool*> pool = PoolOf(vm, pid);
    if (!pool.ok()) return pool.status();
    fn(vm, **pool);
    return absl::OkStatus();
  }

  absl::Status InvalidatePage(VmId id, PoolId pid, const ObjectId& oid,
                              PageIndex index) {
    return WithPool(id, pid, [&](Vm& vm, Pool& pool) {
      Shard& shard = ShardFor(pool, oid);
      {
        MutexLock lock(&shard.mu);
        const uint32_t e = shard.table.FindPage(pool.key(), oid, index);
        if (e != kNoEntry) {
          RemoveEntryLocked(shard, e);
          CompactLocked(shard);
          vm.counters.Inc(Counter::kPagesInvalidated);
          pool.counters.Inc(Counter::kPagesInvalidated);
        }
      }
      vm.counters.Inc(Counter::kInvalidatePage);
      pool.counters.Inc(Counter::kInvalidatePage);
    });
  }

  absl::Status InvalidateObject(VmId id, PoolId pid, const ObjectId& oid) {
    return WithPool(id, pid, [&](Vm& vm, Pool& pool) {
      Shard& shard = ShardFor(pool, oid);
      int64_t removed = 0;
      {
        MutexLock lock(&shard.mu);
        const uint32_t object = shard.table.FindObject(pool.key(), oid);
        if (object != kNoEntry) {
          for (uint32_t e : shard.table.PagesOfObject(object)) {
            RemoveEntryLocked(shard, e);
            ++removed;
          }
          CompactLocked(shard);
        }
      }
      vm.counters.Add(Counter::kPagesInvalidated, removed);
      pool.counters.Add(Counter::kPagesInvalidated, removed);
      vm.counters.Inc(Counter::kInvalidateObject);
      pool.counters.Inc(Counter::kInvalidateObject);
    });
  }

  absl::Status InvalidatePool(VmId id, PoolId pid) {
    return WithPool(id, pid, [&](Vm& vm, Pool& pool) {
      const int64_t removed = RemovePoolPages(pool);
      vm.counters.Add(Counter::kPagesInvalidated, removed);
      pool.counters.Add(Counter::kPagesInvalidated, removed);
      vm.counters.Inc(Counter::kInvalidatePool);
      pool.counters.Inc(Counter::kInvalidatePool);
    });
  }

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

  static bool HoldsBlob(StorageKind kind) {
    return kind == StorageKind::kLz4 || kind == StorageKind::kRaw;
  }

  // Evicts one page of `vm`; false if it holds none. The least recently
  // used page of the next shard (round robin) that holds one; with
  // `slot_bytes`, first a page within kScanDepth of a shard's LRU tail
  // whose blob has that slot size (freeing other classes' slots only helps
  // when a whole slab empties: size-class fragmentation).
  // `found_class` (optional) is set when the page evicted was of that class.
  bool EvictFromVm(Vm& vm, Counter reason, size_t slot_bytes = 0,
                   bool* found_class = nullptr) {
    const auto n = static_cast<uint32_t>(shards_.size());
    const uint32_t start =
        vm.evict_cursor.fetch_add(1, std::memory_order_relaxed);
    // A VM holding no blob has no page of any class: skip the scan.
    if (slot_bytes != 0 && vm.counters.Get(Counter::kStoredBytes) > 0) {
      for (uint32_t i = 0; i < n; ++i) {
        Shard& shard = *shards_[(start + i) % n];
        MutexLock lock(&shard.mu);
        uint32_t e = shard.table.LruTail(vm.slot);
        for (int depth = 0; e != kNoEntry && depth < kScanDepth; ++depth) {
          ++t_op_work;
          const PageEntry& entry = shard.table.entry(e);
          if (HoldsBlob(entry.kind) &&
              BlobRef::Unpack(entry.payload).slot_bytes() == slot_bytes) {
            EvictLocked(shard, e, vm, reason);
            CompactLocked(shard);
            if (found_class != nullptr) *found_class = true;
            return true;
          }
          e = entry.lru_prev;
        }
      }
    }
    for (uint32_t i = 0; i < n; ++i) {
      Shard& shard = *shards_[(start + i) % n];
      MutexLock lock(&shard.mu);
      ++t_op_work;
      const uint32_t e = shard.table.LruTail(vm.slot);
      if (e == kNoEntry) continue;
      EvictLocked(shard, e, vm, reason);
      CompactLocked(shard);
      return true;
    }
    return false;
  }

  void EvictLocked(Shard& shard, uint32_t e, Vm& owner, Counter reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    ++t_op_work;
    NotifyEvictionLocked(shard, e);
    Pool& pool = RemoveEntryLocked(shard, e, /*keep_blob=*/false,
                                   CompactionSkip::kEvicted);
    owner.counters.Inc(reason);
    pool.counters.Inc(reason);
  }

  // Evicts the pages of the slab with the fewest live blobs among the
  // slabs whose every live blob was seen near the LRU tails of VMs marked
  // in `evictable` (by VM slot), so that slab goes back to the pool; the
  // number evicted (0: no such slab). Bounded: it looks at most
  // kSlabChoicePages pages (spread over the shards, one shard lock at a
  // time) and counts a slab only if the arena's live count for it equals
  // the pages seen in it, so pages of other VMs and blobs of puts in flight
  // keep a slab out. Evicting its pages then empties it.
  uint32_t EvictEmptiestSlab(const std::vector<Vm*>& vms,
                             const std::vector<bool>& evictable) {
    struct Seen {
      uint32_t shard;
      uint32_t entry;
      uint64_t payload;
    };
    std::vector<Seen> seen;
    const uint64_t per_shard = std::max<uint64_t>(
        kMinSlabChoicePagesPerShard, kSlabChoicePages / shards_.size());
    uint64_t walked = 0;
    for (uint32_t i = 0; i < shards_.size(); ++i) {
      Shard& shard = *shards_[i];
      MutexLock lock(&shard.mu);
      uint64_t here = 0;
      for (const Vm* vm : vms) {
        if (!evictable[vm->slot]) continue;
        for (uint32_t e = shard.table.LruTail(vm->slot);
             e != kNoEntry && here < per_shard;
             e = shard.table.entry(e).lru_prev) {
          ++here;
          const PageEntry& page = shard.table.entry(e);
          if (HoldsBlob(page.kind)) seen.push_back({i, e, page.payload});
        }
      }
      walked += here;
    }
    t_op_work += walked;
    slab_choice_pages_walked_.fetch_add(walked, std::memory_order_relaxed);
    absl::flat_hash_map<uint32_t, uint32_t> movable;
    for (const Seen& s : seen) ++movable[BlobRef::Unpack(s.payload).slab];
    std::vector<std::pair<uint32_t, uint32_t>> candidates;  // (count, slab)
    candidates.reserve(movable.size());
    for (const auto& [slab, count] : movable) {
      candidates.emplace_back(count, slab);
    }
    std::sort(candidates.begin(), candidates.end());
    t_op_work += candidates.size();
    // Evicts the seen pages of `slab` that still hold the blob they held;
    // with `check`, first confirms (under the first page's shard lock, which
    // keeps the slab's class fixed) that they are all of its live blobs.
    auto evict_slab = [&](uint32_t slab, uint32_t count) -> uint32_t {
      uint32_t evicted = 0;
      bool checked = false;
      for (size_t k = 0; k < seen.size();) {
        const uint32_t shard_index = seen[k].shard;
        Shard& shard = *shards_[shard_index];
        MutexLock lock(&shard.mu);
        for (; k < seen.size() && seen[k].shard == shard_index; ++k) {
          const BlobRef ref = BlobRef::Unpack(seen[k].payload);
          if (ref.slab != slab || !shard.table.IsLive(seen[k].entry)) continue;
          const PageEntry& page = shard.table.entry(seen[k].entry);
          if (!HoldsBlob(page.kind) || page.payload != seen[k].payload) {
            continue;  // gone since it was seen
          }
          if (!checked) {
            if (arena_.LiveBlobsInSlabOf(ref) != count) return 0;
            checked = true;
          }
          Vm* owner = slots_[page.vm_slot].load(std::memory_order_acquire);
          if (owner == nullptr) continue;  // being forgotten: it frees it
          EvictLocked(shard, seen[k].entry, *owner, Counter::kEvictionsHostCap);
          ++evicted;
        }
        // Entry numbers of later shards are untouched by this compaction.
        CompactLocked(shard);
      }
      return evicted;
    };
    for (size_t c = 0; c < candidates.size() && c < kSlabChoiceTries; ++c) {
      if (const uint32_t evicted =
              evict_slab(candidates[c].second, candidates[c].first)) {
        slabs_emptied_for_room_.fetch_add(1, std::memory_order_relaxed);
        return evicted;
      }
    }
    return 0;
  }

  // Evicts up to `count` least recently used pages of `vm` from one shard
  // (the next, round robin, that holds one), then gives back the chunks
  // they freed: metadata room comes a chunk of one shard at a time, so the
  // pages it takes are concentrated there. The number evicted.
  uint32_t EvictBatchFromVm(Vm& vm, uint32_t count) {
    const auto n = static_cast<uint32_t>(shards_.size());
    const uint32_t start =
        vm.evict_cursor.fetch_add(1, std::memory_order_relaxed);
    for (uint32_t i = 0; i < n; ++i) {
      Shard& shard = *shards_[(start + i) % n];
      MutexLock lock(&shard.mu);
      ++t_op_work;
      uint32_t evicted = 0;
      for (uint32_t e = shard.table.LruTail(vm.slot);
           e != kNoEntry && evicted < count; e = shard.table.LruTail(vm.slot)) {
        EvictLocked(shard, e, vm, Counter::kEvictionsHostCap);
        ++evicted;
      }
      if (evicted == 0) continue;
      CompactLocked(shard);
      return evicted;
    }
    return 0;
  }

  // Share inputs of every live VM, for victim choice.
  void CollectShares(std::vector<Vm*>& vms, std::vector<ShareInput>& inputs) {
    const int high = max_slot_.load(std::memory_order_relaxed);
    t_op_work += static_cast<uint64_t>(high + 1);
    vms.reserve(high + 1);
    inputs.reserve(high + 1);
    for (int i = 0; i <= high; ++i) {
      Vm* vm = slots_[i].load(std::memory_order_acquire);
      if (vm == nullptr) continue;
      vms.push_back(vm);
      inputs.push_back(
          {vm->charged(),
           std::max<uint32_t>(
               1, vm->weight.load(std::memory_order_relaxed) /
                      vm->eviction_bias.load(std::memory_order_relaxed))});
    }
  }

  // Evicts, from this shard, the LRU page of the VM furthest over its share
  // among those holding pages here. Used when the shard itself needs an
  // entry: only a page of this shard frees one.
  bool EvictInShardLocked(Shard& shard)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
    std::vector<Vm*> vms;
    std::vector<ShareInput> inputs;
    CollectShares(vms, inputs);
    for (size_t i = 0; i < vms.size(); ++i) {
      if (shard.table.LruTail(vms[i]->slot) == kNoEntry) {
        inputs[i].charged_bytes = 0;
      }
    }
    const int victim = PickEvictionVictim(inputs);
    if (victim < 0) return false;
    Vm& vm = *vms[victim];
    EvictLocked(shard, shard.table.LruTail(vm.slot), vm,
                Counter::kEvictionsHostCap);
    CompactLocked(shard);
    return true;
  }

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
                        bool* found_class = nullptr) {
    std::vector<Vm*> vms;
    std::vector<ShareInput> inputs;
    CollectShares(vms, inputs);
    if (room == Room::kWholeSlab) {
      const int furthest = PickEvictionVictim(inputs);
      if (furthest < 0) return 0;
      std::vector<bool> evictable(kMaxVms, false);
      const uint64_t cap = budget_->cap();
      for (size_t i = 0; i < vms.size(); ++i) {
        const uint64_t charged = inputs[i].charged_bytes;
        if (static_cast<int>(i) == furthest ||
            (charged > 0 &&
             charged + kSlabBytes >=
                 FairShareBytes(cap, inputs, static_cast<int>(i)))) {
          evictable[vms[i]->slot] = true;
        }
      }
      if (const uint32_t evicted = EvictEmptiestSlab(vms, evictable)) {
        return evicted;
      }
      // Every slab in reach mixes in pages of VMs within their share. If
      // the VM furthest over holds blobs, a batch of its pages may empty no
      // slab, and a whole slab of anyone's costs fewer pages; if it holds
      // none (metadata only), the batch below is what frees room, and the
      // slabs of VMs within their share stay.
      if (vms[furthest]->counters.Get(Counter::kStoredBytes) > 0) {
        std::fill(evictable.begin(), evictable.end(), true);
        if (const uint32_t evicted = EvictEmptiestSlab(vms, evictable)) {
          return evicted;
        }
      }
    }
    // A VM whose charge is only an in-flight reservation has nothing to
    // evict; skip it and try the next furthest over.
    for (size_t tries = 0; tries < vms.size(); ++tries) {
      const int victim = PickEvictionVictim(inputs);
      if (victim < 0) return 0;
      if (room == Room::kWholeSlab) {
        if (const uint32_t evicted =
                EvictBatchFromVm(*vms[victim], kEvictBatch)) {
          return evicted;
        }
      } else if (EvictFromVm(*vms[victim], Counter::kEvictionsHostCap,
                             slot_bytes, found_class)) {
        return 1;
      }
      inputs[victim].charged_bytes = 0;
    }
    return 0;
  }

  // Evicts until the budget is within a (lowered) cap or nothing is left to
  // evict; the number evicted. Each emptied slab is handed back at once:
  // cached, it would still be charged.
  uint32_t EvictUntilWithinCap(int max_rounds = INT_MAX) {
    uint32_t evicted = 0;
    for (int round = 0; budget_->OverCap() && round < max_rounds; ++round) {
      slabs_->TrimCache();
      if (!budget_->OverCap()) break;
      const uint32_t now = EvictForHost(Room::kWholeSlab);
      if (now == 0) break;
      evicted += now;
    }
    return evicted;
  }

  // --------------------------------------------------------------- host
  absl::Status SetMemoryCap(uint64_t cap) {
    const uint64_t limit = slabs_->max_slabs() * kSlabBytes;
    if (cap > limit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "memory cap ", cap,
          " bytes exceeds the address space reserved at "
          "start (",
          limit, " bytes); restart with a larger address_space_bytes"));
    }
    budget_->set_cap(cap);
    slabs_->TrimCache();
    EvictUntilWithinCap();
    return absl::OkStatus();
  }

  size_t TrimIdleSlabs() { return slabs_->TrimCacheTo(SlabPool::kCachedSlabs); }

  HostStats GetHostStats() const {
    HostStats s;
    s.memory_cap_bytes = budget_->cap();
    s.memory_used_bytes = budget_->used();
    s.slab_bytes = slabs_->slabs_in_use() * kSlabBytes;
    s.metadata_bytes =
        s.memory_used_bytes - std::min(s.memory_used_bytes, s.slab_bytes);
    s.blob_slot_bytes = arena_.slot_bytes_in_use();
    s.uptime_nanos = clock_->NowNanos() - start_nanos_;
    s.pool_scan_objects_visited =
        pool_scan_objects_visited_.load(std::memory_order_relaxed);
    s.slabs_emptied_for_room =
        slabs_emptied_for_room_.load(std::memory_order_relaxed);
    s.slab_choice_pages_walked =
        slab_choice_pages_walked_.load(std::memory_order_relaxed);
    s.unknown_vm_ids_refused =
        unknown_vm_ids_refused_.load(std::memory_order_relaxed);
    s.max_op_work = max_op_work_.load(std::memory_order_relaxed);
    s.metadata_entries_moved = entries_moved_.load(std::memory_order_relaxed);
    s.metadata_chunks_released =
        metadata_chunks_released_.load(std::memory_order_relaxed);
    s.puts_refused_at_work_bound =
        puts_refused_at_work_bound_.load(std::memory_order_relaxed);
    MutexLock lock(&vms_mu_);
    s.counters = retired_counters_;
    for (const auto& [name, vm] : by_name_) {
      vm->counters.AccumulateInto(s.counters);
      s.vm_charged_bytes += vm->charged();
    }
    // Read apart from `used`: a snapshot of a changing store can see a
    // charge before its bytes or the reverse, so the figure is clamped.
    s.host_overhead_bytes =
        s.memory_used_bytes - std::min(s.memory_used_bytes, s.vm_charged_bytes);
    s.vms = by_name_.size();
    for (const std::unique_ptr<Vm>& vm : vm_structs_)
      s.vm_structs += vm != nullptr;
    return s;
  }

  absl::StatusOr<VmStats> GetVmStats(VmId id) const {
    absl::StatusOr<Vm*> found = LookupVm(id);
    if (!found.ok()) return found.status();
    Vm& vm = **found;
    ReaderMutexLock op_lock(&vm.op_mu);
    if (Gone(vm, id)) return UnknownVm(id);
    VmStats s;
    s.id = vm.id.load(std::memory_order_relaxed);
    s.name = vm.name;
    s.policy.quota_bytes = vm.quota.load(std::memory_order_relaxed);
    s.policy.weight = vm.weight.load(std::memory_order_relaxed);
    s.policy.enabled = vm.enabled.load(std::memory_order_relaxed);
    s.policy.frozen = vm.frozen.load(std::memory_order_relaxed);
    s.counters = vm.counters.Snapshot();
    for (PoolId pid = 0; pid < static_cast<PoolId>(vm.pools.size()); ++pid) {
      const Pool* pool = vm.pools[pid];
      if (pool == nullptr) continue;
      PoolStats p;
      p.id = pid;
      p.shared = pool->shared;
      p.uuid = pool->uuid;
      p.counters = pool->counters.Snapshot();
      s.pools.push_back(p);
    }
    return s;
  }

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

// ------------------------------------------------------------------ facade

absl::StatusOr<std::unique_ptr<TmemStore>> TmemStore::Create(
    StoreOptions options) {
  if (options.num_shards < 1 || options.num_shards > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards must be 1..4096, got ", options.num_shards));
  }
  if (options.poor_compression_threshold_bytes == 0 ||
      options.poor_compression_threshold_bytes > kPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("poor_compression_threshold_bytes must be 1..4096, got ",
                     options.poor_compression_threshold_bytes));
  }
  if (options.max_evictions_per_put < 1) {
    return absl::InvalidArgumentError(
        "max_evictions_per_put must be at least 1");
  }
  if (options.address_space_bytes == 0) {
    options.address_space_bytes =
        std::max(PhysicalMemoryBytes(), options.memory_cap_bytes);
  }
  if (options.memory_cap_bytes > options.address_space_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_cap_bytes (", options.memory_cap_bytes,
        ") exceeds address_space_bytes (", options.address_space_bytes, ")"));
  }
  auto budget = std::make_unique<MemoryBudget>(options.memory_cap_bytes);
  absl::StatusOr<std::unique_ptr<SlabPool>> slabs =
      SlabPool::Create(budget.get(), options.address_space_bytes);
  if (!slabs.ok()) return slabs.status();
  std::unique_ptr<TmemStore> store(new TmemStore(options));
  store->impl_ =
      std::make_unique<Impl>(options, std::move(*slabs), std::move(budget));
  return store;
}

TmemStore::TmemStore(const StoreOptions& options) : options_(options) {}
TmemStore::~TmemStore() = default;

absl::StatusOr<VmId> TmemStore::AddVm(const std::string& name,
                                      const VmPolicy& policy) {
  return impl_->AddVm(name, policy);
}
absl::StatusOr<VmId> TmemStore::FindVm(const std::string& name) const {
  return impl_->FindVm(name);
}
std::vector<VmId> TmemStore::ListVms() const { return impl_->ListVms(); }
absl::Status TmemStore::SetVmPolicy(VmId vm, const VmPolicy& policy) {
  return impl_->SetVmPolicy(vm, policy);
}
absl::Status TmemStore::SetEvictionBias(VmId vm, uint32_t divisor) {
  return impl_->SetEvictionBias(vm, divisor);
}
absl::StatusOr<VmPolicy> TmemStore::GetVmPolicy(VmId vm) const {
  return impl_->GetVmPolicy(vm);
}
absl::Status TmemStore::ForgetVm(VmId vm) { return impl_->ForgetVm(vm); }
void TmemStore::AuthorizeSharedPool(const PoolUuid& uuid,
                                    const std::string& vm_name) {
  impl_->AuthorizeSharedPool(uuid, vm_name);
}
void TmemStore::RevokeSharedPool(const PoolUuid& uuid,
                                 const std::string& vm_name) {
  impl_->RevokeSharedPool(uuid, vm_name);
}
absl::StatusOr<PoolId> TmemStore::NewPool(VmId vm, const PoolUuid* shared) {
  return impl_->NewPool(vm, shared);
}
absl::Status TmemStore::DestroyPool(VmId vm, PoolId pool) {
  return impl_->DestroyPool(vm, pool);
}
absl::StatusOr<PutResult> TmemStore::Put(VmId vm, PoolId pool,
                                         const ObjectId& oid, PageIndex index,
                                         ConstPage page, PutMode mode) {
  return impl_->Put(vm, pool, oid, index, page, mode);
}
absl::StatusOr<bool> TmemStore::Get(VmId vm, PoolId pool, const ObjectId& oid,
                                    PageIndex index, MutablePage out) {
  return impl_->Get(vm, pool, oid, index, out);
}
absl::StatusOr<uint64_t> TmemStore::GetRun(VmId vm, PoolId pool,
                                           const ObjectId& oid, PageIndex first,
                                           size_t count,
                                           std::span<uint8_t> out) {
  return impl_->GetRun(vm, pool, oid, first, count, out);
}
absl::Status TmemStore::InvalidatePage(VmId vm, PoolId pool,
                                       const ObjectId& oid, PageIndex index) {
  return impl_->InvalidatePage(vm, pool, oid, index);
}
absl::Status TmemStore::InvalidateObject(VmId vm, PoolId pool,
                                         const ObjectId& oid) {
  return impl_->InvalidateObject(vm, pool, oid);
}
absl::Status TmemStore::InvalidatePool(VmId vm, PoolId pool) {
  return impl_->InvalidatePool(vm, pool);
}
bool TmemStore::ReadDeferred(const CompactionTicket& ticket, MutablePage out) {
  return impl_->ReadDeferred(ticket, out);
}
DeferredOutcome TmemStore::CompleteDeferred(const CompactionTicket& ticket,
                                            std::span<const uint8_t> block) {
  return impl_->CompleteDeferred(ticket, block);
}
absl::Status TmemStore::SetMemoryCap(uint64_t cap_bytes) {
  return impl_->SetMemoryCap(cap_bytes);
}
HostStats TmemStore::GetHostStats() const { return impl_->GetHostStats(); }
size_t TmemStore::TrimIdleSlabs() { return impl_->TrimIdleSlabs(); }
absl::StatusOr<VmStats> TmemStore::GetVmStats(VmId vm) const {
  return impl_->GetVmStats(vm);
}

}  // namespace tmem
