#include "host-agent/swap/virtio_blk.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <span>

namespace tmem::swap {
namespace {

void Put16(std::vector<uint8_t>* b, size_t off, uint16_t v) {
  std::memcpy(b->data() + off, &v, sizeof v);
}
void Put32(std::vector<uint8_t>* b, size_t off, uint32_t v) {
  std::memcpy(b->data() + off, &v, sizeof v);
}
void Put64(std::vector<uint8_t>* b, size_t off, uint64_t v) {
  std::memcpy(b->data() + off, &v, sizeof v);
}

constexpr size_t kHeaderSize = 16;   // struct virtio_blk_outhdr
constexpr size_t kSegmentSize = 16;  // struct virtio_blk_discard_write_zeroes

struct Header {
  uint32_t type;
  uint32_t ioprio;
  uint64_t sector;
};

// [sector, sector + count) within the device, without overflow.
bool SectorsInRange(uint64_t sector, uint64_t count, uint64_t capacity) {
  return sector <= capacity && count <= capacity - sector;
}

// Reads or writes [offset, offset + len) bytes of the device (offset and
// len whole sectors) from/into `data`, page by page of the backing: runs of
// whole pages in one call, partial pages by read-modify-write.
absl::Status TransferBytes(bool write, uint64_t offset, uint64_t len,
                           std::span<const GuestSpan> data,
                           SwapBacking* backing, SwapMetrics* metrics) {
  std::vector<GuestSpan> slice;
  std::array<uint8_t, kSwapPageSize> page_buf{};
  const GuestSpan page_span{page_buf.data(), page_buf.size()};
  const uint64_t end = offset + len;
  uint64_t pos = offset;
  while (pos < end) {
    const uint64_t page = pos / kSwapPageSize;
    const uint64_t in_page = pos % kSwapPageSize;
    if (in_page == 0 && end - pos >= kSwapPageSize) {
      const uint64_t run = (end - pos) / kSwapPageSize;
      slice.clear();
      if (!SliceSpans(data, pos - offset, run * kSwapPageSize, &slice)) {
        return absl::InternalError("request spans shorter than the request");
      }
      absl::Status s = write ? backing->WritePages(page, run, slice)
                             : backing->ReadPages(page, run, slice);
      if (!s.ok()) return s;
      pos += run * kSwapPageSize;
      continue;
    }
    const uint64_t take = std::min(kSwapPageSize - in_page, end - pos);
    metrics->Inc(SwapCounter::kPartialPageRmw);
    if (absl::Status s = backing->ReadPages(page, 1, {&page_span, 1});
        !s.ok()) {
      return s;
    }
    slice.clear();
    if (!SliceSpans(data, pos - offset, take, &slice)) {
      return absl::InternalError("request spans shorter than the request");
    }
    if (write) {
      CopyFromSpans(slice, page_buf.data() + in_page, take);
      if (absl::Status s = backing->WritePages(page, 1, {&page_span, 1});
          !s.ok()) {
        return s;
      }
    } else {
      CopyToSpans(slice, page_buf.data() + in_page, take);
    }
    pos += take;
  }
  return absl::OkStatus();
}

// Zeroes (or discards) [offset, offset + len): whole pages through the
// backing's own call, partial pages by read-modify-write.
absl::Status ZeroBytes(bool discard, bool may_unmap, uint64_t offset,
                       uint64_t len, SwapBacking* backing,
                       SwapMetrics* metrics) {
  std::array<uint8_t, kSwapPageSize> page_buf{};
  const GuestSpan page_span{page_buf.data(), page_buf.size()};
  const uint64_t end = offset + len;
  uint64_t pos = offset;
  while (pos < end) {
    const uint64_t page = pos / kSwapPageSize;
    const uint64_t in_page = pos % kSwapPageSize;
    if (in_page == 0 && end - pos >= kSwapPageSize) {
      const uint64_t run = (end - pos) / kSwapPageSize;
      absl::Status s = discard ? backing->DiscardPages(page, run)
                               : backing->WriteZeroPages(page, run, may_unmap);
      if (!s.ok()) return s;
      pos += run * kSwapPageSize;
      continue;
    }
    const uint64_t take = std::min(kSwapPageSize - in_page, end - pos);
    metrics->Inc(SwapCounter::kPartialPageRmw);
    if (absl::Status s = backing->ReadPages(page, 1, {&page_span, 1});
        !s.ok()) {
      return s;
    }
    std::memset(page_buf.data() + in_page, 0, take);
    if (absl::Status s = backing->WritePages(page, 1, {&page_span, 1});
        !s.ok()) {
      return s;
    }
    pos += take;
  }
  return absl::OkStatus();
}

uint8_t BackingFailed(SwapMetrics* metrics) {
  metrics->Inc(SwapCounter::kBackingErrors);
  return kVirtioBlkSIoErr;
}

uint8_t BadLayout(SwapMetrics* metrics) {
  metrics->Inc(SwapCounter::kRequestsBadLayout);
  return kVirtioBlkSIoErr;
}

// DISCARD and WRITE_ZEROES: segments follow the header, device-readable.
uint8_t ExecuteZeroing(const DescriptorChain& chain, bool discard,
                       const BlkDeviceConfig& config, SwapBacking* backing,
                       SwapMetrics* metrics) {
  metrics->Inc(discard ? SwapCounter::kDiscards : SwapCounter::kWriteZeroes);
  const uint64_t payload = chain.readable_len - kHeaderSize;
  const uint32_t max_seg =
      discard ? config.max_discard_seg : config.max_write_zeroes_seg;
  const uint32_t max_sectors =
      discard ? config.max_discard_sectors : config.max_write_zeroes_sectors;
  if (chain.writable_len != 1 || payload == 0 || payload % kSegmentSize != 0 ||
      payload / kSegmentSize > max_seg) {
    return BadLayout(metrics);
  }
  const size_t nseg = payload / kSegmentSize;
  std::vector<uint8_t> segs(chain.readable_len);
  CopyFromSpans(chain.readable, segs.data(), segs.size());
  for (size_t i = 0; i < nseg; ++i) {
    const uint8_t* p = segs.data() + kHeaderSize + i * kSegmentSize;
    uint64_t sector;
    uint32_t num;
    uint32_t flags;
    std::memcpy(&sector, p, 8);
    std::memcpy(&num, p + 8, 4);
    std::memcpy(&flags, p + 12, 4);
    // Discard has no flags; write-zeroes only "unmap" (virtio 1.x 5.2.6.2).
    const uint32_t allowed = discard ? 0 : kVirtioBlkWriteZeroesUnmap;
    if ((flags & ~allowed) != 0) {
      metrics->Inc(SwapCounter::kRequestsUnsupported);
      return kVirtioBlkSUnsupp;
    }
    if (num > max_sectors ||
        !SectorsInRange(sector, num, config.capacity_sectors)) {
      metrics->Inc(SwapCounter::kRequestsOutOfRange);
      return kVirtioBlkSIoErr;
    }
    absl::Status s = ZeroBytes(
        discard, (flags & kVirtioBlkWriteZeroesUnmap) != 0,
        sector * kSectorSize, uint64_t{num} * kSectorSize, backing, metrics);
    if (!s.ok()) return BackingFailed(metrics);
  }
  return kVirtioBlkSOk;
}

}  // namespace

uint64_t BlkDeviceFeatures(const BlkDeviceConfig& config) {
  uint64_t f = (1ull << kVirtioBlkFSegMax) | (1ull << kVirtioBlkFBlkSize) |
               (1ull << kVirtioBlkFFlush) | (1ull << kVirtioBlkFDiscard) |
               (1ull << kVirtioBlkFWriteZeroes) |
               (1ull << kVirtioRingFIndirectDesc) |
               (1ull << kVirtioRingFEventIdx) | (1ull << kVirtioFVersion1);
  if (config.num_queues > 1) f |= 1ull << kVirtioBlkFMq;
  return f;
}

std::vector<uint8_t> EncodeBlkConfigSpace(const BlkDeviceConfig& config) {
  // struct virtio_blk_config offsets (virtio 1.x 5.2.4).
  std::vector<uint8_t> b(60, 0);
  Put64(&b, 0, config.capacity_sectors);
  Put32(&b, 8, 0);  // size_max: not offered
  Put32(&b, 12, config.seg_max);
  // 16..19 geometry: not offered.
  Put32(&b, 20, static_cast<uint32_t>(kSwapPageSize));  // blk_size
  // 24..31 topology: not offered. 32 writeback: not offered.
  Put16(&b, 34, config.num_queues);
  Put32(&b, 36, config.max_discard_sectors);
  Put32(&b, 40, config.max_discard_seg);
  Put32(&b, 44, config.discard_sector_alignment);
  Put32(&b, 48, config.max_write_zeroes_sectors);
  Put32(&b, 52, config.max_write_zeroes_seg);
  b[56] = 1;  // write_zeroes_may_unmap
  return b;
}

uint32_t ExecuteBlkRequest(const DescriptorChain& chain,
                           const BlkDeviceConfig& config, SwapBacking* backing,
                           SwapMetrics* metrics) {
  metrics->Inc(SwapCounter::kRequests);
  if (chain.writable_len == 0) {
    metrics->Inc(SwapCounter::kRequestsNoStatus);
    return 0;
  }
  // The status byte is the chain's last writable byte; everything before
  // it in the writable part is data.
  std::vector<GuestSpan> data_in;
  SliceSpans(chain.writable, 0, chain.writable_len - 1, &data_in);
  GuestSpan status_span{};
  {
    std::vector<GuestSpan> s;
    SliceSpans(chain.writable, chain.writable_len - 1, 1, &s);
    status_span = s.front();
  }
  uint8_t status = kVirtioBlkSOk;
  uint32_t written = 0;

  Header h{};
  if (chain.readable_len < kHeaderSize) {
    status = BadLayout(metrics);
  } else {
    std::array<uint8_t, kHeaderSize> raw{};
    CopyFromSpans(chain.readable, raw.data(), raw.size());
    std::memcpy(&h.type, raw.data(), 4);
    std::memcpy(&h.ioprio, raw.data() + 4, 4);
    std::memcpy(&h.sector, raw.data() + 8, 8);
    const uint64_t out_len = chain.readable_len - kHeaderSize;
    const uint64_t in_len = chain.writable_len - 1;
    switch (h.type) {
      case kVirtioBlkTIn:
      case kVirtioBlkTOut: {
        const bool write = h.type == kVirtioBlkTOut;
        metrics->Inc(write ? SwapCounter::kWrites : SwapCounter::kReads);
        const uint64_t len = write ? out_len : in_len;
        if ((write ? in_len : out_len) != 0) {
          status = BadLayout(metrics);
        } else if (len % kSectorSize != 0) {
          metrics->Inc(SwapCounter::kRequestsUnaligned);
          status = kVirtioBlkSIoErr;
        } else if (!SectorsInRange(h.sector, len / kSectorSize,
                                   config.capacity_sectors)) {
          metrics->Inc(SwapCounter::kRequestsOutOfRange);
          status = kVirtioBlkSIoErr;
        } else {
          std::vector<GuestSpan> data_out;
          if (write) SliceSpans(chain.readable, kHeaderSize, len, &data_out);
          absl::Status s =
              TransferBytes(write, h.sector * kSectorSize, len,
                            write ? data_out : data_in, backing, metrics);
          if (!s.ok()) {
            status = BackingFailed(metrics);
          } else if (write) {
            metrics->Inc(SwapCounter::kBytesWritten, len);
          } else {
            metrics->Inc(SwapCounter::kBytesRead, len);
            written = static_cast<uint32_t>(len);
          }
        }
        break;
      }
      case kVirtioBlkTFlush:
        metrics->Inc(SwapCounter::kFlushes);
        if (out_len != 0 || in_len != 0) {
          status = BadLayout(metrics);
        } else if (!backing->Flush().ok()) {
          status = BackingFailed(metrics);
        }
        break;
      case kVirtioBlkTGetId: {
        metrics->Inc(SwapCounter::kGetIds);
        if (out_len != 0 || in_len == 0) {
          status = BadLayout(metrics);
          break;
        }
        std::array<uint8_t, kVirtioBlkIdBytes> id{};
        std::memcpy(id.data(), config.serial.data(),
                    std::min(config.serial.size(), id.size()));
        const size_t n = std::min<uint64_t>(in_len, id.size());
        CopyToSpans(data_in, id.data(), n);
        written = static_cast<uint32_t>(n);
        break;
      }
      case kVirtioBlkTDiscard:
      case kVirtioBlkTWriteZeroes:
        status = ExecuteZeroing(chain, h.type == kVirtioBlkTDiscard, config,
                                backing, metrics);
        break;
      default:
        metrics->Inc(SwapCounter::kRequestsUnsupported);
        status = kVirtioBlkSUnsupp;
        break;
    }
  }
  *status_span.data = status;
  return written + 1;
}

}  // namespace tmem::swap
