// tmem-scenario: the scenario benchmark (issue 4), the 2011 LKML report
// replayed against tmemd.
//
//   tmem-scenario [--quick] [--rounds R] [--duration S] [--out DIR] ...
//                 (--help lists every option)
//
// Modes: none (guests without tmem: the report's baseline), off (tmemd
// --mode off: tmem attached, nothing stored, gets still sent), always
// (compress every put: zcache-like), adaptive (the valve), deferred (the
// valve, compressing later at SCHED_IDLE).
// Every run starts a fresh tmemd (--mode off|always|adaptive, its CPU budget,
// a memory cap, JSON logs) with one channel per simulated VM, optionally
// background CPU hogs (busy processes, one per core: other tenants taking
// the host's spare CPU), and one tmem-scenario-guest per VM (page cache LRU
// + bandwidth-limited disk + application CPU per page; see
// scenario_guest.cc). Scenarios:
//   stream  one VM streams files larger than its cache + tmem (the report),
//           CPU hogs on by default (host CPU saturated);
//   reread  one VM re-reads a working set that fits in tmem but not in its
//           page cache;
//   both    the two VMs together, on one tmemd;
//   idle    (on request) the reread VM on a host with no hogs at all: the
//           compactor's put-to-compressed time and the compression ratio
//           (issue 17);
//   phases  (on request) the reread VM with a hog on every core, switched
//           on and off every 2 s (host_phases.h): hit ratio and tmemd's CPU
//           in the busy phases (issue 17).
// Rounds interleave the modes (the order rotates every round) so that noise
// from this shared 2-core machine hits every mode alike; figures are medians
// over rounds, ratios medians of per-round ratios.
//
// Per run it records each VM's application throughput and tmem hit ratio
// (from the guest), tmemd's CPU seconds over the guests' run (/proc/PID/stat
// of the tmemd child) and over its life (wait4 rusage), and each VM's pages
// stored and valve decisions (tmemd's vm_stats at SIGTERM).
//
// Writes into --out: scenario.txt (the table and targets), scenario.csv
// (medians per scenario/mode/VM), runs.csv (every run), targets.csv,
// scenario.png (gnuplot, when installed), and each run's logs under runs/.
//
// Exit status: 0 when every run worked (targets missed or not: they are
// printed with PASS/FAIL), 1 when a run failed, 2 for bad arguments.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_support.h"
#include "bench/page_corpus.h"
#include "bench/scenario/app_work.h"
#include "bench/scenario/decide_cost.h"
#include "bench/scenario/deferred_report.h"
#include "bench/scenario/host_phases.h"
#include "bench/scenario/report_rows.h"
#include "bench/scenario/tmemd_log.h"

#ifndef TMEMD_BIN
#define TMEMD_BIN "tmemd"
#endif
#ifndef SCENARIO_GUEST_BIN
#define SCENARIO_GUEST_BIN "tmem-scenario-guest"
#endif

namespace tmem::scenario {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The phases scenario's busy and idle periods (issue 17: every 2 s).
constexpr std::chrono::milliseconds kPhasePeriod(2000);

struct Config {
  bool quick = false;
  int rounds = 0;       // 0: 2 quick, 4 full
  double duration = 0;  // measured seconds per guest; 0: 3 quick, 8 full
  std::string out;      // default: build dir's bench/scenario-results
  std::string tmemd = TMEMD_BIN;
  std::string guest = SCENARIO_GUEST_BIN;
  std::vector<std::string> scenarios = {"stream", "reread", "both"};
  // deferred (issue 17) is opt-in in tmemd and here: --modes ...,deferred.
  std::vector<std::string> modes = {"none", "off", "always", "adaptive"};
  std::string memory_cap = "64MiB";
  double cpu_budget = 25;
  int workers = -1;              // tmemd's default
  uint64_t cache_pages = 4096;   // 16 MiB guest page cache
  uint64_t working_set = 12288;  // 48 MiB: > cache, < cache + tmem
  double disk_mbps = 300;
  uint64_t readahead_pages = 32;
  double disk_latency_us = 100;  // random reads (an SSD's, about)
  double app_us = 6;             // application CPU per page read
  int stream_hogs = -1;          // -1: one per online CPU
  int other_hogs = 0;
  size_t corpus_pages = 1024;
  int micro_rounds = 0;  // 0: 5 quick, 11 full
  double progress_s = 1;
  bool plot = true;
};

// ---------------------------------------------------------------------------
// Processes.

// Every child alive (tmemd, guests, hogs), so a signal to the driver takes
// them down with it instead of leaving busy hogs behind.
constexpr int kMaxChildren = 64;
volatile sig_atomic_t g_children[kMaxChildren];

void Track(pid_t pid) {
  for (volatile sig_atomic_t& c : g_children) {
    if (c == 0) {
      c = pid;
      return;
    }
  }
}

void Untrack(pid_t pid) {
  for (volatile sig_atomic_t& c : g_children) {
    if (c == pid) c = 0;
  }
}

void KillChildrenAndExit(int sig) {
  for (volatile sig_atomic_t& c : g_children) {
    if (c > 0) kill(static_cast<pid_t>(c), SIGKILL);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

// fork + exec with stdout/stderr redirected to fds (-1: inherit).
pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (out_fd >= 0) dup2(out_fd, STDOUT_FILENO);
    if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  if (pid > 0) Track(pid);
  return pid;
}

// A busy process: another tenant's vCPU using whatever CPU it gets.
pid_t SpawnHog() {
  const pid_t pid = fork();
  if (pid == 0) {
    volatile uint64_t x = 0;
    for (;;) x = x + 1;
  }
  if (pid > 0) Track(pid);
  return pid;
}

// utime + stime of a live process, in seconds (/proc/PID/stat).
double ProcCpuSeconds(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(f, line)) return std::nan("");
  // The command may contain spaces: fields start after the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nan("");
  std::istringstream in(line.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  // Fields 3.. (state is 3); utime is 14, stime 15.
  for (int n = 3; n <= 15 && in >> field; ++n) {
    if (n == 14) utime = std::strtod(field.c_str(), nullptr);
    if (n == 15) stime = std::strtod(field.c_str(), nullptr);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Waits for `pid` up to `timeout`, then SIGKILLs it. Returns the wait
// status (or -1) and the child's rusage.
int WaitWithTimeout(pid_t pid, std::chrono::milliseconds timeout,
                    struct rusage* ru) {
  const Clock::time_point end = Clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t r = wait4(pid, &status, WNOHANG, ru);
    if (r == pid) {
      Untrack(pid);
      return status;
    }
    if (r < 0 && errno != EINTR) return -1;
    if (Clock::now() >= end) {
      kill(pid, SIGKILL);
      const int rc = wait4(pid, &status, 0, ru) == pid ? status : -1;
      Untrack(pid);
      return rc;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// ---------------------------------------------------------------------------
// Runs.

struct VmResult {
  std::string vm;                            // "stream" or "reread"
  std::map<std::string, std::string> guest;  // the guest's result line
  std::map<std::string, std::string> tmemd;  // tmemd's vm_stats line
};

struct RunResult {
  std::string scenario;
  std::string mode;
  int round = 0;
  int hogs = 0;
  bool ok = false;
  std::string error;
  double wall_s = 0;                   // guests' run, start to last exit
  double tmemd_cpu_s = 0;              // over wall_s (/proc/PID/stat)
  double tmemd_cpu_frac = 0;           // tmemd_cpu_s / (wall_s * cpus)
  double tmemd_total_cpu_s = 0;        // its whole life (wait4 rusage)
  std::map<std::string, double> host;  // run-level (deferred_report.h)
  std::vector<VmResult> vms;
};

std::vector<std::string> VmsOf(const std::string& scenario) {
  if (scenario == "stream") return {"stream"};
  if (scenario == "reread" || scenario == "idle" || scenario == "phases") {
    return {"reread"};
  }
  return {"stream", "reread"};
}

class Runner {
 public:
  Runner(const Config& c, std::string corpus, int passes, int cpus)
      : c_(c), corpus_(std::move(corpus)), passes_(passes), cpus_(cpus) {}

  RunResult Run(const std::string& scenario, const std::string& mode, int round,
                const std::string& label) {
    RunResult r;
    r.scenario = scenario;
    r.mode = mode;
    r.round = round;
    // idle: no other tenant, whatever --other-hogs says; phases: one hog
    // per core, switched on and off (host_phases.h).
    r.hogs = scenario == "stream"
                 ? (c_.stream_hogs < 0 ? cpus_ : c_.stream_hogs)
             : scenario == "idle"   ? 0
             : scenario == "phases" ? cpus_
                                    : c_.other_hogs;
    // phases: at least two busy and two idle periods.
    const double guest_duration =
        scenario == "phases"
            ? std::max(c_.duration,
                       4 * std::chrono::duration<double>(kPhasePeriod).count())
            : c_.duration;
    const fs::path dir = fs::path(c_.out) / "runs" /
                         absl::StrCat(scenario, "-", mode, "-r", round);
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::create_directories(dir / "sock", ec);
    const std::vector<std::string> vms = VmsOf(scenario);

    // tmemd. adaptive: the synchronous valve; deferred: the same valve with
    // compression left to the idle-priority compactor (issue 17).
    const std::string tmemd_mode = mode == "none" ? std::string("off")
                                   : mode == "deferred"
                                       ? std::string("adaptive")
                                       : mode;
    std::vector<std::string> targv = {
        c_.tmemd,
        "--socket-dir",
        (dir / "sock").string(),
        "--memory-cap",
        c_.memory_cap,
        "--mode",
        tmemd_mode,
        absl::StrCat("--deferred-compression=",
                     mode == "deferred" ? "true" : "false"),
        "--cpu-budget",
        absl::StrCat(c_.cpu_budget),
        "--log-format",
        "json",
        "--stats-interval",
        "1"};
    if (c_.workers > 0) {
      targv.emplace_back("--workers");
      targv.emplace_back(absl::StrCat(c_.workers));
    }
    for (const std::string& vm : vms) {
      targv.emplace_back("--vm");
      targv.emplace_back(vm);
    }
    const std::string tlog = (dir / "tmemd.log").string();
    const int tfd = open(tlog.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const pid_t tmemd = Spawn(targv, tfd, tfd);
    close(tfd);
    bool ready = false;
    for (int i = 0; i < 200 && !ready; ++i) {
      ready = true;
      for (const std::string& vm : vms) {
        if (!fs::exists(dir / "sock" / (vm + ".sock"))) ready = false;
      }
      if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    if (!ready) {
      kill(tmemd, SIGKILL);
      struct rusage ru {};
      WaitWithTimeout(tmemd, std::chrono::milliseconds(2000), &ru);
      r.error = "tmemd did not create its sockets (see " + tlog + ")";
      return r;
    }

    std::vector<pid_t> hogs;
    for (int i = 0; i < r.hogs; ++i) hogs.push_back(SpawnHog());
    std::unique_ptr<HostPhases> phases;
    if (scenario == "phases") {
      phases = std::make_unique<HostPhases>(
          hogs, kPhasePeriod, [tmemd] { return ProcCpuSeconds(tmemd); });
    }

    // Guests, stdout through pipes (progress and result lines).
    struct Child {
      std::string vm;
      pid_t pid = -1;
      int fd = -1;
      std::string buf;
      std::string result;
      double mb_per_s = 0;
      int status = 0;
    };
    std::vector<Child> kids(vms.size());
    const double t0_cpu = ProcCpuSeconds(tmemd);
    const Clock::time_point t0 = Clock::now();
    if (phases) phases->Start(t0);
    for (size_t i = 0; i < vms.size(); ++i) {
      Child& k = kids[i];
      k.vm = vms[i];
      int p[2];
      if (pipe2(p, O_CLOEXEC) != 0) {
        r.error = "pipe failed";
        break;
      }
      double duration = guest_duration;
      // In "both" the streamer outlasts the re-reader's warm-up, so the
      // re-reader is measured with the streamer running throughout.
      if (scenario == "both" && k.vm == "stream") duration += 1.5;
      const std::string elog = (dir / (k.vm + ".stderr")).string();
      const int efd = open(elog.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      // Mode "none": the guest has no tmem at all (no gets either), the
      // baseline of a guest without cleancache.
      std::vector<std::string> gargv = {
          c_.guest,
          "--socket",
          mode == "none" ? std::string()
                         : (dir / "sock" / (k.vm + ".sock")).string(),
          "--corpus",
          corpus_,
          "--workload",
          k.vm,
          "--cache-pages",
          absl::StrCat(c_.cache_pages),
          "--working-set",
          absl::StrCat(c_.working_set),
          "--disk-mbps",
          absl::StrCat(c_.disk_mbps),
          "--readahead-pages",
          absl::StrCat(c_.readahead_pages),
          "--disk-latency-us",
          absl::StrCat(c_.disk_latency_us),
          "--app-passes",
          absl::StrCat(passes_),
          "--duration",
          absl::StrCat(duration),
          "--seed",
          absl::StrCat(round + 1),
          "--progress-ms",
          absl::StrCat(static_cast<int>(c_.progress_s * 1000))};
      k.pid = Spawn(gargv, p[1], efd);
      close(p[1]);
      close(efd);
      k.fd = p[0];
    }

    // Collect lines; print progress.
    Clock::time_point next_print =
        t0 + std::chrono::milliseconds(static_cast<int>(c_.progress_s * 1000));
    size_t open_fds = kids.size();
    // A guest that outlives its duration by this much is hung: kill it (its
    // result line is then missing and the run fails).
    const Clock::time_point deadline =
        t0 + std::chrono::seconds(static_cast<int>(guest_duration) + 60);
    while (open_fds > 0) {
      int wait_ms = 200;
      if (phases) {
        phases->Tick(Clock::now());
        wait_ms = static_cast<int>(std::clamp<int64_t>(
            std::chrono::duration_cast<std::chrono::milliseconds>(
                phases->NextSwitch() - Clock::now())
                .count(),
            1, 200));
      }
      if (Clock::now() > deadline) {
        for (const Child& k : kids) kill(k.pid, SIGKILL);
      }
      std::vector<pollfd> pfds;
      std::vector<size_t> idx;
      for (size_t i = 0; i < kids.size(); ++i) {
        if (kids[i].fd >= 0) {
          pfds.push_back({kids[i].fd, POLLIN, 0});
          idx.push_back(i);
        }
      }
      poll(pfds.data(), pfds.size(), wait_ms);
      for (size_t j = 0; j < pfds.size(); ++j) {
        if ((pfds[j].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        Child& k = kids[idx[j]];
        char buf[4096];
        const ssize_t n = read(k.fd, buf, sizeof(buf));
        if (n <= 0) {
          close(k.fd);
          k.fd = -1;
          --open_fds;
          continue;
        }
        k.buf.append(buf, static_cast<size_t>(n));
        size_t nl;
        while ((nl = k.buf.find('\n')) != std::string::npos) {
          const std::string line = k.buf.substr(0, nl);
          k.buf.erase(0, nl + 1);
          if (line.rfind("progress ", 0) == 0) {
            k.mb_per_s = Num(ParseFlatJson(line), "mb_per_s");
          } else if (line.rfind("result ", 0) == 0) {
            k.result = line;
          }
        }
      }
      const Clock::time_point now = Clock::now();
      if (c_.progress_s > 0 && now >= next_print) {
        next_print +=
            std::chrono::milliseconds(static_cast<int>(c_.progress_s * 1000));
        std::string line =
            absl::StrFormat("  %s %-6s %-8s %5.1fs", label, scenario, mode,
                            std::chrono::duration<double>(now - t0).count());
        for (const Child& k : kids) {
          absl::StrAppendFormat(&line, "  %s %.0f MB/s", k.vm, k.mb_per_s);
        }
        std::printf("%s\n", line.c_str());
        std::fflush(stdout);
      }
    }
    for (Child& k : kids) {
      struct rusage ru {};
      k.status = WaitWithTimeout(k.pid, std::chrono::milliseconds(10000), &ru);
    }
    const Clock::time_point t1 = Clock::now();
    const double t1_cpu = ProcCpuSeconds(tmemd);
    PhaseTotals phase_totals;
    if (phases) phase_totals = phases->Finish(t1);
    for (pid_t h : hogs) kill(h, SIGKILL);
    for (pid_t h : hogs) {
      waitpid(h, nullptr, 0);
      Untrack(h);
    }

    kill(tmemd, SIGTERM);
    struct rusage tru {};
    const int tstatus =
        WaitWithTimeout(tmemd, std::chrono::milliseconds(10000), &tru);
    r.wall_s = std::chrono::duration<double>(t1 - t0).count();
    r.tmemd_cpu_s = t1_cpu - t0_cpu;
    r.tmemd_cpu_frac = r.tmemd_cpu_s / (r.wall_s * cpus_);
    r.tmemd_total_cpu_s =
        static_cast<double>(tru.ru_utime.tv_sec + tru.ru_stime.tv_sec) +
        static_cast<double>(tru.ru_utime.tv_usec + tru.ru_stime.tv_usec) / 1e6;

    // tmemd's log: per-VM counters, the compactor's, the host's ratio.
    const TmemdLog log = ReadTmemdLog(tlog);
    r.host = DeferredMetrics(log, phases ? &phase_totals : nullptr, cpus_);
    r.ok = r.error.empty();
    if (!WIFEXITED(tstatus) || WEXITSTATUS(tstatus) != 0) {
      r.ok = false;
      r.error = absl::StrCat("tmemd exited with status ", tstatus, " (see ",
                             tlog, ")");
    }
    for (Child& k : kids) {
      VmResult v;
      v.vm = k.vm;
      v.guest = ParseFlatJson(k.result);
      if (auto it = log.vm_stats.find(k.vm); it != log.vm_stats.end()) {
        v.tmemd = it->second;
      }
      if (k.result.empty() || !WIFEXITED(k.status) ||
          WEXITSTATUS(k.status) != 0) {
        r.ok = false;
        r.error =
            absl::StrCat("guest ", k.vm, " failed (status ", k.status, "; see ",
                         (dir / (k.vm + ".stderr")).string(), ")");
      }
      if (v.tmemd.empty()) {
        r.ok = false;
        r.error = absl::StrCat("no vm_stats for ", k.vm, " in ", tlog);
      }
      r.vms.push_back(std::move(v));
    }
    return r;
  }

 private:
  const Config& c_;
  std::string corpus_;
  int passes_;
  int cpus_;
};

// ---------------------------------------------------------------------------
// Aggregation and reports.

// Rows (report_rows.h): per (scenario, mode, vm), medians over rounds.

const std::vector<std::string>& Metrics() {
  static const std::vector<std::string> k = {"mb_per_s",
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
      "%-7s %-8s %-7s %7s %7s %7s %7s %8s %7s %9s %9s %9s %9s %9s %9s %6s\n",
      "scen", "mode", "vm", "MB/s", "vs off", "vs none", "hit %", "tmemd s",
      "CPU %", "pages", "compr", "raw", "drop cpu", "drop reu", "drop oth",
      "admit");
  for (const Row& r : rows) {
    auto g = [&](const char* k) { return r.m.at(k); };
    absl::StrAppendFormat(
        &out,
        "%-7s %-8s %-7s %7s %7s %7s %7s %8s %7s %9s %9s %9s %9s %9s %9s %6s\n",
        r.scenario, r.mode, r.vm, Fmt(g("mb_per_s"), "%.0f"),
        Fmt(g("vs_off"), "%.2fx"), Fmt(g("vs_none"), "%.2fx"),
        Fmt(g("hit_ratio") * 100, "%.1f"), Fmt(g("tmemd_cpu_s"), "%.2f"),
        Fmt(g("tmemd_cpu_frac") * 100, "%.1f"), Fmt(g("pages"), "%.0f"),
        Fmt(g("valve_compressed"), "%.0f"), Fmt(g("valve_raw"), "%.0f"),
        Fmt(g("valve_dropped_cpu"), "%.0f"),
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
      "\ndeferred compression (issue 17): ratio: host compression ratio in "
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
      "| scenario | mode | VM | MB/s | vs off | vs none | tmem hit % | "
      "tmemd CPU s | "
      "tmemd CPU % of host | pages stored | compressed | raw | dropped cpu | "
      "dropped reuse | dropped other | admission |\n"
      "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
      "---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (const Row& r : rows) {
    auto g = [&](const char* k) { return r.m.at(k); };
    absl::StrAppend(
        &out, "| ", r.scenario, " | ", r.mode, " | ", r.vm, " | ",
        Fmt(g("mb_per_s"), "%.0f"), " | ", Fmt(g("vs_off"), "%.2fx"), " | ",
        Fmt(g("vs_none"), "%.2fx"), " | ", Fmt(g("hit_ratio") * 100, "%.1f"),
        " | ", Fmt(g("tmemd_cpu_s"), "%.2f"), " | ",
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

// ---------------------------------------------------------------------------

std::string ExeDir() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

int Main(int argc, char** argv) {
  Config c;
  CLI::App app{
      "tmem-scenario: the 2011 report replayed: tmemd + simulated guests "
      "(page cache, disk, application), modes off/always/adaptive side by "
      "side"};
  app.add_flag("--quick", c.quick, "short runs (~2-3 min in all)");
  app.add_option("--rounds", c.rounds, "rounds (0: 2 quick, 4 full)");
  app.add_option("--duration", c.duration,
                 "measured seconds per guest (0: 3 quick, 8 full)");
  app.add_option("--out", c.out, "output directory");
  app.add_option("--tmemd", c.tmemd, "tmemd binary");
  app.add_option("--guest", c.guest, "tmem-scenario-guest binary");
  app.add_option("--scenarios", c.scenarios,
                 "stream,reread,both; idle (reread, never hogs) and phases "
                 "(reread, hogs on every core switched every 2 s) on request "
                 "(issue 17's rows, with --modes ...,deferred)")
      ->delimiter(',')
      ->check(CLI::IsMember({"stream", "reread", "both", "idle", "phases"}));
  app.add_option("--modes", c.modes,
                 "none,off,always,adaptive (none: guests without "
                 "tmem; off: tmemd --mode off, guests still send gets; "
                 "adaptive: synchronous valve); deferred (adaptive with "
                 "compression at idle priority) on request")
      ->delimiter(',')
      ->check(CLI::IsMember({"none", "off", "always", "adaptive", "deferred"}));
  app.add_option("--memory-cap", c.memory_cap, "tmemd --memory-cap");
  app.add_option("--cpu-budget", c.cpu_budget,
                 "tmemd --cpu-budget (percent of the host)");
  app.add_option("--workers", c.workers, "tmemd --workers (default: its own)");
  app.add_option("--cache-pages", c.cache_pages, "guest page cache, pages");
  app.add_option("--working-set", c.working_set, "reread VM's pages");
  app.add_option("--disk-mbps", c.disk_mbps, "simulated disk bandwidth");
  app.add_option("--readahead-pages", c.readahead_pages,
                 "disk burst (readahead window), pages");
  app.add_option("--disk-latency-us", c.disk_latency_us,
                 "latency of a random (non-sequential) disk read");
  app.add_option("--app-us", c.app_us,
                 "application CPU per page read, microseconds (calibrated)");
  app.add_option("--stream-hogs", c.stream_hogs,
                 "CPU hogs in the stream scenario (-1: one per CPU)");
  app.add_option("--other-hogs", c.other_hogs,
                 "CPU hogs in the reread and both scenarios");
  app.add_option("--corpus-pages", c.corpus_pages,
                 "corpus pages per file category");
  app.add_option("--micro-rounds", c.micro_rounds,
                 "Decide-vs-put rounds (0: 5 quick, 11 full; -1: skip)");
  app.add_option("--progress", c.progress_s,
                 "seconds between progress lines (0: none)");
  bool no_plot = false;
  app.add_flag("--no-plot", no_plot, "skip the gnuplot PNG");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  c.plot = !no_plot;
  if (c.rounds <= 0) c.rounds = c.quick ? 2 : 4;
  if (c.duration <= 0) c.duration = c.quick ? 3 : 8;
  if (c.micro_rounds == 0) c.micro_rounds = c.quick ? 5 : 11;
  if (c.out.empty()) {
    c.out = (fs::path(ExeDir()).parent_path() / "scenario-results").string();
  }
  std::error_code ec;
  fs::create_directories(c.out, ec);
  if (ec) {
    std::fprintf(stderr, "tmem-scenario: cannot create %s: %s\n", c.out.c_str(),
                 ec.message().c_str());
    return 2;
  }
  const int cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  const Clock::time_point start = Clock::now();

  // Realistic pages: the corpus' mix (text, binaries, compressed files,
  // zero and same-filled pages), written once for every guest to map.
  bench::CorpusOptions co;
  co.pages_per_category = c.corpus_pages;
  co.verbose = false;
  const bench::PageCorpus corpus = bench::PageCorpus::Build(co);
  const bench::PageSet& mix = corpus.pages(bench::PageCategory::kMix);
  if (mix.empty()) {
    std::fprintf(stderr, "tmem-scenario: the page corpus is empty\n");
    return 2;
  }
  const std::string corpus_path = (fs::path(c.out) / "corpus.bin").string();
  {
    std::ofstream f(corpus_path, std::ios::binary | std::ios::trunc);
    for (const bench::Page& p : mix) {
      f.write(reinterpret_cast<const char*>(p.bytes.data()), kAppPageSize);
    }
    if (!f) {
      std::fprintf(stderr, "tmem-scenario: cannot write %s\n",
                   corpus_path.c_str());
      return 2;
    }
  }
  double lz4_bytes = 0;
  for (size_t n : bench::PageCorpus::Lz4Sizes(mix)) {
    lz4_bytes += static_cast<double>(n);
  }
  const double lz4_ratio =
      static_cast<double>(mix.size() * kAppPageSize) / lz4_bytes;

  // Calibrate the application's passes per page (best of 5).
  double pass_ns = 1e18;
  volatile uint64_t sink = 0;  // keeps the timed loop from being elided
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point t0 = Clock::now();
    for (size_t p = 0; p < 2000; ++p) {
      sink = sink ^ ParsePage(mix[p % mix.size()].bytes.data(), 1);
    }
    pass_ns = std::min(
        pass_ns,
        std::chrono::duration<double, std::nano>(Clock::now() - t0).count() /
            2000);
  }
  const int passes =
      std::max(1, static_cast<int>(std::lround(c.app_us * 1000 / pass_ns)));

  DecideCost dc;
  if (c.micro_rounds > 0) {
    std::printf("valve Decide vs put micro-measurement (%d rounds)...\n",
                c.micro_rounds);
    std::fflush(stdout);
    dc = MeasureDecideCost(corpus.text_and_binary(), c.micro_rounds, 20000);
  }

  std::string context = absl::StrFormat(
      "%s\nrun %s; %d rounds x %zu scenarios x %zu modes, %.0f s measured "
      "per guest\n"
      "tmemd: --memory-cap %s --cpu-budget %.0f; guest: cache %llu pages, "
      "working set %llu pages, disk %.0f MB/s (readahead %llu pages; random "
      "reads +%.0f us), app "
      "%.1f us/page (%d passes of %.0f ns); hogs: stream %d, others %d\n"
      "corpus: %zu mix pages, LZ4 ratio %.2f\n",
      bench::MachineDescription(),
      absl::FormatTime("%Y-%m-%d %H:%M UTC", absl::Now(), absl::UTCTimeZone()),
      c.rounds, c.scenarios.size(), c.modes.size(), c.duration, c.memory_cap,
      c.cpu_budget, static_cast<unsigned long long>(c.cache_pages),
      static_cast<unsigned long long>(c.working_set), c.disk_mbps,
      static_cast<unsigned long long>(c.readahead_pages), c.disk_latency_us,
      static_cast<double>(passes) * pass_ns / 1000, passes, pass_ns,
      c.stream_hogs < 0 ? cpus : c.stream_hogs, c.other_hogs, mix.size(),
      lz4_ratio);
  std::printf("%s", context.c_str());
  std::fflush(stdout);

  Runner runner(c, corpus_path, passes, cpus);
  std::vector<RunResult> runs;
  const size_t total =
      static_cast<size_t>(c.rounds) * c.scenarios.size() * c.modes.size();
  int failures = 0;
  for (int round = 0; round < c.rounds; ++round) {
    for (const std::string& s : c.scenarios) {
      for (size_t i = 0; i < c.modes.size(); ++i) {
        // Rotate the order every round (and scenario), so no mode always
        // runs first or right after the same neighbour.
        const std::string& mode =
            c.modes[(i + static_cast<size_t>(round)) % c.modes.size()];
        const std::string label =
            absl::StrFormat("[%zu/%zu r%d]", runs.size() + 1, total, round);
        RunResult r = runner.Run(s, mode, round, label);
        std::string line = absl::StrFormat("%s %-6s %-8s done in %.1fs:", label,
                                           s, mode, r.wall_s);
        for (const VmResult& v : r.vms) {
          absl::StrAppendFormat(&line, "  %s %.0f MB/s hit %.1f%%", v.vm,
                                Num(v.guest, "mb_per_s"),
                                Num(v.guest, "hit_ratio") * 100);
        }
        absl::StrAppendFormat(&line, "  tmemd %.2f cpu-s (%.1f%% of host)",
                              r.tmemd_cpu_s, r.tmemd_cpu_frac * 100);
        if (!r.ok) {
          ++failures;
          absl::StrAppend(&line, "  FAILED: ", r.error);
        }
        std::printf("%s\n", line.c_str());
        std::fflush(stdout);
        runs.push_back(std::move(r));
      }
    }
  }

  const std::vector<Row> rows = Aggregate(c, runs, c.rounds);
  const std::vector<Target> targets = Targets(c, rows, runs, c.rounds, dc);
  const std::string report = absl::StrCat(
      "\n== tmemd scenario benchmark (the 2011 report)\n", context,
      "medians over rounds; vs off / vs none: median of per-round ratios to "
      "off (tmemd --mode off: gets still sent) / none (guest without tmem); "
      "hit %: tmem gets that hit; tmemd s / CPU %: tmemd's CPU over the "
      "guests' run (of wall x ",
      cpus,
      " cores); pages/compr/raw/drop: tmemd's vm_stats at SIGTERM; admit: "
      "final admission hint\n\n",
      Table(rows), DeferredSection(c, rows), "\ntargets:\n",
      TargetsText(targets),
      absl::StrFormat(
          "\n%d run(s) failed; %.0f s in all; results in %s\n", failures,
          std::chrono::duration<double>(Clock::now() - start).count(), c.out));
  std::printf("%s", report.c_str());
  const fs::path out(c.out);
  bench::WriteFile((out / "scenario.txt").string(), report);
  bench::WriteFile((out / "scenario.md").string(),
                   Markdown(rows) + "\n" + TargetsText(targets));
  bench::WriteFile((out / "scenario.csv").string(), Csv(rows));
  bench::WriteFile((out / "runs.csv").string(), RunsCsv(runs));
  bench::WriteFile((out / "targets.csv").string(), TargetsCsv(targets));
  if (c.plot) {
    if (Plot(c, rows)) {
      std::printf("plot: %s\n", (out / "scenario.png").string().c_str());
    } else {
      std::printf("plot: gnuplot failed or is missing (see %s)\n",
                  (out / "gnuplot.log").string().c_str());
    }
  }
  return failures > 0 ? 1 : 0;
}

}  // namespace
}  // namespace tmem::scenario

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, tmem::scenario::KillChildrenAndExit);
  signal(SIGTERM, tmem::scenario::KillChildrenAndExit);
  signal(SIGHUP, tmem::scenario::KillChildrenAndExit);
  try {
    return tmem::scenario::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tmem-scenario: %s\n", e.what());
    return 2;
  }
}
