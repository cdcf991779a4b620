// Tests for the semantic rules of TmemStore (backend/tmem_store.h): VMs,
// private and shared pools, put/get/invalidate, refusals, storage kinds and
// the counters that report all of them.
#include "backend/tmem_store.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backend/blob_arena.h"
#include "backend/clock.h"
#include "backend/page_codec.h"
#include "backend/shard_table.h"
#include "backend/slab_pool.h"
#include "backend/stats.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::FilledWith;
using test::Page;
using test::RandomPage;
using test::TextPage;
constexpr uint64_t kMiB = uint64_t{1} << 20;

size_t Lz4Size(const Page& page) {
  std::vector<uint8_t> block(kMaxCompressedPage);
  return CompressPage(page, block);
}

uint64_t Get(const CounterValues& v, Counter c) {
  return v[static_cast<int>(c)];
}

ObjectId Oid(uint64_t ino) { return ObjectId::FromInode(ino); }

PoolUuid Uuid(uint8_t tag) {
  PoolUuid u;
  u.bytes.fill(tag);
  u.bytes[0] = 0xfe;
  return u;
}

constexpr Counter kRefusalCounters[] = {
    Counter::kPutsRefusedQuota, Counter::kPutsRefusedPoorCompression,
    Counter::kPutsRefusedNoMemory, Counter::kPutsRefusedPolicy};

class TmemStoreTest : public ::testing::Test {
 protected:
  static StoreOptions SmallOptions() {
    StoreOptions options;
    options.memory_cap_bytes = 64 * kMiB;
    options.address_space_bytes = 256 * kMiB;
    options.num_shards = 8;
    return options;
  }

  void SetUp() override { Open(SmallOptions()); }

  void Open(StoreOptions options) {
    options.clock = &clock_;
    store_.reset();
    absl::StatusOr<std::unique_ptr<TmemStore>> store =
        TmemStore::Create(options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(store).value();
  }

  VmId AddVm(const std::string& name, const VmPolicy& policy = {}) {
    return store_->AddVm(name, policy).value();
  }
  PoolId NewPool(VmId vm) { return store_->NewPool(vm, nullptr).value(); }
  PoolId JoinShared(VmId vm, const PoolUuid& uuid) {
    return store_->NewPool(vm, &uuid).value();
  }
  PutResult Put(VmId vm, PoolId pool, uint64_t ino, PageIndex index,
                const Page& page, PutMode mode = PutMode::kCompress) {
    return store_->Put(vm, pool, Oid(ino), index, page, mode).value();
  }
  // The page on a hit, nullopt on a miss (or an error, which also fails).
  std::optional<Page> GetPage(VmId vm, PoolId pool, uint64_t ino,
                              PageIndex index) {
    Page out;
    out.fill(0xee);
    absl::StatusOr<bool> hit = store_->Get(vm, pool, Oid(ino), index, out);
    EXPECT_TRUE(hit.ok()) << hit.status();
    if (!hit.ok() || !*hit) return std::nullopt;
    return out;
  }
  CounterValues VmCounters(VmId vm) {
    return store_->GetVmStats(vm).value().counters;
  }
  CounterValues HostCounters() { return store_->GetHostStats().counters; }
  const PoolStats* FindPoolStats(const VmStats& stats, PoolId pool) {
    for (const PoolStats& p : stats.pools) {
      if (p.id == pool) return &p;
    }
    return nullptr;
  }

  ManualClock clock_{1'000'000'000};
  std::unique_ptr<TmemStore> store_;
};

// --- VMs --------------------------------------------------------------------

TEST_F(TmemStoreTest, AddFindAndListVms) {
  VmPolicy policy;
  policy.quota_bytes = 12345678;
  policy.weight = 250;
  const VmId a = AddVm("alpha", policy);
  const VmId b = AddVm("beta");
  EXPECT_NE(a, b);
  EXPECT_EQ(store_->FindVm("alpha").value(), a);
  EXPECT_EQ(store_->FindVm("beta").value(), b);
  EXPECT_FALSE(store_->FindVm("gamma").ok());
  std::vector<VmId> listed = store_->ListVms();
  std::sort(listed.begin(), listed.end());
  std::vector<VmId> expected = {a, b};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(listed, expected);
  EXPECT_EQ(store_->GetHostStats().vms, 2u);

  const VmPolicy got = store_->GetVmPolicy(a).value();
  EXPECT_EQ(got.quota_bytes, 12345678u);
  EXPECT_EQ(got.weight, 250u);
  EXPECT_TRUE(got.enabled);
  EXPECT_FALSE(got.frozen);
  const VmStats stats = store_->GetVmStats(a).value();
  EXPECT_EQ(stats.id, a);
  EXPECT_EQ(stats.name, "alpha");
  EXPECT_EQ(stats.policy.quota_bytes, 12345678u);
  EXPECT_EQ(stats.policy.weight, 250u);
}

TEST_F(TmemStoreTest, DuplicateNameIsAlreadyExists) {
  const VmId a = AddVm("alpha");
  absl::StatusOr<VmId> dup = store_->AddVm("alpha", {});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store_->FindVm("alpha").value(), a);
  EXPECT_EQ(store_->ListVms().size(), 1u);
}

TEST_F(TmemStoreTest, EmptyNameIsInvalidArgument) {
  EXPECT_EQ(store_->AddVm("", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_->ListVms().empty());
}

TEST_F(TmemStoreTest, AtMostMaxVms) {
  for (int i = 0; i < kMaxVms; ++i) {
    ASSERT_TRUE(store_->AddVm("vm" + std::to_string(i), {}).ok()) << i;
  }
  EXPECT_EQ(store_->AddVm("one-too-many", {}).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(store_->ForgetVm(store_->FindVm("vm17").value()).ok());
  EXPECT_TRUE(store_->AddVm("one-too-many", {}).ok())
      << "a forgotten VM's slot is free again";
}

TEST_F(TmemStoreTest, SetVmPolicyTakesEffectAndUnknownVmIsNotFound) {
  const VmId a = AddVm("alpha");
  VmPolicy policy;
  policy.quota_bytes = 1 * kMiB;
  policy.weight = 7;
  policy.enabled = false;
  policy.frozen = true;
  ASSERT_TRUE(store_->SetVmPolicy(a, policy).ok());
  const VmPolicy got = store_->GetVmPolicy(a).value();
  EXPECT_EQ(got.quota_bytes, 1 * kMiB);
  EXPECT_EQ(got.weight, 7u);
  EXPECT_FALSE(got.enabled);
  EXPECT_TRUE(got.frozen);
  EXPECT_EQ(store_->SetVmPolicy(a + 12345, policy).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->GetVmPolicy(a + 12345).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(TmemStoreTest, GarbageVmIdsAreNotFound) {
  Page out{};
  for (VmId bogus : {VmId{0}, VmId{1}, VmId{4095}, VmId{4096}, VmId{0x7fffffff},
                     VmId{0xffffffff}}) {
    EXPECT_EQ(store_->NewPool(bogus, nullptr).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->Put(bogus, 0, Oid(1), 0, TextPage(1)).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->Get(bogus, 0, Oid(1), 0, out).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->GetVmStats(bogus).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->ForgetVm(bogus).code(), absl::StatusCode::kNotFound);
  }
}

TEST_F(TmemStoreTest, ForgetVmRemovesTheVm) {
  const VmId a = AddVm("alpha");
  const VmId b = AddVm("beta");
  ASSERT_TRUE(store_->ForgetVm(a).ok());
  EXPECT_FALSE(store_->FindVm("alpha").ok());
  EXPECT_EQ(store_->ListVms(), std::vector<VmId>{b});
  EXPECT_EQ(store_->GetHostStats().vms, 1u);
  EXPECT_EQ(store_->ForgetVm(a).code(), absl::StatusCode::kNotFound);
  // The name is free again, under a new id.
  const VmId a2 = AddVm("alpha");
  EXPECT_NE(a2, a);
}

TEST_F(TmemStoreTest, StaleVmIdIsNotFoundEvenWhenItsSlotIsReused) {
  // Repeat so that some new VM certainly lands in a freed slot.
  AddVm("keeper");
  for (int round = 0; round < 20; ++round) {
    const VmId old_vm = AddVm("old" + std::to_string(round));
    const PoolId old_pool = NewPool(old_vm);
    ASSERT_TRUE(Put(old_vm, old_pool, 1, 0, TextPage(round)).stored);
    ASSERT_TRUE(store_->ForgetVm(old_vm).ok());

    const VmId new_vm = AddVm("new" + std::to_string(round));
    EXPECT_NE(new_vm, old_vm);
    const PoolId new_pool = NewPool(new_vm);
    ASSERT_TRUE(Put(new_vm, new_pool, 1, 0, TextPage(1000 + round)).stored);

    Page out{};
    auto not_found = [](const absl::Status& s) {
      return s.code() == absl::StatusCode::kNotFound;
    };
    for (PoolId pool : {old_pool, new_pool}) {
      EXPECT_TRUE(not_found(
          store_->Put(old_vm, pool, Oid(1), 0, TextPage(5)).status()));
      EXPECT_TRUE(
          not_found(store_->Get(old_vm, pool, Oid(1), 0, out).status()));
      EXPECT_TRUE(not_found(store_->InvalidatePage(old_vm, pool, Oid(1), 0)));
      EXPECT_TRUE(not_found(store_->InvalidateObject(old_vm, pool, Oid(1))));
      EXPECT_TRUE(not_found(store_->InvalidatePool(old_vm, pool)));
      EXPECT_TRUE(not_found(store_->DestroyPool(old_vm, pool)));
    }
    EXPECT_TRUE(not_found(store_->NewPool(old_vm, nullptr).status()));
    EXPECT_TRUE(not_found(store_->SetVmPolicy(old_vm, {})));
    EXPECT_TRUE(not_found(store_->GetVmPolicy(old_vm).status()));
    EXPECT_TRUE(not_found(store_->GetVmStats(old_vm).status()));
    EXPECT_TRUE(not_found(store_->ForgetVm(old_vm)));

    // The new VM was not disturbed by any of that.
    std::optional<Page> page = GetPage(new_vm, new_pool, 1, 0);
    ASSERT_TRUE(page.has_value()) << "round " << round;
    EXPECT_EQ(*page, TextPage(1000 + round));
    ASSERT_TRUE(store_->ForgetVm(new_vm).ok());
  }
}

// --- Pools ------------------------------------------------------------------

TEST_F(TmemStoreTest, PrivateGetIsExclusive) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  const Page page = TextPage(1);
  ASSERT_TRUE(Put(vm, pool, 1, 0, page).stored);
  std::optional<Page> got = GetPage(vm, pool, 1, 0);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, page);
  EXPECT_FALSE(GetPage(vm, pool, 1, 0).has_value())
      << "a private hit removes the page";
  const CounterValues c = VmCounters(vm);
  EXPECT_EQ(Get(c, Counter::kGetsHit), 1u);
  EXPECT_EQ(Get(c, Counter::kGetsMiss), 1u);
  EXPECT_EQ(Get(c, Counter::kPagesHeld), 0u);
  EXPECT_EQ(Get(c, Counter::kChargedBytes), 0u);
  EXPECT_EQ(Get(c, Counter::kStoredBytes), 0u);
}

TEST_F(TmemStoreTest, PoolIdsAreSmallAndReused) {
  const VmId vm = AddVm("alpha");
  std::set<PoolId> live;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 3000; ++i) {
    if (live.size() < 10 || rng() % 2 == 0) {
      const PoolId pool = NewPool(vm);
      EXPECT_GE(pool, 0);
      EXPECT_LT(pool, kMaxPoolsPerVm);
      EXPECT_TRUE(live.insert(pool).second) << "pool id handed out twice";
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(store_->DestroyPool(vm, *it).ok());
      live.erase(it);
    }
  }
}

TEST_F(TmemStoreTest, AtMostMaxPoolsPerVm) {
  const VmId vm = AddVm("alpha");
  for (int i = 0; i < kMaxPoolsPerVm; ++i) {
    ASSERT_TRUE(store_->NewPool(vm, nullptr).ok()) << i;
  }
  EXPECT_FALSE(store_->NewPool(vm, nullptr).ok());
  // Another VM has its own pool ids.
  const VmId other = AddVm("beta");
  EXPECT_TRUE(store_->NewPool(other, nullptr).ok());
}

TEST_F(TmemStoreTest, UnknownPoolIsNotFound) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  const PoolId destroyed = NewPool(vm);
  ASSERT_TRUE(store_->DestroyPool(vm, destroyed).ok());
  Page out{};
  for (PoolId bad : {PoolId{-1}, PoolId{pool + 100}, PoolId{kMaxPoolsPerVm},
                     PoolId{INT32_MAX}, PoolId{INT32_MIN}, destroyed}) {
    EXPECT_EQ(store_->Put(vm, bad, Oid(1), 0, TextPage(1)).status().code(),
              absl::StatusCode::kNotFound)
        << bad;
    EXPECT_EQ(store_->Get(vm, bad, Oid(1), 0, out).status().code(),
              absl::StatusCode::kNotFound)
        << bad;
    EXPECT_EQ(store_->InvalidatePage(vm, bad, Oid(1), 0).code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->InvalidateObject(vm, bad, Oid(1)).code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->InvalidatePool(vm, bad).code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(store_->DestroyPool(vm, bad).code(), absl::StatusCode::kNotFound);
  }
  // Nothing was stored or counted as a put by those calls.
  const CounterValues c = VmCounters(vm);
  EXPECT_EQ(Get(c, Counter::kPagesHeld), 0u);
  EXPECT_EQ(Get(c, Counter::kPutsCompressed), 0u);
}

TEST_F(TmemStoreTest, PoolsOfDifferentVmsAreIsolated) {
  const VmId a = AddVm("alpha");
  const VmId b = AddVm("beta");
  const PoolId pa = NewPool(a);
  const PoolId pb = NewPool(b);
  ASSERT_TRUE(Put(a, pa, 1, 0, TextPage(1)).stored);
  // Same object and index in B's pool: a different key.
  EXPECT_FALSE(GetPage(b, pb, 1, 0).has_value());
  ASSERT_TRUE(Put(b, pb, 1, 0, TextPage(2)).stored);
  std::optional<Page> from_a = GetPage(a, pa, 1, 0);
  ASSERT_TRUE(from_a.has_value());
  EXPECT_EQ(*from_a, TextPage(1));
  // B cannot name a pool of A's that B does not have.
  const PoolId a_only = NewPool(a);
  if (a_only != pb) {
    Page out{};
    EXPECT_EQ(store_->Get(b, a_only, Oid(1), 0, out).status().code(),
              absl::StatusCode::kNotFound);
  }
  // Invalidating B's pool leaves A's pages alone.
  ASSERT_TRUE(Put(a, pa, 2, 0, TextPage(3)).stored);
  ASSERT_TRUE(store_->InvalidatePool(b, pb).ok());
  EXPECT_TRUE(GetPage(a, pa, 2, 0).has_value());
}

TEST_F(TmemStoreTest, RecreatedPoolDoesNotSeeTheOldPoolsPages) {
  const VmId vm = AddVm("alpha");
  for (int round = 0; round < 10; ++round) {
    const PoolId pool = NewPool(vm);
    ASSERT_TRUE(Put(vm, pool, 1, 0, TextPage(round)).stored);
    ASSERT_TRUE(Put(vm, pool, 2, 5, FilledWith(0)).stored);
    ASSERT_TRUE(store_->DestroyPool(vm, pool).ok());
    const PoolId again = NewPool(vm);  // usually the same id
    EXPECT_FALSE(GetPage(vm, again, 1, 0).has_value()) << "round " << round;
    EXPECT_FALSE(GetPage(vm, again, 2, 5).has_value()) << "round " << round;
    ASSERT_TRUE(store_->DestroyPool(vm, again).ok());
  }
  EXPECT_EQ(Get(VmCounters(vm), Counter::kPagesHeld), 0u);
}

TEST_F(TmemStoreTest, DestroyPoolDropsItsPages) {
  const VmId vm = AddVm("alpha");
  const PoolId keep = NewPool(vm);
  const PoolId drop = NewPool(vm);
  for (PageIndex i = 0; i < 5; ++i) {
    ASSERT_TRUE(Put(vm, drop, 1, i, TextPage(i)).stored);
    ASSERT_TRUE(Put(vm, keep, 1, i, TextPage(100 + i)).stored);
  }
  const uint64_t invalidated_before =
      Get(VmCounters(vm), Counter::kPagesInvalidated);
  ASSERT_TRUE(store_->DestroyPool(vm, drop).ok());
  const CounterValues c = VmCounters(vm);
  EXPECT_EQ(Get(c, Counter::kPagesHeld), 5u);
  EXPECT_EQ(Get(c, Counter::kPagesInvalidated), invalidated_before + 5)
      << "pages removed by destroy count as invalidated";
  for (PageIndex i = 0; i < 5; ++i) {
    std::optional<Page> page = GetPage(vm, keep, 1, i);
    ASSERT_TRUE(page.has_value());
    EXPECT_EQ(*page, TextPage(100 + i));
  }
}

// --- Shared pools
// -------------------------------------------------------------

TEST_F(TmemStoreTest, SharedPoolNeedsAuthorization) {
  const VmId a = AddVm("alpha");
  const VmId b = AddVm("beta");
  const PoolUuid uuid = Uuid(1);
  EXPECT_EQ(store_->NewPool(a, &uuid).status().code(),
            absl::StatusCode::kPermissionDenied);
  store_->AuthorizeSharedPool(uuid, "alpha");
  EXPECT_TRUE(store_->NewPool(a, &uuid).ok());
  EXPECT_EQ(store_->NewPool(b, &uuid).status().code(),
            absl::StatusCode::kPermissionDenied)
      << "authorization is per VM name";
  const PoolUuid other = Uuid(2);
  EXPECT_EQ(store_->NewPool(a, &other).status().code(),
            absl::StatusCode::kPermissionDenied)
      << "authorization is per UUID";
  store_->RevokeSharedPool(uuid, "alpha");
  EXPECT_EQ(store_->NewPool(a, &uuid).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(TmemStoreTest, AuthorizationOutlivesTheVm) {
  const PoolUuid uuid = Uuid(3);
  store_->AuthorizeSharedPool(uuid, "alpha");
  const VmId first = AddVm("alpha");
  ASSERT_TRUE(store_->ForgetVm(first).ok());
  const VmId second = AddVm("alpha");
  EXPECT_TRUE(store_->NewPool(second, &uuid).ok());
}

TEST_F(TmemStoreTest, SharedPoolIsSharedAndGetIsNotExclusive) {
  const PoolUuid uuid = Uuid(4);
  store_->AuthorizeSharedPool(uuid, "alpha");
  store_->AuthorizeSharedPool(uuid, "beta");
  const VmId a = AddVm("alpha");
  const VmId b = AddVm("beta");
  const PoolId pa = JoinShared(a, uuid);
  const PoolId pb = JoinShared(b, uuid);

  ASSERT_TRUE(Put(a, pa, 9, 3, TextPage(1)).stored);
  for (int i = 0; i < 3; ++i) {
    std::optional<Page> from_b = GetPage(b, pb, 9, 3);
    ASSERT_TRUE(from_b.has_value()) << i;
    EXPECT_EQ(*from_b, TextPage(1));
  }
  std::optional<Page> from_a = GetPage(a, pa, 9, 3);
  ASSERT_TRUE(from_a.has_value());
  EXPECT_EQ(*from_a, TextPage(1));

  // A put by either member replaces the page for both.
  ASSERT_TRUE(Put(b, pb, 9, 3, TextPage(2)).stored);
  from_a = GetPage(a, pa, 9, 3);
  ASSERT_TRUE(from_a.has_value());
  EXPECT_EQ(*from_a, TextPage(2));
  // An invalidate by either member is seen by both.
  ASSERT_TRUE(store_->InvalidatePage(a, pa, Oid(9), 3).ok());
  EXPECT_FALSE(GetPage(b, pb, 9, 3).has_value());

  const VmStats stats = store_->GetVmStats(b).value();
  const PoolStats* pool_stats = FindPoolStats(stats, pb);
  ASSERT_NE(pool_stats, nullptr);
  EXPECT_TRUE(pool_stats->shared);
  EXPECT_EQ(pool_stats->uuid, uuid);
}

TEST_F(TmemStoreTest, SharedPoolsOfDifferentUuidsAreDistinct) {
  const PoolUuid u1 = Uuid(5);
  const PoolUuid u2 = Uuid(6);
  store_->AuthorizeSharedPool(u1, "alpha");
  store_->AuthorizeSharedPool(u2, "alpha");
  const VmId a = AddVm("alpha");
  const PoolId p1 = JoinShared(a, u1);
  const PoolId p2 = JoinShared(a, u2);
  const PoolId priv = NewPool(a);
  EXPECT_NE(p1, p2);
  ASSERT_TRUE(Put(a, p1, 1, 0, TextPage(1)).stored);
  EXPECT_FALSE(GetPage(a, p2, 1, 0).has_value());
  EXPECT_FALSE(GetPage(a, priv, 1, 0).has_value());
}

TEST_F(TmemStoreTest, SharedPagesSurviveAMemberLeavingAndGoWithTheLast) {
  const PoolUuid uuid = Uuid(7);
  store_->AuthorizeSharedPool(uuid, "alpha");
  store_->AuthorizeSharedPool(uuid, "beta");
  const VmId a = AddVm("alpha");
  const VmId b = AddVm("beta");
  const PoolId pa = JoinShared(a, uuid);
  const PoolId pb = JoinShared(b, uuid);
  ASSERT_TRUE(Put(a, pa, 1, 0, TextPage(1)).stored);
  ASSERT_TRUE(Put(b, pb, 2, 0, TextPage(2)).stored);

  ASSERT_TRUE(store_->DestroyPool(a, pa).ok());
  std::optional<Page> page = GetPage(b, pb, 1, 0);
  ASSERT_TRUE(page.has_value()) << "A's page stays while B is a member";
  EXPECT_EQ(*page, TextPage(1));
  page = GetPage(b, pb, 2, 0);
  ASSERT_TRUE(page.has_value());
  EXPECT_EQ(*page, TextPage(2));

  ASSERT_TRUE(store_->DestroyPool(b, pb).ok());
  EXPECT_EQ(Get(HostCounters(), Counter::kPagesHeld), 0u)
      << "the last member leaving drops the pool's pages";
  EXPECT_EQ(Get(HostCounters(), Counter::kChargedBytes), 0u);
  const PoolId again = JoinShared(a, uuid);
  EXPECT_FALSE(GetPage(a, again, 1, 0).has_value());
  EXPECT_FALSE(GetPage(a, again, 2, 0).has_value());
}

TEST_F(TmemStoreTest, ForgetVmDropsItsPagesEverywhere) {
  const PoolUuid uuid = Uuid(8);
  store_->AuthorizeSharedPool(uuid, "alpha");
  store_->AuthorizeSharedPool(uuid, "beta");
  const VmId a = AddVm("alpha");
  const VmId b = AddVm("beta");
  const PoolId shared_a = JoinShared(a, uuid);
  const PoolId shared_b = JoinShared(b, uuid);
  const PoolId private_a = NewPool(a);
  const PoolId private_b = NewPool(b);
  ASSERT_TRUE(Put(a, shared_a, 1, 0, TextPage(1)).stored);
  ASSERT_TRUE(Put(a, private_a, 1, 0, TextPage(2)).stored);
  ASSERT_TRUE(Put(b, shared_b, 2, 0, TextPage(3)).stored);
  ASSERT_TRUE(Put(b, private_b, 1, 0, TextPage(4)).stored);
  const CounterValues b_before = VmCounters(b);

  ASSERT_TRUE(store_->ForgetVm(a).ok());
  EXPECT_FALSE(GetPage(b, shared_b, 1, 0).has_value())
      << "the page A put into the shared pool went with A";
  std::optional<Page> page = GetPage(b, shared_b, 2, 0);
  ASSERT_TRUE(page.has_value());
  EXPECT_EQ(*page, TextPage(3));
  page = GetPage(b, private_b, 1, 0);
  ASSERT_TRUE(page.has_value());
  EXPECT_EQ(*page, TextPage(4));
  // Host gauges hold only B's (remaining) page now.
  const CounterValues host = HostCounters();
  const CounterValues b_now = VmCounters(b);
  EXPECT_EQ(Get(host, Counter::kPagesHeld), Get(b_now, Counter::kPagesHeld));
  EXPECT_EQ(Get(b_now, Counter::kPagesHeld), 1u);
  EXPECT_EQ(Get(host, Counter::kChargedBytes),
            Get(b_now, Counter::kChargedBytes));
  EXPECT_EQ(Get(b_before, Counter::kPagesHeld), 2u);
}

// --- Puts
// ---------------------------------------------------------------------

TEST_F(TmemStoreTest, PutReplacesTheEarlierPage) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  const Page versions[] = {TextPage(1), RandomPage(2), FilledWith(0),
                           FilledWith(0x1234), TextPage(3)};
  for (const Page& v : versions) ASSERT_TRUE(Put(vm, pool, 1, 0, v).stored);
  EXPECT_EQ(Get(VmCounters(vm), Counter::kPagesHeld), 1u);
  std::optional<Page> page = GetPage(vm, pool, 1, 0);
  ASSERT_TRUE(page.has_value());
  EXPECT_EQ(*page, TextPage(3));
  // The replaced versions' bytes were released too.
  const CounterValues c = VmCounters(vm);
  EXPECT_EQ(Get(c, Counter::kPagesHeld), 0u);
  EXPECT_EQ(Get(c, Counter::kStoredBytes), 0u);
  EXPECT_EQ(Get(c, Counter::kChargedBytes), 0u);
}

TEST_F(TmemStoreTest, StorageKindsAndTheirCounters) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  const Page zero = FilledWith(0);
  const Page same = FilledWith(0x0123456789abcdef);
  const Page text = TextPage(1);
  const Page random = RandomPage(2);
  const size_t text_lz4 = Lz4Size(text);
  ASSERT_LT(text_lz4, SmallOptions().poor_compression_threshold_bytes);

  struct Case {
    const Page* page;
    PutMode mode;
    StorageKind kind;
    uint64_t stored_bytes;
  };
  const Case cases[] = {
      {&zero, PutMode::kCompress, StorageKind::kZero, 0},
      {&same, PutMode::kCompress, StorageKind::kSameFilled, 0},
      {&text, PutMode::kCompress, StorageKind::kLz4, BlobSlotBytes(text_lz4)},
      {&random, PutMode::kCompress, StorageKind::kRaw, kPageSize},
      {&text, PutMode::kRaw, StorageKind::kRaw, kPageSize},
      // Zero and same-filled pages are metadata-only whatever the mode.
      {&zero, PutMode::kRaw, StorageKind::kZero, 0},
      {&same, PutMode::kRaw, StorageKind::kSameFilled, 0},
  };
  uint64_t stored_total = 0;
  uint64_t blob_charge_total = 0;
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    const CounterValues before = VmCounters(vm);
    const PutResult result = Put(vm, pool, 1, i, *c.page, c.mode);
    ASSERT_TRUE(result.stored) << "case " << i;
    EXPECT_EQ(result.kind, c.kind) << "case " << i;
    EXPECT_EQ(result.evicted, 0u);
    const CounterValues after = VmCounters(vm);
    stored_total += c.stored_bytes;
    blob_charge_total += BlobCharge(c.stored_bytes);
    EXPECT_EQ(Get(after, Counter::kStoredBytes), stored_total) << "case " << i;
    // Every page is in object 1 of one pool: one object, one shard.
    EXPECT_EQ(Get(after, Counter::kChargedBytes),
              blob_charge_total + (i + 1) * kPageEntryCharge + kObjectCharge +
                  kPoolInShardCharge)
        << "case " << i;
    EXPECT_EQ(Get(after, Counter::kPagesHeld), i + 1);
    const Counter kind_counter =
        c.kind == StorageKind::kZero         ? Counter::kPutsZero
        : c.kind == StorageKind::kSameFilled ? Counter::kPutsSameFilled
        : c.kind == StorageKind::kLz4        ? Counter::kPutsCompressed
                                             : Counter::kPutsRaw;
    for (Counter k : {Counter::kPutsZero, Counter::kPutsSameFilled,
                      Counter::kPutsCompressed, Counter::kPutsRaw}) {
      EXPECT_EQ(Get(after, k) - Get(before, k), k == kind_counter ? 1u : 0u)
          << "case " << i << " counter " << CounterName(k);
    }
  }
  // Every kind reads back exactly.
  for (size_t i = 0; i < std::size(cases); ++i) {
    std::optional<Page> page = GetPage(vm, pool, 1, i);
    ASSERT_TRUE(page.has_value()) << "case " << i;
    EXPECT_EQ(*page, *cases[i].page) << "case " << i;
  }
  const CounterValues end = VmCounters(vm);
  EXPECT_EQ(Get(end, Counter::kGetsHit), std::size(cases));
  EXPECT_EQ(Get(end, Counter::kPagesHeld), 0u);
  EXPECT_EQ(Get(end, Counter::kChargedBytes), 0u);
}

TEST_F(TmemStoreTest, PoorCompressionThresholdIsHonoured) {
  const Page text = TextPage(42);
  const size_t lz4 = Lz4Size(text);
  for (bool refuse : {false, true}) {
    for (size_t threshold : {lz4 - 1, lz4}) {
      StoreOptions options = SmallOptions();
      options.poor_compression_threshold_bytes = threshold;
      options.poor_compression_action = refuse
                                            ? PoorCompressionAction::kRefuse
                                            : PoorCompressionAction::kStoreRaw;
      Open(options);
      const VmId vm = AddVm("alpha");
      const PoolId pool = NewPool(vm);
      const PutResult result = Put(vm, pool, 1, 0, text);
      const bool poor = lz4 > threshold;  // "larger than this" is poor
      SCOPED_TRACE(testing::Message() << "refuse=" << refuse << " threshold="
                                      << threshold << " lz4=" << lz4);
      if (!poor) {
        ASSERT_TRUE(result.stored);
        EXPECT_EQ(result.kind, StorageKind::kLz4);
      } else if (refuse) {
        EXPECT_FALSE(result.stored);
        EXPECT_EQ(result.reason, RefuseReason::kPoorCompression);
        EXPECT_EQ(Get(VmCounters(vm), Counter::kPutsRefusedPoorCompression),
                  1u);
      } else {
        ASSERT_TRUE(result.stored);
        EXPECT_EQ(result.kind, StorageKind::kRaw);
        EXPECT_EQ(Get(VmCounters(vm), Counter::kPutsRaw), 1u);
      }
      std::optional<Page> page = GetPage(vm, pool, 1, 0);
      EXPECT_EQ(page.has_value(), result.stored);
      if (page) {
        EXPECT_EQ(*page, text);
      }
    }
  }
}

// One way of getting a put refused. `setup` runs after the first version of
// the key is stored; then a put of the second version must be refused.
struct RefusalCase {
  std::string name;
  RefuseReason reason;
  std::function<void(TmemStore&, VmId)> setup;
  Page first;
  Page second;
  PutMode second_mode = PutMode::kCompress;
  StoreOptions options;
  // Whether the store may evict the VM's other page while trying to make
  // room (only when the refusal comes after an eviction attempt).
  bool may_evict_others = false;
};

class RefusedPutTest : public TmemStoreTest,
                       public ::testing::WithParamInterface<int> {
 public:
  static std::vector<RefusalCase> Cases() {
    std::vector<RefusalCase> cases;
    StoreOptions base = SmallOptions();

    cases.push_back({"DropMode", RefuseReason::kPolicy, [](TmemStore&, VmId) {},
                     TextPage(1), TextPage(2), PutMode::kDrop, base});
    cases.push_back({"FrozenVm", RefuseReason::kPolicy,
                     [](TmemStore& s, VmId vm) {
                       VmPolicy p = s.GetVmPolicy(vm).value();
                       p.frozen = true;
                       ASSERT_TRUE(s.SetVmPolicy(vm, p).ok());
                     },
                     TextPage(1), TextPage(2), PutMode::kCompress, base});
    cases.push_back({"DisabledVm", RefuseReason::kPolicy,
                     [](TmemStore& s, VmId vm) {
                       VmPolicy p = s.GetVmPolicy(vm).value();
                       p.enabled = false;
                       ASSERT_TRUE(s.SetVmPolicy(vm, p).ok());
                     },
                     TextPage(1), FilledWith(0), PutMode::kCompress, base});
    // A zero page (metadata charge only) fits a 100-byte quota; a raw page
    // could not fit even in an empty quota.
    cases.push_back({"QuotaSmallerThanAPage", RefuseReason::kQuota,
                     [](TmemStore& s, VmId vm) {
                       VmPolicy p = s.GetVmPolicy(vm).value();
                       // Room for the zero page kept, not for a raw one.
                       p.quota_bytes = 2 * kMaxPageMetadataCharge;
                       ASSERT_TRUE(s.SetVmPolicy(vm, p).ok());
                     },
                     FilledWith(0), RandomPage(2), PutMode::kCompress, base});
    StoreOptions refuse_raw = base;
    refuse_raw.poor_compression_action = PoorCompressionAction::kRefuse;
    cases.push_back({"PoorCompression", RefuseReason::kPoorCompression,
                     [](TmemStore&, VmId) {}, TextPage(1), RandomPage(2),
                     PutMode::kCompress, refuse_raw});
    // The cap has room for an entry chunk (metadata-only pages) but never
    // for a 64 KiB blob slab.
    StoreOptions tiny = base;
    tiny.num_shards = 1;
    tiny.memory_cap_bytes = uint64_t{56} * 1024;
    tiny.address_space_bytes = 4 * kMiB;
    cases.push_back({"NoMemory", RefuseReason::kNoMemory,
                     [](TmemStore&, VmId) {}, FilledWith(7), TextPage(2),
                     PutMode::kCompress, tiny, /*may_evict_others=*/true});
    return cases;
  }
};

TEST_P(RefusedPutTest, RemovesTheEarlierVersionAndCountsTheReason) {
  const RefusalCase c = Cases()[GetParam()];
  SCOPED_TRACE(c.name);
  Open(c.options);
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  ASSERT_TRUE(Put(vm, pool, 1, 0, c.first).stored);
  // Another key stored before the setup, to show gets are still served.
  ASSERT_TRUE(Put(vm, pool, 2, 0, c.first).stored);
  c.setup(*store_, vm);
  const CounterValues vm_before = VmCounters(vm);
  const CounterValues host_before = HostCounters();

  const PutResult result = Put(vm, pool, 1, 0, c.second, c.second_mode);
  EXPECT_FALSE(result.stored);
  EXPECT_EQ(result.reason, c.reason);

  const CounterValues vm_after = VmCounters(vm);
  const CounterValues host_after = HostCounters();
  for (Counter k : kRefusalCounters) {
    const uint64_t want = k == RefusedCounter(c.reason) ? 1 : 0;
    EXPECT_EQ(Get(vm_after, k) - Get(vm_before, k), want) << CounterName(k);
    EXPECT_EQ(Get(host_after, k) - Get(host_before, k), want) << CounterName(k);
  }
  for (Counter k : {Counter::kPutsZero, Counter::kPutsSameFilled,
                    Counter::kPutsCompressed, Counter::kPutsRaw}) {
    EXPECT_EQ(Get(vm_after, k), Get(vm_before, k))
        << "a refused put is not a stored put: " << CounterName(k);
  }
  if (c.may_evict_others) {
    EXPECT_LE(Get(vm_after, Counter::kPagesHeld), 1u);
  } else {
    EXPECT_EQ(Get(vm_after, Counter::kPagesHeld), 1u)
        << "the earlier version of the key is gone, the other key is not";
  }

  // The stale first version must never come back.
  EXPECT_FALSE(GetPage(vm, pool, 1, 0).has_value());
  // Gets are still served (frozen and disabled VMs included).
  std::optional<Page> other = GetPage(vm, pool, 2, 0);
  if (!c.may_evict_others) {
    ASSERT_TRUE(other.has_value());
  }
  if (other.has_value()) {
    EXPECT_EQ(*other, c.first);
  }
}

INSTANTIATE_TEST_SUITE_P(AllReasons, RefusedPutTest, ::testing::Range(0, 6),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return RefusedPutTest::Cases()[info.param].name;
                         });

TEST_F(TmemStoreTest, FrozenAndDisabledVmsRefuseEvenMetadataOnlyPages) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  VmPolicy policy;
  policy.frozen = true;
  ASSERT_TRUE(store_->SetVmPolicy(vm, policy).ok());
  PutResult r = Put(vm, pool, 1, 0, FilledWith(0));
  EXPECT_FALSE(r.stored);
  EXPECT_EQ(r.reason, RefuseReason::kPolicy);
  policy.frozen = false;
  policy.enabled = false;
  ASSERT_TRUE(store_->SetVmPolicy(vm, policy).ok());
  r = Put(vm, pool, 1, 0, FilledWith(5));
  EXPECT_FALSE(r.stored);
  EXPECT_EQ(r.reason, RefuseReason::kPolicy);
  EXPECT_EQ(Get(VmCounters(vm), Counter::kPutsRefusedPolicy), 2u);
  // Thawed and enabled again: puts are stored.
  policy.enabled = true;
  ASSERT_TRUE(store_->SetVmPolicy(vm, policy).ok());
  EXPECT_TRUE(Put(vm, pool, 1, 0, FilledWith(5)).stored);
}

// --- Invalidates
// --------------------------------------------------------------

TEST_F(TmemStoreTest, InvalidatePageObjectAndPool) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  const PoolId other_pool = NewPool(vm);
  for (PageIndex i = 0; i < 10; ++i) {
    ASSERT_TRUE(Put(vm, pool, 1, i, TextPage(i)).stored);
  }
  for (PageIndex i = 0; i < 5; ++i) {
    ASSERT_TRUE(Put(vm, pool, 2, i, FilledWith(i)).stored);
  }
  ASSERT_TRUE(Put(vm, other_pool, 1, 3, TextPage(77)).stored);
  auto held = [&] { return Get(VmCounters(vm), Counter::kPagesHeld); };
  auto invalidated = [&] {
    return Get(VmCounters(vm), Counter::kPagesInvalidated);
  };
  ASSERT_EQ(held(), 16u);

  ASSERT_TRUE(store_->InvalidatePage(vm, pool, Oid(1), 3).ok());
  EXPECT_EQ(held(), 15u);
  EXPECT_EQ(invalidated(), 1u);
  // Invalidating a page that is not there is a call but removes nothing.
  ASSERT_TRUE(store_->InvalidatePage(vm, pool, Oid(1), 3).ok());
  ASSERT_TRUE(store_->InvalidatePage(vm, pool, Oid(99), 0).ok());
  EXPECT_EQ(invalidated(), 1u);
  EXPECT_EQ(Get(VmCounters(vm), Counter::kInvalidatePage), 3u);

  ASSERT_TRUE(store_->InvalidateObject(vm, pool, Oid(1)).ok());
  EXPECT_EQ(held(), 6u);
  EXPECT_EQ(invalidated(), 10u);
  EXPECT_EQ(Get(VmCounters(vm), Counter::kInvalidateObject), 1u);
  std::optional<Page> object2 = GetPage(vm, pool, 2, 4);
  ASSERT_TRUE(object2.has_value()) << "other objects are untouched";
  EXPECT_EQ(*object2, FilledWith(4));

  ASSERT_TRUE(store_->InvalidatePool(vm, pool).ok());
  EXPECT_EQ(held(), 1u);
  EXPECT_EQ(invalidated(), 14u);
  EXPECT_EQ(Get(VmCounters(vm), Counter::kInvalidatePool), 1u);
  for (PageIndex i = 0; i < 10; ++i) {
    EXPECT_FALSE(GetPage(vm, pool, 1, i).has_value()) << i;
  }
  std::optional<Page> other = GetPage(vm, other_pool, 1, 3);
  ASSERT_TRUE(other.has_value()) << "other pools are untouched";
  EXPECT_EQ(*other, TextPage(77));

  // The pool is still usable after InvalidatePool.
  ASSERT_TRUE(Put(vm, pool, 1, 0, TextPage(5)).stored);
  std::optional<Page> again = GetPage(vm, pool, 1, 0);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, TextPage(5));
}

TEST_F(TmemStoreTest, InvalidateIsHonouredBeforeALaterPutOfTheSameKey) {
  // The CVE-2018-16862 shape: a file is deleted (invalidate) and its inode
  // number reused; the old contents must never be returned.
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  for (PageIndex i = 0; i < 4; ++i) {
    ASSERT_TRUE(Put(vm, pool, 500, i, TextPage(i)).stored);
  }
  ASSERT_TRUE(store_->InvalidateObject(vm, pool, Oid(500)).ok());
  ASSERT_TRUE(Put(vm, pool, 500, 1, TextPage(1001)).stored);
  EXPECT_FALSE(GetPage(vm, pool, 500, 0).has_value());
  std::optional<Page> page = GetPage(vm, pool, 500, 1);
  ASSERT_TRUE(page.has_value());
  EXPECT_EQ(*page, TextPage(1001));
  EXPECT_FALSE(GetPage(vm, pool, 500, 2).has_value());
}

// --- Statistics
// ---------------------------------------------------------------

TEST_F(TmemStoreTest, GetHitAndMissCounters) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  EXPECT_FALSE(GetPage(vm, pool, 1, 0).has_value());
  EXPECT_FALSE(GetPage(vm, pool, 1, 1).has_value());
  ASSERT_TRUE(Put(vm, pool, 1, 0, TextPage(1)).stored);
  ASSERT_TRUE(Put(vm, pool, 1, 1, FilledWith(0)).stored);
  EXPECT_TRUE(GetPage(vm, pool, 1, 0).has_value());
  EXPECT_TRUE(GetPage(vm, pool, 1, 1).has_value());
  EXPECT_FALSE(GetPage(vm, pool, 1, 1).has_value());
  const CounterValues c = VmCounters(vm);
  EXPECT_EQ(Get(c, Counter::kGetsHit), 2u);
  EXPECT_EQ(Get(c, Counter::kGetsMiss), 3u);
  EXPECT_EQ(Get(HostCounters(), Counter::kGetsHit), 2u);
  EXPECT_EQ(Get(HostCounters(), Counter::kGetsMiss), 3u);
}

TEST_F(TmemStoreTest, PerPoolStats) {
  const VmId vm = AddVm("alpha");
  const PoolId p0 = NewPool(vm);
  const PoolId p1 = NewPool(vm);
  for (PageIndex i = 0; i < 3; ++i)
    ASSERT_TRUE(Put(vm, p0, 1, i, TextPage(i)).stored);
  for (PageIndex i = 0; i < 5; ++i) {
    ASSERT_TRUE(Put(vm, p1, 1, i, FilledWith(i + 1)).stored);
  }
  EXPECT_TRUE(GetPage(vm, p0, 1, 0).has_value());
  EXPECT_FALSE(GetPage(vm, p1, 9, 0).has_value());
  EXPECT_FALSE(GetPage(vm, p1, 9, 1).has_value());
  ASSERT_TRUE(store_->InvalidatePage(vm, p1, Oid(1), 4).ok());

  const VmStats stats = store_->GetVmStats(vm).value();
  ASSERT_EQ(stats.pools.size(), 2u);
  const PoolStats* s0 = FindPoolStats(stats, p0);
  const PoolStats* s1 = FindPoolStats(stats, p1);
  ASSERT_NE(s0, nullptr);
  ASSERT_NE(s1, nullptr);
  EXPECT_FALSE(s0->shared);
  EXPECT_EQ(Get(s0->counters, Counter::kPutsCompressed), 3u);
  EXPECT_EQ(Get(s0->counters, Counter::kGetsHit), 1u);
  EXPECT_EQ(Get(s0->counters, Counter::kGetsMiss), 0u);
  EXPECT_EQ(Get(s0->counters, Counter::kPagesHeld), 2u);
  EXPECT_EQ(Get(s1->counters, Counter::kPutsSameFilled), 5u);
  EXPECT_EQ(Get(s1->counters, Counter::kPutsCompressed), 0u);
  EXPECT_EQ(Get(s1->counters, Counter::kGetsMiss), 2u);
  EXPECT_EQ(Get(s1->counters, Counter::kInvalidatePage), 1u);
  EXPECT_EQ(Get(s1->counters, Counter::kPagesInvalidated), 1u);
  EXPECT_EQ(Get(s1->counters, Counter::kPagesHeld), 4u);
  EXPECT_EQ(Get(s1->counters, Counter::kStoredBytes), 0u);
  // Four pages of one object in one shard.
  EXPECT_EQ(Get(s1->counters, Counter::kChargedBytes),
            4 * kPageEntryCharge + kObjectCharge + kPoolInShardCharge);
  // A VM's counters are its pools' counters summed.
  for (int i = 0; i < kNumCounters; ++i) {
    EXPECT_EQ(stats.counters[i], s0->counters[i] + s1->counters[i])
        << CounterName(static_cast<Counter>(i));
  }
}

TEST_F(TmemStoreTest, HostCountersSumOverVmsAndStayMonotonicAfterForget) {
  const PoolUuid uuid = Uuid(9);
  std::vector<VmId> vms;
  std::vector<PoolId> pools;
  for (int i = 0; i < 3; ++i) {
    const std::string name = "vm" + std::to_string(i);
    store_->AuthorizeSharedPool(uuid, name);
    vms.push_back(AddVm(name));
    pools.push_back(NewPool(vms.back()));
  }
  std::vector<PoolId> shared;
  for (VmId vm : vms) shared.push_back(JoinShared(vm, uuid));

  std::mt19937_64 rng(17);
  auto random_ops = [&](const std::vector<int>& who, int count) {
    for (int i = 0; i < count; ++i) {
      const int v = who[rng() % who.size()];
      const PoolId pool = rng() % 4 == 0 ? shared[v] : pools[v];
      const uint64_t ino = rng() % 5;
      const PageIndex index = rng() % 8;
      switch (rng() % 6) {
        case 0:
        case 1: {
          const uint64_t kind = rng() % 4;
          const Page page = kind == 0   ? FilledWith(0)
                            : kind == 1 ? FilledWith(rng())
                            : kind == 2 ? TextPage(rng())
                                        : RandomPage(rng());
          Put(vms[v], pool, ino, index, page,
              rng() % 10 == 0 ? PutMode::kDrop : PutMode::kCompress);
          break;
        }
        case 2:
          GetPage(vms[v], pool, ino, index);
          break;
        case 3:
          ASSERT_TRUE(
              store_->InvalidatePage(vms[v], pool, Oid(ino), index).ok());
          break;
        case 4:
          ASSERT_TRUE(store_->InvalidateObject(vms[v], pool, Oid(ino)).ok());
          break;
        default:
          if (rng() % 10 == 0) {
            ASSERT_TRUE(store_->InvalidatePool(vms[v], pool).ok());
          } else {
            Put(vms[v], pool, ino, index, TextPage(rng()));
          }
          break;
      }
    }
  };
  auto sum_of = [&](const std::vector<int>& who) {
    CounterValues sum{};
    for (int v : who) {
      const CounterValues c = VmCounters(vms[v]);
      for (int i = 0; i < kNumCounters; ++i) sum[i] += c[i];
    }
    return sum;
  };

  random_ops({0, 1, 2}, 2000);
  const CounterValues host_before = HostCounters();
  const CounterValues sum_before = sum_of({0, 1, 2});
  for (int i = 0; i < kNumCounters; ++i) {
    EXPECT_EQ(host_before[i], sum_before[i])
        << CounterName(static_cast<Counter>(i));
  }
  EXPECT_GT(Get(host_before, Counter::kPutsCompressed), 0u);
  EXPECT_GT(Get(host_before, Counter::kGetsHit), 0u);

  ASSERT_TRUE(store_->ForgetVm(vms[1]).ok());
  const CounterValues host_forgot = HostCounters();
  const CounterValues sum_forgot = sum_of({0, 2});
  for (int i = 0; i < kNumCounters; ++i) {
    const auto c = static_cast<Counter>(i);
    if (CounterIsGauge(c)) {
      // Gauges describe what is held now, and VM 1 holds nothing.
      EXPECT_EQ(host_forgot[i], sum_forgot[i]) << CounterName(c);
    } else {
      EXPECT_GE(host_forgot[i], host_before[i]) << CounterName(c);
    }
  }

  // Later activity adds to the totals that still include the forgotten VM.
  random_ops({0, 2}, 1000);
  const CounterValues host_after = HostCounters();
  const CounterValues sum_after = sum_of({0, 2});
  for (int i = 0; i < kNumCounters; ++i) {
    const auto c = static_cast<Counter>(i);
    if (CounterIsGauge(c)) {
      EXPECT_EQ(host_after[i], sum_after[i]) << CounterName(c);
    } else {
      EXPECT_EQ(host_after[i] - host_forgot[i], sum_after[i] - sum_forgot[i])
          << CounterName(c);
    }
  }
}

TEST_F(TmemStoreTest, CompressionRatioAboveOneForTextPages) {
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  uint64_t page_charges = 0;
  for (PageIndex i = 0; i < 200; ++i) {
    const Page page = TextPage(i);
    ASSERT_TRUE(Put(vm, pool, i / 16, i, page).stored);
    page_charges += BlobCharge(BlobSlotBytes(Lz4Size(page))) + kPageEntryCharge;
  }
  // 13 objects (16 pages each), whose pool is in 1 to 13 shards.
  page_charges += 13 * kObjectCharge;
  const CounterValues c = VmCounters(vm);
  const uint64_t expected_charge = Get(c, Counter::kChargedBytes);
  EXPECT_GE(expected_charge, page_charges + kPoolInShardCharge);
  EXPECT_LE(expected_charge, page_charges + 13 * kPoolInShardCharge);
  EXPECT_EQ(Get(c, Counter::kPutsCompressed), 200u);
  const double ratio = CompressionRatio(c);
  EXPECT_GT(ratio, 1.5);
  EXPECT_DOUBLE_EQ(ratio,
                   200.0 * 4096.0 / static_cast<double>(expected_charge));
  EXPECT_GT(CompressionRatio(HostCounters()), 1.5);

  // Random pages stored raw cost more than they hold.
  const VmId raw_vm = AddVm("beta");
  const PoolId raw_pool = NewPool(raw_vm);
  for (PageIndex i = 0; i < 20; ++i) {
    ASSERT_TRUE(Put(raw_vm, raw_pool, 1, i, RandomPage(i)).stored);
  }
  EXPECT_LT(CompressionRatio(VmCounters(raw_vm)), 1.0);
}

TEST_F(TmemStoreTest, HostMemoryFiguresAndUptime) {
  HostStats host = store_->GetHostStats();
  EXPECT_EQ(host.memory_cap_bytes, SmallOptions().memory_cap_bytes);
  EXPECT_EQ(host.vms, 0u);
  const int64_t uptime0 = host.uptime_nanos;
  EXPECT_GE(uptime0, 0);
  clock_.Advance(5'000'000'000);
  EXPECT_EQ(store_->GetHostStats().uptime_nanos - uptime0, 5'000'000'000);

  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  for (PageIndex i = 0; i < 300; ++i) {
    ASSERT_TRUE(
        Put(vm, pool, i % 7, i, i % 2 ? TextPage(i) : RandomPage(i)).stored);
  }
  host = store_->GetHostStats();
  EXPECT_GT(host.slab_bytes, 0u);
  EXPECT_EQ(host.slab_bytes % kSlabBytes, 0u) << "slabs are whole";
  EXPECT_GT(host.metadata_bytes, 0u);
  EXPECT_GE(host.memory_used_bytes, host.slab_bytes + host.metadata_bytes);
  EXPECT_GE(host.slab_bytes, Get(host.counters, Counter::kStoredBytes))
      << "blob slots live in slabs";
  EXPECT_EQ(host.blob_slot_bytes, Get(host.counters, Counter::kStoredBytes));
  EXPECT_LE(host.blob_slot_bytes, host.slab_bytes);
  EXPECT_LE(host.memory_used_bytes, host.memory_cap_bytes);

  // Emptying the store hands every slab back (to the slab pool, which
  // keeps them charged for the next puts until a periodic trim leaves a
  // few).
  ASSERT_TRUE(store_->InvalidatePool(vm, pool).ok());
  EXPECT_GT(store_->TrimIdleSlabs(), 0u);
  host = store_->GetHostStats();
  EXPECT_LE(host.slab_bytes, SlabPool::kCachedSlabs * kSlabBytes);
  EXPECT_EQ(host.blob_slot_bytes, 0u);
  EXPECT_EQ(Get(host.counters, Counter::kStoredBytes), 0u);
}

TEST_F(TmemStoreTest, EmptiedStoreGivesBackItsMetadata) {
  // "An empty shard returns its entry chunks and tables beyond the first
  // chunk": a burst of metadata-only pages must not pin memory forever.
  const VmId vm = AddVm("alpha");
  const PoolId pool = NewPool(vm);
  for (PageIndex i = 0; i < 100000; ++i) {
    ASSERT_TRUE(Put(vm, pool, i % 1000, i, FilledWith(i % 2)).stored);
  }
  const HostStats full = store_->GetHostStats();
  EXPECT_GE(full.metadata_bytes, 100000 * sizeof(PageEntry))
      << "40-byte entries for 100 K pages";
  ASSERT_TRUE(store_->InvalidatePool(vm, pool).ok());
  const HostStats empty = store_->GetHostStats();
  EXPECT_EQ(Get(empty.counters, Counter::kPagesHeld), 0u);
  // At most one chunk (1024 x 40 bytes by shard_table.h) and small tables
  // per shard remain.
  const uint64_t per_shard = 1024 * 40 + 8 * 1024;
  EXPECT_LE(empty.metadata_bytes, SmallOptions().num_shards * per_shard)
      << "was " << full.metadata_bytes;
  EXPECT_EQ(empty.slab_bytes, 0u);
  EXPECT_GE(empty.memory_used_bytes, empty.metadata_bytes);
  EXPECT_LE(empty.memory_used_bytes, full.memory_used_bytes / 4);
}

TEST_F(TmemStoreTest, SetMemoryCapBeyondTheReservationIsInvalid) {
  EXPECT_EQ(store_->SetMemoryCap(SmallOptions().address_space_bytes * 2).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->GetHostStats().memory_cap_bytes,
            SmallOptions().memory_cap_bytes);
  EXPECT_TRUE(store_->SetMemoryCap(128 * kMiB).ok());
  EXPECT_EQ(store_->GetHostStats().memory_cap_bytes, 128 * kMiB);
}

// A handle kept from a forgotten VM never reaches a later VM in the same
// slot, even after more than 65,536 re-adds (a 16-bit generation would wrap
// there), and forgotten VMs' structs are reused, not kept.
TEST(VmIdTest, AStaleHandleNeverReachesALaterVm) {
  StoreOptions options;
  options.memory_cap_bytes = 16 << 20;
  options.address_space_bytes = 64 << 20;
  options.num_shards = 1;
  std::unique_ptr<TmemStore> store = TmemStore::Create(options).value();
  const VmId first = store->AddVm("first", VmPolicy{}).value();
  ASSERT_TRUE(store->ForgetVm(first).ok());
  for (int i = 0; i < 70000; ++i) {
    const VmId id = store->AddVm(absl::StrCat("vm", i), VmPolicy{}).value();
    ASSERT_NE(id, first) << "id reissued after " << i << " re-adds";
    ASSERT_EQ(store->GetVmStats(first).status().code(),
              absl::StatusCode::kNotFound)
        << i;
    ASSERT_TRUE(store->ForgetVm(id).ok());
  }
  // The reused struct serves the new VM with fresh counters and policy.
  VmPolicy policy;
  policy.weight = 7;
  const VmId last = store->AddVm("last", policy).value();
  const VmStats stats = store->GetVmStats(last).value();
  EXPECT_EQ(stats.name, "last");
  EXPECT_EQ(stats.policy.weight, 7u);
  EXPECT_EQ(stats.counters[static_cast<int>(Counter::kPagesHeld)], 0u);
  EXPECT_TRUE(stats.pools.empty());
  EXPECT_EQ(store->SetVmPolicy(first, VmPolicy{}).code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tmem
