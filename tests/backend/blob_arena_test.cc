// Tests for BlobArena (backend/blob_arena.h): blobs of every size round-trip,
// slot accounting follows BlobSlotBytes, emptied slabs go back to the
// SlabPool (and so to the budget), a full budget makes Store return nullopt,
// and BlobRef packs into 64 bits.
#include "backend/blob_arena.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backend/memory_budget.h"
#include "backend/slab_pool.h"
#include "gtest/gtest.h"

namespace tmem {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// Payload of `length` bytes whose content depends on `seed` and position, so
// a blob that overlaps another, or is read from the wrong slot, shows.
std::vector<uint8_t> Payload(size_t length, uint64_t seed) {
  std::vector<uint8_t> data(length);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + length;
  for (size_t i = 0; i < length; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    data[i] = static_cast<uint8_t>(x);
  }
  return data;
}

bool Matches(std::span<const uint8_t> got, const std::vector<uint8_t>& want) {
  return got.size() == want.size() &&
         std::memcmp(got.data(), want.data(), want.size()) == 0;
}

class BlobArenaTest : public ::testing::Test {
 protected:
  void Init(uint64_t cap_bytes,
            uint64_t address_space_bytes = uint64_t{64} << 20) {
    budget_ = std::make_unique<MemoryBudget>(cap_bytes);
    pool_ = SlabPool::Create(budget_.get(), address_space_bytes).value();
    arena_ = std::make_unique<BlobArena>(pool_.get(), budget_.get());
  }
  // Every slab is back in the pool: only the pool's cache is still
  // charged; a periodic trim leaves kCachedSlabs, a full one nothing.
  void ExpectNoSlabsHeld() {
    EXPECT_LE(pool_->slabs_in_use(), SlabPool::kMaxCachedSlabs);
    pool_->TrimCacheTo(SlabPool::kCachedSlabs);
    EXPECT_LE(pool_->slabs_in_use(), SlabPool::kCachedSlabs);
    pool_->TrimCache();
    EXPECT_EQ(pool_->slabs_in_use(), 0u);
  }
  void TearDown() override {
    // Destroy in dependency order, then everything must be uncharged.
    if (budget_ == nullptr) return;
    arena_.reset();
    pool_.reset();
    EXPECT_EQ(budget_->used(), 0u) << "arena/pool leaked budget charges";
  }

  std::unique_ptr<MemoryBudget> budget_;
  std::unique_ptr<SlabPool> pool_;
  std::unique_ptr<BlobArena> arena_;
};

TEST(BlobRefTest, PackUnpackRoundTrips) {
  const BlobRef refs[] = {
      {0, 0, 0},
      {1, 2, 3},
      {UINT32_MAX, UINT16_MAX, UINT16_MAX},
      {0x12345678, 0x9abc, 4095},
      {7, 1023, 1},
  };
  for (const BlobRef& ref : refs) {
    const BlobRef back = BlobRef::Unpack(ref.Pack());
    EXPECT_EQ(back.slab, ref.slab);
    EXPECT_EQ(back.slot, ref.slot);
    EXPECT_EQ(back.length, ref.length);
  }
  // Distinct refs pack to distinct words.
  EXPECT_NE((BlobRef{1, 0, 0}.Pack()), (BlobRef{0, 1, 0}.Pack()));
  EXPECT_NE((BlobRef{0, 1, 0}.Pack()), (BlobRef{0, 0, 1}.Pack()));
}

TEST(BlobRefTest, LengthZeroMeansAFullPage) {
  EXPECT_EQ((BlobRef{0, 0, 0}.bytes()), kPageSize);
  EXPECT_EQ((BlobRef{0, 0, 1}.bytes()), 1u);
  EXPECT_EQ((BlobRef{0, 0, 4095}.bytes()), 4095u);
  EXPECT_EQ((BlobRef{0, 0, 0}.slot_bytes()), kPageSize);
  EXPECT_EQ((BlobRef{0, 0, 65}.slot_bytes()), 128u);
}

TEST(BlobSlotBytesTest, RoundsUpTo64ByteClasses) {
  EXPECT_EQ(BlobSlotBytes(1), 64u);
  EXPECT_EQ(BlobSlotBytes(64), 64u);
  EXPECT_EQ(BlobSlotBytes(65), 128u);
  EXPECT_EQ(BlobSlotBytes(4095), 4096u);
  EXPECT_EQ(BlobSlotBytes(4096), 4096u);
}

TEST_F(BlobArenaTest, EverySizeRoundTrips) {
  Init(kGiB);
  std::map<size_t, std::pair<BlobRef, std::vector<uint8_t>>> live;
  uint64_t expected_slot_bytes = 0;
  for (size_t length = 1; length <= kPageSize; ++length) {
    std::vector<uint8_t> data = Payload(length, length);
    std::optional<BlobRef> ref = arena_->Store(data);
    ASSERT_TRUE(ref.has_value()) << "length " << length;
    EXPECT_EQ(ref->bytes(), length);
    expected_slot_bytes += BlobSlotBytes(length);
    live.emplace(length, std::make_pair(*ref, std::move(data)));
  }
  EXPECT_EQ(arena_->slot_bytes_in_use(), expected_slot_bytes);
  EXPECT_GE(pool_->slabs_in_use(), kNumBlobClasses) << "one slab per class";

  // Read everything back only after all stores: no blob overwrote another.
  for (const auto& [length, entry] : live) {
    ASSERT_TRUE(Matches(arena_->Read(entry.first), entry.second))
        << "length " << length;
  }
  // A ref survives packing into a page entry's 64-bit payload.
  for (const auto& [length, entry] : live) {
    ASSERT_TRUE(Matches(arena_->Read(BlobRef::Unpack(entry.first.Pack())),
                        entry.second))
        << "length " << length;
  }

  // Free every other blob, check the rest, then free the rest.
  for (auto& [length, entry] : live) {
    if (length % 2 == 0) {
      arena_->Free(entry.first);
      expected_slot_bytes -= BlobSlotBytes(length);
    }
  }
  EXPECT_EQ(arena_->slot_bytes_in_use(), expected_slot_bytes);
  for (const auto& [length, entry] : live) {
    if (length % 2 == 1) {
      ASSERT_TRUE(Matches(arena_->Read(entry.first), entry.second))
          << "length " << length;
    }
  }
  for (auto& [length, entry] : live) {
    if (length % 2 == 1) arena_->Free(entry.first);
  }
  EXPECT_EQ(arena_->slot_bytes_in_use(), 0u);
  ExpectNoSlabsHeld();
}

TEST_F(BlobArenaTest, EmptySlabGoesBackToThePoolAndTheBudget) {
  Init(kGiB);
  const uint64_t used_before = budget_->used();
  // 40 full-page blobs: 16 per slab, so 3 slabs.
  std::vector<BlobRef> refs;
  for (int i = 0; i < 40; ++i) {
    std::optional<BlobRef> ref = arena_->Store(Payload(kPageSize, i));
    ASSERT_TRUE(ref.has_value());
    refs.push_back(*ref);
  }
  EXPECT_EQ(pool_->slabs_in_use(), 3u);
  EXPECT_GE(budget_->used(), used_before + 3 * kSlabBytes);
  const uint64_t used_full = budget_->used();
  for (BlobRef ref : refs) arena_->Free(ref);
  EXPECT_EQ(arena_->slot_bytes_in_use(), 0u);
  // The arena kept none: every slab is back in the pool (perhaps in its
  // cache, which TrimCache empties).
  pool_->TrimCache();
  EXPECT_EQ(pool_->slabs_in_use(), 0u);
  // All three slabs' charges are gone; only small descriptor/free-list
  // bookkeeping may remain.
  EXPECT_LE(budget_->used() + 3 * kSlabBytes, used_full + 1024);
  EXPECT_LT(budget_->used(), kSlabBytes);
}

TEST_F(BlobArenaTest, FreedSlotsAreReusedBeforeANewSlab) {
  Init(kGiB);
  std::vector<BlobRef> refs;
  for (int i = 0; i < 16; ++i) refs.push_back(*arena_->Store(Payload(100, i)));
  ASSERT_EQ(pool_->slabs_in_use(), 1u);
  arena_->Free(refs[3]);
  arena_->Free(refs[9]);
  const std::vector<uint8_t> a = Payload(100, 1000);
  const std::vector<uint8_t> b = Payload(128, 1001);  // same 128-byte class
  std::optional<BlobRef> ra = arena_->Store(a);
  std::optional<BlobRef> rb = arena_->Store(b);
  ASSERT_TRUE(ra && rb);
  EXPECT_EQ(pool_->slabs_in_use(), 1u);
  EXPECT_TRUE(Matches(arena_->Read(*ra), a));
  EXPECT_TRUE(Matches(arena_->Read(*rb), b));
  for (int i = 0; i < 16; ++i) {
    if (i == 3 || i == 9) continue;
    EXPECT_TRUE(Matches(arena_->Read(refs[i]), Payload(100, i))) << i;
  }
}

TEST_F(BlobArenaTest, StoreReturnsNulloptAtTheBudgetCap) {
  // Room for two slabs (plus bookkeeping) but not three.
  Init(2 * kSlabBytes + uint64_t{8} * 1024);
  std::vector<BlobRef> refs;
  for (int i = 0; i < 32; ++i) {  // exactly two slabs of 4096-byte blobs
    std::optional<BlobRef> ref = arena_->Store(Payload(kPageSize, i));
    ASSERT_TRUE(ref.has_value()) << i;
    refs.push_back(*ref);
  }
  const uint64_t used = budget_->used();
  EXPECT_FALSE(arena_->Store(Payload(kPageSize, 99)).has_value());
  // Another class needs a slab of its own: also refused.
  EXPECT_FALSE(arena_->Store(Payload(10, 98)).has_value());
  EXPECT_EQ(budget_->used(), used) << "a refused store charges nothing";
  EXPECT_LE(budget_->used(), budget_->cap());
  for (int i = 0; i < 32; ++i) {
    ASSERT_TRUE(Matches(arena_->Read(refs[i]), Payload(kPageSize, i))) << i;
  }

  // Freeing one slot lets the same class store again without a new slab.
  arena_->Free(refs[5]);
  std::optional<BlobRef> again = arena_->Store(Payload(kPageSize, 5));
  ASSERT_TRUE(again.has_value());
  refs[5] = *again;

  // Emptying a whole slab lets any other class take it (from the pool's
  // cache, without a new charge).
  for (int i = 0; i < 16; ++i) arena_->Free(refs[i]);
  std::optional<BlobRef> small = arena_->Store(Payload(10, 98));
  ASSERT_TRUE(small.has_value()) << "an emptied slab is never stranded";
  EXPECT_TRUE(Matches(arena_->Read(*small), Payload(10, 98)));
  EXPECT_LE(budget_->used(), budget_->cap());
  arena_->Free(*small);

  // Same again with the emptied slab handed back to the OS first.
  for (int i = 16; i < 32; ++i) arena_->Free(refs[i]);
  pool_->TrimCache();
  EXPECT_EQ(pool_->slabs_in_use(), 0u);
  for (int i = 0; i < 32; ++i) {
    std::optional<BlobRef> ref = arena_->Store(Payload(kPageSize, i));
    ASSERT_TRUE(ref.has_value()) << i;
    refs[i] = *ref;
  }
  EXPECT_FALSE(arena_->Store(Payload(10, 98)).has_value());
  for (int i = 0; i < 16; ++i) arena_->Free(refs[i]);
  pool_->TrimCache();
  small = arena_->Store(Payload(10, 98));
  ASSERT_TRUE(small.has_value());
  arena_->Free(*small);
  for (int i = 16; i < 32; ++i) arena_->Free(refs[i]);
  ExpectNoSlabsHeld();
}

TEST_F(BlobArenaTest, RandomizedAgainstAModel) {
  Init(kGiB);
  std::mt19937_64 rng(2024);
  struct Live {
    BlobRef ref;
    uint64_t seed;
    size_t length;
  };
  std::vector<Live> live;
  uint64_t expected_slot_bytes = 0;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const size_t length = 1 + rng() % kPageSize;
      const uint64_t seed = rng();
      std::optional<BlobRef> ref = arena_->Store(Payload(length, seed));
      ASSERT_TRUE(ref.has_value());
      live.push_back({*ref, seed, length});
      expected_slot_bytes += BlobSlotBytes(length);
    } else {
      const size_t i = rng() % live.size();
      ASSERT_TRUE(Matches(arena_->Read(live[i].ref),
                          Payload(live[i].length, live[i].seed)))
          << "step " << step;
      arena_->Free(live[i].ref);
      expected_slot_bytes -= BlobSlotBytes(live[i].length);
      live[i] = live.back();
      live.pop_back();
    }
    if (live.size() > 3000) {  // keep the footprint modest
      for (const Live& l : live) arena_->Free(l.ref);
      for (const Live& l : live) expected_slot_bytes -= BlobSlotBytes(l.length);
      live.clear();
      pool_->TrimCacheTo(SlabPool::kCachedSlabs);
      EXPECT_LE(pool_->slabs_in_use(), SlabPool::kCachedSlabs);
    }
  }
  EXPECT_EQ(arena_->slot_bytes_in_use(), expected_slot_bytes);
  for (const Live& l : live) {
    ASSERT_TRUE(Matches(arena_->Read(l.ref), Payload(l.length, l.seed)));
  }
  for (const Live& l : live) arena_->Free(l.ref);
  ExpectNoSlabsHeld();
  EXPECT_EQ(arena_->slot_bytes_in_use(), 0u);
}

TEST_F(BlobArenaTest, ConcurrentStoreReadFree) {
  // The arena is shared by every shard: threads store, read and free at
  // once, across all classes, and nobody's blob is disturbed.
  Init(kGiB);
  std::vector<std::thread> threads;
  std::atomic<int> corrupted{0};
  std::atomic<int> refused{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      struct Live {
        BlobRef ref;
        uint64_t seed;
        size_t length;
      };
      std::vector<Live> live;
      for (int step = 0; step < 10000; ++step) {
        if (live.size() < 200 && (live.empty() || rng() % 2 == 0)) {
          const size_t length = 1 + rng() % kPageSize;
          const uint64_t seed = rng();
          std::optional<BlobRef> ref = arena_->Store(Payload(length, seed));
          if (!ref) {
            ++refused;
            continue;
          }
          live.push_back({*ref, seed, length});
        } else {
          const size_t i = rng() % live.size();
          if (!Matches(arena_->Read(live[i].ref),
                       Payload(live[i].length, live[i].seed))) {
            ++corrupted;
          }
          arena_->Free(live[i].ref);
          live[i] = live.back();
          live.pop_back();
        }
      }
      for (const Live& l : live) {
        if (!Matches(arena_->Read(l.ref), Payload(l.length, l.seed))) {
          ++corrupted;
        }
        arena_->Free(l.ref);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(refused.load(), 0) << "the budget was never the limit here";
  EXPECT_EQ(arena_->slot_bytes_in_use(), 0u);
  ExpectNoSlabsHeld();
}

}  // namespace
}  // namespace tmem
