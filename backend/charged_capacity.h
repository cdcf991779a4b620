// ChargedCapacity: keeps a MemoryBudget in step with a container's capacity.
//
// Growth goes through TryGrow: the new footprint is charged while the old
// one is still charged (a resize holds both for a moment), the container
// grows, then the old footprint is released. If the budget cannot take the
// new footprint, nothing grows and TryGrow returns false, so growth never
// pushes the budget over its cap. Shrinking goes through Sync. Not
// thread-safe: the owner's lock covers it.
#ifndef TMEMD_BACKEND_CHARGED_CAPACITY_H_
#define TMEMD_BACKEND_CHARGED_CAPACITY_H_

#include <cstdint>

#include "backend/memory_budget.h"

namespace tmem {

class ChargedCapacity {
 public:
  explicit ChargedCapacity(MemoryBudget* budget) : budget_(budget) {}
  ChargedCapacity(const ChargedCapacity&) = delete;
  ChargedCapacity& operator=(const ChargedCapacity&) = delete;
  ~ChargedCapacity() { budget_->Release(charged_); }

  // Charges `new_bytes`, runs `grow`, then releases the old charge.
  // `new_bytes` must be the container's footprint after `grow`.
  template <typename Fn>
  bool TryGrow(uint64_t new_bytes, Fn&& grow) {
    if (!budget_->TryCharge(new_bytes)) return false;
    grow();
    budget_->Release(charged_);
    charged_ = new_bytes;
    return true;
  }

  // Sets the charge to the footprint now (used when shrinking).
  void Sync(uint64_t bytes_now) {
    if (bytes_now > charged_) {
      budget_->ForceCharge(bytes_now - charged_);
    } else if (bytes_now < charged_) {
      budget_->Release(charged_ - bytes_now);
    }
    charged_ = bytes_now;
  }
  uint64_t charged() const { return charged_; }

 private:
  MemoryBudget* budget_;
  uint64_t charged_ = 0;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_CHARGED_CAPACITY_H_
