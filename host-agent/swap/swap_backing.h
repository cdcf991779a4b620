// SwapBacking: where a swap device's pages live, addressed by 4 KiB page
// index. The device (virtio_blk_request) turns sectors into pages and does
// read-modify-write for partial pages itself, so a backing only ever sees
// whole pages.
//
// Contract for every implementation:
//  * Pages are [0, page_count()). A page never written, or last discarded
//    or zeroed, reads as 4096 zero bytes. A written page is never dropped:
//    if a write cannot be stored, WritePages returns an error (the guest
//    gets VIRTIO_BLK_S_IOERR) and the pages keep their previous content
//    (per page; a multi-page write may have stored a prefix).
//  * Spans point into guest memory that the guest may change while the
//    call runs: WritePages copies the bytes once and derives everything
//    (zero detection, compression) from its copy; ReadPages writes each
//    destination byte and never reads it back. The spans of one call hold
//    exactly count * 4096 bytes in total, in page order, and may split a
//    page anywhere.
//  * Errors are absl::Status: kOutOfRange for pages outside the device,
//    kResourceExhausted when there is no room, kInternal/kDataLoss for a
//    store fault. The device counts each and fails the request.
//  * Flush returns once every completed write would survive what the
//    backing promises to survive (for the memory backing: nothing more).
// Thread safety: implementations must allow calls from several threads
// (one per virtqueue, later); the device never issues two calls for the
// same page concurrently.
#ifndef TMEMD_HOST_AGENT_SWAP_SWAP_BACKING_H_
#define TMEMD_HOST_AGENT_SWAP_SWAP_BACKING_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "host-agent/swap/guest_memory.h"

namespace tmem::swap {

inline constexpr size_t kSwapPageSize = 4096;

class SwapBacking {
 public:
  virtual ~SwapBacking() = default;
  virtual uint64_t page_count() const = 0;
  virtual absl::Status ReadPages(uint64_t first_page, uint64_t count,
                                 std::span<const GuestSpan> dst) = 0;
  virtual absl::Status WritePages(uint64_t first_page, uint64_t count,
                                  std::span<const GuestSpan> src) = 0;
  // The guest no longer needs these pages: free them (they read as zeros).
  virtual absl::Status DiscardPages(uint64_t first_page, uint64_t count) = 0;
  // The pages must read as zeros; `may_unmap` lets the backing free them
  // (it always may read back zeros cheaply, so both end the same).
  virtual absl::Status WriteZeroPages(uint64_t first_page, uint64_t count,
                                      bool may_unmap) = 0;
  virtual absl::Status Flush() = 0;
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SWAP_BACKING_H_
