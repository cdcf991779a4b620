// Section 1 of the ring benchmark: put throughput, the ring (1 and 4
// guests) against TmemStore::Put called in-process by as many threads on
// the same pages, keys and order, in interleaved rounds. Adds its rows to
// `table`.
#ifndef TMEMD_BENCH_RING_PUT_THROUGHPUT_H_
#define TMEMD_BENCH_RING_PUT_THROUGHPUT_H_

#include "bench/bench_support.h"
#include "bench/page_corpus.h"
#include "bench/ring/common.h"
#include "bench/ring/rounds.h"

namespace tmem::bench::ring {

// 1 guest against 1 thread: the throughput and the worker's CPU per put
// targets.
void RunPutOneGuest(const PageSet& mix, const RingBenchOptions& o,
                    Progress& progress, ResultTable& table);

// 4 guests against 4 and 1 threads: informational rows.
void RunPutFourGuests(const PageSet& mix, const RingBenchOptions& o,
                      Progress& progress, ResultTable& table);

}  // namespace tmem::bench::ring

#endif  // TMEMD_BENCH_RING_PUT_THROUGHPUT_H_
