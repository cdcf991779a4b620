// BlobArena: the size-class slab allocator for compressed and raw pages.
//
// Sizes round up to 64-byte classes (64 .. 4096 bytes, 64 classes), so a blob
// wastes 32 bytes on average and every slot is cache-line aligned. Each 64 KiB
// slab (from SlabPool) serves one class. Slabs with free slots sit on their
// class's partial list; a slab that becomes empty goes straight back to the
// SlabPool, where any class can reuse it.
//
// One arena serves the whole store: a slot freed by any shard is reusable by
// a put to any other, so fragmentation is bounded by classes (64 partial
// slabs at most hold free slots that no put can use), not by shards x classes.
//
// A blob is named by a BlobRef (slab, slot, length) packed into 64 bits. The
// slot size follows from the length, so reading a blob needs no lock and no
// descriptor.
//
// Thread-safe. Store and Free take the mutex of one size class (held for a
// few list operations; the copy into the slot happens outside it). Read is
// lock-free; the caller guarantees the blob stays live (the owning shard's
// lock, or having removed the page that references it).
// Lock order: (shard) -> class mutex -> SlabPool mutex.
#ifndef TMEMD_BACKEND_BLOB_ARENA_H_
#define TMEMD_BACKEND_BLOB_ARENA_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "absl/base/thread_annotations.h"
#include "backend/memory_budget.h"
#include "backend/mutex.h"
#include "backend/slab_pool.h"
#include "backend/types.h"

namespace tmem {

inline constexpr size_t kBlobClassBytes = 64;
inline constexpr size_t kNumBlobClasses = kPageSize / kBlobClassBytes;

// Bytes a blob of `length` occupies in its slot.
inline constexpr size_t BlobSlotBytes(size_t length) {
  return (length + kBlobClassBytes - 1) / kBlobClassBytes * kBlobClassBytes;
}

struct BlobRef {
  uint32_t slab = 0;    // SlabPool index
  uint16_t slot = 0;    // slot within the slab
  uint16_t length = 0;  // bytes of payload, 1 .. 4096 (4096 stored as 0)

  uint64_t Pack() const {
    return (uint64_t{slab} << 32) | (uint64_t{slot} << 16) | length;
  }
  static BlobRef Unpack(uint64_t v) {
    return BlobRef{static_cast<uint32_t>(v >> 32),
                   static_cast<uint16_t>(v >> 16), static_cast<uint16_t>(v)};
  }
  size_t bytes() const { return length == 0 ? kPageSize : length; }
  size_t slot_bytes() const { return BlobSlotBytes(bytes()); }
};

class BlobArena {
 public:
  // Descriptor bytes per slab in use, charged to `budget` with the slab.
  static constexpr uint64_t kDescriptorBytes = 16;

  BlobArena(SlabPool* pool, MemoryBudget* budget);
  ~BlobArena();
  BlobArena(const BlobArena&) = delete;
  BlobArena& operator=(const BlobArena&) = delete;

  // Allocates a slot for `data` (1..4096 bytes) and copies it in. Returns
  // nullopt when a new slab is needed and the SlabPool has none (the host cap
  // is reached): the caller evicts and retries.
  std::optional<BlobRef> Store(std::span<const uint8_t> data);
  // The payload of a live blob.
  std::span<const uint8_t> Read(BlobRef ref) const {
    return {pool_->SlabAddress(ref.slab) + size_t{ref.slot} * ref.slot_bytes(),
            ref.bytes()};
  }
  // Frees a live blob.
  void Free(BlobRef ref);
  // Live blobs in the slab holding `ref`, which the caller keeps live (its
  // shard's lock held), so the slab cannot change class meanwhile.
  uint32_t LiveBlobsInSlabOf(BlobRef ref);

  // Slot bytes of live blobs (what fragmentation is measured against).
  uint64_t slot_bytes_in_use() const;

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  static constexpr uint16_t kNoSlot = UINT16_MAX;

  struct SlabDesc {
    uint32_t prev;  // partial-list links (class mutex)
    uint32_t next;
    uint16_t used;       // live slots
    uint16_t free_head;  // freed slots, linked through their first bytes
    uint16_t bump;       // slots [bump, capacity) never used yet
    uint16_t blob_class;
  };
  static_assert(sizeof(SlabDesc) == kDescriptorBytes);

  struct alignas(64) ClassState {
    Mutex mu;
    uint32_t partial_head ABSL_GUARDED_BY(mu) = kNone;
    uint64_t slot_bytes_in_use ABSL_GUARDED_BY(mu) = 0;
  };

  static size_t SlotsPerSlab(size_t blob_class) {
    return kSlabBytes / ((blob_class + 1) * kBlobClassBytes);
  }
  void LinkPartial(ClassState& cls, uint32_t slab)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(cls.mu);
  void UnlinkPartial(ClassState& cls, uint32_t slab)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(cls.mu);

  SlabPool* const pool_;
  MemoryBudget* const budget_;
  // One descriptor per slab the pool could hand out, in a MAP_NORESERVE
  // mapping: only descriptors of slabs actually used are ever touched.
  SlabDesc* descs_;
  std::array<ClassState, kNumBlobClasses> classes_;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_BLOB_ARENA_H_
