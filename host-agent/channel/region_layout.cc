#include "host-agent/channel/region_layout.h"

#include <bit>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/tmem_abi.h"

namespace tmem {

absl::StatusOr<RegionLayout> RegionLayout::ForSize(uint64_t region_bytes,
                                                   uint32_t sq_entries) {
  constexpr uint64_t kMin = uint64_t{256} << 10;
  constexpr uint64_t kMax = uint64_t{1} << 30;
  if (!std::has_single_bit(region_bytes) || region_bytes < kMin ||
      region_bytes > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared region size ", region_bytes,
        " must be a power of two between 256 KiB and 1 GiB (QEMU maps it "
        "as BAR2, which must be a power of two)"));
  }
  if (!std::has_single_bit(sq_entries) || sq_entries < 8 || sq_entries > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring size ", sq_entries, " must be a power of two in [8, 4096]"));
  }
  RegionLayout l;
  l.region_bytes = region_bytes;
  l.sq_entries = sq_entries;
  l.cq_entries = sq_entries;  // every SQE gets a CQE slot: the host never waits
  l.sq_offset = TMEM_PAGE_SIZE;
  l.cq_offset = l.sq_offset + l.sq_entries * sizeof(struct tmem_sqe);
  const uint64_t rings_end =
      uint64_t{l.cq_offset} + uint64_t{l.cq_entries} * sizeof(struct tmem_cqe);
  l.slots_offset = static_cast<uint32_t>((rings_end + TMEM_PAGE_SIZE - 1) /
                                         TMEM_PAGE_SIZE * TMEM_PAGE_SIZE);
  const uint64_t slots = (region_bytes - l.slots_offset) / TMEM_PAGE_SIZE;
  if (slots < sq_entries) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared region of ", region_bytes, " bytes leaves ", slots,
                     " page slots for ", sq_entries,
                     " ring entries; use a larger region or smaller rings"));
  }
  l.slot_count = static_cast<uint32_t>(slots);
  return l;
}

}  // namespace tmem
