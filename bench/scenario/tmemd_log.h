// Reading tmemd's JSON log (--log-format json --stats-interval 1) after a
// scenario run: the per-VM `vm_stats`, the host `stats` lines and the
// compactor's `compactor_stats` (host-agent/tmemd_main.cc writes them).
//
// Contract: ReadTmemdLog never fails; a missing file or line leaves the
// corresponding map empty (the caller decides whether that fails the run).
// Lines are flat JSON objects; ParseFlatJson reads numbers, strings and
// booleans by name and ignores anything nested.
#ifndef TMEMD_BENCH_SCENARIO_TMEMD_LOG_H_
#define TMEMD_BENCH_SCENARIO_TMEMD_LOG_H_

#include <map>
#include <string>

namespace tmem::scenario {

using Fields = std::map<std::string, std::string>;

// A flat JSON object's fields by name (values as their text).
Fields ParseFlatJson(const std::string& line);

// A field as a number: 0 when absent, 1/0 for true/false.
double Num(const Fields& m, const std::string& key);

struct TmemdLog {
  // Per VM: the last vm_stats line (counters at shutdown), with "pages"
  // replaced by the VM's peak (tmemd forgets a VM's pages when its guest
  // disconnects, so the last line holds none).
  std::map<std::string, Fields> vm_stats;
  // The last compactor_stats line (cumulative counters; tmemd writes one at
  // every stats interval and at shutdown).
  Fields compactor;
  // The host's compression ratio (pages x 4 KiB / charged bytes) in steady
  // state: from the last `stats` line holding >= 90% of the run's peak
  // pages, so neither the warm-up nor the teardown (pages forgotten) counts.
  // NaN when no stats line held a page.
  double compression_ratio = 0;
  double peak_pages = 0;
};

TmemdLog ReadTmemdLog(const std::string& path);

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_TMEMD_LOG_H_
