// Persistent pools (tmem_store.h, "Persistent pools"): a page a persistent
// pool took is never lost, whatever else happens to the store (a flood of
// ephemeral puts at the cap, a cap or quota lowered to 0, slab-emptying
// pressure, deferred compression), gets leave it in place, invalidates free
// its charge at once, and a put lacking room evicts ephemeral pages (of its
// own VM at quota, of the fair-share victim at the cap) before it is
// refused.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backend/blob_arena.h"
#include "backend/compaction_queue.h"
#include "backend/page_charge.h"
#include "backend/page_codec.h"
#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::FilledWith;
using test::Page;
using test::PageStyle;
using test::RandomPage;
using test::StyledPage;
using test::TextPage;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = kKiB * kKiB;
// The most work one put or get may do (bounded_work_test's kWorkBound).
constexpr uint64_t kWorkBound = 200000;
// What a put of a raw (incompressible) page reserves: the most it can cost.
constexpr uint64_t kRawPutReserve =
    BlobCharge(BlobSlotBytes(kPageSize)) + kMaxPageMetadataCharge;

uint64_t Value(const CounterValues& v, Counter c) {
  return v[static_cast<int>(c)];
}

class PersistentPoolTest : public ::testing::Test {
 protected:
  void Open(uint64_t cap_bytes, int num_shards = 8,
            CompactionQueue* queue = nullptr) {
    StoreOptions options;
    options.memory_cap_bytes = cap_bytes;
    options.address_space_bytes = 64 * kMiB;
    options.num_shards = num_shards;
    options.compaction_queue = queue;
    store_ = TmemStore::Create(options).value();
  }
  VmId AddVm(const std::string& name, uint64_t quota = kUnlimitedQuota,
             uint64_t swap_quota = kUnlimitedQuota) {
    VmPolicy policy;
    policy.quota_bytes = quota;
    policy.swap_quota_bytes = swap_quota;
    return store_->AddVm(name, policy).value();
  }
  PoolId Persistent(VmId vm) {
    return store_->NewPool(vm, nullptr, PoolKind::kPersistent).value();
  }
  PoolId Ephemeral(VmId vm) { return store_->NewPool(vm, nullptr).value(); }
  PutResult Put(VmId vm, PoolId pool, uint64_t ino, PageIndex index,
                const Page& page, PutMode mode = PutMode::kCompress) {
    return store_
        ->Put(vm, pool, ObjectId::FromInode(ino), index, ConstPage(page), mode)
        .value();
  }
  std::optional<Page> Get(VmId vm, PoolId pool, uint64_t ino, PageIndex index) {
    Page out{};
    const bool hit =
        store_->Get(vm, pool, ObjectId::FromInode(ino), index, MutablePage(out))
            .value();
    if (!hit) return std::nullopt;
    return out;
  }
  CounterValues VmCounters(VmId vm) {
    return store_->GetVmStats(vm).value().counters;
  }
  // Pages the VM holds that eviction may take.
  uint64_t EphemeralPages(VmId vm) {
    const CounterValues c = VmCounters(vm);
    return Value(c, Counter::kPagesHeld) -
           Value(c, Counter::kPersistentPagesHeld);
  }

  std::unique_ptr<TmemStore> store_;
};

TEST_F(PersistentPoolTest, NewPoolRefusesSharedPersistentAndUnknownKinds) {
  Open(4 * kMiB);
  const VmId vm = AddVm("a");
  PoolUuid uuid;
  uuid.bytes[0] = 7;
  store_->AuthorizeSharedPool(uuid, "a");
  EXPECT_EQ(store_->NewPool(vm, &uuid, PoolKind::kPersistent).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store_->NewPool(vm, nullptr, static_cast<PoolKind>(9)).status().code(),
      absl::StatusCode::kInvalidArgument);
  const PoolId eph = Ephemeral(vm);
  const PoolId per = Persistent(vm);
  const VmStats stats = store_->GetVmStats(vm).value();
  ASSERT_EQ(stats.pools.size(), 2u);
  EXPECT_EQ(stats.pools[eph].kind, PoolKind::kEphemeral);
  EXPECT_EQ(stats.pools[per].kind, PoolKind::kPersistent);
  EXPECT_EQ(PoolKindName(PoolKind::kPersistent), "persistent");
}

TEST_F(PersistentPoolTest, GetLeavesThePageAndNeverWrittenKeysMiss) {
  Open(4 * kMiB);
  const VmId vm = AddVm("a");
  const PoolId pool = Persistent(vm);
  EXPECT_FALSE(Get(vm, pool, 1, 0).has_value());  // never written
  const Page text = TextPage(1);
  const Page random = RandomPage(2);
  ASSERT_TRUE(Put(vm, pool, 1, 0, text).stored);
  ASSERT_TRUE(Put(vm, pool, 1, 1, random).stored);
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(Get(vm, pool, 1, 0), text) << round;
    EXPECT_EQ(Get(vm, pool, 1, 1), random) << round;
  }
  // A run is not exclusive either.
  std::vector<uint8_t> out(3 * kPageSize);
  for (int round = 0; round < 2; ++round) {
    const uint64_t hits =
        store_->GetRun(vm, pool, ObjectId::FromInode(1), 0, 3, out).value();
    EXPECT_EQ(hits, 0b011u) << round;
    EXPECT_TRUE(std::equal(text.begin(), text.end(), out.begin()));
    EXPECT_TRUE(
        std::equal(random.begin(), random.end(), out.begin() + kPageSize));
  }
  EXPECT_EQ(Value(VmCounters(vm), Counter::kPersistentPagesHeld), 2u);
  // Overwriting replaces.
  ASSERT_TRUE(Put(vm, pool, 1, 0, random).stored);
  EXPECT_EQ(Get(vm, pool, 1, 0), random);
  EXPECT_EQ(Value(VmCounters(vm), Counter::kPersistentPagesHeld), 2u);
}

TEST_F(PersistentPoolTest, InvalidatesFreeTheChargeAtOnce) {
  Open(4 * kMiB);
  const VmId vm = AddVm("a");
  const PoolId pool = Persistent(vm);
  for (uint64_t ino = 1; ino <= 3; ++ino) {
    for (PageIndex i = 0; i < 8; ++i) {
      ASSERT_TRUE(Put(vm, pool, ino, i, RandomPage(ino * 100 + i)).stored);
    }
  }
  auto charged = [&] { return Value(VmCounters(vm), Counter::kChargedBytes); };
  auto persistent = [&] {
    return Value(VmCounters(vm), Counter::kPersistentChargedBytes);
  };
  EXPECT_EQ(charged(), persistent());
  const uint64_t before = charged();
  ASSERT_TRUE(store_->InvalidatePage(vm, pool, ObjectId::FromInode(1), 0).ok());
  EXPECT_LT(charged(), before);
  EXPECT_EQ(charged(), persistent());
  EXPECT_FALSE(Get(vm, pool, 1, 0).has_value());
  ASSERT_TRUE(store_->InvalidateObject(vm, pool, ObjectId::FromInode(2)).ok());
  EXPECT_EQ(Value(VmCounters(vm), Counter::kPersistentPagesHeld), 7u + 8u);
  EXPECT_EQ(charged(), persistent());
  ASSERT_TRUE(store_->InvalidatePool(vm, pool).ok());
  EXPECT_EQ(charged(), 0u);
  EXPECT_EQ(persistent(), 0u);
  const HostStats host = store_->GetHostStats();
  EXPECT_EQ(host.persistent_pages, 0u);
  EXPECT_EQ(host.persistent_bytes, 0u);
  EXPECT_EQ(host.blob_slot_bytes, 0u);
  // Destroying a pool frees its pages too.
  ASSERT_TRUE(Put(vm, pool, 1, 0, RandomPage(5)).stored);
  ASSERT_TRUE(store_->DestroyPool(vm, pool).ok());
  EXPECT_EQ(charged(), 0u);
  EXPECT_EQ(store_->GetHostStats().persistent_pages, 0u);
}

TEST_F(PersistentPoolTest, ZeroAndSameFilledPagesCostNoBlob) {
  Open(4 * kMiB);
  const VmId vm = AddVm("a");
  const PoolId pool = Persistent(vm);
  const PutResult zero = Put(vm, pool, 1, 0, Page{});
  const PutResult same = Put(vm, pool, 1, 1, FilledWith(0xabcdef));
  ASSERT_TRUE(zero.stored);
  ASSERT_TRUE(same.stored);
  EXPECT_EQ(zero.kind, StorageKind::kZero);
  EXPECT_EQ(same.kind, StorageKind::kSameFilled);
  const VmStats stats = store_->GetVmStats(vm).value();
  EXPECT_EQ(Value(stats.counters, Counter::kStoredBytes), 0u);
  EXPECT_EQ(stats.persistent_pages, 2u);
  EXPECT_EQ(store_->GetHostStats().blob_slot_bytes, 0u);
  EXPECT_EQ(Get(vm, pool, 1, 0), Page{});
  EXPECT_EQ(Get(vm, pool, 1, 1), FilledWith(0xabcdef));
}

// Another VM's ephemeral flood at the cap evicts its own pages (and any
// other ephemeral ones), never a persistent page.
TEST_F(PersistentPoolTest, SurvivesAnotherVmsEphemeralFloodAtTheCap) {
  Open(2 * kMiB);
  const VmId a = AddVm("a");
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_a = Ephemeral(a);
  const PoolId cache_b = Ephemeral(b);
  constexpr uint64_t kPersistentPages = 200;  // ~0.8 MiB of the 2 MiB
  for (PageIndex i = 0; i < kPersistentPages; ++i) {
    ASSERT_TRUE(Put(a, swap, 1 + i % 5, i, RandomPage(i)).stored) << i;
    Put(a, cache_a, 1, i, RandomPage(10000 + i));
  }
  uint64_t stored_b = 0;
  for (uint64_t i = 0; i < 5000; ++i) {  // ~10x the cap
    const Page page = (i % 3 == 0) ? RandomPage(20000 + i) : TextPage(i);
    stored_b += Put(b, cache_b, 1 + i % 17, i, page).stored;
    if (i % 500 == 0) {
      const HostStats host = store_->GetHostStats();
      ASSERT_LE(host.memory_used_bytes, host.memory_cap_bytes) << i;
    }
  }
  EXPECT_GT(stored_b, 4000u);
  EXPECT_GT(Value(VmCounters(b), Counter::kEvictionsHostCap), 0u);
  EXPECT_EQ(EphemeralPages(a), 0u) << "a's cache pages go before anything";
  for (PageIndex i = 0; i < kPersistentPages; ++i) {
    ASSERT_EQ(Get(a, swap, 1 + i % 5, i), RandomPage(i)) << i;
  }
  const VmStats sa = store_->GetVmStats(a).value();
  EXPECT_EQ(sa.persistent_pages, kPersistentPages);
  EXPECT_EQ(store_->GetHostStats().persistent_pages, kPersistentPages);
}

// At the cap a persistent put evicts ephemeral pages, its own VM's and
// other VMs', and is refused only once none is left; the refused key's
// earlier page is gone (the caller now holds the only copy).
TEST_F(PersistentPoolTest, PutAtTheCapEvictsEphemeralPagesBeforeRefusing) {
  Open(2 * kMiB, 4);
  const VmId a = AddVm("a");
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_a = Ephemeral(a);
  const PoolId cache_b = Ephemeral(b);
  for (PageIndex i = 0; i < 600; ++i) {
    Put(a, cache_a, 1, i, RandomPage(50000 + i));
    Put(b, cache_b, 1, i, RandomPage(60000 + i));
  }
  ASSERT_GT(EphemeralPages(a), 0u);
  ASSERT_GT(EphemeralPages(b), 0u);
  PageIndex stored = 0;
  std::optional<PageIndex> refused;
  for (PageIndex i = 0; i < 1000; ++i) {
    if (Put(a, swap, 7, i, RandomPage(i)).stored) {
      ++stored;
      continue;
    }
    refused = i;
    break;
  }
  ASSERT_TRUE(refused.has_value()) << "the cap must bind";
  EXPECT_EQ(*refused, stored);
  EXPECT_EQ(EphemeralPages(a), 0u);
  EXPECT_EQ(EphemeralPages(b), 0u);
  EXPECT_GT(Value(VmCounters(b), Counter::kEvictionsHostCap), 0u);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentPutsRefusedForRoom), 1u);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPutsRefusedNoMemory), 1u);
  EXPECT_EQ(store_->GetHostStats().persistent_puts_refused_for_room, 1u);
  // Re-putting a stored key with no room left: refused, and the old page
  // of the key is gone rather than stale.
  const PutResult again = Put(a, swap, 7, 0, RandomPage(999999));
  if (!again.stored) {
    EXPECT_FALSE(Get(a, swap, 7, 0).has_value());
  } else {
    EXPECT_EQ(Get(a, swap, 7, 0), RandomPage(999999));
  }
  for (PageIndex i = 1; i < stored; ++i) {
    ASSERT_EQ(Get(a, swap, 7, i), RandomPage(i)) << i;
  }
  const HostStats host = store_->GetHostStats();
  EXPECT_LE(host.memory_used_bytes, host.memory_cap_bytes);
}

// At quota a persistent put evicts its own VM's ephemeral pages (never
// another VM's), then is refused for quota.
TEST_F(PersistentPoolTest, PutAtQuotaEvictsOwnEphemeralPagesOnly) {
  Open(16 * kMiB);
  const uint64_t quota = 512 * kKiB;
  const VmId a = AddVm("a", quota);
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_a = Ephemeral(a);
  const PoolId cache_b = Ephemeral(b);
  for (PageIndex i = 0; i < 200; ++i) {
    Put(a, cache_a, 1, i, RandomPage(70000 + i));
    ASSERT_TRUE(Put(b, cache_b, 1, i, RandomPage(80000 + i)).stored);
  }
  ASSERT_GT(EphemeralPages(a), 0u);
  PageIndex stored = 0;
  for (PageIndex i = 0; i < 400; ++i) {
    if (!Put(a, swap, 1, i, RandomPage(i)).stored) break;
    ++stored;
  }
  EXPECT_GT(stored, 0u);
  EXPECT_LT(stored, 400u);
  EXPECT_EQ(EphemeralPages(a), 0u);
  EXPECT_EQ(EphemeralPages(b), 200u) << "b's pages are not a's to evict";
  EXPECT_GT(Value(VmCounters(a), Counter::kEvictionsQuota), 0u);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPutsRefusedQuota), 1u);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentPutsRefusedForRoom), 1u);
  EXPECT_LE(Value(VmCounters(a), Counter::kChargedBytes), quota);
  for (PageIndex i = 0; i < stored; ++i) {
    ASSERT_EQ(Get(a, swap, 1, i), RandomPage(i)) << i;
  }
}

TEST_F(PersistentPoolTest, SurvivesCapLoweredToZero) {
  Open(4 * kMiB);
  const VmId a = AddVm("a");
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_b = Ephemeral(b);
  for (PageIndex i = 0; i < 300; ++i) {
    ASSERT_TRUE(Put(a, swap, 1 + i % 3, i, TextPage(i)).stored);
    Put(b, cache_b, 1, i, RandomPage(90000 + i));
  }
  ASSERT_TRUE(store_->SetMemoryCap(0).ok());
  EXPECT_EQ(EphemeralPages(b), 0u);
  HostStats host = store_->GetHostStats();
  EXPECT_EQ(host.persistent_pages, 300u);
  EXPECT_GT(host.memory_used_bytes, host.memory_cap_bytes)
      << "persistent pages are kept even over the cap";
  EXPECT_GE(host.vm_charged_bytes, host.persistent_bytes);
  for (PageIndex i = 0; i < 300; ++i) {
    ASSERT_EQ(Get(a, swap, 1 + i % 3, i), TextPage(i)) << i;
  }
  // Nothing new fits; ephemeral and persistent puts are refused.
  EXPECT_FALSE(Put(b, cache_b, 1, 0, RandomPage(1)).stored);
  EXPECT_FALSE(Put(a, swap, 9, 0, RandomPage(2)).stored);
  // Invalidating gives the memory back.
  ASSERT_TRUE(store_->InvalidatePool(a, swap).ok());
  host = store_->GetHostStats();
  EXPECT_EQ(host.persistent_pages, 0u);
  EXPECT_EQ(host.vm_charged_bytes, 0u);
  store_->TrimIdleSlabs();
  ASSERT_TRUE(store_->SetMemoryCap(0).ok());
  // What stays is the shards' own tables (tmem_store.h: host overhead).
  EXPECT_LE(store_->GetHostStats().memory_used_bytes,
            8 * TmemStore::kShardOverheadBytes);
}

TEST_F(PersistentPoolTest, SurvivesQuotaLoweredToZero) {
  Open(8 * kMiB);
  const VmId a = AddVm("a");
  const PoolId swap = Persistent(a);
  const PoolId cache = Ephemeral(a);
  for (PageIndex i = 0; i < 200; ++i) {
    ASSERT_TRUE(Put(a, swap, 1, i, RandomPage(i)).stored);
    ASSERT_TRUE(Put(a, cache, 1, i, RandomPage(1000 + i)).stored);
  }
  VmPolicy policy;
  policy.quota_bytes = 0;
  ASSERT_TRUE(store_->SetVmPolicy(a, policy).ok());
  const VmStats stats = store_->GetVmStats(a).value();
  EXPECT_EQ(Value(stats.counters, Counter::kPagesHeld), 200u);
  EXPECT_EQ(stats.persistent_pages, 200u);
  EXPECT_EQ(Value(stats.counters, Counter::kEvictionsQuota), 200u);
  EXPECT_GT(Value(stats.counters, Counter::kChargedBytes), 0u)
      << "over its quota with persistent pages only";
  for (PageIndex i = 0; i < 200; ++i) {
    ASSERT_EQ(Get(a, swap, 1, i), RandomPage(i)) << i;
  }
  EXPECT_FALSE(Put(a, swap, 2, 0, RandomPage(5)).stored);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentPutsRefusedForRoom), 1u);
}

// Slabs mixing persistent and ephemeral blobs are never emptied whole;
// slabs of ephemeral blobs are, and the persistent pages stay.
TEST_F(PersistentPoolTest, SurvivesSlabEmptyingPressure) {
  Open(3 * kMiB, 4);
  const VmId a = AddVm("a");
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_a = Ephemeral(a);
  const PoolId cache_b = Ephemeral(b);
  // Interleaved puts of every size class put persistent and ephemeral
  // blobs of the same class into the same slabs.
  std::mt19937_64 rng(3);
  std::vector<Page> kept;
  for (PageIndex i = 0; i < 300; ++i) {
    Page page = TextPage(i);
    // Random tails of varying length spread the pages over size classes.
    const size_t tail = (rng() % 32) * 128;
    for (size_t k = kPageSize - tail; k < kPageSize; ++k) {
      page[k] = static_cast<uint8_t>(rng());
    }
    ASSERT_TRUE(Put(a, swap, 1 + i % 7, i, page).stored) << i;
    kept.push_back(page);
    Put(a, cache_a, 1 + i % 7, i, TextPage(5000 + i));
  }
  // b's puts of other classes need whole slabs: the store must empty
  // slabs, and may only take ephemeral ones.
  for (uint64_t i = 0; i < 4000; ++i) {
    Put(b, cache_b, 1 + i % 11, i,
        i % 2 == 0 ? RandomPage(i) : FilledWith(i + 1));
    Put(b, cache_b, 100 + i % 11, i, TextPage(7000 + i));
  }
  const HostStats host = store_->GetHostStats();
  EXPECT_GT(host.slabs_emptied_for_room, 0u);
  EXPECT_LE(host.memory_used_bytes, host.memory_cap_bytes);
  for (PageIndex i = 0; i < 300; ++i) {
    ASSERT_EQ(Get(a, swap, 1 + i % 7, i), kept[i]) << i;
  }
  EXPECT_EQ(store_->GetVmStats(a).value().persistent_pages, 300u);
}

TEST_F(PersistentPoolTest, DeferredCompressionRechargesAndKeepsThePage) {
  CompactionQueue queue(64);
  Open(8 * kMiB, 4, &queue);
  const VmId a = AddVm("a");
  const PoolId swap = Persistent(a);
  const Page page = TextPage(42);
  const PutResult r = Put(a, swap, 1, 0, page, PutMode::kDefer);
  ASSERT_TRUE(r.stored);
  ASSERT_TRUE(r.deferred);
  const uint64_t raw_charge = Value(VmCounters(a), Counter::kChargedBytes);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentChargedBytes), raw_charge);
  // A get before the compactor's turn leaves the page pending.
  EXPECT_EQ(Get(a, swap, 1, 0), page);
  std::array<CompactionTicket, 1> t;
  ASSERT_EQ(queue.PopBatch(t), 1u);
  Page raw{};
  ASSERT_TRUE(store_->ReadDeferred(t[0], MutablePage(raw)));
  EXPECT_EQ(raw, page);
  std::array<uint8_t, kMaxCompressedPage> block{};
  const size_t n = CompressPage(ConstPage(raw), block);
  ASSERT_GT(n, 0u);
  EXPECT_EQ(
      store_->CompleteDeferred(t[0], std::span<const uint8_t>(block.data(), n)),
      DeferredOutcome::kCompressed);
  const CounterValues after = VmCounters(a);
  EXPECT_LT(Value(after, Counter::kChargedBytes), raw_charge);
  EXPECT_EQ(Value(after, Counter::kPersistentChargedBytes),
            Value(after, Counter::kChargedBytes));
  EXPECT_EQ(Value(after, Counter::kPersistentPagesHeld), 1u);
  EXPECT_EQ(Get(a, swap, 1, 0), page);
  EXPECT_EQ(Get(a, swap, 1, 0), page);
}

// Deferred pages under cap pressure, with the same VM's deferred cache
// pages beside them: the compactor's room-finding and the puts around it
// evict ephemeral pages only; a block with no room leaves
// the persistent page raw, never dropped.
TEST_F(PersistentPoolTest, DeferredPagesSurviveCapPressure) {
  CompactionQueue queue(1024);
  Open(2 * kMiB, 4, &queue);
  const VmId a = AddVm("a");
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_a = Ephemeral(a);
  const PoolId cache_b = Ephemeral(b);
  constexpr PageIndex kPages = 300;
  for (PageIndex i = 0; i < kPages; ++i) {
    ASSERT_TRUE(Put(a, swap, 1, i, TextPage(i), PutMode::kDeferIdle).stored);
  }
  // Fill the rest with b's cache, then compact while b keeps putting.
  std::array<CompactionTicket, 1> t;
  uint64_t compressed = 0;
  for (uint64_t i = 0; i < 3000; ++i) {
    Put(b, cache_b, 1, i, RandomPage(i));
    Put(a, cache_a, 1, i, RandomPage(100000 + i), PutMode::kDefer);
    if (i % 10 == 0 && queue.PopBatch(t) == 1) {
      Page raw{};
      ASSERT_TRUE(store_->ReadDeferred(t[0], MutablePage(raw)));
      std::array<uint8_t, kMaxCompressedPage> block{};
      const size_t n = CompressPage(ConstPage(raw), block);
      const DeferredOutcome o = store_->CompleteDeferred(
          t[0], std::span<const uint8_t>(block.data(), n));
      ASSERT_TRUE(o == DeferredOutcome::kCompressed ||
                  o == DeferredOutcome::kNoRoom);
      compressed += o == DeferredOutcome::kCompressed;
    }
  }
  EXPECT_GT(compressed, 0u);
  for (PageIndex i = 0; i < kPages; ++i) {
    ASSERT_EQ(Get(a, swap, 1, i), TextPage(i)) << i;
  }
  EXPECT_EQ(store_->GetVmStats(a).value().persistent_pages, kPages);
}

TEST_F(PersistentPoolTest, ForgetVmRemovesItsPersistentPages) {
  Open(4 * kMiB);
  const VmId a = AddVm("a");
  const PoolId swap = Persistent(a);
  for (PageIndex i = 0; i < 100; ++i) {
    ASSERT_TRUE(Put(a, swap, 1, i, RandomPage(i)).stored);
  }
  ASSERT_TRUE(store_->ForgetVm(a).ok());
  const HostStats host = store_->GetHostStats();
  EXPECT_EQ(host.persistent_pages, 0u);
  EXPECT_EQ(host.vm_charged_bytes, 0u);
  EXPECT_EQ(host.blob_slot_bytes, 0u);
  EXPECT_EQ(Value(host.counters, Counter::kPersistentPagesHeld), 0u);
}

// Many persistent pages add no work to the eviction another VM's puts do
// at the cap (they are on no LRU list), and a VM holding only persistent
// pages is never walked as a victim.
TEST_F(PersistentPoolTest, ManyPersistentPagesAddNoEvictionWork) {
  Open(8 * kMiB, 16);
  const VmId a = AddVm("a");
  const VmId b = AddVm("b");
  const PoolId swap = Persistent(a);
  const PoolId cache_b = Ephemeral(b);
  // ~3 MiB of a's persistent pages, most of them metadata-only.
  for (PageIndex i = 0; i < 20000; ++i) {
    const Page page = i % 16 == 0 ? TextPage(i) : FilledWith(i + 1);
    ASSERT_TRUE(Put(a, swap, 1 + i % 64, i, page).stored) << i;
  }
  for (uint64_t i = 0; i < 6000; ++i) {
    Put(b, cache_b, 1 + i % 13, i, RandomPage(i));
  }
  const HostStats host = store_->GetHostStats();
  EXPECT_GT(Value(VmCounters(b), Counter::kEvictionsHostCap), 0u);
  // A tenth of the bound bounded_work_test holds every op to: a walk of
  // a's 20000 pages would pass it.
  EXPECT_LE(host.max_op_work, kWorkBound / 10);
  RecordProperty("max_op_work", static_cast<int>(host.max_op_work));
  EXPECT_EQ(host.persistent_pages, 20000u);
  for (PageIndex i = 0; i < 20000; i += 97) {
    const Page page = i % 16 == 0 ? TextPage(i) : FilledWith(i + 1);
    ASSERT_EQ(Get(a, swap, 1 + i % 64, i), page) << i;
  }
}

// A random mix of ephemeral and persistent puts, gets and invalidates over
// 4 VMs, with quotas and the cap moving, checked against a model after
// every step: a persistent page the store took reads back exactly until it
// is overwritten or invalidated (never lost; the VM's persistent gauge
// equals the model's count), an ephemeral get returns a miss or the latest
// bytes, and the cap and every quota hold whenever there are ephemeral
// pages left to evict.
TEST_F(PersistentPoolTest, RandomizedMixNeverLosesAPersistentPage) {
  constexpr int kVms = 4;
  constexpr uint64_t kObjects = 6;
  constexpr PageIndex kIndices = 96;
  const uint64_t seed = 20261207;
  std::mt19937_64 rng(seed);
  Open(3 * kMiB, 8);
  struct VmState {
    VmId id = 0;
    PoolId swap = -1;
    PoolId cache = -1;
    // (ino, index) -> (style, page seed) of the latest stored put.
    std::map<std::pair<uint64_t, PageIndex>, std::pair<PageStyle, uint64_t>>
        persistent;
    std::map<std::pair<uint64_t, PageIndex>, std::pair<PageStyle, uint64_t>>
        ephemeral;
  };
  std::vector<VmState> vms(kVms);
  for (int v = 0; v < kVms; ++v) {
    vms[v].id = AddVm(
        "vm" + std::to_string(v),
        v == 0 ? kUnlimitedQuota : static_cast<uint64_t>(v + 1) * 256 * kKiB);
    vms[v].swap = Persistent(vms[v].id);
    vms[v].cache = Ephemeral(vms[v].id);
  }
  auto make = [](PageStyle style, uint64_t s) {
    return StyledPage(style, s, s | 1);
  };
  auto pick_style = [&] {
    switch (rng() % 8) {
      case 0:
        return PageStyle::kZero;
      case 1:
        return PageStyle::kSameFilled;
      case 2:
      case 3:
        return PageStyle::kRandom;
      default:
        return PageStyle::kText;
    }
  };
  uint64_t persistent_refused = 0;
  uint64_t persistent_stored = 0;
  uint64_t ephemeral_hits = 0;
  for (uint64_t op = 0; op < 30000; ++op) {
    VmState& vm = vms[rng() % kVms];
    const uint64_t ino = 1 + rng() % kObjects;
    const PageIndex index = rng() % kIndices;
    const auto key = std::make_pair(ino, index);
    const uint64_t dice = rng() % 100;
    if (dice < 40) {  // persistent put
      const PageStyle style = pick_style();
      const uint64_t s = rng();
      if (Put(vm.id, vm.swap, ino, index, make(style, s)).stored) {
        vm.persistent[key] = {style, s};
        ++persistent_stored;
      } else {
        vm.persistent.erase(key);  // the caller keeps it elsewhere
        ++persistent_refused;
      }
    } else if (dice < 70) {  // ephemeral put
      const PageStyle style = pick_style();
      const uint64_t s = rng();
      if (Put(vm.id, vm.cache, ino, index, make(style, s)).stored) {
        vm.ephemeral[key] = {style, s};
      } else {
        vm.ephemeral.erase(key);
      }
    } else if (dice < 80) {  // persistent get
      const std::optional<Page> got = Get(vm.id, vm.swap, ino, index);
      auto it = vm.persistent.find(key);
      if (it == vm.persistent.end()) {
        ASSERT_FALSE(got.has_value()) << "op " << op;
      } else {
        ASSERT_TRUE(got.has_value()) << "persistent page lost, op " << op;
        ASSERT_EQ(*got, make(it->second.first, it->second.second))
            << "op " << op;
      }
    } else if (dice < 86) {  // ephemeral get: exclusive
      const std::optional<Page> got = Get(vm.id, vm.cache, ino, index);
      auto it = vm.ephemeral.find(key);
      if (got.has_value()) {
        ASSERT_NE(it, vm.ephemeral.end()) << "op " << op;
        ASSERT_EQ(*got, make(it->second.first, it->second.second))
            << "op " << op;
        ++ephemeral_hits;
      }
      if (it != vm.ephemeral.end()) vm.ephemeral.erase(it);
    } else if (dice < 92) {  // invalidate a persistent page (DISCARD)
      ASSERT_TRUE(
          store_
              ->InvalidatePage(vm.id, vm.swap, ObjectId::FromInode(ino), index)
              .ok());
      vm.persistent.erase(key);
    } else if (dice < 94) {  // a persistent run
      const size_t n = 1 + rng() % 8;
      std::vector<uint8_t> out(n * kPageSize);
      const uint64_t hits =
          store_
              ->GetRun(vm.id, vm.swap, ObjectId::FromInode(ino), index, n, out)
              .value();
      for (size_t k = 0; k < n; ++k) {
        auto it = vm.persistent.find({ino, index + k});
        ASSERT_EQ(((hits >> k) & 1) != 0, it != vm.persistent.end())
            << "op " << op << " page " << index + k;
        if (it == vm.persistent.end()) continue;
        const Page want = make(it->second.first, it->second.second);
        ASSERT_TRUE(
            std::equal(want.begin(), want.end(), out.begin() + k * kPageSize))
            << "op " << op;
      }
    } else if (dice < 96) {  // invalidate an object in either pool
      const bool swap = rng() % 2 == 0;
      ASSERT_TRUE(store_
                      ->InvalidateObject(vm.id, swap ? vm.swap : vm.cache,
                                         ObjectId::FromInode(ino))
                      .ok());
      auto& model = swap ? vm.persistent : vm.ephemeral;
      for (auto it = model.begin(); it != model.end();) {
        it = it->first.first == ino ? model.erase(it) : std::next(it);
      }
    } else if (dice < 98) {  // a quota moves
      VmPolicy policy;
      const uint64_t q = rng() % 5;
      policy.quota_bytes = q == 0 ? kUnlimitedQuota : q * 192 * kKiB;
      ASSERT_TRUE(store_->SetVmPolicy(vm.id, policy).ok());
    } else {  // the cap moves
      ASSERT_TRUE(store_->SetMemoryCap((1 + rng() % 4) * kMiB).ok());
    }
    // Ephemeral pages the store dropped are misses the model learns of at
    // its next get; the model keeps only what may still be there.
    bool any_ephemeral = false;
    for (VmState& v : vms) {
      const VmStats s = store_->GetVmStats(v.id).value();
      ASSERT_EQ(s.persistent_pages, v.persistent.size())
          << "op " << op << ": a persistent page was lost";
      const uint64_t held = Value(s.counters, Counter::kPagesHeld);
      const bool has_ephemeral = held > s.persistent_pages;
      any_ephemeral |= has_ephemeral;
      if (has_ephemeral) {
        ASSERT_LE(Value(s.counters, Counter::kChargedBytes),
                  s.policy.quota_bytes)
            << "op " << op << " vm " << v.id;
      }
    }
    const HostStats host = store_->GetHostStats();
    if (any_ephemeral) {
      ASSERT_LE(host.memory_used_bytes, host.memory_cap_bytes) << "op " << op;
    }
    // bounded_work_test's bound on one put or get.
    ASSERT_LE(host.max_op_work, kWorkBound) << "op " << op;
    if (op % 2000 == 0) {
      for (VmState& v : vms) {
        for (const auto& [k, val] : v.persistent) {
          ASSERT_EQ(Get(v.id, v.swap, k.first, k.second),
                    make(val.first, val.second))
              << "op " << op;
        }
      }
    }
  }
  for (VmState& v : vms) {
    for (const auto& [k, val] : v.persistent) {
      ASSERT_EQ(Get(v.id, v.swap, k.first, k.second),
                make(val.first, val.second));
    }
  }
  // The mix must have exercised both outcomes of a persistent put.
  EXPECT_GT(persistent_stored, 1000u);
  EXPECT_GT(persistent_refused, 0u);
  EXPECT_GT(ephemeral_hits, 0u);
  RecordProperty("persistent_refused", static_cast<int>(persistent_refused));
  RecordProperty("persistent_stored", static_cast<int>(persistent_stored));
  RecordProperty("max_op_work",
                 static_cast<int>(store_->GetHostStats().max_op_work));
}

// Threads: each VM's own thread puts, reads back and discards its
// persistent pages and puts cache pages, while another floods the cap with
// ephemeral puts and moves it. No persistent page is ever lost.
TEST_F(PersistentPoolTest, ConcurrentPressureNeverLosesAPersistentPage) {
  Open(3 * kMiB, 8);
  constexpr int kVms = 3;
  const VmId flooder = AddVm("flood");
  const PoolId flood_pool = Ephemeral(flooder);
  std::vector<VmId> ids;
  std::vector<PoolId> swaps, caches;
  for (int v = 0; v < kVms; ++v) {
    ids.push_back(AddVm("vm" + std::to_string(v)));
    swaps.push_back(Persistent(ids[v]));
    caches.push_back(Ephemeral(ids[v]));
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> lost{0}, wrong{0}, checked{0};
  std::vector<std::thread> threads;
  for (int v = 0; v < kVms; ++v) {
    threads.emplace_back([&, v] {
      std::mt19937_64 rng(v + 1);
      std::map<PageIndex, uint64_t> model;  // index -> text page seed
      for (int op = 0; op < 3000; ++op) {
        const PageIndex index = rng() % 128;
        const uint64_t dice = rng() % 10;
        if (dice < 4) {
          const uint64_t s = rng();
          auto r = store_->Put(ids[v], swaps[v], ObjectId::FromInode(1), index,
                               ConstPage(TextPage(s)));
          if (r.ok() && r->stored) {
            model[index] = s;
          } else {
            model.erase(index);
          }
        } else if (dice < 7) {
          Page out{};
          auto hit = store_->Get(ids[v], swaps[v], ObjectId::FromInode(1),
                                 index, MutablePage(out));
          auto it = model.find(index);
          if (it != model.end()) {
            checked.fetch_add(1);
            if (!hit.ok() || !*hit) {
              lost.fetch_add(1);
            } else if (out != TextPage(it->second)) {
              wrong.fetch_add(1);
            }
          }
        } else if (dice < 8) {
          (void)store_->InvalidatePage(ids[v], swaps[v], ObjectId::FromInode(1),
                                       index);
          model.erase(index);
        } else {
          (void)store_->Put(ids[v], caches[v], ObjectId::FromInode(2), index,
                            ConstPage(RandomPage(rng())));
        }
      }
      for (const auto& [index, s] : model) {
        Page out{};
        auto hit = store_->Get(ids[v], swaps[v], ObjectId::FromInode(1), index,
                               MutablePage(out));
        checked.fetch_add(1);
        if (!hit.ok() || !*hit) {
          lost.fetch_add(1);
        } else if (out != TextPage(s)) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  threads.emplace_back([&] {
    std::mt19937_64 rng(99);
    for (uint64_t i = 0; !stop.load(); ++i) {
      (void)store_->Put(flooder, flood_pool, ObjectId::FromInode(1 + i % 9), i,
                        ConstPage(RandomPage(i)));
      if (i % 256 == 0) {
        (void)store_->SetMemoryCap((1 + rng() % 3) * kMiB);
      }
    }
  });
  for (int v = 0; v < kVms; ++v) threads[v].join();
  stop.store(true);
  threads.back().join();
  EXPECT_EQ(lost.load(), 0u);
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_GT(checked.load(), 1000u);
}

// --- Swap quota (tmem_store.h, "Persistent pools": swap quota) ----------

TEST_F(PersistentPoolTest, SwapQuotaRefusesPastItAndEvictsNothing) {
  Open(16 * kMiB);
  const uint64_t swap_quota = 256 * kKiB;
  const VmId a = AddVm("a", 4 * kMiB, swap_quota);
  EXPECT_EQ(store_->GetVmPolicy(a).value().swap_quota_bytes, swap_quota);
  EXPECT_EQ(store_->GetVmStats(a).value().policy.swap_quota_bytes, swap_quota);
  const PoolId swap = Persistent(a);
  const PoolId cache = Ephemeral(a);
  for (PageIndex i = 0; i < 100; ++i) {
    ASSERT_TRUE(Put(a, cache, 1, i, RandomPage(50000 + i)).stored);
  }
  PageIndex stored = 0;
  PutResult refused;
  for (PageIndex i = 0; i < 400; ++i) {
    refused = Put(a, swap, 1, i, RandomPage(i));
    if (!refused.stored) break;
    ++stored;
  }
  ASSERT_FALSE(refused.stored);
  EXPECT_EQ(refused.reason, RefuseReason::kQuota);
  EXPECT_EQ(refused.evicted, 0u);
  const VmStats stats = store_->GetVmStats(a).value();
  const uint64_t held = Value(stats.counters, Counter::kPersistentChargedBytes);
  EXPECT_GT(stored, 0u);
  EXPECT_LE(held, swap_quota);
  // Refused at the swap quota, not before it: the page's reservation did
  // not fit in what was left.
  EXPECT_GT(held + kRawPutReserve, swap_quota);
  EXPECT_EQ(Value(stats.counters, Counter::kPersistentPutsRefusedForSwapQuota),
            1u);
  EXPECT_EQ(Value(stats.pools[swap].counters,
                  Counter::kPersistentPutsRefusedForSwapQuota),
            1u);
  EXPECT_EQ(Value(stats.counters, Counter::kPutsRefusedQuota), 1u);
  EXPECT_EQ(Value(stats.counters, Counter::kPersistentPutsRefusedForRoom), 0u);
  EXPECT_EQ(store_->GetHostStats().persistent_puts_refused_for_swap_quota, 1u);
  // Nothing evicted for it: the VM's cache pages are all there.
  EXPECT_EQ(Value(stats.counters, Counter::kEvictionsQuota), 0u);
  EXPECT_EQ(Value(stats.counters, Counter::kEvictionsHostCap), 0u);
  EXPECT_EQ(EphemeralPages(a), 100u);
  for (PageIndex i = 0; i < stored; ++i) {
    ASSERT_EQ(Get(a, swap, 1, i), RandomPage(i)) << i;
  }
  // Room made in the swap quota takes the next put.
  ASSERT_TRUE(store_->InvalidatePage(a, swap, ObjectId::FromInode(1), 0).ok());
  EXPECT_TRUE(Put(a, swap, 1, stored, RandomPage(stored)).stored);
}

TEST_F(PersistentPoolTest, SwapQuotaDoesNotLimitEphemeralPages) {
  Open(16 * kMiB);
  const VmId a = AddVm("a", kUnlimitedQuota, /*swap_quota=*/0);
  const PoolId swap = Persistent(a);
  const PoolId cache = Ephemeral(a);
  for (PageIndex i = 0; i < 200; ++i) {
    ASSERT_TRUE(Put(a, cache, 1, i, RandomPage(i)).stored) << i;
  }
  const PutResult r = Put(a, swap, 1, 0, RandomPage(1000));
  EXPECT_FALSE(r.stored);
  EXPECT_EQ(r.reason, RefuseReason::kQuota);
  // Even a metadata-only page is charged, so none fits in 0.
  EXPECT_FALSE(Put(a, swap, 1, 1, FilledWith(0)).stored);
  const CounterValues c = VmCounters(a);
  EXPECT_EQ(Value(c, Counter::kPersistentChargedBytes), 0u);
  EXPECT_EQ(Value(c, Counter::kPersistentPutsRefusedForSwapQuota), 2u);
  EXPECT_EQ(EphemeralPages(a), 200u);
  EXPECT_GT(Value(c, Counter::kChargedBytes), 200 * kPageSize);
}

TEST_F(PersistentPoolTest, LoweredSwapQuotaKeepsThePagesAndRefusesNewOnes) {
  Open(16 * kMiB);
  const VmId a = AddVm("a");
  const PoolId swap = Persistent(a);
  const PoolId cache = Ephemeral(a);
  for (PageIndex i = 0; i < 64; ++i) {
    ASSERT_TRUE(Put(a, swap, 1, i, RandomPage(i)).stored) << i;
  }
  const uint64_t held = Value(VmCounters(a), Counter::kPersistentChargedBytes);
  VmPolicy policy = store_->GetVmPolicy(a).value();
  policy.swap_quota_bytes = held / 2;
  ASSERT_TRUE(store_->SetVmPolicy(a, policy).ok());
  EXPECT_EQ(store_->GetVmPolicy(a).value().swap_quota_bytes, held / 2);
  // Every page stays, visible as a persistent charge over the swap quota.
  for (PageIndex i = 0; i < 64; ++i) {
    ASSERT_EQ(Get(a, swap, 1, i), RandomPage(i)) << i;
  }
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentChargedBytes), held);
  EXPECT_EQ(Value(VmCounters(a), Counter::kEvictionsQuota), 0u);
  // New persistent puts are refused until under; cache puts are not.
  EXPECT_FALSE(Put(a, swap, 1, 100, RandomPage(100)).stored);
  EXPECT_TRUE(Put(a, cache, 1, 0, RandomPage(200)).stored);
  for (PageIndex i = 0; i < 40; ++i) {
    ASSERT_TRUE(
        store_->InvalidatePage(a, swap, ObjectId::FromInode(1), i).ok());
  }
  EXPECT_LT(Value(VmCounters(a), Counter::kPersistentChargedBytes),
            held / 2 - kRawPutReserve);
  EXPECT_TRUE(Put(a, swap, 1, 100, RandomPage(100)).stored);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentPutsRefusedForSwapQuota),
            1u);
}

// Deferred compression re-charges a persistent page at its compressed
// size: the swap quota's gauge follows, so the room it frees takes more
// pages, and the gauge stays the sum of what the pages are charged.
TEST_F(PersistentPoolTest, DeferredRechargeKeepsTheSwapQuotaGaugeRight) {
  CompactionQueue queue(1024);
  Open(16 * kMiB, 4, &queue);
  const uint64_t swap_quota = 128 * kKiB;
  const VmId a = AddVm("a", kUnlimitedQuota, swap_quota);
  const PoolId swap = Persistent(a);
  PageIndex next = 0;
  while (Put(a, swap, 1, next, TextPage(next), PutMode::kDefer).stored) {
    ++next;
    ASSERT_LT(next, 1000u);
  }
  const PageIndex raw_pages = next;
  ASSERT_GT(raw_pages, 0u);
  std::array<CompactionTicket, 64> tickets;
  size_t n;
  while ((n = queue.PopBatch(tickets)) > 0) {
    for (size_t k = 0; k < n; ++k) {
      Page raw{};
      ASSERT_TRUE(store_->ReadDeferred(tickets[k], MutablePage(raw)));
      std::array<uint8_t, kMaxCompressedPage> block{};
      const size_t len = CompressPage(ConstPage(raw), block);
      ASSERT_GT(len, 0u);
      ASSERT_EQ(store_->CompleteDeferred(
                    tickets[k], std::span<const uint8_t>(block.data(), len)),
                DeferredOutcome::kCompressed);
    }
  }
  VmStats stats = store_->GetVmStats(a).value();
  EXPECT_EQ(
      Value(stats.counters, Counter::kPersistentChargedBytes),
      Value(stats.pools[swap].counters, Counter::kPersistentChargedBytes));
  // The compressed pages left room for more in the same swap quota.
  while (Put(a, swap, 1, next, TextPage(next)).stored) {
    ++next;
    ASSERT_LT(next, 10000u);
  }
  EXPECT_GT(next, raw_pages + 1);
  stats = store_->GetVmStats(a).value();
  const uint64_t held = Value(stats.counters, Counter::kPersistentChargedBytes);
  EXPECT_LE(held, swap_quota);
  EXPECT_EQ(held, Value(stats.pools[swap].counters,
                        Counter::kPersistentChargedBytes));
  for (PageIndex i = 0; i < next; ++i) {
    ASSERT_EQ(Get(a, swap, 1, i), TextPage(i)) << i;
  }
}

// Threads: several threads put into one VM's persistent pool at once. What
// the stored pages are charged never exceeds the swap quota (add then
// check), and the VM's gauge settles to exactly that (every reservation
// trimmed or given back).
TEST_F(PersistentPoolTest, SwapQuotaIsExactUnderConcurrentPuts) {
  Open(32 * kMiB, 8);
  const uint64_t swap_quota = 512 * kKiB;
  const VmId a = AddVm("a", 8 * kMiB, swap_quota);
  const PoolId swap = Persistent(a);
  const PoolId cache = Ephemeral(a);
  constexpr int kThreads = 4;
  constexpr PageIndex kPerThread = 400;
  std::atomic<uint64_t> over{0}, stored{0}, refused{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (PageIndex i = 0; i < kPerThread; ++i) {
        const PageIndex index = t * kPerThread + i;
        // Re-puts, invalidates and a cache page now and then, so
        // reservations meet removals of the same gauge.
        if (i % 7 == 3) {
          (void)store_->InvalidatePage(a, swap, ObjectId::FromInode(1),
                                       index - 2);
        }
        if (i % 5 == 1) {
          (void)store_->Put(a, cache, ObjectId::FromInode(2), index,
                            ConstPage(RandomPage(90000 + index)));
        }
        const Page page = i % 3 == 0 ? TextPage(index) : RandomPage(index);
        auto r = store_->Put(a, swap, ObjectId::FromInode(1),
                             i % 11 == 0 ? index / 2 : index, ConstPage(page));
        if (r.ok() && r->stored) {
          stored.fetch_add(1);
        } else if (r.ok() && r->reason == RefuseReason::kQuota) {
          refused.fetch_add(1);
        } else {
          other.fetch_add(1);  // an error, or refused for another reason
        }
        // What the stored pages are charged (the pool's gauge): the VM's
        // gauge also holds puts in flight, whose add-then-check may stand
        // over the swap quota for the moment before it is taken back.
        const VmStats now = store_->GetVmStats(a).value();
        if (Value(now.pools[swap].counters, Counter::kPersistentChargedBytes) >
            swap_quota) {
          over.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(over.load(), 0u) << "the stored pages went over the swap quota";
  EXPECT_EQ(other.load(), 0u);
  EXPECT_GT(stored.load(), 0u);
  EXPECT_GT(refused.load(), 0u);
  const VmStats stats = store_->GetVmStats(a).value();
  const uint64_t held = Value(stats.counters, Counter::kPersistentChargedBytes);
  EXPECT_LE(held, swap_quota);
  EXPECT_EQ(held, Value(stats.pools[swap].counters,
                        Counter::kPersistentChargedBytes));
  EXPECT_EQ(Value(stats.counters, Counter::kPersistentPutsRefusedForSwapQuota),
            refused.load());
  // Every persistent page gone: the gauge is back at exactly 0.
  ASSERT_TRUE(store_->InvalidatePool(a, swap).ok());
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentChargedBytes), 0u);
  EXPECT_EQ(Value(VmCounters(a), Counter::kPersistentPagesHeld), 0u);
}

}  // namespace
}  // namespace tmem
