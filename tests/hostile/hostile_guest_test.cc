// Hostile guests against a real tmemd: each attack runs next to
// a well-behaved guest whose every page read back is verified, all VMs on
// one worker (the worst case for sharing). The assertions are guarantees
// that hold on a loaded 2-core machine under ASan, never rates: 0
// mismatches; the neighbour keeps its pool and gets hits while attacked;
// a flooder's all-in charge stays within its quota + 5% and host memory
// within the cap at every sample; tmemd survives and exits cleanly.
// Throughput ratios are the isolation benchmark's job (bench/).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_join.h"
#include "tests/hostile/hostile_harness.h"
#include "tests/temp_dir.h"

namespace tmem::hostile {
namespace {

using std::chrono::milliseconds;

constexpr uint64_t kMiB = 1ull << 20;
constexpr int kUntilDeadlineMs = 180000;

class HostileGuestTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.empty()) << "mkdtemp failed"; }

  TmemdSpec Spec(uint64_t cap, std::vector<VmSpec> vms) const {
    TmemdSpec spec;
    spec.tmemd_bin = TMEMD_BIN;
    spec.dir = dir_;
    spec.memory_cap_bytes = cap;
    spec.workers = 1;
    spec.vms = std::move(vms);
    return spec;
  }

  // Runs `guest` alone for a moment, then `attackers` next to it for
  // `attack_ms`, sampling `watched` VMs; checks everything the file header
  // promises.
  // With `until`, the attack goes on past attack_ms until it holds (or
  // kUntilDeadline passes): how far an attack gets in a fixed time depends
  // on the machine, what it must reach does not.
  void RunAttack(Tmemd& tmemd, VerifiedGuest& guest,
                 std::vector<std::unique_ptr<RawAttacker>>& attackers,
                 const std::vector<std::string>& watched, int attack_ms,
                 const std::function<bool()>& until = nullptr) {
    Sampler sampler(&tmemd, watched);
    sampler.Start();
    guest.Start();
    std::this_thread::sleep_for(milliseconds(500));
    const uint64_t hits_before = guest.hits() + guest.bulk_hits();
    const uint64_t ops_before = guest.ops();
    for (auto& a : attackers) a->Start();
    std::this_thread::sleep_for(milliseconds(attack_ms));
    if (until) {
      EXPECT_TRUE(tmem::testing::WaitUntil(until, kUntilDeadlineMs))
          << "the attack did not reach its goal in " << kUntilDeadlineMs
          << " ms";
    }
    // The neighbour still has its pools while the attack goes on.
    absl::StatusOr<v1::VmDetail> during = tmemd.GetVm("good");
    ASSERT_TRUE(during.ok()) << during.status();
    EXPECT_GE(during->pools_size(), 1);
    const uint64_t hits_during = guest.hits() + guest.bulk_hits() - hits_before;
    const uint64_t ops_during = guest.ops() - ops_before;
    for (auto& a : attackers) a->Stop();
    guest.Stop();
    const SampleSummary s = sampler.Stop();

    uint64_t attack_entries = 0;
    for (auto& a : attackers) attack_entries += a->completed();
    RecordProperty("neighbour_ops_during_attack", static_cast<int>(ops_during));
    RecordProperty("neighbour_hits_during_attack",
                   static_cast<int>(hits_during));
    RecordProperty("attack_entries_completed",
                   static_cast<int>(attack_entries));
    // The attack really ran: the host completed entries of every attacker.
    for (auto& a : attackers) EXPECT_GT(a->completed(), 0u);
    // The neighbour made progress during it: it got pages back.
    EXPECT_GT(hits_during, 0u) << "ops during attack " << ops_during;
    EXPECT_EQ(guest.mismatches(), 0u)
        << absl::StrJoin(guest.mismatch_log(), "\n");
    EXPECT_EQ(guest.counters().errors, 0u);
    EXPECT_GT(s.samples, 2u);
    EXPECT_EQ(s.cap_exceeded, 0u) << absl::StrJoin(s.violations, "\n");
    EXPECT_EQ(s.quota_exceeded, 0u) << absl::StrJoin(s.violations, "\n");
    EXPECT_TRUE(tmemd.Alive()) << tmemd.Log();
  }

  tmem::testing::TempDir tmp_{"tmemd-hostile"};
  std::string dir_ = tmp_.path();
};

// INVAL_POOL / DESTROY_POOL cost O(the pool's own objects), never a scan of
// every VM's objects (which, beside a 1M-object neighbour on the same
// worker, would keep the neighbour from even creating its pool): the storm
// visits none of the neighbour's objects, and the neighbour keeps its pools
// and its hits.
TEST_F(HostileGuestTest, PoolStormsDoNotReachAMillionObjectNeighbour) {
  constexpr uint64_t kObjects = 1'000'000;
  // The neighbour's mode is "always": its million puts are never read
  // back, and the valve would rightly stop admitting them.
  auto tmemd = Tmemd::Start(
      Spec(1024 * kMiB, {{"good", 0, "always"}, {"inval"}, {"destroy"}}));
  ASSERT_TRUE(tmemd.ok()) << tmemd.status();
  auto guest = VerifiedGuest::Connect((*tmemd)->Socket("good"), {});
  ASSERT_TRUE(guest.ok()) << guest.status();
  const auto fill_start = std::chrono::steady_clock::now();
  const absl::Status filled_status = (*guest)->Fill(kObjects);
  ASSERT_TRUE(filled_status.ok()) << filled_status;
  RecordProperty(
      "fill_ms",
      static_cast<int>(std::chrono::duration_cast<milliseconds>(
                           std::chrono::steady_clock::now() - fill_start)
                           .count()));
  absl::StatusOr<v1::VmDetail> filled = (*tmemd)->GetVm("good");
  ASSERT_TRUE(filled.ok()) << filled.status();
  ASSERT_GE(filled->summary().pages(), kObjects) << filled->DebugString();

  std::vector<std::unique_ptr<RawAttacker>> attackers;
  for (auto [vm, attack] : {std::pair{"inval", Attack::kInvalidatePoolStorm},
                            std::pair{"destroy", Attack::kDestroyPoolStorm}}) {
    auto a = RawAttacker::Connect((*tmemd)->Socket(vm), attack);
    ASSERT_TRUE(a.ok()) << a.status();
    attackers.push_back(std::move(*a));
  }
  absl::StatusOr<v1::HostStatus> before = (*tmemd)->Status();
  ASSERT_TRUE(before.ok());
  const int64_t visited_before =
      CounterValue(before->counters(), "pool_scan_objects_visited");
  ASSERT_GE(visited_before, 0) << "tmemd does not export the counter";

  RunAttack(**tmemd, **guest, attackers, {}, 3000);

  absl::StatusOr<v1::HostStatus> after = (*tmemd)->Status();
  ASSERT_TRUE(after.ok());
  // Thousands of pool ops ran, each on an empty pool: not one of the
  // neighbour's objects was visited (it ran no pool op of its own).
  EXPECT_EQ(CounterValue(after->counters(), "pool_scan_objects_visited"),
            visited_before);
  absl::StatusOr<v1::VmDetail> good = (*tmemd)->GetVm("good");
  ASSERT_TRUE(good.ok());
  EXPECT_GE(good->pools_size(), 2);
  // Its bulk objects are still there (exclusive gets put each back).
  EXPECT_GE(good->summary().pages(), kObjects - 1);
  EXPECT_EQ((*tmemd)->Stop(), 0) << (*tmemd)->Log();
}

// The all-in charge holds at every sample: a zero page in its own object is
// charged what it costs with its metadata, so a flooder never holds more
// than its quota and host-cap eviction never takes its neighbour's pages.
// The flooders' valve mode is "always": the valve would otherwise drop
// their puts (no reuse) long before the quota is reached, and the quota
// must hold on its own.
TEST_F(HostileGuestTest, MetadataFloodStaysWithinItsQuota) {
  constexpr uint64_t kQuota = 8 * kMiB;
  auto tmemd = Tmemd::Start(Spec(
      64 * kMiB,
      {{"good"}, {"flood", kQuota, "always"}, {"flood2", kQuota, "always"}}));
  ASSERT_TRUE(tmemd.ok()) << tmemd.status();
  auto guest = VerifiedGuest::Connect((*tmemd)->Socket("good"), {});
  ASSERT_TRUE(guest.ok()) << guest.status();
  std::vector<std::unique_ptr<RawAttacker>> attackers;
  for (const char* vm : {"flood", "flood2"}) {
    auto a = RawAttacker::Connect((*tmemd)->Socket(vm), Attack::kZeroPageFlood);
    ASSERT_TRUE(a.ok()) << a.status();
    attackers.push_back(std::move(*a));
  }
  // The flood must reach its quota (else the sampler's check proves
  // nothing): it runs until both flooders had to evict their own pages.
  auto at_quota = [&] {
    for (const char* vm : {"flood", "flood2"}) {
      absl::StatusOr<v1::VmDetail> d = (*tmemd)->GetVm(vm);
      if (!d.ok() || CounterValue(d->counters(), "evictions_quota") <= 0) {
        return false;
      }
    }
    return true;
  };
  RunAttack(**tmemd, **guest, attackers, {"flood", "flood2"}, 2000, at_quota);
  EXPECT_TRUE(at_quota());
  EXPECT_EQ((*tmemd)->Stop(), 0) << (*tmemd)->Log();
}

// Zero pages, each in an object of its own, cost the store metadata only,
// so a flooder with no quota fills the host cap with entries and object
// nodes and no blob. The neighbour's ordinary puts must then find room by
// evicting those entries in bounded work per put: the worker keeps serving
// the neighbour (hits, verified), the cap holds, and SIGTERM still ends
// tmemd cleanly: looking for a slab to empty among pages that hold no blob
// must never cost a put a walk over every page the store holds.
TEST_F(HostileGuestTest, ZeroPageFloodFillingTheCapLeavesTheNeighbourServed) {
  auto tmemd =
      Tmemd::Start(Spec(16 * kMiB, {{"good"}, {"zeros", 0, "always"}}));
  ASSERT_TRUE(tmemd.ok()) << tmemd.status();
  auto guest = VerifiedGuest::Connect((*tmemd)->Socket("good"), {});
  ASSERT_TRUE(guest.ok()) << guest.status();
  std::vector<std::unique_ptr<RawAttacker>> attackers;
  auto a =
      RawAttacker::Connect((*tmemd)->Socket("zeros"), Attack::kZeroPageFlood);
  ASSERT_TRUE(a.ok()) << a.status();
  attackers.push_back(std::move(*a));
  // The flood must fill the cap: the host had to evict for it.
  auto cap_full = [&] {
    absl::StatusOr<v1::HostStatus> st = (*tmemd)->Status();
    return st.ok() && CounterValue(st->counters(), "evictions_host_cap") > 0;
  };
  RunAttack(**tmemd, **guest, attackers, {"zeros"}, 2000, cap_full);
  EXPECT_TRUE(cap_full());
  absl::StatusOr<v1::HostStatus> st = (*tmemd)->Status();
  ASSERT_TRUE(st.ok()) << st.status();
  // The store's own bound on one put's or get's work (tmem_store.h).
  EXPECT_GT(CounterValue(st->counters(), "max_op_work"), 0);
  EXPECT_LE(CounterValue(st->counters(), "max_op_work"), 200000);
  EXPECT_EQ((*tmemd)->Stop(), 0) << (*tmemd)->Log();
}

// Eight VMs put as fast as their rings allow, ignoring the admission hint,
// against one verified VM, under a cap the flood fills: the cap holds and
// the verified VM keeps getting its (exact) pages back. The flooders' valve
// mode is "always" (every put compressed and stored): the worst case for
// the worker they share and for fair-share eviction.
TEST_F(HostileGuestTest, EightPutFloodersAgainstOneVerifiedVm) {
  std::vector<VmSpec> vms = {{"good"}};
  std::vector<std::string> flooders;
  for (int i = 0; i < 8; ++i) {
    flooders.push_back("put" + std::to_string(i));
    vms.push_back({flooders.back(), 0, "always"});
  }
  auto tmemd = Tmemd::Start(Spec(48 * kMiB, vms));
  ASSERT_TRUE(tmemd.ok()) << tmemd.status();
  auto guest = VerifiedGuest::Connect((*tmemd)->Socket("good"), {});
  ASSERT_TRUE(guest.ok()) << guest.status();
  std::vector<std::unique_ptr<RawAttacker>> attackers;
  for (const std::string& vm : flooders) {
    auto a = RawAttacker::Connect((*tmemd)->Socket(vm), Attack::kPutFlood);
    ASSERT_TRUE(a.ok()) << a.status();
    attackers.push_back(std::move(*a));
  }
  RunAttack(**tmemd, **guest, attackers, flooders, 4000);
  EXPECT_EQ((*tmemd)->Stop(), 0) << (*tmemd)->Log();
}

}  // namespace
}  // namespace tmem::hostile
