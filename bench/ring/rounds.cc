#include "bench/ring/rounds.h"

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace tmem::bench::ring {

namespace {

bool g_debug_passes = false;

RoundPlan Plan(const RingBenchOptions& o) {
  RoundPlan plan;
  plan.rounds = o.rounds;
  plan.warmup_rounds = o.warmup_rounds;
  plan.extra_seconds = o.extra_seconds;
  return plan;
}

}  // namespace

Rounds RunRingRounds(const RingBenchOptions& o, const PageSet* probe_pages,
                     const std::string& rule, const Judge& judge,
                     Progress& progress,
                     const std::function<void(int)>& round) {
  return tmem::bench::RunRounds(
      Plan(o), probe_pages, rule, judge, o.debug_rounds,
      [&](const std::string& line) { progress.Note(line); }, round);
}

void SetDebugPasses(bool on) { g_debug_passes = on; }

void RunRingPasses(int round,
                   const std::vector<std::function<void()>>& passes) {
  if (!g_debug_passes) {
    tmem::bench::RunPasses(round, passes);
    return;
  }
  tmem::bench::RunPasses(round, passes, [](size_t j, double ms, double wait) {
    std::fprintf(stderr, "ring:   pass %zu: %.1f ms, own wait %.2f%%\n", j, ms,
                 100 * wait);
  });
}

ResultRow Judged(ResultRow row, const Rounds& r) {
  // As the summary's scaling row: a pass stands even on a busy machine;
  // a miss there says nothing about tmemd.
  row.JudgeOn(!r.enough);
  return row;
}

}  // namespace tmem::bench::ring
