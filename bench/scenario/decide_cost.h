// The valve's decision next to the put it decides, in-process: how much of
// a put's time Valve::Decide costs (the scenario benchmark's fifth target:
// under 2%).
//
// Method: a TmemStore (BenchStore) takes compressing puts of realistic pages
// (the corpus' LZ4-path set) over a steady-state key space; a Valve with the
// same VM answers Decide for as many distinct key hashes. The two timed loops
// alternate for `rounds` rounds (so drift hits both) and the result is the
// median per-round ratio. Not thread-safe; runs on the calling thread.
#ifndef TMEMD_BENCH_SCENARIO_DECIDE_COST_H_
#define TMEMD_BENCH_SCENARIO_DECIDE_COST_H_

#include <cstdint>

#include "bench/page_corpus.h"

namespace tmem::scenario {

struct DecideCost {
  double decide_ns = 0;  // median per round, ns per Decide
  double put_ns = 0;     // median per round, ns per compressing put
  double ratio = 0;      // median of per-round decide_ns / put_ns
  int rounds = 0;
};

DecideCost MeasureDecideCost(const bench::PageSet& pages, int rounds,
                             uint64_t puts_per_round);

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_DECIDE_COST_H_
