#include "host-agent/channel/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "proto/tmem_abi.h"

namespace tmem {
namespace {

// The guest may read (and scribble on) the header at any time, so every
// store into it is an atomic store: a plain store racing with the guest's
// loads would be a data race, and the compiler could tear or merge it.
// Relaxed is enough for single fields; publication is ordered by the
// release store of host_state (and the fence in Reset).
template <typename T>
void StoreRelaxed(T* field, T value) {
  __atomic_store_n(field, value, __ATOMIC_RELAXED);
}

// A layout that did not come from RegionLayout::ForSize must still describe
// rings and slots inside the region, or WriteHeader and the ring consumer
// would point the guest (and tmemd) outside the mapping.
absl::Status ValidateLayout(const RegionLayout& l) {
  const uint64_t size = l.region_bytes;
  if (!std::has_single_bit(size) || size < TMEM_PAGE_SIZE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared region size ", size,
        " must be a power of two of at least one page (QEMU maps it as BAR2); "
        "build the layout with RegionLayout::ForSize"));
  }
  if (!std::has_single_bit(l.sq_entries) ||
      !std::has_single_bit(l.cq_entries)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring sizes (sq ", l.sq_entries, ", cq ", l.cq_entries,
                     ") must be powers of two"));
  }
  const uint64_t sq_end =
      uint64_t{l.sq_offset} + uint64_t{l.sq_entries} * sizeof(tmem_sqe);
  const uint64_t cq_end =
      uint64_t{l.cq_offset} + uint64_t{l.cq_entries} * sizeof(tmem_cqe);
  const uint64_t slots_end =
      uint64_t{l.slots_offset} + uint64_t{l.slot_count} * TMEM_PAGE_SIZE;
  const bool ordered = l.sq_offset >= sizeof(tmem_shm_header) &&
                       l.cq_offset >= sq_end && l.slots_offset >= cq_end &&
                       l.slots_offset % TMEM_PAGE_SIZE == 0 &&
                       slots_end <= size;
  if (!ordered) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region layout does not fit its ", size,
        "-byte region (header, sq, cq and slots must follow each other in "
        "order): sq_offset ",
        l.sq_offset, ", cq_offset ", l.cq_offset, ", slots_offset ",
        l.slots_offset, ", slot_count ", l.slot_count));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t SharedRegion::NewHostGeneration(uint64_t previous) {
  // 64 random bits from the kernel: unique per init with overwhelming
  // probability, across hosts too, so a region that arrives with a VM from
  // another host (live migration copies the shared memory) never carries a
  // generation this tmemd wrote. Never 0 (a guest's "none") nor `previous`
  // (a reset must be visible).
  for (;;) {
    uint64_t g = 0;
    if (getrandom(&g, sizeof(g), 0) != static_cast<ssize_t>(sizeof(g))) {
      // getrandom on 8 bytes does not fail once the pool is initialized;
      // should it, the clock still differs per init on one host.
      g = static_cast<uint64_t>(
              std::chrono::steady_clock::now().time_since_epoch().count()) *
          0x9e3779b97f4a7c15ull;
    }
    if (g != 0 && g != previous) return g;
  }
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(
    const std::string& name, const RegionLayout& layout,
    uint64_t host_generation) {
  if (absl::Status s = ValidateLayout(layout); !s.ok()) return s;

  // MFD_ALLOW_SEALING: without it F_ADD_SEALS fails with EPERM.
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("memfd_create(\"", name,
                            "\") for the shared region failed (names are "
                            "limited to 249 bytes)"));
  }
  if (ftruncate(fd, static_cast<off_t>(layout.region_bytes)) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(
        err, absl::StrCat("ftruncate of shared region \"", name, "\" to ",
                          layout.region_bytes,
                          " bytes failed (out of memory or tmpfs limits?)"));
  }
  // No holder of the fd (QEMU, a compromised QEMU) can shrink the memfd
  // under tmemd's mapping, so tmemd never takes SIGBUS; nor grow it, which
  // would hand the next QEMU a BAR2 that is not a power of two. F_SEAL_SEAL
  // keeps anyone from adding F_SEAL_WRITE later.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(
        err, absl::StrCat("sealing shared region \"", name,
                          "\" (F_ADD_SEALS) failed; the kernel must support "
                          "memfd sealing (Linux >= 3.17)"));
  }
  void* base = mmap(nullptr, layout.region_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(
        err, absl::StrCat("mmap of shared region \"", name, "\" (",
                          layout.region_bytes,
                          " bytes) failed (address space or RLIMIT_AS?)"));
  }
  std::unique_ptr<SharedRegion> region(new SharedRegion(
      fd, static_cast<uint8_t*>(base), layout, host_generation));
  // A fresh memfd reads as zeros, so the rings are already empty; INIT is
  // stored anyway so the header says so explicitly while it is written.
  StoreRelaxed(&region->header()->host_state, TMEM_HOST_STATE_INIT);
  region->WriteHeader();
  StoreRelaxed(&region->header()->resets, uint32_t{0});
  // Release: a guest that acquires READY sees every header field above.
  __atomic_store_n(&region->header()->host_state, TMEM_HOST_STATE_READY,
                   __ATOMIC_RELEASE);
  return region;
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Adopt(
    int fd, uint32_t ring_entries, uint64_t host_generation,
    uint32_t host_peer_id) {
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    if (fd >= 0) close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("handed-over shared region (fd ", fd, ") is not a memfd"));
  }
  // Without these seals a holder of the fd could shrink it under tmemd's
  // mapping (SIGBUS); Create always sets them, so their absence means the
  // fd is not one of ours.
  const int seals = fcntl(fd, F_GET_SEALS);
  constexpr int kNeeded = F_SEAL_SHRINK | F_SEAL_GROW;
  if (seals < 0 || (seals & kNeeded) != kNeeded) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "handed-over shared region (fd ", fd,
        ") is not sealed against shrinking and growing (seals ", seals, ")"));
  }
  absl::StatusOr<RegionLayout> layout =
      RegionLayout::ForSize(static_cast<uint64_t>(st.st_size), ring_entries);
  if (!layout.ok()) {
    close(fd);
    return absl::Status(
        layout.status().code(),
        absl::StrCat("handed-over shared region: ", layout.status().message()));
  }
  void* base = mmap(nullptr, layout->region_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, "mmap of the handed-over shared region");
  }
  // Published under the caller's (fresh, random) generation: nothing the
  // old process wrote is taken for ours.
  std::unique_ptr<SharedRegion> region(new SharedRegion(
      fd, static_cast<uint8_t*>(base), *layout, host_generation));
  region->host_peer_id_ = host_peer_id;
  region->ResetTo(host_generation, /*fresh_host=*/true);
  return region;
}

void SharedRegion::SetHostPeerId(uint32_t peer_id) {
  host_peer_id_ = peer_id;
  StoreRelaxed(&header()->host_peer_id, peer_id);
}

bool SharedRegion::IsForeign() const {
  return __atomic_load_n(&header()->host_generation, __ATOMIC_RELAXED) !=
         host_generation_;
}

void SharedRegion::MarkUnserved() {
  __atomic_store_n(&header()->host_state, TMEM_HOST_STATE_RESET,
                   __ATOMIC_RELEASE);
}

void SharedRegion::ClearGuestReport() {
  tmem_shm_header* h = header();
  // Relaxed: the guest is gone; Reset (which follows) publishes with its
  // release store of READY.
  StoreRelaxed(&h->guest_flags, tmem_u32{0});
  StoreRelaxed(&h->guest_get_ns, tmem_u64{0});
  StoreRelaxed(&h->guest_miss_ns, tmem_u64{0});
  StoreRelaxed(&h->guest_prefetch_used, tmem_u64{0});
  StoreRelaxed(&h->guest_prefetch_unused, tmem_u64{0});
  StoreRelaxed(&h->guest_ram_pages, tmem_u64{0});
}

SharedRegion::SharedRegion(int fd, uint8_t* base, const RegionLayout& layout,
                           uint64_t host_generation)
    : fd_(fd),
      base_(base),
      layout_(layout),
      host_generation_(host_generation) {}

SharedRegion::~SharedRegion() {
  munmap(base_, layout_.region_bytes);
  close(fd_);
}

void SharedRegion::WriteHeader() {
  tmem_shm_header* h = header();
  // Written from tmemd's own layout, never from what the header holds: the
  // guest can overwrite any of these, and Reset rewrites them all.
  StoreRelaxed(&h->magic, TMEM_ABI_MAGIC);
  StoreRelaxed(&h->version, TMEM_ABI_VERSION);
  StoreRelaxed(&h->features_host,
               TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT |
                   TMEM_FEAT_FLUSH_BARRIER | TMEM_FEAT_GET_BATCH);
  StoreRelaxed(&h->header_size, static_cast<tmem_u32>(sizeof(tmem_shm_header)));
  StoreRelaxed(&h->region_size, tmem_u64{layout_.region_bytes});
  StoreRelaxed(&h->sq_offset, layout_.sq_offset);
  StoreRelaxed(&h->sq_entries, layout_.sq_entries);
  StoreRelaxed(&h->cq_offset, layout_.cq_offset);
  StoreRelaxed(&h->cq_entries, layout_.cq_entries);
  StoreRelaxed(&h->slots_offset, layout_.slots_offset);
  StoreRelaxed(&h->slot_count, layout_.slot_count);
  StoreRelaxed(&h->host_generation, tmem_u64{host_generation_});
  // Which ivshmem peer the guest rings: 0, or 1 for a migratable device
  // (QEMU master=on needs the VM to be peer 0).
  StoreRelaxed(&h->host_peer_id, tmem_u32{host_peer_id_});
  StoreRelaxed(&h->pad0, tmem_u32{0});
  // Until a worker polls, tmemd sleeps on the doorbell; and until the valve
  // says otherwise every put is welcome.
  StoreRelaxed(&h->host_flags, TMEM_HOST_NEEDS_DOORBELL);
  StoreRelaxed(&h->admission_hint, TMEM_ADMIT_ALL);
  StoreRelaxed(&h->flush_done_seq, tmem_u64{0});
  StoreRelaxed(&h->flush_request, tmem_u64{0});
  StoreRelaxed(&h->flush_request_seq, tmem_u64{0});
  StoreRelaxed(&h->sq_head.value, tmem_u32{0});
  StoreRelaxed(&h->sq_tail.value, tmem_u32{0});
  StoreRelaxed(&h->cq_head.value, tmem_u32{0});
  StoreRelaxed(&h->cq_tail.value, tmem_u32{0});
}

void SharedRegion::Reset(bool fresh_host) {
  ResetTo(NewHostGeneration(host_generation_), fresh_host);
}

void SharedRegion::ResetTo(uint64_t host_generation, bool fresh_host) {
  tmem_shm_header* h = header();
  // RESET first, so a guest still running sees the channel going away
  // before it sees indices jump back to zero. The release fence orders the
  // RESET store before every store below: a guest that observes any of
  // them (acquire) then reads host_state as RESET or the READY that follows,
  // never the old READY.
  StoreRelaxed(&h->host_state, TMEM_HOST_STATE_RESET);
  __atomic_thread_fence(__ATOMIC_RELEASE);

  // `resets` is only informational for the guest and tmemd never relies on
  // it, so bumping whatever is there is fine even if the guest scribbled on
  // it.
  const tmem_u32 resets = __atomic_load_n(&h->resets, __ATOMIC_RELAXED);
  // Keep what the worker and the valve last published: a reset must not
  // lift a throttle or claim tmemd is polling when it is not.
  const tmem_u32 host_flags = __atomic_load_n(&h->host_flags, __ATOMIC_RELAXED);
  const tmem_u32 admission_hint =
      __atomic_load_n(&h->admission_hint, __ATOMIC_RELAXED);

  host_generation_ = host_generation;
  WriteHeader();  // ring indices and flush fields back to zero
  if (!fresh_host) {
    StoreRelaxed(&h->host_flags, host_flags);
    StoreRelaxed(&h->admission_hint, admission_hint <= TMEM_ADMIT_ALL
                                         ? admission_hint
                                         : TMEM_ADMIT_ALL);
  }
  StoreRelaxed(&h->resets, resets + 1);
  // guest_generation and features_guest stay: the guest rewrites them when
  // it re-attaches after seeing RESET. Page slots stay as they are.

  __atomic_store_n(&h->host_state, TMEM_HOST_STATE_READY, __ATOMIC_RELEASE);
}

}  // namespace tmem
