// Tests for SlabPool (backend/slab_pool.h): slabs are charged to the budget
// from Acquire until they go back to the OS (a few stay cached, charged,
// until TrimCache), Acquire fails cleanly at the cap and at the end of the
// reservation, and released slabs are reusable.
#include "backend/slab_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "backend/memory_budget.h"
#include "gtest/gtest.h"

namespace tmem {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

std::unique_ptr<SlabPool> MakePool(MemoryBudget* budget, uint64_t bytes) {
  absl::StatusOr<std::unique_ptr<SlabPool>> pool =
      SlabPool::Create(budget, bytes);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

TEST(SlabPoolTest, ReservationIsRoundedUpToWholeSlabs) {
  MemoryBudget budget(kGiB);
  EXPECT_EQ(MakePool(&budget, kSlabBytes)->max_slabs(), 1u);
  EXPECT_EQ(MakePool(&budget, kSlabBytes + 1)->max_slabs(), 2u);
  EXPECT_EQ(MakePool(&budget, 10 * kSlabBytes)->max_slabs(), 10u);
  EXPECT_EQ(budget.used(), 0u) << "reserving address space costs nothing";
}

TEST(SlabPoolTest, AcquireChargesAndReleaseUncharges) {
  MemoryBudget budget(kGiB);
  {
    auto pool = MakePool(&budget, 32 * kSlabBytes);
    // More slabs than a trim keeps, so some go back to the OS.
    constexpr int kSlabs = SlabPool::kCachedSlabs + 8;
    std::vector<uint32_t> slabs;
    for (int i = 0; i < kSlabs; ++i) {
      const uint32_t slab = pool->Acquire();
      ASSERT_NE(slab, SlabPool::kNoSlab);
      EXPECT_LT(slab, pool->max_slabs());
      EXPECT_LT(slab, pool->high_water());
      slabs.push_back(slab);
      EXPECT_EQ(pool->slabs_in_use(), static_cast<uint64_t>(i + 1));
      EXPECT_GE(budget.used(), (i + 1) * kSlabBytes);
    }
    const uint64_t used_full = budget.used();
    for (uint32_t slab : slabs) pool->Release(slab);
    // All are kept, charged, for reuse (the cap has room for 1024)...
    EXPECT_EQ(pool->slabs_in_use(), static_cast<uint64_t>(kSlabs));
    EXPECT_EQ(budget.used(), used_full);
    // ...until a trim gives back all but kCachedSlabs, uncharged.
    EXPECT_EQ(pool->TrimCacheTo(SlabPool::kCachedSlabs), 8u);
    EXPECT_EQ(pool->TrimCacheTo(SlabPool::kCachedSlabs), 0u);
    EXPECT_EQ(pool->slabs_in_use(), SlabPool::kCachedSlabs);
    EXPECT_LE(budget.used(), SlabPool::kCachedSlabs * kSlabBytes + 1024);
    EXPECT_LE(budget.used() + (kSlabs - SlabPool::kCachedSlabs) * kSlabBytes,
              used_full + 1024);

    // Cached slabs are what Acquire hands out first: no new charge.
    const uint64_t used_cached = budget.used();
    const uint32_t again = pool->Acquire();
    ASSERT_NE(again, SlabPool::kNoSlab);
    EXPECT_EQ(budget.used(), used_cached);
    EXPECT_EQ(pool->slabs_in_use(), SlabPool::kCachedSlabs);
    pool->Release(again);

    // TrimCache hands every cached slab back.
    pool->TrimCache();
    EXPECT_EQ(pool->slabs_in_use(), 0u);
    EXPECT_LT(budget.used(), kSlabBytes) << "only free-list bookkeeping";
  }
  EXPECT_EQ(budget.used(), 0u) << "destroying the pool releases everything";
}

// Between trims the cache holds at most 1/16 of the cap (but kCachedSlabs
// at least): a small cap is not filled with empty slabs.
TEST(SlabPoolTest, CacheIsBoundedByTheCap) {
  MemoryBudget budget(64 * kSlabBytes);  // 1/16 is 4 slabs: 8 are kept
  auto pool = MakePool(&budget, 64 * kSlabBytes);
  std::vector<uint32_t> slabs;
  for (int i = 0; i < 32; ++i) {
    const uint32_t slab = pool->Acquire();
    ASSERT_NE(slab, SlabPool::kNoSlab);
    slabs.push_back(slab);
  }
  for (uint32_t slab : slabs) pool->Release(slab);
  EXPECT_EQ(pool->slabs_in_use(), SlabPool::kCachedSlabs);
  EXPECT_EQ(pool->TrimCacheTo(SlabPool::kCachedSlabs), 0u);
  EXPECT_LE(budget.used(), SlabPool::kCachedSlabs * kSlabBytes + 1024);
}

TEST(SlabPoolTest, DestroyingPoolWithCachedSlabsReleasesTheirCharge) {
  MemoryBudget budget(kGiB);
  {
    auto pool = MakePool(&budget, 8 * kSlabBytes);
    const uint32_t a = pool->Acquire();
    ASSERT_NE(a, SlabPool::kNoSlab);
    pool->Release(a);  // cached, still charged
    EXPECT_GE(budget.used(), kSlabBytes);
  }
  EXPECT_EQ(budget.used(), 0u);
}

TEST(SlabPoolTest, DestroyingPoolWithSlabsInUseReleasesTheirCharge) {
  MemoryBudget budget(kGiB);
  {
    auto pool = MakePool(&budget, 8 * kSlabBytes);
    ASSERT_NE(pool->Acquire(), SlabPool::kNoSlab);
    ASSERT_NE(pool->Acquire(), SlabPool::kNoSlab);
    EXPECT_GE(budget.used(), 2 * kSlabBytes);
  }
  EXPECT_EQ(budget.used(), 0u);
}

TEST(SlabPoolTest, SlabsAreDistinctWritableAndDoNotOverlap) {
  MemoryBudget budget(kGiB);
  auto pool = MakePool(&budget, 32 * kSlabBytes);
  std::vector<uint32_t> slabs;
  for (int i = 0; i < 32; ++i) {
    const uint32_t slab = pool->Acquire();
    ASSERT_NE(slab, SlabPool::kNoSlab);
    std::memset(pool->SlabAddress(slab), i + 1, kSlabBytes);  // all usable
    slabs.push_back(slab);
  }
  std::vector<uint8_t*> addresses;
  for (uint32_t slab : slabs) addresses.push_back(pool->SlabAddress(slab));
  std::sort(addresses.begin(), addresses.end());
  for (size_t i = 1; i < addresses.size(); ++i) {
    EXPECT_GE(addresses[i], addresses[i - 1] + kSlabBytes) << "overlap";
  }
  for (int i = 0; i < 32; ++i) {
    // Each slab still holds its own fill: nobody else wrote into it.
    const uint8_t* p = pool->SlabAddress(slabs[i]);
    EXPECT_EQ(p[0], i + 1);
    EXPECT_EQ(p[kSlabBytes / 2], i + 1);
    EXPECT_EQ(p[kSlabBytes - 1], i + 1);
  }
  EXPECT_LE(pool->high_water(), pool->max_slabs());
  for (uint32_t slab : slabs) pool->Release(slab);
}

TEST(SlabPoolTest, AcquireReturnsNoSlabAtTheBudgetCap) {
  MemoryBudget budget(3 * kSlabBytes + kSlabBytes / 2);
  auto pool = MakePool(&budget, 100 * kSlabBytes);
  const uint32_t a = pool->Acquire();
  const uint32_t b = pool->Acquire();
  const uint32_t c = pool->Acquire();
  ASSERT_NE(a, SlabPool::kNoSlab);
  ASSERT_NE(b, SlabPool::kNoSlab);
  ASSERT_NE(c, SlabPool::kNoSlab);
  const uint64_t used = budget.used();
  EXPECT_EQ(pool->Acquire(), SlabPool::kNoSlab);
  EXPECT_EQ(budget.used(), used) << "a failed Acquire charges nothing";
  EXPECT_EQ(pool->slabs_in_use(), 3u);
  EXPECT_LE(budget.used(), budget.cap());

  pool->Release(b);
  const uint32_t d = pool->Acquire();
  EXPECT_NE(d, SlabPool::kNoSlab) << "a released slab is available again";
  pool->Release(a);
  pool->Release(c);
  pool->Release(d);
  pool->TrimCache();
  EXPECT_EQ(pool->slabs_in_use(), 0u);
}

TEST(SlabPoolTest, AcquireReturnsNoSlabWhenTheReservationIsExhausted) {
  MemoryBudget budget(kGiB);
  auto pool = MakePool(&budget, 2 * kSlabBytes);
  const uint32_t a = pool->Acquire();
  const uint32_t b = pool->Acquire();
  ASSERT_NE(a, SlabPool::kNoSlab);
  ASSERT_NE(b, SlabPool::kNoSlab);
  const uint64_t used = budget.used();
  EXPECT_EQ(pool->Acquire(), SlabPool::kNoSlab);
  EXPECT_EQ(budget.used(), used)
      << "the charge of a slab that could not be handed out is undone";
  pool->Release(a);
  const uint32_t c = pool->Acquire();
  EXPECT_EQ(c, a) << "with one slab free, it is the one handed out";
  EXPECT_EQ(pool->high_water(), 2u);
  pool->Release(b);
  pool->Release(c);
}

TEST(SlabPoolTest, SlabAddressIsStable) {
  MemoryBudget budget(kGiB);
  auto pool = MakePool(&budget, 4 * kSlabBytes);
  const uint32_t a = pool->Acquire();
  ASSERT_NE(a, SlabPool::kNoSlab);
  uint8_t* address = pool->SlabAddress(a);
  pool->Release(a);
  const uint32_t again = pool->Acquire();
  ASSERT_EQ(again, a);
  EXPECT_EQ(pool->SlabAddress(again), address);
  pool->Release(again);
}

TEST(SlabPoolTest, ConcurrentAcquireReleaseNeverExceedsTheCap) {
  constexpr int kCapSlabs = 6;
  MemoryBudget budget(kCapSlabs * kSlabBytes + 4096);
  auto pool = MakePool(&budget, 64 * kSlabBytes);
  std::atomic<bool> over_cap{false};
  std::atomic<bool> corrupted{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint32_t> mine;
      for (int i = 0; i < 3000; ++i) {
        if (mine.size() < 3 && (i % 3) != 2) {
          const uint32_t slab = pool->Acquire();
          if (slab != SlabPool::kNoSlab) {
            std::memset(pool->SlabAddress(slab), t + 1, 64);
            mine.push_back(slab);
          }
        } else if (!mine.empty()) {
          const uint32_t slab = mine.back();
          mine.pop_back();
          // Nobody else may have been handed this slab meanwhile.
          const uint8_t* p = pool->SlabAddress(slab);
          for (int j = 0; j < 64; ++j) {
            if (p[j] != t + 1) corrupted = true;
          }
          pool->Release(slab);
        }
        if (budget.used() > budget.cap()) over_cap = true;
      }
      for (uint32_t slab : mine) pool->Release(slab);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_FALSE(over_cap);
  EXPECT_FALSE(corrupted);
  EXPECT_LE(pool->slabs_in_use(), SlabPool::kCachedSlabs);
  pool->TrimCache();
  EXPECT_EQ(pool->slabs_in_use(), 0u);
  EXPECT_LT(budget.used(), kSlabBytes);
}

}  // namespace
}  // namespace tmem
