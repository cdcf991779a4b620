// GuestRegion: the guest's only window onto the raw shared memory
// (proto/tmem_abi.h). Every load and store of a shared field, every copy
// into or out of a ring entry or page slot, and every memory-ordering
// decision of the guest side lives in guest_region.cc; TmemGuest works on
// values.
//
// What it relies on:
//  * The mapping is at least `size` bytes and stays mapped (the device owns
//    it). tmemd seals its memfd against shrinking, so no access here can
//    SIGBUS.
//  * Fields the two sides share are naturally aligned (the ABI's static
//    asserts pin the layout) and 4 or 8 bytes, so std::atomic_ref on them is
//    lock-free and address-free: it works across processes.
//  * The host follows the ABI's ordering: it writes entries and slot bytes
//    before a store-release of cq_tail/sq_head, and the header before a
//    store-release of host_state = READY.
//  * The host may still be buggy or restart at any moment: geometry is read
//    once, validated against the mapped size, and used only through the
//    validated copy (never re-read from the header), so a changed header can
//    never make the guest touch memory outside the mapping.
//
// Not thread-safe: one TmemGuest owns a GuestRegion.
#ifndef TMEMD_GUEST_DRIVER_USERSPACE_GUEST_REGION_H_
#define TMEMD_GUEST_DRIVER_USERSPACE_GUEST_REGION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "proto/tmem_abi.h"

namespace tmem {

// The host-written, read-only-after-READY part of the header, validated.
struct RegionGeometry {
  uint32_t features_host = 0;
  uint64_t host_generation = 0;
  uint32_t sq_offset = 0;
  uint32_t sq_entries = 0;  // power of two
  uint32_t cq_offset = 0;
  uint32_t cq_entries = 0;  // power of two
  uint32_t slots_offset = 0;
  uint32_t slot_count = 0;
};

class GuestRegion {
 public:
  GuestRegion(uint8_t* base, uint64_t size) : base_(base), size_(size) {}

  // Reads the geometry once the host published READY. UNAVAILABLE while the
  // host is not READY (or re-initialized the header while we read it);
  // FAILED_PRECONDITION for a header that is not tmem ABI v1 or describes
  // rings or slots outside the mapping or overlapping each other.
  absl::StatusOr<RegionGeometry> ReadGeometry() const;
  // Ring and slot accesses below use this geometry (from ReadGeometry).
  void Bind(const RegionGeometry& geometry) { g_ = geometry; }
  const RegionGeometry& geometry() const { return g_; }

  // --- Host-written fields. Acquire: what the host wrote before them is
  // visible after (entries before indices, header before state).
  uint32_t LoadHostState() const;
  uint64_t LoadHostGeneration() const;
  uint32_t LoadHostFlags() const;
  uint32_t LoadAdmissionHint() const;
  uint64_t LoadFlushDoneSeq() const;
  uint32_t LoadSqHead() const;
  uint32_t LoadCqTail() const;
  // Guest-owned indices as they are in shared memory (after a host reset
  // rewrote them, the guest adopts them).
  uint32_t LoadSqTail() const;
  uint32_t LoadCqHead() const;

  // --- Guest-written fields.
  void StoreGuestGeneration(uint64_t generation);
  void StoreFeaturesGuest(uint32_t features);
  // Store-release: the host that acquires the new tail sees the entries
  // (and slot bytes) written before it.
  void PublishSqTail(uint32_t tail);
  // Store-release: the host may overwrite the reaped CQEs after this.
  void PublishCqHead(uint32_t head);
  // Full fence between publishing sq_tail and reading host_flags, pairing
  // with the host's fence between setting NEEDS_DOORBELL and re-checking
  // sq_tail before it sleeps: without it both sides could miss each other
  // (store-load reordering) and the host would sleep on a non-empty ring.
  static void FenceBeforeDoorbellCheck();

  // Flush barrier: ORs `pool_bits` into flush_request, then stores
  // flush_request_seq = seq with release, so a host that acquires the new
  // seq also sees the bits (the host reads the seq first, then the bits).
  void RequestFlush(uint64_t pool_bits, uint64_t seq);
  // After flush_done_seq caught up: clears the request bits (the host only
  // reads them while a request is outstanding).
  void ClearFlushRequest();

  // --- Entries and slots, at ring position index & (entries - 1).
  void WriteSqe(uint32_t index, const tmem_sqe& sqe);
  tmem_cqe ReadCqe(uint32_t index) const;
  // slot < geometry().slot_count (TmemGuest only uses slots it handed out).
  void CopyToSlot(uint32_t slot, const uint8_t* page);
  void CopyFromSlot(uint32_t slot, uint8_t* page) const;

 private:
  tmem_shm_header* header() const {
    return reinterpret_cast<tmem_shm_header*>(base_);
  }

  uint8_t* base_;
  uint64_t size_;
  RegionGeometry g_;
};

}  // namespace tmem

#endif  // TMEMD_GUEST_DRIVER_USERSPACE_GUEST_REGION_H_
