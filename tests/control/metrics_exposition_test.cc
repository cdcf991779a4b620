// The Prometheus exposition: PrometheusText keeps each family
// whole whatever the order samples are added in, escapes label values and
// HELP text, and refuses a family redefined with another type or HELP; the
// counter mapping gives every counter a family with HELP text, named as
// Prometheus wants; and tmemd's real exposition (an in-process agent with
// VMs) has one HELP and one TYPE per family, contiguous samples, and no
// family that mixes host-wide series with per-VM ones.
// tests/monitoring/ runs promtool and a real Prometheus on a real tmemd.
#include "host-agent/control/metrics_exposition.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "host-agent/agent.h"
#include "host-agent/control/prometheus_text.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

constexpr MetricFamily kA{"test_a_total", MetricType::kCounter, "A things."};
constexpr MetricFamily kB{"test_b_bytes", MetricType::kGauge, "B bytes."};

TEST(PrometheusTextTest, KeepsEachFamilyWholeWhateverTheOrder) {
  PrometheusText t;
  t.Add(kA, {{"vm", "x"}}, uint64_t{1});
  t.Add(kB, {{"vm", "x"}}, 2.5);
  t.Add(kA, {{"vm", "y"}}, uint64_t{3});
  t.Add(kB, {{"vm", "y"}}, uint64_t{4});
  EXPECT_EQ(t.Render(),
            "# HELP test_a_total A things.\n"
            "# TYPE test_a_total counter\n"
            "test_a_total{vm=\"x\"} 1\n"
            "test_a_total{vm=\"y\"} 3\n"
            "# HELP test_b_bytes B bytes.\n"
            "# TYPE test_b_bytes gauge\n"
            "test_b_bytes{vm=\"x\"} 2.5\n"
            "test_b_bytes{vm=\"y\"} 4\n");
  EXPECT_EQ(t.conflicts(), 0);
}

TEST(PrometheusTextTest, EscapesLabelValuesAndHelp) {
  PrometheusText t;
  constexpr MetricFamily kHelp{"test_c", MetricType::kGauge,
                               "back\\slash\nnewline"};
  t.Add(kHelp, {{"vm", "a\"b\\c\nd"}, {"k", ""}}, uint64_t{0});
  EXPECT_EQ(t.Render(),
            "# HELP test_c back\\\\slash\\nnewline\n"
            "# TYPE test_c gauge\n"
            "test_c{vm=\"a\\\"b\\\\c\\nd\",k=\"\"} 0\n");
}

TEST(PrometheusTextTest, FormatsDoublesExactlyAndSpecialValuesAsTheFormatSays) {
  PrometheusText t;
  t.Add(kB, {{"v", "tenth"}}, 0.1);
  t.Add(kB, {{"v", "big"}}, 17179869184.0);  // 16 GiB, > 10 digits
  t.Add(kB, {{"v", "nan"}}, std::nan(""));
  t.Add(kB, {{"v", "inf"}}, HUGE_VAL);
  t.Add(kB, {{"v", "max"}}, UINT64_MAX);
  const std::string r = t.Render();
  EXPECT_NE(r.find("{v=\"tenth\"} 0.1\n"), std::string::npos) << r;
  EXPECT_NE(r.find("{v=\"big\"} 17179869184\n"), std::string::npos) << r;
  EXPECT_NE(r.find("{v=\"nan\"} NaN\n"), std::string::npos) << r;
  EXPECT_NE(r.find("{v=\"inf\"} +Inf\n"), std::string::npos) << r;
  EXPECT_NE(r.find("{v=\"max\"} 18446744073709551615\n"), std::string::npos)
      << r;
}

TEST(PrometheusTextTest, ARedefinedFamilyIsRefusedAndCounted) {
  PrometheusText t;
  t.Add(kA, {}, uint64_t{1});
  t.Add({"test_a_total", MetricType::kGauge, "A things."}, {}, uint64_t{2});
  t.Add({"test_a_total", MetricType::kCounter, "Other help."}, {}, uint64_t{3});
  EXPECT_EQ(t.conflicts(), 2);
  EXPECT_EQ(t.Render(),
            "# HELP test_a_total A things.\n# TYPE test_a_total counter\n"
            "test_a_total 1\n");
}

// The naming rules every family must keep (Prometheus naming practice, and
// what promtool check metrics lints).
// (No std::regex: GCC 12 warns inside <regex> under ASan, -Werror.)
bool IsMetricName(std::string_view n) {
  if (n.substr(0, 5) != "tmem_" || n.size() == 5) return false;
  for (const char c : n) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
      return false;
    }
  }
  return true;
}

void ExpectWellNamed(const MetricFamily& f, const std::string& what) {
  EXPECT_TRUE(IsMetricName(f.name)) << what << ": " << f.name;
  EXPECT_FALSE(f.help.empty()) << what << " " << f.name;
  const bool total =
      f.name.size() > 6 && f.name.substr(f.name.size() - 6) == "_total";
  EXPECT_EQ(total, f.type == MetricType::kCounter) << f.name;
  for (const char* abbreviation : {"_ns", "_ms", "_us", "_sec", "_fraction"}) {
    EXPECT_EQ(std::string(f.name).find(abbreviation), std::string::npos)
        << f.name << ": use base units (_seconds, _ratio)";
  }
}

TEST(MetricsExpositionTest, EveryCounterHasAWellNamedFamilyAndItsOwnSeries) {
  // (family, label value) -> counter: two counters never share a series.
  std::map<std::pair<std::string, std::string>, std::string> series;
  std::set<std::string> vm_families;
  std::set<std::string> host_families;
  auto check = [&](const CounterSeries& s, const std::string& what) {
    ExpectWellNamed(s.vm_family, what);
    EXPECT_EQ(s.label.empty(), s.label_value.empty()) << what;
    EXPECT_NE(s.label, "vm") << what;
    const auto key = std::make_pair(std::string(s.vm_family.name),
                                    std::string(s.label_value));
    EXPECT_TRUE(series.emplace(key, what).second)
        << what << " shares " << key.first << "{" << key.second << "} with "
        << series[key];
    vm_families.insert(std::string(s.vm_family.name));
    if (!s.host_family.name.empty()) {
      ExpectWellNamed(s.host_family, what);
      EXPECT_EQ(s.host_family.type, s.vm_family.type) << what;
      host_families.insert(std::string(s.host_family.name));
    }
  };
  for (int i = 0; i < kNumCounters; ++i) {
    const auto c = static_cast<Counter>(i);
    const CounterSeries s = StoreCounterSeries(c);
    check(s, "store counter " + std::string(CounterName(c)));
    // Host-wide counters are exported (they include removed VMs); host
    // gauges would only be the sum of the VMs' and are not.
    EXPECT_EQ(s.host_family.name.empty(), CounterIsGauge(c)) << CounterName(c);
  }
  for (int i = 0; i < kNumValveCounters; ++i) {
    const auto c = static_cast<ValveCounter>(i);
    check(ValveCounterSeries(c),
          "valve counter " + std::string(ValveCounterName(c)));
  }
  for (int i = 0; i < kNumChannelCounters; ++i) {
    const auto c = static_cast<ChannelCounter>(i);
    check(ChannelCounterSeries(c),
          "channel counter " + std::string(ChannelCounterName(c)));
  }
  for (const std::string& h : host_families) {
    EXPECT_EQ(vm_families.count(h), 0u) << h << " is both per-VM and host";
  }
}

struct ParsedFamily {
  int help = 0;
  int type = 0;
  std::string type_name;
  int unlabelled = 0;  // samples without a vm label
  int per_vm = 0;
  int first_sample_line = -1;
  int last_sample_line = -1;
  int samples = 0;
};

std::map<std::string, ParsedFamily> Parse(const std::string& text) {
  std::map<std::string, ParsedFamily> out;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.rfind("# HELP ", 0) == 0) {
      out[line.substr(7, line.find(' ', 7) - 7)].help++;
    } else if (line.rfind("# TYPE ", 0) == 0) {
      const size_t sp = line.find(' ', 7);
      ParsedFamily& f = out[line.substr(7, sp - 7)];
      f.type++;
      f.type_name = line.substr(sp + 1);
    } else if (const size_t end = line.find_first_of("{ ");
               !line.empty() && line[0] != '#' && end != std::string::npos &&
               IsMetricName(line.substr(0, end)) &&
               line.find(' ', line.find('}') == std::string::npos
                                  ? end
                                  : line.find('}')) != std::string::npos) {
      ParsedFamily& f = out[line.substr(0, end)];
      if (f.first_sample_line < 0) f.first_sample_line = n;
      f.last_sample_line = n;
      f.samples++;
      const size_t close = line.find('}');
      const std::string labels =
          line[end] == '{' ? line.substr(end, close - end) : "";
      if (labels.find("vm=\"") != std::string::npos) {
        f.per_vm++;
      } else {
        f.unlabelled++;
      }
    } else {
      ADD_FAILURE() << "line " << n << " is no HELP, TYPE or sample: " << line;
    }
  }
  return out;
}

TEST(MetricsExpositionTest, TheAgentsExpositionIsWellFormed) {
  tmem::testing::TempDir tmp("tmem-exposition-test");
  AgentOptions o;
  o.socket_dir = tmp.path();
  o.store.memory_cap_bytes = 16 << 20;
  o.store.address_space_bytes = 64 << 20;
  o.workers = 1;
  o.run_valve_ticker = false;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create(o);
  ASSERT_TRUE(agent.ok()) << agent.status();
  VmPolicy quota;
  quota.quota_bytes = 4 << 20;
  quota.swap_quota_bytes = 2 << 20;
  ASSERT_TRUE((*agent)->AddVm("vm1", VmPolicy{}).ok());
  ASSERT_TRUE((*agent)->AddVm("vm2", quota).ok());

  PrometheusText text;
  AppendAgentMetrics(**agent, text);
  EXPECT_EQ(text.conflicts(), 0);
  const std::string r = text.Render();
  const std::map<std::string, ParsedFamily> families = Parse(r);
  ASSERT_GT(families.size(), 40u) << r;
  for (const auto& [name, f] : families) {
    EXPECT_EQ(f.help, 1) << name;
    EXPECT_EQ(f.type, 1) << name;
    EXPECT_GT(f.samples, 0) << name;
    // Contiguous: the format refuses a family split in two.
    EXPECT_EQ(f.last_sample_line - f.first_sample_line + 1, f.samples) << name;
    EXPECT_TRUE(f.unlabelled == 0 || f.per_vm == 0)
        << name << " mixes host-wide and per-VM series";
    EXPECT_EQ(name.ends_with("_total"), f.type_name == "counter") << name;
  }
  // Per-VM families carry both VMs; quota only where one is set.
  EXPECT_EQ(families.at("tmem_puts_total").per_vm, 8);  // 4 kinds x 2 VMs
  EXPECT_EQ(families.at("tmem_host_puts_total").unlabelled, 4);
  EXPECT_NE(r.find("tmem_vm_quota_bytes{vm=\"vm2\"} 4194304\n"),
            std::string::npos)
      << r;
  EXPECT_EQ(r.find("tmem_vm_quota_bytes{vm=\"vm1\"}"), std::string::npos);
  EXPECT_NE(r.find("tmem_vm_swap_quota_bytes{vm=\"vm2\"} 2097152\n"),
            std::string::npos)
      << r;
  EXPECT_EQ(r.find("tmem_vm_swap_quota_bytes{vm=\"vm1\"}"), std::string::npos);
  EXPECT_NE(r.find("tmem_memory_cap_bytes 16777216\n"), std::string::npos);
  EXPECT_NE(r.find("tmem_vms 2\n"), std::string::npos);
  EXPECT_NE(r.find("tmem_vm_connected{vm=\"vm1\"} 0\n"), std::string::npos);
  EXPECT_EQ(RenderPrometheus(**agent).substr(0, 40), r.substr(0, 40));
}

}  // namespace
}  // namespace tmem
