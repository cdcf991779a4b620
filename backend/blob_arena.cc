#include "backend/blob_arena.h"

#include <sys/mman.h>

#include <cassert>
#include <cstdlib>
#include <cstring>

namespace tmem {

BlobArena::BlobArena(SlabPool* pool, MemoryBudget* budget)
    : pool_(pool), budget_(budget) {
  void* m = mmap(nullptr, pool->max_slabs() * sizeof(SlabDesc),
                 PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  // The reservation is 1/4096 of the SlabPool's, which did succeed.
  if (m == MAP_FAILED) std::abort();
  descs_ = static_cast<SlabDesc*>(m);
}

BlobArena::~BlobArena() {
  // Slabs still holding blobs go back to the pool; their owners (the shard
  // tables) are gone by now.
  for (uint64_t i = 0; i < pool_->high_water(); ++i) {
    // Untouched descriptors read as zero: used == 0.
    if (descs_[i].used != 0) {
      pool_->Release(static_cast<uint32_t>(i));
      budget_->Release(kDescriptorBytes);
    }
  }
  munmap(descs_, pool_->max_slabs() * sizeof(SlabDesc));
}

void BlobArena::LinkPartial(ClassState& cls, uint32_t slab) {
  SlabDesc& d = descs_[slab];
  d.prev = kNone;
  d.next = cls.partial_head;
  if (cls.partial_head != kNone) descs_[cls.partial_head].prev = slab;
  cls.partial_head = slab;
}

void BlobArena::UnlinkPartial(ClassState& cls, uint32_t slab) {
  SlabDesc& d = descs_[slab];
  if (d.prev != kNone) {
    descs_[d.prev].next = d.next;
  } else {
    cls.partial_head = d.next;
  }
  if (d.next != kNone) descs_[d.next].prev = d.prev;
  d.prev = d.next = kNone;
}

std::optional<BlobRef> BlobArena::Store(std::span<const uint8_t> data) {
  assert(!data.empty() && data.size() <= kPageSize);
  const size_t slot_bytes = BlobSlotBytes(data.size());
  const size_t blob_class = slot_bytes / kBlobClassBytes - 1;
  ClassState& cls = classes_[blob_class];
  uint32_t slab;
  uint16_t slot;
  {
    MutexLock lock(&cls.mu);
    slab = cls.partial_head;
    if (slab == kNone) {
      if (!budget_->TryCharge(kDescriptorBytes)) return std::nullopt;
      slab = pool_->Acquire();
      if (slab == SlabPool::kNoSlab) {
        budget_->Release(kDescriptorBytes);
        return std::nullopt;
      }
      descs_[slab] = SlabDesc{
          kNone, kNone, 0, kNoSlot, 0, static_cast<uint16_t>(blob_class)};
      LinkPartial(cls, slab);
    }
    SlabDesc& d = descs_[slab];
    if (d.free_head != kNoSlot) {
      slot = d.free_head;
      std::memcpy(&d.free_head, pool_->SlabAddress(slab) + slot * slot_bytes,
                  sizeof(d.free_head));
    } else {
      slot = d.bump++;
    }
    if (++d.used == SlotsPerSlab(blob_class)) UnlinkPartial(cls, slab);
    cls.slot_bytes_in_use += slot_bytes;
  }
  // The slot is ours alone now; copy without the class lock.
  std::memcpy(pool_->SlabAddress(slab) + slot * slot_bytes, data.data(),
              data.size());
  return BlobRef{
      slab, slot,
      static_cast<uint16_t>(data.size() == kPageSize ? 0 : data.size())};
}

void BlobArena::Free(BlobRef ref) {
  const size_t slot_bytes = ref.slot_bytes();
  const size_t blob_class = slot_bytes / kBlobClassBytes - 1;
  ClassState& cls = classes_[blob_class];
  bool release = false;
  {
    MutexLock lock(&cls.mu);
    SlabDesc& d = descs_[ref.slab];
    assert(d.blob_class == blob_class && d.used > 0);
    const bool was_full = d.used == SlotsPerSlab(blob_class);
    cls.slot_bytes_in_use -= slot_bytes;
    if (--d.used == 0) {
      if (!was_full) UnlinkPartial(cls, ref.slab);
      release = true;
    } else {
      std::memcpy(pool_->SlabAddress(ref.slab) + size_t{ref.slot} * slot_bytes,
                  &d.free_head, sizeof(d.free_head));
      d.free_head = ref.slot;
      if (was_full) LinkPartial(cls, ref.slab);
    }
  }
  if (release) {
    // The slab left its class under the lock; nobody else can reach it.
    pool_->Release(ref.slab);
    budget_->Release(kDescriptorBytes);
  }
}

uint32_t BlobArena::LiveBlobsInSlabOf(BlobRef ref) {
  ClassState& cls = classes_[ref.slot_bytes() / kBlobClassBytes - 1];
  MutexLock lock(&cls.mu);
  return descs_[ref.slab].used;
}

uint64_t BlobArena::slot_bytes_in_use() const {
  uint64_t total = 0;
  for (const ClassState& cls : classes_) {
    MutexLock lock(&const_cast<ClassState&>(cls).mu);
    total += cls.slot_bytes_in_use;
  }
  return total;
}

}  // namespace tmem
