#include "host-agent/config.h"

#include <gtest/gtest.h>

namespace tmem {
namespace {

TEST(ParseSizeTest, AcceptsBytesAndBinaryUnits) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("4KiB"), 4096u);
  EXPECT_EQ(*ParseSize("4 MiB"), uint64_t{4} << 20);
  EXPECT_EQ(*ParseSize("2GiB"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseSize("1g"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseSize(" 7 "), 7u);
}

TEST(ParseSizeTest, RejectsGarbageWithTheOffendingText) {
  for (const char* bad :
       {"", "MiB", "-4", "12XB", "4.5GiB", "99999999999999TiB"}) {
    absl::StatusOr<uint64_t> v = ParseSize(bad);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ParseSize("12XB").status().message().find("12XB"),
            absl::string_view::npos);
}

TEST(ParseConfigTest, ReadsEverySection) {
  const char* toml = R"(
[store]
memory_cap = "2GiB"
shards = 16
poor_compression_threshold = 3000
poor_compression_action = "refuse"
max_evictions_per_put = 64

[channels]
socket_dir = "/run/x"
region_size = "8MiB"
ring_entries = 512
vectors = 2
socket_mode = "0600"
socket_group = "kvm"

[worker]
poll_us = 20
batch = 32
idle_check_ms = 5

[log]
level = "debug"
format = "json"
stats_interval_seconds = 10

[[vm]]
name = "web1"
quota = "512MiB"
weight = 200

[[vm]]
name = "db1"
enabled = false
)";
  absl::StatusOr<TmemdConfig> c = ParseConfig(toml, "test.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->store.memory_cap_bytes, uint64_t{2} << 30);
  EXPECT_EQ(c->store.num_shards, 16);
  EXPECT_EQ(c->store.poor_compression_threshold_bytes, 3000u);
  EXPECT_EQ(c->store.poor_compression_action, PoorCompressionAction::kRefuse);
  EXPECT_EQ(c->store.max_evictions_per_put, 64);
  EXPECT_EQ(c->socket_dir, "/run/x");
  EXPECT_EQ(c->region_bytes, uint64_t{8} << 20);
  EXPECT_EQ(c->ring_entries, 512u);
  EXPECT_EQ(c->vectors, 2);
  EXPECT_EQ(c->socket_mode, 0600u);
  EXPECT_EQ(c->socket_group, "kvm");
  EXPECT_EQ(c->worker.poll_us, 20);
  EXPECT_EQ(c->worker.batch, 32u);
  EXPECT_EQ(c->worker.idle_check_ms, 5);
  EXPECT_EQ(c->log_level, LogLevel::kDebug);
  EXPECT_EQ(c->log_format, LogFormat::kJson);
  EXPECT_EQ(c->stats_interval_seconds, 10);
  ASSERT_EQ(c->vms.size(), 2u);
  EXPECT_EQ(c->vms[0].name, "web1");
  EXPECT_EQ(c->vms[0].policy.quota_bytes, uint64_t{512} << 20);
  EXPECT_EQ(c->vms[0].policy.weight, 200u);
  EXPECT_TRUE(c->vms[0].policy.enabled);
  EXPECT_EQ(c->vms[1].name, "db1");
  EXPECT_FALSE(c->vms[1].policy.enabled);
  EXPECT_TRUE(ValidateConfig(*c).ok());
}

TEST(ParseConfigTest, EmptyFileKeepsDefaults) {
  TmemdConfig defaults;
  absl::StatusOr<TmemdConfig> c = ParseConfig("", "empty.toml", defaults);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->store.memory_cap_bytes, defaults.store.memory_cap_bytes);
  EXPECT_EQ(c->socket_dir, defaults.socket_dir);
  EXPECT_TRUE(c->vms.empty());
}

// A typo must fail loudly, naming the key and the line.
TEST(ParseConfigTest, RejectsUnknownKeysSectionsAndBadValues) {
  struct Case {
    const char* toml;
    const char* expect_in_message;
  };
  const Case cases[] = {
      {"[store]\nmemory_capp = 1\n", "store.memory_capp"},
      {"[stor]\n", "[stor]"},
      {"[store]\nmemory_cap = \"lots\"\n", "store.memory_cap"},
      {"[store]\nshards = 0\n", "store.shards"},
      {"[store]\npoor_compression_action = \"maybe\"\n", "raw"},
      {"[channels]\nsocket_mode = \"999\"\n", "socket_mode"},
      {"[channels]\nvectors = 100\n", "channels.vectors"},
      {"[log]\nlevel = \"loud\"\n", "log.level"},
      {"[[vm]]\nquota = 5\n", "no name"},
      {"[[vm]]\nname = \"a\"\nweight = \"heavy\"\n", "vm[0].weight"},
      {"vm = 3\n", "[[vm]]"},
      {"[store\n", "test.toml:1"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(c.toml, "test.toml", TmemdConfig{});
    ASSERT_FALSE(r.ok()) << c.toml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.toml;
    EXPECT_NE(r.status().message().find(c.expect_in_message),
              absl::string_view::npos)
        << c.toml << " -> " << r.status();
  }
}

TEST(ValidateConfigTest, ChecksCrossFieldRules) {
  TmemdConfig c;
  c.vms = {{"a", {}}, {"a", {}}};
  EXPECT_NE(ValidateConfig(c).message().find("twice"), absl::string_view::npos);
  c.vms = {{"../etc/passwd", {}}};
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.vms = {{".hidden", {}}};
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.vms = {{"ok-name_1.2", {}}};
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.region_bytes = 3 << 20;
  EXPECT_NE(ValidateConfig(c).message().find("power of two"),
            absl::string_view::npos);
}

}  // namespace
}  // namespace tmem

namespace tmem {
namespace {

// The shipped example must stay a valid config.
TEST(ParseConfigTest, ExampleFileParses) {
  absl::StatusOr<TmemdConfig> c = LoadConfigFile(
      std::string(TMEM_SOURCE_DIR) + "/host-agent/tmemd.example.toml",
      TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(ValidateConfig(*c).ok());
  EXPECT_EQ(c->store.memory_cap_bytes, uint64_t{1} << 30);
}

}  // namespace
}  // namespace tmem

namespace tmem {
namespace {

TEST(ParseConfigTest, LibvirtIsOffUnlessAskedAndAUriAsks) {
  absl::StatusOr<TmemdConfig> c = ParseConfig("", "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->libvirt.enabled);
  EXPECT_EQ(c->libvirt.uri, "qemu:///system");
  c = ParseConfig(
      "[libvirt]\nuri = \"test:///default\"\n"
      "detach_timeout_seconds = 5\n",
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->libvirt.enabled);
  EXPECT_EQ(c->libvirt.uri, "test:///default");
  EXPECT_EQ(c->libvirt.detach_timeout_seconds, 5);
  c = ParseConfig("[libvirt]\nenabled = true\n", "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->libvirt.enabled);
  EXPECT_EQ(c->libvirt.uri, "qemu:///system");
  c = ParseConfig("[libvirt]\nuri = \"qemu:///system\"\nenabled = false\n",
                  "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->libvirt.enabled);
  c = ParseConfig("[libvirt]\nurl = \"qemu:///system\"\n", "t.toml",
                  TmemdConfig{});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("libvirt.url"), absl::string_view::npos)
      << c.status();
}

}  // namespace
}  // namespace tmem
