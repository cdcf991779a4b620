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
#include "backend/tmem_store_impl.h"

namespace tmem {

namespace {

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

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return uint64_t{16} << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

}  // namespace

absl::StatusOr<VmId> TmemStore::Impl::AddVm(const std::string& name,
                                            const VmPolicy& policy) {
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
  const VmId id =
      (static_cast<VmId>(++generations_[slot]) << 16) | static_cast<VmId>(slot);
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

absl::StatusOr<VmId> TmemStore::Impl::FindVm(const std::string& name) const {
  MutexLock lock(&vms_mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("no VM named '", name, "'"));
  }
  return it->second->id.load(std::memory_order_relaxed);
}

std::vector<VmId> TmemStore::Impl::ListVms() const {
  MutexLock lock(&vms_mu_);
  std::vector<VmId> out;
  for (const auto& [name, vm] : by_name_) {
    out.push_back(vm->id.load(std::memory_order_relaxed));
  }
  std::sort(out.begin(), out.end(),
            [](VmId a, VmId b) { return (a & 0xFFFF) < (b & 0xFFFF); });
  return out;
}

absl::StatusOr<TmemStore::Impl::Vm*> TmemStore::Impl::LookupVm(VmId id) const {
  const uint32_t slot = id & 0xFFFF;
  if (slot >= static_cast<uint32_t>(kMaxVms)) return UnknownVm(id);
  Vm* vm = slots_[slot].load(std::memory_order_acquire);
  if (vm == nullptr || vm->id.load(std::memory_order_acquire) != id) {
    return UnknownVm(id);
  }
  return vm;
}

bool TmemStore::Impl::Gone(const Vm& vm, VmId id) {
  return vm.gone || vm.id.load(std::memory_order_relaxed) != id;
}

absl::Status TmemStore::Impl::UnknownVm(VmId id) const {
  unknown_vm_ids_refused_.fetch_add(1, std::memory_order_relaxed);
  return absl::NotFoundError(
      absl::StrCat("unknown VM id ", id, " (never added, or forgotten)"));
}

void TmemStore::Impl::ApplyPolicy(Vm& vm, const VmPolicy& policy) {
  vm.quota.store(policy.quota_bytes, std::memory_order_relaxed);
  vm.swap_quota.store(policy.swap_quota_bytes, std::memory_order_relaxed);
  vm.weight.store(policy.weight, std::memory_order_relaxed);
  vm.enabled.store(policy.enabled, std::memory_order_relaxed);
  vm.frozen.store(policy.frozen, std::memory_order_relaxed);
}

absl::Status TmemStore::Impl::SetVmPolicy(VmId id, const VmPolicy& policy) {
  absl::StatusOr<Vm*> vm = LookupVm(id);
  if (!vm.ok()) return vm.status();
  ReaderMutexLock op_lock(&(*vm)->op_mu);
  if (Gone(**vm, id)) return UnknownVm(id);
  ApplyPolicy(**vm, policy);
  // A lowered quota holds from now on: evict the VM's oldest pages. A
  // lowered swap quota evicts nothing (persistent pages are never evicted,
  // and ephemeral ones are no part of it): new persistent puts are refused
  // until the VM is back under it.
  while ((*vm)->charged() > policy.quota_bytes) {
    if (!EvictFromVm(**vm, Counter::kEvictionsQuota)) break;
  }
  return absl::OkStatus();
}

absl::Status TmemStore::Impl::SetEvictionBias(VmId id, uint32_t divisor) {
  absl::StatusOr<Vm*> vm = LookupVm(id);
  if (!vm.ok()) return vm.status();
  ReaderMutexLock op_lock(&(*vm)->op_mu);
  if (Gone(**vm, id)) return UnknownVm(id);
  (*vm)->eviction_bias.store(std::max<uint32_t>(divisor, 1),
                             std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<VmPolicy> TmemStore::Impl::GetVmPolicy(VmId id) const {
  absl::StatusOr<Vm*> vm = LookupVm(id);
  if (!vm.ok()) return vm.status();
  ReaderMutexLock op_lock(&(*vm)->op_mu);
  if (Gone(**vm, id)) return UnknownVm(id);
  VmPolicy p;
  p.quota_bytes = (*vm)->quota.load(std::memory_order_relaxed);
  p.swap_quota_bytes = (*vm)->swap_quota.load(std::memory_order_relaxed);
  p.weight = (*vm)->weight.load(std::memory_order_relaxed);
  p.enabled = (*vm)->enabled.load(std::memory_order_relaxed);
  p.frozen = (*vm)->frozen.load(std::memory_order_relaxed);
  return p;
}

absl::Status TmemStore::Impl::ForgetVm(VmId id) {
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
      for (uint32_t e = shard->table.PinnedTail(vm.slot); e != kNoEntry;
           e = shard->table.PinnedTail(vm.slot)) {
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

void TmemStore::Impl::AuthorizeSharedPool(const PoolUuid& uuid,
                                          const std::string& vm_name) {
  MutexLock lock(&pools_mu_);
  shared_auth_[uuid].insert(vm_name);
}

void TmemStore::Impl::RevokeSharedPool(const PoolUuid& uuid,
                                       const std::string& vm_name) {
  MutexLock lock(&pools_mu_);
  auto it = shared_auth_.find(uuid);
  if (it == shared_auth_.end()) return;
  it->second.erase(vm_name);
  if (it->second.empty()) shared_auth_.erase(it);
}

absl::StatusOr<PoolId> TmemStore::Impl::NewPool(VmId id, const PoolUuid* shared,
                                                PoolKind kind) {
  if (kind != PoolKind::kEphemeral && kind != PoolKind::kPersistent) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown pool kind ", static_cast<int>(kind)));
  }
  if (kind == PoolKind::kPersistent && shared != nullptr) {
    return absl::InvalidArgumentError(
        "a persistent pool is private: it cannot be shared");
  }
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
      pool->kind = kind;
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
  if (pid == static_cast<PoolId>(vm.pools.size())) vm.pools.push_back(nullptr);
  vm.pools[pid] = pool;
  return pid;
}

absl::Status TmemStore::Impl::DestroyPool(VmId id, PoolId pid) {
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

int64_t TmemStore::Impl::ReleasePoolLocked(Pool* pool) {
  if (pool->shared && --pool->members > 0) return 0;
  const int64_t removed = RemovePoolPages(*pool);
  if (pool->shared) shared_pools_.erase(pool->uuid);
  pools_.erase(pool);
  return removed;
}

absl::StatusOr<TmemStore::Impl::Pool*> TmemStore::Impl::PoolOf(const Vm& vm,
                                                               PoolId pid) {
  if (pid < 0 || pid >= static_cast<PoolId>(vm.pools.size()) ||
      vm.pools[pid] == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("VM '", vm.name, "' has no pool ", pid));
  }
  return vm.pools[pid];
}

TmemStore::Impl::Shard& TmemStore::Impl::ShardFor(const Pool& pool,
                                                  const ObjectId& oid) {
  const size_t h =
      absl::Hash<std::pair<uint64_t, ObjectId>>{}({pool.key(), oid});
  return *shards_[h % shards_.size()];
}

void TmemStore::Impl::CompactLocked(Shard& shard) {
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

TmemStore::Impl::Pool& TmemStore::Impl::RemoveEntryLocked(Shard& shard,
                                                          uint32_t e,
                                                          bool keep_blob,
                                                          CompactionSkip why) {
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
  const bool pinned = removed.pinned != 0;
  Vm* owner = slots_[removed.vm_slot].load(std::memory_order_acquire);
  if (owner != nullptr) {
    // Persistent first: a lock-free reader (Vm::MayHoldEvictable) then
    // never sees fewer evictable pages than there are.
    if (pinned) owner->counters.Add(Counter::kPersistentPagesHeld, -1);
    owner->counters.Add(Counter::kPagesHeld, -1);
    owner->counters.Add(Counter::kStoredBytes, -stored);
  }
  pool.counters.Add(Counter::kPagesHeld, -1);
  pool.counters.Add(Counter::kStoredBytes, -stored);
  if (pinned) pool.counters.Add(Counter::kPersistentPagesHeld, -1);
  AddCharge(owner, pool, pinned, -charge);
  if (gone.heir != kNoEntry) {
    // A page of the same pool now pays the object or pool slot this one
    // paid; its owner (possibly another VM sharing the pool) is charged.
    const PageEntry& heir = shard.table.entry(gone.heir);
    AddCharge(slots_[heir.vm_slot].load(std::memory_order_acquire), pool,
              heir.pinned != 0,
              static_cast<int64_t>(SharedCharge(gone.heir_gained)));
  }
  return pool;
}

void TmemStore::Impl::AddCharge(Vm* owner, Pool& pool, bool pinned,
                                int64_t delta) {
  if (owner != nullptr) {
    owner->counters.Add(Counter::kChargedBytes, delta);
    if (pinned) owner->counters.Add(Counter::kPersistentChargedBytes, delta);
  }
  pool.counters.Add(Counter::kChargedBytes, delta);
  if (pinned) pool.counters.Add(Counter::kPersistentChargedBytes, delta);
}

void TmemStore::Impl::RemoveKeyLocked(Shard& shard, Pool& pool,
                                      const ObjectId& oid, PageIndex index) {
  const uint32_t e = shard.table.FindPage(pool.key(), oid, index);
  if (e == kNoEntry) return;
  RemoveEntryLocked(shard, e, /*keep_blob=*/false, CompactionSkip::kReplaced);
  CompactLocked(shard);
}

int64_t TmemStore::Impl::RemovePoolPages(Pool& pool) {
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

EncodedPage TmemStore::Impl::Encode(ConstPage page, PutMode mode,
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

absl::StatusOr<PutResult> TmemStore::Impl::Put(VmId id, PoolId pid,
                                               const ObjectId& oid,
                                               PageIndex index, ConstPage page,
                                               PutMode mode) {
  t_op_work = 0;
  absl::StatusOr<PutResult> result = PutWork(id, pid, oid, index, page, mode);
  RecordOpWork();
  return result;
}

void TmemStore::Impl::RecordOpWork() {
  const uint64_t work = t_op_work;
  uint64_t seen = max_op_work_.load(std::memory_order_relaxed);
  while (work > seen && !max_op_work_.compare_exchange_weak(
                            seen, work, std::memory_order_relaxed)) {
  }
}

absl::StatusOr<PutResult> TmemStore::Impl::PutWork(VmId id, PoolId pid,
                                                   const ObjectId& oid,
                                                   PageIndex index,
                                                   ConstPage page,
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
    if (pool.persistent() &&
        (reason == RefuseReason::kQuota || reason == RefuseReason::kNoMemory)) {
      vm.counters.Inc(Counter::kPersistentPutsRefusedForRoom);
      pool.counters.Inc(Counter::kPersistentPutsRefusedForRoom);
    }
    result.stored = false;
    result.reason = reason;
    return result;
  };
  // Refused at the swap quota: quota to the guest (the swap backing spills
  // the page), told apart from the VM quota by its own counter.
  auto refuse_for_swap_quota = [&] {
    vm.counters.Inc(Counter::kPersistentPutsRefusedForSwapQuota);
    pool.counters.Inc(Counter::kPersistentPutsRefusedForSwapQuota);
    {
      MutexLock lock(&shard.mu);
      RemoveKeyLocked(shard, pool, oid, index);
    }
    vm.counters.Inc(RefusedCounter(RefuseReason::kQuota));
    pool.counters.Inc(RefusedCounter(RefuseReason::kQuota));
    result.stored = false;
    result.reason = RefuseReason::kQuota;
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
  const uint64_t charge = BlobCharge(SlotBytesOf(enc)) + kMaxPageMetadataCharge;
  if (charge > vm.quota.load(std::memory_order_relaxed)) {
    return refuse(RefuseReason::kQuota);
  }
  // A persistent page is reserved against the swap quota too, before any
  // eviction: evicting ephemeral pages cannot make room in it, so a put
  // past it evicts nothing. Add then check, as for the quota below, so
  // concurrent puts of one VM never overshoot together; the reservation
  // is held until the page is stored (then trimmed to its actual charge)
  // or given back on every path that does not store it.
  bool swap_reserved = false;
  if (pool.persistent()) {
    const uint64_t swap_quota = vm.swap_quota.load(std::memory_order_relaxed);
    if (charge > swap_quota) return refuse_for_swap_quota();
    vm.counters.Add(Counter::kPersistentChargedBytes,
                    static_cast<int64_t>(charge));
    if (vm.persistent_charged() > swap_quota) {
      vm.counters.Add(Counter::kPersistentChargedBytes,
                      -static_cast<int64_t>(charge));
      return refuse_for_swap_quota();
    }
    swap_reserved = true;
  }
  auto release_swap_reservation = [&] {
    if (!swap_reserved) return;
    vm.counters.Add(Counter::kPersistentChargedBytes,
                    -static_cast<int64_t>(charge));
    swap_reserved = false;
  };

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
        release_swap_reservation();
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
                                       enc.kind, payload, pool.persistent());
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
        pool.counters.Add(Counter::kChargedBytes, static_cast<int64_t>(actual));
        if (pool.persistent()) {
          vm.counters.Inc(Counter::kPersistentPagesHeld);
          // The swap quota's reservation becomes the actual charge.
          vm.counters.Add(Counter::kPersistentChargedBytes,
                          -static_cast<int64_t>(charge - actual));
          swap_reserved = false;
          pool.counters.Inc(Counter::kPersistentPagesHeld);
          pool.counters.Add(Counter::kPersistentChargedBytes,
                            static_cast<int64_t>(actual));
        }
        if (defer)
          result.deferred = QueueDeferredLocked(shard, entry, id, pool, pid,
                                                oid, index, idle_only);
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
    if (evicted == 0) {
      release_swap_reservation();
      return refuse(RefuseReason::kNoMemory);
    }
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

bool TmemStore::Impl::QueueDeferredLocked(Shard& shard, uint32_t entry, VmId id,
                                          const Pool& pool, PoolId pid,
                                          const ObjectId& oid, PageIndex index,
                                          bool idle_only) {
  CompactionQueue& queue = *options_.compaction_queue;
  CompactionTicket ticket;
  ticket.idle_only = idle_only;
  ticket.persistent = pool.persistent();
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

uint32_t TmemStore::Impl::PendingEntryLocked(Shard& shard, const Pool& pool,
                                             const CompactionTicket& t) {
  const uint32_t e = shard.table.FindPage(pool.key(), t.oid, t.index);
  if (e == kNoEntry) return kNoEntry;
  auto it = shard.deferred.find(e);
  if (it == shard.deferred.end() || it->second != t.stamp) return kNoEntry;
  return e;
}

template <typename Fn>
bool TmemStore::Impl::WithTicket(const CompactionTicket& t, Fn fn) {
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

bool TmemStore::Impl::ReadDeferred(const CompactionTicket& t, MutablePage out) {
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

DeferredOutcome TmemStore::Impl::CompleteDeferred(
    const CompactionTicket& t, std::span<const uint8_t> block) {
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
          owner->counters.Add(Counter::kStoredBytes, stored_delta);
        }
        pool.counters.Add(Counter::kStoredBytes, stored_delta);
        AddCharge(owner, pool, before.pinned != 0, charge_delta);
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

absl::StatusOr<bool> TmemStore::Impl::Get(VmId id, PoolId pid,
                                          const ObjectId& oid, PageIndex index,
                                          MutablePage out) {
  t_op_work = 0;
  absl::StatusOr<bool> hit = GetWork(id, pid, oid, index, out);
  RecordOpWork();
  return hit;
}

absl::StatusOr<bool> TmemStore::Impl::GetWork(VmId id, PoolId pid,
                                              const ObjectId& oid,
                                              PageIndex index,
                                              MutablePage out) {
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
      if (!pool.shared && !pool.persistent()) {
        // Private ephemeral pools are exclusive: the guest now holds the
        // only copy. The entry goes now; its blob is decoded after the lock
        // drops.
        taken = shard.table.entry(e);
        RemoveEntryLocked(shard, e, /*keep_blob=*/true, CompactionSkip::kRead);
        CompactLocked(shard);
      } else {
        // Shared and persistent pages stay, so a later put or invalidate
        // may free the blob once the lock drops: decode under the lock.
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

absl::StatusOr<uint64_t> TmemStore::Impl::GetRun(VmId id, PoolId pid,
                                                 const ObjectId& oid,
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
  if (pool.persistent()) return GetRunKept(vm, pool, shard, oid, first, n, out);
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
  return CountGetRun(vm, pool, n, hits, corrupt);
}

absl::StatusOr<uint64_t> TmemStore::Impl::CountGetRun(Vm& vm, Pool& pool,
                                                      size_t n, uint64_t hits,
                                                      bool corrupt) {
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

absl::StatusOr<uint64_t> TmemStore::Impl::GetRunKept(Vm& vm, Pool& pool,
                                                     Shard& shard,
                                                     const ObjectId& oid,
                                                     PageIndex first, size_t n,
                                                     std::span<uint8_t> out) {
  uint64_t hits = 0;
  bool corrupt = false;
  {
    MutexLock lock(&shard.mu);
    for (size_t k = 0; k < n; ++k) {
      const uint32_t e = shard.table.FindPage(pool.key(), oid, first + k);
      if (e == kNoEntry) continue;
      // The page stays, so a later put or invalidate may free its blob once
      // the lock drops: decode under the lock, as Get does.
      shard.table.Touch(e);
      if (DecodeEntry(shard.table.entry(e),
                      MutablePage(out.data() + k * kPageSize, kPageSize))) {
        hits |= uint64_t{1} << k;
      } else {
        corrupt = true;
        RemoveEntryLocked(shard, e);
      }
    }
    if (corrupt) CompactLocked(shard);
  }
  return CountGetRun(vm, pool, n, hits, corrupt);
}

bool TmemStore::Impl::DecodeEntry(const PageEntry& entry,
                                  MutablePage out) const {
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
absl::Status TmemStore::Impl::WithPool(VmId id, PoolId pid, Fn fn) {
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

absl::Status TmemStore::Impl::InvalidatePage(VmId id, PoolId pid,
                                             const ObjectId& oid,
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

absl::Status TmemStore::Impl::InvalidateObject(VmId id, PoolId pid,
                                               const ObjectId& oid) {
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

absl::Status TmemStore::Impl::InvalidatePool(VmId id, PoolId pid) {
  return WithPool(id, pid, [&](Vm& vm, Pool& pool) {
    const int64_t removed = RemovePoolPages(pool);
    vm.counters.Add(Counter::kPagesInvalidated, removed);
    pool.counters.Add(Counter::kPagesInvalidated, removed);
    vm.counters.Inc(Counter::kInvalidatePool);
    pool.counters.Inc(Counter::kInvalidatePool);
  });
}

bool TmemStore::Impl::HoldsBlob(StorageKind kind) {
  return kind == StorageKind::kLz4 || kind == StorageKind::kRaw;
}

absl::Status TmemStore::Impl::SetMemoryCap(uint64_t cap) {
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

HostStats TmemStore::Impl::GetHostStats() const {
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
    s.persistent_pages += vm->counters.Get(Counter::kPersistentPagesHeld);
    s.persistent_bytes += vm->counters.Get(Counter::kPersistentChargedBytes);
  }
  s.persistent_puts_refused_for_room =
      CounterValueOf(s.counters, Counter::kPersistentPutsRefusedForRoom);
  s.persistent_puts_refused_for_swap_quota =
      CounterValueOf(s.counters, Counter::kPersistentPutsRefusedForSwapQuota);
  // Read apart from `used`: a snapshot of a changing store can see a
  // charge before its bytes or the reverse, so the figure is clamped.
  s.host_overhead_bytes =
      s.memory_used_bytes - std::min(s.memory_used_bytes, s.vm_charged_bytes);
  s.vms = by_name_.size();
  for (const std::unique_ptr<Vm>& vm : vm_structs_)
    s.vm_structs += vm != nullptr;
  return s;
}

absl::StatusOr<VmStats> TmemStore::Impl::GetVmStats(VmId id) const {
  absl::StatusOr<Vm*> found = LookupVm(id);
  if (!found.ok()) return found.status();
  Vm& vm = **found;
  ReaderMutexLock op_lock(&vm.op_mu);
  if (Gone(vm, id)) return UnknownVm(id);
  VmStats s;
  s.id = vm.id.load(std::memory_order_relaxed);
  s.name = vm.name;
  s.policy.quota_bytes = vm.quota.load(std::memory_order_relaxed);
  s.policy.swap_quota_bytes = vm.swap_quota.load(std::memory_order_relaxed);
  s.policy.weight = vm.weight.load(std::memory_order_relaxed);
  s.policy.enabled = vm.enabled.load(std::memory_order_relaxed);
  s.policy.frozen = vm.frozen.load(std::memory_order_relaxed);
  s.counters = vm.counters.Snapshot();
  s.persistent_pages =
      CounterValueOf(s.counters, Counter::kPersistentPagesHeld);
  s.persistent_bytes =
      CounterValueOf(s.counters, Counter::kPersistentChargedBytes);
  for (PoolId pid = 0; pid < static_cast<PoolId>(vm.pools.size()); ++pid) {
    const Pool* pool = vm.pools[pid];
    if (pool == nullptr) continue;
    PoolStats p;
    p.id = pid;
    p.shared = pool->shared;
    p.kind = pool->kind;
    p.uuid = pool->uuid;
    p.counters = pool->counters.Snapshot();
    s.pools.push_back(p);
  }
  return s;
}

absl::StatusOr<PersistentExcess> TmemStore::Impl::PersistentExcessBytes(
    VmId id) const {
  absl::StatusOr<Vm*> found = LookupVm(id);
  if (!found.ok()) return found.status();
  // The policy as the store keeps it (the swap quota included).
  absl::StatusOr<VmPolicy> policy = GetVmPolicy(id);
  if (!policy.ok()) return policy.status();
  const Vm& me = **found;
  PersistentExcess out;
  out.persistent_bytes = me.counters.Get(Counter::kPersistentChargedBytes);
  const uint64_t charged = me.charged();
  if (charged > policy->quota_bytes) {
    out.over_quota =
        std::min(out.persistent_bytes, charged - policy->quota_bytes);
  }
  if (out.persistent_bytes > policy->swap_quota_bytes) {
    out.over_swap_quota = out.persistent_bytes - policy->swap_quota_bytes;
  }

  // The host's excess, in charge (see the header), and who gives it.
  struct Share {
    uint64_t charged;
    uint64_t persistent;
    uint64_t weight;
  };
  std::vector<Share> shares;
  int mine = -1;
  uint64_t charged_total = 0;
  uint64_t persistent_total = 0;
  const int high = max_slot_.load(std::memory_order_relaxed);
  for (int i = 0; i <= high; ++i) {
    const Vm* vm = slots_[i].load(std::memory_order_acquire);
    if (vm == nullptr) continue;
    const uint64_t c = vm->charged();
    charged_total += c;
    const uint64_t p = vm->counters.Get(Counter::kPersistentChargedBytes);
    if (p == 0 && vm != &me) continue;
    persistent_total += p;
    if (vm == &me) mine = static_cast<int>(shares.size());
    shares.push_back(
        {c, p,
         std::max<uint64_t>(1, vm->weight.load(std::memory_order_relaxed))});
  }
  const uint64_t held = std::min(budget_->used(), charged_total);
  const uint64_t cap = budget_->cap();
  const uint64_t host_excess =
      held > cap ? std::min(held - cap, persistent_total) : 0;
  if (host_excess > 0 && mine >= 0 && out.persistent_bytes > 0) {
    // What VM i gives at level L (bytes per unit of weight): its charge
    // above L * weight, at most its persistent charge. Non-increasing in
    // L; find the highest L at which the VMs give the excess.
    auto give = [](const Share& s, uint64_t level) -> uint64_t {
      const unsigned __int128 keep =
          static_cast<unsigned __int128>(level) * s.weight;
      if (keep >= s.charged) return 0;
      return std::min<uint64_t>(s.persistent,
                                s.charged - static_cast<uint64_t>(keep));
    };
    auto total_at = [&](uint64_t level) {
      unsigned __int128 sum = 0;
      for (const Share& s : shares) sum += give(s, level);
      return sum;
    };
    uint64_t lo = 0;  // gives at least the excess (all persistent pages)
    uint64_t hi = 0;  // gives nothing
    for (const Share& s : shares) hi = std::max(hi, s.charged / s.weight + 1);
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      if (total_at(mid) >= host_excess) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    out.host_cap_share = give(shares[mine], lo);
  }
  out.bytes =
      std::max({out.over_quota, out.over_swap_quota, out.host_cap_share});
  return out;
}

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
absl::StatusOr<PoolId> TmemStore::NewPool(VmId vm, const PoolUuid* shared,
                                          PoolKind kind) {
  return impl_->NewPool(vm, shared, kind);
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
absl::StatusOr<PersistentExcess> TmemStore::PersistentExcessBytes(
    VmId vm) const {
  return impl_->PersistentExcessBytes(vm);
}

}  // namespace tmem
