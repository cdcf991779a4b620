// tmem_micro_bench: per-page costs of the tmem backend next to their
// baselines (memcpy, raw LZ4), in one run.
//
// Modes:
//   tmem_micro_bench [--benchmark_* flags]   Google Benchmark runs, then the
//       results table computed from those runs.
//   tmem_micro_bench --summary               interleaved side-by-side rounds
//       (see summary.h): the robust table on a noisy machine. ~30 s.
// Both accept --markdown FILE and --csv FILE for the table, --results FILE
// to record its rows in the results file (bench/results_file.h; section
// "micro", or "micro-gbench" for Google Benchmark mode), and
// --corpus_pages N / --rounds N / --metadata_pages N to scale the work.
// The exit code is 0 whether or not targets are met (it is a benchmark);
// misses are listed under the table. Exit 1: the results file could not be
// written; 2: bad arguments or setup failure.
#include <benchmark/benchmark.h>
#include <lz4.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "bench/bench_support.h"
#include "bench/method.h"
#include "bench/page_corpus.h"
#include "bench/results_file.h"
#include "bench/summary.h"

namespace tmem::bench {
namespace {

const PageCorpus* g_corpus = nullptr;
size_t g_metadata_pages = 200000;

// items/s, bytes/s, and seconds per page (GB prints e.g. "per_page=6.9u").
void SetPerPage(benchmark::State& state, int64_t pages) {
  state.SetItemsProcessed(pages);
  state.SetBytesProcessed(pages * static_cast<int64_t>(kPageSize));
  state.counters["per_page"] = benchmark::Counter(
      static_cast<double>(pages),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// --- Baselines ------------------------------------------------------------

void BM_Memcpy(benchmark::State& state, const PageSet* set) {
  auto dst = std::make_unique<Page>();
  size_t i = 0;
  for (auto _ : state) {
    std::memcpy(dst->bytes.data(), (*set)[i].bytes.data(), kPageSize);
    benchmark::DoNotOptimize(dst->bytes.data());
    benchmark::ClobberMemory();
    if (++i == set->size()) i = 0;
  }
  SetPerPage(state, state.iterations());
}

// A component of every put: the zero/same-filled check reads the page.
void BM_DetectSameFilled(benchmark::State& state, const PageSet* set) {
  size_t i = 0;
  uint64_t word = 0;
  for (auto _ : state) {
    bool same = DetectSameFilled((*set)[i].view(), &word);
    benchmark::DoNotOptimize(same);
    benchmark::DoNotOptimize(word);
    if (++i == set->size()) i = 0;
  }
  SetPerPage(state, state.iterations());
}

void BM_Lz4Compress(benchmark::State& state, const PageSet* set) {
  char out[LZ4_COMPRESSBOUND(kPageSize)];
  size_t i = 0;
  uint64_t in_bytes = 0, out_bytes = 0;
  for (auto _ : state) {
    const int n = LZ4_compress_default(
        reinterpret_cast<const char*>((*set)[i].bytes.data()), out, kPageSize,
        sizeof(out));
    benchmark::DoNotOptimize(n);
    benchmark::ClobberMemory();
    out_bytes += static_cast<uint64_t>(n);
    in_bytes += kPageSize;
    if (++i == set->size()) i = 0;
  }
  SetPerPage(state, state.iterations());
  state.counters["ratio"] =
      out_bytes ? static_cast<double>(in_bytes) / static_cast<double>(out_bytes)
                : 0;
}

// Per iteration: compress kGetBatch pages untimed (what a put would do), then
// decompress them all timed: the same shape as BM_Get, so the two compare.
void BM_Lz4DecompressBatch(benchmark::State& state, const PageSet* set) {
  constexpr size_t kStride = LZ4_COMPRESSBOUND(kPageSize);
  std::vector<char> blocks(kGetBatch * kStride);
  std::vector<int> sizes(kGetBatch);
  auto out = std::make_unique<Page>();
  size_t next = 0;
  int64_t bad = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (size_t j = 0; j < kGetBatch; ++j) {
      sizes[j] = LZ4_compress_default(
          reinterpret_cast<const char*>((*set)[next].bytes.data()),
          blocks.data() + j * kStride, kPageSize, kStride);
      if (++next == set->size()) next = 0;
    }
    state.ResumeTiming();
    for (size_t j = 0; j < kGetBatch; ++j) {
      const int r = LZ4_decompress_safe(
          blocks.data() + j * kStride,
          reinterpret_cast<char*>(out->bytes.data()), sizes[j], kPageSize);
      bad += r != static_cast<int>(kPageSize);
      benchmark::ClobberMemory();
    }
  }
  if (bad > 0) state.SkipWithError("LZ4_decompress_safe failed");
  SetPerPage(state, state.iterations() * static_cast<int64_t>(kGetBatch));
}

// --- Store operations -----------------------------------------------------

// Steady-state puts: every key already holds a page, so each put replaces
// one (frees the old blob, stores the new) and the store stays bounded.
void BM_Put(benchmark::State& state, const PageSet* set, PutMode mode,
            StorageKind expected) {
  BenchStore s(1);
  for (uint64_t k = 0; k < kSteadyStateKeys; ++k) {
    s.Put(0, k, (*set)[k % set->size()].view(), mode);
  }
  uint64_t key = 0;
  size_t i = 0;
  int64_t unexpected = 0;
  for (auto _ : state) {
    unexpected +=
        s.Put(0, key, (*set)[i].view(), mode) != static_cast<int>(expected);
    if (++key == kSteadyStateKeys) key = 0;
    if (++i == set->size()) i = 0;
  }
  SetPerPage(state, state.iterations());
  // A mix is expected to produce every kind; for the codec-path sets this
  // must be 0, or the benchmark measured another path.
  state.counters["other_kind"] = static_cast<double>(unexpected);
}

// Per iteration: put kGetBatch pages untimed, then get them all (private
// pool: each hit removes the page). `resident`: the store also holds a
// population of other pages (see AddResidentPopulation), the steady state;
// otherwise every batch empties the store and its slabs.
void BM_Get(benchmark::State& state, const PageSet* set, PutMode mode,
            bool resident) {
  BenchStore s(1);
  if (resident) AddResidentPopulation(s, 0, *set, 2 * kSteadyStateKeys);
  auto out = std::make_unique<Page>();
  size_t next = 0;
  int64_t misses = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (size_t j = 0; j < kGetBatch; ++j) {
      s.Put(0, j, (*set)[next].view(), mode);
      if (++next == set->size()) next = 0;
    }
    state.ResumeTiming();
    for (size_t j = 0; j < kGetBatch; ++j) {
      misses += !s.Get(0, j, out->mutable_view());
    }
    benchmark::DoNotOptimize(out->bytes.data());
  }
  if (misses > 0) state.SkipWithError("get missed a page just put");
  SetPerPage(state, state.iterations() * static_cast<int64_t>(kGetBatch));
}

// Threaded puts: one store shared by all threads, one VM per thread. Setup
// and Teardown run once per thread count, outside the timed region.
std::unique_ptr<BenchStore> g_thread_store;

void ThreadStoreSetup(const benchmark::State&) {
  g_thread_store = std::make_unique<BenchStore>(2);
}
void ThreadStoreTeardown(const benchmark::State&) { g_thread_store.reset(); }

void BM_PutThreads(benchmark::State& state, const PageSet* set) {
  BenchStore& s = *g_thread_store;
  const int t = state.thread_index();
  for (uint64_t k = 0; k < kSteadyStateKeys; ++k) {
    s.Put(t, k, (*set)[k % set->size()].view());
  }
  uint64_t key = 0;
  // Threads start at different pages so they do not compress the same page
  // at the same moment.
  size_t i = (set->size() / 2) * static_cast<size_t>(t) % set->size();
  for (auto _ : state) {
    s.Put(t, key, (*set)[i].view());
    if (++key == kSteadyStateKeys) key = 0;
    if (++i == set->size()) i = 0;
  }
  SetPerPage(state, state.iterations());
}

// The machine's own scaling for the same work without the store.
void BM_Lz4CompressThreads(benchmark::State& state, const PageSet* set) {
  char out[LZ4_COMPRESSBOUND(kPageSize)];
  size_t i = (set->size() / 2) * static_cast<size_t>(state.thread_index()) %
             set->size();
  for (auto _ : state) {
    const int n = LZ4_compress_default(
        reinterpret_cast<const char*>((*set)[i].bytes.data()), out, kPageSize,
        sizeof(out));
    benchmark::DoNotOptimize(n);
    if (++i == set->size()) i = 0;
  }
  SetPerPage(state, state.iterations());
}

void BM_Metadata(benchmark::State& state, const PageSet* set) {
  MetadataResult m;
  for (auto _ : state) m = MeasureMetadata(*set, g_metadata_pages);
  const auto pages = static_cast<double>(m.pages);
  auto per_page = [&](uint64_t v) {
    return m.pages > 0 ? static_cast<double>(v) / pages : 0.0;
  };
  state.counters["pages"] = pages;
  state.counters["refused"] = static_cast<double>(m.refused);
  state.counters["meta_B_per_page"] = per_page(m.metadata_bytes);
  state.counters["nonpayload_B_per_page"] = per_page(
      m.memory_used > m.stored_bytes ? m.memory_used - m.stored_bytes : 0);
  state.counters["mem_B_per_page"] = per_page(m.memory_used);
  state.counters["slot_B_per_page"] = per_page(m.stored_bytes);
  state.counters["payload_B_per_page"] = per_page(m.payload_bytes);
}

void RegisterBenchmarks(const PageCorpus& c) {
  const PageSet* tb = &c.text_and_binary();
  const PageSet* text = &c.pages(PageCategory::kText);
  const PageSet* binary = &c.pages(PageCategory::kBinary);
  const PageSet* compressed = &c.pages(PageCategory::kCompressed);
  const PageSet* zero = &c.pages(PageCategory::kZero);
  const PageSet* same = &c.pages(PageCategory::kSameFilled);
  const PageSet* mix = &c.pages(PageCategory::kMix);
  // A category this machine could not fill is skipped, not run on nothing.
  auto usable = [](const PageSet* s) { return !s->empty(); };

  if (usable(zero))
    benchmark::RegisterBenchmark("memcpy_4k/zero", BM_Memcpy, zero);
  if (usable(tb))
    benchmark::RegisterBenchmark("memcpy_4k/text+binary", BM_Memcpy, tb);
  if (usable(zero)) {
    benchmark::RegisterBenchmark("detect_same_filled/zero", BM_DetectSameFilled,
                                 zero);
  }
  if (usable(tb)) {
    benchmark::RegisterBenchmark("detect_same_filled/text+binary",
                                 BM_DetectSameFilled, tb);
  }

  const std::vector<std::pair<const char*, const PageSet*>> lz4_sets = {
      {"text+binary", tb},
      {"text", text},
      {"binary", binary},
      {"compressed", compressed},
      {"mix", mix}};
  for (const auto& [name, set] : lz4_sets) {
    if (!usable(set)) continue;
    benchmark::RegisterBenchmark((std::string("lz4_compress/") + name).c_str(),
                                 BM_Lz4Compress, set);
  }
  for (const auto& [name, set] : lz4_sets) {
    if (!usable(set)) continue;
    benchmark::RegisterBenchmark(
        (std::string("lz4_decompress_batch/") + name).c_str(),
        BM_Lz4DecompressBatch, set);
  }

  struct PutCase {
    const char* name;
    const PageSet* set;
    PutMode mode;
    StorageKind expected;
  };
  const std::vector<PutCase> puts = {
      {"put/lz4/text+binary", tb, PutMode::kCompress, StorageKind::kLz4},
      {"put/lz4/text", text, PutMode::kCompress, StorageKind::kLz4},
      {"put/lz4/binary", binary, PutMode::kCompress, StorageKind::kLz4},
      {"put/raw/compressed", compressed, PutMode::kCompress, StorageKind::kRaw},
      {"put/raw_mode/text+binary", tb, PutMode::kRaw, StorageKind::kRaw},
      {"put/zero", zero, PutMode::kCompress, StorageKind::kZero},
      {"put/same_filled", same, PutMode::kCompress, StorageKind::kSameFilled},
      {"put/mix", mix, PutMode::kCompress, StorageKind::kLz4},
  };
  for (const PutCase& p : puts) {
    if (!usable(p.set)) continue;
    benchmark::RegisterBenchmark(p.name, BM_Put, p.set, p.mode, p.expected);
  }

  const std::vector<std::pair<const char*, const PageSet*>> gets = {
      {"get/lz4/text+binary", tb},
      {"get/raw/compressed", compressed},
      {"get/zero", zero},
      {"get/same_filled", same},
      {"get/mix", mix}};
  for (const auto& [name, set] : gets) {
    if (!usable(set)) continue;
    benchmark::RegisterBenchmark(name, BM_Get, set, PutMode::kCompress, true);
  }
  if (usable(tb)) {
    benchmark::RegisterBenchmark("get/raw_mode/text+binary", BM_Get, tb,
                                 PutMode::kRaw, true);
    benchmark::RegisterBenchmark("get_empty_store/lz4/text+binary", BM_Get, tb,
                                 PutMode::kCompress, false);
  }

  if (usable(mix)) {
    benchmark::RegisterBenchmark("put_threads/mix", BM_PutThreads, mix)
        ->Setup(ThreadStoreSetup)
        ->Teardown(ThreadStoreTeardown)
        ->Threads(1)
        ->Threads(2)
        ->UseRealTime();
    benchmark::RegisterBenchmark("lz4_compress_threads/mix",
                                 BM_Lz4CompressThreads, mix)
        ->Threads(1)
        ->Threads(2)
        ->UseRealTime();
    benchmark::RegisterBenchmark("metadata/mix", BM_Metadata, mix)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  }
}

// Console output as usual, plus a copy of every run for the results table.
class CapturingReporter : public benchmark::ConsoleReporter {
 public:
  // Colour only on a terminal: the output is often captured to a file.
  CapturingReporter()
      : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      // With --benchmark_repetitions, prefer the median aggregate.
      if (r.run_type == Run::RT_Aggregate) {
        if (r.aggregate_name == "median") medians_[r.run_name.str()] = r;
      } else {
        iterations_[r.run_name.str()] = r;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  const Run* Find(const std::string& name) const {
    if (auto it = medians_.find(name); it != medians_.end()) return &it->second;
    if (auto it = iterations_.find(name); it != iterations_.end())
      return &it->second;
    return nullptr;
  }
  // Seconds per page from the per_page counter, else from items/s.
  double SecondsPerPage(const std::string& name) const {
    const Run* r = Find(name);
    if (r == nullptr) return 0;
    if (auto it = r->counters.find("per_page"); it != r->counters.end()) {
      return it->second.value;
    }
    if (auto it = r->counters.find("items_per_second");
        it != r->counters.end()) {
      return it->second.value > 0 ? 1.0 / it->second.value : 0;
    }
    return 0;
  }
  double Counter(const std::string& name, const std::string& counter) const {
    const Run* r = Find(name);
    if (r == nullptr) return 0;
    auto it = r->counters.find(counter);
    return it == r->counters.end() ? 0 : it->second.value;
  }

 private:
  std::map<std::string, Run> medians_;
  std::map<std::string, Run> iterations_;
};

ResultTable TableFromRuns(const CapturingReporter& rep) {
  ResultTable t;
  t.title = "tmem backend micro-benchmarks (from the Google Benchmark runs)";
  t.context = MachineDescription() +
              "; ratios of separate runs (use --summary for interleaved, "
              "noise-robust ratios)";
  auto ratio_row = [&](const std::string& what, const std::string& pages,
                       const std::string& measured, const std::string& baseline,
                       Goal goal, double target) {
    const double m = rep.SecondsPerPage(measured) * 1e9;
    const double b = rep.SecondsPerPage(baseline) * 1e9;
    if (m == 0 || b == 0) return;  // filtered out or not run
    t.rows.push_back({what, pages, m, b, "ns/page", m / b, "x", goal, target,
                      measured + " vs " + baseline});
  };
  ratio_row("put zero page / memcpy 4 KiB (hot)", "zero", "put/zero",
            "memcpy_4k/zero", Goal::kBelow, kTargetZeroPutOverMemcpy);
  ratio_row("put zero page, DetectSameFilled part / memcpy 4 KiB", "zero",
            "detect_same_filled/zero", "memcpy_4k/zero", Goal::kInfo, 0);
  ratio_row("put same-filled page / memcpy 4 KiB (hot)", "same_filled",
            "put/same_filled", "memcpy_4k/zero", Goal::kInfo, 0);
  ratio_row("put LZ4 path / LZ4_compress_default", "text+binary",
            "put/lz4/text+binary", "lz4_compress/text+binary", Goal::kAtMost,
            kTargetPutOverCompress);
  ratio_row("put LZ4 path / LZ4_compress_default", "text", "put/lz4/text",
            "lz4_compress/text", Goal::kInfo, 0);
  ratio_row("put LZ4 path / LZ4_compress_default", "binary", "put/lz4/binary",
            "lz4_compress/binary", Goal::kInfo, 0);
  ratio_row("put incompressible (raw path) / LZ4_compress_default",
            "compressed", "put/raw/compressed", "lz4_compress/compressed",
            Goal::kInfo, 0);
  ratio_row("put PutMode::kRaw / memcpy 4 KiB (same pages)", "text+binary",
            "put/raw_mode/text+binary", "memcpy_4k/text+binary", Goal::kInfo,
            0);
  ratio_row("put mix / LZ4_compress_default", "mix", "put/mix",
            "lz4_compress/mix", Goal::kInfo, 0);
  ratio_row("get LZ4 path / LZ4_decompress_safe", "text+binary",
            "get/lz4/text+binary", "lz4_decompress_batch/text+binary",
            Goal::kAtMost, kTargetGetOverDecompress);
  ratio_row("get LZ4 path, store otherwise empty / LZ4_decompress_safe",
            "text+binary", "get_empty_store/lz4/text+binary",
            "lz4_decompress_batch/text+binary", Goal::kInfo, 0);
  ratio_row("get mix / LZ4_decompress_safe", "mix", "get/mix",
            "lz4_decompress_batch/mix", Goal::kInfo, 0);

  auto scaling = [&](const std::string& family) {
    const double one =
        rep.Counter(family + "/real_time/threads:1", "items_per_second");
    const double two =
        rep.Counter(family + "/real_time/threads:2", "items_per_second");
    return one > 0 ? two / one : 0.0;
  };
  // Runs a minute apart cannot tell the store's scaling from a neighbour
  // taking a core; the LZ4 reference run says whether two cores were free.
  const double machine = scaling("lz4_compress_threads/mix");
  auto scaling_row = [&](const std::string& what, const std::string& family,
                         Goal goal, double target) {
    const double one =
        rep.Counter(family + "/real_time/threads:1", "items_per_second");
    const double two =
        rep.Counter(family + "/real_time/threads:2", "items_per_second");
    if (one == 0 || two == 0) return;
    std::string note = family + " threads:2 vs threads:1";
    const bool busy = machine > 0 && machine < kMachineScalingFloor;
    if (busy) {
      note += "; WARNING: LZ4 alone scaled only " + std::to_string(machine) +
              "x in this run (machine busy); see --summary";
    }
    ResultRow row{what,      "mix", two / 1e3, one / 1e3, "kpages/s",
                  two / one, "x",   goal,      target,    note};
    row.JudgeOn(busy);
    t.rows.push_back(row);
  };
  scaling_row("put throughput 2 threads / 1 thread (own VM each)",
              "put_threads/mix", Goal::kAtLeast, kTargetTwoThreadScaling);
  scaling_row("LZ4_compress_default throughput 2 threads / 1 thread (machine)",
              "lz4_compress_threads/mix", Goal::kInfo, 0);

  const std::string meta = "metadata/mix/iterations:1";
  if (rep.Find(meta) != nullptr) {
    const double v = rep.Counter(meta, "meta_B_per_page");
    t.rows.push_back({"metadata per stored page", "mix", v, 0, "B/page", v,
                      "B/page", Goal::kBelow, kTargetMetadataBytesPerPage,
                      "HostStats.metadata_bytes / pages held"});
    const double all = rep.Counter(meta, "nonpayload_B_per_page");
    t.rows.push_back({"all-in overhead per page: memory_used - blob slot bytes",
                      "mix", all, 0, "B/page", all, "B/page", Goal::kInfo, 0,
                      "metadata + slab slack"});
    const double mem = rep.Counter(meta, "mem_B_per_page");
    t.rows.push_back({"memory used per stored page", "mix", mem, 0, "B/page",
                      mem, "B/page", Goal::kInfo, 0, ""});
  }
  return t;
}

struct Flags {
  bool summary = false;
  std::string markdown;
  std::string csv;
  std::string results;
  size_t corpus_pages = 2048;
  int rounds = 31;
  size_t metadata_pages = 200000;
};

// Parses our flags (both "--flag value" and "--flag=value") and leaves
// the rest, Google Benchmark's, in *rest (argv[0] first). False (CLI11 has
// printed why, naming the flag, or the help) unless the flags are good;
// *exit_code is then what main returns.
bool ParseFlags(int argc, char** argv, Flags* flags,
                std::vector<std::string>* rest, int* exit_code) {
  CLI::App app{
      "tmem_micro_bench: the backend's per-page costs (Google Benchmark "
      "mode; any --benchmark_* flag passes through) or, with --summary, as "
      "ratios to their baselines measured side by side"};
  app.allow_extras();
  app.add_flag("--summary", flags->summary,
               "side-by-side summary with targets instead of Google "
               "Benchmark mode");
  app.add_option("--markdown", flags->markdown, "write the table here (.md)");
  app.add_option("--csv", flags->csv, "write the table here (.csv)");
  app.add_option("--results", flags->results,
                 "record the rows in this results file (.json)");
  app.add_option("--corpus_pages", flags->corpus_pages,
                 "corpus pages per file category");
  app.add_option("--rounds", flags->rounds, "timed rounds per comparison")
      ->check(CLI::Range(1, 10000));
  app.add_option("--metadata_pages", flags->metadata_pages,
                 "pages stored for the metadata-per-page row");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    *exit_code = app.exit(e) == 0 ? 0 : 2;
    return false;
  }
  rest->assign(1, argv[0]);
  for (const std::string& a : app.remaining()) rest->push_back(a);
  return true;
}

}  // namespace
}  // namespace tmem::bench

int main(int argc, char** argv) try {
  using namespace tmem::bench;
  Flags flags;
  std::vector<std::string> rest;
  if (int exit_code = 0; !ParseFlags(argc, argv, &flags, &rest, &exit_code)) {
    return exit_code;
  }

  CorpusOptions corpus_options;
  corpus_options.pages_per_category = flags.corpus_pages;
  const PageCorpus corpus = PageCorpus::Build(corpus_options);

  if (flags.summary) {
    if (rest.size() > 1) {
      std::fprintf(stderr, "--summary takes no Google Benchmark flags: %s\n",
                   rest[1].c_str());
      return 2;
    }
    SummaryOptions options;
    options.rounds = flags.rounds;
    options.metadata_pages = flags.metadata_pages;
    const ResultTable table = RunSummary(corpus, options);
    EmitTable(table, flags.markdown, flags.csv);
    return RecordResults(flags.results,
                         TableSection(table, "micro", CommandLine(argc, argv)))
               ? 0
               : 1;
  }

  g_corpus = &corpus;
  g_metadata_pages = flags.metadata_pages;
  // Google Benchmark's flags, as a C argv it may rearrange.
  std::vector<char*> bench_argv;
  for (std::string& a : rest) bench_argv.push_back(a.data());
  bench_argv.push_back(nullptr);
  int bench_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&bench_argc, bench_argv.data());
  if (benchmark::ReportUnrecognizedArguments(bench_argc, bench_argv.data())) {
    return 2;
  }
  RegisterBenchmarks(corpus);
  CapturingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  const ResultTable table = TableFromRuns(reporter);
  EmitTable(table, flags.markdown, flags.csv);
  return RecordResults(flags.results, TableSection(table, "micro-gbench",
                                                   CommandLine(argc, argv)))
             ? 0
             : 1;
} catch (const std::exception& e) {
  // Nothing here throws on purpose; a library might (std::bad_alloc).
  std::fprintf(stderr, "tmem_micro_bench: %s\n", e.what());
  return 2;
}
