#include "bench/scenario/deferred_report.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tmem::scenario {
namespace {

bool Has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// The VM whose row carries a scenario's run-level metrics.
std::string VmOf(const std::string& scenario) {
  return scenario == "stream" ? "stream" : "reread";
}

}  // namespace

const std::vector<std::string>& DeferredMetricNames() {
  static const std::vector<std::string> k = {
      "compression_ratio",   "compact_compressed",  "compact_within_2s",
      "compact_owed",        "compact_share_2s",    "compact_kept_raw",
      "compact_no_room",     "compact_overflows",   "compact_skipped",
      "compact_stale",       "compact_idle_cpu_s",  "compact_normal_cpu_s",
      "busy_tmemd_cpu_frac", "idle_tmemd_cpu_frac", "phase_switches"};
  return k;
}

std::map<std::string, double> DeferredMetrics(const TmemdLog& log,
                                              const PhaseTotals* phases,
                                              int cpus) {
  std::map<std::string, double> m;
  const Fields& k = log.compactor;
  const double nan = std::nan("");
  m["compression_ratio"] = log.compression_ratio;
  const double compressed = Num(k, "compressed");
  const double within = Num(k, "within_2s");
  // What the compactor owed: every page it compressed (late ones count
  // against the share), and the queued pages it could not (no room, queue
  // full). Pages read back or invalidated before their turn are not owed
  // (skipping them is the point), nor poorly compressible ones (kept
  // raw). Puts the valve decided raw for want of CPU are queued too with
  // deferred compression (Valve::DecidePut returns kDefer for them), so
  // they are in these counts already: adding valve_raw would count each
  // such page twice.
  const double owed =
      compressed + Num(k, "no_room") + Num(k, "queue_overflows");
  m["compact_owed"] = owed;
  m["compact_compressed"] = compressed;
  m["compact_within_2s"] = within;
  // Deferred off (or no compactor line): the share means nothing.
  const bool deferred = !k.empty() && Num(k, "deferred") != 0;
  m["compact_share_2s"] = deferred && owed > 0 ? within / owed : nan;
  m["compact_kept_raw"] = Num(k, "kept_raw");
  m["compact_no_room"] = Num(k, "no_room");
  m["compact_overflows"] = Num(k, "queue_overflows");
  m["compact_skipped"] = Num(k, "skipped_read") +
                         Num(k, "skipped_invalidated") +
                         Num(k, "skipped_evicted") + Num(k, "skipped_replaced");
  m["compact_stale"] = Num(k, "stale");
  m["compact_idle_cpu_s"] = Num(k, "idle_cpu_ns") / 1e9;
  m["compact_normal_cpu_s"] = Num(k, "normal_cpu_ns") / 1e9;
  m["busy_tmemd_cpu_frac"] = nan;
  m["idle_tmemd_cpu_frac"] = nan;
  m["phase_switches"] = nan;
  if (phases != nullptr) {
    if (phases->busy_wall_s > 0) {
      m["busy_tmemd_cpu_frac"] =
          phases->busy_cpu_s / (phases->busy_wall_s * cpus);
    }
    if (phases->idle_wall_s > 0) {
      m["idle_tmemd_cpu_frac"] =
          phases->idle_cpu_s / (phases->idle_wall_s * cpus);
    }
    m["phase_switches"] = phases->switches;
  }
  return m;
}

std::vector<Target> DeferredTargets(const std::vector<std::string>& scenarios,
                                    const std::vector<std::string>& modes,
                                    const std::vector<Row>& rows,
                                    const WorstOf& worst,
                                    double cpu_budget_percent) {
  std::vector<Target> t;
  if (!Has(modes, "deferred")) return t;
  auto m = [&](const std::string& s, const std::string& mode,
               const std::string& metric) {
    return RowMetric(rows, s, mode, VmOf(s), metric);
  };
  // Each target for deferred, then for the synchronous valve.
  const std::vector<std::pair<std::string, std::string>> valves = {
      {"deferred", "deferred"}, {"adaptive", "synchronous adaptive"}};
  if (Has(scenarios, "idle")) {
    Target x;
    x.name = "idle: deferred pages compressed within 2 s of their put";
    x.value = m("idle", "deferred", "compact_share_2s") * 100;
    x.measured =
        Fmt(x.value, "%.1f%%") + " (" +
        Fmt(m("idle", "deferred", "compact_within_2s"), "%.0f") + " of " +
        Fmt(m("idle", "deferred", "compact_owed"), "%.0f") + ": compressed " +
        Fmt(m("idle", "deferred", "compact_compressed"), "%.0f") +
        " (the valve's puts queued raw for want of CPU: " +
        Fmt(m("idle", "deferred", "valve_raw"), "%.0f") + "), overflows " +
        Fmt(m("idle", "deferred", "compact_overflows"), "%.0f") + ", no room " +
        Fmt(m("idle", "deferred", "compact_no_room"), "%.0f") + ")";
    x.goal = ">= 95%";
    x.bound = 95;
    t.push_back(x);
    for (const auto& [mode, label] : valves) {
      if (!Has(modes, mode) || !Has(modes, "always")) continue;
      Target y;
      y.name = "idle: compression ratio, " + label + " / always";
      const double own = m("idle", mode, "compression_ratio");
      const double always = m("idle", "always", "compression_ratio");
      y.value = always > 0 ? own / always : std::nan("");
      y.measured = Fmt(y.value, "%.3fx") + " (" + Fmt(own, "%.2f") + " vs " +
                   Fmt(always, "%.2f") + ")";
      y.goal = ">= 0.95x";
      y.bound = 0.95;
      t.push_back(y);
    }
  }
  if (Has(scenarios, "phases")) {
    if (Has(modes, "adaptive")) {
      Target x;
      x.name = "phases (busy/idle every 2 s): hit ratio deferred / adaptive";
      const double d = m("phases", "deferred", "hit_ratio");
      const double a = m("phases", "adaptive", "hit_ratio");
      x.value = a > 0 ? d / a : std::nan("");
      x.measured = Fmt(x.value, "%.3fx") + " (" + Fmt(d) + " vs " + Fmt(a) +
                   " synchronous)";
      x.goal = ">= 1.00x";
      x.bound = 1.0;
      t.push_back(x);
    }
    for (const auto& [mode, label] : valves) {
      if (!Has(modes, mode)) continue;
      Target y;
      y.name = "phases: tmemd CPU in busy phases, " + label + ", worst run";
      y.value = worst("phases", mode, "busy_tmemd_cpu_frac") * 100;
      y.measured =
          Fmt(y.value, "%.1f%%") + " of the host (idle phases " +
          Fmt(m("phases", mode, "idle_tmemd_cpu_frac") * 100, "%.1f%%") +
          " median)";
      y.goal = "<= " + Fmt(cpu_budget_percent, "%.0f") + "%";
      y.bound = cpu_budget_percent;
      y.at_least = false;
      t.push_back(y);
    }
  }
  if (Has(scenarios, "stream") && Has(modes, "none")) {
    for (const auto& [mode, label] : valves) {
      if (!Has(modes, mode)) continue;
      Target y;
      y.name = "stream (host CPU saturated): " + label + " / none throughput";
      y.value = m("stream", mode, "vs_none");
      y.measured = Fmt(y.value, "%.3fx") + " (" +
                   Fmt(m("stream", mode, "mb_per_s"), "%.0f") + " vs " +
                   Fmt(m("stream", "none", "mb_per_s"), "%.0f") + " MB/s)";
      y.goal = ">= 0.98x";
      y.bound = 0.98;
      t.push_back(y);
    }
  }
  return t;
}

std::string DeferredTable(const std::vector<std::string>& scenarios,
                          const std::vector<std::string>& modes,
                          const std::vector<Row>& rows) {
  if (!Has(modes, "deferred") && !Has(scenarios, "idle") &&
      !Has(scenarios, "phases")) {
    return "";
  }
  std::string out = absl::StrFormat(
      "%-7s %-8s %6s %9s %8s %9s %8s %8s %8s %8s %8s %8s %8s\n", "scen", "mode",
      "ratio", "compacted", "<=2s %", "kept raw", "overflow", "skipped",
      "stale", "idle s", "normal s", "busy CPU", "idle CPU");
  for (const std::string& s : scenarios) {
    for (const std::string& mode : modes) {
      if (mode == "none" || mode == "off") continue;
      const Row* r = FindRow(rows, s, mode, VmOf(s));
      if (r == nullptr) continue;
      auto g = [&](const char* k) {
        return RowMetric(rows, s, mode, VmOf(s), k);
      };
      absl::StrAppendFormat(
          &out, "%-7s %-8s %6s %9s %8s %9s %8s %8s %8s %8s %8s %8s %8s\n", s,
          mode, Fmt(g("compression_ratio"), "%.2f"),
          Fmt(g("compact_compressed"), "%.0f"),
          Fmt(g("compact_share_2s") * 100, "%.1f"),
          Fmt(g("compact_kept_raw"), "%.0f"),
          Fmt(g("compact_overflows"), "%.0f"),
          Fmt(g("compact_skipped"), "%.0f"), Fmt(g("compact_stale"), "%.0f"),
          Fmt(g("compact_idle_cpu_s"), "%.2f"),
          Fmt(g("compact_normal_cpu_s"), "%.2f"),
          Fmt(g("busy_tmemd_cpu_frac") * 100, "%.1f%%"),
          Fmt(g("idle_tmemd_cpu_frac") * 100, "%.1f%%"));
    }
  }
  return out;
}

}  // namespace tmem::scenario
