// PlanDescriptorBudget: the formula in descriptor_budget.h, and the order in
// which caps give way when the limit cannot hold them.
#include "host-agent/control/descriptor_budget.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

namespace tmem {
namespace {

DescriptorBudgetInput Input(int64_t limit) {
  DescriptorBudgetInput in;
  in.limit = limit;
  in.reserved_vm_channels = 64;
  in.vectors = 1;
  in.metrics_clients = 17;
  in.admin = 64;
  in.readonly = 8;
  in.tcp = 32;
  return in;
}

TEST(DescriptorBudgetTest, DefaultsFitTheUsualSoftLimit) {
  absl::StatusOr<DescriptorBudget> b = PlanDescriptorBudget(Input(1024));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->guest_reserve, 64 * 5);
  EXPECT_EQ(b->control_descriptors, 1024 - 128 - 320 - 17);
  EXPECT_FALSE(b->lowered);
  EXPECT_EQ(b->admin, 64);
  EXPECT_EQ(b->readonly, 8);
  EXPECT_EQ(b->tcp, 32);
}

TEST(DescriptorBudgetTest, ReadOnlyGivesWayFirstThenTcpThenAdmin) {
  // 128 + 320 + 17 = 465 fixed; 2 x 104 = 208 wanted.
  DescriptorBudgetInput in = Input(465 + 2 * 100);
  absl::StatusOr<DescriptorBudget> b = PlanDescriptorBudget(in);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->lowered);
  EXPECT_EQ(b->readonly, 4);
  EXPECT_EQ(b->tcp, 32);
  EXPECT_EQ(b->admin, 64);

  b = PlanDescriptorBudget(Input(465 + 2 * 70));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->readonly, 1);
  EXPECT_EQ(b->tcp, 5);
  EXPECT_EQ(b->admin, 64);

  b = PlanDescriptorBudget(Input(465 + 2 * 10));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->readonly, 1);
  EXPECT_EQ(b->tcp, 1);
  EXPECT_EQ(b->admin, 8);
  // Whatever is lowered, the caps fit the control share.
  EXPECT_LE(2 * (b->admin + b->readonly + b->tcp), b->control_descriptors);
}

TEST(DescriptorBudgetTest, ListenersThatAreOffCostNothing) {
  DescriptorBudgetInput in = Input(465 + 2 * 64);
  in.readonly = 0;
  in.tcp = 0;
  absl::StatusOr<DescriptorBudget> b = PlanDescriptorBudget(in);
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->lowered);
  EXPECT_EQ(b->admin, 64);
  EXPECT_EQ(b->readonly, 0);
  EXPECT_EQ(b->tcp, 0);
}

TEST(DescriptorBudgetTest, ALimitBelowTheReservationIsAnErrorNamingIt) {
  absl::StatusOr<DescriptorBudget> b = PlanDescriptorBudget(Input(400));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("RLIMIT_NOFILE 400"),
            std::string_view::npos);
  EXPECT_NE(b.status().message().find("reserved_vm_channels"),
            std::string_view::npos);
}

TEST(DescriptorBudgetTest, RaiseLiftsTheSoftLimitToTheHardOne) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max < 64) GTEST_SKIP() << "hard limit too low to lower";
  rlimit low = saved;
  low.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  absl::StatusOr<DescriptorLimit> l = RaiseDescriptorLimit();
  rlimit now{};
  getrlimit(RLIMIT_NOFILE, &now);
  setrlimit(RLIMIT_NOFILE, &saved);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->raised || saved.rlim_max == 64);
  EXPECT_EQ(now.rlim_cur, saved.rlim_max);
  EXPECT_EQ(l->soft, l->hard);
}

}  // namespace
}  // namespace tmem
