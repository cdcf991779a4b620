// MemorySwapBacking: a SwapBacking held in a hash map of 4 KiB pages, for
// tests and the test server. Never-written pages cost nothing and read as
// zeros; discard and write-zeroes free pages at once. An optional page
// limit makes writes beyond it fail with kResourceExhausted (to test the
// guest-visible I/O error path). Thread-safe (one mutex).
#ifndef TMEMD_HOST_AGENT_SWAP_MEMORY_SWAP_BACKING_H_
#define TMEMD_HOST_AGENT_SWAP_MEMORY_SWAP_BACKING_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "backend/mutex.h"
#include "host-agent/swap/swap_backing.h"

namespace tmem::swap {

class MemorySwapBacking final : public SwapBacking {
 public:
  explicit MemorySwapBacking(uint64_t page_count,
                             std::optional<uint64_t> max_stored = {});

  uint64_t page_count() const override { return page_count_; }
  absl::Status ReadPages(uint64_t first_page, uint64_t count,
                         std::span<const GuestSpan> dst) override;
  absl::Status WritePages(uint64_t first_page, uint64_t count,
                          std::span<const GuestSpan> src) override;
  absl::Status DiscardPages(uint64_t first_page, uint64_t count) override;
  absl::Status WriteZeroPages(uint64_t first_page, uint64_t count,
                              bool may_unmap) override;
  absl::Status Flush() override { return absl::OkStatus(); }

  // Pages holding data now.
  uint64_t stored_pages() const;
  // Test hook: flips one byte of a stored page (negative controls).
  bool CorruptPage(uint64_t page);

 private:
  using Page = std::array<uint8_t, kSwapPageSize>;
  absl::Status CheckRange(uint64_t first_page, uint64_t count,
                          std::span<const GuestSpan> spans) const;

  const uint64_t page_count_;
  const std::optional<uint64_t> max_stored_;
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Page>> pages_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_MEMORY_SWAP_BACKING_H_
