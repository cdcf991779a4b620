// RegionLayout: where the header, rings and page slots sit in a VM's shared
// region (see proto/tmem_abi.h for the format itself).
//
// The host picks the layout from the region size; the guest reads the same
// numbers from the header and must not assume any of them. Pure value type.
#ifndef TMEMD_HOST_AGENT_CHANNEL_REGION_LAYOUT_H_
#define TMEMD_HOST_AGENT_CHANNEL_REGION_LAYOUT_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace tmem {

struct RegionLayout {
  uint64_t region_bytes = 0;  // power of two (QEMU asserts it for BAR2)
  uint32_t sq_offset = 0;
  uint32_t sq_entries = 0;  // power of two
  uint32_t cq_offset = 0;
  uint32_t cq_entries = 0;    // power of two, >= sq_entries
  uint32_t slots_offset = 0;  // page aligned
  uint32_t slot_count = 0;

  // The default: 256 SQ/CQ entries and the rest of the region as slots.
  // INVALID_ARGUMENT unless region_bytes is a power of two in
  // [256 KiB, 1 GiB] and sq_entries a power of two in [8, 4096] that leaves
  // at least sq_entries slots.
  static absl::StatusOr<RegionLayout> ForSize(uint64_t region_bytes,
                                              uint32_t sq_entries = 256);
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_REGION_LAYOUT_H_
