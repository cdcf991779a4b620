// Tenant isolation in the store (architecture invariant 9): every operation a
// VM can trigger costs O(its own data). The work is counted by the store
// itself (HostStats::pool_scan_objects_visited), not timed, so the test means
// the same on a loaded machine and under sanitizers.
#include <cstdint>
#include <memory>
#include <string>

#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
// Issue 15 saw a 1.2M-object neighbour make each invalidate-pool cost 40-75
// ms. One million objects, one zero page each, is the attack's shape.
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

}  // namespace
}  // namespace tmem
