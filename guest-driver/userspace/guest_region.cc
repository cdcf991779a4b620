#include "guest-driver/userspace/guest_region.h"

#include <atomic>
#include <bit>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

static_assert(std::atomic_ref<uint32_t>::is_always_lock_free &&
                  std::atomic_ref<uint64_t>::is_always_lock_free,
              "shared fields need lock-free (address-free) atomics");

// Each shared field is accessed only through these: a plain access racing
// with the other side would be a data race, and the compiler could tear,
// merge or re-read it.
template <typename T>
T Load(T& field, std::memory_order order) {
  return std::atomic_ref<T>(field).load(order);
}
template <typename T>
void Store(T& field, T value, std::memory_order order) {
  std::atomic_ref<T>(field).store(value, order);
}

}  // namespace

absl::StatusOr<RegionGeometry> GuestRegion::ReadGeometry() const {
  if (size_ < TMEM_PAGE_SIZE) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory of ", size_, " bytes cannot hold the tmem header"));
  }
  tmem_shm_header& h = *header();
  // Acquire READY first: the host wrote the header before its release store
  // of READY. Seqlock-style, the state and generation are checked again
  // after the reads, so a reset in between is caught.
  if (Load(h.host_state, std::memory_order_acquire) != TMEM_HOST_STATE_READY) {
    return absl::UnavailableError("the host has not published READY");
  }
  RegionGeometry g;
  const uint32_t magic = Load(h.magic, std::memory_order_relaxed);
  const uint32_t version = Load(h.version, std::memory_order_relaxed);
  const uint32_t header_size = Load(h.header_size, std::memory_order_relaxed);
  const uint64_t region_size = Load(h.region_size, std::memory_order_relaxed);
  g.features_host = Load(h.features_host, std::memory_order_relaxed);
  g.host_generation = Load(h.host_generation, std::memory_order_relaxed);
  g.sq_offset = Load(h.sq_offset, std::memory_order_relaxed);
  g.sq_entries = Load(h.sq_entries, std::memory_order_relaxed);
  g.cq_offset = Load(h.cq_offset, std::memory_order_relaxed);
  g.cq_entries = Load(h.cq_entries, std::memory_order_relaxed);
  g.slots_offset = Load(h.slots_offset, std::memory_order_relaxed);
  g.slot_count = Load(h.slot_count, std::memory_order_relaxed);
  // Order the reads above before the re-check below.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (Load(h.host_state, std::memory_order_relaxed) != TMEM_HOST_STATE_READY ||
      Load(h.host_generation, std::memory_order_relaxed) != g.host_generation) {
    return absl::UnavailableError("the host re-initialized the region");
  }

  if (magic != TMEM_ABI_MAGIC || version != TMEM_ABI_VERSION) {
    return absl::FailedPreconditionError(
        absl::StrCat("not a tmem ABI v", TMEM_ABI_VERSION, " region (magic 0x",
                     absl::Hex(magic), ", version ", version, ")"));
  }
  if (header_size != sizeof(tmem_shm_header) || region_size != size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header claims header_size ", header_size, " and region_size ",
        region_size, "; expected ", sizeof(tmem_shm_header), " and the ", size_,
        " bytes mapped"));
  }
  const uint64_t sq_end =
      uint64_t{g.sq_offset} + uint64_t{g.sq_entries} * sizeof(tmem_sqe);
  const uint64_t cq_end =
      uint64_t{g.cq_offset} + uint64_t{g.cq_entries} * sizeof(tmem_cqe);
  const uint64_t slots_end =
      uint64_t{g.slots_offset} + uint64_t{g.slot_count} * TMEM_PAGE_SIZE;
  // In order and disjoint: header, SQ, CQ, slots, all inside the mapping,
  // each entry array aligned for its type.
  const bool fits =
      std::has_single_bit(g.sq_entries) && std::has_single_bit(g.cq_entries) &&
      g.slot_count > 0 && g.sq_offset >= sizeof(tmem_shm_header) &&
      g.sq_offset % alignof(tmem_sqe) == 0 && g.cq_offset >= sq_end &&
      g.cq_offset % alignof(tmem_cqe) == 0 && g.slots_offset >= cq_end &&
      slots_end <= size_;
  if (!fits) {
    return absl::FailedPreconditionError(
        absl::StrCat("header describes rings or slots outside the ", size_,
                     "-byte region: sq ", g.sq_offset, "+", g.sq_entries,
                     ", cq ", g.cq_offset, "+", g.cq_entries, ", slots ",
                     g.slots_offset, "+", g.slot_count));
  }
  return g;
}

uint32_t GuestRegion::LoadHostState() const {
  return Load(header()->host_state, std::memory_order_acquire);
}
uint64_t GuestRegion::LoadHostGeneration() const {
  return Load(header()->host_generation, std::memory_order_acquire);
}
uint32_t GuestRegion::LoadHostFlags() const {
  // Ordered by FenceBeforeDoorbellCheck where it matters.
  return Load(header()->host_flags, std::memory_order_relaxed);
}
uint32_t GuestRegion::LoadAdmissionHint() const {
  // A hint, not a publication: nothing is read because of it.
  return Load(header()->admission_hint, std::memory_order_relaxed);
}
uint64_t GuestRegion::LoadFlushDoneSeq() const {
  // Acquire: the host flushed before publishing done.
  return Load(header()->flush_done_seq, std::memory_order_acquire);
}
uint32_t GuestRegion::LoadSqHead() const {
  // Acquire: the host finished reading the entries (and put slots) before
  // it advanced sq_head, so those entries may be overwritten.
  return Load(header()->sq_head.value, std::memory_order_acquire);
}
uint32_t GuestRegion::LoadCqTail() const {
  // Acquire: CQEs and get slots were written before cq_tail moved.
  return Load(header()->cq_tail.value, std::memory_order_acquire);
}
uint32_t GuestRegion::LoadSqTail() const {
  return Load(header()->sq_tail.value, std::memory_order_relaxed);
}
uint32_t GuestRegion::LoadCqHead() const {
  return Load(header()->cq_head.value, std::memory_order_relaxed);
}

void GuestRegion::StoreGuestGeneration(uint64_t generation) {
  Store(header()->guest_generation, generation, std::memory_order_release);
}
void GuestRegion::StoreFeaturesGuest(uint32_t features) {
  Store(header()->features_guest, features, std::memory_order_release);
}
void GuestRegion::PublishSqTail(uint32_t tail) {
  Store(header()->sq_tail.value, tail, std::memory_order_release);
}
void GuestRegion::PublishCqHead(uint32_t head) {
  Store(header()->cq_head.value, head, std::memory_order_release);
}
void GuestRegion::FenceBeforeDoorbellCheck() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void GuestRegion::RequestFlush(uint64_t pool_bits, uint64_t seq) {
  std::atomic_ref<uint64_t>(header()->flush_request)
      .fetch_or(pool_bits, std::memory_order_relaxed);
  Store(header()->flush_request_seq, seq, std::memory_order_release);
}
void GuestRegion::ClearFlushRequest() {
  Store(header()->flush_request, uint64_t{0}, std::memory_order_relaxed);
}

void GuestRegion::WriteSqe(uint32_t index, const tmem_sqe& sqe) {
  // Inside the mapping: index is masked to sq_entries, validated to fit.
  // The host reads it only after acquiring the sq_tail published later.
  uint8_t* at = base_ + g_.sq_offset +
                uint64_t{index & (g_.sq_entries - 1)} * sizeof(tmem_sqe);
  std::memcpy(at, &sqe, sizeof(sqe));
}

tmem_cqe GuestRegion::ReadCqe(uint32_t index) const {
  // Written before the cq_tail the caller acquired; copied once, so the
  // caller validates a snapshot the host cannot change under it.
  const uint8_t* at = base_ + g_.cq_offset +
                      uint64_t{index & (g_.cq_entries - 1)} * sizeof(tmem_cqe);
  tmem_cqe cqe{};
  std::memcpy(&cqe, at, sizeof(cqe));
  return cqe;
}

void GuestRegion::CopyToSlot(uint32_t slot, const uint8_t* page) {
  // The guest owns the slot (no op in flight uses it): nobody reads it
  // until the SQE that names it is published.
  uint8_t* dst = base_ + g_.slots_offset + uint64_t{slot} * TMEM_PAGE_SIZE;
#if defined(__SSE2__)
  // Streaming stores: the host's worker, on another CPU, read this slot
  // last, so ordinary stores would first pull every line back from its
  // cache; and the guest never reads the slot again. The release that
  // publishes the SQE orders them (sfence below, as streaming stores are
  // weakly ordered).
  auto* d = reinterpret_cast<__m128i*>(dst);
  const auto* s = reinterpret_cast<const __m128i*>(page);
  for (size_t i = 0; i < TMEM_PAGE_SIZE / sizeof(__m128i); i += 4) {
    const __m128i a = _mm_loadu_si128(s + i);
    const __m128i b = _mm_loadu_si128(s + i + 1);
    const __m128i c = _mm_loadu_si128(s + i + 2);
    const __m128i e = _mm_loadu_si128(s + i + 3);
    _mm_stream_si128(d + i, a);
    _mm_stream_si128(d + i + 1, b);
    _mm_stream_si128(d + i + 2, c);
    _mm_stream_si128(d + i + 3, e);
  }
  _mm_sfence();
#else
  std::memcpy(dst, page, TMEM_PAGE_SIZE);
#endif
}

void GuestRegion::CopyFromSlot(uint32_t slot, uint8_t* page) const {
  // The host wrote the page before the CQE the caller reaped; the slot is
  // still ours until the caller frees it.
  std::memcpy(page, base_ + g_.slots_offset + uint64_t{slot} * TMEM_PAGE_SIZE,
              TMEM_PAGE_SIZE);
}

}  // namespace tmem
