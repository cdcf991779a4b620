// The scenario driver's child processes (tmemd, guests, CPU hogs,
// gnuplot): started tracked, so that a signal to the driver
// (KillChildrenAndExit, installed by main) takes them all down instead of
// leaving busy hogs behind; waited for with a timeout; their CPU time read
// from /proc.
#ifndef TMEMD_BENCH_SCENARIO_PROCESSES_H_
#define TMEMD_BENCH_SCENARIO_PROCESSES_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace tmem::scenario {

// Signal handler: SIGKILLs every tracked child, then re-raises `sig`.
void KillChildrenAndExit(int sig);

// fork + exec with stdout/stderr redirected to fds (-1: inherit); the
// child is tracked. Returns its pid (< 0 on failure).
pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int err_fd);

// Stops tracking `pid` (the caller has reaped it).
void Untrack(pid_t pid);

// A busy process: another tenant's vCPU using whatever CPU it gets.
pid_t SpawnHog();

// utime + stime of a live process, in seconds (/proc/PID/stat); NaN if
// unreadable.
double ProcCpuSeconds(pid_t pid);

// Waits for `pid` up to `timeout`, then SIGKILLs it. Returns the wait
// status (or -1) and the child's rusage; the child is no longer tracked.
int WaitWithTimeout(pid_t pid, std::chrono::milliseconds timeout,
                    struct rusage* ru);

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_PROCESSES_H_
