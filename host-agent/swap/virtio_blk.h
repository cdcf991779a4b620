// VirtioBlk: the virtio-blk device model (virtio 1.x, 5.2) over a
// SwapBacking: feature bits, config space, and the execution of one request
// taken from a descriptor chain.
//
// Contract:
//  * The device has capacity = backing page_count * 8 sectors of 512 bytes
//    and tells the guest its logical block is 4096 bytes (blk_size), so
//    Linux sends page-aligned I/O. Any other alignment still works: the
//    device reads and writes whole pages of the backing, doing
//    read-modify-write for partial pages (counted), so the backing only
//    ever sees whole pages.
//  * ExecuteBlkRequest reads the 16-byte request header once (it may be
//    split over several buffers), checks the layout for its type (header
//    and data device-readable for OUT/DISCARD/WRITE_ZEROES, data
//    device-writable for IN/GET_ID, the last writable byte is the status),
//    that data is whole sectors, that every sector is below the capacity
//    (without overflow) and DISCARD/WRITE_ZEROES segments are within the
//    advertised limits; then runs it. Reads go from the backing straight
//    into the guest's buffers (the spans), writes straight from them.
//    Result in the status byte: OK, IOERR (bad layout, out of range, the
//    backing failed), UNSUPP (unknown type, reserved flags). Every refusal
//    bumps its counter. A chain with no writable byte cannot carry a
//    status: it completes with length 0 (counted).
//  * Returns the used length: bytes the device wrote into the chain.
// Thread-compatible: one call at a time per scratch buffer.
#ifndef TMEMD_HOST_AGENT_SWAP_VIRTIO_BLK_H_
#define TMEMD_HOST_AGENT_SWAP_VIRTIO_BLK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "host-agent/swap/descriptor_chain.h"
#include "host-agent/swap/swap_backing.h"
#include "host-agent/swap/swap_metrics.h"

namespace tmem::swap {

// Request types and status values (virtio 1.x 5.2.6).
inline constexpr uint32_t kVirtioBlkTIn = 0;
inline constexpr uint32_t kVirtioBlkTOut = 1;
inline constexpr uint32_t kVirtioBlkTFlush = 4;
inline constexpr uint32_t kVirtioBlkTGetId = 8;
inline constexpr uint32_t kVirtioBlkTDiscard = 11;
inline constexpr uint32_t kVirtioBlkTWriteZeroes = 13;
inline constexpr uint8_t kVirtioBlkSOk = 0;
inline constexpr uint8_t kVirtioBlkSIoErr = 1;
inline constexpr uint8_t kVirtioBlkSUnsupp = 2;
inline constexpr uint32_t kVirtioBlkWriteZeroesUnmap = 1;
inline constexpr uint32_t kVirtioBlkIdBytes = 20;
inline constexpr uint64_t kSectorSize = 512;
inline constexpr uint64_t kSectorsPerPage = kSwapPageSize / kSectorSize;

// Feature bits.
inline constexpr int kVirtioBlkFSegMax = 2;
inline constexpr int kVirtioBlkFBlkSize = 6;
inline constexpr int kVirtioBlkFFlush = 9;
inline constexpr int kVirtioBlkFMq = 12;
inline constexpr int kVirtioBlkFDiscard = 13;
inline constexpr int kVirtioBlkFWriteZeroes = 14;
inline constexpr int kVirtioRingFIndirectDesc = 28;
inline constexpr int kVirtioRingFEventIdx = 29;
inline constexpr int kVirtioFVersion1 = 32;

struct BlkDeviceConfig {
  uint64_t capacity_sectors = 0;  // backing page_count * 8
  uint16_t num_queues = 1;
  uint32_t seg_max = 126;  // data segments per request (queue size - 2)
  uint32_t max_discard_sectors = 1u << 22;  // 2 GiB per segment
  uint32_t max_discard_seg = 1;
  uint32_t discard_sector_alignment = kSectorsPerPage;
  uint32_t max_write_zeroes_sectors = 1u << 22;
  uint32_t max_write_zeroes_seg = 1;
  std::string serial = "tmemd-swap";  // GET_ID, at most 20 bytes used
};

// The virtio feature bits the device offers (without the vhost-user bit).
uint64_t BlkDeviceFeatures(const BlkDeviceConfig& config);

// struct virtio_blk_config as the guest reads it (little-endian), 60 bytes
// up to and including write_zeroes_may_unmap; reads past it see zeros.
std::vector<uint8_t> EncodeBlkConfigSpace(const BlkDeviceConfig& config);

uint32_t ExecuteBlkRequest(const DescriptorChain& chain,
                           const BlkDeviceConfig& config, SwapBacking* backing,
                           SwapMetrics* metrics);

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_VIRTIO_BLK_H_
