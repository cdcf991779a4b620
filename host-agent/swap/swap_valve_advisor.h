// SwapValveAdvisor: the valve as a swap device's store sees it.
//
// The valve's Advise is made for cleancache: it drops puts of a VM whose
// pages do not come back (reuse throttle, ghosts), of a guest deep in CPU
// debt that ignores the admission hint, and of a VM at its share when
// memory is short. A swap page always comes back, and a "drop" there only
// moves the page to the spill image, where reading it back costs the host
// more than storing it. So a swap device's puts ask Valve::DecideSwap:
// compress with spare CPU tokens, raw (or deferred to idle cycles) without
// them, never a drop for reuse; room is the store's business (a refused
// put spills). Swap reads are not reported as gets: every swap page is read
// back, so they would make any VM look like one whose cleancache pages
// return. The CPU a device spends on the VM (ChargeCpu) goes to the VM's
// token bucket like its ring work, so the host budget counts it.
//
// Thread safety: as the valve's hot path (lock-free); any thread. The
// valve must outlive the advisor.
#ifndef TMEMD_HOST_AGENT_SWAP_SWAP_VALVE_ADVISOR_H_
#define TMEMD_HOST_AGENT_SWAP_SWAP_VALVE_ADVISOR_H_

#include <cstdint>

#include "backend/put_advisor.h"
#include "backend/valve.h"

namespace tmem::swap {

class SwapValveAdvisor final : public PutAdvisor {
 public:
  explicit SwapValveAdvisor(Valve* valve) : valve_(valve) {}

  PutMode Advise(uint32_t vm, uint64_t /*key_hash*/,
                 bool /*guest_applies_hint*/) override {
    return valve_->DecideSwap(vm);
  }
  // OnGet: deliberately the default no-op (see above).
  void ChargeCpu(uint32_t vm, int64_t nanos) override {
    valve_->ChargeCpu(vm, nanos);
  }

 private:
  Valve* const valve_;
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SWAP_VALVE_ADVISOR_H_
