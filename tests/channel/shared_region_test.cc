// Tests for SharedRegion (host-agent/channel/shared_region.h): the memfd is
// a sealed power-of-two file (what QEMU needs for BAR2 and what keeps tmemd
// safe from SIGBUS), Create publishes a complete header as READY, and Reset
// re-initializes the header and rings under a new generation while leaving
// the page slots alone.
#include "host-agent/channel/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "host-agent/channel/region_layout.h"
#include "proto/tmem_abi.h"

namespace tmem {
namespace {

// strerror is not thread-safe (clang-tidy concurrency-mt-unsafe).
std::string ErrnoText(int err = errno) {
  char buf[256];
  return strerror_r(err, buf, sizeof(buf));  // GNU: returns the message
}

constexpr uint64_t kMiB = uint64_t{1} << 20;
// The smallest region that holds the default 256-entry rings and 256 slots.
constexpr uint64_t kRegion = 2 * kMiB;

RegionLayout Layout(uint64_t bytes, uint32_t sq_entries = 256) {
  absl::StatusOr<RegionLayout> layout =
      RegionLayout::ForSize(bytes, sq_entries);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

std::unique_ptr<SharedRegion> MakeRegion(uint64_t bytes,
                                         uint64_t generation = 7,
                                         uint32_t sq_entries = 256) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create("tmem-test", Layout(bytes, sq_entries), generation);
  EXPECT_TRUE(region.ok()) << region.status();
  return std::move(region).value();
}

TEST(SharedRegionTest, CreatePublishesCompleteHeader) {
  const RegionLayout layout = Layout(kRegion);
  auto region = MakeRegion(kRegion, /*generation=*/42);
  const tmem_shm_header* h = region->header();
  EXPECT_EQ(h->magic, TMEM_ABI_MAGIC);
  EXPECT_EQ(h->version, TMEM_ABI_VERSION);
  EXPECT_EQ(h->features_host,
            TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT |
                TMEM_FEAT_FLUSH_BARRIER | TMEM_FEAT_GET_BATCH);
  EXPECT_EQ(h->host_peer_id, 0u);
  EXPECT_EQ(h->header_size, sizeof(tmem_shm_header));
  EXPECT_EQ(h->region_size, kRegion);
  EXPECT_EQ(h->sq_offset, layout.sq_offset);
  EXPECT_EQ(h->sq_entries, layout.sq_entries);
  EXPECT_EQ(h->cq_offset, layout.cq_offset);
  EXPECT_EQ(h->cq_entries, layout.cq_entries);
  EXPECT_EQ(h->slots_offset, layout.slots_offset);
  EXPECT_EQ(h->slot_count, layout.slot_count);
  EXPECT_EQ(h->host_generation, 42u);
  EXPECT_EQ(region->host_generation(), 42u);
  EXPECT_EQ(__atomic_load_n(&h->host_state, __ATOMIC_ACQUIRE),
            TMEM_HOST_STATE_READY);
  EXPECT_EQ(h->host_flags, TMEM_HOST_NEEDS_DOORBELL);
  EXPECT_EQ(h->admission_hint, TMEM_ADMIT_ALL);
  EXPECT_EQ(h->resets, 0u);
  EXPECT_EQ(h->flush_done_seq, 0u);
  EXPECT_EQ(h->guest_generation, 0u);
  EXPECT_EQ(h->flush_request, 0u);
  EXPECT_EQ(h->flush_request_seq, 0u);
  EXPECT_EQ(h->sq_head.value, 0u);
  EXPECT_EQ(h->sq_tail.value, 0u);
  EXPECT_EQ(h->cq_head.value, 0u);
  EXPECT_EQ(h->cq_tail.value, 0u);
  EXPECT_EQ(region->layout().region_bytes, kRegion);
  // Rings start empty (all zero), so no stale entry can be mistaken for one.
  for (uint32_t off = layout.sq_offset; off < layout.slots_offset; ++off) {
    ASSERT_EQ(region->base()[off], 0) << "ring byte at offset " << off;
  }
}

TEST(SharedRegionTest, MemfdIsSealedPowerOfTwoAndCloseOnExec) {
  auto region = MakeRegion(kRegion);
  const int fd = region->fd();

  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kRegion);
  EXPECT_TRUE(std::has_single_bit(static_cast<uint64_t>(st.st_size)))
      << "QEMU asserts BAR2 is a power of two";

  EXPECT_EQ(fcntl(fd, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  errno = 0;
  EXPECT_EQ(ftruncate(fd, 4096), -1);
  EXPECT_EQ(errno, EPERM) << "shrinking must be sealed";
  errno = 0;
  EXPECT_EQ(ftruncate(fd, 2 * kRegion), -1);
  EXPECT_EQ(errno, EPERM) << "growing must be sealed";
  errno = 0;
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1)
      << "F_SEAL_SEAL must stop anyone from adding a write seal";
  EXPECT_EQ(errno, EPERM);
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kRegion);

  EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0)
      << "the memfd must not leak into child processes";

  // The memfd's name shows which VM a descriptor belongs to.
  char link[PATH_MAX] = {};
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  ASSERT_GT(readlink(proc.c_str(), link, sizeof(link) - 1), 0);
  EXPECT_EQ(std::string(link).rfind("/memfd:tmem-test", 0), 0u) << link;
}

TEST(SharedRegionTest, MappingIsSharedWithOtherMappingsOfTheFd) {
  // QEMU maps the same fd; what tmemd writes must be what the guest sees.
  auto region = MakeRegion(kRegion);
  void* other = mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_SHARED,
                     region->fd(), 0);
  ASSERT_NE(other, MAP_FAILED) << ErrnoText();
  const auto* bytes = static_cast<const uint8_t*>(other);
  uint32_t magic = 0;
  std::memcpy(&magic, bytes, sizeof(magic));
  EXPECT_EQ(magic, TMEM_ABI_MAGIC);
  const uint32_t last = region->layout().region_bytes - 1;
  region->base()[last] = 0x5a;
  EXPECT_EQ(bytes[last], 0x5a);
  munmap(other, kRegion);
}

TEST(SharedRegionTest, ResetBumpsGenerationAndReinitializesHeader) {
  auto region = MakeRegion(kRegion, /*generation=*/100);
  tmem_shm_header* h = region->header();
  const RegionLayout layout = region->layout();

  // A running guest: indices moved, a flush pending, a page in slot 0, and
  // (hostile or buggy) scribbles over host-owned fields.
  h->sq_head.value = 17;
  h->sq_tail.value = 19;
  h->cq_head.value = 15;
  h->cq_tail.value = 17;
  h->flush_request = 0b1010;
  h->flush_request_seq = 18;
  h->flush_done_seq = 3;
  h->guest_generation = 9;
  h->features_guest = TMEM_FEAT_FLUSH_BARRIER;
  h->magic = 0xdeadbeef;
  h->sq_entries = 1u << 30;
  h->slot_count = ~0u;
  h->admission_hint = 1000;  // the valve's current throttle
  uint8_t* slot0 = region->base() + layout.slots_offset;
  std::memset(slot0, 0xab, TMEM_PAGE_SIZE);

  region->Reset();
  // A fresh random generation: neither the old one nor 0.
  const uint64_t first_reset = region->host_generation();
  EXPECT_NE(first_reset, 100u);
  EXPECT_NE(first_reset, 0u);
  EXPECT_EQ(h->host_generation, first_reset);
  EXPECT_EQ(h->resets, 1u);
  EXPECT_EQ(__atomic_load_n(&h->host_state, __ATOMIC_ACQUIRE),
            TMEM_HOST_STATE_READY);
  EXPECT_EQ(h->sq_head.value, 0u);
  EXPECT_EQ(h->sq_tail.value, 0u);
  EXPECT_EQ(h->cq_head.value, 0u);
  EXPECT_EQ(h->cq_tail.value, 0u);
  EXPECT_EQ(h->flush_request, 0u);
  EXPECT_EQ(h->flush_request_seq, 0u);
  EXPECT_EQ(h->flush_done_seq, 0u);
  // Host-owned fields come from tmemd's layout, not from what was there.
  EXPECT_EQ(h->magic, TMEM_ABI_MAGIC);
  EXPECT_EQ(h->sq_entries, layout.sq_entries);
  EXPECT_EQ(h->slot_count, layout.slot_count);
  // A reset does not lift the valve's throttle.
  EXPECT_EQ(h->admission_hint, 1000u);
  // The guest re-announces itself after seeing the reset.
  EXPECT_EQ(h->guest_generation, 9u);
  // Page slots are left as they are.
  for (uint32_t i = 0; i < TMEM_PAGE_SIZE; ++i) ASSERT_EQ(slot0[i], 0xab);

  region->Reset();
  EXPECT_NE(region->host_generation(), first_reset);
  EXPECT_NE(region->host_generation(), 0u);
  EXPECT_EQ(h->host_generation, region->host_generation());
  EXPECT_EQ(h->resets, 2u);
}

TEST(SharedRegionTest, ResetClampsScribbledAdmissionHint) {
  auto region = MakeRegion(kRegion);
  region->header()->admission_hint = TMEM_ADMIT_ALL + 1;
  region->Reset();
  EXPECT_EQ(region->header()->admission_hint, TMEM_ADMIT_ALL);
}

TEST(SharedRegionTest, LargestAndSmallestSizes) {
  // 256 KiB only fits small rings; 64 MiB is a typical production size.
  for (const auto& [bytes, entries] :
       {std::pair<uint64_t, uint32_t>{uint64_t{256} << 10, 8},
        std::pair<uint64_t, uint32_t>{64 * kMiB, 256}}) {
    auto region = MakeRegion(bytes, 1, entries);
    EXPECT_EQ(region->header()->sq_entries, entries);
    EXPECT_EQ(region->header()->region_size, bytes);
    struct stat st {};
    ASSERT_EQ(fstat(region->fd(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes);
    // The last slot is inside the mapping and writable.
    region->base()[bytes - 1] = 1;
  }
}

TEST(SharedRegionTest, RejectsLayoutsThatDoNotFitOrAreNotPowerOfTwo) {
  RegionLayout not_pow2 = Layout(kRegion);
  not_pow2.region_bytes = kRegion + 4096;
  absl::StatusOr<std::unique_ptr<SharedRegion>> r =
      SharedRegion::Create("bad", not_pow2, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("power of two"), std::string::npos)
      << r.status();

  r = SharedRegion::Create("bad", RegionLayout{}, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);

  RegionLayout too_many_slots = Layout(kRegion);
  ++too_many_slots.slot_count;
  r = SharedRegion::Create("bad", too_many_slots, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();

  RegionLayout overlapping = Layout(kRegion);
  overlapping.cq_offset = overlapping.sq_offset;
  r = SharedRegion::Create("bad", overlapping, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();
}

TEST(SharedRegionTest, MemfdErrorsCarryErrnoText) {
  // memfd names are limited to 249 bytes: the kernel says EINVAL.
  absl::StatusOr<std::unique_ptr<SharedRegion>> r =
      SharedRegion::Create(std::string(300, 'x'), Layout(kRegion), 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("memfd_create"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("Invalid argument"), std::string::npos)
      << r.status();
}

}  // namespace
}  // namespace tmem

namespace tmem {
namespace {

// Restart: a successor adopts the memfd and re-initializes everything the
// old process (or the guest) left in the header, under its own generation.
TEST(SharedRegionAdoptTest, AdoptReinitializesUnderANewGeneration) {
  auto old = MakeRegion(kRegion, /*generation=*/7);
  tmem_shm_header* h = old->header();
  h->sq_tail.value = 99;  // what a guest might have left
  h->cq_tail.value = 5;
  h->admission_hint = 1000;
  h->host_flags = 0;
  const int fd = fcntl(old->fd(), F_DUPFD_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  absl::StatusOr<std::unique_ptr<SharedRegion>> adopted = SharedRegion::Adopt(
      fd, 256, /*host_generation=*/1000, /*host_peer_id=*/1);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  const tmem_shm_header* a = (*adopted)->header();
  EXPECT_EQ(a->host_generation, 1000u);
  EXPECT_EQ((*adopted)->host_generation(), 1000u);
  EXPECT_EQ(a->host_peer_id, 1u);
  EXPECT_EQ(a->host_state, TMEM_HOST_STATE_READY);
  EXPECT_EQ(a->sq_tail.value, 0u);
  EXPECT_EQ(a->cq_tail.value, 0u);
  // A fresh host: doorbells wanted, everything admitted.
  EXPECT_EQ(a->host_flags, TMEM_HOST_NEEDS_DOORBELL);
  EXPECT_EQ(a->admission_hint, TMEM_ADMIT_ALL);
  EXPECT_EQ(a->resets, 1u);
  EXPECT_FALSE((*adopted)->IsForeign());
  // The old process's view (same memory) is now foreign to it.
  EXPECT_TRUE(old->IsForeign());
}

TEST(SharedRegionAdoptTest, RefusesDescriptorsThatAreNotSealedMemfds) {
  // Not sealed: someone could shrink it under tmemd's mapping.
  const int unsealed = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(ftruncate(unsealed, static_cast<off_t>(kRegion)), 0);
  absl::StatusOr<std::unique_ptr<SharedRegion>> r =
      SharedRegion::Adopt(unsealed, 256, 1, 1);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("sealed"), std::string::npos)
      << r.status();
  // A pipe is no memfd at all.
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  r = SharedRegion::Adopt(p[0], 256, 1, 1);
  EXPECT_FALSE(r.ok());
  close(p[1]);
  EXPECT_FALSE(SharedRegion::Adopt(-1, 256, 1, 1).ok());
}

// Live migration: the destination's region is overwritten with the
// source's bytes; a generation this process did not write is foreign, and
// a reset makes it ours again.
TEST(SharedRegionAdoptTest, ForeignGenerationIsDetectedAndResetClearsIt) {
  auto region = MakeRegion(kRegion, /*generation=*/7);
  EXPECT_FALSE(region->IsForeign());
  auto source = MakeRegion(kRegion, /*generation=*/12345);
  std::memcpy(region->base(), source->base(), kRegion);
  EXPECT_TRUE(region->IsForeign());
  region->Reset(/*fresh_host=*/true);
  EXPECT_FALSE(region->IsForeign());
  EXPECT_EQ(region->header()->host_generation, region->host_generation());
  EXPECT_EQ(region->header()->admission_hint, TMEM_ADMIT_ALL);
}

}  // namespace
}  // namespace tmem
