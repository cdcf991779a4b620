// The agent's valve tick drives swap relief: a VM's quota lowered below
// what its swap device holds in memory (to 0), and each TickValve moves a
// bounded batch of pages into the device's spill image until the VM is
// within the quota; the guest reads every page back throughout. Real agent,
// real swap device and front-end, real TmemStore; only the CPU sampler is a
// fake.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "host-agent/agent.h"
#include "host-agent/swap/swap_store.h"
#include "tests/agent/test_agent.h"
#include "tests/swap/vhost_user_front_end.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using testing::FakeSampler;

uint64_t Counter(const swap::SwapPageStats& s, const std::string& name) {
  for (const auto& [n, v] : s.counters) {
    if (n == name) return v;
  }
  ADD_FAILURE() << "no counter " << name;
  return 0;
}

TEST(AgentSwapReliefTest, ALoweredQuotaMovesSwapPagesToTheImageTickByTick) {
  tmem::testing::TempDir tmp("tmem-agent-relief");
  ASSERT_FALSE(tmp.path().empty());
  FakeSampler sampler;
  absl::StatusOr<std::unique_ptr<Agent>> agent =
      Agent::Create(testing::SwapTestAgentOptions(tmp.path(), &sampler));
  ASSERT_TRUE(agent.ok()) << agent.status();
  // More pages than one tick moves, so relief takes several.
  constexpr uint64_t kDevicePages = 2048;
  constexpr int kPages = 1100;
  static_assert(kPages > swap::kReliefBatchPages);
  const auto queues = static_cast<uint64_t>((*agent)->options().swap_queues);
  absl::StatusOr<SwapDeviceInfo> sw =
      (*agent)->AddSwapDevice("a", kDevicePages * swap::kSwapPageSize);
  ASSERT_TRUE(sw.ok()) << sw.status();
  auto fe = swap::testing::FrontEnd::Connect(sw->socket_path);
  ASSERT_NE(fe, nullptr);
  swap::testing::Guest g(kDevicePages, queues);
  g.Handshake(fe.get());
  for (uint8_t s : g.WritePages(0, kPages, 5)) {
    ASSERT_EQ(s, swap::kVirtioBlkSOk);
  }
  absl::StatusOr<VmInfo> vm = (*agent)->GetVm("a");
  ASSERT_TRUE(vm.ok() && vm->swap.has_value());
  ASSERT_EQ(vm->swap->pages.in_memory, uint64_t{kPages});

  // Within every limit, a tick moves nothing (the control).
  ASSERT_TRUE((*agent)->TickValve().ok());
  vm = (*agent)->GetVm("a");
  EXPECT_EQ(vm->swap->pages.spilled, 0u);

  const uint64_t charged =
      CounterValueOf(vm->stats.counters, Counter::kChargedBytes);
  ASSERT_GT(charged, 0u);
  VmPolicy policy = vm->policy;
  policy.quota_bytes = 0;  // every swap page must go
  ASSERT_TRUE((*agent)->SetVmPolicy("a", policy).ok());
  // Nothing moved yet: the store evicts no swap page.
  vm = (*agent)->GetVm("a");
  ASSERT_EQ(vm->swap->pages.in_memory, uint64_t{kPages});

  ASSERT_TRUE((*agent)->TickValve().ok());
  vm = (*agent)->GetVm("a");
  EXPECT_EQ(vm->swap->pages.spilled, swap::kReliefBatchPages)
      << "one tick moves one bounded batch";
  EXPECT_EQ(g.VerifyPages(0, kPages, 5), 0);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE((*agent)->TickValve().ok());
  vm = (*agent)->GetVm("a");
  EXPECT_EQ(CounterValueOf(vm->stats.counters, Counter::kChargedBytes), 0u);
  EXPECT_EQ(vm->swap->pages.in_memory, 0u);
  EXPECT_EQ(vm->swap->pages.spilled, uint64_t{kPages});
  EXPECT_EQ(vm->swap->pages.lost, 0u);
  EXPECT_EQ(Counter(vm->swap->pages, "relieved_to_image"),
            vm->swap->pages.spilled);
  EXPECT_EQ(Counter(vm->swap->pages, "relief_image_write_errors"), 0u);
  EXPECT_EQ(g.VerifyPages(0, kPages, 5), 0) << "every page must read back";
  EXPECT_EQ(g.VerifyPages(0, 8, 6), 8) << "negative control";
}

}  // namespace
}  // namespace tmem
