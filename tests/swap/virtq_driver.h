// VirtqDriver: the driver side of one split virtqueue, for tests. Lays out
// a descriptor table, available and used rings and a bump-allocated heap in
// a block of "guest memory" (a buffer, or a memfd shared with a device),
// and builds descriptor chains, honest or hostile, the way a guest would.
// Single-threaded, except that ring indices are written and read with
// atomics so a device thread in the same process may run beside it.
#ifndef TMEMD_TESTS_SWAP_VIRTQ_DRIVER_H_
#define TMEMD_TESTS_SWAP_VIRTQ_DRIVER_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "host-agent/swap/descriptor_chain.h"
#include "host-agent/swap/virtio_blk.h"

namespace tmem::swap::testing {

class VirtqDriver {
 public:
  struct Buf {
    uint64_t gpa;
    uint32_t len;
    bool device_writes;
  };

  // host: our pointer to the block; gpa/uva: its guest-physical and
  // front-end user addresses.
  VirtqDriver(uint8_t* host, uint64_t gpa, uint64_t uva, uint64_t size,
              uint16_t qsize)
      : host_(host), gpa_(gpa), uva_(uva), size_(size), qsize_(qsize) {
    std::memset(host_, 0, RingBytes());
    avail_off_ = kVirtqDescSize * qsize_;
    used_off_ = (avail_off_ + 6 + 2ull * qsize_ + 4095) & ~4095ull;
    heap_ = (used_off_ + 6 + 8ull * qsize_ + 4095) & ~4095ull;
  }
  uint64_t RingBytes() const {
    return ((kVirtqDescSize * qsize_ + 6 + 2ull * qsize_ + 4095) & ~4095ull) +
           ((6 + 8ull * qsize_ + 4095) & ~4095ull);
  }

  uint16_t qsize() const { return qsize_; }
  uint64_t desc_uva() const { return uva_; }
  uint64_t avail_uva() const { return uva_ + avail_off_; }
  uint64_t used_uva() const { return uva_ + used_off_; }
  uint8_t* desc_host() const { return host_; }
  uint64_t desc_gpa() const { return gpa_; }

  // Heap allocation: a guest-physical address of len bytes (16-aligned).
  uint64_t Alloc(uint64_t len) {
    const uint64_t off = heap_;
    heap_ = (heap_ + len + 15) & ~15ull;
    if (heap_ > size_) abort();
    return gpa_ + off;
  }
  void ResetHeap() {
    heap_ = (used_off_ + 6 + 8ull * qsize_ + 4095) & ~4095ull;
  }
  uint8_t* Host(uint64_t gpa) const { return host_ + (gpa - gpa_); }

  void WriteDesc(uint8_t* table, uint16_t i, uint64_t addr, uint32_t len,
                 uint16_t flags, uint16_t next) {
    uint8_t* d = table + kVirtqDescSize * i;
    std::memcpy(d, &addr, 8);
    std::memcpy(d + 8, &len, 4);
    std::memcpy(d + 12, &flags, 2);
    std::memcpy(d + 14, &next, 2);
  }
  void WriteDesc(uint16_t i, uint64_t addr, uint32_t len, uint16_t flags,
                 uint16_t next) {
    WriteDesc(host_, i, addr, len, flags, next);
  }

  // Chains `bufs` through the next free descriptors; returns the head.
  uint16_t Chain(const std::vector<Buf>& bufs) {
    const uint16_t head = next_desc_;
    for (size_t i = 0; i < bufs.size(); ++i) {
      const auto idx = static_cast<uint16_t>((head + i) % qsize_);
      const bool last = i + 1 == bufs.size();
      uint16_t flags = bufs[i].device_writes ? kVirtqDescFWrite : 0;
      if (!last) flags |= kVirtqDescFNext;
      WriteDesc(idx, bufs[i].gpa, bufs[i].len, flags,
                static_cast<uint16_t>((idx + 1) % qsize_));
    }
    next_desc_ = static_cast<uint16_t>((head + bufs.size()) % qsize_);
    return head;
  }
  // One descriptor pointing at an indirect table holding `bufs`.
  uint16_t ChainIndirect(const std::vector<Buf>& bufs) {
    const uint64_t table = Alloc(kVirtqDescSize * bufs.size());
    for (size_t i = 0; i < bufs.size(); ++i) {
      const bool last = i + 1 == bufs.size();
      uint16_t flags = bufs[i].device_writes ? kVirtqDescFWrite : 0;
      if (!last) flags |= kVirtqDescFNext;
      WriteDesc(Host(table), static_cast<uint16_t>(i), bufs[i].gpa, bufs[i].len,
                flags, static_cast<uint16_t>(i + 1));
    }
    const uint16_t head = next_desc_;
    WriteDesc(head, table, static_cast<uint32_t>(kVirtqDescSize * bufs.size()),
              kVirtqDescFIndirect, 0);
    next_desc_ = static_cast<uint16_t>((head + 1) % qsize_);
    return head;
  }

  // Makes `head` available (entry, then idx with release order).
  void Publish(uint16_t head) {
    const uint16_t idx = avail_idx_;
    std::memcpy(host_ + avail_off_ + 4 + size_t{2} * (idx % qsize_), &head, 2);
    ++avail_idx_;
    __atomic_store_n(reinterpret_cast<uint16_t*>(host_ + avail_off_ + 2),
                     avail_idx_, __ATOMIC_RELEASE);
  }
  void SetAvailIdx(uint16_t v) {
    avail_idx_ = v;
    __atomic_store_n(reinterpret_cast<uint16_t*>(host_ + avail_off_ + 2), v,
                     __ATOMIC_RELEASE);
  }
  void SetUsedEvent(uint16_t v) {
    __atomic_store_n(reinterpret_cast<uint16_t*>(host_ + avail_off_ + 4 +
                                                 size_t{2} * qsize_),
                     v, __ATOMIC_RELEASE);
  }
  void SetAvailFlags(uint16_t v) {
    __atomic_store_n(reinterpret_cast<uint16_t*>(host_ + avail_off_), v,
                     __ATOMIC_RELEASE);
  }
  uint16_t UsedIdx() const {
    return __atomic_load_n(
        reinterpret_cast<const uint16_t*>(host_ + used_off_ + 2),
        __ATOMIC_ACQUIRE);
  }
  uint16_t AvailEvent() const {
    return __atomic_load_n(reinterpret_cast<const uint16_t*>(
                               host_ + used_off_ + 4 + size_t{8} * qsize_),
                           __ATOMIC_ACQUIRE);
  }
  // The used element at position i: {id, len}.
  std::pair<uint32_t, uint32_t> Used(uint16_t i) const {
    const uint8_t* e = host_ + used_off_ + 4 + size_t{8} * (i % qsize_);
    uint32_t id;
    uint32_t len;
    std::memcpy(&id, e, 4);
    std::memcpy(&len, e + 4, 4);
    return {id, len};
  }

  // A virtio-blk request: header, data (device-writable for IN and
  // GET_ID), status byte. Returns the head; *status_gpa and *data_gpa say
  // where to look after completion.
  uint16_t BlkRequest(uint32_t type, uint64_t sector, uint32_t data_len,
                      bool indirect, uint64_t* data_gpa, uint64_t* status_gpa) {
    const uint64_t hdr = Alloc(16);
    uint8_t* h = Host(hdr);
    const uint32_t zero = 0;
    std::memcpy(h, &type, 4);
    std::memcpy(h + 4, &zero, 4);
    std::memcpy(h + 8, &sector, 8);
    const uint64_t data = data_len > 0 ? Alloc(data_len) : 0;
    const uint64_t status = Alloc(1);
    *Host(status) = 0xee;  // neither OK, IOERR nor UNSUPP
    const bool in = type == kVirtioBlkTIn || type == kVirtioBlkTGetId;
    std::vector<Buf> bufs{{hdr, 16, false}};
    if (data_len > 0) bufs.push_back({data, data_len, in});
    bufs.push_back({status, 1, true});
    if (data_gpa != nullptr) *data_gpa = data;
    *status_gpa = status;
    return indirect ? ChainIndirect(bufs) : Chain(bufs);
  }

 private:
  uint8_t* host_;
  uint64_t gpa_;
  uint64_t uva_;
  uint64_t size_;
  uint16_t qsize_;
  uint64_t avail_off_ = 0;
  uint64_t used_off_ = 0;
  uint64_t heap_ = 0;
  uint16_t next_desc_ = 0;
  uint16_t avail_idx_ = 0;
};

}  // namespace tmem::swap::testing

#endif  // TMEMD_TESTS_SWAP_VIRTQ_DRIVER_H_
