// The shared measuring method (bench/method.h) as the ring benchmark uses
// it: rounds judged by a rule, ABBA passes (each
// reported with --debug_rounds), ratio figures over the used rounds, and
// rows judged INCONCLUSIVE when the machine gave too few undisturbed rounds.
#ifndef TMEMD_BENCH_RING_ROUNDS_H_
#define TMEMD_BENCH_RING_ROUNDS_H_

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_support.h"
#include "bench/method.h"
#include "bench/page_corpus.h"
#include "bench/ring/common.h"

namespace tmem::bench::ring {

// The method's rounds (bench/method.h), reporting to `progress`.
Rounds RunRingRounds(const RingBenchOptions& o, const PageSet* probe_pages,
                     const std::string& rule, const Judge& judge,
                     Progress& progress, const std::function<void(int)>& round);

// --debug_rounds: also one stderr line per pass, with its run-queue wait.
void SetDebugPasses(bool on);

// The method's ABBA passes, each reported on stderr with --debug_rounds.
void RunRingPasses(int round, const std::vector<std::function<void()>>& passes);

// Median of the used rounds' ratios a/b, and the same over all rounds.
struct RatioFigures {
  Spread used;
  double all;
  RatioFigures(const Rounds& r, const std::vector<double>& a,
               const std::vector<double>& b)
      : used(r.Pick(Ratios(a, b))), all(Percentile(Ratios(a, b), 0.5)) {}
};

// `row`, INCONCLUSIVE if it missed without enough undisturbed rounds.
ResultRow Judged(ResultRow row, const Rounds& r);

}  // namespace tmem::bench::ring

#endif  // TMEMD_BENCH_RING_ROUNDS_H_
