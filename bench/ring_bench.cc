// tmem_ring_bench: tmemd's data plane (shared-memory rings, the worker, the
// guest library) next to the same operations called on the store in-process,
// measured side by side in one run.
//
//   tmem_ring_bench [--markdown FILE] [--csv FILE] [--results FILE] [--rounds
//   N]
//                   [--corpus_pages N] [--latency_batches N] [--gap_us N]
//                   [--extra_seconds S] [--sections put1,put4,get_poll,get_irq]
//                   [--debug_rounds]
//
// What is compared (targets: SPECIFICATION.md, "Data plane"):
//  1. Put throughput. The ring side is tmemd's real components in this
//     process: one TmemStore, one Channel per guest (Channel::Create: sealed
//     memfd region, ivshmem server on a UNIX socket in a temp dir), one
//     Worker thread driving them all (as tmemd runs), and per guest a thread
//     with a TmemGuest over IvshmemClient::Connect to that socket. The
//     baseline is TmemStore::Put called directly by as many threads, on the
//     same pages (the corpus mix), the same keys, in the same order. Puts are
//     fire-and-forget, so a ring pass ends when every CQE has been reaped:
//     the host has copied, compressed and stored every page.
//  2. Get round-trip latency (p50, p99): TmemGuest::Get with the worker
//     polling (poll_us 1 s, so it never sleeps) and with it asleep
//     (poll_us 0: the guest rings the doorbell and waits for the completion
//     interrupt), vs TmemStore::Get of the same pages.
//
// Method: the benchmarks' shared one (bench/method.h), as in the backend
// micro-benchmark's summary (summary.h), whose results table this reuses:
// each comparison alternates ring and in-process passes in ABBA order
// within every round (drift biases neither side) and reports the median
// of per-round ratios with its interquartile range.
// Latency samples are pooled over rounds for the percentiles (a p99 needs
// thousands of samples). Everything is wall time: a round trip is two
// threads' work plus the wait between them.
//
// This machine has two cores and busy neighbours. The ring needs two CPUs
// at once (guest and worker) where its baseline needs one, so a neighbour
// hurts the ring far more than the baseline, and in the latency tail it is
// all one sees. So, like the summary's scaling rows, every round records
// whether the machine gave us the CPUs it needed, and a round that failed is
// "disturbed":
//  * around every round, LZ4 alone must scale >= kMachineScalingFloor on two
//    threads (the summary's own probe; it also sees the hypervisor taking a
//    CPU, which this VM does not report as steal);
//  * during it, where two threads of ours share two CPUs (1 guest, polling
//    gets), our threads' time runnable but waiting for a CPU (schedstat
//    run_delay, ns-exact) must stay under kMaxOwnWait; where we run more
//    threads than CPUs by design (4 guests), each pass must get the CPUs it
//    can use (process CPU time over wall time); where our own wake-ups make
//    our threads wait (asleep worker), other processes' CPU time
//    (/proc/stat) must stay under kMaxOthersCpu.
// Rounds continue past --rounds (up to --extra_seconds per section) to
// collect --rounds undisturbed ones. Figures come from the undisturbed
// rounds when there are at least kMinUndisturbedRounds of them, else from
// all rounds with a warning (a miss then says nothing about tmemd and is
// reported INCONCLUSIVE, as the summary does). Every note also gives the
// all-rounds figure, so nothing is hidden.
//
// Besides the targets, "machine floor" rows time bare two-thread round
// trips (a spin hand-off; eventfd wake-ups shaped like the worker's and the
// guest's) with none of tmemd's code, so the table shows how much of a ring
// get is this machine rather than tmemd.
//
// Targets, each judged against a baseline measured in the same rounds:
//  * put, 1 guest: ring throughput >= 0.8x in-process, and tmemd's CPU per
//    ring put (the worker thread's) <= 1.25x an in-process put's;
//  * get p99, worker polling: < 3x the in-process get's p99;
//  * get p99, worker asleep (doorbell + interrupt): <= 1.5x the p99 of the
//    bare eventfd round trip (the machine floor row whose threads the
//    scheduler places, as it places the ring's).
// The rest is informational (printed, no verdict): the 4-guest put rows
// (on two CPUs the guests' page copies share the CPUs with the workers,
// which no host-side change removes), the p50 rows, the asleep get against
// the in-process get (the bare eventfd round trip alone is ~9x that), and
// the floor rows.
//
// Layout: the rounds, disturbance check and verdicts are bench/method.h's
// (bench/ring/rounds.h adapts them); bench/ring/ring_host.h is the ring
// side; bench/ring/put_throughput.h is section 1, bench/ring/get_latency.h
// section 2 with bench/ring/machine_floor.h's floor probe; this file holds
// the flags and the driver.
//
// --results FILE records the rows as section "ring" of the results file
// (bench/results_file.h).
//
// Exit status 0 whether or not targets are met (misses are listed under the
// table); 1 if the results file could not be written; 2 for a bad flag
// (refused with its name) or a setup failure.
#include <signal.h>
#include <sys/prctl.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/bench_support.h"
#include "bench/method.h"
#include "bench/page_corpus.h"
#include "bench/results_file.h"
#include "bench/ring/common.h"
#include "bench/ring/get_latency.h"
#include "bench/ring/put_throughput.h"
#include "bench/ring/rounds.h"
#include "host-agent/log.h"

namespace tmem::bench::ring {
namespace {

ResultTable RunRingBench(const PageCorpus& corpus, const RingBenchOptions& o) {
  ResultTable table;
  table.title = "tmemd data plane: rings vs in-process store";
  table.context =
      MachineDescription() +
      "; Release build; tmemd's Channel/Worker/RingConsumer/IvshmemServer "
      "and the guest library (TmemGuest over IvshmemClient) in one process, "
      "over real UNIX sockets, memfd regions and eventfds; ratios are "
      "medians of interleaved (ABBA) ring/in-process rounds on the same "
      "pages, from undisturbed rounds where the machine allowed (see notes)";
  const PageSet& mix = corpus.pages(PageCategory::kMix);
  if (mix.empty()) {
    Die("page corpus", absl::FailedPreconditionError("no mix pages"));
  }
  Progress progress("ring", o.verbose, static_cast<int>(o.sections.size()),
                    /*show_load=*/true);
  LatencyFigures polling;
  if (o.sections.count("put1")) {
    progress.Step("put throughput, 1 guest vs 1 in-process thread");
    RunPutOneGuest(mix, o, progress, table);
  }
  if (o.sections.count("put4")) {
    progress.Step("put throughput, 4 guests vs 4 and 1 in-process threads");
    RunPutFourGuests(mix, o, progress, table);
  }
  if (o.sections.count("get_poll")) {
    progress.Step("get latency, worker polling");
    RunGetLatency(mix, /*asleep=*/false, o, progress, &polling, table);
  }
  if (o.sections.count("get_irq")) {
    progress.Step("get latency, worker asleep (doorbell + interrupt)");
    RunGetLatency(mix, /*asleep=*/true, o, progress, &polling, table);
  }
  table.context += "; 1-min load average at the end " + LoadAverageText();
  progress.Done();
  return table;
}

struct Flags {
  std::string markdown;
  std::string csv;
  std::string results;
  size_t corpus_pages = 2048;
  RingBenchOptions options;
};

// False (CLI11 has printed why, naming the flag, or the help) unless the
// flags are good; *exit_code is then what main returns.
bool ParseFlags(int argc, char** argv, Flags* flags, int* exit_code) {
  RingBenchOptions& o = flags->options;
  CLI::App app{
      "tmem_ring_bench: tmemd's data plane (rings, worker, guest library) "
      "against the same puts and gets on the store in-process, in "
      "interleaved rounds"};
  app.add_option("--markdown", flags->markdown, "write the table here (.md)");
  app.add_option("--csv", flags->csv, "write the table here (.csv)");
  app.add_option("--results", flags->results,
                 "record the rows in this results file (.json)");
  app.add_option("--rounds", o.rounds, "undisturbed rounds wanted per section")
      ->check(CLI::Range(1, 10000));
  app.add_option("--corpus_pages", flags->corpus_pages,
                 "corpus pages per file category")
      ->check(CLI::Range(size_t{64}, size_t{1} << 20));
  app.add_option("--latency_batches", o.latency_batches,
                 "get batches per side per latency round")
      ->check(CLI::Range(1, 1000));
  int64_t gap_us = o.gap.count();
  app.add_option("--gap_us", gap_us,
                 "asleep-worker gets: untimed pause before each get (us)")
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}));
  app.add_option("--extra_seconds", o.extra_seconds,
                 "per section, how long rounds may continue past --rounds "
                 "waiting for undisturbed ones")
      ->check(CLI::Range(0.0, 3600.0));
  std::vector<std::string> sections(o.sections.begin(), o.sections.end());
  app.add_option("--sections", sections, "put1,put4,get_poll,get_irq")
      ->delimiter(',')
      ->check(CLI::IsMember({"put1", "put4", "get_poll", "get_irq"}));
  app.add_flag("--debug_rounds", o.debug_rounds, "one stderr line per round");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    *exit_code = rc == 0 ? 0 : 2;
    return false;
  }
  if (sections.empty()) {
    std::fprintf(stderr, "--sections: no section named\n");
    *exit_code = 2;
    return false;
  }
  o.gap = std::chrono::microseconds(gap_us);
  o.sections = std::set<std::string>(sections.begin(), sections.end());
  SetDebugPasses(o.debug_rounds);
  return true;
}

}  // namespace
}  // namespace tmem::bench::ring

int main(int argc, char** argv) try {
  using namespace tmem::bench;
  using namespace tmem::bench::ring;
  Flags flags;
  if (int exit_code = 0; !ParseFlags(argc, argv, &flags, &exit_code)) {
    return exit_code;
  }
  // As tmemd: a guest that vanishes mid-handshake must not kill the host.
  signal(SIGPIPE, SIG_IGN);
  // Short waits for ring room are sleeps (kRoomPause): keep the kernel from
  // stretching them (threads inherit this).
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  // The worker logs every attach at info; the table is the output here.
  tmem::SetLogLevel(tmem::LogLevel::kWarn);

  CorpusOptions corpus_options;
  corpus_options.pages_per_category = flags.corpus_pages;
  const PageCorpus corpus = PageCorpus::Build(corpus_options);
  const ResultTable table = RunRingBench(corpus, flags.options);
  EmitTable(table, flags.markdown, flags.csv);
  return RecordResults(flags.results,
                       TableSection(table, "ring", CommandLine(argc, argv)))
             ? 0
             : 1;
} catch (const std::exception& e) {
  // Nothing here throws on purpose; a library might (std::bad_alloc).
  std::fprintf(stderr, "tmem_ring_bench: %s\n", e.what());
  return 2;
}
