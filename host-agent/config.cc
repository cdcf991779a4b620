#include "host-agent/config.h"

#include <grp.h>
#include <toml++/toml.h>

#include <bit>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "host-agent/common/setting_ranges.h"

namespace tmem {

namespace {

// Reads tables strictly: every key must be known.
class TableReader {
 public:
  TableReader(const toml::table& table, std::string path)
      : table_(table), path_(std::move(path)) {}

  absl::Status CheckKeys(std::initializer_list<std::string_view> known) const {
    for (const auto& [key, node] : table_) {
      bool ok = false;
      for (std::string_view k : known) ok = ok || key.str() == k;
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            "unknown key '", path_, std::string(key.str()), "'", Where(node)));
      }
    }
    return absl::OkStatus();
  }

  // Values are read by their exact TOML type: toml++'s value<T>() would
  // turn `true` into 1 and 8.0 into 8, giving a wrong-typed value a meaning.
  absl::Status Size(std::string_view key, uint64_t* out,
                    const IntRange& range) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    uint64_t bytes = 0;
    if (auto i = n->value_exact<int64_t>()) {
      if (*i < 0) return Bad(key, *n, "must not be negative");
      bytes = static_cast<uint64_t>(*i);
    } else if (auto s = n->value_exact<std::string>()) {
      absl::StatusOr<uint64_t> v = ParseSize(*s);
      if (!v.ok()) return Bad(key, *n, std::string(v.status().message()));
      bytes = *v;
    } else {
      return Bad(key, *n,
                 absl::StrCat("must be a size (an integer number of bytes or "
                              "a string like \"64MiB\"), not ",
                              TypeName(*n)));
    }
    if (absl::Status s = CheckRange(range, bytes, Source(key, *n)); !s.ok()) {
      return s;
    }
    *out = bytes;
    return absl::OkStatus();
  }

  template <typename Int>
  absl::Status Integer(std::string_view key, Int* out,
                       const IntRange& range) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    auto i = n->value_exact<int64_t>();
    if (!i) {
      return Bad(key, *n,
                 absl::StrCat("must be an integer, not ", TypeName(*n)));
    }
    if (absl::Status s = CheckRange(range, *i, Source(key, *n)); !s.ok()) {
      return s;
    }
    *out = static_cast<Int>(*i);
    return absl::OkStatus();
  }

  absl::Status Bool(std::string_view key, bool* out) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    auto b = n->value_exact<bool>();
    if (!b) {
      return Bad(key, *n,
                 absl::StrCat("must be true or false, not ", TypeName(*n)));
    }
    *out = *b;
    return absl::OkStatus();
  }

  absl::Status Double(std::string_view key, double* out,
                      const DoubleRange& range) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    // An integer is a number too (25 for 25.0); a bool or string is not.
    std::optional<double> d;
    if (auto f = n->value_exact<double>()) {
      d = *f;
    } else if (auto i = n->value_exact<int64_t>()) {
      d = static_cast<double>(*i);
    }
    if (!d) {
      return Bad(key, *n, absl::StrCat("must be a number, not ", TypeName(*n)));
    }
    if (absl::Status s = CheckRange(range, *d, Source(key, *n)); !s.ok()) {
      return s;
    }
    *out = *d;
    return absl::OkStatus();
  }

  absl::Status Mode(std::string_view key, ValveMode* out,
                    bool allow_default) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    auto text = n->value_exact<std::string>();
    ValveMode m;
    if (!text || !ParseValveMode(*text, &m) ||
        (!allow_default && m == ValveMode::kDefault)) {
      return Bad(key, *n,
                 allow_default ? "use default, off, always or adaptive"
                               : "use off, always or adaptive");
    }
    *out = m;
    return absl::OkStatus();
  }

  absl::Status Strings(std::string_view key,
                       std::vector<std::string>* out) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    const toml::array* a = n->as_array();
    if (a == nullptr) return Bad(key, *n, "must be an array of strings");
    out->clear();
    for (const toml::node& e : *a) {
      auto s = e.value_exact<std::string>();
      if (!s) return Bad(key, *n, "must be an array of strings");
      out->push_back(*s);
    }
    return absl::OkStatus();
  }

  absl::Status String(std::string_view key,
                      std::optional<std::string>* out) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) return absl::OkStatus();
    auto s = n->value_exact<std::string>();
    if (!s)
      return Bad(key, *n, absl::StrCat("must be a string, not ", TypeName(*n)));
    *out = *s;
    return absl::OkStatus();
  }

  // "'PATH.KEY' (FILE:LINE)" of a key that is present; "" otherwise.
  std::string SourceOf(std::string_view key) const {
    const toml::node* n = table_.get(key);
    return n == nullptr ? std::string() : Source(key, *n);
  }

  // A refusal of a key that is present, naming it with FILE:LINE.
  absl::Status Error(std::string_view key, std::string_view why) const {
    const toml::node* n = table_.get(key);
    if (n == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path_, std::string(key), "': ", std::string(why)));
    }
    return Bad(key, *n, why);
  }

 private:
  // " (FILE:LINE)" of a node.
  static std::string Where(const toml::node& n) {
    const auto& src = n.source();
    if (!src.begin) return "";
    return absl::StrCat(" (", src.path ? *src.path : std::string("config"), ":",
                        src.begin.line, ")");
  }
  static std::string TypeName(const toml::node& n) {
    switch (n.type()) {
      case toml::node_type::boolean:
        return "a boolean";
      case toml::node_type::floating_point:
        return "a float";
      case toml::node_type::integer:
        return "an integer";
      case toml::node_type::string:
        return "a string";
      case toml::node_type::array:
        return "an array";
      case toml::node_type::table:
        return "a table";
      default:
        return "a date or time";
    }
  }
  std::string Source(std::string_view key, const toml::node& n) const {
    return absl::StrCat("'", path_, std::string(key), "'", Where(n));
  }
  absl::Status Bad(std::string_view key, const toml::node& n,
                   std::string_view why) const {
    return absl::InvalidArgumentError(
        absl::StrCat(Source(key, n), ": ", std::string(why)));
  }

  const toml::table& table_;
  std::string path_;
};

// A swap device's size, from a flag or a file: positive, whole pages.
absl::Status CheckSwapSize(uint64_t bytes, std::string_view source) {
  if (absl::Status s = CheckRange(ranges::kSwapSize, bytes, source); !s.ok()) {
    return s;
  }
  if (bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source), ": swap size ", bytes,
                     " is not a multiple of 4096 (the device's block)"));
  }
  return absl::OkStatus();
}

absl::Status ApplyStore(const toml::table& t, StoreOptions& store,
                        std::string& state_dir) {
  TableReader r(t, "store.");
  if (absl::Status s = r.CheckKeys(
          {"memory_cap", "shards", "poor_compression_threshold",
           "poor_compression_action", "max_evictions_per_put", "state_dir"});
      !s.ok()) {
    return s;
  }
  std::optional<std::string> dir;
  if (auto s = r.String("state_dir", &dir); !s.ok()) return s;
  if (dir) {
    if (dir->empty() || (*dir)[0] != '/') {
      return r.Error("state_dir", "must be an absolute path");
    }
    state_dir = *dir;
  }
  if (auto s =
          r.Size("memory_cap", &store.memory_cap_bytes, ranges::kMemoryCap);
      !s.ok())
    return s;
  if (auto s = r.Integer("shards", &store.num_shards, ranges::kShards); !s.ok())
    return s;
  uint64_t threshold = store.poor_compression_threshold_bytes;
  if (auto s = r.Size("poor_compression_threshold", &threshold,
                      ranges::kPoorCompressionThreshold);
      !s.ok())
    return s;
  store.poor_compression_threshold_bytes = threshold;
  if (auto s = r.Integer("max_evictions_per_put", &store.max_evictions_per_put,
                         ranges::kMaxEvictionsPerPut);
      !s.ok()) {
    return s;
  }
  std::optional<std::string> action;
  if (auto s = r.String("poor_compression_action", &action); !s.ok()) return s;
  if (action) {
    if (*action == "raw") {
      store.poor_compression_action = PoorCompressionAction::kStoreRaw;
    } else if (*action == "refuse") {
      store.poor_compression_action = PoorCompressionAction::kRefuse;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("'store.poor_compression_action' is '", *action,
                       R"(': use "raw" or "refuse")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyChannels(const toml::table& t, TmemdConfig& c) {
  TableReader r(t, "channels.");
  if (auto s = r.CheckKeys({"socket_dir", "region_size", "ring_entries",
                            "vectors", "socket_mode", "socket_group"});
      !s.ok()) {
    return s;
  }
  std::optional<std::string> dir, mode, group;
  if (auto s = r.String("socket_dir", &dir); !s.ok()) return s;
  if (dir) c.socket_dir = *dir;
  if (auto s = r.Size("region_size", &c.region_bytes, ranges::kRegionSize);
      !s.ok())
    return s;
  if (auto s = r.Integer("ring_entries", &c.ring_entries, ranges::kRingEntries);
      !s.ok())
    return s;
  if (auto s = r.Integer("vectors", &c.vectors, ranges::kVectors); !s.ok())
    return s;
  if (auto s = r.String("socket_mode", &mode); !s.ok()) return s;
  if (mode) {
    char* end = nullptr;
    const unsigned long m = std::strtoul(mode->c_str(), &end, 8);
    if (mode->empty() || end == nullptr || *end != '\0' || m > 0777) {
      return absl::InvalidArgumentError(
          absl::StrCat("'channels.socket_mode' is '", *mode,
                       "': use an octal mode like \"0660\""));
    }
    c.socket_mode = static_cast<mode_t>(m);
  }
  if (auto s = r.String("socket_group", &group); !s.ok()) return s;
  if (group) c.socket_group = *group;
  return absl::OkStatus();
}

absl::Status ApplyValve(const toml::table& t, ValveOptions& v) {
  TableReader r(t, "valve.");
  if (auto s = r.CheckKeys(
          {"mode", "cpu_budget_percent", "cpu_floor_percent",
           "spare_cpu_fraction", "cpu_pressure_start", "cpu_pressure_full",
           "sample_period_ms", "smoothing", "throttle_below", "restore_above",
           "min_samples", "min_dwell_periods", "min_admission",
           "memory_headroom_fraction", "deferred_compression"});
      !s.ok()) {
    return s;
  }
  absl::Status s;
  if (s = r.Mode("mode", &v.default_mode, false); !s.ok()) return s;
  if (s = r.Double("cpu_budget_percent", &v.cpu_budget_percent,
                   ranges::kCpuBudgetPercent);
      !s.ok())
    return s;
  if (s = r.Double("cpu_floor_percent", &v.cpu_floor_percent,
                   ranges::kCpuFloorPercent);
      !s.ok())
    return s;
  if (s = r.Double("spare_cpu_fraction", &v.spare_cpu_fraction,
                   ranges::kSpareCpuFraction);
      !s.ok())
    return s;
  if (s = r.Double("cpu_pressure_start", &v.cpu_pressure_start,
                   ranges::kCpuPressureStart);
      !s.ok())
    return s;
  if (s = r.Double("cpu_pressure_full", &v.cpu_pressure_full,
                   ranges::kCpuPressureFull);
      !s.ok())
    return s;
  if (s = r.Integer("sample_period_ms", &v.sample_period_ms,
                    ranges::kSamplePeriodMs);
      !s.ok())
    return s;
  if (s = r.Double("smoothing", &v.smoothing, ranges::kSmoothing); !s.ok())
    return s;
  if (s = r.Double("throttle_below", &v.throttle_below, ranges::kThrottleBelow);
      !s.ok())
    return s;
  if (s = r.Double("restore_above", &v.restore_above, ranges::kRestoreAbove);
      !s.ok())
    return s;
  if (s = r.Integer("min_samples", &v.min_samples, ranges::kMinSamples);
      !s.ok())
    return s;
  if (s = r.Integer("min_dwell_periods", &v.min_dwell_periods,
                    ranges::kMinDwellPeriods);
      !s.ok())
    return s;
  if (s = r.Integer("min_admission", &v.min_admission, ranges::kMinAdmission);
      !s.ok())
    return s;
  if (s = r.Double("memory_headroom_fraction", &v.memory_headroom_fraction,
                   ranges::kMemoryHeadroomFraction);
      !s.ok())
    return s;
  if (s = r.Bool("deferred_compression", &v.deferred_compression); !s.ok())
    return s;
  return Valve::ValidateOptions(v);
}

absl::Status ApplyWorker(const toml::table& t, TmemdConfig& c) {
  WorkerOptions& w = c.worker;
  TableReader r(t, "worker.");
  if (auto s = r.CheckKeys({"workers", "poll_us", "batch", "idle_check_ms"});
      !s.ok())
    return s;
  if (auto s = r.Integer("workers", &c.workers, ranges::kWorkers); !s.ok())
    return s;
  if (auto s = r.Integer("poll_us", &w.poll_us, ranges::kPollUs); !s.ok())
    return s;
  if (auto s = r.Integer("batch", &w.batch, ranges::kBatch); !s.ok()) return s;
  if (auto s =
          r.Integer("idle_check_ms", &w.idle_check_ms, ranges::kIdleCheckMs);
      !s.ok())
    return s;
  return absl::OkStatus();
}

absl::Status ApplyLog(const toml::table& t, TmemdConfig& c) {
  TableReader r(t, "log.");
  if (auto s = r.CheckKeys({"level", "format", "stats_interval_seconds"});
      !s.ok()) {
    return s;
  }
  std::optional<std::string> level, format;
  if (auto s = r.String("level", &level); !s.ok()) return s;
  if (level && !ParseLogLevel(*level, &c.log_level)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'log.level' is '", *level, "': use debug, info, warn or error"));
  }
  if (auto s = r.String("format", &format); !s.ok()) return s;
  if (format) {
    if (*format == "text") {
      c.log_format = LogFormat::kText;
    } else if (*format == "json") {
      c.log_format = LogFormat::kJson;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("'log.format' is '", *format, "': use text or json"));
    }
  }
  if (auto s = r.Integer("stats_interval_seconds", &c.stats_interval_seconds,
                         ranges::kStatsIntervalSeconds);
      !s.ok()) {
    return s;
  }
  return absl::OkStatus();
}

absl::Status ApplyControl(const toml::table& t, ControlConfig& c) {
  TableReader r(t, "control.");
  if (auto s = r.CheckKeys({"socket", "readonly_socket", "tcp_address",
                            "tls_cert", "tls_key", "tls_ca", "admin",
                            "state_file", "metrics_port", "metrics_address",
                            "max_admin_connections", "max_readonly_connections",
                            "max_tcp_connections", "reserved_vm_channels"});
      !s.ok()) {
    return s;
  }
  std::optional<std::string> v;
  if (auto s = r.String("socket", &c.socket); !s.ok()) return s;
  for (auto [key, field] :
       {std::pair{"readonly_socket", &c.readonly_socket},
        std::pair{"tcp_address", &c.tcp_address},
        std::pair{"tls_cert", &c.tls_cert}, std::pair{"tls_key", &c.tls_key},
        std::pair{"tls_ca", &c.tls_ca}, std::pair{"state_file", &c.state_file},
        std::pair{"metrics_address", &c.metrics_address}}) {
    v.reset();
    if (auto s = r.String(key, &v); !s.ok()) return s;
    if (v) *field = *v;
  }
  if (auto s = r.Strings("admin", &c.admin); !s.ok()) return s;
  if (auto s = r.Integer("metrics_port", &c.metrics_port, ranges::kMetricsPort);
      !s.ok())
    return s;
  for (auto [key, field, range] :
       {std::tuple{"max_admin_connections", &c.max_admin_connections,
                   &ranges::kMaxAdminConnections},
        std::tuple{"max_readonly_connections", &c.max_readonly_connections,
                   &ranges::kMaxReadonlyConnections},
        std::tuple{"max_tcp_connections", &c.max_tcp_connections,
                   &ranges::kMaxTcpConnections},
        std::tuple{"reserved_vm_channels", &c.reserved_vm_channels,
                   &ranges::kReservedVmChannels}}) {
    if (auto s = r.Integer(key, field, *range); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ApplyLibvirt(const toml::table& t, LibvirtConfig& c) {
  TableReader r(t, "libvirt.");
  if (auto s = r.CheckKeys({"enabled", "uri", "detach_timeout_seconds"});
      !s.ok()) {
    return s;
  }
  std::optional<std::string> uri;
  if (auto s = r.String("uri", &uri); !s.ok()) return s;
  if (uri) {
    c.uri = *uri;
    c.enabled = true;  // naming a URI asks for libvirt
  }
  if (auto s = r.Bool("enabled", &c.enabled); !s.ok()) return s;
  if (auto s = r.Integer("detach_timeout_seconds", &c.detach_timeout_seconds,
                         ranges::kDetachTimeoutSeconds);
      !s.ok()) {
    return s;
  }
  return absl::OkStatus();
}

absl::Status ApplyFleet(const toml::table& t, FleetConfig& c) {
  TableReader r(t, "fleet.");
  if (auto s =
          r.CheckKeys({"endpoints", "host", "groups", "state_dir", "tls_cert",
                       "tls_key", "tls_ca", "lease_ttl_seconds"});
      !s.ok()) {
    return s;
  }
  if (auto s = r.Strings("endpoints", &c.endpoints); !s.ok()) return s;
  if (auto s = r.Strings("groups", &c.groups); !s.ok()) return s;
  std::optional<std::string> v;
  for (auto [key, field] :
       {std::pair{"host", &c.host}, std::pair{"state_dir", &c.state_dir},
        std::pair{"tls_cert", &c.tls_cert}, std::pair{"tls_key", &c.tls_key},
        std::pair{"tls_ca", &c.tls_ca}}) {
    v.reset();
    if (auto s = r.String(key, &v); !s.ok()) return s;
    if (v) *field = *v;
  }
  if (auto s = r.Integer("lease_ttl_seconds", &c.lease_ttl_seconds,
                         ranges::kLeaseTtlSeconds);
      !s.ok()) {
    return s;
  }
  // Names become etcd keys; endpoints must say where (no empty entry).
  for (const std::string& e : c.endpoints) {
    if (e.empty() || e.find(':') == std::string::npos) {
      return r.Error("endpoints", absl::StrCat("'", e, "' is not host:port"));
    }
  }
  if (!c.host.empty()) {
    if (auto s = ValidateVmName(c.host); !s.ok()) {
      return r.Error("host",
                     "must be 1-64 of [A-Za-z0-9._-], starting "
                     "with a letter or digit");
    }
  }
  for (const std::string& g : c.groups) {
    if (auto s = ValidateVmName(g); !s.ok()) {
      return r.Error("groups", absl::StrCat("'", g,
                                            "' must be 1-64 of [A-Za-z0-9._-]"
                                            ", starting with a letter or "
                                            "digit"));
    }
  }
  // TLS: tls_ca alone, or with tls_cert and tls_key (host-agent/fleet/
  // etcd_tls.h checks the files themselves when tmemd starts).
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return r.Error(c.tls_cert.empty() ? "tls_key" : "tls_cert",
                   "tls_cert and tls_key go together");
  }
  if (!c.tls_cert.empty() && c.tls_ca.empty()) {
    return r.Error("tls_cert", "needs tls_ca (the CA of etcd's certificate)");
  }
  return absl::OkStatus();
}

// The policy fields of a [[vm]] or [swap.NAME] table (those in `keys`),
// into `policy`, with where each was set into `set`.
struct PolicyKeys {
  bool enabled = true;  // [[vm]] only: a swap-only VM is served or removed
};
absl::Status ReadPolicy(const TableReader& r, const PolicyKeys& keys,
                        VmPolicy& policy, PolicySources& set) {
  uint64_t quota = 0;  // 0: unlimited (setting_ranges.h)
  if (auto s = r.Size("quota", &quota, ranges::kQuota); !s.ok()) return s;
  policy.quota_bytes = QuotaFromSetting(quota);
  set.quota = r.SourceOf("quota");
  if (auto s = r.Integer("weight", &policy.weight, ranges::kWeight); !s.ok()) {
    return s;
  }
  set.weight = r.SourceOf("weight");
  if (keys.enabled) {
    if (auto s = r.Bool("enabled", &policy.enabled); !s.ok()) return s;
    set.enabled = r.SourceOf("enabled");
  }
  if (auto s = r.Mode("mode", &policy.mode, true); !s.ok()) return s;
  set.mode = r.SourceOf("mode");
  uint64_t swap_quota = 0;  // 0: unlimited, as quota
  if (auto s = r.Size("swap_quota", &swap_quota, ranges::kSwapQuota); !s.ok()) {
    return s;
  }
  policy.swap_quota_bytes = QuotaFromSetting(swap_quota);
  set.swap_quota = r.SourceOf("swap_quota");
  if (auto s = r.Mode("swap_mode", &policy.swap_mode, true); !s.ok()) return s;
  set.swap_mode = r.SourceOf("swap_mode");
  return absl::OkStatus();
}

// [swap.NAME]: size = "4GiB", and the policy of a VM with no [[vm]].
absl::Status ApplySwap(const toml::table& t, TmemdConfig& c) {
  for (const auto& [key, node] : t) {
    const std::string name(key.str());
    const auto& src = node.source();
    const std::string where =
        src.begin ? absl::StrCat(src.path ? *src.path : std::string("config"),
                                 ":", src.begin.line)
                  : std::string("config");
    if (absl::Status s = ValidateVmName(name); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("[swap.", name, "] (", where, "): ", s.message()));
    }
    const toml::table* dev = node.as_table();
    if (dev == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'swap.", name, "' (", where, "): must be a table: write [swap.",
          name, "] with size = \"4GiB\""));
    }
    TableReader r(*dev, absl::StrCat("swap.", name, "."));
    if (auto s = r.CheckKeys(
            {"size", "quota", "weight", "mode", "swap_quota", "swap_mode"});
        !s.ok()) {
      return s;
    }
    if (dev->get("size") == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("[swap.", name, "] (", where, ") has no size"));
    }
    SwapConfig sc;
    sc.name = name;
    if (auto s = r.Size("size", &sc.size_bytes, ranges::kSwapSize); !s.ok()) {
      return s;
    }
    const auto& size_src = dev->get("size")->source();
    sc.source =
        absl::StrCat("'swap.", name, ".size' (",
                     size_src.path ? *size_src.path : std::string("config"),
                     ":", size_src.begin.line, ")");
    if (auto s = CheckSwapSize(sc.size_bytes, sc.source); !s.ok()) return s;
    if (auto s = ReadPolicy(r, PolicyKeys{.enabled = false}, sc.policy, sc.set);
        !s.ok()) {
      return s;
    }
    c.swap_devices.push_back(sc);
  }
  return absl::OkStatus();
}

absl::Status ApplyVm(const toml::table& t, size_t index, TmemdConfig& c) {
  TableReader r(t, absl::StrCat("vm[", index, "]."));
  if (auto s = r.CheckKeys({"name", "quota", "weight", "enabled", "mode",
                            "swap_quota", "swap_mode"});
      !s.ok())
    return s;
  VmConfig vm;
  std::optional<std::string> name;
  if (auto s = r.String("name", &name); !s.ok()) return s;
  if (!name) {
    return absl::InvalidArgumentError(
        absl::StrCat("'vm[", index, "]' has no name"));
  }
  vm.name = *name;
  if (auto s = ReadPolicy(r, PolicyKeys{}, vm.policy, vm.set); !s.ok()) {
    return s;
  }
  c.vms.push_back(vm);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TmemdConfig> ParseConfig(std::string_view text,
                                        std::string_view source_name,
                                        TmemdConfig c) {
  toml::table root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(source_name), ":", e.source().begin.line, ":",
        e.source().begin.column, ": ", std::string(e.description())));
  }
  for (const auto& [key, node] : root) {
    const std::string_view k = key.str();
    absl::Status s;
    if (k == "vm") {
      const toml::array* vms = node.as_array();
      if (vms == nullptr) {
        return absl::InvalidArgumentError(
            "'vm' must be an array of tables: write [[vm]] sections");
      }
      for (size_t i = 0; i < vms->size(); ++i) {
        const toml::table* t = (*vms)[i].as_table();
        if (t == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("'vm[", i, "]' must be a table"));
        }
        if (s = ApplyVm(*t, i, c); !s.ok()) return s;
      }
      continue;
    }
    const toml::table* t = node.as_table();
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown top-level key '", std::string(k),
                       "' (sections: [store], [channels], [worker], [valve], "
                       "[log], [libvirt], [swap.NAME], [[vm]])"));
    }
    if (k == "store") {
      s = ApplyStore(*t, c.store, c.state_dir);
    } else if (k == "swap") {
      s = ApplySwap(*t, c);
    } else if (k == "channels") {
      s = ApplyChannels(*t, c);
    } else if (k == "worker") {
      s = ApplyWorker(*t, c);
    } else if (k == "valve") {
      s = ApplyValve(*t, c.valve);
    } else if (k == "log") {
      s = ApplyLog(*t, c);
    } else if (k == "control") {
      s = ApplyControl(*t, c.control);
    } else if (k == "libvirt") {
      s = ApplyLibvirt(*t, c.libvirt);
    } else if (k == "fleet") {
      s = ApplyFleet(*t, c.fleet);
    } else {
      s = absl::InvalidArgumentError(absl::StrCat(
          "unknown section [", std::string(k),
          "] (sections: [store], [channels], [worker], [valve], "
          "[log], [control], [libvirt], [fleet], [swap.NAME], [[vm]])"));
    }
    if (!s.ok()) return s;
  }
  return c;
}

absl::StatusOr<TmemdConfig> LoadConfigFile(const std::string& path,
                                           TmemdConfig base) {
  // A directory opens as a stream that reads nothing: it would start tmemd
  // on its defaults.
  std::error_code ec;
  if (std::filesystem::exists(path, ec) &&
      !std::filesystem::is_regular_file(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file '", path, "' is not a regular file"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read config file '", path, "'"));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  return ParseConfig(buf.str(), path, std::move(base));
}

namespace {

// A policy field a VM's [[vm]] and its [swap.NAME] both set: which one
// wins would be a guess, so neither does.
absl::Status CheckSetOnce(const std::string& vm, const PolicySources& a,
                          const PolicySources& b) {
  const std::pair<const char*, const std::string PolicySources::*> fields[] = {
      {"quota", &PolicySources::quota},
      {"weight", &PolicySources::weight},
      {"enabled", &PolicySources::enabled},
      {"mode", &PolicySources::mode},
      {"swap_quota", &PolicySources::swap_quota},
      {"swap_mode", &PolicySources::swap_mode},
  };
  for (const auto& [field, member] : fields) {
    if ((a.*member).empty() || (b.*member).empty()) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("VM '", vm, "': ", field, " is set twice, by ", a.*member,
                     " and by ", b.*member, ": set it in one place"));
  }
  return absl::OkStatus();
}

}  // namespace

VmPolicy ConfiguredVmPolicy(const TmemdConfig& c, std::string_view name) {
  VmPolicy policy;
  for (const VmConfig& vm : c.vms) {
    if (vm.name == name) policy = vm.policy;
  }
  for (const SwapConfig& sc : c.swap_devices) {
    if (sc.name != name) continue;
    const PolicySources& set = sc.set;
    if (!set.quota.empty()) policy.quota_bytes = sc.policy.quota_bytes;
    if (!set.weight.empty()) policy.weight = sc.policy.weight;
    if (!set.enabled.empty()) policy.enabled = sc.policy.enabled;
    if (!set.mode.empty()) policy.mode = sc.policy.mode;
    if (!set.swap_quota.empty()) {
      policy.swap_quota_bytes = sc.policy.swap_quota_bytes;
    }
    if (!set.swap_mode.empty()) policy.swap_mode = sc.policy.swap_mode;
  }
  return policy;
}

absl::Status ValidateConfig(const TmemdConfig& c) {
  if (!std::has_single_bit(c.region_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("channels.region_size ", c.region_bytes,
                     " must be a power of two (QEMU requires it for BAR2)"));
  }
  if (!std::has_single_bit(c.ring_entries)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "channels.ring_entries ", c.ring_entries, " must be a power of two"));
  }
  if (c.socket_dir.empty()) {
    return absl::InvalidArgumentError("channels.socket_dir is empty");
  }
  if (!c.control.tcp_address.empty() &&
      (c.control.tls_cert.empty() || c.control.tls_key.empty() ||
       c.control.tls_ca.empty())) {
    return absl::InvalidArgumentError(
        "control.tcp_address needs control.tls_cert, control.tls_key and "
        "control.tls_ca (the control plane accepts TCP only with mutual TLS)");
  }
  absl::flat_hash_set<std::string> names;
  for (const VmConfig& vm : c.vms) {
    if (absl::Status s = ValidateVmName(vm.name); !s.ok()) return s;
    if (!names.insert(vm.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("VM '", vm.name, "' is configured twice"));
    }
  }
  absl::flat_hash_set<std::string> swaps;
  for (const SwapConfig& sc : c.swap_devices) {
    for (const VmConfig& vm : c.vms) {
      if (vm.name != sc.name) continue;
      if (absl::Status s = CheckSetOnce(vm.name, vm.set, sc.set); !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = ValidateVmName(sc.name); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(sc.source, ": ", s.message()));
    }
    if (absl::Status s = CheckSwapSize(sc.size_bytes, sc.source); !s.ok()) {
      return s;
    }
    if (!swaps.insert(sc.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(sc.source, ": VM '", sc.name,
                       "' has a swap device already (one per VM)"));
    }
  }
  if (c.state_dir.empty() || c.state_dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "store.state_dir '", c.state_dir, "' must be an absolute path"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SwapConfig> ParseSwapFlag(std::string_view text) {
  const std::string source = absl::StrCat("--swap '", std::string(text), "'");
  const size_t eq = text.find('=');
  if (eq == std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": use NAME=SIZE, e.g. vm1=4G"));
  }
  SwapConfig sc;
  sc.name = std::string(text.substr(0, eq));
  sc.source = source;
  if (absl::Status s = ValidateVmName(sc.name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  }
  absl::StatusOr<uint64_t> size = ParseSize(text.substr(eq + 1));
  if (!size.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", size.status().message()));
  }
  if (absl::Status s = CheckSwapSize(*size, source); !s.ok()) return s;
  sc.size_bytes = *size;
  return sc;
}

}  // namespace tmem
