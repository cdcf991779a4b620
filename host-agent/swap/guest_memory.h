// GuestMemory: the one place that turns guest addresses into host pointers.
//
// A VM's RAM reaches tmemd as up to kVhostUserMaxRegions memfd regions
// (SET_MEM_TABLE). Each region has a guest-physical base (what descriptors
// carry), a base in QEMU's own address space (what SET_VRING_ADDR carries),
// a size and an offset into its file.
//
// Contract:
//  * ValidateRegions refuses, with the region and the reason: a size of 0,
//    a region whose guest-physical, user or file range wraps around 2^64 or
//    does not fit size_t, and any two regions overlapping in guest-physical
//    or in user address space. It is pure: tests and fuzzers call it on
//    arbitrary tables.
//  * Map validates, then mmaps each fd (MAP_SHARED, read/write) from file
//    offset 0 over mmap_offset + memory_size bytes, after checking with
//    fstat that the file is that large (a shorter file would turn a guest
//    access into SIGBUS). It closes every fd it was given, on success and
//    on failure. Unmaps everything when destroyed.
//  * Translate* return a pointer only when [addr, addr + len) lies inside
//    the mapping; every comparison is written so it cannot overflow
//    (addr - base < size, then len <= size - offset). A buffer crossing from
//    one guest-physical region into the next is split into spans
//    (TranslateGuestSpans); ring structures must lie in one region.
//  * The bytes behind a returned pointer are shared with a running guest
//    that may change them at any time: callers read each field once, into a
//    local, before checking it.
// Immutable after construction: thread-safe to read from many threads.
// Movable, not copyable (it owns mappings).
#ifndef TMEMD_HOST_AGENT_SWAP_GUEST_MEMORY_H_
#define TMEMD_HOST_AGENT_SWAP_GUEST_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "host-agent/swap/vhost_user_message.h"

namespace tmem::swap {

// A piece of guest memory, already translated and bounds-checked.
struct GuestSpan {
  uint8_t* data = nullptr;
  size_t len = 0;
};

// Helpers over span lists (a request's buffers, in order). All of them
// stay inside the spans they are given and return false if asked for more
// bytes than the spans hold.
//  * SliceSpans appends to `out` the spans covering [offset, offset + len).
//  * CopyFromSpans copies the first n bytes out (one read of each byte).
//  * CopyToSpans writes n bytes in.
uint64_t SpansLength(std::span<const GuestSpan> spans);
bool SliceSpans(std::span<const GuestSpan> spans, uint64_t offset, uint64_t len,
                std::vector<GuestSpan>* out);
bool CopyFromSpans(std::span<const GuestSpan> spans, uint8_t* dst, size_t n);
bool CopyToSpans(std::span<const GuestSpan> spans, const uint8_t* src,
                 size_t n);

class GuestMemory {
 public:
  static absl::Status ValidateRegions(
      std::span<const MemoryRegionDesc> regions);

  // Takes ownership of `fds` (one per region, same order).
  static absl::StatusOr<GuestMemory> Map(
      std::span<const MemoryRegionDesc> regions, std::span<const int> fds);

  // Regions over memory the caller owns and keeps alive (tests, fuzzers):
  // bases[i] holds regions[i].memory_size bytes; mmap_offset is ignored.
  static absl::StatusOr<GuestMemory> FromBuffers(
      std::span<const MemoryRegionDesc> regions,
      std::span<uint8_t* const> bases);

  GuestMemory() = default;
  GuestMemory(GuestMemory&& other) noexcept;
  GuestMemory& operator=(GuestMemory&& other) noexcept;
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;
  ~GuestMemory();

  bool empty() const { return regions_.empty(); }
  size_t region_count() const { return regions_.size(); }

  // Guest-physical [gpa, gpa + len) inside one region, else nullptr.
  uint8_t* TranslateGuest(uint64_t gpa, uint64_t len) const;
  // QEMU user address [uva, uva + len) inside one region, else nullptr.
  uint8_t* TranslateUser(uint64_t uva, uint64_t len) const;
  // Guest-physical [gpa, gpa + len), possibly across adjacent regions,
  // appended to `out` as spans. False (out unchanged) if any byte is
  // outside guest memory or more than `max_spans` would be needed.
  bool TranslateGuestSpans(uint64_t gpa, uint64_t len, size_t max_spans,
                           std::vector<GuestSpan>* out) const;

 private:
  struct Region {
    uint64_t gpa = 0;
    uint64_t uva = 0;
    uint64_t size = 0;
    uint8_t* host = nullptr;   // first byte of the region in our mapping
    void* map_base = nullptr;  // what to munmap (nullptr: not ours)
    size_t map_len = 0;
  };
  void Release();
  std::vector<Region> regions_;
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_GUEST_MEMORY_H_
