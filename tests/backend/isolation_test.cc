// Tenant isolation in the store (architecture invariant 9): every operation a
// VM can trigger costs O(its own data). The work is counted by the store
// itself (HostStats::pool_scan_objects_visited), not timed, so the test means
// the same on a loaded machine and under sanitizers.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
// A neighbour with a million objects must not make another VM's
// invalidate-pool cost more: a scan of every object would take tens of ms.
// One million objects, one zero page each, is the attack's shape.
constexpr uint64_t kNeighbourObjects = 1'000'000;

uint64_t Held(const TmemStore& store, VmId vm) {
  return store.GetVmStats(vm)->counters[static_cast<int>(Counter::kPagesHeld)];
}

// One neighbour for the whole suite: filling it is most of the run time.
class IsolationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    StoreOptions options;
    options.memory_cap_bytes = 1024 * kMiB;
    options.address_space_bytes = 1024 * kMiB;
    store_ = TmemStore::Create(options).value();
    neighbour_ = store_->AddVm("neighbour", VmPolicy{}).value();
    neighbour_pool_ = store_->NewPool(neighbour_, nullptr).value();
    const test::Page zero = test::FilledWith(0);
    for (uint64_t ino = 0; ino < kNeighbourObjects; ++ino) {
      const PutResult r = store_
                              ->Put(neighbour_, neighbour_pool_,
                                    ObjectId::FromInode(ino), 0, zero)
                              .value();
      ASSERT_TRUE(r.stored) << ino;
    }
    ASSERT_EQ(Held(*store_, neighbour_), kNeighbourObjects);
  }
  static void TearDownTestSuite() { store_.reset(); }

  void SetUp() override {
    ASSERT_NE(store_, nullptr);
    flooder_ =
        store_
            ->AddVm(
                ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                VmPolicy{})
            .value();
  }
  void TearDown() override {
    store_->ForgetVm(flooder_).IgnoreError();  // already gone in one test
    EXPECT_EQ(Held(*store_, neighbour_), kNeighbourObjects);
  }

  static uint64_t Visited() {
    return store_->GetHostStats().pool_scan_objects_visited;
  }

  static std::unique_ptr<TmemStore> store_;
  static VmId neighbour_;
  static PoolId neighbour_pool_;
  VmId flooder_ = 0;
};

std::unique_ptr<TmemStore> IsolationTest::store_;
VmId IsolationTest::neighbour_ = 0;
PoolId IsolationTest::neighbour_pool_ = -1;

TEST_F(IsolationTest, InvalidatePoolStormOnAnEmptyPoolVisitsNothing) {
  const PoolId pool = store_->NewPool(flooder_, nullptr).value();
  const uint64_t before = Visited();
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(store_->InvalidatePool(flooder_, pool).ok());
  }
  EXPECT_EQ(Visited() - before, 0u)
      << "an empty pool's invalidate looked at other VMs' objects";
  EXPECT_EQ(Held(*store_, neighbour_), kNeighbourObjects);
}

TEST_F(IsolationTest, PoolOpsCostOnlyTheirOwnObjects) {
  const test::Page zero = test::FilledWith(0);
  constexpr uint64_t kOwnObjects = 10;
  const uint64_t before = Visited();
  for (int round = 0; round < 100; ++round) {
    const PoolId pool = store_->NewPool(flooder_, nullptr).value();
    for (uint64_t ino = 0; ino < kOwnObjects; ++ino) {
      // Two pages per object: objects, not pages, are what a scan visits.
      for (PageIndex index = 0; index < 2; ++index) {
        ASSERT_TRUE(
            store_->Put(flooder_, pool, ObjectId::FromInode(ino), index, zero)
                .value()
                .stored);
      }
    }
    ASSERT_TRUE(store_->InvalidatePool(flooder_, pool).ok());
    ASSERT_EQ(Held(*store_, flooder_), 0u);
    ASSERT_TRUE(store_->DestroyPool(flooder_, pool).ok());
  }
  // Each round: the invalidate visits the pool's 10 objects, the destroy
  // (of a now empty pool) none.
  EXPECT_LE(Visited() - before, 100 * kOwnObjects);
  EXPECT_EQ(Held(*store_, neighbour_), kNeighbourObjects);
}

TEST_F(IsolationTest, ForgettingASmallVmCostsOnlyItsOwnObjects) {
  const PoolId pool = store_->NewPool(flooder_, nullptr).value();
  const test::Page zero = test::FilledWith(0);
  for (uint64_t ino = 0; ino < 5; ++ino) {
    ASSERT_TRUE(
        store_->Put(flooder_, pool, ObjectId::FromInode(ino), 0, zero).ok());
  }
  const uint64_t before = Visited();
  ASSERT_TRUE(store_->ForgetVm(flooder_).ok());
  EXPECT_LE(Visited() - before, 5u);
  EXPECT_EQ(Held(*store_, neighbour_), kNeighbourObjects);
}

// ---------------------------------------------------------------------------
// A VM's quota bounds what its pages really cost (architecture invariant 4),
// whatever shapes it picks. "Real" is the store's own measure of the bytes it
// took from the OS (HostStats::memory_used_bytes, every container charged
// before it grows); with one VM in the store, all of it is that VM's doing.

struct FloodShape {
  const char* name;
  uint64_t quota_bytes;
  uint64_t puts;
  uint64_t pages_per_object;
  int pools;     // objects are spread round robin over this many pools
  char content;  // 'z' zero, 's' same-filled (distinct words), 't' text,
                 // 'r' random
};

class MetadataFloodQuotaTest : public ::testing::TestWithParam<FloodShape> {};

TEST_P(MetadataFloodQuotaTest, RealMemoryStaysWithinQuotaAtEveryStep) {
  const FloodShape& shape = GetParam();
  constexpr int kShards = 4;
  StoreOptions options;
  options.memory_cap_bytes = 1024 * kMiB;
  options.address_space_bytes = 1024 * kMiB;
  options.num_shards = kShards;
  std::unique_ptr<TmemStore> store = TmemStore::Create(options).value();
  const uint64_t baseline = store->GetHostStats().memory_used_bytes;
  VmPolicy policy;
  policy.quota_bytes = shape.quota_bytes;
  const VmId vm = store->AddVm("flooder", policy).value();
  std::vector<PoolId> pools;
  for (int i = 0; i < shape.pools; ++i) {
    pools.push_back(store->NewPool(vm, nullptr).value());
  }
  // Not per page: per shard, one entry chunk, one object chunk and small
  // tables kept while empty (256 x 48 B each, tables under 8 KiB); per blob
  // size class, one partly filled 64 KiB slab; 8 cached empty slabs.
  const uint64_t fixed_slack = kShards * (256 * 48 * 2 + 8 * 1024) +
                               (shape.content == 't' ? 64 : 1) * 65536 +
                               8 * 65536;
  const uint64_t bound =
      shape.quota_bytes + shape.quota_bytes / 20 + fixed_slack;
  uint64_t peak_used = 0, peak_charged = 0, stored = 0;
  for (uint64_t i = 0; i < shape.puts; ++i) {
    const uint64_t object = i / shape.pages_per_object;
    test::Page page;
    switch (shape.content) {
      case 'z':
        page = test::FilledWith(0);
        break;
      case 's':
        page = test::FilledWith(i + 1);
        break;
      case 't':
        page = test::TextPage(i);
        break;
      default:
        page = test::RandomPage(i);
        break;
    }
    const PutResult r =
        store
            ->Put(vm, pools[object % pools.size()], ObjectId::FromInode(object),
                  i % shape.pages_per_object, page)
            .value();
    stored += r.stored;
    const HostStats host = store->GetHostStats();
    const uint64_t used = host.memory_used_bytes - baseline;
    const uint64_t charged =
        store->GetVmStats(vm)
            ->counters[static_cast<int>(Counter::kChargedBytes)];
    peak_used = std::max(peak_used, used);
    peak_charged = std::max(peak_charged, charged);
    ASSERT_LE(charged, shape.quota_bytes) << "after put " << i;
    ASSERT_LE(used, bound) << "after put " << i << ": real " << used
                           << " B, charged " << charged << " B, quota "
                           << shape.quota_bytes << " B";
  }
  // The flood went well past the quota: the bound was tested at its edge.
  EXPECT_GT(store->GetVmStats(vm)
                ->counters[static_cast<int>(Counter::kEvictionsQuota)],
            0u);
  EXPECT_GT(stored, shape.puts / 2) << "puts are stored, not refused";
  // And the charge is what the pages cost, not a multiple of it: at the
  // peak, real memory is at least 85% of what the VM was charged.
  EXPECT_GE(peak_used, peak_charged / 100 * 85);
  std::printf(
      "[ shape %s ] peak real %llu B, peak charged %llu B, quota %llu B"
      " (real/quota %.3f)\n",
      shape.name, static_cast<unsigned long long>(peak_used),
      static_cast<unsigned long long>(peak_charged),
      static_cast<unsigned long long>(shape.quota_bytes),
      static_cast<double>(peak_used) / static_cast<double>(shape.quota_bytes));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MetadataFloodQuotaTest,
    ::testing::Values(
        // 8 MiB quota, a zero page per object: charged its metadata too.
        FloodShape{"ZeroPagePerObject", 8 * kMiB, 200'000, 1, 1, 'z'},
        FloodShape{"SameFilledPerObject", 8 * kMiB, 200'000, 1, 1, 's'},
        FloodShape{"ZeroPagesManyPerObject", 8 * kMiB, 400'000, 64, 1, 'z'},
        FloodShape{"ObjectPerPoolSpread", 8 * kMiB, 200'000, 1, 1024, 'z'},
        FloodShape{"TextPagePerObject", 32 * kMiB, 40'000, 1, 1, 't'},
        FloodShape{"RandomPagePerObject", 32 * kMiB, 20'000, 1, 1, 'r'}),
    [](const ::testing::TestParamInfo<FloodShape>& info) {
      return std::string(info.param.name);
    });

}  // namespace
}  // namespace tmem
