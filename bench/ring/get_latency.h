// Section 2 of the ring benchmark: get round-trip latency (p50, p99), the
// ring with the worker polling or asleep against TmemStore::Get of the same
// pages, and (asleep) the machine floor rows from the same rounds. Adds its
// rows to `table`.
#ifndef TMEMD_BENCH_RING_GET_LATENCY_H_
#define TMEMD_BENCH_RING_GET_LATENCY_H_

#include "bench/bench_support.h"
#include "bench/page_corpus.h"
#include "bench/ring/common.h"
#include "bench/ring/rounds.h"

namespace tmem::bench::ring {

// The ring's figures of one latency section, for the floor rows' notes.
struct LatencyFigures {
  bool measured = false;
  double ring_p50_us = 0, ring_p99_us = 0;
};

// `polling` carries the polling section's figures to the asleep section's
// floor rows (filled when !asleep).
void RunGetLatency(const PageSet& mix, bool asleep, const RingBenchOptions& o,
                   Progress& progress, LatencyFigures* polling,
                   ResultTable& table);

}  // namespace tmem::bench::ring

#endif  // TMEMD_BENCH_RING_GET_LATENCY_H_
