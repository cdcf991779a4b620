// VhostUserMessage: the wire format of the vhost-user protocol (QEMU's
// docs/interop/vhost-user.rst), as the back-end side of a connection sees it.
//
// Contract:
//  * ParseVhostUserMessage takes one message exactly as it arrived (the
//    12-byte header followed by `size` payload bytes) and the number of file
//    descriptors that came with it (SCM_RIGHTS), and returns a typed request
//    or a Status naming what was wrong. It never reads past `bytes`, never
//    trusts `size` before comparing it with what arrived, and refuses: a
//    version other than 1, the reply bit set (a front-end never sends
//    replies), unknown flag bits, a payload longer than
//    kVhostUserMaxPayload, a payload of the wrong size for its request, and
//    a file descriptor count other than the request allows. Unknown request
//    codes parse (as kUnknown) so the session can refuse them with a counter;
//    the parser itself holds no policy about which requests are served.
//  * The parser owns no file descriptors: the caller keeps the ones it
//    received and hands them over, or closes them, whatever the result.
//  * EncodeVhostUserReply builds a reply (header with the reply bit, the
//    request code echoed) for a request that has one.
// Pure functions; thread-safe.
#ifndef TMEMD_HOST_AGENT_SWAP_VHOST_USER_MESSAGE_H_
#define TMEMD_HOST_AGENT_SWAP_VHOST_USER_MESSAGE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace tmem::swap {

// Request codes (front-end -> back-end), as numbered by the protocol.
enum class VhostUserRequest : uint32_t {
  kUnknown = 0,
  kGetFeatures = 1,
  kSetFeatures = 2,
  kSetOwner = 3,
  kResetOwner = 4,
  kSetMemTable = 5,
  kSetLogBase = 6,
  kSetLogFd = 7,
  kSetVringNum = 8,
  kSetVringAddr = 9,
  kSetVringBase = 10,
  kGetVringBase = 11,
  kSetVringKick = 12,
  kSetVringCall = 13,
  kSetVringErr = 14,
  kGetProtocolFeatures = 15,
  kSetProtocolFeatures = 16,
  kGetQueueNum = 17,
  kSetVringEnable = 18,
  kGetConfig = 24,
  kSetConfig = 25,
  kGetInflightFd = 31,
  kSetInflightFd = 32,
  kResetDevice = 34,
  kGetMaxMemSlots = 36,
};

// Header flags: bits 0-1 the version, bit 2 "this is a reply", bit 3 "the
// front-end wants an ack" (REPLY_ACK).
inline constexpr uint32_t kVhostUserVersion = 0x1;
inline constexpr uint32_t kVhostUserVersionMask = 0x3;
inline constexpr uint32_t kVhostUserFlagReply = 1u << 2;
inline constexpr uint32_t kVhostUserFlagNeedReply = 1u << 3;

inline constexpr size_t kVhostUserHeaderSize = 12;
// The largest payload any request we parse can carry: a memory table of
// kVhostUserMaxRegions regions (8 + 8 * 32 = 264 bytes) or a config
// message (12 + 256 = 268). Anything longer is refused before it is read.
inline constexpr size_t kVhostUserMaxPayload = 4096;
// Regions in one SET_MEM_TABLE (VHOST_MEMORY_BASELINE_NREGIONS).
inline constexpr uint32_t kVhostUserMaxRegions = 8;
// At most this many descriptors accompany one message.
inline constexpr size_t kVhostUserMaxFds = kVhostUserMaxRegions;
// Config space bytes one GET_CONFIG/SET_CONFIG may move.
inline constexpr uint32_t kVhostUserMaxConfigSize = 256;

// Protocol feature bits (GET/SET_PROTOCOL_FEATURES).
inline constexpr int kProtocolFeatureMq = 0;
inline constexpr int kProtocolFeatureReplyAck = 3;
inline constexpr int kProtocolFeatureConfig = 9;
inline constexpr int kProtocolFeatureInflightShmfd = 12;
// The virtio feature bit that says protocol features exist.
inline constexpr int kVhostUserFeatureProtocolFeatures = 30;

// Bits 0-7 of a SET_VRING_KICK/CALL/ERR payload: the vring index; bit 8:
// no file descriptor is sent (polling mode for kick, none for call/err).
inline constexpr uint64_t kVringIndexMask = 0xff;
inline constexpr uint64_t kVringNoFdFlag = 1ull << 8;

struct MemoryRegionDesc {
  uint64_t guest_phys_addr = 0;
  uint64_t memory_size = 0;
  uint64_t userspace_addr = 0;
  uint64_t mmap_offset = 0;
};

struct VringAddrDesc {
  uint32_t index = 0;
  uint32_t flags = 0;
  // QEMU's user addresses of the three rings (and of the log, unused).
  uint64_t desc_user_addr = 0;
  uint64_t used_user_addr = 0;
  uint64_t avail_user_addr = 0;
  uint64_t log_guest_addr = 0;
};

struct ConfigDesc {
  uint32_t offset = 0;
  uint32_t size = 0;
  uint32_t flags = 0;
  std::vector<uint8_t> data;  // SET_CONFIG only: exactly `size` bytes
};

// One parsed request. Which fields mean something depends on `request`.
struct VhostUserMessage {
  VhostUserRequest request = VhostUserRequest::kUnknown;
  uint32_t raw_request = 0;  // the code as received (for unknown ones)
  uint32_t flags = 0;
  bool need_reply = false;
  uint64_t u64 = 0;          // features, protocol features, kick/call/err word
  uint32_t vring_index = 0;  // SET_VRING_NUM/BASE/ENABLE, GET_VRING_BASE
  uint32_t vring_num = 0;    // the state's second word
  VringAddrDesc vring_addr;
  std::vector<MemoryRegionDesc> regions;
  ConfigDesc config;
  size_t fd_count = 0;
};

// `bytes`: header plus payload, exactly as received.
absl::StatusOr<VhostUserMessage> ParseVhostUserMessage(
    std::span<const uint8_t> bytes, size_t fd_count);

// Reads only the header: the payload size the caller must still read, or
// an error for a header that must not be followed (bad version or flags,
// payload over the limit). `header` is kVhostUserHeaderSize bytes.
absl::StatusOr<uint32_t> ParseVhostUserHeaderSize(
    std::span<const uint8_t> header);

// Reply frames.
std::vector<uint8_t> EncodeVhostUserReplyU64(uint32_t request, uint64_t value);
std::vector<uint8_t> EncodeVhostUserReplyVringState(uint32_t request,
                                                    uint32_t index,
                                                    uint32_t num);
std::vector<uint8_t> EncodeVhostUserReplyConfig(uint32_t request,
                                                uint32_t offset, uint32_t flags,
                                                std::span<const uint8_t> data);

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_VHOST_USER_MESSAGE_H_
