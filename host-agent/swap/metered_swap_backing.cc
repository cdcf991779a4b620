#include "host-agent/swap/metered_swap_backing.h"

#include <chrono>

namespace tmem::swap {
namespace {

uint64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - start)
          .count());
}

}  // namespace

absl::Status MeteredSwapBacking::ReadPages(uint64_t first_page, uint64_t count,
                                           std::span<const GuestSpan> dst) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = inner_->ReadPages(first_page, count, dst);
  read_ns_.fetch_add(NanosSince(start), std::memory_order_relaxed);
  read_calls_.fetch_add(1, std::memory_order_relaxed);
  return s;
}

absl::Status MeteredSwapBacking::WritePages(uint64_t first_page, uint64_t count,
                                            std::span<const GuestSpan> src) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = inner_->WritePages(first_page, count, src);
  write_ns_.fetch_add(NanosSince(start), std::memory_order_relaxed);
  write_calls_.fetch_add(1, std::memory_order_relaxed);
  return s;
}

absl::Status MeteredSwapBacking::DiscardPages(uint64_t first_page,
                                              uint64_t count) {
  absl::Status s = inner_->DiscardPages(first_page, count);
  if (s.ok()) discarded_pages_.fetch_add(count, std::memory_order_relaxed);
  return s;
}

absl::Status MeteredSwapBacking::WriteZeroPages(uint64_t first_page,
                                                uint64_t count,
                                                bool may_unmap) {
  absl::Status s = inner_->WriteZeroPages(first_page, count, may_unmap);
  if (s.ok()) discarded_pages_.fetch_add(count, std::memory_order_relaxed);
  return s;
}

SwapBackingTimes MeteredSwapBacking::Times() const {
  return {.discarded_pages = discarded_pages_.load(std::memory_order_relaxed),
          .read_calls = read_calls_.load(std::memory_order_relaxed),
          .read_ns = read_ns_.load(std::memory_order_relaxed),
          .write_calls = write_calls_.load(std::memory_order_relaxed),
          .write_ns = write_ns_.load(std::memory_order_relaxed)};
}

}  // namespace tmem::swap
