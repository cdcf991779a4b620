// The machine floor rows' probe: bare two-thread round trips with none of
// tmemd's code, so the table shows how much of a ring get is this machine.
#ifndef TMEMD_BENCH_RING_MACHINE_FLOOR_H_
#define TMEMD_BENCH_RING_MACHINE_FLOOR_H_

#include <chrono>
#include <cstddef>
#include <vector>

#include "bench/page_corpus.h"

namespace tmem::bench::ring {

// TmemGuestOptions::get_spin's default: how long a get spins before it
// sleeps on the completion interrupt.
inline constexpr std::chrono::microseconds kGetSpin{20};

// The machine's floor: a bare round trip between two threads with none of
// tmemd's work in it, so the table can say how much of a ring get is this
// machine's thread hand-off rather than tmemd. As in a get, the answer is a
// page: the responder writes 4 KiB into a shared page before answering and
// the requester copies it out, so one page crosses cores each time.
//  * spinning: the responder spins on a cache line (the polling worker), the
//    requester spins for the answer (a get inside get_spin);
//  * sleeping: shaped like the asleep worker and TmemGuest::Get: the
//    responder sleeps in epoll_wait on an eventfd (the doorbell) and answers
//    through a flag plus a second eventfd (the completion interrupt); the
//    requester spins kGetSpin, then ppolls in 1 ms slices. As on the ring
//    side, each request follows an untimed `gap` so the responder is asleep.
// Spinning, the two threads are pinned to different CPUs: a fresh thread
// left to the scheduler sometimes starts on its creator's CPU, where two
// spinners take turns by time slice, which says nothing about the hand-off.
// Sleeping, both placements are measured: the scheduler's (what the ring
// gets: it may wake the responder on the requester's CPU) and different
// CPUs (the cost of waking the other, idle, CPU).
enum class FloorMode { kSpinning, kSleepingAnyCpu, kSleepingOtherCpu };

// Times `n` round trips of `mode` (each after an untimed `gap` when
// sleeping), appending ns per round trip to *samples unless it is null.
void FloorBatch(FloorMode mode, size_t n, std::chrono::microseconds gap,
                const Page& answer, std::vector<double>* samples);

}  // namespace tmem::bench::ring

#endif  // TMEMD_BENCH_RING_MACHINE_FLOOR_H_
