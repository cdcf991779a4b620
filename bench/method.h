// The measuring method the benchmark programs share: rounds, the
// disturbance check, and verdicts. Every program measures on a shared
// two-core machine with busy neighbours, so they all follow this contract.
//
// A round is one timed repetition of a comparison. Within it every side
// runs its pass back to back, in ABBA order across rounds (RunPasses:
// reversed on odd rounds), so drift biases no side. Figures are medians of
// per-round values or ratios (Percentile, linear interpolation), with their
// interquartile range (Spread); latency percentiles pool the samples of
// the rounds used. Untimed warm-up rounds come first.
//
// The disturbance check: each timed round is judged undisturbed or not
// (a Judge, from what the machine did during the round: our threads' wait
// for a CPU, other processes' CPU time, and where it can be probed whether
// LZ4 alone scaled >= kMachineScalingFloor on two threads around it).
// Rounds continue past the rounds wanted, up to a time budget, until that
// many were undisturbed (RunRoundLoop). Figures come from the undisturbed
// rounds when there are at least kMinUndisturbedRounds of them, else from
// all rounds, with a warning in the note (RoundSelection::enough).
//
// A verdict: a row with a goal (<=, <, >=) and a target PASSes when its
// value meets the target (Meets) and FAILs otherwise; a miss measured
// without enough undisturbed rounds is INCONCLUSIVE (it says nothing about
// tmemd; a pass stands); a row with no measured value (NaN) is N/A; a row
// without a goal is "info". Targets themselves live with each program
// (SPECIFICATION.md lists them).
#ifndef TMEMD_BENCH_METHOD_H_
#define TMEMD_BENCH_METHOD_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench/page_corpus.h"

namespace tmem::bench {

using Clock = std::chrono::steady_clock;

double NsBetween(Clock::time_point a, Clock::time_point b);

// ----------------------------------------------------------------------------
// Statistics.

// The q-quantile (q in [0, 1]) of `v`, interpolated linearly between the
// two nearest samples; 0 for an empty sample.
double Percentile(std::vector<double> v, double q);

// The nearest-rank `percent`-th percentile (0-100] of a non-empty sample:
// a value that was observed (the fleet benchmark's latencies).
double NearestRankPercentile(std::vector<double> v, double percent);

// The median of the values that are not NaN (a metric a run does not
// have); NaN if there are none.
double Median(std::vector<double> v);

// Median and interquartile range of a sample.
struct Spread {
  double median = 0, p25 = 0, p75 = 0;
  explicit Spread(const std::vector<double>& v)
      : median(Percentile(v, 0.5)),
        p25(Percentile(v, 0.25)),
        p75(Percentile(v, 0.75)) {}
};

// a[i] / b[i] (0 where b[i] is not positive), as far as both go.
std::vector<double> Ratios(const std::vector<double>& a,
                           const std::vector<double>& b);

// ----------------------------------------------------------------------------
// The machine.

// The 1-minute load average as /proc/loadavg prints it ("?" if unreadable),
// and as a number (-1 if unreadable).
std::string LoadAverageText();
double LoadAverage();

// Progress lines on stderr while a benchmark runs ("NAME: [k/n] 12.3s what",
// with the load average when show_load), silent unless verbose.
class Progress {
 public:
  Progress(std::string name, bool verbose, int steps, bool show_load)
      : name_(std::move(name)),
        verbose_(verbose),
        steps_(steps),
        show_load_(show_load) {}
  void Step(const std::string& what);
  // A line between steps (no step number).
  void Note(const std::string& what);
  void Done();

 private:
  double Seconds() const;
  std::string name_;
  bool verbose_;
  int steps_;
  bool show_load_;
  int step_ = 0;
  Clock::time_point t0_ = Clock::now();
};

// CPU time of the whole process (every thread).
int64_t ProcessCpuNs();

// schedstat's second field at `schedstat_path`: ns the thread spent
// runnable, waiting for a CPU; 0 if the kernel does not provide it.
int64_t RunDelayNs(const std::string& schedstat_path);

// This process's threads, by id, and ns thread `tid` has run (0 if unknown).
std::set<std::string> TaskIds();
int64_t TaskCpuNs(const std::string& tid);

// Run-queue wait of every thread this process has had (RunThreads' exited
// threads included).
int64_t OwnWaitNs();

// All CPUs' non-idle time and the hypervisor's steal, in ns (/proc/stat).
struct CpuTimes {
  int64_t busy_ns = 0;
  int64_t steal_ns = 0;
};
CpuTimes ReadCpuTimes();

// What the machine and this process had done at one moment.
struct MachineSample {
  Clock::time_point wall;
  int64_t own_cpu_ns = 0;
  int64_t own_wait_ns = 0;
  CpuTimes cpu;

  static MachineSample Now();
};

// What happened between two samples.
struct Disturbance {
  double own_wait = 0;    // our threads' run-queue wait / wall time
  double others_cpu = 0;  // CPUs other processes and steal used (10 ms
                          // ticks: only meaningful over long intervals)
  double scaling = 0;     // MachineScaling() around the round (the lower;
                          // < 0: not probed)

  static Disturbance Between(const MachineSample& a, const MachineSample& b);
};

// Runs body(t) for t in [0, n) on n new threads released together; returns
// the wall time from the earliest start to the last finish (a late starter
// counts against throughput, as it would in real use). Each thread adds its
// run-queue wait to OwnWaitNs() before it ends.
double RunThreads(int n, const std::function<void(int)>& body);

// The machine's own two-core limit right now: LZ4 alone on `set`, 2 threads
// over 1. Below kMachineScalingFloor a neighbour (or the hypervisor, whose
// steal a VM may not report) held a CPU.
double MachineScaling(const PageSet& set);

// ----------------------------------------------------------------------------
// The disturbance check.

// A two-thread round is undisturbed only if LZ4 alone scaled at least this
// much around it: below, a neighbour held one of the two cores.
inline constexpr double kMachineScalingFloor = 1.8;
// Fewer undisturbed rounds than this: figures over all rounds, with a
// warning.
inline constexpr int kMinUndisturbedRounds = 5;
// A two-thread round is disturbed when our threads together waited for a
// CPU more than this fraction of its wall time (two threads on two CPUs
// wait ~0 on an idle machine).
inline constexpr double kMaxOwnWait = 0.02;
// A round judged by other processes' CPU time is disturbed above this many
// CPUs. /proc/stat counts in 10 ms ticks, so this needs rounds of 100 ms or
// more.
inline constexpr double kMaxOthersCpu = 0.2;

// Whether round i was undisturbed, given what the machine did meanwhile.
using Judge = std::function<bool(int round, const Disturbance& d)>;

// The machine had two real CPUs around the round, where that was probed.
bool TwoCpus(const Disturbance& d);
// Two threads of ours on two CPUs: any wait for a CPU is a neighbour's.
bool NoOwnWait(int round, const Disturbance& d);
std::string NoOwnWaitRule();
// Where our own wake-ups make our threads wait, only other processes can
// tell a disturbed round.
bool NoOthers(int round, const Disturbance& d);
std::string NoOthersRule();

// Which timed rounds count.
struct RoundSelection {
  std::vector<bool> undisturbed;  // per timed round
  std::vector<size_t> used;       // the rounds whose results count
  bool enough = true;             // used = the undisturbed rounds

  int count() const { return static_cast<int>(undisturbed.size()); }
  int calm() const;
  // Picks the used rounds' entries out of per-round results.
  std::vector<double> Pick(const std::vector<double>& v) const;
};

struct RoundPlan {
  int rounds = 31;  // undisturbed timed rounds wanted
  int warmup_rounds = 2;
  // Rounds continue past `rounds`, up to this long, waiting for `rounds`
  // undisturbed ones.
  double extra_seconds = 10;
};

// Runs round(-1 - k) for each warm-up round k, then timed rounds round(i),
// i = 0, 1, ...: at least plan.rounds, then more until plan.rounds were
// undisturbed or plan.extra_seconds have passed. round(i) returns whether
// timed round i was undisturbed (warm-ups' answers are ignored).
RoundSelection RunRoundLoop(const RoundPlan& plan,
                            const std::function<bool(int)>& round);

// Rounds judged from the machine's samples, with what the check saw.
struct Rounds : RoundSelection {
  std::vector<Disturbance> disturbance;  // per timed round
  Disturbance section;                   // over all timed rounds
  std::string rule;                      // how rounds were judged

  // The note's account of the rounds: how many were undisturbed and why.
  std::string Describe() const;
};

// RunRoundLoop with the disturbance check around every round: a machine
// sample before and after, and with `probe_pages` (nullptr where the probe
// cannot work, e.g. a polling worker holds a CPU) MachineScaling() just
// before and after. `note` gets one line per round when `debug_rounds`, and
// the rounds' Describe() at the end.
Rounds RunRounds(const RoundPlan& plan, const PageSet* probe_pages,
                 const std::string& rule, const Judge& judge, bool debug_rounds,
                 const std::function<void(const std::string&)>& note,
                 const std::function<void(int)>& round);

// Runs the passes of round `round` in ABBA order (reversed on odd rounds).
// With `observe`, each pass is also sampled and reported to it (pass index,
// wall ms, our threads' wait as a fraction of it).
using PassObserver = std::function<void(size_t pass, double ms, double wait)>;
void RunPasses(int round, const std::vector<std::function<void()>>& passes,
               const PassObserver& observe = nullptr);

// ----------------------------------------------------------------------------
// Verdicts.

enum class Goal { kInfo, kAtMost, kBelow, kAtLeast };

// Whether `value` meets `target` under `goal` (always, for kInfo).
bool Meets(Goal goal, double value, double target);

enum class Verdict { kInfo, kPass, kFail, kInconclusive, kNotAvailable };

// The verdict of a row: `disturbed` means the machine did not give the run
// enough undisturbed rounds (a miss is then INCONCLUSIVE); a NaN value was
// not measured.
Verdict VerdictOf(Goal goal, double value, double target, bool disturbed);

// "info", "PASS", "FAIL", "INCONCLUSIVE", "N/A": the words the tables print.
const char* VerdictName(Verdict v);

// "info", "<=", "<", ">=": a goal as the results file records it.
const char* GoalSymbol(Goal goal);

}  // namespace tmem::bench

#endif  // TMEMD_BENCH_METHOD_H_
