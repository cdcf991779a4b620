#include "host-agent/swap/vhost_user_message.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem::swap {
namespace {

// The wire is little-endian, as is every host tmemd runs on (x86-64, and
// QEMU's vhost-user is host-endian by definition: both ends share a host).
uint32_t Load32(std::span<const uint8_t> b, size_t off) {
  uint32_t v;
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;
}
uint64_t Load64(std::span<const uint8_t> b, size_t off) {
  uint64_t v;
  std::memcpy(&v, b.data() + off, sizeof v);
  return v;
}
void Store32(std::vector<uint8_t>* out, uint32_t v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out->insert(out->end(), p, p + sizeof v);
}
void Store64(std::vector<uint8_t>* out, uint64_t v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out->insert(out->end(), p, p + sizeof v);
}

constexpr size_t kU64Size = 8;
constexpr size_t kVringStateSize = 8;
constexpr size_t kVringAddrSize = 40;
constexpr size_t kMemTableHeaderSize = 8;
constexpr size_t kRegionSize = 32;
constexpr size_t kConfigHeaderSize = 12;

VhostUserRequest Classify(uint32_t code) {
  switch (code) {
    case 1:
    case 2:
    case 3:
    case 4:
    case 5:
    case 6:
    case 7:
    case 8:
    case 9:
    case 10:
    case 11:
    case 12:
    case 13:
    case 14:
    case 15:
    case 16:
    case 17:
    case 18:
    case 24:
    case 25:
    case 31:
    case 32:
    case 34:
    case 36:
      return static_cast<VhostUserRequest>(code);
    default:
      return VhostUserRequest::kUnknown;
  }
}

absl::Status Refuse(uint32_t code, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("vhost-user request ", code, ": ", why));
}

absl::Status ExpectSize(uint32_t code, size_t got, size_t want) {
  if (got == want) return absl::OkStatus();
  return Refuse(code,
                absl::StrCat("payload is ", got, " bytes, expected ", want));
}

absl::Status ExpectFds(uint32_t code, size_t got, size_t want) {
  if (got == want) return absl::OkStatus();
  return Refuse(code, absl::StrCat(got, " file descriptors, expected ", want));
}

}  // namespace

absl::StatusOr<uint32_t> ParseVhostUserHeaderSize(
    std::span<const uint8_t> header) {
  if (header.size() < kVhostUserHeaderSize) {
    return absl::InvalidArgumentError("vhost-user header truncated");
  }
  const uint32_t code = Load32(header, 0);
  const uint32_t flags = Load32(header, 4);
  const uint32_t size = Load32(header, 8);
  if ((flags & kVhostUserVersionMask) != kVhostUserVersion) {
    return Refuse(code, absl::StrCat("version ", flags & kVhostUserVersionMask,
                                     ", only 1 exists"));
  }
  if ((flags & kVhostUserFlagReply) != 0) {
    return Refuse(code, "reply bit set on a request");
  }
  const uint32_t known =
      kVhostUserVersionMask | kVhostUserFlagReply | kVhostUserFlagNeedReply;
  if ((flags & ~known) != 0) {
    return Refuse(
        code, absl::StrCat("unknown flag bits 0x", absl::Hex(flags & ~known)));
  }
  if (size > kVhostUserMaxPayload) {
    return Refuse(
        code, absl::StrCat("payload of ", size, " bytes exceeds the limit of ",
                           kVhostUserMaxPayload));
  }
  return size;
}

absl::StatusOr<VhostUserMessage> ParseVhostUserMessage(
    std::span<const uint8_t> bytes, size_t fd_count) {
  absl::StatusOr<uint32_t> size = ParseVhostUserHeaderSize(bytes);
  if (!size.ok()) return size.status();
  const uint32_t code = Load32(bytes, 0);
  if (bytes.size() - kVhostUserHeaderSize != *size) {
    return Refuse(
        code, absl::StrCat("header says ", *size, " payload bytes, ",
                           bytes.size() - kVhostUserHeaderSize, " arrived"));
  }
  if (fd_count > kVhostUserMaxFds) {
    return Refuse(code, absl::StrCat(fd_count, " file descriptors, at most ",
                                     kVhostUserMaxFds));
  }
  const std::span<const uint8_t> p = bytes.subspan(kVhostUserHeaderSize);

  VhostUserMessage m;
  m.raw_request = code;
  m.request = Classify(code);
  m.flags = Load32(bytes, 4);
  m.need_reply = (m.flags & kVhostUserFlagNeedReply) != 0;
  m.fd_count = fd_count;

  switch (m.request) {
    case VhostUserRequest::kGetFeatures:
    case VhostUserRequest::kGetProtocolFeatures:
    case VhostUserRequest::kSetOwner:
    case VhostUserRequest::kResetOwner:
    case VhostUserRequest::kResetDevice:
    case VhostUserRequest::kGetQueueNum:
    case VhostUserRequest::kGetMaxMemSlots:
      if (absl::Status s = ExpectSize(code, p.size(), 0); !s.ok()) return s;
      if (absl::Status s = ExpectFds(code, fd_count, 0); !s.ok()) return s;
      break;

    case VhostUserRequest::kSetFeatures:
    case VhostUserRequest::kSetProtocolFeatures:
    case VhostUserRequest::kSetLogBase:
      if (absl::Status s = ExpectSize(code, p.size(), kU64Size); !s.ok()) {
        return s;
      }
      if (m.request != VhostUserRequest::kSetLogBase) {
        if (absl::Status s = ExpectFds(code, fd_count, 0); !s.ok()) return s;
      }
      m.u64 = Load64(p, 0);
      break;

    case VhostUserRequest::kSetVringKick:
    case VhostUserRequest::kSetVringCall:
    case VhostUserRequest::kSetVringErr: {
      if (absl::Status s = ExpectSize(code, p.size(), kU64Size); !s.ok()) {
        return s;
      }
      m.u64 = Load64(p, 0);
      if ((m.u64 & ~(kVringIndexMask | kVringNoFdFlag)) != 0) {
        return Refuse(code, "reserved bits set in the vring word");
      }
      m.vring_index = static_cast<uint32_t>(m.u64 & kVringIndexMask);
      const size_t want = (m.u64 & kVringNoFdFlag) != 0 ? 0 : 1;
      if (absl::Status s = ExpectFds(code, fd_count, want); !s.ok()) return s;
      break;
    }

    case VhostUserRequest::kSetVringNum:
    case VhostUserRequest::kSetVringBase:
    case VhostUserRequest::kGetVringBase:
    case VhostUserRequest::kSetVringEnable:
      if (absl::Status s = ExpectSize(code, p.size(), kVringStateSize);
          !s.ok()) {
        return s;
      }
      if (absl::Status s = ExpectFds(code, fd_count, 0); !s.ok()) return s;
      m.vring_index = Load32(p, 0);
      m.vring_num = Load32(p, 4);
      break;

    case VhostUserRequest::kSetVringAddr:
      if (absl::Status s = ExpectSize(code, p.size(), kVringAddrSize);
          !s.ok()) {
        return s;
      }
      if (absl::Status s = ExpectFds(code, fd_count, 0); !s.ok()) return s;
      m.vring_addr.index = Load32(p, 0);
      m.vring_addr.flags = Load32(p, 4);
      m.vring_addr.desc_user_addr = Load64(p, 8);
      m.vring_addr.used_user_addr = Load64(p, 16);
      m.vring_addr.avail_user_addr = Load64(p, 24);
      m.vring_addr.log_guest_addr = Load64(p, 32);
      m.vring_index = m.vring_addr.index;
      break;

    case VhostUserRequest::kSetMemTable: {
      if (p.size() < kMemTableHeaderSize) {
        return Refuse(code, "memory table shorter than its header");
      }
      const uint32_t n = Load32(p, 0);
      if (n == 0 || n > kVhostUserMaxRegions) {
        return Refuse(code, absl::StrCat(n, " regions, must be 1 to ",
                                         kVhostUserMaxRegions));
      }
      // n <= 8: the product cannot overflow.
      if (absl::Status s =
              ExpectSize(code, p.size(), kMemTableHeaderSize + n * kRegionSize);
          !s.ok()) {
        return s;
      }
      if (absl::Status s = ExpectFds(code, fd_count, n); !s.ok()) return s;
      m.regions.reserve(n);
      for (uint32_t i = 0; i < n; ++i) {
        const size_t off = kMemTableHeaderSize + i * kRegionSize;
        MemoryRegionDesc r;
        r.guest_phys_addr = Load64(p, off);
        r.memory_size = Load64(p, off + 8);
        r.userspace_addr = Load64(p, off + 16);
        r.mmap_offset = Load64(p, off + 24);
        m.regions.push_back(r);
      }
      break;
    }

    case VhostUserRequest::kGetConfig:
    case VhostUserRequest::kSetConfig: {
      if (p.size() < kConfigHeaderSize) {
        return Refuse(code, "config message shorter than its header");
      }
      if (absl::Status s = ExpectFds(code, fd_count, 0); !s.ok()) return s;
      m.config.offset = Load32(p, 0);
      m.config.size = Load32(p, 4);
      m.config.flags = Load32(p, 8);
      if (m.config.size > kVhostUserMaxConfigSize) {
        return Refuse(code, absl::StrCat("config size ", m.config.size,
                                         " exceeds ", kVhostUserMaxConfigSize));
      }
      if (absl::Status s =
              ExpectSize(code, p.size(), kConfigHeaderSize + m.config.size);
          !s.ok()) {
        return s;
      }
      if (m.request == VhostUserRequest::kSetConfig) {
        m.config.data.assign(p.begin() + kConfigHeaderSize, p.end());
      }
      break;
    }

    case VhostUserRequest::kSetLogFd:
    case VhostUserRequest::kGetInflightFd:
    case VhostUserRequest::kSetInflightFd:
    case VhostUserRequest::kUnknown:
      // Framing is valid; the session decides (it serves none of these).
      break;
  }
  return m;
}

namespace {
std::vector<uint8_t> ReplyHeader(uint32_t request, uint32_t size) {
  std::vector<uint8_t> out;
  out.reserve(kVhostUserHeaderSize + size);
  Store32(&out, request);
  Store32(&out, kVhostUserVersion | kVhostUserFlagReply);
  Store32(&out, size);
  return out;
}
}  // namespace

std::vector<uint8_t> EncodeVhostUserReplyU64(uint32_t request, uint64_t value) {
  std::vector<uint8_t> out = ReplyHeader(request, kU64Size);
  Store64(&out, value);
  return out;
}

std::vector<uint8_t> EncodeVhostUserReplyVringState(uint32_t request,
                                                    uint32_t index,
                                                    uint32_t num) {
  std::vector<uint8_t> out = ReplyHeader(request, kVringStateSize);
  Store32(&out, index);
  Store32(&out, num);
  return out;
}

std::vector<uint8_t> EncodeVhostUserReplyConfig(uint32_t request,
                                                uint32_t offset, uint32_t flags,
                                                std::span<const uint8_t> data) {
  std::vector<uint8_t> out = ReplyHeader(
      request, static_cast<uint32_t>(kConfigHeaderSize + data.size()));
  Store32(&out, offset);
  Store32(&out, static_cast<uint32_t>(data.size()));
  Store32(&out, flags);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

}  // namespace tmem::swap
