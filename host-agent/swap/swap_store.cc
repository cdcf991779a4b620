#include "host-agent/swap/swap_store.h"

#include "host-agent/swap/memory_swap_backing.h"

namespace tmem::swap {
namespace {

class MemorySwapStore final : public SwapStore {
 public:
  explicit MemorySwapStore(uint64_t page_count) : backing_(page_count) {}
  SwapBacking& backing() override { return backing_; }
  SwapPageStats PageStats() const override {
    const uint64_t stored = backing_.stored_pages();
    return {.stored = stored, .compressed = 0, .raw = stored, .spilled = 0};
  }
  absl::Status WriteBack() override { return absl::OkStatus(); }

 private:
  MemorySwapBacking backing_;
};

}  // namespace

SwapStoreFactory MemorySwapStoreFactory() {
  return [](const SwapStoreRequest& r)
             -> absl::StatusOr<std::unique_ptr<SwapStore>> {
    return std::make_unique<MemorySwapStore>(r.page_count);
  };
}

}  // namespace tmem::swap
