// The data-plane benchmark's options, targets and small text helpers,
// shared by its sections (tmem_ring_bench; see ring_bench.cc for what is
// compared and how).
#ifndef TMEMD_BENCH_RING_COMMON_H_
#define TMEMD_BENCH_RING_COMMON_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "bench/page_corpus.h"

namespace tmem::bench::ring {

// Targets (SPECIFICATION.md, "Data plane").
inline constexpr double kTargetRingPutOverInProcess = 0.8;
inline constexpr double kTargetWorkerCpuPerPutOverInProcess = 1.25;
inline constexpr double kTargetPollingGetP99OverInProcess = 3.0;
inline constexpr double kTargetAsleepGetP99OverFloor = 1.5;

// The polling variant: the worker keeps polling this long after the last
// work, i.e. throughout the run.
inline constexpr int kPollingPollUs = 1000000;

// Room for everything the benchmark stores, so nothing is ever evicted and
// both sides store the same pages.
inline constexpr uint64_t kStoreCapBytes = uint64_t{2} << 30;

// An oversubscribed pass is disturbed when it got less than this fraction
// of the CPUs it could use (min(busy threads, CPUs)).
inline constexpr double kMinCpuShare = 0.95;
// (Rounds judged by other processes' CPU time, kMaxOthersCpu in
// bench/method.h, need rounds of 100 ms or more: the asleep-worker rounds are
// ~140 ms.)

struct RingBenchOptions {
  int rounds = 31;
  int warmup_rounds = 2;
  // Rounds continue past `rounds`, up to this long per section, waiting for
  // `rounds` undisturbed ones.
  double extra_seconds = 10;
  // Batches of kGetBatch gets per side per latency round. Short rounds:
  // the shorter a round, the likelier a neighbour leaves it alone.
  int latency_batches = 1;
  // Asleep-worker variant: untimed pause before each get, both sides, so
  // the worker has really gone to sleep in epoll_wait.
  std::chrono::microseconds gap{50};
  std::set<std::string> sections = {"put1", "put4", "get_poll", "get_irq"};
  bool verbose = true;
  bool debug_rounds = false;  // one stderr line per round
};

// --- Small helpers --------------------------------------------------------

[[noreturn]] inline void Die(const std::string& what,
                             const absl::Status& status) {
  std::fprintf(stderr, "ring bench setup failed: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  // Setup failures happen with no benchmark thread running.
  std::exit(2);  // NOLINT(concurrency-mt-unsafe)
}

template <typename... Args>
inline std::string Fmt(const char* fmt, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), fmt, args...);
  return buf;
}

inline unsigned long long U(uint64_t v) {
  return static_cast<unsigned long long>(v);
}

inline std::string SetLabel(const char* name, const PageSet& set) {
  return std::string(name) + " (" + std::to_string(set.size()) + ")";
}

}  // namespace tmem::bench::ring

#endif  // TMEMD_BENCH_RING_COMMON_H_
