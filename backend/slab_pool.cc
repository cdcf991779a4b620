#include "backend/slab_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem {
namespace {
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // <linux/mman.h>, Linux 5.14
#endif
}  // namespace

absl::StatusOr<std::unique_ptr<SlabPool>> SlabPool::Create(
    MemoryBudget* budget, uint64_t address_space_bytes) {
  const uint64_t slabs = (address_space_bytes + kSlabBytes - 1) / kSlabBytes;
  if (slabs == 0 || slabs >= UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("slab pool size ", address_space_bytes,
                     " bytes is out of range (1 slab .. 2^32 slabs)"));
  }
  void* base = mmap(nullptr, slabs * kSlabBytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve ", slabs * kSlabBytes,
                     " bytes of address space for blobs: ",
                     std::generic_category().message(errno)));
  }
  return std::unique_ptr<SlabPool>(
      new SlabPool(budget, static_cast<uint8_t*>(base), slabs));
}

SlabPool::SlabPool(MemoryBudget* budget, uint8_t* base, uint64_t max_slabs)
    : budget_(budget),
      base_(base),
      max_slabs_(max_slabs),
      free_list_charge_(budget) {
  MutexLock lock(&mu_);
  cached_.reserve(kMaxCachedSlabs);
}

SlabPool::~SlabPool() {
  munmap(base_, max_slabs_ * kSlabBytes);
  MutexLock lock(&mu_);
  budget_->Release(in_use_ * kSlabBytes);
}

uint32_t SlabPool::Acquire() {
  {
    MutexLock lock(&mu_);
    if (!cached_.empty()) {
      const uint32_t index = cached_.back();
      cached_.pop_back();
      return index;
    }
  }
  if (!budget_->TryCharge(kSlabBytes)) return kNoSlab;
  const uint32_t index = TakeFresh();
  if (index == kNoSlab) {
    budget_->Release(kSlabBytes);
    return kNoSlab;
  }
  Populate(index);  // outside the lock: it zeroes 64 KiB
  return index;
}

uint32_t SlabPool::TakeFresh() {
  MutexLock lock(&mu_);
  uint32_t index;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else if (next_unused_ < max_slabs_) {
    // Every slab handed out may come back to the free list; reserve its
    // place now so that returning a slab never allocates.
    if (free_.capacity() <= next_unused_) {
      const size_t cap = std::max<size_t>(64, 2 * free_.capacity());
      if (!free_list_charge_.TryGrow(
              cap * sizeof(uint32_t),
              // Runs inside TryGrow, still under mu_.
              [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { free_.reserve(cap); })) {
        return kNoSlab;
      }
    }
    index = static_cast<uint32_t>(next_unused_++);
  } else {
    return kNoSlab;
  }
  ++in_use_;
  return index;
}

void SlabPool::Populate(uint32_t slab) {
  // A fresh slab's pages would each fault on first touch, in the middle of
  // a put's copy: one call maps all 16 of them (Linux 5.14+; older kernels
  // say EINVAL once and fault as before).
  if (!populate_.load(std::memory_order_relaxed)) return;
  if (madvise(SlabAddress(slab), kSlabBytes, kMadvPopulateWrite) != 0 &&
      errno == EINVAL) {
    populate_.store(false, std::memory_order_relaxed);
  }
}

size_t SlabPool::CacheLimit() const {
  return std::clamp<size_t>(budget_->cap() / 16 / kSlabBytes, kCachedSlabs,
                            kMaxCachedSlabs);
}

void SlabPool::Release(uint32_t slab) {
  {
    MutexLock lock(&mu_);
    // Keep it while the budget has room: a full budget wants its bytes back
    // now so metadata can take them.
    if (cached_.size() < CacheLimit() && !budget_->OverCap()) {
      cached_.push_back(slab);  // capacity reserved at construction
      return;
    }
  }
  ReturnToOs(slab);
}

void SlabPool::TrimCache() { TrimCacheTo(0); }

size_t SlabPool::TrimCacheTo(size_t keep) {
  std::vector<uint32_t> slabs;
  {
    MutexLock lock(&mu_);
    if (cached_.size() <= keep) return 0;
    // The most recently released stay: their pages are the warmest.
    slabs.assign(cached_.begin(),
                 cached_.end() - static_cast<std::ptrdiff_t>(keep));
    cached_.erase(cached_.begin(),
                  cached_.end() - static_cast<std::ptrdiff_t>(keep));
  }
  const size_t n = slabs.size();
  ReturnToOs(std::move(slabs));
  return n;
}

void SlabPool::ReturnToOs(std::vector<uint32_t> slabs) {
  std::sort(slabs.begin(), slabs.end());
  for (size_t i = 0; i < slabs.size();) {
    size_t j = i + 1;
    while (j < slabs.size() && slabs[j] == slabs[j - 1] + 1) ++j;
    madvise(SlabAddress(slabs[i]), (j - i) * kSlabBytes, MADV_DONTNEED);
    i = j;
  }
  {
    MutexLock lock(&mu_);
    for (uint32_t slab : slabs) free_.push_back(slab);  // capacity reserved
    in_use_ -= slabs.size();
  }
  budget_->Release(slabs.size() * kSlabBytes);
}

void SlabPool::ReturnToOs(uint32_t slab) {
  // The pages go back to the OS now; the next Acquire of this slab faults in
  // fresh zero pages. That is what makes "bytes charged" an upper bound on
  // what the store really holds.
  madvise(SlabAddress(slab), kSlabBytes, MADV_DONTNEED);
  {
    MutexLock lock(&mu_);
    free_.push_back(slab);  // capacity reserved in Acquire
    --in_use_;
  }
  budget_->Release(kSlabBytes);
}

uint64_t SlabPool::high_water() const {
  MutexLock lock(&mu_);
  return next_unused_;
}

uint64_t SlabPool::slabs_in_use() const {
  MutexLock lock(&mu_);
  return in_use_;
}

}  // namespace tmem
