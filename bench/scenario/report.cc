#include "bench/scenario/report.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_support.h"
#include "bench/method.h"
#include "bench/scenario/deferred_report.h"
#include "bench/scenario/host_phases.h"
#include "bench/scenario/processes.h"

namespace tmem::scenario {

namespace {

namespace fs = std::filesystem;

// Rows (report_rows.h): per (scenario, mode, vm), medians over rounds.

const std::vector<std::string>& Metrics() {
  static const std::vector<std::string> k = {"mb_per_s",
                                             "cpu_us_per_page",
                                             "vs_off",
                                             "vs_none",
                                             "hit_ratio",
                                             "tmemd_cpu_s",
                                             "tmemd_cpu_frac",
                                             "tmemd_total_cpu_s",
                                             "pages",
                                             "valve_compressed",
                                             "valve_raw",
                                             "valve_dropped_cpu",
                                             "valve_dropped_reuse",
                                             "valve_dropped_memory",
                                             "valve_dropped_off",
                                             "admission",
                                             "reuse",
                                             "valve_cpu_ns",
                                             "guest_puts_sent",
                                             "guest_puts_skipped_by_hint",
                                             "tmem_gets",
                                             "tmem_hits",
                                             "disk_reads",
                                             "pages_read"};
  static const std::vector<std::string> all = [] {
    std::vector<std::string> v = k;
    for (const std::string& d : DeferredMetricNames()) v.push_back(d);
    return v;
  }();
  return all;
}

double MetricOf(const RunResult& r, const VmResult& v, const std::string& k) {
  if (k == "tmemd_cpu_s") return r.tmemd_cpu_s;
  if (k == "tmemd_cpu_frac") return r.tmemd_cpu_frac;
  if (k == "tmemd_total_cpu_s") return r.tmemd_total_cpu_s;
  if (auto it = r.host.find(k); it != r.host.end()) return it->second;
  if (v.tmemd.count(k) != 0) return Num(v.tmemd, k);
  return Num(v.guest, k);
}

const RunResult* FindRun(const std::vector<RunResult>& runs,
                         const std::string& scenario, const std::string& mode,
                         int round) {
  for (const RunResult& r : runs) {
    if (r.ok && r.scenario == scenario && r.mode == mode && r.round == round) {
      return &r;
    }
  }
  return nullptr;
}

const VmResult* FindVm(const RunResult* r, const std::string& vm) {
  if (r == nullptr) return nullptr;
  for (const VmResult& v : r->vms) {
    if (v.vm == vm) return &v;
  }
  return nullptr;
}

}  // namespace

std::vector<Row> Aggregate(const Config& c, const std::vector<RunResult>& runs,
                           int rounds) {
  std::vector<Row> rows;
  for (const std::string& s : c.scenarios) {
    for (const std::string& mode : c.modes) {
      for (const std::string& vm : VmsOf(s)) {
        Row row{s, mode, vm, 0, {}};
        std::map<std::string, std::vector<double>> vals;
        for (int round = 0; round < rounds; ++round) {
          const RunResult* r = FindRun(runs, s, mode, round);
          const VmResult* v = FindVm(r, vm);
          if (v == nullptr) continue;
          ++row.runs;
          for (const std::string& k : Metrics()) {
            if (k == "vs_off" || k == "vs_none") continue;
            vals[k].push_back(MetricOf(*r, *v, k));
          }
          // Throughput relative to "off" and "none" of the same round:
          // paired, so a noisy round moves both.
          for (const char* base : {"off", "none"}) {
            const VmResult* b = FindVm(FindRun(runs, s, base, round), vm);
            if (b != nullptr && Num(b->guest, "mb_per_s") > 0) {
              vals[absl::StrCat("vs_", base)].push_back(
                  Num(v->guest, "mb_per_s") / Num(b->guest, "mb_per_s"));
            }
          }
        }
        for (const std::string& k : Metrics())
          row.m[k] = bench::Median(vals[k]);
        rows.push_back(std::move(row));
      }
    }
  }
  return rows;
}

std::vector<Target> Targets(const Config& c, const std::vector<Row>& rows,
                            const std::vector<RunResult>& runs, int rounds,
                            const DecideCost& dc) {
  std::vector<Target> t;
  auto m = [&](const std::string& s, const std::string& mode,
               const std::string& vm, const std::string& k) {
    const Row* r = FindRow(rows, s, mode, vm);
    return r == nullptr ? std::nan("") : r->m.at(k);
  };
  {
    // Adaptive's stream throughput over `base`'s, with both MB/s figures.
    const auto adaptive_over = [&](const std::string& base,
                                   const std::string& base_label) {
      Target x;
      x.name =
          "stream (host CPU saturated): adaptive / " + base + " throughput";
      x.value = m("stream", "adaptive", "stream", "vs_" + base);
      x.measured = Fmt(x.value, "%.3fx") + " (" +
                   Fmt(m("stream", "adaptive", "stream", "mb_per_s"), "%.0f") +
                   " vs " +
                   Fmt(m("stream", base, "stream", "mb_per_s"), "%.0f") +
                   " MB/s" + base_label;
      return x;
    };
    Target x = adaptive_over("off", ")");
    x.goal = ">= 0.97x";
    x.bound = 0.97;
    t.push_back(x);
    // The baseline is tmemd's mode off (the VM's tmem turned off);
    // "none" (no frontend at all) also counts the guest library's work per
    // page-cache miss, mostly the sent-keys filter's cache misses.
    Target z = adaptive_over(
        "none", " without tmem): the frontend's own cost included");
    z.goal = "(shown)";
    z.info = true;
    t.push_back(z);
    Target y;
    y.name = "stream (host CPU saturated): always / off throughput";
    y.value = m("stream", "always", "stream", "vs_off");
    y.measured = Fmt(y.value, "%.3fx") + " (" +
                 Fmt(m("stream", "always", "stream", "mb_per_s"), "%.0f") +
                 " MB/s): the zcache-like degradation";
    y.goal = "(shown)";
    y.info = true;
    t.push_back(y);
  }
  {
    Target x;
    x.name = "reread: adaptive's share of always's hit-ratio benefit";
    const double off = m("reread", "off", "reread", "hit_ratio");
    const double al = m("reread", "always", "reread", "hit_ratio");
    const double ad = m("reread", "adaptive", "reread", "hit_ratio");
    x.value = (al - off) > 0 ? (ad - off) / (al - off) : std::nan("");
    x.measured = Fmt(x.value, "%.3fx") + " (hit ratio off " + Fmt(off) +
                 ", always " + Fmt(al) + ", adaptive " + Fmt(ad) + ")";
    x.goal = ">= 0.9x";
    x.bound = 0.9;
    t.push_back(x);
  }
  {
    Target x;
    x.name = "both: reread VM hit ratio with streamer / alone (adaptive)";
    const double both = m("both", "adaptive", "reread", "hit_ratio");
    const double alone = m("reread", "adaptive", "reread", "hit_ratio");
    x.value = alone > 0 ? both / alone : std::nan("");
    x.measured =
        Fmt(x.value, "%.3fx") + " (" + Fmt(both) + " vs " + Fmt(alone) + ")";
    x.goal = ">= 0.9x";
    x.bound = 0.9;
    t.push_back(x);
  }
  {
    Target x;
    x.name = "tmemd CPU / (wall x cores), adaptive, worst run";
    double worst = std::nan("");
    std::string where;
    for (const RunResult& r : runs) {
      if (!r.ok || r.mode != "adaptive") continue;
      if (std::isnan(worst) || r.tmemd_cpu_frac > worst) {
        worst = r.tmemd_cpu_frac;
        where = absl::StrCat(r.scenario, " round ", r.round);
      }
    }
    x.value = worst * 100;
    x.measured = Fmt(x.value, "%.1f%%") + " (" + where + "; budget " +
                 Fmt(c.cpu_budget, "%.0f") + "%)";
    x.goal = "<= " + Fmt(c.cpu_budget + 5, "%.0f") + "%";
    x.bound = c.cpu_budget + 5;
    x.at_least = false;
    t.push_back(x);
  }
  {
    Target x;
    x.name = "valve Decide / compressing put (in-process)";
    x.value = dc.rounds > 0 ? dc.ratio * 100 : std::nan("");
    x.measured = Fmt(x.value, "%.2f%%") + " (" + Fmt(dc.decide_ns, "%.1f") +
                 " ns vs " + Fmt(dc.put_ns, "%.0f") + " ns)";
    x.goal = "< 2%";
    x.bound = 2;
    x.at_least = false;
    t.push_back(x);
  }
  const WorstOf worst = [&runs](const std::string& s, const std::string& mode,
                                const std::string& metric) {
    double w = std::nan("");
    for (const RunResult& r : runs) {
      if (!r.ok || r.scenario != s || r.mode != mode) continue;
      auto it = r.host.find(metric);
      if (it == r.host.end() || std::isnan(it->second)) continue;
      if (std::isnan(w) || it->second > w) w = it->second;
    }
    return w;
  };
  for (Target& x :
       DeferredTargets(c.scenarios, c.modes, rows, worst, c.cpu_budget)) {
    t.push_back(std::move(x));
  }
  (void)rounds;
  return t;
}

std::string Table(const std::vector<Row>& rows) {
  std::string out = absl::StrFormat(
      "%-7s %-8s %-7s %7s %7s %7s %7s %7s %8s %7s %9s %9s %9s %9s %9s %9s "
      "%6s\n",
      "scen", "mode", "vm", "MB/s", "us/page", "vs off", "vs none", "hit %",
      "tmemd s", "CPU %", "pages", "compr", "raw", "drop cpu", "drop reu",
      "drop oth", "admit");
  for (const Row& r : rows) {
    auto g = [&](const char* k) { return r.m.at(k); };
    absl::StrAppendFormat(
        &out,
        "%-7s %-8s %-7s %7s %7s %7s %7s %7s %8s %7s %9s %9s %9s %9s %9s %9s "
        "%6s\n",
        r.scenario, r.mode, r.vm, Fmt(g("mb_per_s"), "%.0f"),
        Fmt(g("cpu_us_per_page"), "%.2f"), Fmt(g("vs_off"), "%.2fx"),
        Fmt(g("vs_none"), "%.2fx"), Fmt(g("hit_ratio") * 100, "%.1f"),
        Fmt(g("tmemd_cpu_s"), "%.2f"), Fmt(g("tmemd_cpu_frac") * 100, "%.1f"),
        Fmt(g("pages"), "%.0f"), Fmt(g("valve_compressed"), "%.0f"),
        Fmt(g("valve_raw"), "%.0f"), Fmt(g("valve_dropped_cpu"), "%.0f"),
        Fmt(g("valve_dropped_reuse"), "%.0f"),
        Fmt(g("valve_dropped_memory") + g("valve_dropped_off"), "%.0f"),
        Fmt(g("admission") / 65536 * 100, "%.1f%%"));
  }
  return out;
}

// The compactor's table (deferred_report.h), when it has anything to say.
std::string DeferredSection(const Config& c, const std::vector<Row>& rows) {
  const std::string table = DeferredTable(c.scenarios, c.modes, rows);
  if (table.empty()) return "";
  return absl::StrCat(
      "\ndeferred compression: ratio: host compression ratio in "
      "steady state; compacted / <=2s %: pages the compactor compressed and "
      "the share within 2 s of their put (of compacted + no room + "
      "overflows + the valve's raw decisions); skipped / stale: pages gone "
      "before their turn; idle s / "
      "normal s: compactor CPU by class; busy / idle CPU: tmemd's CPU of "
      "the host in the busy / idle phases (phases only)\n\n",
      table);
}

std::string Markdown(const std::vector<Row>& rows) {
  std::string out =
      "| scenario | mode | VM | MB/s | guest CPU us/page | vs off | vs none | "
      "tmem hit % | "
      "tmemd CPU s | "
      "tmemd CPU % of host | pages stored | compressed | raw | dropped cpu | "
      "dropped reuse | dropped other | admission |\n"
      "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: | "
      "---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (const Row& r : rows) {
    auto g = [&](const char* k) { return r.m.at(k); };
    absl::StrAppend(
        &out, "| ", r.scenario, " | ", r.mode, " | ", r.vm, " | ",
        Fmt(g("mb_per_s"), "%.0f"), " | ", Fmt(g("cpu_us_per_page"), "%.2f"),
        " | ", Fmt(g("vs_off"), "%.2fx"), " | ", Fmt(g("vs_none"), "%.2fx"),
        " | ", Fmt(g("hit_ratio") * 100, "%.1f"), " | ",
        Fmt(g("tmemd_cpu_s"), "%.2f"), " | ",
        Fmt(g("tmemd_cpu_frac") * 100, "%.1f"), " | ", Fmt(g("pages"), "%.0f"),
        " | ", Fmt(g("valve_compressed"), "%.0f"), " | ",
        Fmt(g("valve_raw"), "%.0f"), " | ", Fmt(g("valve_dropped_cpu"), "%.0f"),
        " | ", Fmt(g("valve_dropped_reuse"), "%.0f"), " | ",
        Fmt(g("valve_dropped_memory") + g("valve_dropped_off"), "%.0f"), " | ",
        Fmt(g("admission") / 65536 * 100, "%.1f%%"), " |\n");
  }
  return out;
}

std::string TargetsText(const std::vector<Target>& t) {
  std::string out;
  for (const Target& x : t) {
    absl::StrAppendFormat(&out, "  %-5s %-68s %-9s %s\n", x.Verdict(), x.name,
                          x.goal, x.measured);
  }
  return out;
}

std::string Csv(const std::vector<Row>& rows) {
  std::string out = "scenario,mode,vm,runs";
  for (const std::string& k : Metrics()) absl::StrAppend(&out, ",", k);
  out += "\n";
  for (const Row& r : rows) {
    absl::StrAppend(&out, r.scenario, ",", r.mode, ",", r.vm, ",", r.runs);
    for (const std::string& k : Metrics()) {
      absl::StrAppend(&out, ",", Fmt(r.m.at(k), "%.6g"));
    }
    out += "\n";
  }
  return out;
}

std::string RunsCsv(const std::vector<RunResult>& runs) {
  std::string out = "scenario,mode,round,vm,ok,hogs,wall_s";
  for (const std::string& k : Metrics()) {
    if (k != "vs_off" && k != "vs_none") absl::StrAppend(&out, ",", k);
  }
  out += "\n";
  for (const RunResult& r : runs) {
    for (const VmResult& v : r.vms) {
      absl::StrAppend(&out, r.scenario, ",", r.mode, ",", r.round, ",", v.vm,
                      ",", r.ok ? 1 : 0, ",", r.hogs, ",",
                      Fmt(r.wall_s, "%.3f"));
      for (const std::string& k : Metrics()) {
        if (k != "vs_off" && k != "vs_none") {
          absl::StrAppend(&out, ",", Fmt(MetricOf(r, v, k), "%.6g"));
        }
      }
      out += "\n";
    }
  }
  return out;
}

std::string TargetsCsv(const std::vector<Target>& t) {
  std::string out = "target,goal,value,verdict,measured\n";
  for (const Target& x : t) {
    absl::StrAppend(&out, "\"", x.name, "\",\"", x.goal, "\",",
                    Fmt(x.value, "%.6g"), ",", x.Verdict(), ",\"", x.measured,
                    "\"\n");
  }
  return out;
}

namespace {

// The unit after the first number in `text` ("0.97x" -> "x", "<= 30%" ->
// "%", "24.7% (...)" -> "%"); empty when there is none.
std::string UnitAfterNumber(const std::string& text) {
  const size_t digit = text.find_first_of("0123456789");
  if (digit == std::string::npos) return "";
  const size_t end = text.find_first_not_of("0123456789.", digit);
  if (end == std::string::npos) return "";
  const size_t stop = text.find_first_of(" (),;", end);
  return text.substr(end, stop == std::string::npos ? stop : stop - end);
}

}  // namespace

std::vector<bench::ResultRecord> TargetRecords(const std::vector<Target>& t) {
  std::vector<bench::ResultRecord> rows;
  for (const Target& x : t) {
    bench::ResultRecord r;
    r.name = x.name;
    r.value = x.value;
    r.unit = UnitAfterNumber(x.goal);
    if (r.unit.empty()) r.unit = UnitAfterNumber(x.measured);
    r.goal = bench::GoalSymbol(x.GoalKind());
    if (!x.info) r.target = x.bound;
    r.verdict = x.Verdict();
    r.note = x.measured;
    rows.push_back(std::move(r));
  }
  bench::AssignRowIds(rows);
  return rows;
}

// Two panels: throughput and tmem hit ratio per scenario/VM, one bar per
// mode. Returns false when gnuplot is missing or fails.
bool Plot(const Config& c, const std::vector<Row>& rows) {
  const fs::path dir(c.out);
  std::string dat = "label";
  for (const std::string& mode : c.modes) absl::StrAppend(&dat, " ", mode);
  for (const std::string& mode : c.modes) absl::StrAppend(&dat, " hit_", mode);
  dat += "\n";
  for (const std::string& s : c.scenarios) {
    for (const std::string& vm : VmsOf(s)) {
      absl::StrAppend(&dat, "\"", s, ":", vm, "\"");
      for (const std::string& mode : c.modes) {
        const Row* r = FindRow(rows, s, mode, vm);
        absl::StrAppend(&dat, " ", Fmt(r ? r->m.at("mb_per_s") : 0, "%.1f"));
      }
      for (const std::string& mode : c.modes) {
        const Row* r = FindRow(rows, s, mode, vm);
        absl::StrAppend(&dat, " ",
                        Fmt(r ? r->m.at("hit_ratio") * 100 : 0, "%.1f"));
      }
      dat += "\n";
    }
  }
  if (!bench::WriteFile((dir / "plot.dat").string(), dat)) return false;
  const size_t n = c.modes.size();
  std::string gp = absl::StrCat(
      "set terminal pngcairo size 1100,480 font 'sans,10'\n"
      "set output '",
      (dir / "scenario.png").string(),
      "'\n"
      "set multiplot layout 1,2 title 'tmemd scenario benchmark (2011 "
      "report): medians of ",
      c.rounds, " rounds'\n",
      "set style data histograms\nset style histogram clustered gap 1\n"
      "set style fill solid 0.8 border -1\nset key top left\n"
      "set grid ytics\nset yrange [0:*]\nset xtics rotate by -20\n"
      "set ylabel 'application MB/s'\nset title 'throughput'\n"
      "plot ");
  for (size_t i = 0; i < n; ++i) {
    absl::StrAppend(&gp, i == 0 ? "" : ", ", "'", (dir / "plot.dat").string(),
                    "' using ", i + 2, (i == 0 ? ":xtic(1)" : ""),
                    " title columnheader");
  }
  absl::StrAppend(&gp,
                  "\nset ylabel 'tmem hit ratio %'\nset title 'tmem hit "
                  "ratio (gets that hit)'\nset yrange [0:105]\nplot ");
  for (size_t i = 0; i < n; ++i) {
    absl::StrAppend(&gp, i == 0 ? "" : ", ", "'", (dir / "plot.dat").string(),
                    "' using ", i + 2 + n, (i == 0 ? ":xtic(1)" : ""),
                    " title '", c.modes[i], "'");
  }
  gp += "\nunset multiplot\n";
  const std::string gp_path = (dir / "scenario.gp").string();
  if (!bench::WriteFile(gp_path, gp)) return false;
  const std::string log = (dir / "gnuplot.log").string();
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const pid_t pid = Spawn({"/usr/bin/gnuplot", gp_path}, fd, fd);
  close(fd);
  if (pid < 0) return false;
  struct rusage ru {};
  const int status = WaitWithTimeout(pid, std::chrono::seconds(60), &ru);
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace tmem::scenario
