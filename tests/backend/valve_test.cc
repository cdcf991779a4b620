// Valve decision logic, driven by hand-made CPU samples (no clock, no /proc).
#include "backend/valve.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/page_charge.h"
#include "backend/tmem_store.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::Page;
using test::RandomPage;

constexpr uint32_t kAll = 65536;
constexpr int64_t kPeriodNs = 100'000'000;  // 100 ms

// A host whose counters the test moves: each Advance is one period with the
// given whole-host busy share (others + tmemd) and tmemd share.
class FakeHost {
 public:
  explicit FakeHost(int cpus = 2) { s_.num_cpus = cpus; }
  CpuSample Advance(double busy, double agent, double pressure = -1) {
    const auto total = static_cast<uint64_t>(kPeriodNs) * s_.num_cpus;
    s_.wall_nanos += kPeriodNs;
    s_.host_total_nanos += total;
    s_.host_busy_nanos +=
        static_cast<uint64_t>(busy * static_cast<double>(total));
    s_.agent_nanos += static_cast<uint64_t>(agent * static_cast<double>(total));
    s_.has_pressure = pressure >= 0;
    s_.pressure_some_avg10 = pressure < 0 ? 0 : pressure;
    return s_;
  }

 private:
  CpuSample s_;
};

ValveOptions TestOptions() {
  ValveOptions o;
  o.smoothing = 1.0;  // no EWMA lag: each tick sees exactly its sample
  o.cpu_budget_percent = 25;
  o.spare_cpu_fraction = 0.8;
  o.cpu_floor_percent = 0;
  o.min_samples = 100;
  o.min_dwell_periods = 3;
  o.reuse_window_decay = 0.5;
  return o;
}

VmPolicy Policy(uint32_t weight = 100, ValveMode mode = ValveMode::kDefault) {
  VmPolicy p;
  p.weight = weight;
  p.mode = mode;
  return p;
}

// Makes `vm` want more CPU than it has: charge a lot, then decide once.
void Starve(Valve& v, VmId vm) {
  v.ChargeCpu(vm, 10 * kPeriodNs);
  v.Decide(vm, 1, true);
}

uint64_t Count(const Valve& v, VmId vm, ValveCounter c) {
  return v.VmStatus(vm).counters[static_cast<int>(c)];
}

// One sample period of VM 1 on an idle host: `puts` puts of fresh keys,
// every `hit_every`-th of them read back as a hit (0: none), then a tick.
void ReusePeriod(Valve& v, FakeHost& host, uint64_t& key, int puts,
                 int hit_every = 0) {
  for (int i = 0; i < puts; ++i) {
    v.Decide(1, ++key, true);
    if (hit_every > 0 && i % hit_every == 0) v.RecordGet(1, key, true);
  }
  v.Tick(host.Advance(0, 0));
}

// Ticks once, then adds VM 1, which says its RAM (judged after 2 x that).
void AddVmSayingItsRam(Valve& v, FakeHost& host, uint64_t ram_pages) {
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  v.OnGuestRamPages(1, ram_pages);
}

TEST(ValveTest, ValidateOptionsRejectsNonsense) {
  ValveOptions o;
  EXPECT_TRUE(Valve::ValidateOptions(o).ok());
  o.default_mode = ValveMode::kDefault;
  EXPECT_FALSE(Valve::ValidateOptions(o).ok());
  o = ValveOptions{};
  o.cpu_budget_percent = 150;
  EXPECT_FALSE(Valve::ValidateOptions(o).ok());
  o = ValveOptions{};
  o.throttle_below = 0.2;
  o.restore_above = 0.1;  // no hysteresis gap
  EXPECT_FALSE(Valve::ValidateOptions(o).ok());
  o = ValveOptions{};
  o.min_admission = 0;
  EXPECT_FALSE(Valve::ValidateOptions(o).ok());
}

TEST(ValveTest, ModesOffAndAlwaysIgnoreCpu) {
  Valve v(TestOptions());
  v.AddVm(1, Policy(100, ValveMode::kOff));
  v.AddVm(2, Policy(100, ValveMode::kAlways));
  Starve(v, 2);  // deep in debt: always compresses anyway
  EXPECT_EQ(v.Decide(1, 7, true), PutMode::kDrop);
  EXPECT_EQ(v.AdmissionHint(1), 0u);
  EXPECT_EQ(v.Decide(2, 7, true), PutMode::kCompress);
  EXPECT_EQ(v.AdmissionHint(2), kAll);
  EXPECT_EQ(Count(v, 1, ValveCounter::kDroppedOff), 1u);

  // The host default applies to VMs on kDefault, and follows SetOptions.
  v.AddVm(3, Policy());
  EXPECT_EQ(v.VmStatus(3).effective_mode, ValveMode::kAdaptive);
  ValveOptions o = TestOptions();
  o.default_mode = ValveMode::kOff;
  ASSERT_TRUE(v.SetOptions(o).ok());
  EXPECT_EQ(v.Decide(3, 7, true), PutMode::kDrop);
  EXPECT_EQ(v.AdmissionHint(3), 0u);
}

TEST(ValveTest, DeferredCompressionDefersAdaptiveOnly) {
  ValveOptions o = TestOptions();
  o.deferred_compression = true;
  Valve v(o);
  v.AddVm(1, Policy());  // adaptive (host default), tokens to spend
  v.AddVm(2, Policy(100, ValveMode::kAlways));
  EXPECT_EQ(v.Decide(1, 7, true), PutMode::kDefer);
  EXPECT_EQ(Count(v, 1, ValveCounter::kCompressed), 1u);
  EXPECT_EQ(v.Decide(2, 7, true), PutMode::kCompress);  // always: in the put
  // Out of tokens: stored raw now and queued too, so idle cycles compress
  // it later (deferred compression: a page raw for want of CPU is not raw
  // for good),
  // and only idle cycles, even when memory is tight: the VM has no tokens.
  Starve(v, 1);
  const uint64_t raw = Count(v, 1, ValveCounter::kRaw);
  EXPECT_EQ(v.Decide(1, 8, true), PutMode::kDeferIdle);
  EXPECT_EQ(Count(v, 1, ValveCounter::kRaw), raw + 1);
  // The per-host switch back to synchronous compression.
  o.deferred_compression = false;
  ASSERT_TRUE(v.SetOptions(o).ok());
  v.AddVm(3, Policy());
  EXPECT_EQ(v.Decide(3, 7, true), PutMode::kCompress);
}

TEST(ValveTest, AGuestStandingAsideIsAdmittedNothingInAnyMode) {
  Valve v(TestOptions());
  v.AddVm(1, Policy(100, ValveMode::kAdaptive));
  v.AddVm(2, Policy(100, ValveMode::kAlways));
  v.AddVm(3, Policy(100, ValveMode::kAdaptive));
  for (VmId vm : {1u, 2u}) v.OnGuestStandingAside(vm, true);
  for (VmId vm : {1u, 2u}) {
    SCOPED_TRACE(vm);
    EXPECT_TRUE(v.VmStatus(vm).standing_aside);
    EXPECT_EQ(v.AdmissionHint(vm), 0u);
    EXPECT_EQ(v.VmStatus(vm).admission, 0u);
    // Even a guest that sends anyway (or ignores the hint) gets drops.
    EXPECT_EQ(v.Decide(vm, 7, true), PutMode::kDrop);
    EXPECT_EQ(v.Decide(vm, 8, false), PutMode::kDrop);
    EXPECT_EQ(Count(v, vm, ValveCounter::kDroppedAside), 2u);
  }
  // Other VMs are not affected.
  EXPECT_EQ(v.AdmissionHint(3), kAll);
  EXPECT_EQ(v.Decide(3, 7, true), PutMode::kCompress);
  // Back in: admission as before.
  v.OnGuestStandingAside(1, false);
  EXPECT_FALSE(v.VmStatus(1).standing_aside);
  EXPECT_EQ(v.AdmissionHint(1), kAll);
  EXPECT_EQ(v.Decide(1, 9, true), PutMode::kCompress);
  // Unknown VMs are ignored.
  v.OnGuestStandingAside(99, true);
}

TEST(ValveTest, AdaptiveCompressesWithTokensThenRawThenDrops) {
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  v.Tick(host.Advance(0, 0));  // budget 25% of 2 CPUs: 50 ms per period
  const ValveVmStatus st = v.VmStatus(1);
  ASSERT_GT(st.cpu_tokens_ns, 0);
  EXPECT_EQ(v.Decide(1, 1, true), PutMode::kCompress);
  // Spend the tokens: raw (a memcpy) while in debt of under one share...
  v.ChargeCpu(1, st.cpu_tokens_ns + 1);
  EXPECT_EQ(v.Decide(1, 2, true), PutMode::kRaw);
  // ...and a whole share beyond it: still raw for a guest that applies the
  // admission hint (the hint is what throttles it), dropped for one that
  // ignores the hint.
  v.ChargeCpu(1, v.VmStatus(1).cpu_share_ns + 1);
  EXPECT_EQ(v.Decide(1, 3, true), PutMode::kRaw);
  EXPECT_EQ(v.Decide(1, 4, false), PutMode::kDrop);
  EXPECT_EQ(Count(v, 1, ValveCounter::kCompressed), 1u);
  EXPECT_EQ(Count(v, 1, ValveCounter::kRaw), 2u);
  EXPECT_EQ(Count(v, 1, ValveCounter::kDroppedCpu), 1u);
}

TEST(ValveTest, BudgetIsSplitByWeightAmongHungryVms) {
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy(100));
  v.AddVm(2, Policy(300));
  Starve(v, 1);
  Starve(v, 2);
  v.Tick(host.Advance(0, 0));
  const int64_t s1 = v.VmStatus(1).cpu_share_ns;
  const int64_t s2 = v.VmStatus(2).cpu_share_ns;
  // 25% of 2 CPUs over 100 ms = 50 ms, split 1:3.
  EXPECT_NEAR(static_cast<double>(s1), 12.5e6, 0.01e6);
  EXPECT_NEAR(static_cast<double>(s2), 37.5e6, 0.01e6);
}

TEST(ValveTest, UnusedShareIsLent) {
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy(100));  // light: uses 1 ms per period
  v.AddVm(2, Policy(100));  // hungry
  for (int i = 0; i < 3; ++i) {
    v.ChargeCpu(1, 1'000'000);
    Starve(v, 2);
    v.Tick(host.Advance(0, 0));
  }
  const int64_t s1 = v.VmStatus(1).cpu_share_ns;
  const int64_t s2 = v.VmStatus(2).cpu_share_ns;
  // The light VM keeps what it uses (plus margin); the rest goes to the
  // hungry one, far beyond its 25 ms fair share.
  EXPECT_GE(s1, 1'000'000);
  EXPECT_LT(s1, 3'000'000);
  EXPECT_GT(s2, 45'000'000);
  EXPECT_NEAR(static_cast<double>(s1 + s2), 50e6, 0.01e6);
}

TEST(ValveTest, BudgetUsesOnlySpareCpuAndShrinksUnderPressure) {
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.Tick(host.Advance(0.0, 0.0));
  EXPECT_NEAR(v.HostStatus().budget_fraction, 0.25, 1e-9);
  // Others use 90% of the host: 10% spare x 0.8.
  v.Tick(host.Advance(0.95, 0.05));
  EXPECT_NEAR(v.HostStatus().budget_fraction, 0.08, 1e-6);
  // tmemd's own use does not count against it: 30% busy, all tmemd.
  v.Tick(host.Advance(0.30, 0.30));
  EXPECT_NEAR(v.HostStatus().budget_fraction, 0.25, 1e-6);
  // Pressure halfway between start (20) and full (80): half the budget.
  v.Tick(host.Advance(0.0, 0.0, 50.0));
  EXPECT_NEAR(v.HostStatus().budget_fraction, 0.125, 1e-6);
  v.Tick(host.Advance(0.0, 0.0, 95.0));
  EXPECT_EQ(v.HostStatus().budget_fraction, 0.0);
}

TEST(ValveTest, SaturatedHostGetsRawPutsAndGuestsToldToStopSending) {
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  v.Tick(host.Advance(1.0, 0.0));  // others take every cycle
  EXPECT_EQ(v.HostStatus().budget_fraction, 0.0);
  v.ChargeCpu(1, v.VmStatus(1).cpu_tokens_ns + 1);
  EXPECT_EQ(v.Decide(1, 1, true), PutMode::kRaw);
  // Every period it keeps spending with no budget: admission halves each
  // period down to the floor.
  uint32_t last = v.AdmissionHint(1);
  for (int i = 0; i < 12; ++i) {
    v.ChargeCpu(1, 5'000'000);
    v.Decide(1, 2, true);
    v.Tick(host.Advance(1.0, 0.0));
    const uint32_t now = v.AdmissionHint(1);
    EXPECT_LE(now, last);
    last = now;
  }
  EXPECT_EQ(last, o.min_admission);
  EXPECT_FALSE(v.VmStatus(1).throttled);  // CPU, not reuse
  // The floor knob keeps a trickle of budget on a saturated host.
  ValveOptions floor = o;
  floor.cpu_floor_percent = 2;
  ASSERT_TRUE(v.SetOptions(floor).ok());
  v.Tick(host.Advance(1.0, 0.0));
  EXPECT_NEAR(v.HostStatus().budget_fraction, 0.02, 1e-9);
}

// The budget bounds all of tmemd: CPU no VM was charged for (polling,
// wake-ups) is taken out of it before the VMs' buckets are filled.
TEST(ValveTest, CpuNoVmWasChargedForComesOutOfTheBudget) {
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  // VM 1 spends all its tokens (and wants more); tmemd used that plus
  // 20 ms no VM was charged for: 10% of the 200 ms the 2 CPUs had.
  const int64_t tokens = v.VmStatus(1).cpu_tokens_ns;
  ASSERT_GT(tokens, 0);
  v.ChargeCpu(1, tokens + 1);
  EXPECT_EQ(v.Decide(1, 1, true), PutMode::kRaw);
  const double agent =
      static_cast<double>(tokens + 1 + 20'000'000) / (2.0 * kPeriodNs);
  v.Tick(host.Advance(agent, agent));
  ValveHostStatus hs = v.HostStatus();
  EXPECT_NEAR(hs.budget_fraction, 0.25, 1e-9);
  EXPECT_NEAR(hs.overhead_fraction, 0.10, 1e-6);
  EXPECT_NEAR(hs.token_fraction, 0.15, 1e-6);
  EXPECT_NEAR(static_cast<double>(v.VmStatus(1).cpu_share_ns),
              0.15 * 2 * kPeriodNs, 1e3);
  // Overhead beyond the budget leaves the floor, never less.
  ValveOptions floor = TestOptions();
  floor.cpu_floor_percent = 2;
  ASSERT_TRUE(v.SetOptions(floor).ok());
  v.Tick(host.Advance(0.40, 0.40));
  hs = v.HostStatus();
  EXPECT_NEAR(hs.overhead_fraction, 0.40, 1e-6);
  EXPECT_NEAR(hs.token_fraction, 0.02, 1e-9);
}

// Out of CPU, a VM whose puts come back is stored raw, not told to send
// less: each page that comes back saves more CPU than it cost. One whose
// puts do not come back is cut as before.
TEST(ValveTest, VmWhosePutsComeBackIsNotCutForCpu) {
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());  // re-reader: every put read back
  v.AddVm(2, Policy());  // no reuse
  uint64_t key = 0;
  for (int period = 0; period < 12; ++period) {
    for (VmId vm : {VmId{1}, VmId{2}}) {
      v.ChargeCpu(vm, 50'000'000);  // far beyond any share
      for (int i = 0; i < 50; ++i) {
        ++key;
        EXPECT_NE(v.Decide(vm, key, true), PutMode::kDrop);
        if (vm == 1) v.RecordGet(vm, key, true);
      }
    }
    v.Tick(host.Advance(1.0, 0.0));  // others take every cycle
  }
  EXPECT_EQ(v.AdmissionHint(1), kAll);
  EXPECT_GT(Count(v, 1, ValveCounter::kRaw), 0u);
  EXPECT_EQ(v.AdmissionHint(2), o.min_admission);
}

TEST(ValveTest, AdmissionComesBackWhenTheVmFitsItsShareAgain) {
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  for (int i = 0; i < 8; ++i) {  // overspend: 200 ms per 50 ms budget
    v.ChargeCpu(1, 200'000'000);
    v.Decide(1, 2, true);
    v.Tick(host.Advance(0.5, 0.5));
  }
  ASSERT_LT(v.AdmissionHint(1), kAll / 8);
  for (int i = 0; i < 20; ++i) {  // then only 1 ms per period
    v.ChargeCpu(1, 1'000'000);
    v.Tick(host.Advance(0.0, 0.0));
  }
  EXPECT_EQ(v.AdmissionHint(1), kAll);
}

TEST(ValveTest, StreamingVmIsThrottledAndRecoversWhenPagesReturn) {
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  uint64_t key = 0;
  // Streaming: many puts, no gets.
  for (int period = 0; period < 6; ++period) ReusePeriod(v, host, key, 500);
  ValveVmStatus st = v.VmStatus(1);
  EXPECT_TRUE(st.throttled);
  EXPECT_EQ(st.admission, o.min_admission);
  EXPECT_EQ(v.AdmissionHint(1), o.min_admission);
  EXPECT_EQ(Count(v, 1, ValveCounter::kThrottleEvents), 1u);

  // The sampled puts start coming back. Throttled, the VM stores none of
  // them: each is a ghost, and a get of it (a miss) is a ghost hit, which
  // counts as reuse: restored after the dwell time.
  for (int period = 0; period < 6; ++period) {
    for (int i = 0; i < 20; ++i) {
      const bool throttled = v.VmStatus(1).throttled;
      const PutMode put = v.Decide(1, ++key, true);
      if (throttled) {
        EXPECT_EQ(put, PutMode::kDrop);
      }
      v.RecordGet(1, key, put != PutMode::kDrop);
    }
    v.Tick(host.Advance(0, 0));
  }
  EXPECT_GT(Count(v, 1, ValveCounter::kGhostHits), 0u);
  st = v.VmStatus(1);
  EXPECT_FALSE(st.throttled);
  EXPECT_EQ(st.admission, kAll);
  EXPECT_EQ(Count(v, 1, ValveCounter::kRestoreEvents), 1u);
}

// A guest that re-reads a data set cyclically (the real-guest streaming
// case: files read again and again, never fitting): every
// page-cache miss asks for the page (a get), every eviction offers it (a put
// the guest sends at the admission rate it is told), and the host keeps the
// last `capacity` admitted pages (LRU), evicting the oldest. Returns the
// VM's status after `periods` periods of `misses` page-cache misses each.
// Each tick gets `store`'s memory sample, as tmemd's valve ticker does.
struct CyclicResult {
  ValveVmStatus status;
  uint64_t hits = 0;
  uint64_t puts_sent = 0;
};
CyclicResult CyclicReread(Valve& v, FakeHost& host, const TmemStore& store,
                          VmId vm, uint64_t keys, size_t capacity, int periods,
                          int misses = 500) {
  CyclicResult out;
  std::list<uint64_t> lru;  // front: newest
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> held;
  uint64_t credit = 0;
  uint64_t next = 0;
  const ObjectId oid = ObjectId::FromInode(77);
  for (int period = 0; period < periods; ++period) {
    for (int i = 0; i < misses; ++i) {
      const uint64_t k = next++ % keys;
      const uint64_t hash = KeyHash(oid, k);
      auto it = held.find(k);
      const bool hit = it != held.end();
      if (hit) {  // exclusive get: the page leaves the host
        lru.erase(it->second);
        held.erase(it);
        ++out.hits;
      }
      v.RecordGet(vm, hash, hit);
      // The guest evicts some page later; model it as this one, sent at
      // the admission rate (evenly, as the guest library samples).
      const uint32_t admission = v.AdmissionHint(vm);
      credit += admission;
      if (credit < 65536) continue;
      credit -= 65536;
      ++out.puts_sent;
      if (v.Decide(vm, hash, true) == PutMode::kDrop) continue;
      lru.push_front(k);
      held[k] = lru.begin();
      if (lru.size() > capacity) {
        const uint64_t victim = lru.back();
        lru.pop_back();
        held.erase(victim);
        v.RecordEviction(vm, KeyHash(oid, victim));
      }
    }
    v.Tick(host.Advance(0, 0), SampleStoreMemory(store));
  }
  out.status = v.VmStatus(vm);
  return out;
}

// What a VM's share of the cap holds here: 1 MiB of raw pages.
constexpr size_t kReachPages = (1 << 20) / (kPageSize + kPageEntryCharge);

std::unique_ptr<TmemStore> OneMiBStore() {
  StoreOptions so;
  so.memory_cap_bytes = 1 << 20;
  so.address_space_bytes = 64 << 20;
  so.num_shards = 1;
  absl::StatusOr<std::unique_ptr<TmemStore>> store = TmemStore::Create(so);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

TEST(ValveTest, CyclicRereadFarBeyondTheCapIsThrottled) {
  // Gets of pages the host evicted long ago are not evidence that admitting
  // pays: at a reuse distance of 40 times what the VM's share of the cap
  // holds, no admitted page could have survived until its get.
  std::unique_ptr<TmemStore> store = OneMiBStore();
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0), SampleStoreMemory(*store));
  absl::StatusOr<VmId> vm = store->AddVm("streamer", Policy());
  ASSERT_TRUE(vm.ok());
  v.AddVm(*vm, Policy());
  const CyclicResult r =
      CyclicReread(v, host, *store, *vm, 40 * kReachPages, kReachPages, 80);
  EXPECT_TRUE(r.status.throttled) << "reuse ratio " << r.status.reuse_ratio;
  EXPECT_EQ(r.status.admission, o.min_admission);
  EXPECT_GT(Count(v, *vm, ValveCounter::kGhostHitsFar), 0u);
}

TEST(ValveTest, CyclicRereadJustBeyondTheCapStaysAdmitted) {
  // A working set of 1.5x what the share holds: LRU misses every page, but
  // each comes back within the share's reach of its eviction, so more
  // memory (or a better-placed share) would hit: keep admitting.
  std::unique_ptr<TmemStore> store = OneMiBStore();
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0), SampleStoreMemory(*store));
  absl::StatusOr<VmId> vm = store->AddVm("rereader", Policy());
  ASSERT_TRUE(vm.ok());
  v.AddVm(*vm, Policy());
  const CyclicResult r =
      CyclicReread(v, host, *store, *vm, kReachPages * 3 / 2, kReachPages, 80);
  EXPECT_FALSE(r.status.throttled) << "reuse ratio " << r.status.reuse_ratio;
  EXPECT_EQ(r.status.admission, kAll);
  EXPECT_GT(Count(v, *vm, ValveCounter::kGhostHits), 1000u);
}

TEST(ValveTest, RereadOfMoreThanGuestRamIsNotJudgedOnItsFirstPass) {
  // A guest of 2000 pages re-reads 3000: its first pass evicts ~1000 pages
  // before anything can come back. Judged only after 2 x RAM evictions, it
  // is still fully admitted when its pages start to return.
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  AddVmSayingItsRam(v, host, 2000);
  uint64_t key = 0;
  for (int period = 0; period < 7; ++period) ReusePeriod(v, host, key, 500);
  ValveVmStatus st = v.VmStatus(1);
  EXPECT_EQ(st.guest_ram_pages, 2000u);
  EXPECT_EQ(st.judge_after_evictions, 4000u);
  EXPECT_EQ(st.evictions_in_state, 3500u);
  EXPECT_FALSE(st.throttled);
  EXPECT_EQ(st.admission, kAll);
  // Its second pass: every page it put comes back.
  for (int period = 0; period < 6; ++period) {
    ReusePeriod(v, host, key, 500, /*hit_every=*/1);
  }
  st = v.VmStatus(1);
  EXPECT_FALSE(st.throttled);
  EXPECT_EQ(Count(v, 1, ValveCounter::kThrottleEvents), 0u);
}

TEST(ValveTest, StreamerThatSaysItsRamIsThrottledOnceThatManyEvictionsPass) {
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  AddVmSayingItsRam(v, host, 1000);  // judged after 2000 evictions
  uint64_t key = 0;
  for (int period = 0; period < 3; ++period) ReusePeriod(v, host, key, 500);
  EXPECT_FALSE(v.VmStatus(1).throttled);  // 1500 evictions: too early
  for (int period = 0; period < 3; ++period) ReusePeriod(v, host, key, 500);
  EXPECT_TRUE(v.VmStatus(1).throttled);
  EXPECT_EQ(v.AdmissionHint(1), o.min_admission);
  // A guest that claims a huge RAM is bounded by its reach.
  std::unique_ptr<TmemStore> store = OneMiBStore();
  Valve capped(o);
  capped.Tick(host.Advance(0, 0), SampleStoreMemory(*store));
  absl::StatusOr<VmId> vm = store->AddVm("liar", Policy());
  ASSERT_TRUE(vm.ok());
  capped.AddVm(*vm, Policy());
  EXPECT_EQ(capped.ReachPages(*vm), 0u) << "not known before a tick";
  capped.OnGuestRamPages(*vm, uint64_t{1} << 40);
  capped.Tick(host.Advance(0, 0), SampleStoreMemory(*store));
  const ValveVmStatus st = capped.VmStatus(*vm);
  EXPECT_LE(st.judge_after_evictions, st.reach_pages);
  EXPECT_LT(st.judge_after_evictions, uint64_t{1} << 20);
  // What the guest is told (tmem_abi.h reach_pages): the same reach.
  EXPECT_GT(capped.ReachPages(*vm), 0u);
  EXPECT_EQ(capped.ReachPages(*vm), st.reach_pages);
}

TEST(ValveTest, StreamerIsCutByThePutThatReachesItsThresholdNotAtTheTick) {
  // Between two ticks a fast streamer evicts thousands of pages; each one
  // admitted after its threshold is a copy its guest makes for nothing.
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  AddVmSayingItsRam(v, host, 1000);  // judged after 2000 evictions
  uint64_t key = 0;
  for (int period = 0; period < 3; ++period) ReusePeriod(v, host, key, 500);
  // 1500 evictions, no tick from here on.
  for (int i = 0; i < 499; ++i) v.Decide(1, ++key, true);
  EXPECT_FALSE(v.VmStatus(1).throttled);
  EXPECT_EQ(v.AdmissionHint(1), kAll);
  v.Decide(1, ++key, true);  // the 2000th
  EXPECT_TRUE(v.VmStatus(1).throttled);
  EXPECT_EQ(v.AdmissionHint(1), o.min_admission);
  EXPECT_EQ(Count(v, 1, ValveCounter::kThrottleEvents), 1u);
  // The ticks after it agree (no second event, no flapping).
  for (int period = 0; period < 3; ++period) ReusePeriod(v, host, key, 10);
  EXPECT_TRUE(v.VmStatus(1).throttled);
  EXPECT_EQ(Count(v, 1, ValveCounter::kThrottleEvents), 1u);

  // A VM whose puts come back is not cut at its threshold.
  Valve reuse(o);
  AddVmSayingItsRam(reuse, host, 1000);
  key = 0;
  for (int period = 0; period < 3; ++period) {
    ReusePeriod(reuse, host, key, 500, /*hit_every=*/10);
  }
  for (int i = 0; i < 600; ++i) {
    reuse.Decide(1, ++key, true);
    if (i % 10 == 0) reuse.RecordGet(1, key, true);
  }
  EXPECT_FALSE(reuse.VmStatus(1).throttled);
  EXPECT_EQ(reuse.AdmissionHint(1), kAll);
}

TEST(ValveTest, ReuseBetweenThresholdsDoesNotFlap) {
  const ValveOptions o = TestOptions();  // throttle < 0.02, restore > 0.08
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  uint64_t key = 0;
  // 5% reuse: neither throttles an admitted VM...
  for (int period = 0; period < 20; ++period) {
    ReusePeriod(v, host, key, 200, /*hit_every=*/20);
    EXPECT_FALSE(v.VmStatus(1).throttled) << "period " << period;
  }
  // ...nor restores a throttled one.
  for (int period = 0; period < 8; ++period) ReusePeriod(v, host, key, 200);
  ASSERT_TRUE(v.VmStatus(1).throttled);
  for (int period = 0; period < 20; ++period) {
    ReusePeriod(v, host, key, 200, /*hit_every=*/20);
    EXPECT_TRUE(v.VmStatus(1).throttled) << "period " << period;
  }
  EXPECT_EQ(Count(v, 1, ValveCounter::kThrottleEvents), 1u);
  EXPECT_EQ(Count(v, 1, ValveCounter::kRestoreEvents), 0u);
}

TEST(ValveTest, FewSamplesNeverThrottle) {
  Valve v(TestOptions());  // min_samples 100
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  uint64_t key = 0;
  for (int period = 0; period < 30; ++period) ReusePeriod(v, host, key, 10);
  EXPECT_FALSE(v.VmStatus(1).throttled);
}

// A VM throttled for no reuse stores nothing: the sample its guest still
// sends (or the valve takes, for a guest that ignores the hint) becomes a
// ghost, which shows reuse as well as a stored page would, and the rest is
// dropped too. Every put is counted as dropped for reuse.
TEST(ValveTest, AThrottledVmStoresNothingWhetherOrNotItsGuestSamples) {
  const ValveOptions o = TestOptions();
  Valve v(o);
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  uint64_t key = 0;
  for (int period = 0; period < 6; ++period) ReusePeriod(v, host, key, 500);
  ASSERT_TRUE(v.VmStatus(1).throttled);
  const uint64_t dropped_before = Count(v, 1, ValveCounter::kDroppedReuse);
  const uint64_t stored_before =
      Count(v, 1, ValveCounter::kCompressed) + Count(v, 1, ValveCounter::kRaw);
  const int n = 64 * 100;
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(v.Decide(1, ++key, /*guest_applies_hint=*/i % 2 == 0),
              PutMode::kDrop);
  }
  EXPECT_EQ(Count(v, 1, ValveCounter::kDroppedReuse) - dropped_before,
            static_cast<uint64_t>(n));
  EXPECT_EQ(
      Count(v, 1, ValveCounter::kCompressed) + Count(v, 1, ValveCounter::kRaw),
      stored_before)
      << "nothing stored";
  v.RecordGet(1, key, false);
  EXPECT_EQ(Count(v, 1, ValveCounter::kGhostHits), 1u)
      << "the dropped sample is a ghost";
}

TEST(ValveTest, GetOfADroppedKeyIsAGhostHitAndCountsAsReuse) {
  Valve v(TestOptions());
  FakeHost host;
  v.Tick(host.Advance(0, 0));
  v.AddVm(1, Policy());
  v.Tick(host.Advance(1.0, 0.0));  // no budget
  v.ChargeCpu(1, v.VmStatus(1).cpu_tokens_ns + v.VmStatus(1).cpu_share_ns + 1);
  ASSERT_EQ(v.Decide(1, 0xabcdef, /*guest_applies_hint=*/false),
            PutMode::kDrop);
  v.RecordGet(1, 0x123456, false);  // an unrelated miss: no ghost
  EXPECT_EQ(Count(v, 1, ValveCounter::kGhostHits), 0u);
  v.RecordGet(1, 0xabcdef, false);
  EXPECT_EQ(Count(v, 1, ValveCounter::kGhostHits), 1u);
  v.RecordGet(1, 0xabcdef, false);  // taken once
  EXPECT_EQ(Count(v, 1, ValveCounter::kGhostHits), 1u);
}

TEST(ValveTest, StoreEvictionsBecomeGhosts) {
  ValveOptions vo = TestOptions();
  Valve v(vo);
  StoreOptions so;
  so.memory_cap_bytes = 1 << 20;
  so.address_space_bytes = 64 << 20;
  so.num_shards = 4;
  so.eviction_listener = &v;
  auto store = TmemStore::Create(so);
  ASSERT_TRUE(store.ok());
  auto vm = (*store)->AddVm("a", VmPolicy{});
  ASSERT_TRUE(vm.ok());
  v.AddVm(*vm, VmPolicy{});
  auto pool = (*store)->NewPool(*vm, nullptr);
  ASSERT_TRUE(pool.ok());
  const ObjectId oid = ObjectId::FromInode(42);
  // Far more pages than 1 MiB holds: the first ones get evicted.
  for (uint64_t i = 0; i < 2000; ++i) {
    const Page page = RandomPage(i);
    ASSERT_TRUE(
        (*store)->Put(*vm, *pool, oid, i, ConstPage(page), PutMode::kRaw).ok());
  }
  Page out{};
  absl::StatusOr<bool> hit =
      (*store)->Get(*vm, *pool, oid, 0, MutablePage(out));
  ASSERT_TRUE(hit.ok());
  ASSERT_FALSE(*hit);
  v.RecordGet(*vm, KeyHash(oid, 0), false);
  EXPECT_EQ(Count(v, *vm, ValveCounter::kGhostHits), 1u);
  // Memory headroom: the store is full, so a VM out of tokens drops.
  FakeHost host;
  v.Tick(host.Advance(0, 0), SampleStoreMemory(**store));
  v.Tick(host.Advance(0, 0), SampleStoreMemory(**store));
  v.ChargeCpu(*vm, v.VmStatus(*vm).cpu_tokens_ns + 1);
  EXPECT_EQ(v.Decide(*vm, 99, true), PutMode::kDrop);
  EXPECT_EQ(Count(v, *vm, ValveCounter::kDroppedMemory), 1u);
}

// Short of memory, only a VM holding its share of the cap is refused raw
// puts; one below its share stores raw and the store evicts from the VM
// above its share.
TEST(ValveTest, MemoryShortageDropsOnlyForVmsHoldingTheirShare) {
  Valve v(TestOptions());
  StoreOptions so;
  so.memory_cap_bytes = 1 << 20;
  so.address_space_bytes = 64 << 20;
  so.num_shards = 4;
  so.eviction_listener = &v;
  auto store = TmemStore::Create(so);
  ASSERT_TRUE(store.ok());
  auto full = (*store)->AddVm("full", VmPolicy{});
  auto empty = (*store)->AddVm("empty", VmPolicy{});
  ASSERT_TRUE(full.ok() && empty.ok());
  v.AddVm(*full, VmPolicy{});
  v.AddVm(*empty, VmPolicy{});
  auto pool = (*store)->NewPool(*full, nullptr);
  auto empty_pool = (*store)->NewPool(*empty, nullptr);
  ASSERT_TRUE(pool.ok() && empty_pool.ok());
  const ObjectId oid = ObjectId::FromInode(42);
  for (uint64_t i = 0; i < 2000; ++i) {
    const Page page = RandomPage(i);
    ASSERT_TRUE((*store)
                    ->Put(*full, *pool, oid, i, ConstPage(page), PutMode::kRaw)
                    .ok());
  }
  FakeHost host;
  v.Tick(host.Advance(0, 0), SampleStoreMemory(**store));
  v.Tick(host.Advance(0, 0), SampleStoreMemory(**store));
  for (VmId vm : {*full, *empty}) {
    v.ChargeCpu(vm, v.VmStatus(vm).cpu_tokens_ns + 1);
  }
  EXPECT_EQ(v.Decide(*full, 1, true), PutMode::kDrop);
  EXPECT_EQ(Count(v, *full, ValveCounter::kDroppedMemory), 1u);
  EXPECT_EQ(v.Decide(*empty, 2, true), PutMode::kRaw);
  EXPECT_EQ(Count(v, *empty, ValveCounter::kDroppedMemory), 0u);
  // The raw put makes the store evict from the VM above its share.
  const uint64_t full_held =
      (*store)
          ->GetVmStats(*full)
          ->counters[static_cast<int>(Counter::kPagesHeld)];
  const Page page = RandomPage(7);
  ASSERT_TRUE(
      (*store)
          ->Put(*empty, *empty_pool, oid, 0, ConstPage(page), PutMode::kRaw)
          .ok());
  EXPECT_LT((*store)
                ->GetVmStats(*full)
                ->counters[static_cast<int>(Counter::kPagesHeld)],
            full_held);
}

TEST(ValveTest, MemoryHeadroomComesFromTheSampleItIsGiven) {
  // The valve reads no store: headroom is whatever the caller's memory
  // sample says, and a sample that knows nothing (cap 0) changes nothing.
  const ValveOptions o = TestOptions();  // memory_headroom_fraction 0.05
  Valve v(o);
  v.AddVm(1, Policy());
  FakeHost host;
  MemorySample roomy;
  roomy.cap_bytes = 100 << 20;
  roomy.used_bytes = 50 << 20;
  MemorySample full = roomy;
  full.used_bytes = 99 << 20;
  // VM 1 holds all of it: its share and more (a VM below its share would
  // store raw and make the store evict from those above theirs).
  full.vms[1] = VmMemoryUse{(99 << 20) / kPageSize, 99 << 20};
  const auto out_of_tokens = [&] {
    v.ChargeCpu(1, v.VmStatus(1).cpu_tokens_ns + 1);
  };
  v.Tick(host.Advance(0, 0), roomy);
  v.Tick(host.Advance(0, 0), roomy);
  out_of_tokens();
  EXPECT_EQ(v.Decide(1, 1, true), PutMode::kRaw);
  v.Tick(host.Advance(0, 0), full);
  out_of_tokens();
  EXPECT_EQ(v.Decide(1, 2, true), PutMode::kDrop);
  EXPECT_EQ(Count(v, 1, ValveCounter::kDroppedMemory), 1u);
  v.Tick(host.Advance(0, 0), MemorySample{});  // not known: still tight
  out_of_tokens();
  EXPECT_EQ(v.Decide(1, 3, true), PutMode::kDrop);
  EXPECT_EQ(Count(v, 1, ValveCounter::kDroppedMemory), 2u);
  v.Tick(host.Advance(0, 0), roomy);
  out_of_tokens();
  EXPECT_EQ(v.Decide(1, 4, true), PutMode::kRaw);
  EXPECT_EQ(Count(v, 1, ValveCounter::kDroppedMemory), 2u);
}

TEST(ValveTest, RemovedVmIsForgotten) {
  Valve v(TestOptions());
  v.AddVm(1, Policy(100, ValveMode::kOff));
  v.RemoveVm(1);
  // Unknown VMs are not throttled (the store decides what happens to them).
  EXPECT_EQ(v.Decide(1, 1, true), PutMode::kCompress);
  EXPECT_EQ(v.AdmissionHint(1), kAll);
  // A new VM in the same slot with another generation starts clean.
  v.AddVm(1 | (1u << 16), Policy());
  EXPECT_EQ(v.Decide(1, 1, true), PutMode::kCompress);
}

}  // namespace
}  // namespace tmem
