// SlabPool: the only place blob memory comes from the OS.
//
// One virtual-address reservation (MAP_NORESERVE, so nothing is committed
// until touched) is cut into fixed 64 KiB slabs. A slab counts against the
// MemoryBudget from Acquire until it is handed back to the OS with
// MADV_DONTNEED. Released slabs are kept (still charged) for the next
// Acquire, up to kMaxCachedSlabs or 1/16 of the cap, so a store that empties
// and refills (exclusive gets, then puts; a pool wiped, then refilled) does
// not fault pages in and out on every slab: each MADV_DONTNEED is a TLB
// shootdown on every CPU, and it and the refault were a third of tmemd's CPU
// under a re-reading real guest. The owner's periodic TrimCacheTo gives back
// what stayed unused beyond kCachedSlabs, in as few calls as the slabs'
// address ranges allow, off the data path; TrimCache gives back everything
// when the budget needs the room now. Because every slab
// has the same size, a slab freed by one size class or shard is reusable by any
// other, which is what keeps fragmentation from pinning memory: an emptied slab
// is never stranded.
//
// Thread-safe. Acquire/Release take a small internal mutex (once per 64 KiB of
// blobs, not per page).
#ifndef TMEMD_BACKEND_SLAB_POOL_H_
#define TMEMD_BACKEND_SLAB_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "backend/charged_capacity.h"
#include "backend/memory_budget.h"
#include "backend/mutex.h"

namespace tmem {

inline constexpr size_t kSlabBytes = size_t{64} * 1024;

class SlabPool {
 public:
  // Reserves `address_space_bytes` (rounded up to whole slabs) of virtual
  // memory. Fails with RESOURCE_EXHAUSTED if mmap refuses.
  static absl::StatusOr<std::unique_ptr<SlabPool>> Create(
      MemoryBudget* budget, uint64_t address_space_bytes);
  ~SlabPool();
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  static constexpr uint32_t kNoSlab = UINT32_MAX;
  // Kept warm by TrimCacheTo; at most this many are cached between trims
  // (and at most 1/16 of the budget's cap).
  static constexpr size_t kCachedSlabs = 8;
  static constexpr size_t kMaxCachedSlabs = 1024;

  // Returns the index of a slab of kSlabBytes (contents unspecified), charged
  // to the budget, or kNoSlab when the budget or the reservation is
  // exhausted.
  uint32_t Acquire();
  // Returns a slab (from Acquire): into the cache, else to the OS, uncharged.
  void Release(uint32_t slab);
  // Returns every cached slab to the OS and uncharges it.
  void TrimCache();
  // Returns cached slabs beyond `keep` to the OS (contiguous slabs in one
  // madvise) and uncharges them; the number returned.
  size_t TrimCacheTo(size_t keep);
  // Address of a slab; stable for the pool's lifetime. Lock-free.
  uint8_t* SlabAddress(uint32_t slab) const {
    return base_ + uint64_t{slab} * kSlabBytes;
  }

  // Slabs charged to the budget: handed out plus cached.
  uint64_t slabs_in_use() const;
  // Slab indexes ever handed out are all below this.
  uint64_t high_water() const;
  uint64_t max_slabs() const { return max_slabs_; }

 private:
  SlabPool(MemoryBudget* budget, uint8_t* base, uint64_t max_slabs);
  void ReturnToOs(uint32_t slab);
  // The same for many slabs: one madvise per run of adjacent slabs.
  void ReturnToOs(std::vector<uint32_t> slabs);
  size_t CacheLimit() const;
  // A slab from the free list or the unused reservation (kNoSlab if none),
  // counted in use; the caller has charged it.
  uint32_t TakeFresh();
  // Maps a fresh slab's pages in one call instead of a fault per page.
  void Populate(uint32_t slab);

  MemoryBudget* const budget_;
  uint8_t* const base_;
  const uint64_t max_slabs_;

  std::atomic<bool> populate_{true};  // until the kernel says EINVAL
  mutable Mutex mu_;
  uint64_t next_unused_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);    // returned to the OS
  std::vector<uint32_t> cached_ ABSL_GUARDED_BY(mu_);  // charged, reusable
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  // The free list is metadata too.
  ChargedCapacity free_list_charge_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_SLAB_POOL_H_
