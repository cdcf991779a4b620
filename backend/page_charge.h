// PageCharge: what a stored page costs, all-in. These are the bytes VM
// quotas and fair-share eviction count (architecture invariant 4), so no VM
// can hold more than its quota by choosing its page shapes.
//
// A page pays for its entry and its page-index slot; the page that created
// an object pays for the object (node and object-index slot); the page that
// brought a pool into a shard pays for the pool's slot there. Index slots are
// counted at the lowest load an index has while it grows (3/8), entries and
// nodes at their size (they live in chunks: the partly used chunk per shard
// is the shard's, not any page's). A blob pays for its size-class slot plus
// its share of the slab tail that slot size leaves unused. ShardTable says
// which page pays which shared cost (PageEntry::charges) and hands the duty
// on when that page goes.
//
// Not charged to any VM (the host cap still counts them): per shard, one
// partly used chunk of entries and of objects and index slack below 3/8 load
// left by removals (bounded by the shard's peak); per size class, one partly
// filled slab; up to 8 cached empty slabs.
#ifndef TMEMD_BACKEND_PAGE_CHARGE_H_
#define TMEMD_BACKEND_PAGE_CHARGE_H_

#include <cstddef>
#include <cstdint>

#include "backend/slab_pool.h"

namespace tmem {

inline constexpr uint64_t kPageEntryBytes = 40;   // sizeof(PageEntry)
inline constexpr uint64_t kObjectNodeBytes = 48;  // sizeof(ObjectNode)

// Worst-case bytes per item of a hash-index slot of `slot_bytes` (plus its
// control byte) kept at least 3/8 full.
inline constexpr uint64_t IndexSlotWorstBytes(uint64_t slot_bytes) {
  return ((slot_bytes + 1) * 8 + 2) / 3;
}
// A page's own metadata: its entry and its page-index slot (a uint32_t).
inline constexpr uint64_t kPageEntryCharge =
    kPageEntryBytes + IndexSlotWorstBytes(sizeof(uint32_t));
// An object: its node and its object-index slot (a uint32_t).
inline constexpr uint64_t kObjectCharge =
    kObjectNodeBytes + IndexSlotWorstBytes(sizeof(uint32_t));
// A pool holding objects in a shard: its pool-head slot (uint64_t key,
// uint32_t head, padded to 16 bytes).
inline constexpr uint64_t kPoolInShardCharge = IndexSlotWorstBytes(16);

// Which shared costs a page pays (PageEntry::charges).
enum ChargeBit : uint8_t {
  kPaysObject = 1,       // its object's kObjectCharge
  kPaysPoolInShard = 2,  // its pool's kPoolInShardCharge in its shard
};
// The shared costs named by `bits`.
inline constexpr uint64_t SharedCharge(uint8_t bits) {
  return ((bits & kPaysObject) != 0 ? kObjectCharge : 0) +
         ((bits & kPaysPoolInShard) != 0 ? kPoolInShardCharge : 0);
}
// All metadata a page with these `bits` is charged.
inline constexpr uint64_t MetadataCharge(uint8_t bits) {
  return kPageEntryCharge + SharedCharge(bits);
}
// The most any one page's metadata is charged.
inline constexpr uint64_t kMaxPageMetadataCharge =
    MetadataCharge(kPaysObject | kPaysPoolInShard);

// A blob in a slot of `slot_bytes` (a multiple of 64, at most 4096): the slot
// and its share of the slab's unused tail.
inline constexpr uint64_t BlobCharge(uint64_t slot_bytes) {
  if (slot_bytes == 0) return 0;
  const uint64_t slots = kSlabBytes / slot_bytes;
  const uint64_t tail = kSlabBytes % slot_bytes;
  return slot_bytes + (tail + slots - 1) / slots;
}

}  // namespace tmem

#endif  // TMEMD_BACKEND_PAGE_CHARGE_H_
