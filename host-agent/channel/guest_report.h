// GuestReport: what a guest says about itself in the shared header (ABI v2
// guest_flags and cost fields), as tmemd shows it.
//
// Untrusted (invariant 3): each field is read exactly once, with an atomic
// load, from guest-writable memory, and is only ever displayed or used to
// admit *less* from that VM (a guest standing aside is admitted nothing), or
// to delay judging its reuse by at most its reach (guest_ram_pages).
// Nothing here is a size, an index or a reason to do more work. Thread-safe
// (a snapshot of the header; any thread may read it while the region lives).
#ifndef TMEMD_HOST_AGENT_CHANNEL_GUEST_REPORT_H_
#define TMEMD_HOST_AGENT_CHANNEL_GUEST_REPORT_H_

#include <cstdint>

#include "proto/tmem_abi.h"

namespace tmem {

struct GuestReport {
  uint32_t features = 0;         // features_guest
  uint32_t flags = 0;            // guest_flags, every bit as the guest wrote it
  bool standing_aside = false;   // flags & TMEM_GUEST_STANDING_ASIDE
  uint64_t get_ns = 0;           // guest time per page served by tmem
  uint64_t miss_ns = 0;          // guest's estimate of a disk read per page
  uint64_t prefetch_used = 0;    // batched pages served from slots
  uint64_t prefetch_unused = 0;  // batched pages dropped unused
  uint64_t ram_pages = 0;        // the guest's RAM in pages (v3; 0: unsaid)
};

inline GuestReport ReadGuestReport(const tmem_shm_header* h) {
  auto load = [](const auto* field) {
    return __atomic_load_n(field, __ATOMIC_RELAXED);
  };
  GuestReport r;
  r.features = load(&h->features_guest);
  r.flags = load(&h->guest_flags);
  r.standing_aside = (r.flags & TMEM_GUEST_STANDING_ASIDE) != 0;
  r.get_ns = load(&h->guest_get_ns);
  r.miss_ns = load(&h->guest_miss_ns);
  r.prefetch_used = load(&h->guest_prefetch_used);
  r.prefetch_unused = load(&h->guest_prefetch_unused);
  r.ram_pages = load(&h->guest_ram_pages);
  return r;
}

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_GUEST_REPORT_H_
