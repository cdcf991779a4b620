#include "bench/scenario/decide_cost.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "backend/valve.h"
#include "bench/bench_support.h"
#include "bench/method.h"

namespace tmem::scenario {
namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

}  // namespace

DecideCost MeasureDecideCost(const bench::PageSet& pages, int rounds,
                             uint64_t puts_per_round) {
  using Clock = std::chrono::steady_clock;
  DecideCost out;
  if (pages.empty() || rounds <= 0 || puts_per_round == 0) return out;
  bench::BenchStore s(1);
  Valve valve(ValveOptions{});
  valve.AddVm(s.vm(0), VmPolicy{});
  // Two samples so the VM has a CPU share and tokens, as in tmemd.
  CpuSample a;
  a.wall_nanos = 1'000'000'000;
  a.num_cpus = 2;
  a.host_total_nanos = 2'000'000'000;
  CpuSample b = a;
  b.wall_nanos += 100'000'000;
  b.host_total_nanos += 200'000'000;
  b.host_busy_nanos += 20'000'000;
  valve.Tick(a, SampleStoreMemory(s.store()));
  valve.Tick(b, SampleStoreMemory(s.store()));

  // Warm the store to steady state (every key holds a page).
  uint64_t k = 0;
  for (uint64_t i = 0; i < bench::kSteadyStateKeys; ++i, ++k) {
    s.Put(0, k % bench::kSteadyStateKeys, pages[k % pages.size()].view());
  }
  std::vector<double> put_ns, decide_ns, ratios;
  uint64_t hash = 0;
  volatile int sink = 0;
  for (int r = 0; r < rounds; ++r) {
    const Clock::time_point t0 = Clock::now();
    for (uint64_t i = 0; i < puts_per_round; ++i, ++k) {
      sink =
          s.Put(0, k % bench::kSteadyStateKeys, pages[k % pages.size()].view());
    }
    const Clock::time_point t1 = Clock::now();
    // Decide is ~1000x cheaper: time 64x more of them for resolution.
    const uint64_t decides = puts_per_round * 64;
    for (uint64_t i = 0; i < decides; ++i) {
      sink = static_cast<int>(valve.Decide(s.vm(0), Mix(++hash), true));
    }
    const Clock::time_point t2 = Clock::now();
    const double p = std::chrono::duration<double, std::nano>(t1 - t0).count() /
                     static_cast<double>(puts_per_round);
    const double d = std::chrono::duration<double, std::nano>(t2 - t1).count() /
                     static_cast<double>(decides);
    put_ns.push_back(p);
    decide_ns.push_back(d);
    ratios.push_back(d / p);
  }
  (void)sink;
  out.put_ns = bench::Median(put_ns);
  out.decide_ns = bench::Median(decide_ns);
  out.ratio = bench::Median(ratios);
  out.rounds = rounds;
  return out;
}

}  // namespace tmem::scenario
