// Weighted fair share: who gives up memory when the host is full.
//
// A VM's fair share of the host cap is cap * weight / (sum of weights of VMs
// holding pages). The victim is the VM with the largest charged/weight, i.e.
// the one furthest over its share. When the host is full the charges sum to
// about the cap, so that VM is at or over its share: a VM within its share is
// never robbed while another is over. Pure functions; thread-compatible.
#ifndef TMEMD_BACKEND_FAIR_SHARE_H_
#define TMEMD_BACKEND_FAIR_SHARE_H_

#include <cstdint>
#include <span>

namespace tmem {

struct ShareInput {
  uint64_t charged_bytes = 0;
  uint32_t weight = 1;  // 0 is treated as 1: every VM can be a victim
};

// Index of the VM to evict from, or -1 if no VM holds anything.
int PickEvictionVictim(std::span<const ShareInput> vms);

// A VM's fair share in bytes among the VMs that hold pages (plus itself).
uint64_t FairShareBytes(uint64_t cap_bytes, std::span<const ShareInput> vms,
                        int index);

}  // namespace tmem

#endif  // TMEMD_BACKEND_FAIR_SHARE_H_
