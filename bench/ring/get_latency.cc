#include "bench/ring/get_latency.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/method.h"
#include "bench/ring/machine_floor.h"
#include "bench/ring/ring_host.h"
#include "bench/summary.h"

namespace tmem::bench::ring {

namespace {

// One side's per-round samples (ns per get).
struct LatencySide {
  std::vector<std::vector<double>> rounds;
  uint64_t misses = 0;
  uint64_t wrong = 0;  // hits whose bytes differ from the page put

  std::vector<double>* For(int round) {
    if (round < 0) return nullptr;  // warm-up: not kept
    if (rounds.size() <= static_cast<size_t>(round)) rounds.resize(round + 1);
    return &rounds[round];
  }
  std::vector<double> Pooled(const Rounds& r) const {
    std::vector<double> all;
    for (size_t i : r.used) {
      all.insert(all.end(), rounds[i].begin(), rounds[i].end());
    }
    return all;
  }
  std::vector<double> PooledAll() const {
    std::vector<double> all;
    for (const auto& v : rounds) all.insert(all.end(), v.begin(), v.end());
    return all;
  }
  std::vector<double> PerRound(double q) const {
    std::vector<double> out;
    for (const auto& v : rounds) out.push_back(Percentile(v, q));
    return out;
  }
  void Check(bool hit, const Page& got, const Page& want) {
    if (!hit) {
      ++misses;
    } else if (std::memcmp(got.bytes.data(), want.bytes.data(), kPageSize) !=
               0) {
      ++wrong;
    }
  }
};

// Keys of the get batches: 0..kGetBatch-1, apart from the resident ones.
void RingGetBatch(RingHost& h, const PageSet& set, size_t start, bool asleep,
                  std::chrono::microseconds gap, Page& out,
                  std::vector<double>* samples, LatencySide& side) {
  TmemGuest& g = h.guest(0);
  for (size_t j = 0; j < kGetBatch; ++j) {
    RingPut(h, 0, j, set[(start + j) % set.size()]);
  }
  WaitConsumed(g);
  for (size_t j = 0; j < kGetBatch; ++j) {
    if (asleep) {
      // The worker sets NEEDS_DOORBELL on its way to sleep; then give it
      // time to really be in epoll_wait, so the get has to wake it.
      while (!h.HostWantsDoorbell(0)) std::this_thread::yield();
      std::this_thread::sleep_for(gap);
    }
    const Clock::time_point t0 = Clock::now();
    const bool hit = g.Get(h.pool(0), GuestOid(j), KeyIndex(j),
                           TmemGuest::MutablePage(out.bytes));
    const Clock::time_point t1 = Clock::now();
    if (samples != nullptr) samples->push_back(NsBetween(t0, t1));
    side.Check(hit, out, set[(start + j) % set.size()]);
  }
}

void LocalGetBatch(BenchStore& s, const PageSet& set, size_t start, bool asleep,
                   std::chrono::microseconds gap, Page& out,
                   std::vector<double>* samples, LatencySide& side) {
  for (size_t j = 0; j < kGetBatch; ++j) {
    s.Put(0, j, set[(start + j) % set.size()].view());
  }
  for (size_t j = 0; j < kGetBatch; ++j) {
    // The same untimed pause as the ring side, so both gets find their
    // caches in the same state.
    if (asleep) std::this_thread::sleep_for(gap);
    const Clock::time_point t0 = Clock::now();
    const bool hit = s.Get(0, j, out.mutable_view());
    const Clock::time_point t1 = Clock::now();
    if (samples != nullptr) samples->push_back(NsBetween(t0, t1));
    side.Check(hit, out, set[(start + j) % set.size()]);
  }
}

}  // namespace

void RunGetLatency(const PageSet& mix, bool asleep, const RingBenchOptions& o,
                   Progress& progress, LatencyFigures* polling,
                   ResultTable& table) {
  WorkerOptions wo;
  wo.poll_us = asleep ? 0 : kPollingPollUs;
  // One GET per page: the row is a round trip's latency. With batching the
  // keys read in order would come 32 to a GET_BATCH and 31 from the window,
  // so the p99 would be the batch's service time (one get in 32).
  TmemGuestOptions go;
  go.get_batch_pages = 1;
  RingHost h(1, wo, go);
  BenchStore s(1, kStoreCapBytes);
  // Steady state: the store holds other pages (with holes), so a batch that
  // empties its own pages does not also empty and release slabs.
  AddResidentPopulation(s, 0, mix, 2 * kSteadyStateKeys);
  AddRingResidentPopulation(h, 0, mix, 2 * kSteadyStateKeys);
  auto out = std::make_unique<Page>();
  LatencySide ring, local, floor_spin, floor_sleep_any, floor_sleep_other;
  size_t start = 0;
  GuestCounters g0;
  uint64_t doorbells0 = 0;
  const Rounds r = RunRingRounds(
      o, asleep ? &mix : nullptr, asleep ? NoOthersRule() : NoOwnWaitRule(),
      asleep ? Judge(NoOthers) : Judge(NoOwnWait), progress, [&](int i) {
        if (i == 0) {
          g0 = h.guest(0).counters();
          doorbells0 = h.Metric(0, ChannelCounter::kDoorbells);
        }
        std::vector<double>* ring_samples = ring.For(i);
        std::vector<double>* local_samples = local.For(i);
        std::vector<double>* spin_samples = floor_spin.For(i);
        std::vector<double>* sleep_any_samples = floor_sleep_any.For(i);
        std::vector<double>* sleep_other_samples = floor_sleep_other.For(i);
        for (int b = 0; b < o.latency_batches; ++b) {
          std::vector<std::function<void()>> passes = {
              [&] {
                RingGetBatch(h, mix, start, asleep, o.gap, *out, ring_samples,
                             ring);
              },
              [&] {
                LocalGetBatch(s, mix, start, asleep, o.gap, *out, local_samples,
                              local);
              }};
          // The floor needs the worker asleep: a third spinning
          // thread on two CPUs would measure the scheduler instead.
          if (asleep) {
            passes.emplace_back([&] {
              FloorBatch(FloorMode::kSpinning, kGetBatch, o.gap, mix[start],
                         spin_samples);
            });
            passes.emplace_back([&] {
              FloorBatch(FloorMode::kSleepingAnyCpu, kGetBatch, o.gap,
                         mix[start], sleep_any_samples);
            });
            passes.emplace_back([&] {
              FloorBatch(FloorMode::kSleepingOtherCpu, kGetBatch, o.gap,
                         mix[start], sleep_other_samples);
            });
          }
          // ABBA within the round and across rounds.
          RunRingPasses(i + b, passes);
          start = (start + kGetBatch) % mix.size();
        }
      });
  const GuestCounters g1 = h.guest(0).counters();
  const uint64_t doorbells1 = h.Metric(0, ChannelCounter::kDoorbells);

  const std::vector<double> ring_used = ring.Pooled(r);
  const std::vector<double> local_used = local.Pooled(r);
  const auto n = static_cast<double>(ring_used.size());
  const double ring_p50 = Percentile(ring_used, 0.5) / 1e3;
  const double ring_p99 = Percentile(ring_used, 0.99) / 1e3;
  const double local_p50 = Percentile(local_used, 0.5) / 1e3;
  const double local_p99 = Percentile(local_used, 0.99) / 1e3;
  const std::vector<double> ring_all = ring.PooledAll();
  const std::vector<double> local_all = local.PooledAll();
  const double all_p99_ratio =
      Percentile(ring_all, 0.99) / std::max(1.0, Percentile(local_all, 0.99));
  const double all_p50_ratio =
      Percentile(ring_all, 0.5) / std::max(1.0, Percentile(local_all, 0.5));
  const Spread p50_ratio(
      r.Pick(Ratios(ring.PerRound(0.5), local.PerRound(0.5))));
  const Spread p99_ratio(
      r.Pick(Ratios(ring.PerRound(0.99), local.PerRound(0.99))));
  // Over all timed rounds: gets that slept on the completion interrupt,
  // and doorbells the worker took (the untimed puts ring too).
  const auto gets_all = static_cast<double>(ring_all.size());
  const auto slept =
      static_cast<double>(g1.interrupt_waits - g0.interrupt_waits);
  const auto rung = static_cast<double>(doorbells1 - doorbells0);
  const double ring_ops = 2 * gets_all;  // each get follows one put

  const std::string mode = asleep ? "worker asleep (poll_us 0): doorbell + irq"
                                  : "worker polling (poll_us 1 s)";
  std::string method =
      Fmt("pooled %.0f gets per side from %zu rounds; ", n, r.used.size());
  method += r.Describe();
  method +=
      Fmt("; wall time per get, batches of %zu pages just put (untimed; "
          "private pool, a hit removes the page), ~4k other pages resident, "
          "bytes checked, one GET per page (batched gets off)",
          kGetBatch);
  if (asleep) {
    method +=
        Fmt("; before each get, untimed, both sides: wait for NEEDS_DOORBELL, "
            "then %lld us, so the worker sleeps in epoll_wait",
            static_cast<long long>(o.gap.count()));
  } else {
    method += "; gets back to back, worker spinning on the other core";
  }
  method +=
      Fmt("; the guest spins 20 us (get_spin) then sleeps on the completion "
          "interrupt: %.0f%% of gets slept; %.0f doorbells per 100 ring ops",
          100 * slept / std::max(1.0, gets_all),
          100 * rung / std::max(1.0, ring_ops));
  std::string warn;
  if (ring.misses > 0 || ring.wrong > 0) {
    warn += Fmt("; WARNING: ring %llu misses, %llu wrong pages", U(ring.misses),
                U(ring.wrong));
  }
  if (local.misses > 0 || local.wrong > 0) {
    warn += Fmt("; WARNING: in-process %llu misses, %llu wrong pages",
                U(local.misses), U(local.wrong));
  }
  if (g1.gets_timeout != g0.gets_timeout) {
    warn += Fmt("; WARNING: %llu gets timed out (50 ms)",
                U(g1.gets_timeout - g0.gets_timeout));
  }

  // Asleep, the in-process get is no yardstick: the bare eventfd round
  // trip alone is several times it. That row is informational and the
  // target is the floor row whose threads the scheduler places (as it
  // places the ring's), from the same rounds.
  table.rows.push_back(Judged(
      {"get round trip p99: ring, " + mode + " / in-process Get",
       SetLabel("mix", mix), ring_p99, local_p99, "us p99",
       local_p99 > 0 ? ring_p99 / local_p99 : 0, "x",
       asleep ? Goal::kInfo : Goal::kBelow,
       asleep ? 0 : kTargetPollingGetP99OverInProcess,
       Fmt("all rounds %.2fx; per-round p99 ratio median %.2f, IQR "
           "%.2f-%.2f; ",
           all_p99_ratio, p99_ratio.median, p99_ratio.p25, p99_ratio.p75) +
           method + warn},
      r));
  if (asleep) {
    const double floor_p99 = Percentile(floor_sleep_any.Pooled(r), 0.99) / 1e3;
    const double floor_all_p99 =
        Percentile(floor_sleep_any.PooledAll(), 0.99) / 1e3;
    const Spread floor_ratio(
        r.Pick(Ratios(ring.PerRound(0.99), floor_sleep_any.PerRound(0.99))));
    table.rows.push_back(Judged(
        {"get round trip p99: ring, " + mode +
             " / machine floor (bare eventfd round trip, CPUs as the "
             "scheduler places them)",
         SetLabel("mix", mix), ring_p99, floor_p99, "us p99",
         floor_p99 > 0 ? ring_p99 / floor_p99 : 0, "x", Goal::kAtMost,
         kTargetAsleepGetP99OverFloor,
         Fmt("all rounds %.2fx; per-round p99 ratio median %.2f, IQR "
             "%.2f-%.2f; the floor: the machine-floor row below (no tmemd "
             "code), its round trips interleaved with the ring's gets in "
             "the same rounds; tmemd's share is what the ring adds to it",
             floor_all_p99 > 0
                 ? Percentile(ring_all, 0.99) / 1e3 / floor_all_p99
                 : 0,
             floor_ratio.median, floor_ratio.p25, floor_ratio.p75) +
             warn},
        r));
  }
  table.rows.push_back(
      {"get round trip p50: ring, " + mode + " / in-process Get",
       SetLabel("mix", mix), ring_p50, local_p50, "us p50",
       local_p50 > 0 ? ring_p50 / local_p50 : 0, "x", Goal::kInfo, 0,
       Fmt("all rounds %.2fx; per-round p50 ratio median %.2f, IQR "
           "%.2f-%.2f; the ring adds %.2f us at p50",
           all_p50_ratio, p50_ratio.median, p50_ratio.p25, p50_ratio.p75,
           ring_p50 - local_p50)});
  if (!asleep) {
    polling->measured = true;
    polling->ring_p50_us = ring_p50;
    polling->ring_p99_us = ring_p99;
    return;
  }

  // The floor rows: absolute figures (nothing to compare them with but the
  // ring rows they explain).
  auto floor_row = [&](const LatencySide& side, const std::string& what,
                       const std::string& compare) {
    const std::vector<double> used = side.Pooled(r);
    const double p50 = Percentile(used, 0.5) / 1e3;
    const double p99 = Percentile(used, 0.99) / 1e3;
    table.rows.push_back(
        {"machine floor p99: " + what, "-", p99, 0, "us p99", p99, "us",
         Goal::kInfo, 0,
         Fmt("p50 %.2f us; %zu round trips from the same rounds as the ring "
             "gets, no tmemd code; ",
             p50, used.size()) +
             compare});
  };
  floor_row(floor_spin,
            "bare thread round trip + 4 KiB page, both spinning (pinned to "
            "different CPUs)",
            polling->measured
                ? Fmt("the polling ring get (p50 %.2f, p99 %.2f us) is this "
                      "hand-off plus the store's get and tmemd's own work",
                      polling->ring_p50_us, polling->ring_p99_us)
                : std::string("what a polling ring get cannot go below"));
  const std::string wakeups =
      Fmt("bare round trip + 4 KiB page via eventfd wakeups (epoll_wait "
          "doorbell; %lld us spin, then ppoll), ",
          static_cast<long long>(kGetSpin.count()));
  const std::string compare =
      Fmt("the asleep ring get (p50 %.2f, p99 %.2f us) is such wakeups plus "
          "the store's get and tmemd's own work",
          ring_p50, ring_p99);
  floor_row(floor_sleep_any, wakeups + "CPUs as the scheduler places them",
            compare);
  floor_row(floor_sleep_other,
            wakeups + "pinned to different CPUs (waking the idle one)",
            compare);
}

}  // namespace tmem::bench::ring
