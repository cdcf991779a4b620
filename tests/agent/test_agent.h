// What the agent tests share: a CPU sampler the test drives, and the
// options of an agent with real swap devices (the tmem swap store, a spill
// image under the test's directory, no valve ticker: the test ticks).
#ifndef TMEMD_TESTS_AGENT_TEST_AGENT_H_
#define TMEMD_TESTS_AGENT_TEST_AGENT_H_

#include <cstdint>
#include <string>

#include "host-agent/agent.h"
#include "host-agent/swap/swap_store.h"

namespace tmem::testing {

// Each sample is 100 ms of a 2-CPU host, `busy` of it busy.
class FakeSampler final : public CpuSampler {
 public:
  absl::StatusOr<CpuSample> Sample() override {
    s_.num_cpus = 2;
    s_.wall_nanos += 100'000'000;
    s_.host_total_nanos += 200'000'000;
    s_.host_busy_nanos += static_cast<uint64_t>(busy * 200'000'000);
    return s_;
  }
  double busy = 0;

 private:
  CpuSample s_;
};

inline AgentOptions SwapTestAgentOptions(const std::string& dir,
                                         CpuSampler* sampler) {
  AgentOptions o;
  o.socket_dir = dir;
  o.state_dir = dir + "/state";
  o.swap_store_factory = swap::TmemSwapStoreFactory();
  o.store.memory_cap_bytes = 64 << 20;
  o.store.address_space_bytes = 256 << 20;
  o.workers = 1;
  o.cpu_sampler = sampler;
  o.run_valve_ticker = false;
  return o;
}

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_AGENT_TEST_AGENT_H_
