// Agent: VM lifecycle, policies reaching the store and the valve, and the
// valve's admission hint reaching a real guest through the shared header.
// Real channels, sockets and workers; only the CPU sampler is a fake.
#include "host-agent/agent.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "backend/stats.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "host-agent/swap/tmem_swap_backing.h"
#include "proto/tmem_abi.h"
#include "tests/agent/test_agent.h"
#include "tests/swap/vhost_user_front_end.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using testing::FakeSampler;

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.empty()) << "mkdtemp failed";
    AgentOptions o;
    o.socket_dir = dir_;
    o.store.memory_cap_bytes = 64 << 20;
    o.store.address_space_bytes = 256 << 20;
    o.workers = 2;
    o.cpu_sampler = &sampler_;
    o.run_valve_ticker = false;
    absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = std::move(*a);
  }
  void TearDown() override { agent_.reset(); }

  FakeSampler sampler_;
  // Declared before what uses it, so it is removed after them.
  tmem::testing::TempDir tmp_{"tmem-agent-test"};
  std::string dir_ = tmp_.path();
  std::unique_ptr<Agent> agent_;
};

TEST_F(AgentTest, AddListGetRemove) {
  absl::StatusOr<VmInfo> a = agent_->AddVm("a", VmPolicy{});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->socket_path, dir_ + "/a.sock");
  EXPECT_FALSE(a->connected);
  struct stat st {};
  EXPECT_EQ(stat(a->socket_path.c_str(), &st), 0) << "socket must listen";
  ASSERT_TRUE(agent_->AddVm("b", VmPolicy{}, dir_ + "/custom.sock").ok());
  EXPECT_EQ(agent_->VmNames(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(agent_->ListVms().size(), 2u);
  EXPECT_EQ(agent_->GetVm("b")->socket_path, dir_ + "/custom.sock");

  EXPECT_EQ(agent_->AddVm("a", VmPolicy{}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(agent_->AddVm("../etc", VmPolicy{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(agent_->GetVm("zz").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(agent_->RemoveVm("zz").code(), absl::StatusCode::kNotFound);

  ASSERT_TRUE(agent_->RemoveVm("a").ok());
  EXPECT_NE(stat((dir_ + "/a.sock").c_str(), &st), 0) << "socket unlinked";
  EXPECT_FALSE(agent_->HasVm("a"));
  // The name is free again.
  EXPECT_TRUE(agent_->AddVm("a", VmPolicy{}).ok());
  EXPECT_EQ(agent_->Status().workers, 2);
  EXPECT_EQ(agent_->Status().store.vms, 2u);
}

// libvirt events can remove a VM on one thread while another re-adds the
// same name (undefine, then define). A VM leaves the list before its
// channel is torn down (and its socket unlinked, its store VM dropped): a
// re-add in that window must wait for the teardown, not fail as a
// duplicate, and must keep its own new socket.
TEST_F(AgentTest, ReAddingAVmWhileItIsRemovedWaitsForTheOldOne) {
  const std::string sock = dir_ + "/vm.sock";
  ASSERT_TRUE(agent_->AddVm("vm", VmPolicy{}).ok());
  int failed_adds = 0;
  int lost_sockets = 0;
  for (int i = 0; i < 200; ++i) {
    std::thread remover([&] { EXPECT_TRUE(agent_->RemoveVm("vm").ok()); });
    while (agent_->HasVm("vm")) std::this_thread::yield();
    absl::StatusOr<VmInfo> info = agent_->AddVm("vm", VmPolicy{});
    remover.join();
    if (!info.ok()) {
      ++failed_adds;
      ADD_FAILURE() << info.status();
      ASSERT_TRUE(agent_->AddVm("vm", VmPolicy{}).ok());
      continue;
    }
    struct stat st {};
    if (stat(sock.c_str(), &st) != 0) ++lost_sockets;
  }
  EXPECT_EQ(failed_adds, 0);
  EXPECT_EQ(lost_sockets, 0);
}

TEST_F(AgentTest, PolicyReachesStoreAndValve) {
  ASSERT_TRUE(agent_->AddVm("a", VmPolicy{}).ok());
  VmPolicy p;
  p.quota_bytes = 1 << 20;
  p.weight = 300;
  p.mode = ValveMode::kAlways;
  ASSERT_TRUE(agent_->SetVmPolicy("a", p).ok());
  absl::StatusOr<VmInfo> info = agent_->GetVm("a");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->policy.quota_bytes, uint64_t{1} << 20);
  EXPECT_EQ(info->policy.weight, 300u);
  EXPECT_EQ(info->valve.mode, ValveMode::kAlways);
  EXPECT_EQ(info->valve.weight, 300u);
  EXPECT_EQ(agent_->SetVmPolicy("nope", p).code(), absl::StatusCode::kNotFound);

  // The swap fields round-trip too: swap quota through the store, swap
  // mode through the valve.
  p.swap_quota_bytes = 256 << 10;
  p.swap_mode = ValveMode::kOff;
  ASSERT_TRUE(agent_->SetVmPolicy("a", p).ok());
  info = agent_->GetVm("a");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->policy.swap_quota_bytes, uint64_t{256} << 10);
  EXPECT_EQ(info->policy.swap_mode, ValveMode::kOff);
  EXPECT_EQ(info->policy.mode, ValveMode::kAlways);
  EXPECT_EQ(info->valve.swap_mode, ValveMode::kOff);
  EXPECT_EQ(info->valve.effective_swap_mode, ValveMode::kOff);
  EXPECT_EQ(agent_->store().GetVmPolicy(info->stats.id)->swap_quota_bytes,
            uint64_t{256} << 10);
  absl::StatusOr<VmPolicy> got = agent_->GetVmPolicy("a");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->swap_quota_bytes, uint64_t{256} << 10);
  EXPECT_EQ(got->swap_mode, ValveMode::kOff);
  EXPECT_EQ(got->quota_bytes, uint64_t{1} << 20);
  p.swap_quota_bytes = kUnlimitedQuota;
  p.swap_mode = ValveMode::kDefault;
  ASSERT_TRUE(agent_->SetVmPolicy("a", p).ok());
  got = agent_->GetVmPolicy("a");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->swap_quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(got->swap_mode, ValveMode::kDefault);
  EXPECT_EQ(agent_->GetVm("a")->valve.effective_swap_mode, ValveMode::kAlways)
      << "a default swap mode follows the VM's mode";

  ValveOptions bad = agent_->GetValveOptions();
  bad.cpu_budget_percent = -1;
  EXPECT_EQ(agent_->SetValveOptions(bad).code(),
            absl::StatusCode::kInvalidArgument);
  ValveOptions good = agent_->GetValveOptions();
  good.cpu_budget_percent = 40;
  ASSERT_TRUE(agent_->SetValveOptions(good).ok());
  ASSERT_TRUE(agent_->TickValve().ok());
  ASSERT_TRUE(agent_->TickValve().ok());
  EXPECT_NEAR(agent_->Status().valve.budget_fraction, 0.40, 1e-9);
}

// Polls `cond` for up to 5 s.
template <typename Cond>
bool Eventually(Cond cond) {
  for (int i = 0; i < 500; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

TEST_F(AgentTest, AdmissionHintReachesTheGuestAndItStopsSending) {
  absl::StatusOr<VmInfo> vm = agent_->AddVm("g", VmPolicy{});
  ASSERT_TRUE(vm.ok());
  absl::StatusOr<std::unique_ptr<IvshmemClient>> client =
      IvshmemClient::Connect(vm->socket_path, IvshmemClientOptions{});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::unique_ptr<TmemGuest>> guest =
      TmemGuest::Create(client->get());
  ASSERT_TRUE(guest.ok()) << guest.status();
  absl::StatusOr<TmemGuest::PoolHandle> pool = (*guest)->InitFs();
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE(Eventually([&] { return agent_->GetVm("g")->connected; }));
  const auto* header =
      reinterpret_cast<const tmem_shm_header*>((*client)->shm_base());
  const auto hint = [&] {
    return __atomic_load_n(&header->admission_hint, __ATOMIC_RELAXED);
  };
  ASSERT_TRUE(Eventually([&] { return hint() == TMEM_ADMIT_ALL; }));
  // Beside it, how far away a page of this VM can still come back (its
  // share of the cap in pages, set by the valve's tick): a sampled guest
  // looks that far. (The valve's first tick only takes its first sample.)
  ASSERT_TRUE(agent_->TickValve().ok());
  ASSERT_TRUE(agent_->TickValve().ok());
  const auto reach = [&] {
    return __atomic_load_n(&header->reach_pages, __ATOMIC_RELAXED);
  };
  ASSERT_TRUE(Eventually([&] {
    return reach() > 0 && reach() == agent_->GetVm("g")->valve.reach_pages;
  })) << reach();

  // Mode off: the worker publishes 0 and the guest skips every put.
  VmPolicy off;
  off.mode = ValveMode::kOff;
  ASSERT_TRUE(agent_->SetVmPolicy("g", off).ok());
  ASSERT_TRUE(Eventually([&] { return hint() == 0; })) << hint();
  std::array<uint8_t, TMEM_PAGE_SIZE> page{};
  page[0] = 1;
  const uint64_t skipped0 = (*guest)->counters().puts_skipped_by_hint;
  for (uint64_t i = 0; i < 100; ++i) {
    (*guest)->Put(*pool, TmemGuest::ObjectId{1}, i, page);
  }
  EXPECT_EQ((*guest)->counters().puts_skipped_by_hint - skipped0, 100u);

  // Back on: full admission, puts flow and come back. Mode always, whose
  // hint is full admission by definition: adaptive's follows the host's
  // CPU, which a loaded or sanitized run may not have to spare.
  VmPolicy on;
  on.mode = ValveMode::kAlways;
  ASSERT_TRUE(agent_->SetVmPolicy("g", on).ok());
  ASSERT_TRUE(Eventually([&] { return hint() == TMEM_ADMIT_ALL; }));
  // Heard within TMEM_CORE_HINT_RECHECK_PUTS puts: until the core reads
  // the hint again under its lock, it refuses on the one it last read.
  const uint64_t sent0 = (*guest)->counters().puts_sent;
  for (uint32_t i = 0; i <= TMEM_CORE_HINT_RECHECK_PUTS &&
                       (*guest)->counters().puts_sent == sent0;
       ++i) {
    (*guest)->Put(*pool, TmemGuest::ObjectId{2}, 0, page);
  }
  EXPECT_EQ((*guest)->counters().puts_sent, sent0 + 1);
  std::array<uint8_t, TMEM_PAGE_SIZE> out{};
  EXPECT_TRUE((*guest)->Get(*pool, TmemGuest::ObjectId{2}, 0, out));
  EXPECT_EQ(out, page);
  const VmInfo info = *agent_->GetVm("g");
  // Stored, compressed or raw (either one comes back).
  const auto counter = [&](ValveCounter c) {
    return info.valve.counters[static_cast<int>(c)];
  };
  EXPECT_GE(counter(ValveCounter::kCompressed) + counter(ValveCounter::kRaw),
            1u);
  EXPECT_GT(info.valve.cpu_used_ns, 0u) << "the worker charges CPU per batch";
}

// ABI v2: the guest's self-report is shown per VM as the guest wrote it,
// and a guest standing aside is admitted nothing until it stops.
TEST_F(AgentTest, GuestReportIsShownAndStandingAsideAdmitsNothing) {
  absl::StatusOr<VmInfo> vm = agent_->AddVm("aside", VmPolicy{});
  ASSERT_TRUE(vm.ok());
  absl::StatusOr<std::unique_ptr<IvshmemClient>> client =
      IvshmemClient::Connect(vm->socket_path, IvshmemClientOptions{});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Eventually([&] { return agent_->GetVm("aside")->connected; }));
  auto* header = reinterpret_cast<tmem_shm_header*>((*client)->shm_base());
  const auto hint = [&] {
    return __atomic_load_n(&header->admission_hint, __ATOMIC_RELAXED);
  };
  ASSERT_TRUE(Eventually([&] { return hint() == TMEM_ADMIT_ALL; }));
  EXPECT_FALSE(agent_->GetVm("aside")->guest.standing_aside);

  __atomic_store_n(&header->guest_get_ns, uint64_t{31000}, __ATOMIC_RELAXED);
  __atomic_store_n(&header->guest_miss_ns, uint64_t{18000}, __ATOMIC_RELAXED);
  __atomic_store_n(&header->guest_prefetch_used, uint64_t{7}, __ATOMIC_RELAXED);
  __atomic_store_n(&header->guest_prefetch_unused, ~uint64_t{0},
                   __ATOMIC_RELAXED);  // untrusted: shown, never used
  __atomic_store_n(&header->guest_flags, TMEM_GUEST_STANDING_ASIDE | (1u << 31),
                   __ATOMIC_RELAXED);
  // The worker polls the header every round (the idle timer at the latest).
  ASSERT_TRUE(Eventually([&] { return hint() == 0; })) << hint();
  const VmInfo info = *agent_->GetVm("aside");
  EXPECT_TRUE(info.guest.standing_aside);
  EXPECT_EQ(info.guest.flags, TMEM_GUEST_STANDING_ASIDE | (1u << 31));
  EXPECT_EQ(info.guest.get_ns, 31000u);
  EXPECT_EQ(info.guest.miss_ns, 18000u);
  EXPECT_EQ(info.guest.prefetch_used, 7u);
  EXPECT_EQ(info.guest.prefetch_unused, ~uint64_t{0});
  EXPECT_TRUE(info.valve.standing_aside);
  EXPECT_EQ(info.valve.admission, 0u);
  // A put that arrives anyway is dropped, and counted as such.
  Valve& valve = agent_->valve();
  EXPECT_EQ(valve.Decide(info.stats.id, 1, true), PutMode::kDrop);
  EXPECT_EQ(valve.VmStatus(info.stats.id)
                .counters[static_cast<int>(ValveCounter::kDroppedAside)],
            1u);

  __atomic_store_n(&header->guest_flags, 0u, __ATOMIC_RELAXED);
  ASSERT_TRUE(Eventually([&] { return hint() == TMEM_ADMIT_ALL; }));
  EXPECT_FALSE(agent_->GetVm("aside")->valve.standing_aside);
}

// A VM's channel and its swap device are one store VM: one registration,
// one policy (quota, weight), whichever frontend came first; the VM stays
// while either serves and goes (with its pages) when the last one leaves.
TEST_F(AgentTest, ChannelAndSwapDeviceShareOneStoreVm) {
  absl::StatusOr<SwapDeviceInfo> sw = agent_->AddSwapDevice("a", 1 << 20);
  ASSERT_TRUE(sw.ok()) << sw.status();
  EXPECT_EQ(sw->socket_path, dir_ + "/a.swap.sock");
  EXPECT_EQ(sw->size_bytes, 1u << 20);
  EXPECT_FALSE(sw->connected);
  struct stat st {};
  ASSERT_EQ(stat(sw->socket_path.c_str(), &st), 0) << "must listen";
  EXPECT_EQ(st.st_mode & 0777, 0660u) << "the ivshmem sockets' mode";
  EXPECT_EQ(agent_->store().GetHostStats().vms, 1u);
  absl::StatusOr<VmInfo> only_swap = agent_->GetVm("a");
  ASSERT_TRUE(only_swap.ok());
  EXPECT_FALSE(only_swap->has_channel);
  EXPECT_TRUE(only_swap->socket_path.empty());
  ASSERT_TRUE(only_swap->swap.has_value());
  const VmId id = only_swap->stats.id;

  VmPolicy policy;
  policy.quota_bytes = 8 << 20;
  policy.weight = 300;
  ASSERT_TRUE(agent_->AddVm("a", policy).ok());
  absl::StatusOr<VmInfo> both = agent_->GetVm("a");
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE(both->has_channel);
  EXPECT_TRUE(both->swap.has_value());
  EXPECT_EQ(both->stats.id, id) << "the channel must join the swap's VM";
  EXPECT_EQ(agent_->store().GetHostStats().vms, 1u);
  EXPECT_EQ(agent_->store().GetVmPolicy(id)->quota_bytes, 8u << 20);
  EXPECT_EQ(agent_->store().GetVmPolicy(id)->weight, 300u);
  EXPECT_EQ(agent_->VmNames(), (std::vector<std::string>{"a"}));

  EXPECT_EQ(agent_->AddSwapDevice("a", 1 << 20).status().code(),
            absl::StatusCode::kAlreadyExists);
  for (uint64_t bad : {uint64_t{0}, uint64_t{4097}, uint64_t{100}}) {
    EXPECT_EQ(agent_->AddSwapDevice("b", bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(agent_->AddSwapDevice("../b", 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(agent_->HasVm("b")) << "a refused device registers nothing";

  // The channel goes; the VM (and its policy) stays for the swap device.
  ASSERT_TRUE(agent_->RemoveVm("a").ok());
  EXPECT_NE(stat((dir_ + "/a.sock").c_str(), &st), 0);
  ASSERT_TRUE(agent_->HasVm("a"));
  EXPECT_FALSE(agent_->GetVm("a")->has_channel);
  EXPECT_EQ(agent_->GetVm("a")->stats.id, id);
  EXPECT_EQ(agent_->store().GetVmPolicy(id)->quota_bytes, 8u << 20);
  EXPECT_EQ(agent_->RemoveVm("a").code(), absl::StatusCode::kNotFound);

  // The swap device goes: the VM is forgotten, its socket unlinked.
  ASSERT_TRUE(agent_->RemoveSwapDevice("a").ok());
  EXPECT_FALSE(agent_->HasVm("a"));
  EXPECT_NE(stat(sw->socket_path.c_str(), &st), 0);
  EXPECT_EQ(agent_->store().GetHostStats().vms, 0u);
  EXPECT_EQ(agent_->RemoveSwapDevice("a").code(), absl::StatusCode::kNotFound);

  // And the other order: the channel first, the swap device joins it.
  ASSERT_TRUE(agent_->AddVm("c", policy).ok());
  ASSERT_TRUE(agent_->AddSwapDevice("c", 4096).ok());
  EXPECT_EQ(agent_->store().GetHostStats().vms, 1u);
  EXPECT_EQ(agent_->store().GetVmPolicy(agent_->GetVm("c")->stats.id)->weight,
            300u)
      << "a swap device leaves the channel's policy alone";
  ASSERT_TRUE(agent_->RemoveSwapDevice("c").ok());
  EXPECT_TRUE(agent_->GetVm("c")->has_channel);
  EXPECT_FALSE(agent_->GetVm("c")->swap.has_value());
  EXPECT_EQ(agent_->store().GetHostStats().vms, 1u);
}

// A VM registered by its swap device starts with the policy asked for
// (tmemd passes what [swap.NAME] configures); a VM already known keeps its
// own.
TEST_F(AgentTest, SwapDeviceRegistersANewVmWithTheRequestedPolicy) {
  VmPolicy requested;
  requested.quota_bytes = 32 << 20;
  requested.weight = 250;
  requested.swap_quota_bytes = 8 << 20;
  requested.swap_mode = ValveMode::kAlways;
  ASSERT_TRUE(agent_->AddSwapDevice("s", 1 << 20, requested).ok());
  absl::StatusOr<VmPolicy> got = agent_->GetVmPolicy("s");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->quota_bytes, uint64_t{32} << 20);
  EXPECT_EQ(got->weight, 250u);
  EXPECT_EQ(got->swap_quota_bytes, uint64_t{8} << 20);
  EXPECT_EQ(got->swap_mode, ValveMode::kAlways);

  VmPolicy channel;
  channel.quota_bytes = 4 << 20;
  ASSERT_TRUE(agent_->AddVm("t", channel).ok());
  ASSERT_TRUE(agent_->AddSwapDevice("t", 1 << 20, requested).ok());
  got = agent_->GetVmPolicy("t");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->quota_bytes, uint64_t{4} << 20);
  EXPECT_EQ(got->swap_quota_bytes, kUnlimitedQuota);
}

// Removing a swap device loses none of its pages: those it held in memory
// go into its spill image first, so adding the device again serves the
// same disk. (Freeing them without writing them back left holes that read
// as zeros.)
TEST(AgentSwapTest, RemovingADeviceKeepsItsPagesInTheImage) {
  tmem::testing::TempDir tmp("tmem-agent-swap");
  ASSERT_FALSE(tmp.path().empty());
  FakeSampler sampler;
  absl::StatusOr<std::unique_ptr<Agent>> agent =
      Agent::Create(testing::SwapTestAgentOptions(tmp.path(), &sampler));
  ASSERT_TRUE(agent.ok()) << agent.status();
  constexpr uint64_t kDevicePages = 1024;
  constexpr int kPages = 64;
  const auto queues = static_cast<uint64_t>((*agent)->options().swap_queues);

  absl::StatusOr<SwapDeviceInfo> sw =
      (*agent)->AddSwapDevice("a", kDevicePages * swap::kSwapPageSize);
  ASSERT_TRUE(sw.ok()) << sw.status();
  {
    auto fe = swap::testing::FrontEnd::Connect(sw->socket_path);
    ASSERT_NE(fe, nullptr);
    swap::testing::Guest g(kDevicePages, queues);
    g.Handshake(fe.get());
    for (uint8_t s : g.WritePages(0, kPages, 5)) {
      ASSERT_EQ(s, swap::kVirtioBlkSOk);
    }
    ASSERT_EQ(g.VerifyPages(0, kPages, 5), 0);
    absl::StatusOr<VmInfo> vm = (*agent)->GetVm("a");
    ASSERT_TRUE(vm.ok() && vm->swap.has_value());
    ASSERT_EQ(vm->swap->pages.in_memory, uint64_t{kPages})
        << "the pages must be held in memory";
  }
  ASSERT_TRUE((*agent)->RemoveSwapDevice("a").ok());

  sw = (*agent)->AddSwapDevice("a", kDevicePages * swap::kSwapPageSize);
  ASSERT_TRUE(sw.ok()) << sw.status();
  auto fe = swap::testing::FrontEnd::Connect(sw->socket_path);
  ASSERT_NE(fe, nullptr);
  swap::testing::Guest g(kDevicePages, queues);
  g.Handshake(fe.get());
  EXPECT_EQ(g.VerifyPages(0, kPages, 5), 0) << "every page must come back";
  EXPECT_EQ(g.VerifyPages(0, 8, 6), 8) << "negative control";
}

// A VM's swap quota bounds what its swap device keeps in memory, within a
// larger VM quota: the pages past it go to the spill image (spilled for
// quota), the VM's persistent charge stays within the swap quota, and every
// page reads back.
TEST(AgentSwapTest, SwapQuotaSpillsPastItWithinALargerVmQuota) {
  tmem::testing::TempDir tmp("tmem-agent-swapq");
  ASSERT_FALSE(tmp.path().empty());
  FakeSampler sampler;
  absl::StatusOr<std::unique_ptr<Agent>> agent =
      Agent::Create(testing::SwapTestAgentOptions(tmp.path(), &sampler));
  ASSERT_TRUE(agent.ok()) << agent.status();
  constexpr uint64_t kDevicePages = 1024;
  constexpr int kPages = 256;  // 1 MiB written
  constexpr uint64_t kSwapQuota = 256 << 10;
  constexpr uint64_t kVmQuota = 16 << 20;
  const auto queues = static_cast<uint64_t>((*agent)->options().swap_queues);

  absl::StatusOr<SwapDeviceInfo> sw =
      (*agent)->AddSwapDevice("a", kDevicePages * swap::kSwapPageSize);
  ASSERT_TRUE(sw.ok()) << sw.status();
  VmPolicy policy;
  policy.quota_bytes = kVmQuota;
  policy.swap_quota_bytes = kSwapQuota;
  ASSERT_TRUE((*agent)->SetVmPolicy("a", policy).ok());

  auto fe = swap::testing::FrontEnd::Connect(sw->socket_path);
  ASSERT_NE(fe, nullptr);
  swap::testing::Guest g(kDevicePages, queues);
  g.Handshake(fe.get());
  for (uint8_t s : g.WritePages(0, kPages, 7)) {
    ASSERT_EQ(s, swap::kVirtioBlkSOk);
  }
  absl::StatusOr<VmInfo> vm = (*agent)->GetVm("a");
  ASSERT_TRUE(vm.ok() && vm->swap.has_value());
  EXPECT_EQ(vm->policy.swap_quota_bytes, kSwapQuota);
  EXPECT_EQ(vm->policy.quota_bytes, kVmQuota);
  uint64_t spilled_quota = 0;
  bool named = false;
  for (const auto& [name, value] : vm->swap->pages.counters) {
    if (name ==
        swap::TmemSwapCounterName(swap::TmemSwapCounter::kSpilledQuota)) {
      spilled_quota = value;
      named = true;
    }
  }
  ASSERT_TRUE(named);
  EXPECT_GT(spilled_quota, 0u);
  EXPECT_GT(vm->swap->pages.in_memory, 0u);
  EXPECT_GT(vm->swap->pages.spilled, 0u);
  const uint64_t persistent =
      CounterValueOf(vm->stats.counters, Counter::kPersistentChargedBytes);
  EXPECT_LE(persistent, kSwapQuota);
  EXPECT_GT(persistent, 0u);
  EXPECT_LT(CounterValueOf(vm->stats.counters, Counter::kChargedBytes),
            kVmQuota)
      << "the VM quota is not what refused them";
  EXPECT_EQ(CounterValueOf(vm->stats.counters,
                           Counter::kPersistentPutsRefusedForSwapQuota),
            spilled_quota);
  EXPECT_EQ(g.VerifyPages(0, kPages, 7), 0) << "every page reads back";
}

}  // namespace
}  // namespace tmem
