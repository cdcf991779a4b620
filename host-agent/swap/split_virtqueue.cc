#include "host-agent/swap/split_virtqueue.h"

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "host-agent/swap/descriptor_chain.h"

namespace tmem::swap {
namespace {

// Ring layouts (virtio 1.x 2.7.6, 2.7.8):
//   avail: le16 flags, le16 idx, le16 ring[size], le16 used_event
//   used:  le16 flags, le16 idx, {le32 id, le32 len}[size], le16 avail_event
constexpr size_t kAvailIdx = 2;
constexpr size_t kAvailRing = 4;
constexpr size_t kUsedIdx = 2;
constexpr size_t kUsedRing = 4;
constexpr size_t kUsedElemSize = 8;

uint16_t AtomicLoad16(const uint8_t* p, int order) {
  return __atomic_load_n(reinterpret_cast<const uint16_t*>(p), order);
}
void AtomicStore16(uint8_t* p, uint16_t v, int order) {
  __atomic_store_n(reinterpret_cast<uint16_t*>(p), v, order);
}
void AtomicStore32(uint8_t* p, uint32_t v) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(p), v, __ATOMIC_RELAXED);
}

// virtio's vring_need_event: has new_idx just passed event (the index
// after which the driver wants to hear), counting from old?
bool NeedEvent(uint16_t event, uint16_t new_idx, uint16_t old) {
  return static_cast<uint16_t>(new_idx - event - 1) <
         static_cast<uint16_t>(new_idx - old);
}

}  // namespace

absl::Status SplitVirtqueue::Configure(const GuestMemory& mem, uint32_t size,
                                       uint64_t desc_uva, uint64_t avail_uva,
                                       uint64_t used_uva, bool event_idx) {
  Reset();
  if (size == 0 || size > kMaxQueueSize || (size & (size - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queue size ", size, " is not a power of two <= ", kMaxQueueSize));
  }
  if (desc_uva % 16 != 0 || avail_uva % 2 != 0 || used_uva % 4 != 0) {
    return absl::InvalidArgumentError("ring address misaligned");
  }
  // size <= 32768: none of these products overflows.
  uint8_t* desc = mem.TranslateUser(desc_uva, kVirtqDescSize * size);
  uint8_t* avail = mem.TranslateUser(avail_uva, 6 + 2ull * size);
  uint8_t* used = mem.TranslateUser(used_uva, 6 + kUsedElemSize * size);
  if (desc == nullptr || avail == nullptr || used == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring outside guest memory:", desc == nullptr ? " descriptors" : "",
        avail == nullptr ? " avail" : "", used == nullptr ? " used" : ""));
  }
  desc_ = desc;
  avail_ = avail;
  used_ = used;
  size_ = static_cast<uint16_t>(size);  // <= 32768 fits
  event_idx_ = event_idx;
  // Resume where the driver is: the used index is whatever the ring says
  // (the front-end restored it with the ring; we never move it backwards).
  used_idx_ = AtomicLoad16(used_ + kUsedIdx, __ATOMIC_ACQUIRE);
  return absl::OkStatus();
}

void SplitVirtqueue::Reset() {
  desc_ = avail_ = used_ = nullptr;
  size_ = 0;
  corrupt_ = false;
  used_idx_ = 0;
  signalled_valid_ = false;
  event_idx_ = false;
}

uint16_t SplitVirtqueue::LoadAvailIdx() const {
  // Acquire pairs with the driver's write barrier before it bumps idx: the
  // ring entries and descriptors it filled are visible once we see idx.
  return AtomicLoad16(avail_ + kAvailIdx, __ATOMIC_ACQUIRE);
}

SplitVirtqueue::PopResult SplitVirtqueue::Pop(uint16_t* head) {
  if (desc_ == nullptr || corrupt_) return PopResult::kEmpty;
  const uint16_t avail_idx = LoadAvailIdx();
  const auto pending = static_cast<uint16_t>(avail_idx - last_avail_);
  if (pending == 0) return PopResult::kEmpty;
  const uint32_t qsize = size_;
  if (pending > qsize) {
    corrupt_ = true;
    return PopResult::kCorrupt;
  }
  const uint32_t slot = last_avail_ & (qsize - 1);
  *head =
      AtomicLoad16(avail_ + kAvailRing + size_t{2} * slot, __ATOMIC_RELAXED);
  ++last_avail_;
  return PopResult::kHead;
}

void SplitVirtqueue::PushUsed(uint16_t head, uint32_t len) {
  const uint32_t qsize = size_;
  uint8_t* elem = used_ + kUsedRing + kUsedElemSize * (used_idx_ & (qsize - 1));
  AtomicStore32(elem, head);
  AtomicStore32(elem + 4, len);
  ++used_idx_;
  // Release: the element (and the data written into the request's buffers
  // before it) become visible no later than the index that publishes them.
  AtomicStore16(used_ + kUsedIdx, used_idx_, __ATOMIC_RELEASE);
}

bool SplitVirtqueue::NeedsCall() {
  if (desc_ == nullptr) return false;
  // Full barrier: our used->idx store must be visible before we read the
  // driver's used_event / flags; the driver does the mirror image (writes
  // used_event, barrier, reads used->idx), so one of us sees the other.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint32_t qsize = size_;
  if (!event_idx_) {
    const uint16_t flags = AtomicLoad16(avail_, __ATOMIC_RELAXED);
    return (flags & kVirtqAvailFNoInterrupt) == 0;
  }
  const uint16_t used_event =
      AtomicLoad16(avail_ + kAvailRing + size_t{2} * qsize, __ATOMIC_RELAXED);
  const uint16_t old = signalled_used_;
  const bool valid = signalled_valid_;
  signalled_used_ = used_idx_;
  signalled_valid_ = true;
  if (!valid) return true;
  return NeedEvent(used_event, used_idx_, old);
}

bool SplitVirtqueue::EnableKicks() {
  if (desc_ == nullptr || corrupt_) return false;
  if (event_idx_) {
    const uint32_t qsize = size_;
    AtomicStore16(used_ + kUsedRing + kUsedElemSize * qsize, last_avail_,
                  __ATOMIC_RELAXED);
  }
  // Full barrier: avail_event must be visible before we look at avail->idx
  // again; the driver writes idx, barrier, reads avail_event. Otherwise
  // both sides could miss each other and the queue would stall.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return LoadAvailIdx() != last_avail_;
}

}  // namespace tmem::swap
