#include "host-agent/swap/descriptor_chain.h"

#include <cstring>

namespace tmem::swap {
namespace {

struct Desc {
  uint64_t addr;
  uint32_t len;
  uint16_t flags;
  uint16_t next;
};
static_assert(sizeof(Desc) == kVirtqDescSize);

// One copy out of shared memory: later checks see the value we use, not a
// value the guest rewrote in between. The table is guest memory written by
// another process, so it is read with memcpy, never through a typed
// reference the compiler may re-read.
Desc LoadDesc(const uint8_t* table, uint32_t i) {
  Desc d{};
  std::memcpy(&d, table + static_cast<size_t>(i) * kVirtqDescSize, sizeof d);
  return d;
}

constexpr uint64_t kMaxChainBytes = 1ull << 32;

}  // namespace

std::string_view ChainErrorName(ChainError e) {
  switch (e) {
    case ChainError::kNone:
      return "none";
    case ChainError::kHeadOutOfRange:
      return "head_out_of_range";
    case ChainError::kNextOutOfRange:
      return "next_out_of_range";
    case ChainError::kTooLong:
      return "too_long";
    case ChainError::kIndirectNotNegotiated:
      return "indirect_not_negotiated";
    case ChainError::kIndirectWithNext:
      return "indirect_with_next";
    case ChainError::kNestedIndirect:
      return "nested_indirect";
    case ChainError::kIndirectBadLength:
      return "indirect_bad_length";
    case ChainError::kIndirectOutOfMemory:
      return "indirect_out_of_memory";
    case ChainError::kBufferOutOfMemory:
      return "buffer_out_of_memory";
    case ChainError::kReadableAfterWritable:
      return "readable_after_writable";
    case ChainError::kTooLarge:
      return "too_large";
  }
  return "unknown";
}

ChainError WalkDescriptorChain(const GuestMemory& mem, const uint8_t* table,
                               uint16_t queue_size, uint16_t head,
                               bool indirect_allowed, DescriptorChain* chain) {
  chain->Clear();
  chain->head = head;
  if (head >= queue_size) return ChainError::kHeadOutOfRange;

  // The table being walked: the queue's own, or one indirect table.
  const uint8_t* cur_table = table;
  uint32_t cur_size = queue_size;
  uint32_t index = head;
  uint32_t visited = 0;  // in cur_table
  bool in_indirect = false;
  uint64_t total = 0;

  while (true) {
    if (++visited > cur_size) return ChainError::kTooLong;
    const Desc d = LoadDesc(cur_table, index);

    if ((d.flags & kVirtqDescFIndirect) != 0) {
      if (!indirect_allowed) return ChainError::kIndirectNotNegotiated;
      if (in_indirect) return ChainError::kNestedIndirect;
      if ((d.flags & kVirtqDescFNext) != 0) {
        return ChainError::kIndirectWithNext;
      }
      if (d.len == 0 || d.len % kVirtqDescSize != 0 ||
          d.len / kVirtqDescSize > kMaxIndirectDescriptors) {
        return ChainError::kIndirectBadLength;
      }
      const uint8_t* t = mem.TranslateGuest(d.addr, d.len);
      if (t == nullptr) return ChainError::kIndirectOutOfMemory;
      // The walk continues in the indirect table and ends with it: an
      // INDIRECT descriptor has no NEXT, so nothing follows in the outer one.
      cur_table = t;
      cur_size = d.len / kVirtqDescSize;
      index = 0;
      visited = 0;
      in_indirect = true;
      continue;
    }

    if (d.len > 0) {
      total += d.len;  // each len < 2^32, total checked below: no overflow
      if (total > kMaxChainBytes) return ChainError::kTooLarge;
      const bool writable = (d.flags & kVirtqDescFWrite) != 0;
      if (!writable && !chain->writable.empty()) {
        return ChainError::kReadableAfterWritable;
      }
      std::vector<GuestSpan>* out =
          writable ? &chain->writable : &chain->readable;
      const size_t budget =
          kMaxChainSpans - (chain->readable.size() + chain->writable.size());
      if (budget == 0) return ChainError::kTooLarge;
      if (!mem.TranslateGuestSpans(d.addr, d.len, budget, out)) {
        // Distinguish "not guest memory" from "too fragmented".
        std::vector<GuestSpan> probe;
        return mem.TranslateGuestSpans(d.addr, d.len, kMaxChainSpans, &probe)
                   ? ChainError::kTooLarge
                   : ChainError::kBufferOutOfMemory;
      }
      (writable ? chain->writable_len : chain->readable_len) += d.len;
    }

    if ((d.flags & kVirtqDescFNext) == 0) return ChainError::kNone;
    if (d.next >= cur_size) return ChainError::kNextOutOfRange;
    index = d.next;
  }
}

}  // namespace tmem::swap
