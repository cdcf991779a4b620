// tmem-isolation-bench: how much a hostile neighbour costs a well-behaved
// VM, in one run, as ratios. For each attack a fresh tmemd (all
// VMs on one worker: the worst case) serves a verified guest alone, then
// next to the attacker(s), then alone again; the ratio is its throughput
// (ops/s: gets, puts, invalidates) under attack over the mean of the two
// alone windows around it; with --cycles N (3 by default) attacked and
// alone windows alternate N times and the row is the cycle with the median
// ratio (all N ratios printed beside it), so one window's luck does not
// decide the verdict. The table also shows the flooders' largest
// all-in charge over their quota and the host's largest use over its cap,
// sampled every 50 ms over gRPC. Target (SPECIFICATION.md): ratio >= 0.8 for
// each attack, charge <= quota + 5%, cap never exceeded.
//
// The simulated guests are threads of this process: on a small host they
// compete with the neighbour and tmemd for the CPUs, which VMs with their
// own vCPUs under a hypervisor's per-VM bound (a cgroup's cpu.max or
// cpu.weight) would not. Each attack therefore runs twice: attackers
// "unbounded", and attackers at SCHED_IDLE (they get a CPU only when
// neither the neighbour nor tmemd wants it), the stand-in for that bound;
// both rows are printed. A second table says where the neighbour's time
// went in each window, from /proc/PID/task/TID/schedstat: its own CPU, its
// wait for a CPU (run queue), the rest blocked on tmemd; tmemd's worker
// CPU and run-queue wait; the worker CPU the valve charged each side; the
// attackers' CPU and run-queue wait.
//
// --results FILE records per attack and bound the ratio, the service-time
// ratio and whether the guarantees held in the results file
// (bench/results_file.h, section "isolation"; "isolation-smoke" for
// --smoke).
//
// Exit status: 1 if a guarantee broke (a mismatch, cap or quota exceeded,
// tmemd died) or the results file could not be written, never because of
// a ratio.
//   tmem-isolation-bench --tmemd build/release/host-agent/tmemd [--smoke]
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/method.h"
#include "bench/results_file.h"
#include "tests/hostile/hostile_harness.h"
#include "tests/temp_dir.h"

namespace tmem::hostile {
namespace {

using std::chrono::milliseconds;
constexpr uint64_t kMiB = 1ull << 20;

// A thread's scheduler statistics (/proc/PID/task/TID/schedstat): time on a
// CPU, time runnable but waiting for one, and how many times it ran.
struct Sched {
  int64_t run_ns = 0;
  int64_t wait_ns = 0;
  int64_t slices = 0;
  Sched& operator+=(const Sched& o) {
    run_ns += o.run_ns;
    wait_ns += o.wait_ns;
    slices += o.slices;
    return *this;
  }
  Sched operator-(const Sched& o) const {
    return {run_ns - o.run_ns, wait_ns - o.wait_ns, slices - o.slices};
  }
};

Sched ReadSched(pid_t pid, pid_t tid) {
  Sched s;
  if (tid <= 0) return s;
  std::ifstream in(absl::StrFormat("/proc/%d/task/%d/schedstat", pid, tid));
  in >> s.run_ns >> s.wait_ns >> s.slices;
  return in ? s : Sched{};
}

std::string ReadComm(pid_t pid, pid_t tid) {
  std::ifstream in(absl::StrFormat("/proc/%d/task/%d/comm", pid, tid));
  std::string comm;
  std::getline(in, comm);
  return comm;
}

// Everything a window is measured by, read at one moment.
struct Snapshot {
  std::chrono::steady_clock::time_point at;
  uint64_t ops = 0;
  uint64_t hits = 0;
  Sched neighbour;  // the verified guest's thread
  Sched attackers;  // every attacker thread, summed
  Sched workers;    // tmemd's worker threads ("tmem-worker*"), summed
  Sched tmemd;      // every tmemd thread, summed
  int64_t neighbour_charged_ns = 0;  // worker CPU the valve charged the VM
  int64_t attackers_charged_ns = 0;  // ... and the attackers' VMs, summed
  OpTimes kinds;                     // the neighbour's ops by kind, timed
};

struct Usage {
  double seconds = 0;
  double ops_per_s = 0;
  double hits_per_s = 0;
  Sched neighbour, attackers, workers, tmemd;
  int64_t neighbour_charged_ns = 0, attackers_charged_ns = 0;
  uint64_t ops = 0;
  OpTimes kinds;
};

int64_t ChargedNs(const Tmemd& tmemd, const std::string& vm) {
  absl::StatusOr<v1::VmDetail> d = tmemd.GetVm(vm);
  return d.ok() ? static_cast<int64_t>(d->valve().cpu_used_ns()) : 0;
}

Snapshot Take(const Tmemd& tmemd, const VerifiedGuest& guest,
              const std::vector<std::unique_ptr<RawAttacker>>& attackers,
              const std::vector<std::string>& attacker_vms) {
  Snapshot s;
  s.neighbour_charged_ns = ChargedNs(tmemd, "good");
  for (const std::string& vm : attacker_vms) {
    s.attackers_charged_ns += ChargedNs(tmemd, vm);
  }
  const pid_t self = getpid();
  s.neighbour = ReadSched(self, guest.tid());
  for (const auto& a : attackers) s.attackers += ReadSched(self, a->tid());
  std::error_code ec;
  const std::string task_dir = absl::StrFormat("/proc/%d/task", tmemd.pid());
  for (const auto& entry : std::filesystem::directory_iterator(task_dir, ec)) {
    const pid_t tid = std::atoi(entry.path().filename().c_str());
    const Sched t = ReadSched(tmemd.pid(), tid);
    s.tmemd += t;
    if (ReadComm(tmemd.pid(), tid).starts_with("tmem-worker")) s.workers += t;
  }
  s.ops = guest.ops();
  s.hits = guest.hits() + guest.bulk_hits();
  s.kinds = guest.op_times();
  s.at = std::chrono::steady_clock::now();
  return s;
}

Usage Between(const Snapshot& a, const Snapshot& b) {
  Usage u;
  u.seconds = std::chrono::duration<double>(b.at - a.at).count();
  u.ops = b.ops - a.ops;
  u.ops_per_s = u.seconds > 0 ? static_cast<double>(u.ops) / u.seconds : 0;
  u.hits_per_s =
      u.seconds > 0 ? static_cast<double>(b.hits - a.hits) / u.seconds : 0;
  u.neighbour = b.neighbour - a.neighbour;
  u.attackers = b.attackers - a.attackers;
  u.workers = b.workers - a.workers;
  u.tmemd = b.tmemd - a.tmemd;
  u.neighbour_charged_ns = b.neighbour_charged_ns - a.neighbour_charged_ns;
  u.attackers_charged_ns = b.attackers_charged_ns - a.attackers_charged_ns;
  u.kinds = b.kinds - a.kinds;
  return u;
}

struct Row {
  std::string attack;
  std::string attackers_cpu;  // "unbounded" or "SCHED_IDLE"
  Usage alone;                // the alone window before the attack
  Usage attacked;
  OpTimes alone_kinds;               // both alone windows around the attack
  std::vector<double> cycle_ratios;  // every cycle's, in run order
  double alone_ops = 0;
  double attacked_ops = 0;
  double attacked_hits = 0;
  uint64_t attack_entries = 0;
  double max_quota_ratio = 0;
  double max_cap_ratio = 0;
  uint64_t mismatches = 0;
  bool guarantees_held = true;
  std::string note;
};

struct Settings {
  std::string tmemd_bin;
  int window_ms = 3000;
  int cycles = 3;
  uint64_t bulk_objects = 1'000'000;
};

Row Failed(std::string what) {
  Row r;
  r.attack = std::move(what);
  r.guarantees_held = false;
  return r;
}

// Sleeps `ms` and measures the window.
Usage Window(const Tmemd& tmemd, const VerifiedGuest& guest,
             const std::vector<std::unique_ptr<RawAttacker>>& attackers,
             const std::vector<std::string>& attacker_vms, int ms) {
  const Snapshot a = Take(tmemd, guest, attackers, attacker_vms);
  std::this_thread::sleep_for(milliseconds(ms));
  return Between(a, Take(tmemd, guest, attackers, attacker_vms));
}

enum class Bound { kUnbounded, kIdle };
const char* BoundName(Bound b) {
  return b == Bound::kIdle ? "SCHED_IDLE" : "unbounded";
}

// One tmemd; the verified guest runs throughout; each attack in `attacks`
// is run once per bound in `bounds`, each bracketed by alone windows.
std::vector<Row> RunScenario(
    const Settings& settings, const std::string& dir, const TmemdSpec& spec_in,
    uint64_t bulk,
    const std::vector<
        std::pair<std::string, std::vector<std::pair<std::string, Attack>>>>&
        attacks,
    const std::vector<std::string>& watched, const std::vector<Bound>& bounds) {
  std::vector<Row> rows;
  TmemdSpec spec = spec_in;
  spec.tmemd_bin = settings.tmemd_bin;
  spec.dir = dir;
  auto tmemd = Tmemd::Start(spec);
  if (!tmemd.ok()) {
    std::fprintf(stderr, "tmemd: %s\n", tmemd.status().ToString().c_str());
    return {Failed("tmemd failed to start")};
  }
  auto guest = VerifiedGuest::Connect((*tmemd)->Socket("good"), {});
  if (!guest.ok()) {
    std::fprintf(stderr, "guest: %s\n", guest.status().ToString().c_str());
    return {Failed("guest failed to attach")};
  }
  if (bulk > 0) {
    const absl::Status filled = (*guest)->Fill(bulk);
    if (!filled.ok()) {
      std::fprintf(stderr, "fill: %s\n", filled.ToString().c_str());
      return {Failed("fill failed")};
    }
  }
  const Tmemd& host = **tmemd;
  (*guest)->Start();
  const std::vector<std::unique_ptr<RawAttacker>> none;
  Window(host, **guest, none, {}, settings.window_ms / 2);  // warm-up
  Usage alone_before = Window(host, **guest, none, {}, settings.window_ms);
  for (const auto& [name, attackers_spec] : attacks) {
    for (const Bound bound : bounds) {
      Row row;
      row.attack = name;
      row.attackers_cpu = BoundName(bound);
      std::vector<std::unique_ptr<RawAttacker>> attackers;
      std::vector<std::string> attacker_vms;
      for (const auto& [vm, attack] : attackers_spec) {
        auto a = RawAttacker::Connect(host.Socket(vm), attack);
        if (!a.ok()) {
          row.note = a.status().ToString();
          row.guarantees_held = false;
          break;
        }
        attackers.push_back(std::move(*a));
        attacker_vms.push_back(vm);
      }
      Sampler sampler(&host, watched);
      sampler.Start();
      const uint64_t mismatches0 = (*guest)->mismatches();
      struct Cycle {
        Usage alone_before, attacked, alone_after;
        double ratio = 0;
      };
      std::vector<Cycle> cycles;
      for (int i = 0; i < settings.cycles; ++i) {
        Cycle c;
        c.alone_before = alone_before;
        for (auto& a : attackers) a->Start(bound == Bound::kIdle);
        // Let the attack ramp up.
        Window(host, **guest, attackers, attacker_vms, settings.window_ms / 4);
        c.attacked =
            Window(host, **guest, attackers, attacker_vms, settings.window_ms);
        for (auto& a : attackers) {
          a->Stop();
          if (a->idle_failed() && i == 0) row.note += "SCHED_IDLE refused; ";
        }
        // Let the host drain.
        Window(host, **guest, none, {}, settings.window_ms / 4);
        c.alone_after = Window(host, **guest, none, {}, settings.window_ms);
        const double alone_ops =
            (c.alone_before.ops_per_s + c.alone_after.ops_per_s) / 2;
        c.ratio = alone_ops > 0 ? c.attacked.ops_per_s / alone_ops : 0;
        row.cycle_ratios.push_back(c.ratio);
        if (c.attacked.hits_per_s == 0) row.guarantees_held = false;
        alone_before = c.alone_after;
        cycles.push_back(c);
      }
      for (auto& a : attackers) row.attack_entries += a->completed();
      const SampleSummary s = sampler.Stop();
      std::vector<size_t> order(cycles.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
        return cycles[x].ratio < cycles[y].ratio;
      });
      const Cycle& median = cycles[order[(order.size() - 1) / 2]];
      row.alone = median.alone_before;
      row.attacked = median.attacked;
      row.alone_kinds = median.alone_before.kinds;
      row.alone_kinds += median.alone_after.kinds;
      row.alone_ops =
          (median.alone_before.ops_per_s + median.alone_after.ops_per_s) / 2;
      row.attacked_ops = row.attacked.ops_per_s;
      row.attacked_hits = row.attacked.hits_per_s;
      row.max_quota_ratio = s.max_quota_ratio;
      row.max_cap_ratio = s.cap_bytes == 0
                              ? 0
                              : static_cast<double>(s.max_used_bytes) /
                                    static_cast<double>(s.cap_bytes);
      row.mismatches = (*guest)->mismatches() - mismatches0;
      if (row.mismatches > 0 || s.cap_exceeded > 0 || s.quota_exceeded > 0 ||
          !host.Alive()) {
        row.guarantees_held = false;
      }
      for (const std::string& v : s.violations) row.note += v + "; ";
      rows.push_back(row);
    }
  }
  (*guest)->Stop();
  if ((*tmemd)->Stop() != 0) {
    rows.push_back(Failed("tmemd exit: " + (*tmemd)->Log()));
  }
  return rows;
}

// The attacked window's ops timed at the alone windows' mean per kind, over
// their time attacked: 1.0 means tmemd served the neighbour's gets, puts and
// invalidates as fast as when it was alone, whatever the mix (ops/s moves
// with the hit ratio: a hit costs the neighbour a verify, a miss does not).
// Kinds the alone windows never saw are left out.
double ServiceRatio(const OpTimes& alone, const OpTimes& attacked) {
  double expected = 0;
  double actual = 0;
  for (int k = 0; k < kNumOpKinds; ++k) {
    if (attacked.count[k] == 0 || alone.count[k] == 0) continue;
    expected += static_cast<double>(attacked.count[k]) *
                static_cast<double>(alone.ns[k]) /
                static_cast<double>(alone.count[k]);
    actual += static_cast<double>(attacked.ns[k]);
  }
  return actual > 0 ? expected / actual : 0;
}

// Microseconds per neighbour op of `nanos`.
double PerOp(int64_t nanos, const Usage& u) {
  return u.ops == 0
             ? 0
             : static_cast<double>(nanos) / 1e3 / static_cast<double>(u.ops);
}
// Share of the window's wall time (100 = one CPU).
double Percent(int64_t nanos, const Usage& u) {
  return u.seconds <= 0 ? 0 : static_cast<double>(nanos) / 1e7 / u.seconds;
}

void PrintTimeRow(const std::string& label, const Usage& u) {
  const auto wall_ns = static_cast<int64_t>(u.seconds * 1e9);
  const int64_t blocked_ns = wall_ns - u.neighbour.run_ns - u.neighbour.wait_ns;
  std::printf(
      "| %s | %.2f | %.2f | %.2f | %.2f | %.0f / %.0f | %.2f | %.1f | %.1f "
      "| %.1f | %.1f |\n",
      label.c_str(), PerOp(wall_ns, u), PerOp(u.neighbour.run_ns, u),
      PerOp(u.neighbour.wait_ns, u), PerOp(blocked_ns, u),
      Percent(u.workers.run_ns, u), Percent(u.workers.wait_ns, u),
      PerOp(u.neighbour_charged_ns, u), Percent(u.attackers_charged_ns, u),
      Percent(u.attackers.run_ns, u), Percent(u.attackers.wait_ns, u),
      Percent(u.tmemd.run_ns, u));
}

int Main(int argc, char** argv) {
  CLI::App app{"tenant isolation benchmark"};
  Settings settings;
  bool smoke = false;
  app.add_option("--tmemd", settings.tmemd_bin, "the tmemd binary")->required();
  app.add_option("--window-ms", settings.window_ms,
                 "length of each measured window")
      ->check(CLI::Range(200, 600000));
  app.add_option("--cycles", settings.cycles,
                 "attacked and alone windows alternated this many times per "
                 "attack; the row is the cycle with the median ratio")
      ->check(CLI::Range(1, 20));
  app.add_option("--bulk-objects", settings.bulk_objects,
                 "objects the neighbour holds during the pool storms")
      ->check(CLI::Range(uint64_t{1}, uint64_t{10'000'000}));
  app.add_flag("--smoke", smoke,
               "tiny run: 20k objects, 400 ms windows, 1 cycle (flags given "
               "beside it keep their values)");
  std::string attackers_cpu = "both";
  app.add_option("--attackers-cpu", attackers_cpu,
                 "the attacker threads' CPU: unbounded (compete with the "
                 "neighbour and tmemd for the host's CPUs), idle "
                 "(SCHED_IDLE: the stand-in for a hypervisor's per-VM CPU "
                 "bound) or both (each attack twice)")
      ->check(CLI::IsMember({"unbounded", "idle", "both"}));
  std::string results;
  app.add_option("--results", results,
                 "record the rows in this results file (.json)");
  std::string only;
  app.add_option("--only", only,
                 "run only the scenarios whose name contains this "
                 "(storms, meta, puts-always, puts-adaptive)");
  CLI11_PARSE(app, argc, argv);
  if (smoke) {
    // Flags given beside --smoke keep their values.
    if (app.count("--window-ms") == 0) settings.window_ms = 400;
    if (app.count("--cycles") == 0) settings.cycles = 1;
    if (app.count("--bulk-objects") == 0) settings.bulk_objects = 20'000;
  }
  std::vector<Bound> bounds;
  if (attackers_cpu != "idle") bounds.push_back(Bound::kUnbounded);
  if (attackers_cpu != "unbounded") bounds.push_back(Bound::kIdle);
  const double load_before = bench::LoadAverage();
  // Every run's tmemd directory lies below it, removed when main returns.
  const tmem::testing::TempDir tmp("tmem-isolation");
  if (tmp.path().empty()) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string& root = tmp.path();
  std::vector<Row> rows;
  auto run = [&](const std::string& sub, const TmemdSpec& spec, uint64_t bulk,
                 const auto& attacks, const std::vector<std::string>& watched) {
    if (sub.find(only) == std::string::npos) return;
    const std::string dir = root + "/" + sub;
    std::filesystem::create_directories(dir);
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all);
    for (Row& r :
         RunScenario(settings, dir, spec, bulk, attacks, watched, bounds)) {
      rows.push_back(std::move(r));
    }
  };
  using Attackers = std::vector<std::pair<std::string, Attack>>;
  using Attacks = std::vector<std::pair<std::string, Attackers>>;

  // Pool storms next to a neighbour holding bulk_objects objects.
  TmemdSpec storms;
  storms.memory_cap_bytes = 1024 * kMiB;
  storms.vms = {{"good", 0, "always"}, {"inval"}, {"destroy"}};
  run("storms", storms, settings.bulk_objects,
      Attacks{{"invalidate-pool storm (neighbour holds bulk objects)",
               {{"inval", Attack::kInvalidatePoolStorm}}},
              {"new/destroy-pool storm (neighbour holds bulk objects)",
               {{"destroy", Attack::kDestroyPoolStorm}}}},
      {});

  // Zero page per object against an 8 MiB quota (valve out of the way).
  TmemdSpec meta;
  meta.memory_cap_bytes = 64 * kMiB;
  meta.vms = {{"good"}, {"flood", 8 * kMiB, "always"}};
  run("meta", meta, 0,
      Attacks{{"zero-page-per-object flood, 8 MiB quota",
               {{"flood", Attack::kZeroPageFlood}}}},
      {"flood"});

  // Eight put flooders, valve "always" (every put compressed) and the
  // default "adaptive" (the valve samples what a hint-ignoring guest sends).
  for (const char* mode : {"always", "adaptive"}) {
    TmemdSpec puts;
    puts.memory_cap_bytes = 48 * kMiB;
    puts.vms = {{"good"}};
    Attackers flooders;
    std::vector<std::string> names;
    for (int i = 0; i < 8; ++i) {
      names.push_back("put" + std::to_string(i));
      puts.vms.push_back({names.back(), 8 * kMiB, mode});
      flooders.push_back({names.back(), Attack::kPutFlood});
    }
    run(std::string("puts-") + mode, puts, 0,
        Attacks{
            {absl::StrFormat("8 put flooders (valve %s, 8 MiB quotas)", mode),
             flooders}},
        names);
  }

  std::printf("load average (1 min) %.2f before, %.2f after\n\n", load_before,
              bench::LoadAverage());
  std::printf(
      "| attack | attackers' CPU | alone ops/s | attacked ops/s | ratio "
      "(target >= 0.8; median cycle) | every cycle's ratio | hits/s attacked "
      "| attack entries | max charge/quota | max used/cap | mismatches |\n| "
      "--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  bool ok = true;
  for (const Row& r : rows) {
    const double ratio = r.alone_ops > 0 ? r.attacked_ops / r.alone_ops : 0;
    std::string each;
    for (const double c : r.cycle_ratios) {
      absl::StrAppendFormat(&each, "%s%.2f", each.empty() ? "" : " / ", c);
    }
    std::printf(
        "| %s | %s | %.0f | %.0f | %.2f | %s | %.0f | %llu | %s | %.3f | %llu "
        "|%s\n",
        r.attack.c_str(), r.attackers_cpu.c_str(), r.alone_ops, r.attacked_ops,
        ratio, each.empty() ? "-" : each.c_str(), r.attacked_hits,
        static_cast<unsigned long long>(r.attack_entries),
        r.max_quota_ratio > 0
            ? absl::StrFormat("%.3f", r.max_quota_ratio).c_str()
            : "-",
        r.max_cap_ratio, static_cast<unsigned long long>(r.mismatches),
        r.guarantees_held ? "" : (" GUARANTEE BROKEN " + r.note).c_str());
    ok = ok && r.guarantees_held;
  }
  // Where the neighbour's time goes: per neighbour op, its thread on a
  // CPU (work and spin), runnable but waiting for a CPU, and blocked
  // (asleep on its completion interrupt); tmemd's worker threads' CPU and
  // run-queue wait; what the valve charged each side for worker time; the
  // attacker threads' own CPU and wait.
  std::printf(
      "\n| window | neighbour us/op | its CPU us/op | its run-queue wait "
      "us/op | its blocked us/op | worker CPU %% / run-queue wait %% | "
      "worker time charged to the neighbour us/op | charged to the "
      "attackers %% | attackers' CPU %% | attackers' run-queue wait %% | "
      "tmemd CPU %% |\n| --- | --- | --- | --- | --- | --- | --- | --- | "
      "--- | --- | --- |\n");
  for (const Row& r : rows) {
    if (r.alone.seconds > 0) PrintTimeRow(r.attack + ": alone", r.alone);
    if (r.attacked.seconds > 0) {
      PrintTimeRow(r.attack + ": attacked, " + r.attackers_cpu, r.attacked);
    }
  }
  // The neighbour's time inside each kind of call, alone (both windows
  // around the attack) and attacked: the service tmemd gave it, apart from
  // the mix.
  std::printf(
      "\n| attack | attackers' CPU | get hit us alone / attacked | get miss "
      "us | put us | invalidate us | ops alone / attacked (hit, miss, put, "
      "inval) | service-time ratio (target >= 0.8) |\n| --- | --- | --- | --- "
      "| --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    if (r.attacked.seconds <= 0) continue;
    const OpTimes& a = r.alone_kinds;
    const OpTimes& b = r.attacked.kinds;
    auto pair = [&](OpKind k) {
      return absl::StrFormat("%.2f / %.2f", a.MeanUs(k), b.MeanUs(k));
    };
    auto counts = [](const OpTimes& t) {
      return absl::StrFormat("%d, %d, %d, %d", t.count[0], t.count[1],
                             t.count[2], t.count[3]);
    };
    std::printf("| %s | %s | %s | %s | %s | %s | %s / %s | %.2f |\n",
                r.attack.c_str(), r.attackers_cpu.c_str(),
                pair(OpKind::kGetHit).c_str(), pair(OpKind::kGetMiss).c_str(),
                pair(OpKind::kPut).c_str(), pair(OpKind::kInvalidate).c_str(),
                counts(a).c_str(), counts(b).c_str(), ServiceRatio(a, b));
  }
  bench::BenchmarkSection section;
  section.benchmark = smoke ? "isolation-smoke" : "isolation";
  section.command = bench::CommandLine(argc, argv);
  for (const Row& r : rows) {
    const std::string who = r.attack + ", attackers " + r.attackers_cpu;
    std::string each;
    for (const double c : r.cycle_ratios) {
      absl::StrAppendFormat(&each, "%s%.2f", each.empty() ? "" : " / ", c);
    }
    auto add = [&](const std::string& what, double value,
                   const std::string& unit, bench::Goal goal, double target,
                   std::string verdict, std::string note) {
      bench::ResultRecord rec;
      rec.name = absl::StrCat(who, ": ", what);
      rec.value = value;
      rec.unit = unit;
      rec.goal = bench::GoalSymbol(goal);
      rec.target = target;
      rec.verdict = std::move(verdict);
      rec.note = std::move(note);
      section.rows.push_back(std::move(rec));
    };
    const double ratio = r.alone_ops > 0 ? r.attacked_ops / r.alone_ops : 0;
    add("neighbour throughput attacked / alone", ratio, "x",
        bench::Goal::kAtLeast, 0.8,
        bench::VerdictName(
            bench::VerdictOf(bench::Goal::kAtLeast, ratio, 0.8, false)),
        absl::StrFormat("%.0f vs %.0f ops/s; every cycle's ratio %s",
                        r.attacked_ops, r.alone_ops,
                        each.empty() ? "-" : each));
    if (r.attacked.seconds > 0) {
      const double service = ServiceRatio(r.alone_kinds, r.attacked.kinds);
      add("neighbour service time alone / attacked", service, "x",
          bench::Goal::kAtLeast, 0.8,
          bench::VerdictName(
              bench::VerdictOf(bench::Goal::kAtLeast, service, 0.8, false)),
          "");
    }
    add("guarantees held", r.guarantees_held ? 1 : 0, "", bench::Goal::kAtLeast,
        1, r.guarantees_held ? "PASS" : "FAIL",
        absl::StrFormat("mismatches %llu, max charge/quota %.3f, max used/cap "
                        "%.3f%s",
                        static_cast<unsigned long long>(r.mismatches),
                        r.max_quota_ratio, r.max_cap_ratio,
                        r.note.empty() ? "" : "; " + r.note));
  }
  bench::AssignRowIds(section.rows);
  const bool recorded = bench::RecordResults(results, section);
  return ok && recorded ? 0 : 1;
}

}  // namespace
}  // namespace tmem::hostile

int main(int argc, char** argv) try {
  return tmem::hostile::Main(argc, argv);
} catch (const std::exception& e) {
  std::fprintf(stderr, "tmem-isolation-bench: %s\n", e.what());
  return 2;
}
