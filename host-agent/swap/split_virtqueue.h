// SplitVirtqueue: the device side of one split virtqueue (virtio 1.x,
// 2.7): the available ring it consumes, the used ring it fills, and the
// notification rules in both directions (with or without
// VIRTIO_RING_F_EVENT_IDX).
//
// Contract:
//  * Configure checks the queue size (a power of two, 1..32768) and that
//    the descriptor table (16 * size bytes, 16-aligned), available ring
//    (6 + 2 * size, 2-aligned) and used ring (6 + 8 * size, 4-aligned) each
//    lie inside one region of guest memory (addresses in QEMU's user space,
//    as SET_VRING_ADDR gives them). Refused otherwise, queue unusable.
//  * Pop returns the next available head, kEmpty, or kCorrupt when the
//    guest's avail->idx is more than `size` ahead of what we consumed (no
//    honest driver can do that). A corrupt queue stays corrupt until it is
//    configured again.
//  * PushUsed publishes one completion: the element first, then used->idx
//    with release order, so a driver that sees the index sees the element.
//  * NeedsCall says whether the driver asked to be interrupted for what was
//    pushed since the last call (used_event with EVENT_IDX, else the
//    NO_INTERRUPT flag). EnableKicks (EVENT_IDX) publishes avail_event and
//    returns true if more buffers arrived meanwhile, so the caller drains
//    again instead of sleeping on a kick that will never come.
//  * The rings are guest memory shared with a running driver: every index
//    is read once (atomically) into a local and checked before use.
// Not thread-safe: one thread serves a queue.
#ifndef TMEMD_HOST_AGENT_SWAP_SPLIT_VIRTQUEUE_H_
#define TMEMD_HOST_AGENT_SWAP_SPLIT_VIRTQUEUE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "host-agent/swap/guest_memory.h"

namespace tmem::swap {

inline constexpr uint32_t kMaxQueueSize = 32768;
inline constexpr uint16_t kVirtqAvailFNoInterrupt = 1;

class SplitVirtqueue {
 public:
  enum class PopResult { kHead, kEmpty, kCorrupt };

  absl::Status Configure(const GuestMemory& mem, uint32_t size,
                         uint64_t desc_uva, uint64_t avail_uva,
                         uint64_t used_uva, bool event_idx);
  void Reset();

  bool configured() const { return desc_ != nullptr; }
  bool corrupt() const { return corrupt_; }
  uint16_t size() const { return size_; }
  const uint8_t* descriptor_table() const { return desc_; }

  // The next avail index to consume (SET_VRING_BASE / GET_VRING_BASE).
  uint16_t last_avail_idx() const { return last_avail_; }
  void set_last_avail_idx(uint16_t v) { last_avail_ = v; }

  PopResult Pop(uint16_t* head);
  void PushUsed(uint16_t head, uint32_t len);
  bool NeedsCall();
  bool EnableKicks();

 private:
  uint16_t LoadAvailIdx() const;

  uint8_t* desc_ = nullptr;
  uint8_t* avail_ = nullptr;
  uint8_t* used_ = nullptr;
  uint16_t size_ = 0;
  bool event_idx_ = false;
  bool corrupt_ = false;
  uint16_t last_avail_ = 0;
  uint16_t used_idx_ = 0;        // ours: the driver never writes used->idx
  uint16_t signalled_used_ = 0;  // used_idx_ at the last call
  bool signalled_valid_ = false;
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SPLIT_VIRTQUEUE_H_
