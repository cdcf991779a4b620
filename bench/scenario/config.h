// The scenario benchmark's configuration: every tmem-scenario flag's
// value (0 or -1 where the default depends on --quick or the machine; Main
// resolves them), and the phases scenario's period.
#ifndef TMEMD_BENCH_SCENARIO_CONFIG_H_
#define TMEMD_BENCH_SCENARIO_CONFIG_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// The binaries a run starts (CMake passes the built ones).
#ifndef TMEMD_BIN
#define TMEMD_BIN "tmemd"
#endif
#ifndef SCENARIO_GUEST_BIN
#define SCENARIO_GUEST_BIN "tmem-scenario-guest"
#endif

namespace tmem::scenario {

// The phases scenario's busy and idle periods: every 2 s.
inline constexpr std::chrono::milliseconds kPhasePeriod(2000);

struct Config {
  bool quick = false;
  int rounds = 0;       // 0: 2 quick, 4 full
  double duration = 0;  // measured seconds per guest; 0: 3 quick, 8 full
  std::string out;      // default: build dir's bench/scenario-results
  std::string results;  // results file to record the targets in, if any
  std::string tmemd = TMEMD_BIN;
  std::string guest = SCENARIO_GUEST_BIN;
  std::vector<std::string> scenarios = {"stream", "reread", "both"};
  // deferred compression is opt-in in tmemd and here: --modes ...,deferred.
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

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_CONFIG_H_
