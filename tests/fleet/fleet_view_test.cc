// FleetView: the kept keys parsed once each, refusals of bytes that are not
// UTF-8 and of keys outside the layout (shown escaped), and resolution that
// matches ResolveFleetPolicy. Pure logic, no etcd.
#include "host-agent/fleet/fleet_view.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_format.h"
#include "host-agent/fleet/fleet_policy.h"

namespace tmem {
namespace {

const std::string kP = kFleetPolicyPrefix;

TEST(FleetViewTest, Utf8IsCheckedByteByByte) {
  EXPECT_FALSE(InvalidUtf8Offset("").has_value());
  EXPECT_FALSE(InvalidUtf8Offset("plain {\"a\": 1}").has_value());
  EXPECT_FALSE(InvalidUtf8Offset("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80")
                   .has_value());
  EXPECT_EQ(InvalidUtf8Offset("\xff"), 0u);
  EXPECT_EQ(InvalidUtf8Offset("ab\xc3"), 2u);            // cut short
  EXPECT_EQ(InvalidUtf8Offset("a\xc0\xaf"), 1u);         // overlong '/'
  EXPECT_EQ(InvalidUtf8Offset("\xed\xa0\x80"), 0u);      // surrogate
  EXPECT_EQ(InvalidUtf8Offset("\xf4\x90\x80\x80"), 0u);  // > U+10FFFF
  EXPECT_EQ(FleetKeyText(kP + "vms/a\xff"), "/tmemd/v1/policy/vms/a\\xff");
}

TEST(FleetViewTest, BadBytesAreRefusedWithTheirReasonEscaped) {
  FleetView v("h1", {"g1"});
  ASSERT_TRUE(v.Put(kP + "fleet", R"({"version":1,"host":{"mode":"off"}})"));
  ASSERT_TRUE(v.Resolve().ok());
  v.MarkApplied();
  ASSERT_TRUE(v.Put(kP + "fleet", "\xff"));
  absl::StatusOr<const PolicySet*> r = v.Resolve();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(
                "fleet: value: byte 0xff at offset 0 is not UTF-8"),
            std::string::npos)
      << r.status();
  ASSERT_TRUE(v.Put(kP + "vms/w\xfe", "\xfe"));
  r = v.Resolve();
  ASSERT_FALSE(r.ok());
  // Keys in order: the fleet key's reason first, the count of the rest.
  EXPECT_NE(r.status().message().find("(and 1 more refused keys)"),
            std::string::npos)
      << r.status();
  ASSERT_TRUE(v.Put(kP + "fleet", R"({"version":1,"host":{"mode":"off"}})"));
  r = v.Resolve();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("key '/tmemd/v1/policy/vms/w\\xfe'"),
            std::string::npos)
      << r.status();
  ASSERT_TRUE(v.Delete(kP + "vms/w\xfe"));
  r = v.Resolve();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->host.default_mode(), v1::MODE_OFF);
  // The raw bytes were kept as etcd holds them (the state file saves them).
  ASSERT_TRUE(v.Put(kP + "vms/w", "\x80"));
  EXPECT_EQ(v.keys().at(kP + "vms/w"), "\x80");
}

TEST(FleetViewTest, KeysOutsideTheLayoutAreKeptAndRefused) {
  FleetView v("h1", {"g1"});
  EXPECT_TRUE(v.Keeps(kP + "fleet"));
  EXPECT_TRUE(v.Keeps(kP + "groups/g1"));
  EXPECT_TRUE(v.Keeps(kP + "vms/anything"));
  EXPECT_FALSE(v.Keeps(kP + "groups/g2"));  // another group's: not ours
  EXPECT_FALSE(v.Keeps(kP + "hosts/h2"));
  EXPECT_FALSE(v.Keeps(kFleetAppliedKey));  // tmemctl's marker
  EXPECT_TRUE(v.Keeps(kP + "host/h1"));     // a typo: refused, not ignored
  EXPECT_TRUE(v.Keeps(kP + "hosts/"));
  ASSERT_TRUE(v.Put(kP + "host/h1", R"({"version":1})"));
  absl::StatusOr<const PolicySet*> r = v.Resolve();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("key '/tmemd/v1/policy/host/h1': want"),
            std::string::npos)
      << r.status();
  ASSERT_TRUE(v.Delete(kP + "host/h1"));
  EXPECT_TRUE(v.Resolve().ok());
}

TEST(FleetViewTest, ResolvesAsResolveFleetPolicyDoes) {
  std::map<std::string, std::string> keys = {
      {kP + "fleet", R"({"version":1,"host":{"cpu_budget_percent":40},
                         "vm":{"weight":100}})"},
      {kP + "groups/g1", R"({"version":1,"host":{"cpu_budget_percent":30}})"},
      {kP + "groups/g2", R"({"version":1,"host":{"mode":"off"}})"},
      {kP + "hosts/h1", R"({"version":1,"vm":{"weight":300}})"},
      {kP + "vms/a", R"({"version":1,"vm":{"quota_bytes":1048576}})"},
  };
  FleetView v("h1", {"g1", "g2"});
  for (const auto& [k, val] : keys) v.Put(k, val);
  absl::StatusOr<const PolicySet*> got = v.Resolve();
  absl::StatusOr<PolicySet> want = ResolveFleetPolicy(keys, "h1", {"g1", "g2"});
  ASSERT_TRUE(got.ok() && want.ok());
  EXPECT_TRUE(**got == *want);
  // One change at a time, same answer.
  keys[kP + "groups/g1"] = R"({"version":1,"host":{"cpu_budget_percent":35}})";
  v.Put(kP + "groups/g1", keys[kP + "groups/g1"]);
  keys.erase(kP + "vms/a");
  v.Delete(kP + "vms/a");
  got = v.Resolve();
  want = ResolveFleetPolicy(keys, "h1", {"g1", "g2"});
  ASSERT_TRUE(got.ok() && want.ok());
  EXPECT_TRUE(**got == *want);
}

// The work behind "in proportion to the change": one value parsed per
// changed key, none for a value put again unchanged, and changed() only
// when the resolved policy may differ.
TEST(FleetViewTest, OneChangeParsesOneValue) {
  FleetView v("h1", {});
  for (int i = 0; i < 1000; ++i) {
    v.Put(absl::StrFormat("%svms/vm%04d", kP, i),
          R"({"version":1,"vm":{"weight":100}})");
  }
  ASSERT_TRUE(v.Resolve().ok());
  v.MarkApplied();
  EXPECT_EQ(v.layers_parsed(), 1000u);
  v.Put(kP + "vms/vm0007", R"({"version":1,"vm":{"weight":200}})");
  EXPECT_EQ(v.layers_parsed(), 1001u);
  EXPECT_TRUE(v.changed());
  absl::StatusOr<const PolicySet*> r = v.Resolve();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->ForVm("vm0007").weight(), 200);
  v.MarkApplied();
  v.Put(kP + "vms/vm0007", R"({"version":1,"vm":{"weight":200}})");
  EXPECT_EQ(v.layers_parsed(), 1001u);  // same bytes: nothing to do
  v.Put(kP + "vms/vm0007", R"({"vm":{"weight":200},"version":1})");
  EXPECT_EQ(v.layers_parsed(), 1002u);  // new bytes, same meaning
  EXPECT_FALSE(v.changed());
}

}  // namespace
}  // namespace tmem
