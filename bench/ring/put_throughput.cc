#include "bench/ring/put_throughput.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench/method.h"
#include "bench/ring/ring_host.h"

namespace tmem::bench::ring {

namespace {

// Each thread's position in its key space and in the page set, on its own
// cache line (shared lines would bounce between the cores on every put).
struct alignas(64) Cursor {
  uint64_t key = 0;
  size_t page = 0;
  uint64_t waits = 0;    // ring side: puts that found the ring full
  uint64_t refused = 0;  // in-process side: puts not stored

  void Advance(size_t set_size) {
    if (++key == kSteadyStateKeys) key = 0;
    if (++page == set_size) page = 0;
  }
};

// Thread t starts at a different place in the page set, so threads are not
// compressing the same page at the same moment.
std::vector<Cursor> Cursors(int n, size_t set_size) {
  std::vector<Cursor> c(n);
  for (int t = 0; t < n; ++t) c[t].page = t * set_size / n;
  return c;
}

uint64_t Waits(const std::vector<Cursor>& cursors) {
  uint64_t n = 0;
  for (const Cursor& c : cursors) n += c.waits;
  return n;
}

// One side of a put comparison: per timed round, its throughput and the
// process CPU per page.
struct PutSide {
  std::vector<double> rate;  // pages/s
  std::vector<double> cpu_ns_per_page;
  std::vector<double> cpus;  // process CPU time / wall time
  // The CPU that stored the pages: the worker thread's on the ring side,
  // the putting threads' (all of the process's) in-process.
  std::vector<double> store_cpu_ns_per_page;

  void Record(int round, double pages, double wall_ns, int64_t cpu_ns,
              int64_t store_cpu_ns) {
    if (round < 0) return;  // warm-up
    rate.push_back(pages * 1e9 / wall_ns);
    cpu_ns_per_page.push_back(static_cast<double>(cpu_ns) / pages);
    cpus.push_back(static_cast<double>(cpu_ns) / wall_ns);
    store_cpu_ns_per_page.push_back(static_cast<double>(store_cpu_ns) / pages);
  }
};

// Ends when every CQE is reaped.
void RingPutPass(RingHost& h, int n, size_t per_thread, const PageSet& set,
                 std::vector<Cursor>& cursors, int round, PutSide& side) {
  const int64_t cpu0 = ProcessCpuNs();
  const int64_t worker0 = h.WorkerCpuNs();
  const double wall = RunThreads(n, [&](int t) {
    TmemGuest& g = h.guest(t);
    Cursor& c = cursors[t];
    for (size_t op = 0; op < per_thread; ++op) {
      c.waits += WaitForRoom(g, h.limit(t));
      g.Put(h.pool(t), GuestOid(c.key), KeyIndex(c.key),
            TmemGuest::Page(set[c.page].bytes));
      c.Advance(set.size());
    }
    WaitConsumed(g);
  });
  side.Record(round, static_cast<double>(n * per_thread), wall,
              ProcessCpuNs() - cpu0, h.WorkerCpuNs() - worker0);
}

void LocalPutPass(BenchStore& s, int n, size_t per_thread, const PageSet& set,
                  std::vector<Cursor>& cursors, int round, PutSide& side) {
  const int64_t cpu0 = ProcessCpuNs();
  const double wall = RunThreads(n, [&](int t) {
    Cursor& c = cursors[t];
    for (size_t op = 0; op < per_thread; ++op) {
      c.refused += s.Put(t, c.key, set[c.page].view()) < 0;
      c.Advance(set.size());
    }
  });
  const int64_t cpu = ProcessCpuNs() - cpu0;
  side.Record(round, static_cast<double>(n * per_thread), wall, cpu, cpu);
}

// What went wrong on the ring side, if anything: the figures only mean
// something if every put was sent and stored.
std::string RingPutWarnings(const RingHost& h, uint64_t expected_sent) {
  const GuestCounters g = h.GuestTotals();
  std::string w;
  if (g.puts_sent != expected_sent) {
    w += Fmt("; WARNING: %llu puts sent, %llu expected", U(g.puts_sent),
             U(expected_sent));
  }
  // Every counter that should have stayed 0, by name, so a warning says
  // what happened. The ring's own accounting (entries posted, completions
  // reaped) counts every put and is no warning.
  for (const auto& [name, value] : CounterList(g)) {
    const bool expected = name == "puts_sent" || name == "gets_hit" ||
                          name == "gets_miss" || name == "invalidates" ||
                          name == "pools_created" || name == "doorbells" ||
                          name == "doorbells_deferred" ||
                          name == "interrupt_waits" || name == "sqes_posted" ||
                          name == "completions_reaped";
    if (!expected && value > 0) {
      w += Fmt("; WARNING: guest %s = %llu", std::string(name).c_str(),
               U(value));
    }
  }
  for (const ChannelCounter c :
       {ChannelCounter::kSqeStoreErrors, ChannelCounter::kPutsDroppedByHost,
        ChannelCounter::kChannelResets, ChannelCounter::kRingCorruptIndex}) {
    if (h.MetricSum(c) > 0) {
      w += Fmt("; WARNING: channel %s = %llu",
               std::string(ChannelCounterName(c)).c_str(), U(h.MetricSum(c)));
    }
  }
  return w;
}

std::string LocalPutWarnings(const std::vector<Cursor>& cursors) {
  uint64_t refused = 0;
  for (const Cursor& c : cursors) refused += c.refused;
  return refused > 0
             ? Fmt("; WARNING: %llu in-process puts refused", U(refused))
             : "";
}

void Prefill(BenchStore& s, int vm, const PageSet& set) {
  for (uint64_t k = 0; k < kSteadyStateKeys; ++k) {
    s.Put(vm, k, set[k % set.size()].view());
  }
}

const char* const kPutMethod =
    "wall time from the first put to the last CQE reaped (the host has "
    "copied, compressed and stored every page); the guest copies into the "
    "slot and waits for room when the ring is full (never drops); the "
    "worker threads (tmemd's defaults: one per CPU, poll_us 50, batch 64) "
    "copy out and compress; steady state (every key already held)";

}  // namespace

void RunPutOneGuest(const PageSet& mix, const RingBenchOptions& o,
                    Progress& progress, ResultTable& table) {
  const size_t ops = mix.size();
  RingHost h(1, WorkerOptions{});
  BenchStore s(1, kStoreCapBytes);
  RingPrefill(h, 0, mix);
  Prefill(s, 0, mix);
  std::vector<Cursor> ring_cur = Cursors(1, mix.size());
  std::vector<Cursor> local_cur = Cursors(1, mix.size());
  PutSide ring, local;
  const uint64_t sent0 = h.GuestTotals().puts_sent;
  int passes = 0;
  const Rounds r =
      RunRingRounds(o, &mix, NoOwnWaitRule(), NoOwnWait, progress, [&](int i) {
        ++passes;
        RunRingPasses(
            i, {[&] { RingPutPass(h, 1, ops, mix, ring_cur, i, ring); },
                [&] { LocalPutPass(s, 1, ops, mix, local_cur, i, local); }});
      });
  const RatioFigures ratio(r, ring.rate, local.rate);
  const RatioFigures store_cpu(r, ring.store_cpu_ns_per_page,
                               local.store_cpu_ns_per_page);
  const double full =
      static_cast<double>(Waits(ring_cur)) / static_cast<double>(passes * ops);
  const std::string warnings =
      RingPutWarnings(h, sent0 + passes * ops) + LocalPutWarnings(local_cur);
  table.rows.push_back(Judged(
      {"put throughput: ring, 1 guest / in-process, 1 thread",
       SetLabel("mix", mix), Percentile(r.Pick(ring.rate), 0.5) / 1e3,
       Percentile(r.Pick(local.rate), 0.5) / 1e3, "kpages/s", ratio.used.median,
       "x", Goal::kAtLeast, kTargetRingPutOverInProcess,
       Fmt("median of %zu paired rounds, IQR %.3f-%.3f, all %d rounds %.3f; ",
           r.used.size(), ratio.used.p25, ratio.used.p75, r.count(),
           ratio.all) +
           r.Describe() + "; " + kPutMethod +
           Fmt("; ring full before %.0f%% of puts (host-bound)", 100 * full) +
           warnings},
      r));
  table.rows.push_back(Judged(
      {"put CPU per page: tmemd worker thread / in-process put",
       SetLabel("mix", mix),
       Percentile(r.Pick(ring.store_cpu_ns_per_page), 0.5),
       Percentile(r.Pick(local.store_cpu_ns_per_page), 0.5), "ns/page",
       store_cpu.used.median, "x", Goal::kAtMost,
       kTargetWorkerCpuPerPutOverInProcess,
       Fmt("median of %zu paired rounds, IQR %.3f-%.3f, all %d rounds %.3f; "
           "the worker's CPU (schedstat) per page: the host's whole cost of "
           "a ring put (slot copy, ring, compression, store); all threads "
           "incl. the guest, which spins while it waits for room: ring %.0f, "
           "in-process %.0f ns/page",
           r.used.size(), store_cpu.used.p25, store_cpu.used.p75, r.count(),
           store_cpu.all, Percentile(r.Pick(ring.cpu_ns_per_page), 0.5),
           Percentile(r.Pick(local.cpu_ns_per_page), 0.5))},
      r));
}

void RunPutFourGuests(const PageSet& mix, const RingBenchOptions& o,
                      Progress& progress, ResultTable& table) {
  constexpr int kGuests = 4;
  const size_t per_thread = mix.size() / 2;
  RingHost h(kGuests, WorkerOptions{});
  BenchStore s4(kGuests, kStoreCapBytes);
  BenchStore s1(1, kStoreCapBytes);
  for (int i = 0; i < kGuests; ++i) {
    RingPrefill(h, i, mix);
    Prefill(s4, i, mix);
  }
  Prefill(s1, 0, mix);
  std::vector<Cursor> ring_cur = Cursors(kGuests, mix.size());
  std::vector<Cursor> local4_cur = Cursors(kGuests, mix.size());
  std::vector<Cursor> local1_cur = Cursors(1, mix.size());
  PutSide ring, local4, local1;
  const uint64_t sent0 = h.GuestTotals().puts_sent;
  int passes = 0;
  // More busy threads than CPUs: waiting is by design, so a round counts
  // if the in-process passes got the CPUs they could use. The ring's guests
  // sleep while they wait for room, so its pass is judged by what other
  // processes took instead.
  const auto usable = [](int threads) {
    return std::min<double>(threads, std::thread::hardware_concurrency());
  };
  const Judge got_cpus = [&](int i, const Disturbance& d) {
    if (o.debug_rounds) {
      progress.Note(Fmt("round %d: CPUs ring %.2f, in-process 4 %.2f, 1 %.2f",
                        i, ring.cpus[i], local4.cpus[i], local1.cpus[i]));
    }
    return TwoCpus(d) && d.others_cpu <= kMaxOthersCpu &&
           local4.cpus[i] >= kMinCpuShare * usable(kGuests) &&
           local1.cpus[i] >= kMinCpuShare * usable(1);
  };
  const Rounds r = RunRingRounds(
      o, &mix,
      Fmt("each in-process pass got >= %.0f%% of min(busy threads, CPUs) in "
          "process CPU time, and other processes used <= %.1f CPUs",
          100 * kMinCpuShare, kMaxOthersCpu),
      got_cpus, progress, [&](int i) {
        ++passes;
        RunRingPasses(i, {[&] {
                            RingPutPass(h, kGuests, per_thread, mix, ring_cur,
                                        i, ring);
                          },
                          [&] {
                            LocalPutPass(s4, kGuests, per_thread, mix,
                                         local4_cur, i, local4);
                          },
                          [&] {
                            // The same total work on one thread.
                            LocalPutPass(s1, 1, kGuests * per_thread, mix,
                                         local1_cur, i, local1);
                          }});
      });
  const uint64_t total = static_cast<uint64_t>(passes) * kGuests * per_thread;
  const double full =
      static_cast<double>(Waits(ring_cur)) / static_cast<double>(total);
  const RatioFigures vs4(r, ring.rate, local4.rate);
  const RatioFigures vs1(r, ring.rate, local1.rate);
  const RatioFigures local_scaling(r, local4.rate, local1.rate);
  const RatioFigures ring_over_one_core(r, ring.rate, local1.rate);
  // The worker's CPU time over the pass's wall time.
  std::vector<double> busy;
  for (size_t i = 0; i < ring.rate.size(); ++i) {
    busy.push_back(ring.store_cpu_ns_per_page[i] * ring.rate[i] / 1e9);
  }
  const Spread worker_busy(r.Pick(busy));
  const std::string warnings = RingPutWarnings(h, sent0 + total) +
                               LocalPutWarnings(local4_cur) +
                               LocalPutWarnings(local1_cur);
  // Informational: on two CPUs the guests' page copies share the CPUs
  // with the workers, so this measures the machine as much as tmemd.
  table.rows.push_back(
      {"put throughput: ring, 4 guests / in-process, 4 threads",
       SetLabel("mix", mix), Percentile(r.Pick(ring.rate), 0.5) / 1e3,
       Percentile(r.Pick(local4.rate), 0.5) / 1e3, "kpages/s", vs4.used.median,
       "x", Goal::kInfo, 0,
       Fmt("median of %zu paired rounds, IQR %.3f-%.3f, all %d rounds %.3f; ",
           r.used.size(), vs4.used.p25, vs4.used.p75, r.count(), vs4.all) +
           r.Describe() +
           Fmt("; 4 guest threads + %d workers on %u CPUs; in-process 4 "
               "threads reached %.2fx one thread in the same rounds (the "
               "store runs on every core), the ring %.2fx; ",
               h.workers(), std::thread::hardware_concurrency(),
               local_scaling.used.median, ring_over_one_core.used.median) +
           kPutMethod +
           Fmt("; ring full before %.0f%% of puts; the workers ran %.0f%% of "
               "the wall time (summed over workers, in CPUs) at %.0f "
               "ns/page; CPU/page, all threads: ring %.0f ns, in-process "
               "%.0f ns",
               100 * full, 100 * worker_busy.median,
               Percentile(r.Pick(ring.store_cpu_ns_per_page), 0.5),
               Percentile(r.Pick(ring.cpu_ns_per_page), 0.5),
               Percentile(r.Pick(local4.cpu_ns_per_page), 0.5)) +
           warnings});
  table.rows.push_back(
      {"put throughput: ring, 4 guests / in-process, 1 thread",
       SetLabel("mix", mix), Percentile(r.Pick(ring.rate), 0.5) / 1e3,
       Percentile(r.Pick(local1.rate), 0.5) / 1e3, "kpages/s", vs1.used.median,
       "x", Goal::kInfo, 0,
       Fmt("median of %zu paired rounds, IQR %.3f-%.3f; the same total puts "
           "on one thread: the worker's speed against one core's, with the "
           "guests' copies on the other core",
           r.used.size(), vs1.used.p25, vs1.used.p75)});
}

}  // namespace tmem::bench::ring
