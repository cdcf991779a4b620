// One scenario run in one mode (tmem-scenario's unit of work): a fresh
// tmemd with one channel per simulated VM, optional CPU hogs, one
// tmem-scenario-guest per VM, and what each reported.
#ifndef TMEMD_BENCH_SCENARIO_RUNNER_H_
#define TMEMD_BENCH_SCENARIO_RUNNER_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bench/scenario/config.h"

namespace tmem::scenario {

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

// The VMs of `scenario` ("stream", "reread" or both).
std::vector<std::string> VmsOf(const std::string& scenario);

class Runner {
 public:
  Runner(const Config& c, std::string corpus, int passes, int cpus)
      : c_(c), corpus_(std::move(corpus)), passes_(passes), cpus_(cpus) {}

  // One run: a fresh tmemd, its guests and hogs; the guests' results and
  // tmemd's stats and CPU time.
  RunResult Run(const std::string& scenario, const std::string& mode, int round,
                const std::string& label);

 private:
  const Config& c_;
  std::string corpus_;
  int passes_;
  int cpus_;
};

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_RUNNER_H_
