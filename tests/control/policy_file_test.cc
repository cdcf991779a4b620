// tmemctl's declarative policy files: TOML and JSON, and their errors.
#include "host-agent/tmemctl/policy_file.h"

#include <gtest/gtest.h>

namespace tmem {
namespace {

TEST(PolicyFileTest, TomlWithHostAndVms) {
  auto f = ParsePolicyFile(R"(
[host]
generation = 7
memory_cap = "2GiB"
cpu_budget_percent = 30
mode = "adaptive"

[[vm]]
name = "web1"
generation = 3
quota = "512MiB"
weight = 200
mode = "default"
enabled = true
frozen = false

[[vm]]
name = "db1"
quota = "unlimited"
)",
                           "p.toml");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(f->host.has_value());
  EXPECT_EQ(f->host->generation(), 7u);
  EXPECT_EQ(f->host->memory_cap_bytes(), uint64_t{2} << 30);
  EXPECT_DOUBLE_EQ(f->host->cpu_budget_percent(), 30);
  EXPECT_EQ(f->host->default_mode(), v1::MODE_ADAPTIVE);
  ASSERT_EQ(f->vms.size(), 2u);
  EXPECT_EQ(f->vms[0].vm(), "web1");
  EXPECT_EQ(f->vms[0].quota_bytes(), uint64_t{512} << 20);
  EXPECT_EQ(f->vms[0].weight(), 200);
  EXPECT_EQ(f->vms[0].mode(), v1::MODE_DEFAULT);
  EXPECT_TRUE(f->vms[0].has_enabled());
  EXPECT_FALSE(f->vms[0].frozen());
  EXPECT_EQ(f->vms[1].vm(), "db1");
  EXPECT_TRUE(f->vms[1].has_quota_bytes());
  EXPECT_EQ(f->vms[1].quota_bytes(), 0u);  // unlimited
  EXPECT_FALSE(f->vms[1].has_weight());
}

TEST(PolicyFileTest, JsonOfTheSameShape) {
  auto f = ParsePolicyFile(
      R"({"vm": [{"name": "web1", "quota": 1048576, "weight": 5,
                  "frozen": true}]})",
      "p.json");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(f->host.has_value());
  ASSERT_EQ(f->vms.size(), 1u);
  EXPECT_EQ(f->vms[0].quota_bytes(), 1048576u);
  EXPECT_TRUE(f->vms[0].frozen());
}

TEST(PolicyFileTest, SwapQuotaAndSwapMode) {
  auto f = ParsePolicyFile(R"(
[[vm]]
name = "web1"
swap_quota = "256MiB"
swap_mode = "off"

[[vm]]
name = "db1"
swap_quota = "unlimited"

[[vm]]
name = "idle"
weight = 3
)",
                           "p.toml");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->vms.size(), 3u);
  EXPECT_EQ(f->vms[0].swap_quota_bytes(), uint64_t{256} << 20);
  EXPECT_EQ(f->vms[0].swap_mode(), v1::MODE_OFF);
  EXPECT_FALSE(f->vms[0].has_quota_bytes());
  EXPECT_TRUE(f->vms[1].has_swap_quota_bytes());
  EXPECT_EQ(f->vms[1].swap_quota_bytes(), 0u);             // unlimited
  EXPECT_EQ(f->vms[1].swap_mode(), v1::MODE_UNSPECIFIED);  // unchanged
  EXPECT_FALSE(f->vms[2].has_swap_quota_bytes());
  EXPECT_EQ(f->vms[2].swap_mode(), v1::MODE_UNSPECIFIED);

  auto j = ParsePolicyFile(
      R"({"vm": [{"name": "web1", "swap_quota": 4096, "swap_mode": "default"}]})",
      "p.json");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->vms[0].swap_quota_bytes(), 4096u);
  EXPECT_EQ(j->vms[0].swap_mode(), v1::MODE_DEFAULT);
}

TEST(PolicyFileTest, MalformedFilesSayWhatIsWrong) {
  struct Case {
    const char* text;
    const char* expect;
  };
  for (const Case& c : {
           Case{"[host\nmode = 1", "p:"},
           Case{"{\"vm\": [", "not valid JSON"},
           Case{"[[vm]]\nquota = \"1MiB\"", "vm[0].name' is missing"},
           Case{"[[vm]]\nname = \"a\"\nweight = 0", "vm[0].weight"},
           Case{"[[vm]]\nname = \"a\"\nweight = -3", "1..1000000"},
           Case{"[[vm]]\nname = \"a\"\nquota = \"lots\"", "vm[0].quota"},
           Case{"[[vm]]\nname = \"a\"\nmode = \"fast\"", "vm[0].mode"},
           Case{"[[vm]]\nname = \"a\"\nswap_quota = \"lots\"",
                "vm[0].swap_quota"},
           Case{"[[vm]]\nname = \"a\"\nswap_quota = -1",
                "'vm[0].swap_quota' must not be negative"},
           Case{"[[vm]]\nname = \"a\"\nswap_mode = \"fast\"",
                "vm[0].swap_mode: 'fast' is not a mode"},
           Case{"[[vm]]\nname = \"a\"\nswap_mode = 1",
                "'vm[0].swap_mode' must be a string"},
           Case{"[[vm]]\nname = \"a\"\nqouta = 1", "unknown key 'vm[0].qouta'"},
           Case{"[host]\ncpu_budget_percent = 0", "host.cpu_budget_percent"},
           Case{"[host]\nmode = \"default\"", "host.mode"},
           Case{"[hosts]\nmode = \"off\"", "unknown section 'hosts'"},
           Case{"[[vm]]\nname = \"../etc\"", "vm[0].name"},
           Case{"", "nothing to apply"},
       }) {
    auto f = ParsePolicyFile(c.text, "p");
    ASSERT_FALSE(f.ok()) << c.text;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos)
        << c.text << "\n -> " << f.status().message();
  }
}

}  // namespace
}  // namespace tmem
