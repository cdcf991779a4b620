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

TEST(FleetPolicyTest, FormatRoundTrips) {
  const std::string k = kP + "hosts/h1";
  absl::StatusOr<FleetLayer> a = ParseFleetLayer(
      k, R"({"version":1,"host":{"memory_cap_bytes":2147483648,"mode":
      "always"},"vm":{"quota_bytes":1048576,"enabled":false}})");
  ASSERT_TRUE(a.ok());
  absl::StatusOr<FleetLayer> b = ParseFleetLayer(k, FormatFleetLayer(*a));
  ASSERT_TRUE(b.ok()) << FormatFleetLayer(*a);
  EXPECT_TRUE(*a == *b);
}

}  // namespace
}  // namespace tmem
