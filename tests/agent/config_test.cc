#include "host-agent/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "host-agent/common/setting_ranges.h"

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
  c.vms = {{"a", {}, {}}, {"a", {}, {}}};
  EXPECT_NE(ValidateConfig(c).message().find("twice"), absl::string_view::npos);
  c.vms = {{"../etc/passwd", {}, {}}};
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.vms = {{".hidden", {}, {}}};
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.vms = {{"ok-name_1.2", {}, {}}};
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

namespace tmem {
namespace {

// A value of the wrong type is an error naming the key and FILE:LINE, never
// converted: toml++ would turn `memory_cap = true` into a 1-byte cap and
// `ring_entries = 8.0` into 8.
TEST(ParseConfigTest, WrongTypesAreErrorsWithFileAndLine) {
  struct Case {
    const char* toml;
    const char* key;
    const char* type;
  };
  const Case cases[] = {
      {"[store]\n\nmemory_cap = true\n", "store.memory_cap", "a boolean"},
      {"[store]\nmemory_cap = 1.5e9\n", "store.memory_cap", "a float"},
      {"[channels]\nring_entries = 8.0\n", "channels.ring_entries", "a float"},
      {"[channels]\nvectors = \"2\"\n", "channels.vectors", "a string"},
      {"[[vm]]\nname = \"a\"\nquota = false\n", "vm[0].quota", "a boolean"},
      {"[[vm]]\nname = \"a\"\nweight = 2.0\n", "vm[0].weight", "a float"},
      {"[[vm]]\nname = \"a\"\nenabled = 1\n", "vm[0].enabled", "an integer"},
      {"[valve]\ncpu_budget_percent = true\n", "valve.cpu_budget_percent",
       "a boolean"},
      {"[worker]\nworkers = 2.0\n", "worker.workers", "a float"},
      {"[log]\nlevel = 3\n", "log.level", "an integer"},
      {"[channels]\nsocket_dir = 7\n", "channels.socket_dir", "an integer"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(c.toml, "t.toml", TmemdConfig{});
    ASSERT_FALSE(r.ok()) << c.toml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(c.key), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.type), std::string::npos) << msg;
    EXPECT_NE(msg.find("t.toml:"), std::string::npos) << msg;
  }
  absl::StatusOr<TmemdConfig> r =
      ParseConfig("[store]\n\nmemory_cap = true\n", "t.toml", TmemdConfig{});
  EXPECT_NE(r.status().message().find("t.toml:3"), absl::string_view::npos)
      << r.status();
  // An integer is still a number for a float setting.
  r = ParseConfig("[valve]\ncpu_budget_percent = 30\n", "t.toml",
                  TmemdConfig{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->valve.cpu_budget_percent, 30.0);
}

TEST(ParseConfigTest, RangesComeFromTheOneTableAndNameTheSource) {
  struct Case {
    const char* toml;
    const char* expect;
  };
  const Case cases[] = {
      {"[worker]\nworkers = 100000\n", "worker.workers"},
      {"[log]\nstats_interval_seconds = -7\n", "log.stats_interval_seconds"},
      {"[store]\nmemory_cap = 1\n", "store.memory_cap"},
      {"[[vm]]\nname = \"a\"\nweight = 5000000000\n", "vm[0].weight"},
      {"[[vm]]\nname = \"a\"\nquota = \"2048TiB\"\n", "vm[0].quota"},
      {"[valve]\ncpu_budget_percent = nan\n", "valve.cpu_budget_percent"},
      {"[valve]\ncpu_budget_percent = inf\n", "valve.cpu_budget_percent"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(c.toml, "t.toml", TmemdConfig{});
    ASSERT_FALSE(r.ok()) << c.toml;
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find("must be in ["), std::string::npos) << msg;
  }
}

// `quota = 0` means unlimited everywhere (setting_ranges.h): the store
// must not refuse every put while tmemctl shows "unlimited".
TEST(ParseConfigTest, QuotaZeroMeansUnlimited) {
  absl::StatusOr<TmemdConfig> r = ParseConfig(
      "[[vm]]\nname = \"a\"\nquota = 0\n[[vm]]\nname = \"b\"\nquota = "
      "\"64MiB\"\n",
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->vms[0].policy.quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(r->vms[1].policy.quota_bytes, uint64_t{64} << 20);
  EXPECT_EQ(QuotaFromSetting(0), kUnlimitedQuota);
}

TEST(ValidateVmNameTest, NamesThatReadAsFlagsOrHiddenFilesAreRefused) {
  for (const char* bad : {"--", "-x", "--help", ".a", "", "a/b", "a b"}) {
    EXPECT_EQ(ValidateVmName(bad).code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  for (const char* good : {"a", "web-1", "9.x_y"}) {
    EXPECT_TRUE(ValidateVmName(good).ok()) << good;
  }
}

TEST(LoadConfigFileTest, ADirectoryIsNotAConfigFile) {
  absl::StatusOr<TmemdConfig> r = LoadConfigFile("/tmp", TmemdConfig{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not a regular file"),
            absl::string_view::npos)
      << r.status();
}

TEST(CheckRangeTest, RefusesNanInfinityAndWrapAround) {
  EXPECT_FALSE(CheckRange(ranges::kCpuBudgetPercent, std::nan(""), "x").ok());
  EXPECT_FALSE(CheckRange(ranges::kCpuBudgetPercent, HUGE_VAL, "x").ok());
  EXPECT_TRUE(CheckRange(ranges::kCpuBudgetPercent, 25.0, "x").ok());
  EXPECT_FALSE(CheckRange(ranges::kWeight, uint64_t{5000000000}, "x").ok());
  EXPECT_FALSE(CheckRange(ranges::kWeight, UINT64_MAX, "x").ok());
  const absl::Status s =
      CheckRange(ranges::kWorkers, int64_t{100000}, "--workers");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      s.message(),
      "--workers: workers (0: one per CPU) must be in [0, 64], got 100000");
}

}  // namespace
}  // namespace tmem

namespace tmem {
namespace {

TEST(ParseConfigTest, FleetIsOffByDefaultAndReadStrictly) {
  absl::StatusOr<TmemdConfig> off = ParseConfig("", "t.toml", TmemdConfig{});
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->fleet.enabled());
  absl::StatusOr<TmemdConfig> c = ParseConfig(
      "[fleet]\nendpoints = [\"10.0.0.1:2379\", \"10.0.0.2:2379\"]\n"
      "host = \"hv-1\"\ngroups = [\"rack4\", \"ssd\"]\n"
      "state_dir = \"/var/lib/tmemd\"\nlease_ttl_seconds = 5\n"
      "tls_ca = \"/etc/tmemd/etcd-ca.pem\"\n",  // the CA alone is enough
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->fleet.tls_ca, "/etc/tmemd/etcd-ca.pem");
  EXPECT_TRUE(c->fleet.enabled());
  EXPECT_EQ(c->fleet.endpoints.size(), 2u);
  EXPECT_EQ(c->fleet.host, "hv-1");
  EXPECT_EQ(c->fleet.groups.back(), "ssd");
  EXPECT_EQ(c->fleet.lease_ttl_seconds, 5);
  struct Bad {
    const char* toml;
    const char* reason;
  } bad[] = {
      {"[fleet]\nendpoints = [\"nohostport\"]\n", "is not host:port"},
      {"[fleet]\nendpoints = \"a:1\"\n", "fleet.endpoints"},
      {"[fleet]\nhost = \"-x\"\n", "fleet.host"},
      {"[fleet]\ngroups = [\"a/b\"]\n", "fleet.groups"},
      {"[fleet]\ntls_cert = \"c.pem\"\n", "go together"},
      {"[fleet]\ntls_key = \"k.pem\"\ntls_ca = \"ca.pem\"\n", "go together"},
      {"[fleet]\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n", "needs tls_ca"},
      {"[fleet]\nlease_ttl_seconds = 1\n", "lease_ttl_seconds"},
      {"[fleet]\nendpoint = [\"a:1\"]\n", "unknown key 'fleet.endpoint'"},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(b.toml, "t.toml", TmemdConfig{});
    ASSERT_FALSE(r.ok()) << b.toml;
    EXPECT_NE(r.status().message().find(b.reason), std::string::npos)
        << b.toml << " -> " << r.status().message();
    EXPECT_NE(r.status().message().find("t.toml:"), std::string::npos)
        << r.status().message();
  }
}

// [swap.NAME] and --swap NAME=SIZE: a device per VM, sizes in whole pages.
TEST(SwapConfigTest, FileAndFlagDeclareDevices) {
  absl::StatusOr<TmemdConfig> c = ParseConfig(
      "[swap.vm1]\nsize = \"4G\"\n[swap.db-2]\nsize = 1048576\n"
      "[store]\nstate_dir = \"/srv/tmemd\"\n",
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->swap_devices.size(), 2u);
  // toml++ keeps a table's keys sorted.
  const SwapConfig& db = c->swap_devices[0];
  const SwapConfig& vm1 = c->swap_devices[1];
  EXPECT_EQ(vm1.name, "vm1");
  EXPECT_EQ(vm1.size_bytes, uint64_t{4} << 30);
  EXPECT_NE(vm1.source.find("t.toml:2"), std::string::npos) << vm1.source;
  EXPECT_EQ(db.name, "db-2");
  EXPECT_EQ(db.size_bytes, uint64_t{1} << 20);
  EXPECT_NE(db.source.find("t.toml:4"), std::string::npos) << db.source;
  EXPECT_EQ(c->state_dir, "/srv/tmemd");
  EXPECT_TRUE(ValidateConfig(*c).ok());
  EXPECT_EQ(TmemdConfig{}.state_dir, "/var/lib/tmemd");

  absl::StatusOr<SwapConfig> f = ParseSwapFlag("vm1=512M");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->name, "vm1");
  EXPECT_EQ(f->size_bytes, uint64_t{512} << 20);
  EXPECT_EQ(ParseSwapFlag("a=4096")->size_bytes, 4096u);
}

TEST(SwapConfigTest, BadFileValuesAreRefusedWithFileAndLine) {
  struct Case {
    const char* toml;
    const char* expect;
  };
  const Case cases[] = {
      {"[swap.vm1]\nsize = 0\n", "must be in ["},
      {"[swap.vm1]\nsize = \"4097\"\n", "not a multiple of 4096"},
      {"[swap.vm1]\nsize = 100\n", "must be in ["},
      {"[swap.vm1]\nsize = -4096\n", "must not be negative"},
      {"[swap.vm1]\nsize = \"lots\"\n", "lots"},
      {"[swap.vm1]\nsize = true\n", "a boolean"},
      {"[swap.vm1]\nsize = \"2048TiB\"\n", "must be in ["},
      {"[swap.vm1]\nsize = \"4G\"\nenabled = false\n",
       "unknown key 'swap.vm1.enabled'"},
      {"[swap.vm1]\nsize = \"4G\"\nquota = true\n", "a boolean"},
      {"[swap.vm1]\nsize = \"4G\"\nswap_quota = \"2048TiB\"\n", "must be in ["},
      {"[swap.vm1]\nsize = \"4G\"\nswap_quota = -1\n", "must not be negative"},
      {"[swap.vm1]\nsize = \"4G\"\nswap_mode = \"fast\"\n",
       "use default, off, always or adaptive"},
      {"[swap.vm1]\nsize = \"4G\"\nweight = 0\n", "must be in ["},
      {"[swap.vm1]\nsize = \"4G\"\nmode = 3\n",
       "use default, off, always or adaptive"},
      {"[swap.vm1]\n", "has no size"},
      {"[swap]\nvm1 = \"4G\"\n", "must be a table"},
      {"[swap.\"../x\"]\nsize = \"4G\"\n", "VM name"},
      {"[swap.\"-rf\"]\nsize = \"4G\"\n", "VM name"},
      {"[store]\nstate_dir = \"relative\"\n", "absolute"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(c.toml, "t.toml", TmemdConfig{});
    ASSERT_FALSE(r.ok()) << c.toml;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.toml << ": " << msg;
    EXPECT_NE(msg.find("t.toml:"), std::string::npos) << c.toml << ": " << msg;
  }
}

TEST(SwapConfigTest, BadFlagValuesAreRefusedNamingTheFlag) {
  struct Case {
    const char* text;
    const char* expect;
  };
  const Case cases[] = {
      {"vm1", "use NAME=SIZE"},
      {"vm1=", "vm1="},
      {"vm1=0", "must be in ["},
      {"vm1=100", "must be in ["},
      {"vm1=4097", "not a multiple of 4096"},
      {"vm1=1.5G", "1.5G"},
      {"vm1=99999999999999999999", "99999999999999999999"},
      {"=4G", "VM name"},
      {"../x=4G", "VM name"},
      {".hidden=4G", "VM name"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SwapConfig> r = ParseSwapFlag(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(absl::StrCat("--swap '", c.text, "'")),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.text << ": " << msg;
  }
}

// One device per VM, whether both come from the file, the flags, or one
// of each (ValidateConfig sees them merged).
TEST(SwapConfigTest, TwoDevicesForOneVmAreRefused) {
  absl::StatusOr<TmemdConfig> c =
      ParseConfig("[swap.vm1]\nsize = \"4G\"\n", "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  c->swap_devices.push_back(*ParseSwapFlag("vm1=1G"));
  const absl::Status s = ValidateConfig(*c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--swap 'vm1=1G'"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("one per VM"), absl::string_view::npos) << s;
}

// [[vm]] swap_quota and swap_mode: exact types, the one range table,
// errors at FILE:LINE; 0 is unlimited, as for quota.
TEST(SwapPolicyConfigTest, VmTableReadsSwapQuotaAndSwapMode) {
  absl::StatusOr<TmemdConfig> c = ParseConfig(
      "[[vm]]\nname = \"a\"\nquota = \"1GiB\"\nswap_quota = \"256MiB\"\n"
      "swap_mode = \"off\"\n"
      "[[vm]]\nname = \"b\"\nswap_quota = 0\nswap_mode = \"default\"\n"
      "[[vm]]\nname = \"c\"\nswap_quota = 8192\n",
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->vms.size(), 3u);
  EXPECT_EQ(c->vms[0].policy.swap_quota_bytes, uint64_t{256} << 20);
  EXPECT_EQ(c->vms[0].policy.quota_bytes, uint64_t{1} << 30);
  EXPECT_EQ(c->vms[0].policy.swap_mode, ValveMode::kOff);
  EXPECT_NE(c->vms[0].set.swap_quota.find("'vm[0].swap_quota' (t.toml:4)"),
            std::string::npos)
      << c->vms[0].set.swap_quota;
  EXPECT_EQ(c->vms[1].policy.swap_quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(c->vms[1].policy.swap_mode, ValveMode::kDefault);
  EXPECT_EQ(c->vms[2].policy.swap_quota_bytes, 8192u);
  EXPECT_EQ(c->vms[2].policy.swap_mode, ValveMode::kDefault);
  EXPECT_TRUE(c->vms[2].set.swap_mode.empty());
  EXPECT_TRUE(ValidateConfig(*c).ok());
  EXPECT_EQ(ConfiguredVmPolicy(*c, "a").swap_quota_bytes, uint64_t{256} << 20);

  struct Case {
    const char* toml;
    const char* expect;
  };
  const Case cases[] = {
      {"[[vm]]\nname = \"a\"\nswap_quota = true\n", "a boolean"},
      {"[[vm]]\nname = \"a\"\nswap_quota = 1.5\n", "a float"},
      {"[[vm]]\nname = \"a\"\nswap_quota = \"lots\"\n", "lots"},
      {"[[vm]]\nname = \"a\"\nswap_quota = \"2048TiB\"\n", "must be in ["},
      {"[[vm]]\nname = \"a\"\nswap_mode = \"sometimes\"\n",
       "use default, off, always or adaptive"},
      {"[[vm]]\nname = \"a\"\nswap_mode = false\n",
       "use default, off, always or adaptive"},
  };
  for (const Case& k : cases) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(k.toml, "t.toml", TmemdConfig{});
    ASSERT_FALSE(r.ok()) << k.toml;
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(k.expect), std::string::npos) << k.toml << ": " << msg;
    EXPECT_NE(msg.find("t.toml:3"), std::string::npos) << k.toml << ": " << msg;
  }
}

// A VM with only a swap device takes its policy from [swap.NAME].
TEST(SwapPolicyConfigTest, SwapOnlyVmGetsItsPolicyFromTheSwapTable) {
  absl::StatusOr<TmemdConfig> c = ParseConfig(
      "[swap.db]\nsize = \"4GiB\"\nquota = \"1GiB\"\nweight = 300\n"
      "mode = \"always\"\nswap_quota = \"512MiB\"\nswap_mode = \"adaptive\"\n"
      "[swap.plain]\nsize = \"1GiB\"\n",
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(ValidateConfig(*c).ok()) << ValidateConfig(*c);
  const VmPolicy db = ConfiguredVmPolicy(*c, "db");
  EXPECT_EQ(db.quota_bytes, uint64_t{1} << 30);
  EXPECT_EQ(db.weight, 300u);
  EXPECT_EQ(db.mode, ValveMode::kAlways);
  EXPECT_EQ(db.swap_quota_bytes, uint64_t{512} << 20);
  EXPECT_EQ(db.swap_mode, ValveMode::kAdaptive);
  EXPECT_TRUE(db.enabled);
  // Nothing set: the defaults.
  const VmPolicy plain = ConfiguredVmPolicy(*c, "plain");
  EXPECT_EQ(plain.quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(plain.swap_quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(plain.weight, VmPolicy{}.weight);
  EXPECT_EQ(plain.swap_mode, ValveMode::kDefault);
  // A --swap device has no policy fields.
  c->swap_devices.push_back(*ParseSwapFlag("flagged=1G"));
  EXPECT_TRUE(ValidateConfig(*c).ok());
  EXPECT_EQ(ConfiguredVmPolicy(*c, "flagged").quota_bytes, kUnlimitedQuota);
}

// [[vm]] NAME and [swap.NAME] together: the fields of both make the VM's
// policy; one field set in both is refused naming both FILE:LINEs.
TEST(SwapPolicyConfigTest, VmAndSwapTablesCombineAndNeverSetOneFieldTwice) {
  absl::StatusOr<TmemdConfig> c = ParseConfig(
      "[[vm]]\nname = \"web\"\nquota = \"2GiB\"\nmode = \"off\"\n"
      "[swap.web]\nsize = \"4GiB\"\nswap_quota = \"1GiB\"\n"
      "swap_mode = \"adaptive\"\n",
      "t.toml", TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(ValidateConfig(*c).ok()) << ValidateConfig(*c);
  const VmPolicy web = ConfiguredVmPolicy(*c, "web");
  EXPECT_EQ(web.quota_bytes, uint64_t{2} << 30);
  EXPECT_EQ(web.mode, ValveMode::kOff);
  EXPECT_EQ(web.swap_quota_bytes, uint64_t{1} << 30);
  EXPECT_EQ(web.swap_mode, ValveMode::kAdaptive);

  struct Case {
    const char* toml;
    const char* field;
    const char* vm_line;
    const char* swap_line;
  };
  const Case cases[] = {
      {"[[vm]]\nname = \"web\"\nquota = \"2GiB\"\n"
       "[swap.web]\nsize = \"4GiB\"\nquota = \"1GiB\"\n",
       "quota", "'vm[0].quota' (t.toml:3)", "'swap.web.quota' (t.toml:6)"},
      {"[[vm]]\nname = \"web\"\nweight = 5\n"
       "[swap.web]\nsize = \"4GiB\"\nweight = 7\n",
       "weight", "'vm[0].weight' (t.toml:3)", "'swap.web.weight' (t.toml:6)"},
      {"[swap.web]\nsize = \"4GiB\"\nmode = \"off\"\n"
       "[[vm]]\nname = \"web\"\nmode = \"off\"\n",
       "mode", "'vm[0].mode' (t.toml:6)", "'swap.web.mode' (t.toml:3)"},
      {"[[vm]]\nname = \"web\"\nswap_quota = 4096\n"
       "[swap.web]\nsize = \"4GiB\"\nswap_quota = 4096\n",
       "swap_quota", "'vm[0].swap_quota' (t.toml:3)",
       "'swap.web.swap_quota' (t.toml:6)"},
      {"[[vm]]\nname = \"web\"\nswap_mode = \"off\"\n"
       "[swap.web]\nsize = \"4GiB\"\nswap_mode = \"always\"\n",
       "swap_mode", "'vm[0].swap_mode' (t.toml:3)",
       "'swap.web.swap_mode' (t.toml:6)"},
  };
  for (const Case& k : cases) {
    absl::StatusOr<TmemdConfig> r =
        ParseConfig(k.toml, "t.toml", TmemdConfig{});
    ASSERT_TRUE(r.ok()) << r.status();
    const absl::Status s = ValidateConfig(*r);
    ASSERT_FALSE(s.ok()) << k.toml;
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(s.message());
    EXPECT_NE(msg.find(absl::StrCat(k.field, " is set twice")),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(k.vm_line), std::string::npos) << msg;
    EXPECT_NE(msg.find(k.swap_line), std::string::npos) << msg;
  }

  // A --vm VM sets no field: [swap.NAME]'s apply to it.
  c = ParseConfig("[swap.web]\nsize = \"4GiB\"\nquota = \"1GiB\"\n", "t.toml",
                  TmemdConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  c->vms.push_back({"web", {}, {}});
  ASSERT_TRUE(ValidateConfig(*c).ok());
  EXPECT_EQ(ConfiguredVmPolicy(*c, "web").quota_bytes, uint64_t{1} << 30);
}

}  // namespace
}  // namespace tmem
