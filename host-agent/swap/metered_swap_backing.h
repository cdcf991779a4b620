// MeteredSwapBacking: a SwapBacking that forwards every call to another and
// counts what the device alone cannot see: pages discarded (DISCARD and
// WRITE_ZEROES free pages), and the time the backing spent in reads and
// writes (for a mean latency per call: seconds / calls, as Prometheus
// rates them). Thread-safe as its inner backing is; counters are relaxed
// atomics any thread may read.
#ifndef TMEMD_HOST_AGENT_SWAP_METERED_SWAP_BACKING_H_
#define TMEMD_HOST_AGENT_SWAP_METERED_SWAP_BACKING_H_

#include <atomic>
#include <cstdint>

#include "host-agent/swap/swap_backing.h"

namespace tmem::swap {

struct SwapBackingTimes {
  uint64_t discarded_pages = 0;
  uint64_t read_calls = 0;
  uint64_t read_ns = 0;
  uint64_t write_calls = 0;
  uint64_t write_ns = 0;
};

class MeteredSwapBacking final : public SwapBacking {
 public:
  explicit MeteredSwapBacking(SwapBacking* inner) : inner_(inner) {}

  uint64_t page_count() const override { return inner_->page_count(); }
  absl::Status ReadPages(uint64_t first_page, uint64_t count,
                         std::span<const GuestSpan> dst) override;
  absl::Status WritePages(uint64_t first_page, uint64_t count,
                          std::span<const GuestSpan> src) override;
  absl::Status DiscardPages(uint64_t first_page, uint64_t count) override;
  absl::Status WriteZeroPages(uint64_t first_page, uint64_t count,
                              bool may_unmap) override;
  absl::Status Flush() override { return inner_->Flush(); }

  SwapBackingTimes Times() const;

 private:
  SwapBacking* const inner_;
  std::atomic<uint64_t> discarded_pages_{0};
  std::atomic<uint64_t> read_calls_{0};
  std::atomic<uint64_t> read_ns_{0};
  std::atomic<uint64_t> write_calls_{0};
  std::atomic<uint64_t> write_ns_{0};
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_METERED_SWAP_BACKING_H_
