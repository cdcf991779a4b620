// The benchmarks' results file: the last measured value of every verdict
// row, as data (bench/results/latest.json; bench/results/render.py makes
// latest.md from it). Each benchmark program owns one section, named by its
// benchmark id, and replaces only that section when it records a run:
//
//   {"schema": 1,
//    "benchmarks": {"<benchmark id>": {
//       "machine": {"hostname", "kernel", "cpus", "cpu_model", "mem_bytes"},
//       "date": "2026-12-07T11:30:00Z", "commit": "...", "command": "...",
//       "rows": [{"id", "name", "value", "unit", "goal", "target",
//                 "verdict", "note"}, ...],
//       "warnings": ["..."]}}}
//
// A value or target that was not measured (NaN, infinite) is null. Goals
// are "<=", "<", ">=" or "info" (and ">" from bench/results/record.py, the
// shell benchmarks' writer of the same file); verdicts are the words the tables
// print (bench/method.h: PASS, FAIL, INCONCLUSIVE, N/A, info).
//
// MergeResults is a read-modify-write of the whole file under an exclusive
// flock on "<path>.lock", written to a temporary file in the same directory
// and renamed over the old one: a reader sees the old file or the new one,
// never a torn one, and two benchmarks recording at once both keep their
// sections. A file that exists but is not a results file is refused, never
// overwritten (it may hold other benchmarks' last runs).
//
// Thread safety: the functions are safe to call from any thread; the
// structs are plain values.
#ifndef TMEMD_BENCH_RESULTS_FILE_H_
#define TMEMD_BENCH_RESULTS_FILE_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace tmem::bench {

inline constexpr int kResultsSchema = 1;

// One verdict row, as the benchmark printed it.
struct ResultRecord {
  std::string id;    // stable within its benchmark: RowSlug(name) by default
  std::string name;  // the row's printed name
  double value = std::nan("");
  std::string unit;           // "x", "%", "ms", "B/page", ...
  std::string goal = "info";  // "<=", "<", ">=", "info"
  double target = std::nan("");
  std::string verdict;  // PASS, FAIL, INCONCLUSIVE, N/A, info
  std::string note;
};

// The machine a run measured on.
struct MachineInfo {
  std::string hostname;
  std::string kernel;  // uname -r
  int cpus = 0;        // online CPUs
  std::string cpu_model;
  uint64_t mem_bytes = 0;  // MemTotal

  // This machine, read from uname(2), sysconf(3) and /proc.
  static MachineInfo Here();
};

// One benchmark's section: a run of one program.
struct BenchmarkSection {
  std::string benchmark;  // section key, e.g. "ring"
  MachineInfo machine = MachineInfo::Here();
  std::string date = NowUtc();
  std::string commit = CommitId();
  std::string command;
  std::vector<ResultRecord> rows;
  std::vector<std::string> warnings;

  // ISO-8601 UTC, seconds: "2026-12-07T11:30:00Z".
  static std::string NowUtc();
  // $TMEM_COMMIT (the scripts set it to `git describe --always --dirty`)
  // when set, else "unknown": a hash guessed from a tree the binary may not
  // have been built from would be wrong data.
  static std::string CommitId();
};

// Replaces `section.benchmark`'s section of the results file at `path`
// (creating the file and its directory as needed); every other section is
// kept as it was. InvalidArgument for an empty benchmark id or duplicate
// row ids, FailedPrecondition for an existing file that is not a results
// file, Internal for I/O errors; the file is unchanged on any error.
absl::Status MergeResults(const std::string& path,
                          const BenchmarkSection& section);

// MergeResults, then one line on stderr: where the section went, or why
// it did not. Nothing (and true) when `path` is empty: a run without
// --results records nothing.
bool RecordResults(const std::string& path, const BenchmarkSection& section);

// A stable row id from a printed name: lower-case ASCII letters and digits,
// every other run of characters one '-', none at either end
// ("put LZ4 path / LZ4_compress_default" ->
// "put-lz4-path-lz4-compress-default").
std::string RowSlug(std::string_view name);

// Gives rows whose id is empty RowSlug(name), and a repeated id a "-2",
// "-3", ... suffix in order, so ids are unique within the section.
void AssignRowIds(std::vector<ResultRecord>& rows);

// argv as one shell-quoted command line. Paths under $TMEM_REPO_ROOT (set by
// bench/results/results.sh) are written relative to it, so the results file
// names files by their place in the repository, not on one machine.
std::string CommandLine(int argc, const char* const* argv);

}  // namespace tmem::bench

#endif  // TMEMD_BENCH_RESULTS_FILE_H_
