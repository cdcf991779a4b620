// Identity and policy types shared by every part of the tmem store, and by
// the tools that speak about it (tmemctl links these, not the store).
//
// A tmem key is (VM, pool, object, index): a VM (the tmem "client") owns pools,
// a pool holds objects named by the 24-byte cleancache filekey, and an object
// holds pages named by their 64-bit page-cache index. Every stored page is
// exactly kPageSize bytes.
#ifndef TMEMD_BACKEND_TYPES_H_
#define TMEMD_BACKEND_TYPES_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tmem {

inline constexpr size_t kPageSize = 4096;

// The cleancache filekey: `u32 key[6]` in Linux 5.10 (an exportfs handle or
// the inode number). Compared bytewise.
struct ObjectId {
  std::array<uint32_t, 6> words{};

  friend bool operator==(const ObjectId&, const ObjectId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ObjectId& o) {
    return H::combine_contiguous(std::move(h), o.words.data(), o.words.size());
  }
  // Convenience for tests and tools: an object named by an inode number.
  static ObjectId FromInode(uint64_t ino) {
    ObjectId o;
    o.words[0] = static_cast<uint32_t>(ino);
    o.words[1] = static_cast<uint32_t>(ino >> 32);
    return o;
  }
};
static_assert(sizeof(ObjectId) == 24);

// A shared pool is named by the filesystem UUID (cleancache init_shared_fs).
struct PoolUuid {
  std::array<uint8_t, 16> bytes{};
  friend bool operator==(const PoolUuid&, const PoolUuid&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const PoolUuid& u) {
    return H::combine_contiguous(std::move(h), u.bytes.data(), u.bytes.size());
  }
};

using PageIndex = uint64_t;

// A well-mixed 64-bit hash of a page's (object, index), pool left out: the
// valve's reuse tracking (ghost keys) only needs "probably the same page",
// and the ring consumer and the store both compute it without pool ids.
inline uint64_t KeyHash(const ObjectId& oid, PageIndex index) {
  uint64_t h = index * 0x9e3779b97f4a7c15ull;
  for (uint32_t w : oid.words) {
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  h = (h ^ (h >> 29)) * 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 32);
}

// A VM's name for one of its pools. Pool ids are per VM, small, and reused
// after DestroyPool, like cleancache's pool ids.
using PoolId = int32_t;

// What a pool promises about its pages (tmem's two pool kinds).
enum class PoolKind : uint8_t {
  // Cleancache's: a page may disappear at any time (eviction); a get in a
  // private pool is exclusive.
  kEphemeral = 0,
  // Frontswap's: a stored page stays until it is overwritten or invalidated
  // (never evicted); gets leave it in place. The store may refuse a put
  // (then the caller keeps the page elsewhere), never lose one it took.
  kPersistent = 1,
};
std::string_view PoolKindName(PoolKind kind);

// How a stored page is held. Recorded per page.
enum class StorageKind : uint8_t {
  kZero = 0,        // all bytes zero: metadata only
  kSameFilled = 1,  // one 64-bit word repeated: metadata only
  kLz4 = 2,         // LZ4 block in the blob allocator
  kRaw = 3,         // the 4096 bytes verbatim in the blob allocator
};
std::string_view StorageKindName(StorageKind kind);

// Why a put was not stored. One counter per reason.
enum class RefuseReason : uint8_t {
  kQuota = 0,  // the page alone would not fit in the VM's quota
  kPoorCompression =
      1,          // LZ4 did not reach the threshold and policy refuses raw
  kNoMemory = 2,  // the host cap could not be met: no page left to evict
  kPolicy = 3,    // the caller (valve) or VM state (disabled, frozen) said no
};
inline constexpr int kNumRefuseReasons = 4;
std::string_view RefuseReasonName(RefuseReason reason);

// What the caller asks the store to do with a put's page. The valve decides;
// the store obeys (zero and same-filled pages are always metadata-only since
// detecting them costs less than a memcpy).
enum class PutMode : uint8_t {
  kCompress = 0,  // try LZ4; poorly compressible pages follow the store policy
  kRaw = 1,       // skip LZ4, store verbatim (CPU is scarce)
  kDrop = 2,      // do not store; counted as refused by policy
  // Store verbatim now and queue the page for the compactor, which
  // compresses it later with idle cycles (compaction_queue.h). A store
  // without a compaction queue treats it as kCompress.
  kDefer = 3,
  // Like kDefer, but compressed only with idle cycles even when memory is
  // tight (the compactor's normal-priority work is for pages a VM has the
  // CPU tokens for): the valve's raw-for-CPU puts, and a backlogged VM's
  // puts the worker defers so that VMs waiting behind it are served first
  // (a VM that floods slows only itself). The raw pages count against their own
  // VM's quota and fair share, so its neighbours do not pay for the memory.
  kDeferIdle = 4,
};

// How the valve treats a VM's puts (backend/valve.h). kDefault follows the
// host's default mode.
enum class ValveMode : uint8_t {
  kDefault = 0,
  kOff = 1,       // no tmem: every put dropped, guests told not to send
  kAlways = 2,    // compress every put (zcache-like; what the 2011 report saw)
  kAdaptive = 3,  // compress with spare CPU, else raw or drop; admit by reuse
};
std::string_view ValveModeName(ValveMode mode);
// "default", "off", "always", "adaptive"; false for anything else.
bool ParseValveMode(std::string_view text, ValveMode* mode);

// A VM's handle: slot and generation, so a stale id never reaches a new VM.
using VmId = uint32_t;

inline constexpr uint64_t kUnlimitedQuota = UINT64_MAX;

// What the host allows one VM. The store keeps quota, weight, enabled and
// frozen; the valve keeps the mode.
struct VmPolicy {
  uint64_t quota_bytes = kUnlimitedQuota;
  uint32_t weight = 100;
  bool enabled = true;  // false: puts refused (policy); gets still served
  bool frozen = false;  // like Xen's tmem-freeze: puts refused, gets served
  // Read by the valve, not the store.
  ValveMode mode = ValveMode::kDefault;
  // The VM's swap device (its persistent pools): at most this much of the
  // VM's charge may be swap pages (within quota_bytes, which bounds
  // everything the VM holds); past it a swap page goes to the spill image.
  uint64_t swap_quota_bytes = kUnlimitedQuota;
  // How the valve stores the VM's swap pages; kDefault follows `mode`.
  // Read by the valve, not the store.
  ValveMode swap_mode = ValveMode::kDefault;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_TYPES_H_
