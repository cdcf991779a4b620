// tmem-scenario: the scenario benchmark, the 2011 LKML report
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
//           (deferred compression);
//   phases  (on request) the reread VM with a hog on every core, switched
//           on and off every 2 s (host_phases.h): hit ratio and tmemd's CPU
//           in the busy phases (deferred compression).
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
// With --results FILE, the targets are also recorded in the results file
// (bench/results_file.h) as section "scenario", or "scenario-deferred"
// when the deferred mode ran (its rows are those of deferred compression).
//
// Layout: config.h (the flags' values), runner.h (one run), processes.h
// (its child processes), report.h (aggregation, targets and the files
// written; verdicts as bench/method.h forms them); this file parses the
// flags, builds the corpus and drives the rounds.
//
// Exit status: 0 when every run worked (targets missed or not: they are
// printed with PASS/FAIL), 1 when a run failed or the results file could
// not be written, 2 for bad arguments.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_support.h"
#include "bench/page_corpus.h"
#include "bench/results_file.h"
#include "bench/scenario/app_work.h"
#include "bench/scenario/config.h"
#include "bench/scenario/decide_cost.h"
#include "bench/scenario/deferred_report.h"
#include "bench/scenario/processes.h"
#include "bench/scenario/report.h"
#include "bench/scenario/runner.h"

namespace tmem::scenario {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

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
  app.add_option("--results", c.results,
                 "record the targets in this results file (.json)");
  app.add_option("--tmemd", c.tmemd, "tmemd binary");
  app.add_option("--guest", c.guest, "tmem-scenario-guest binary");
  app.add_option("--scenarios", c.scenarios,
                 "stream,reread,both; idle (reread, never hogs) and phases "
                 "(reread, hogs on every core switched every 2 s) on request "
                 "(deferred compression's rows, with --modes ...,deferred)")
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
      "medians over rounds; us/page: the guest process's CPU (user + system) "
      "per page read; vs off / vs none: median of per-round ratios to "
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
  bench::BenchmarkSection section;
  section.benchmark =
      std::find(c.modes.begin(), c.modes.end(), "deferred") != c.modes.end()
          ? "scenario-deferred"
          : "scenario";
  section.command = bench::CommandLine(argc, argv);
  section.rows = TargetRecords(targets);
  if (failures > 0) {
    section.warnings.push_back(absl::StrCat(failures, " run(s) failed"));
  }
  const bool recorded = bench::RecordResults(c.results, section);
  if (c.plot) {
    if (Plot(c, rows)) {
      std::printf("plot: %s\n", (out / "scenario.png").string().c_str());
    } else {
      std::printf("plot: gnuplot failed or is missing (see %s)\n",
                  (out / "gnuplot.log").string().c_str());
    }
  }
  return failures > 0 || !recorded ? 1 : 0;
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
