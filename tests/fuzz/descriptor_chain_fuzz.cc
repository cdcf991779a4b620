// libFuzzer target for the swap device's data path: the split virtqueue,
// the descriptor walker and virtio-blk request execution
// (host-agent/swap/split_virtqueue.h, descriptor_chain.h, virtio_blk.h).
//
// The guest controls every byte of its memory; tmemd must never crash,
// touch memory outside the guest's regions or trip ASan/UBSan, whatever the
// rings, descriptors, indirect tables and request headers hold. The input:
//
//   byte 0      control: bits 0-2 log2 of the queue size (1..128),
//               bit 3 indirect descriptors negotiated, bit 4 EVENT_IDX,
//               bit 5 two guest-physical regions instead of one
//   then        the guest memory image (kMemBytes; missing bytes are 0),
//               laid out as: descriptor table at 0, avail ring at 0x1000,
//               used ring at 0x2000, everything else buffers.
//
// Guest memory is two adjacent or separate regions (so buffers crossing
// and missing regions are reachable). Every available head is walked and,
// if the chain is valid, executed against an in-memory backing of 64
// pages, with the completion pushed as the device does. Checked: a valid
// chain's spans all lie inside the image, and the used length never
// exceeds the chain's writable bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "host-agent/swap/descriptor_chain.h"
#include "host-agent/swap/guest_memory.h"
#include "host-agent/swap/memory_swap_backing.h"
#include "host-agent/swap/split_virtqueue.h"
#include "host-agent/swap/virtio_blk.h"

namespace {
constexpr uint64_t kMemBytes = 64 * 1024;
constexpr uint64_t kGpa = 0x10000;
constexpr uint64_t kUva = 0x7f0000000000;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tmem::swap;
  if (size < 1) return 0;
  static MemorySwapBacking backing(64);
  const uint8_t control = data[0];
  const uint32_t qsize = 1u << ((control & 7) % 8);
  const bool indirect = (control & 8) != 0;
  const bool event_idx = (control & 16) != 0;
  const bool split = (control & 32) != 0;

  std::vector<uint8_t> image(kMemBytes, 0);
  std::memcpy(image.data(), data + 1, std::min<size_t>(size - 1, image.size()));

  std::vector<MemoryRegionDesc> regions;
  std::vector<uint8_t*> bases;
  if (split) {
    // Two halves; the second not contiguous in guest-physical space.
    regions.push_back({kGpa, kMemBytes / 2, kUva, 0});
    regions.push_back(
        {kGpa + kMemBytes, kMemBytes / 2, kUva + kMemBytes / 2, 0});
    bases = {image.data(), image.data() + kMemBytes / 2};
  } else {
    regions.push_back({kGpa, kMemBytes, kUva, 0});
    bases = {image.data()};
  }
  auto mem = GuestMemory::FromBuffers(regions, bases);
  if (!mem.ok()) abort();

  SplitVirtqueue vq;
  if (!vq.Configure(*mem, qsize, kUva, kUva + 0x1000, kUva + 0x2000, event_idx)
           .ok()) {
    return 0;
  }
  BlkDeviceConfig config;
  config.capacity_sectors = backing.page_count() * kSectorsPerPage;
  SwapMetrics metrics;
  DescriptorChain chain;
  const uint8_t* lo = image.data();
  const uint8_t* hi = image.data() + image.size();
  uint16_t head = 0;
  for (int n = 0; n < 256 && vq.Pop(&head) == SplitVirtqueue::PopResult::kHead;
       ++n) {
    const ChainError e = WalkDescriptorChain(*mem, vq.descriptor_table(),
                                             vq.size(), head, indirect, &chain);
    if (e != ChainError::kNone) break;  // the device stops the queue
    for (const auto* list : {&chain.readable, &chain.writable}) {
      for (const GuestSpan& s : *list) {
        if (s.data < lo || s.data > hi ||
            s.len > static_cast<size_t>(hi - s.data)) {
          abort();
        }
      }
    }
    const uint32_t used = ExecuteBlkRequest(chain, config, &backing, &metrics);
    if (used > chain.writable_len) abort();
    vq.PushUsed(head, used);
  }
  vq.NeedsCall();
  vq.EnableKicks();
  // Inputs must not depend on each other.
  backing.DiscardPages(0, backing.page_count()).IgnoreError();
  return 0;
}
