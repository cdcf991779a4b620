// Alternating host load for the `phases` scenario (deferred compression's
// "host alternating busy/idle"): the CPU hogs (one per core) run for a period,
// are stopped (SIGSTOP) for the next, and so on, starting busy; tmemd's CPU
// is sampled at every switch so it can be split into busy and idle phases.
//
// Contract: the caller owns the hog processes (spawns and reaps them);
// HostPhases only stops and continues them, and leaves them running
// (SIGCONT) after Finish. Tick must be called often (the scenario's poll
// loop wakes at NextSwitch at the latest); a switch happens at the first
// Tick at or after its time, so a phase can run late by the loop's delay,
// which the measured wall times include. Single-threaded.
#ifndef TMEMD_BENCH_SCENARIO_HOST_PHASES_H_
#define TMEMD_BENCH_SCENARIO_HOST_PHASES_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <vector>

namespace tmem::scenario {

struct PhaseTotals {
  double busy_wall_s = 0;
  double busy_cpu_s = 0;  // tmemd's CPU during busy phases
  double idle_wall_s = 0;
  double idle_cpu_s = 0;
  int switches = 0;
};

class HostPhases {
 public:
  using Clock = std::chrono::steady_clock;
  // `cpu_seconds` reads tmemd's CPU so far (utime + stime).
  HostPhases(std::vector<pid_t> hogs, std::chrono::milliseconds period,
             std::function<double()> cpu_seconds);

  void Start(Clock::time_point now);  // first phase busy
  void Tick(Clock::time_point now);   // switches when a period is over
  Clock::time_point NextSwitch() const { return next_switch_; }
  PhaseTotals Finish(Clock::time_point now);  // closes the current phase

 private:
  void Close(Clock::time_point now);

  const std::vector<pid_t> hogs_;
  const std::chrono::milliseconds period_;
  const std::function<double()> cpu_seconds_;
  bool busy_ = true;
  Clock::time_point phase_start_;
  Clock::time_point next_switch_;
  double phase_cpu_start_ = 0;
  PhaseTotals totals_;
};

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_HOST_PHASES_H_
