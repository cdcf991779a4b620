#include "bench/method.h"

#include <dirent.h>
#include <lz4.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <thread>

namespace tmem::bench {
namespace {

template <typename... Args>
std::string Fmt(const char* fmt, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), fmt, args...);
  return buf;
}

// Waits of our threads that have exited (RunThreads' threads add their own
// before they end), which /proc/self/task no longer lists.
std::atomic<int64_t> g_exited_wait_ns{0};

}  // namespace

double NsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

// ----------------------------------------------------------------------------
// Statistics.

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double NearestRankPercentile(std::vector<double> v, double percent) {
  std::sort(v.begin(), v.end());
  auto rank = static_cast<size_t>(
      percent / 100.0 * static_cast<double>(v.size()) + 0.999999);
  rank = std::clamp<size_t>(rank, 1, v.size());
  return v[rank - 1];
}

double Median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(),
                         [](double x) { return std::isnan(x); }),
          v.end());
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::vector<double> Ratios(const std::vector<double>& a,
                           const std::vector<double>& b) {
  std::vector<double> r;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    r.push_back(b[i] > 0 ? a[i] / b[i] : 0);
  }
  return r;
}

// ----------------------------------------------------------------------------
// The machine.

std::string LoadAverageText() {
  std::string load = "?";
  std::ifstream loadavg("/proc/loadavg");
  loadavg >> load;
  return load;
}

double LoadAverage() {
  double load = -1;
  std::ifstream in("/proc/loadavg");
  in >> load;
  return load;
}

int64_t ProcessCpuNs() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

int64_t RunDelayNs(const std::string& schedstat_path) {
  std::ifstream f(schedstat_path);
  long long run = 0, wait = 0;
  f >> run >> wait;
  return f ? wait : 0;
}

std::set<std::string> TaskIds() {
  std::set<std::string> ids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return ids;
  // readdir is safe on a stream no other thread uses.
  while (const dirent* e = readdir(dir)) {  // NOLINT(concurrency-mt-unsafe)
    if (e->d_name[0] != '.') ids.insert(e->d_name);
  }
  closedir(dir);
  return ids;
}

int64_t TaskCpuNs(const std::string& tid) {
  if (tid.empty()) return 0;
  std::ifstream f("/proc/self/task/" + tid + "/schedstat");
  long long run = 0;
  f >> run;
  return f ? run : 0;
}

int64_t OwnWaitNs() {
  int64_t sum = g_exited_wait_ns.load();
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return sum;
  // readdir is safe on a stream no other thread uses.
  while (const dirent* e = readdir(dir)) {  // NOLINT(concurrency-mt-unsafe)
    if (e->d_name[0] == '.') continue;
    sum +=
        RunDelayNs(std::string("/proc/self/task/") + e->d_name + "/schedstat");
  }
  closedir(dir);
  return sum;
}

CpuTimes ReadCpuTimes() {
  static const int64_t tick_ns = 1000000000 / sysconf(_SC_CLK_TCK);
  std::ifstream f("/proc/stat");
  std::string cpu;
  long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0,
            softirq = 0, steal = 0;
  f >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >>
      steal;
  CpuTimes t;
  if (!f || cpu != "cpu") return t;
  t.busy_ns = (user + nice + system + irq + softirq) * tick_ns;
  t.steal_ns = steal * tick_ns;
  return t;
}

MachineSample MachineSample::Now() {
  MachineSample s;
  s.own_wait_ns = OwnWaitNs();
  s.cpu = ReadCpuTimes();
  s.own_cpu_ns = ProcessCpuNs();
  s.wall = Clock::now();
  return s;
}

Disturbance Disturbance::Between(const MachineSample& a,
                                 const MachineSample& b) {
  const double wall = std::max(1.0, NsBetween(a.wall, b.wall));
  Disturbance d;
  d.own_wait = static_cast<double>(b.own_wait_ns - a.own_wait_ns) / wall;
  const double others = static_cast<double>((b.cpu.busy_ns - a.cpu.busy_ns) +
                                            (b.cpu.steal_ns - a.cpu.steal_ns)) -
                        static_cast<double>(b.own_cpu_ns - a.own_cpu_ns);
  d.others_cpu = std::max(0.0, others / wall);
  return d;
}

double RunThreads(int n, const std::function<void(int)>& body) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<Clock::time_point> start(n), end(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      const int64_t wait0 = RunDelayNs("/proc/thread-self/schedstat");
      ready.fetch_add(1);
      // Yield rather than spin: with two cores, spinning threads would keep
      // the releasing thread (and the worker) off the CPU.
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      start[t] = Clock::now();
      body(t);
      end[t] = Clock::now();
      g_exited_wait_ns.fetch_add(RunDelayNs("/proc/thread-self/schedstat") -
                                 wait0);
    });
  }
  while (ready.load() < n) std::this_thread::yield();
  go.store(true, std::memory_order_release);
  for (std::thread& th : threads) th.join();
  return NsBetween(*std::min_element(start.begin(), start.end()),
                   *std::max_element(end.begin(), end.end()));
}

double MachineScaling(const PageSet& set) {
  // ~4 ms per pass: long enough that thread start-up does not blur the
  // ratio (2.00x with a 10-90% range of 1.95-2.06 on this machine when
  // idle; a quarter of that ranged 1.73-2.03).
  constexpr size_t kPages = 1536;
  auto lz4 = [&](int t) {
    char block[LZ4_COMPRESSBOUND(kPageSize)];
    size_t i = t * set.size() / 2;
    for (size_t op = 0; op < kPages; ++op) {
      const int n = LZ4_compress_default(
          reinterpret_cast<const char*>(set[i].bytes.data()), block, kPageSize,
          sizeof(block));
      asm volatile("" : : "r"(n) : "memory");
      if (++i == set.size()) i = 0;
    }
  };
  const double one = RunThreads(1, lz4);
  const double two = RunThreads(2, lz4);
  return two > 0 ? 2 * one / two : 0;
}

// ----------------------------------------------------------------------------
// The disturbance check.

bool TwoCpus(const Disturbance& d) {
  return d.scaling < 0 || d.scaling >= kMachineScalingFloor;
}

bool NoOwnWait(int /*round*/, const Disturbance& d) {
  return TwoCpus(d) && d.own_wait <= kMaxOwnWait;
}

std::string NoOwnWaitRule() {
  return Fmt("our threads waited for a CPU <= %.0f%% of the round",
             100 * kMaxOwnWait);
}

bool NoOthers(int /*round*/, const Disturbance& d) {
  return TwoCpus(d) && d.others_cpu <= kMaxOthersCpu;
}

std::string NoOthersRule() {
  return Fmt(
      "other processes used <= %.1f CPUs in the round (not our own wait: our "
      "wake-ups cause some)",
      kMaxOthersCpu);
}

int RoundSelection::calm() const {
  return static_cast<int>(
      std::count(undisturbed.begin(), undisturbed.end(), true));
}

std::vector<double> RoundSelection::Pick(const std::vector<double>& v) const {
  std::vector<double> out;
  for (size_t i : used) out.push_back(v[i]);
  return out;
}

RoundSelection RunRoundLoop(const RoundPlan& plan,
                            const std::function<bool(int)>& round) {
  for (int i = 0; i < plan.warmup_rounds; ++i) round(-1 - i);
  RoundSelection s;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(plan.extra_seconds));
  while (s.count() < plan.rounds ||
         (s.calm() < plan.rounds && Clock::now() < deadline)) {
    s.undisturbed.push_back(round(s.count()));
  }
  s.enough = s.calm() >= kMinUndisturbedRounds;
  for (int i = 0; i < s.count(); ++i) {
    if (!s.enough || s.undisturbed[i]) s.used.push_back(i);
  }
  return s;
}

std::string Rounds::Describe() const {
  std::string s = enough ? Fmt("%d undisturbed of %d rounds", calm(), count())
                         : Fmt("WARNING: machine busy, only %d of %d rounds "
                               "undisturbed; figures over all rounds",
                               calm(), count());
  std::vector<double> scaling;
  for (const Disturbance& d : disturbance) scaling.push_back(d.scaling);
  const std::string probe =
      scaling.empty() || scaling[0] < 0
          ? ", no LZ4 probe: the polling worker holds a CPU"
          : Fmt(", and LZ4 alone scaled >= %.2fx on 2 threads just before "
                "and after (median %.2fx)",
                kMachineScalingFloor, Percentile(scaling, 0.5));
  return s + " (undisturbed: " + rule + probe +
         Fmt("; over the section our threads waited for a CPU %.0f%% of "
             "the time and other processes used %.2f CPUs)",
             100 * section.own_wait, section.others_cpu);
}

Rounds RunRounds(const RoundPlan& plan, const PageSet* probe_pages,
                 const std::string& rule, const Judge& judge, bool debug_rounds,
                 const std::function<void(const std::string&)>& note,
                 const std::function<void(int)>& round) {
  Rounds r;
  r.rule = rule;
  MachineSample first;
  bool timed = false;
  RoundSelection selection = RunRoundLoop(plan, [&](int i) {
    if (i < 0) {
      round(i);
      return false;
    }
    if (!timed) {
      first = MachineSample::Now();
      timed = true;
    }
    const double scaling_before =
        probe_pages != nullptr ? MachineScaling(*probe_pages) : -1;
    const MachineSample a = MachineSample::Now();
    round(i);
    const MachineSample b = MachineSample::Now();
    Disturbance d = Disturbance::Between(a, b);
    d.scaling = probe_pages != nullptr
                    ? std::min(scaling_before, MachineScaling(*probe_pages))
                    : -1;
    const bool calm = judge(i, d);
    if (debug_rounds) {
      note(
          Fmt("round %d: %.1f ms, own wait %.2f%%, others %.2f CPUs, LZ4 "
              "scaling %.2fx%s",
              i, NsBetween(a.wall, b.wall) / 1e6, 100 * d.own_wait,
              d.others_cpu, d.scaling, calm ? "" : "  (disturbed)"));
    }
    r.disturbance.push_back(d);
    return calm;
  });
  static_cast<RoundSelection&>(r) = std::move(selection);
  r.section = Disturbance::Between(first, MachineSample::Now());
  note(r.Describe());
  return r;
}

void RunPasses(int round, const std::vector<std::function<void()>>& passes,
               const PassObserver& observe) {
  const bool reverse = (round < 0 ? -round : round) % 2 == 1;
  for (size_t k = 0; k < passes.size(); ++k) {
    const size_t j = reverse ? passes.size() - 1 - k : k;
    if (!observe) {
      passes[j]();
      continue;
    }
    const MachineSample a = MachineSample::Now();
    passes[j]();
    const MachineSample b = MachineSample::Now();
    observe(j, NsBetween(a.wall, b.wall) / 1e6,
            Disturbance::Between(a, b).own_wait);
  }
}

// ----------------------------------------------------------------------------
// Verdicts.

bool Meets(Goal goal, double value, double target) {
  switch (goal) {
    case Goal::kInfo:
      return true;
    case Goal::kAtMost:
      return value <= target;
    case Goal::kBelow:
      return value < target;
    case Goal::kAtLeast:
      return value >= target;
  }
  return false;
}

Verdict VerdictOf(Goal goal, double value, double target, bool disturbed) {
  if (goal == Goal::kInfo) return Verdict::kInfo;
  if (std::isnan(value)) return Verdict::kNotAvailable;
  if (Meets(goal, value, target)) return Verdict::kPass;
  return disturbed ? Verdict::kInconclusive : Verdict::kFail;
}

const char* VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kInfo:
      return "info";
    case Verdict::kPass:
      return "PASS";
    case Verdict::kFail:
      return "FAIL";
    case Verdict::kInconclusive:
      return "INCONCLUSIVE";
    case Verdict::kNotAvailable:
      return "N/A";
  }
  return "?";
}

const char* GoalSymbol(Goal goal) {
  switch (goal) {
    case Goal::kInfo:
      return "info";
    case Goal::kAtMost:
      return "<=";
    case Goal::kBelow:
      return "<";
    case Goal::kAtLeast:
      return ">=";
  }
  return "?";
}

double Progress::Seconds() const { return NsBetween(t0_, Clock::now()) / 1e9; }

void Progress::Step(const std::string& what) {
  if (!verbose_) return;
  if (show_load_) {
    std::fprintf(stderr, "%s: [%d/%d] %5.1fs %s (load %s)\n", name_.c_str(),
                 ++step_, steps_, Seconds(), what.c_str(),
                 LoadAverageText().c_str());
  } else {
    std::fprintf(stderr, "%s: [%d/%d] %5.1fs %s\n", name_.c_str(), ++step_,
                 steps_, Seconds(), what.c_str());
  }
}

void Progress::Note(const std::string& what) {
  if (!verbose_) return;
  std::fprintf(stderr, "%s:        %5.1fs %s\n", name_.c_str(), Seconds(),
               what.c_str());
}

void Progress::Done() {
  if (!verbose_) return;
  std::fprintf(stderr, "%s: done in %.1fs\n", name_.c_str(), Seconds());
}

}  // namespace tmem::bench
