// TmemStore::PersistentExcessBytes: how much of a VM's persistent charge is
// beyond what it may hold now. A lowered quota asks for the charge above
// it (ephemeral pages go first, by eviction); a lowered host cap asks the
// VMs furthest over their weighted fair share first, down to a common
// level, and nothing of a VM within its share; each limit asks at most
// the VM's persistent charge; nothing is asked while every limit holds.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::RandomPage;

constexpr uint64_t kMiB = uint64_t{1} << 20;

class PersistentExcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions options;
    options.memory_cap_bytes = 32 * kMiB;
    options.address_space_bytes = 64 * kMiB;
    options.num_shards = 8;
    store_ = TmemStore::Create(options).value();
  }
  VmId AddVm(const std::string& name, uint32_t weight) {
    VmPolicy policy;
    policy.weight = weight;
    return store_->AddVm(name, policy).value();
  }
  // `pages` incompressible pages (raw: a known, equal charge each).
  void Fill(VmId vm, PoolId pool, uint64_t pages, uint64_t seed) {
    for (uint64_t i = 0; i < pages; ++i) {
      const PutResult r =
          store_
              ->Put(vm, pool, ObjectId::FromInode(i / 64), i % 64,
                    ConstPage(RandomPage(seed + i)), PutMode::kRaw)
              .value();
      ASSERT_TRUE(r.stored) << "page " << i;
    }
  }
  PersistentExcess Excess(VmId vm) {
    return store_->PersistentExcessBytes(vm).value();
  }
  uint64_t Charged(VmId vm) {
    return CounterValueOf(store_->GetVmStats(vm)->counters,
                          Counter::kChargedBytes);
  }
  std::unique_ptr<TmemStore> store_;
};

TEST_F(PersistentExcessTest, NothingWhileEveryLimitHolds) {
  const VmId vm = AddVm("a", 100);
  Fill(vm, store_->NewPool(vm, nullptr, PoolKind::kPersistent).value(), 100, 1);
  const PersistentExcess e = Excess(vm);
  EXPECT_EQ(e.bytes, 0u);
  EXPECT_EQ(e.over_quota, 0u);
  EXPECT_EQ(e.over_swap_quota, 0u);
  EXPECT_EQ(e.host_cap_share, 0u);
  EXPECT_GT(e.persistent_bytes, 0u);
  EXPECT_EQ(store_->PersistentExcessBytes(vm + 12345).status().code(),
            absl::StatusCode::kNotFound);
}

// Ephemeral pages go first (evicted by the lowered quota); what is left
// over is persistent, and never more than the persistent charge.
TEST_F(PersistentExcessTest, AQuotaAsksTheChargeAboveIt) {
  const VmId vm = AddVm("a", 100);
  const PoolId eph = store_->NewPool(vm, nullptr).value();
  const PoolId per =
      store_->NewPool(vm, nullptr, PoolKind::kPersistent).value();
  Fill(vm, eph, 100, 1000);
  Fill(vm, per, 100, 1);
  const uint64_t persistent = Excess(vm).persistent_bytes;
  VmPolicy policy;
  policy.quota_bytes = persistent / 2;
  ASSERT_TRUE(store_->SetVmPolicy(vm, policy).ok());
  // The ephemeral pages went; the persistent ones all stayed.
  EXPECT_EQ(Excess(vm).persistent_bytes, persistent);
  const PersistentExcess e = Excess(vm);
  EXPECT_EQ(e.over_quota, Charged(vm) - policy.quota_bytes);
  EXPECT_EQ(e.bytes, e.over_quota);
  // A quota of 0 asks for all of it, and no more.
  policy.quota_bytes = 0;
  ASSERT_TRUE(store_->SetVmPolicy(vm, policy).ok());
  EXPECT_EQ(Charged(vm), persistent);
  EXPECT_EQ(Excess(vm).over_quota, persistent);
}

// Three VMs at a lowered cap: weights 100, 100, 300. The small one is
// within its share and gives nothing; the two over it give down to one
// level of charge per weight, and together exactly the host's excess
// (within a byte per unit of weight).
TEST_F(PersistentExcessTest, ACapAsksTheVmsFurthestOverTheirShareFirst) {
  const VmId a = AddVm("a", 100);
  const VmId b = AddVm("b", 100);
  const VmId c = AddVm("c", 300);
  Fill(a, store_->NewPool(a, nullptr, PoolKind::kPersistent).value(), 400, 1);
  Fill(b, store_->NewPool(b, nullptr, PoolKind::kPersistent).value(), 40,
       10000);
  Fill(c, store_->NewPool(c, nullptr, PoolKind::kPersistent).value(), 500,
       20000);
  const uint64_t ca = Charged(a);
  const uint64_t cb = Charged(b);
  const uint64_t cc = Charged(c);
  for (VmId vm : {a, b, c}) EXPECT_EQ(Excess(vm).bytes, 0u);

  const uint64_t cap = (ca + cb + cc) * 3 / 5;
  ASSERT_TRUE(store_->SetMemoryCap(cap).ok());
  const HostStats hs = store_->GetHostStats();
  const uint64_t held = std::min(hs.memory_used_bytes, hs.vm_charged_bytes);
  ASSERT_GT(held, cap);
  const uint64_t host_excess = held - cap;
  const PersistentExcess ea = Excess(a);
  const PersistentExcess eb = Excess(b);
  const PersistentExcess ec = Excess(c);
  EXPECT_EQ(eb.host_cap_share, 0u) << "b is within its share";
  EXPECT_GT(ea.host_cap_share, 0u);
  EXPECT_GT(ec.host_cap_share, 0u);
  EXPECT_GE(ea.host_cap_share + ec.host_cap_share, host_excess);
  EXPECT_LE(ea.host_cap_share + ec.host_cap_share, host_excess + 100 + 300);
  // One level of charge per weight for the givers, within a byte of it.
  const uint64_t level_a = (ca - ea.host_cap_share) / 100;
  const uint64_t level_c = (cc - ec.host_cap_share) / 300;
  EXPECT_LE(std::max(level_a, level_c) - std::min(level_a, level_c), 1u);
  // b stays within that level.
  EXPECT_LT(cb / 100, level_a);
  EXPECT_EQ(ea.bytes, ea.host_cap_share);

  // The cap raised again: nothing is asked.
  ASSERT_TRUE(store_->SetMemoryCap(32 * kMiB).ok());
  for (VmId vm : {a, b, c}) EXPECT_EQ(Excess(vm).bytes, 0u);
}

// A cap below what every VM's persistent pages could give in fair shares:
// each gives at most all of its persistent charge.
TEST_F(PersistentExcessTest, ACapBelowEverythingAsksAllPersistentCharge) {
  const VmId a = AddVm("a", 100);
  const VmId b = AddVm("b", 200);
  Fill(a, store_->NewPool(a, nullptr, PoolKind::kPersistent).value(), 100, 1);
  Fill(b, store_->NewPool(b, nullptr, PoolKind::kPersistent).value(), 50,
       10000);
  ASSERT_TRUE(store_->SetMemoryCap(0).ok());
  EXPECT_EQ(Excess(a).host_cap_share, Excess(a).persistent_bytes);
  EXPECT_EQ(Excess(b).host_cap_share, Excess(b).persistent_bytes);
}

}  // namespace
}  // namespace tmem
