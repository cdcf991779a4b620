// DescriptorChain: walking one split-virtqueue descriptor chain (virtio 1.x,
// 2.7.5 and 2.7.5.3) into device-readable and device-writable spans of
// guest memory.
//
// Contract:
//  * WalkDescriptorChain reads each 16-byte descriptor once, into a local,
//    from a table the guest can change at any time, and refuses (one
//    ChainError each, so every cause has its own counter):
//      - a head or `next` index >= the table size;
//      - more descriptors than the table holds (a loop, or a chain longer
//        than the queue: both end there, so no loop detection is needed);
//      - INDIRECT when the feature was not negotiated, INDIRECT together
//        with NEXT, an indirect table inside an indirect table, an indirect
//        table whose length is 0, not a multiple of 16 or above
//        kMaxIndirectDescriptors entries, or that is not in guest memory;
//      - a buffer (addr, len) any byte of which is outside guest memory;
//      - a device-readable buffer after a device-writable one (virtio's
//        required order; a request laid out otherwise is not one we can
//        interpret safely);
//      - a chain totalling more than 4 GiB or more than kMaxChainSpans spans.
//  * On success the spans are in chain order; zero-length buffers are
//    dropped. Nothing is written to guest memory.
// Pure function over the memory it is given; thread-compatible.
#ifndef TMEMD_HOST_AGENT_SWAP_DESCRIPTOR_CHAIN_H_
#define TMEMD_HOST_AGENT_SWAP_DESCRIPTOR_CHAIN_H_

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "host-agent/swap/guest_memory.h"

namespace tmem::swap {

// Descriptor flags (virtq_desc.flags).
inline constexpr uint16_t kVirtqDescFNext = 1;
inline constexpr uint16_t kVirtqDescFWrite = 2;
inline constexpr uint16_t kVirtqDescFIndirect = 4;
inline constexpr size_t kVirtqDescSize = 16;
// Linux sizes indirect tables by the request's segments (seg_max + 2);
// a table larger than this is refused rather than walked.
inline constexpr uint32_t kMaxIndirectDescriptors = 1024;
inline constexpr size_t kMaxChainSpans = 2048;

enum class ChainError : int {
  kNone = 0,
  kHeadOutOfRange,
  kNextOutOfRange,
  kTooLong,  // loop, or longer than the table
  kIndirectNotNegotiated,
  kIndirectWithNext,
  kNestedIndirect,
  kIndirectBadLength,
  kIndirectOutOfMemory,
  kBufferOutOfMemory,
  kReadableAfterWritable,
  kTooLarge,  // > 4 GiB in total, or too many spans
};
std::string_view ChainErrorName(ChainError e);

struct DescriptorChain {
  uint16_t head = 0;
  std::vector<GuestSpan> readable;
  std::vector<GuestSpan> writable;
  uint64_t readable_len = 0;
  uint64_t writable_len = 0;
  void Clear() {
    readable.clear();
    writable.clear();
    readable_len = writable_len = 0;
  }
};

// `table`: the queue's descriptor table (queue_size entries) in our
// mapping, already checked to lie in guest memory. Fills `chain` (cleared
// first; its vectors are reused to avoid allocating per request).
ChainError WalkDescriptorChain(const GuestMemory& mem, const uint8_t* table,
                               uint16_t queue_size, uint16_t head,
                               bool indirect_allowed, DescriptorChain* chain);

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_DESCRIPTOR_CHAIN_H_
