// FleetPolicy: key layout, value validation (tmemd's ranges and modes) and
// most-specific-wins resolution. Pure logic, no etcd.
#include "host-agent/fleet/fleet_policy.h"

#include <gtest/gtest.h>

namespace tmem {
namespace {

const std::string kP = kFleetPolicyPrefix;

TEST(FleetPolicyTest, KeysFollowTheLayout) {
  EXPECT_TRUE(CheckFleetKey(kP + "fleet").ok());
  EXPECT_TRUE(CheckFleetKey(kP + "groups/rack1").ok());
  EXPECT_TRUE(CheckFleetKey(kP + "hosts/h-01").ok());
  EXPECT_TRUE(CheckFleetKey(kP + "vms/web1").ok());
  EXPECT_FALSE(CheckFleetKey(kP + "fleets").ok());
  EXPECT_FALSE(CheckFleetKey(kP + "hosts/").ok());
  EXPECT_FALSE(CheckFleetKey(kP + "hosts/a/b").ok());
  EXPECT_FALSE(CheckFleetKey("/other/fleet").ok());
}

TEST(FleetPolicyTest, ValuesAreCheckedWithTmemdsRanges) {
  const std::string k = kP + "fleet";
  EXPECT_TRUE(ParseFleetLayer(k, R"({"version":1,"host":{"memory_cap_bytes":
      1073741824,"cpu_budget_percent":30,"mode":"adaptive"},"vm":{"weight":
      200,"quota_bytes":0,"mode":"default","enabled":true,"frozen":false}})")
                  .ok());
  struct Bad {
    const char* value;
    const char* reason;
  } bad[] = {
      {R"({"host":{}})", "version: missing"},
      {R"({"version":2})", "unsupported 2"},
      {R"({"version":1,"vm":{"weight":0}})", "weight must be in"},
      {R"({"version":1,"vm":{"weight":2000000}})", "weight must be in"},
      {R"({"version":1,"vm":{"weight":"200"}})", "must be an integer"},
      {R"({"version":1,"vm":{"weight":2.5}})", "must be an integer"},
      {R"({"version":1,"vm":{"quota_bytes":-1}})", "must not be negative"},
      {R"({"version":1,"host":{"memory_cap_bytes":4096}})",
       "memory_cap (bytes) must be in"},
      {R"({"version":1,"host":{"cpu_budget_percent":101}})",
       "cpu_budget_percent must be in"},
      {R"({"version":1,"host":{"mode":"default"}})", "is not a mode"},
      {R"({"version":1,"vm":{"mode":"fast"}})", "is not a mode"},
      {R"({"version":1,"vm":{"enabled":1}})", "must be true or false"},
      {R"({"version":1,"vm":{"wieght":1}})", "unknown field"},
      {R"({"version":1,"vm":{"swap_quota_bytes":-1}})",
       "vm.swap_quota_bytes: must not be negative"},
      {R"({"version":1,"vm":{"swap_quota_bytes":"1GiB"}})",
       "vm.swap_quota_bytes: must be an integer"},
      {R"({"version":1,"vm":{"swap_quota_bytes":2251799813685248}})",
       "vm.swap_quota_bytes: swap quota (bytes; 0: unlimited) must be in"},
      {R"({"version":1,"vm":{"swap_mode":"fast"}})",
       "vm.swap_mode: 'fast' is not a mode"},
      {R"({"version":1,"vm":{"swap_mode":2}})",
       "vm.swap_mode: must be a string"},
      {R"({"version":1,"extra":{}})", "unknown field"},
      {R"({"version":1,)", "not valid JSON"},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<FleetLayer> l = ParseFleetLayer(k, b.value);
    ASSERT_FALSE(l.ok()) << b.value;
    EXPECT_NE(l.status().message().find(b.reason), std::string::npos)
        << b.value << " -> " << l.status().message();
    EXPECT_NE(l.status().message().find(k), std::string::npos);
  }
  // A VM key carries no host section.
  EXPECT_FALSE(
      ParseFleetLayer(kP + "vms/a", R"({"version":1,"host":{"mode":"off"}})")
          .ok());
}

TEST(FleetPolicyTest, MostSpecificWinsFieldByField) {
  const std::map<std::string, std::string> keys = {
      {kP + "fleet",
       R"({"version":1,"host":{"cpu_budget_percent":10,"mode":"off"},
           "vm":{"weight":100,"frozen":true}})"},
      {kP + "groups/g1", R"({"version":1,"host":{"cpu_budget_percent":20}})"},
      {kP + "groups/g2",
       R"({"version":1,"host":{"cpu_budget_percent":25},"vm":{"weight":300}})"},
      {kP + "groups/other", R"({"version":1,"host":{"mode":"always"}})"},
      {kP + "hosts/h1", R"({"version":1,"vm":{"weight":400}})"},
      {kP + "hosts/h2", "not even json"},  // another host's problem
      {kP + "vms/web1", R"({"version":1,"vm":{"weight":7}})"},
  };
  absl::StatusOr<PolicySet> r = ResolveFleetPolicy(keys, "h1", {"g1", "g2"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->host.cpu_budget_percent(), 25);  // g2 after g1
  EXPECT_EQ(r->host.default_mode(), v1::MODE_OFF);     // not group other
  EXPECT_FALSE(r->host.has_memory_cap_bytes());        // nobody said
  EXPECT_EQ(r->ForVm("db").weight(), 400);             // host over groups
  EXPECT_TRUE(r->ForVm("db").frozen());                // from fleet
  EXPECT_EQ(r->ForVm("web1").weight(), 7);             // VM key wins
  EXPECT_EQ(r->ForVm("web1").vm(), "web1");
  // The broken key concerns h2 only.
  absl::StatusOr<PolicySet> h2 = ResolveFleetPolicy(keys, "h2", {});
  ASSERT_FALSE(h2.ok());
  EXPECT_NE(h2.status().message().find("hosts/h2"), std::string::npos);
  EXPECT_TRUE(FleetKeyConcernsHost(kP + "vms/x", "h1", {}));
  EXPECT_FALSE(FleetKeyConcernsHost(kP + "hosts/h2", "h1", {"g1"}));
  EXPECT_TRUE(FleetKeyConcernsHost(kP + "groups/g1", "h1", {"g1"}));
}

TEST(FleetPolicyTest, SwapFieldsParseAndMergeFieldByField) {
  absl::StatusOr<FleetLayer> l = ParseFleetLayer(
      kP + "fleet",
      R"({"version":1,"vm":{"swap_quota_bytes":0,"swap_mode":"default"}})");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->vm.has_swap_quota_bytes());  // 0 is said: unlimited
  EXPECT_EQ(l->vm.swap_quota_bytes(), 0u);
  EXPECT_EQ(l->vm.swap_mode(), v1::MODE_DEFAULT);

  const std::map<std::string, std::string> keys = {
      {kP + "fleet",
       R"({"version":1,"vm":{"swap_quota_bytes":1073741824,"swap_mode":"off",
           "weight":100}})"},
      {kP + "groups/g1",
       R"({"version":1,"vm":{"swap_quota_bytes":536870912}})"},
      {kP + "hosts/h1", R"({"version":1,"vm":{"swap_mode":"adaptive"}})"},
      {kP + "vms/web1", R"({"version":1,"vm":{"swap_mode":"always"}})"},
      {kP + "vms/db", R"({"version":1,"vm":{"swap_quota_bytes":0}})"},
  };
  absl::StatusOr<PolicySet> r = ResolveFleetPolicy(keys, "h1", {"g1"});
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::SetVmPolicyRequest other = r->ForVm("other");
  EXPECT_EQ(other.swap_quota_bytes(), uint64_t{512} << 20);  // group
  EXPECT_EQ(other.swap_mode(), v1::MODE_ADAPTIVE);           // host
  EXPECT_EQ(other.weight(), 100);                            // fleet
  const v1::SetVmPolicyRequest web1 = r->ForVm("web1");
  EXPECT_EQ(web1.swap_mode(), v1::MODE_ALWAYS);             // its key
  EXPECT_EQ(web1.swap_quota_bytes(), uint64_t{512} << 20);  // not said
  const v1::SetVmPolicyRequest db = r->ForVm("db");
  ASSERT_TRUE(db.has_swap_quota_bytes());
  EXPECT_EQ(db.swap_quota_bytes(), 0u);  // 0 overrides: unlimited
  EXPECT_EQ(db.swap_mode(), v1::MODE_ADAPTIVE);
  // No layer says a swap field: not set, the host keeps its own.
  absl::StatusOr<PolicySet> bare = ResolveFleetPolicy(
      {{kP + "fleet", R"({"version":1,"vm":{"weight":5}})"}}, "h1", {});
  ASSERT_TRUE(bare.ok());
  EXPECT_FALSE(bare->ForVm("x").has_swap_quota_bytes());
  EXPECT_EQ(bare->ForVm("x").swap_mode(), v1::MODE_UNSPECIFIED);
}

TEST(FleetPolicyTest, FormatRoundTrips) {
  const std::string k = kP + "hosts/h1";
  absl::StatusOr<FleetLayer> a = ParseFleetLayer(
      k, R"({"version":1,"host":{"memory_cap_bytes":2147483648,"mode":
      "always"},"vm":{"quota_bytes":1048576,"enabled":false,
      "swap_quota_bytes":0,"swap_mode":"off"}})");
  ASSERT_TRUE(a.ok());
  absl::StatusOr<FleetLayer> b = ParseFleetLayer(k, FormatFleetLayer(*a));
  ASSERT_TRUE(b.ok()) << FormatFleetLayer(*a);
  EXPECT_TRUE(*a == *b);
  EXPECT_TRUE(b->vm.has_swap_quota_bytes());
  EXPECT_EQ(b->vm.swap_mode(), v1::MODE_OFF);
}

}  // namespace
}  // namespace tmem
