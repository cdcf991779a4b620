// Eviction: whom to evict and which pages, so that a put, a lowered cap or
// a lowered quota finds room (tmem_store.h: "Eviction when the host is
// full", "Bounded work").
#include <algorithm>
#include <cassert>
#include <climits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "backend/fair_share.h"
#include "backend/tmem_store_impl.h"

namespace tmem {

void TmemStore::Impl::NotifyEvictionLocked(Shard& shard, uint32_t e) {
  if (options_.eviction_listener == nullptr) return;
  const PageEntry& entry = shard.table.entry(e);
  const Vm* owner = slots_[entry.vm_slot].load(std::memory_order_acquire);
  if (owner == nullptr) return;
  options_.eviction_listener->OnEvicted(
      owner->id.load(std::memory_order_relaxed),
      KeyHash(shard.table.object(entry.object).oid, entry.index));
}

bool TmemStore::Impl::EvictFromVm(Vm& vm, Counter reason, size_t slot_bytes,
                                  bool* found_class) {
  // Only persistent pages (or none): nothing on its LRU lists to walk.
  if (!vm.MayHoldEvictable()) return false;
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

void TmemStore::Impl::EvictLocked(Shard& shard, uint32_t e, Vm& owner,
                                  Counter reason) {
  assert(shard.table.entry(e).pinned == 0 &&
         "a persistent page is never evicted");
  ++t_op_work;
  NotifyEvictionLocked(shard, e);
  Pool& pool = RemoveEntryLocked(shard, e, /*keep_blob=*/false,
                                 CompactionSkip::kEvicted);
  owner.counters.Inc(reason);
  pool.counters.Inc(reason);
}

uint32_t TmemStore::Impl::EvictEmptiestSlab(
    const std::vector<Vm*>& vms, const std::vector<bool>& evictable) {
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

uint32_t TmemStore::Impl::EvictBatchFromVm(Vm& vm, uint32_t count) {
  if (!vm.MayHoldEvictable()) return 0;
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

void TmemStore::Impl::CollectShares(std::vector<Vm*>& vms,
                                    std::vector<ShareInput>& inputs) {
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

bool TmemStore::Impl::EvictInShardLocked(Shard& shard) {
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

uint32_t TmemStore::Impl::EvictForHost(Room room, size_t slot_bytes,
                                       bool* found_class) {
  std::vector<Vm*> vms;
  std::vector<ShareInput> inputs;
  CollectShares(vms, inputs);
  // Victims are the VMs that may hold an evictable page, furthest over
  // their share first; how far over counts every page (persistent ones
  // too), but a VM holding only persistent pages has nothing to give.
  std::vector<ShareInput> victims = inputs;
  for (size_t i = 0; i < vms.size(); ++i) {
    if (!vms[i]->MayHoldEvictable()) victims[i].charged_bytes = 0;
  }
  if (room == Room::kWholeSlab) {
    const int furthest = PickEvictionVictim(victims);
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
    const int victim = PickEvictionVictim(victims);
    if (victim < 0) return 0;
    if (room == Room::kWholeSlab) {
      if (const uint32_t evicted =
              EvictBatchFromVm(*vms[victim], kEvictBatch)) {
        return evicted;
      }
    } else if (EvictFromVm(*vms[victim], Counter::kEvictionsHostCap, slot_bytes,
                           found_class)) {
      return 1;
    }
    victims[victim].charged_bytes = 0;
  }
  return 0;
}

uint32_t TmemStore::Impl::EvictUntilWithinCap(int max_rounds) {
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

}  // namespace tmem
