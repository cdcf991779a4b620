// SharedRegion: a VM's shared memory (QEMU's ivshmem BAR2), owned by tmemd.
//
// A memfd of power-of-two size, sealed against shrinking and growing (so a
// guest or QEMU can never make tmemd's mapping SIGBUS), mapped read-write
// into tmemd. Create() writes the header (proto/tmem_abi.h) with host_state
// INIT, zeroed rings, then publishes READY with a release store; Reset()
// does the same with a new host generation (used after a corrupt ring or a
// guest restart). Not thread-safe: the channel's worker owns it.
//
// Adopt() maps a memfd a previous tmemd handed over (restart, upgrade) and
// re-initializes it at once with a new host generation: nothing the old
// process left in the header or rings is trusted. IsForeign() tells when
// the header's host_generation is not the one this process wrote: the
// region arrived by live migration holding another host's header (QEMU
// copies the shared memory of a master=on device), or a guest scribbled
// on a host-owned field; either way the caller resets it.
//
// Every host write to the header goes through this class, each with the
// ordering the protocol (proto/tmem_abi.h) asks of it: the channel and the
// worker call the setters below, the ring consumer publishes its indices and
// flush acks here. What the host writes into ring entries and page slots is
// copied by the ring consumer into layout() offsets of base().
#ifndef TMEMD_HOST_AGENT_CHANNEL_SHARED_REGION_H_
#define TMEMD_HOST_AGENT_CHANNEL_SHARED_REGION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "host-agent/channel/region_layout.h"
#include "proto/tmem_abi.h"

namespace tmem {

class SharedRegion {
 public:
  // `name` labels the memfd (visible in /proc/PID/fd). `host_generation`
  // is the first init's; tmemd passes NewHostGeneration() (tests pick
  // their own).
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(
      const std::string& name, const RegionLayout& layout,
      uint64_t host_generation);
  // Takes `fd` (closed on failure). It must be a memfd of power-of-two size
  // sealed against shrinking and growing (what Create makes), or tmemd's
  // mapping could SIGBUS. The layout is rebuilt for the memfd's own size
  // (the VM's BAR2 cannot change) with `ring_entries`.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Adopt(
      int fd, uint32_t ring_entries, uint64_t host_generation,
      uint32_t host_peer_id);
  ~SharedRegion();  // unmaps and closes
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  int fd() const { return fd_; }
  uint8_t* base() const { return base_; }
  const RegionLayout& layout() const { return layout_; }
  tmem_shm_header* header() const {
    return reinterpret_cast<tmem_shm_header*>(base_);
  }
  uint64_t host_generation() const { return host_generation_; }
  // The ivshmem peer id guests ring (header field host_peer_id). Written
  // into the header now and on every reset.
  void SetHostPeerId(uint32_t peer_id);
  // The header's host_generation is not ours (see above). One relaxed load.
  bool IsForeign() const;

  // host_flags: whether tmemd sleeps on the doorbell (guests must ring it).
  // Release; the caller that sets it then issues the full fence of the
  // Dekker handshake (proto/tmem_abi.h) before re-reading the rings.
  void SetNeedsDoorbell(bool needs) {
    __atomic_store_n(&header()->host_flags,
                     needs ? TMEM_HOST_NEEDS_DOORBELL : tmem_u32{0},
                     __ATOMIC_RELEASE);
  }
  // admission_hint, stored only when it changes (no cache-line write per
  // worker round). Relaxed: a hint the guest samples, ordering nothing.
  void PublishAdmissionHint(uint32_t hint) {
    uint32_t* field = &header()->admission_hint;
    if (__atomic_load_n(field, __ATOMIC_RELAXED) != hint) {
      __atomic_store_n(field, hint, __ATOMIC_RELAXED);
    }
  }
  // reach_pages, likewise.
  void PublishReachPages(uint64_t pages) {
    uint64_t* field = &header()->reach_pages;
    if (__atomic_load_n(field, __ATOMIC_RELAXED) != pages) {
      __atomic_store_n(field, pages, __ATOMIC_RELAXED);
    }
  }
  // Ring indices and the flush ack (the ring consumer). Release: the CQE
  // (and a get's slot bytes) before the tail that hands them over; the copy
  // of an SQE done before the head lets the guest reuse it; the CQEs up to
  // a flush point before its ack.
  void PublishCqTail(uint32_t tail) {
    __atomic_store_n(&header()->cq_tail.value, tail, __ATOMIC_RELEASE);
  }
  void PublishSqHead(uint32_t head) {
    __atomic_store_n(&header()->sq_head.value, head, __ATOMIC_RELEASE);
  }
  void PublishFlushDone(uint64_t seq) {
    __atomic_store_n(&header()->flush_done_seq, tmem_u64{seq},
                     __ATOMIC_RELEASE);
  }
  // Nobody serves this region any more (the channel closes; the guest keeps
  // its mapping): host_state RESET with a release store, so a guest stops
  // waiting on it; a successor re-initializes it with a new generation.
  void MarkUnserved();
  // Zeroes the guest's self-report (flags, cost report, prefetch counts,
  // RAM size) when its guest detaches: the next guest writes its own.
  void ClearGuestReport();

  // A random 64-bit generation, nonzero and != previous: unique per init,
  // so a region from another host (live migration) is recognisably
  // foreign.
  static uint64_t NewHostGeneration(uint64_t previous = 0);

  // Re-initializes the header and rings with a NewHostGeneration() and
  // host_state READY (resets counter bumped in the header). Page slots are
  // left as they are. `fresh_host`: the host side starts over (adopted or
  // foreign region): doorbells wanted and every put admitted, instead of
  // keeping what the worker and the valve last published.
  void Reset(bool fresh_host = false);

 private:
  // Reset under `host_generation` (Adopt publishes the caller's).
  void ResetTo(uint64_t host_generation, bool fresh_host);
  SharedRegion(int fd, uint8_t* base, const RegionLayout& layout,
               uint64_t host_generation);
  void WriteHeader();

  int fd_;
  uint8_t* base_;
  RegionLayout layout_;
  uint64_t host_generation_;
  uint32_t host_peer_id_ = 0;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_SHARED_REGION_H_
