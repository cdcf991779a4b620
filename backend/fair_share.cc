#include "backend/fair_share.h"

namespace tmem {

namespace {
uint64_t EffectiveWeight(const ShareInput& in) {
  return in.weight == 0 ? 1 : in.weight;
}
}  // namespace

int PickEvictionVictim(std::span<const ShareInput> vms) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(vms.size()); ++i) {
    if (vms[i].charged_bytes == 0) continue;
    if (best < 0) {
      best = i;
      continue;
    }
    // Compare charged_i / w_i > charged_best / w_best without division.
    // 128-bit products: charges reach 2^44, weights 2^32.
    const unsigned __int128 lhs =
        static_cast<unsigned __int128>(vms[i].charged_bytes) *
        EffectiveWeight(vms[best]);
    const unsigned __int128 rhs =
        static_cast<unsigned __int128>(vms[best].charged_bytes) *
        EffectiveWeight(vms[i]);
    if (lhs > rhs ||
        (lhs == rhs && vms[i].charged_bytes > vms[best].charged_bytes)) {
      best = i;
    }
  }
  return best;
}

uint64_t FairShareBytes(uint64_t cap_bytes, std::span<const ShareInput> vms,
                        int index) {
  unsigned __int128 total = 0;
  for (int i = 0; i < static_cast<int>(vms.size()); ++i) {
    if (vms[i].charged_bytes > 0 || i == index)
      total += EffectiveWeight(vms[i]);
  }
  if (total == 0) return 0;
  return static_cast<uint64_t>(static_cast<unsigned __int128>(cap_bytes) *
                               EffectiveWeight(vms[index]) / total);
}

}  // namespace tmem
