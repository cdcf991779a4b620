#include "bench/scenario/host_phases.h"

#include <signal.h>

#include <utility>

namespace tmem::scenario {

HostPhases::HostPhases(std::vector<pid_t> hogs,
                       std::chrono::milliseconds period,
                       std::function<double()> cpu_seconds)
    : hogs_(std::move(hogs)),
      period_(period),
      cpu_seconds_(std::move(cpu_seconds)) {}

void HostPhases::Start(Clock::time_point now) {
  busy_ = true;
  for (pid_t h : hogs_) kill(h, SIGCONT);
  phase_start_ = now;
  next_switch_ = now + period_;
  phase_cpu_start_ = cpu_seconds_();
}

void HostPhases::Close(Clock::time_point now) {
  const double cpu = cpu_seconds_();
  const double wall = std::chrono::duration<double>(now - phase_start_).count();
  if (busy_) {
    totals_.busy_wall_s += wall;
    totals_.busy_cpu_s += cpu - phase_cpu_start_;
  } else {
    totals_.idle_wall_s += wall;
    totals_.idle_cpu_s += cpu - phase_cpu_start_;
  }
  phase_start_ = now;
  phase_cpu_start_ = cpu;
}

void HostPhases::Tick(Clock::time_point now) {
  if (now < next_switch_) return;
  Close(now);
  busy_ = !busy_;
  // Stopped hogs use no CPU: the host is idle but for tmemd and the guests.
  for (pid_t h : hogs_) kill(h, busy_ ? SIGCONT : SIGSTOP);
  ++totals_.switches;
  next_switch_ = now + period_;
}

PhaseTotals HostPhases::Finish(Clock::time_point now) {
  Close(now);
  for (pid_t h : hogs_) kill(h, SIGCONT);
  return totals_;
}

}  // namespace tmem::scenario
