// The valve as swap devices see it (SwapValveAdvisor over a real Valve),
// driving a real TmemSwapBacking over a real TmemStore and spill image.
// The valve's state is set by hand-made CPU samples (no clock, no /proc).
// A swap write never waits for LZ4: with spare CPU its page is stored raw
// and queued for the compactor (kDefer), on a saturated host it stays raw
// until idle cycles (kDeferIdle), whatever deferred_compression says. A VM
// the valve throttled for streaming its cleancache pages keeps every swap
// page in the store -- none dropped or spilled for reuse, and the
// compactor compresses them all the same -- while its swap reads do not
// count as cleancache reuse. The device's CPU reaches the VM's token
// bucket.
#include "host-agent/swap/swap_valve_advisor.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "backend/compaction_queue.h"
#include "backend/compactor.h"
#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "backend/valve.h"
#include "gtest/gtest.h"
#include "host-agent/swap/spill_image.h"
#include "host-agent/swap/tmem_swap_backing.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

constexpr uint64_t kPages = 1024;           // 4 MiB device
constexpr int64_t kPeriodNs = 100'000'000;  // 100 ms

// A host whose counters the test moves: each Advance is one period with
// the given whole-host busy share (others + tmemd) and tmemd's share.
class FakeHost {
 public:
  CpuSample Advance(double busy, double agent) {
    s_.num_cpus = 2;
    const auto total = static_cast<uint64_t>(kPeriodNs) * 2;
    s_.wall_nanos += kPeriodNs;
    s_.host_total_nanos += total;
    s_.host_busy_nanos +=
        static_cast<uint64_t>(busy * static_cast<double>(total));
    s_.agent_nanos += static_cast<uint64_t>(agent * static_cast<double>(total));
    return s_;
  }

 private:
  CpuSample s_;
};

ValveOptions TestOptions(bool deferred = false) {
  ValveOptions o;
  o.smoothing = 1.0;  // each tick sees exactly its sample
  o.cpu_floor_percent = 0;
  o.min_samples = 100;
  o.min_dwell_periods = 3;
  o.reuse_window_decay = 0.5;
  o.deferred_compression = deferred;
  return o;
}

// Compressible but distinct per (page, version): LZ4 shrinks it well.
std::vector<uint8_t> Pattern(uint64_t page, uint32_t version) {
  std::vector<uint8_t> p(kSwapPageSize);
  for (size_t i = 0; i < kSwapPageSize; i += 16) {
    const uint64_t a = page * 1000003 + version;
    std::memcpy(p.data() + i, &a, 8);
    std::memset(p.data() + i + 8, static_cast<int>(version & 0xff), 8);
  }
  return p;
}

class SwapValveAdvisorTest : public ::testing::Test {
 protected:
  void Build(const ValveOptions& vo) {
    valve_ = std::make_unique<Valve>(vo);
    advisor_ = std::make_unique<SwapValveAdvisor>(valve_.get());
    queue_ = std::make_unique<CompactionQueue>(4096);
    StoreOptions so;
    so.memory_cap_bytes = 64ull << 20;
    so.num_shards = 8;
    so.compaction_queue = queue_.get();
    auto store = TmemStore::Create(so);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    auto vm = store_->AddVm("vm1", VmPolicy{});
    ASSERT_TRUE(vm.ok());
    vm_ = *vm;
    auto pool = store_->NewPool(vm_, nullptr, PoolKind::kPersistent);
    ASSERT_TRUE(pool.ok()) << pool.status();
    valve_->Tick(host_.Advance(0, 0));
    valve_->AddVm(vm_, VmPolicy{});
    SpillImageOptions io;
    io.path = dir_.path() + "/vm1.img";
    io.page_count = kPages;
    auto img = SpillImage::Open(io);
    ASSERT_TRUE(img.ok()) << img.status();
    TmemSwapBackingOptions o;
    o.store = store_.get();
    o.vm = vm_;
    o.pool = *pool;
    o.advisor = advisor_.get();
    auto b = TmemSwapBacking::Open(o, std::move(*img));
    ASSERT_TRUE(b.ok()) << b.status();
    backing_ = std::move(*b);
  }

  void Write(uint64_t first, uint64_t count, uint32_t version) {
    for (uint64_t p = first; p < first + count; ++p) {
      std::vector<uint8_t> buf = Pattern(p, version);
      GuestSpan span{buf.data(), buf.size()};
      ASSERT_TRUE(backing_->WritePages(p, 1, {&span, 1}).ok()) << p;
    }
  }
  // Pages whose content is not `version`'s.
  int Bad(uint64_t first, uint64_t count, uint32_t version) {
    int bad = 0;
    for (uint64_t p = first; p < first + count; ++p) {
      std::vector<uint8_t> buf(kSwapPageSize, 0xee);
      GuestSpan span{buf.data(), buf.size()};
      if (!backing_->ReadPages(p, 1, {&span, 1}).ok() ||
          buf != Pattern(p, version)) {
        ++bad;
      }
    }
    return bad;
  }
  // Runs the compactor until the queue is empty, the way the agent wires
  // it (pages of a VM the valve expects no reuse from are skipped).
  CompactorStats Drain() {
    CompactorOptions o;
    o.expects_no_reuse = [this](VmId vm) { return valve_->ExpectsNoReuse(vm); };
    Compactor compactor(store_.get(), queue_.get(), o);
    EXPECT_TRUE(compactor.Start().ok());
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::seconds(120);  // generous: loaded hosts
    while (compactor.Stats().queue.length > 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    compactor.Stop();
    return compactor.Stats();
  }
  uint64_t Swap(TmemSwapCounter c) const { return backing_->Stats().Get(c); }
  uint64_t Pool(Counter c) const {
    return CounterValueOf(backing_->Stats().pool, c);
  }
  uint64_t Valved(ValveCounter c) const {
    return valve_->VmStatus(vm_).counters[static_cast<int>(c)];
  }
  // Spends the VM's tokens and a whole period's share beyond: the debt at
  // which the valve drops a hint-ignoring guest's cleancache puts.
  void DeepInDebt() {
    const ValveVmStatus st = valve_->VmStatus(vm_);
    advisor_->ChargeCpu(vm_, st.cpu_tokens_ns + st.cpu_share_ns + 1);
    ASSERT_LE(valve_->VmStatus(vm_).cpu_tokens_ns,
              -valve_->VmStatus(vm_).cpu_share_ns);
  }

  tmem::testing::TempDir dir_{"swapvalve"};
  FakeHost host_;
  std::unique_ptr<Valve> valve_;
  std::unique_ptr<SwapValveAdvisor> advisor_;
  std::unique_ptr<CompactionQueue> queue_;  // outlives the store
  std::unique_ptr<TmemStore> store_;
  VmId vm_ = 0;
  std::unique_ptr<TmemSwapBacking> backing_;
};

// deferred_compression off (the default): swap pages are deferred all the
// same, stored raw at the write and compressed by the compactor after.
TEST_F(SwapValveAdvisorTest, SpareCpuDefersAndTheCompactorCompressesThem) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions(/*deferred=*/false)));
  valve_->Tick(host_.Advance(0, 0));  // idle host: a share of tokens
  ASSERT_GT(valve_->VmStatus(vm_).cpu_tokens_ns, 0);
  EXPECT_EQ(advisor_->Advise(vm_, 1, false), PutMode::kDefer);
  Write(0, 200, 1);
  EXPECT_EQ(Swap(TmemSwapCounter::kWritesStored), 200u);
  EXPECT_EQ(Pool(Counter::kPutsRaw), 200u) << "no LZ4 in the write";
  EXPECT_EQ(queue_->Stats().length, 200u);
  const uint64_t raw_bytes = Pool(Counter::kStoredBytes);
  const CompactorStats s = Drain();
  EXPECT_EQ(s.compressed, 200u);
  EXPECT_LT(Pool(Counter::kStoredBytes), raw_bytes / 2);
  EXPECT_EQ(Bad(0, 200, 1), 0);
}

TEST_F(SwapValveAdvisorTest, DeferredWithDeferredCompressionToo) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions(/*deferred=*/true)));
  valve_->Tick(host_.Advance(0, 0));
  EXPECT_EQ(advisor_->Advise(vm_, 1, false), PutMode::kDefer);
  DeepInDebt();
  EXPECT_EQ(advisor_->Advise(vm_, 2, false), PutMode::kDeferIdle);
}

// A saturated host: no budget, the VM deep in debt. The cleancache view
// would drop a put of a guest that ignores the hint (as a swap device's
// puts do); a swap page is stored raw, never spilled for CPU.
TEST_F(SwapValveAdvisorTest, SaturatedHostStoresSwapPagesRawNeverSpills) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  valve_->Tick(host_.Advance(1.0, 0.0));  // others take every cycle
  ASSERT_EQ(valve_->HostStatus().budget_fraction, 0.0);
  ASSERT_NO_FATAL_FAILURE(DeepInDebt());
  const uint64_t dropped_cpu = Valved(ValveCounter::kDroppedCpu);
  Write(0, 200, 2);
  EXPECT_EQ(Swap(TmemSwapCounter::kSpilledValve), 0u);
  EXPECT_EQ(Swap(TmemSwapCounter::kWritesStored), 200u);
  EXPECT_EQ(Pool(Counter::kPutsRaw), 200u);
  EXPECT_EQ(Pool(Counter::kPutsCompressed), 0u);
  EXPECT_EQ(Valved(ValveCounter::kDroppedCpu), dropped_cpu);
  EXPECT_EQ(Bad(0, 200, 2), 0);
  // Memory tight as well: room is the store's business, not the valve's.
  MemorySample full;
  full.cap_bytes = 1 << 20;
  full.used_bytes = 1 << 20;
  valve_->Tick(host_.Advance(1.0, 0.0), full);
  ASSERT_NO_FATAL_FAILURE(DeepInDebt());
  Write(200, 50, 2);
  EXPECT_EQ(Swap(TmemSwapCounter::kSpilledValve), 0u);
  EXPECT_EQ(Bad(0, 250, 2), 0);
}

// A VM that streams through its cleancache (puts, never a get) is
// throttled for no reuse; its swap pages still all go to the store, and
// reading them back does not make its cleancache look reused.
TEST_F(SwapValveAdvisorTest, StreamingVmsSwapPagesAreNotDroppedForReuse) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  uint64_t key = 0;
  for (int period = 0; period < 8 && !valve_->VmStatus(vm_).throttled;
       ++period) {
    for (int i = 0; i < 500; ++i) valve_->Decide(vm_, ++key, true);
    valve_->Tick(host_.Advance(0, 0));
  }
  ASSERT_TRUE(valve_->VmStatus(vm_).throttled);
  ASSERT_TRUE(valve_->ExpectsNoReuse(vm_));
  const uint64_t dropped_reuse = Valved(ValveCounter::kDroppedReuse);

  Write(0, 300, 3);
  EXPECT_EQ(Swap(TmemSwapCounter::kSpilledValve), 0u);
  EXPECT_EQ(Swap(TmemSwapCounter::kWritesStored), 300u);
  EXPECT_EQ(Valved(ValveCounter::kDroppedReuse), dropped_reuse);
  // Every swap page is read back, several times over: that is swap, not
  // cleancache reuse, so the VM stays throttled.
  for (int period = 0; period < 6; ++period) {
    EXPECT_EQ(Bad(0, 300, 3), 0);
    valve_->Tick(host_.Advance(0, 0));
  }
  EXPECT_TRUE(valve_->VmStatus(vm_).throttled);
  EXPECT_EQ(valve_->VmStatus(vm_).reuse_ratio, 0.0);
  // The compactor skips a no-reuse VM's cleancache pages, never its swap
  // pages: they come back, and they stay in the store.
  const CompactorStats s = Drain();
  EXPECT_EQ(s.skipped_no_reuse, 0u);
  EXPECT_EQ(s.compressed, 300u);
  EXPECT_EQ(Bad(0, 300, 3), 0);
}

// Mode off: no tmem memory for the VM; its swap pages go to the image.
TEST_F(SwapValveAdvisorTest, ModeOffSpillsEverySwapPage) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  VmPolicy off;
  off.mode = ValveMode::kOff;
  valve_->SetVmPolicy(vm_, off);
  Write(0, 20, 4);
  EXPECT_EQ(Swap(TmemSwapCounter::kSpilledValve), 20u);
  EXPECT_EQ(Swap(TmemSwapCounter::kWritesStored), 0u);
  EXPECT_EQ(Bad(0, 20, 4), 0);
}

// Swap mode apart from the cleancache mode (VmPolicy::swap_mode): cleancache
// off, swap adaptive. The VM's cleancache puts are dropped and its guest
// told to send none; its swap pages are stored, compressed with the tokens
// it still gets for them.
TEST_F(SwapValveAdvisorTest, CleancacheOffSwapAdaptiveStoresSwapPages) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  VmPolicy policy;
  policy.mode = ValveMode::kOff;
  policy.swap_mode = ValveMode::kAdaptive;
  valve_->SetVmPolicy(vm_, policy);
  valve_->Tick(host_.Advance(0, 0));
  const ValveVmStatus st = valve_->VmStatus(vm_);
  EXPECT_EQ(st.mode, ValveMode::kOff);
  EXPECT_EQ(st.effective_mode, ValveMode::kOff);
  EXPECT_EQ(st.swap_mode, ValveMode::kAdaptive);
  EXPECT_EQ(st.effective_swap_mode, ValveMode::kAdaptive);
  EXPECT_EQ(st.admission, 0u) << "cleancache stays off";
  EXPECT_GT(st.cpu_tokens_ns, 0) << "tokens for its adaptive swap pages";
  EXPECT_EQ(valve_->Decide(vm_, 1, true), PutMode::kDrop);
  Write(0, 20, 5);
  EXPECT_EQ(Swap(TmemSwapCounter::kSpilledValve), 0u);
  EXPECT_EQ(Swap(TmemSwapCounter::kWritesStored), 20u);
  EXPECT_EQ(Valved(ValveCounter::kCompressed), 20u);
  EXPECT_EQ(Bad(0, 20, 5), 0);
  // Out of tokens, adaptive swap pages are stored raw, never spilled.
  ASSERT_NO_FATAL_FAILURE(DeepInDebt());
  EXPECT_EQ(advisor_->Advise(vm_, 2, false), PutMode::kDeferIdle);
  // The refills pay the debt back and give tokens again (a VM whose
  // every mode is off would get none); its cleancache stays off.
  valve_->Tick(host_.Advance(0, 0));
  valve_->Tick(host_.Advance(0, 0));
  EXPECT_GT(valve_->VmStatus(vm_).cpu_tokens_ns, 0);
  EXPECT_EQ(advisor_->Advise(vm_, 3, false), PutMode::kDefer);
  EXPECT_EQ(valve_->VmStatus(vm_).admission, 0u);
}

// Swap off, cleancache adaptive: every swap page goes to the image (the
// device is a plain disk) while the VM's cleancache puts are stored.
TEST_F(SwapValveAdvisorTest, SwapOffCleancacheAdaptiveSpillsEverySwapPage) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  VmPolicy policy;
  policy.mode = ValveMode::kAdaptive;
  policy.swap_mode = ValveMode::kOff;
  valve_->SetVmPolicy(vm_, policy);
  valve_->Tick(host_.Advance(0, 0));
  const ValveVmStatus st = valve_->VmStatus(vm_);
  EXPECT_EQ(st.effective_mode, ValveMode::kAdaptive);
  EXPECT_EQ(st.effective_swap_mode, ValveMode::kOff);
  EXPECT_EQ(st.admission, 65536u);
  Write(0, 20, 6);
  EXPECT_EQ(Swap(TmemSwapCounter::kSpilledValve), 20u);
  EXPECT_EQ(Swap(TmemSwapCounter::kWritesStored), 0u);
  EXPECT_EQ(Pool(Counter::kPagesHeld), 0u);
  EXPECT_EQ(Bad(0, 20, 6), 0);
  // A cleancache put of the same VM, as the valve advises it, is stored.
  auto cache = store_->NewPool(vm_, nullptr);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const PutMode mode = valve_->Decide(vm_, 7, true);
  EXPECT_NE(mode, PutMode::kDrop);
  const std::vector<uint8_t> page = Pattern(7, 6);
  auto r = store_->Put(vm_, *cache, ObjectId::FromInode(7), 0,
                       ConstPage(page.data(), kPageSize), mode);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->stored);
}

// Swap always: deferred compression for every swap page, tokens or not;
// kDefault follows the VM's mode, then the host default.
TEST_F(SwapValveAdvisorTest, SwapModeAlwaysAndDefaultFallbacks) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  VmPolicy policy;
  policy.swap_mode = ValveMode::kAlways;
  valve_->SetVmPolicy(vm_, policy);
  valve_->Tick(host_.Advance(0, 0));
  ASSERT_NO_FATAL_FAILURE(DeepInDebt());
  EXPECT_EQ(advisor_->Advise(vm_, 1, false), PutMode::kDefer);
  EXPECT_EQ(valve_->VmStatus(vm_).effective_mode, ValveMode::kAdaptive);
  policy.swap_mode = ValveMode::kDefault;
  policy.mode = ValveMode::kOff;
  valve_->SetVmPolicy(vm_, policy);
  EXPECT_EQ(valve_->VmStatus(vm_).effective_swap_mode, ValveMode::kOff);
  EXPECT_EQ(advisor_->Advise(vm_, 2, false), PutMode::kDrop);
  policy.mode = ValveMode::kDefault;
  valve_->SetVmPolicy(vm_, policy);
  EXPECT_EQ(valve_->VmStatus(vm_).swap_mode, ValveMode::kDefault);
  EXPECT_EQ(valve_->VmStatus(vm_).effective_swap_mode, ValveMode::kAdaptive);
}

TEST_F(SwapValveAdvisorTest, ChargedCpuComesOutOfTheVmsTokens) {
  ASSERT_NO_FATAL_FAILURE(Build(TestOptions()));
  valve_->Tick(host_.Advance(0, 0));
  const ValveVmStatus before = valve_->VmStatus(vm_);
  advisor_->ChargeCpu(vm_, 1'000'000);
  const ValveVmStatus after = valve_->VmStatus(vm_);
  EXPECT_EQ(after.cpu_used_ns, before.cpu_used_ns + 1'000'000);
  EXPECT_EQ(after.cpu_tokens_ns, before.cpu_tokens_ns - 1'000'000);
}

}  // namespace
}  // namespace tmem::swap
