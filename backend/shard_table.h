// ShardTable: the metadata of one shard of the store.
//
// Holds, for the keys that hash to this shard: object nodes (pool, 24-byte
// object id), page entries (index, how stored, where), a hash index from
// (object, index) to entry, each object's page list (for invalidate-object),
// each pool's object list (so invalidate-pool and destroy-pool walk only that
// pool's objects, never other VMs'), and one LRU list per VM (for eviction
// and for forgetting a VM). A pinned page (one that must never be evicted:
// a persistent pool's) is kept off that LRU list, on its VM's pinned list,
// so whatever walks LRU tails for victims never meets it and never walks
// past it; ForgetVm walks both lists.
//
// Memory: a page entry is 40 bytes, an object node 48, and the hash indexes
// hold only a 32-bit number per slot (hashing and equality look through to
// the entry or node). Entries and object nodes live in chunks of 256; each
// index doubles when it passes 3/4 full, so while it grows it stays between
// 3/8 and 3/4 full and a slot costs at most 8/3 of its size per item. So a
// page costs at most kPageEntryCharge, an object kObjectCharge and a pool's
// presence in a shard kPoolInShardCharge (page_charge.h), plus per shard one
// partly used chunk of each kind. Each of those shared costs is paid by exactly
// one page (its `charges` bits): the object's by one of its pages, the pool's
// by one page of that pool in this shard; when the payer goes, an heir among
// the remaining pages takes the bit (RemovedPage). The store charges VMs by
// these bits, so what a VM is charged follows what its pages cost. Removals
// that leave a shard non-empty do not shrink its indexes: that slack is the
// shard's peak, not any VM's current pages.
//
// Every container grows only through PrepareInsert, which charges the
// MemoryBudget first, so metadata never takes the budget over its cap.
// absl's own growth never triggers: it needs a load above 25/32, and we
// reserve at 3/4.
//
// Not thread-safe: the owning shard's mutex covers every call.
#ifndef TMEMD_BACKEND_SHARD_TABLE_H_
#define TMEMD_BACKEND_SHARD_TABLE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "backend/charged_capacity.h"
#include "backend/memory_budget.h"
#include "backend/page_charge.h"
#include "backend/types.h"

namespace tmem {

inline constexpr uint32_t kNoEntry = UINT32_MAX;

struct PageEntry {
  uint64_t index;     // page index within the object
  uint64_t payload;   // packed BlobRef, or the fill word of a same-filled page
  uint32_t object;    // ObjectNode number
  uint32_t lru_prev;  // per-VM LRU list (prev = more recently used)
  uint32_t lru_next;  //   (also the free-list link of a free entry)
  uint32_t obj_prev;  // the object's page list
  uint32_t obj_next;
  uint16_t vm_slot;  // owner: the VM whose put stored the page
  StorageKind kind;
  uint8_t charges : 7;  // ChargeBit: shared costs this page pays for
  // On its VM's pinned list, not its LRU list: never an eviction victim.
  uint8_t pinned : 1;
};

struct ObjectNode {
  uint64_t pool_key = 0;  // the pool's global key (0: node is free)
  ObjectId oid;
  uint32_t first_page = kNoEntry;  // (free node: the next free node)
  uint32_t pages = 0;
  uint32_t pool_prev = kNoEntry;  // the pool's object list in this shard
  uint32_t pool_next = kNoEntry;
};

static_assert(sizeof(PageEntry) == kPageEntryBytes);
static_assert(sizeof(ObjectNode) == kObjectNodeBytes);
static_assert(sizeof(std::pair<uint64_t, uint32_t>) == 16);

// What RemovePage did: the removed entry, and the page (if any) that took
// over charge bits the removed one paid.
struct RemovedPage {
  PageEntry entry{};
  uint32_t heir = kNoEntry;
  uint8_t heir_gained = 0;  // ChargeBit bits the heir took over
};

class ShardTable {
 public:
  explicit ShardTable(MemoryBudget* budget);
  ~ShardTable();
  ShardTable(const ShardTable&) = delete;
  ShardTable& operator=(const ShardTable&) = delete;

  // Entry of (pool, oid, index), or kNoEntry.
  uint32_t FindPage(uint64_t pool_key, const ObjectId& oid,
                    PageIndex index) const;
  // Object node of (pool, oid), or kNoEntry.
  uint32_t FindObject(uint64_t pool_key, const ObjectId& oid) const;

  // Adds a page that must not exist yet, at the MRU end of its VM's list
  // (its pinned list if `pinned`). Its `charges` say which shared costs it
  // pays (a new object, a pool new to this shard). Returns kNoEntry if the
  // metadata it needs does not fit in the budget; then nothing changed.
  // Removing a page of this shard always makes room, except for a VM's
  // first pinned page here, whose list head may need budget bytes.
  uint32_t InsertPage(uint64_t pool_key, const ObjectId& oid, PageIndex index,
                      uint16_t vm_slot, StorageKind kind, uint64_t payload,
                      bool pinned = false);
  // Unlinks and frees an entry; returns a copy for the caller's bookkeeping
  // and the heir of its charge bits.
  RemovedPage RemovePage(uint32_t entry);
  // Moves an entry to the MRU end of its VM's list (LRU or pinned).
  void Touch(uint32_t entry);
  // Changes how a live entry's page is held (the compactor swapping a
  // compressed block in); key, owner, list positions and charges stay.
  void SetStorage(uint32_t entry, StorageKind kind, uint64_t payload) {
    Slot(entry).kind = kind;
    Slot(entry).payload = payload;
  }

  const PageEntry& entry(uint32_t id) const { return Slot(id); }
  // Whether `id` names a live entry now (an entry number kept across a
  // release of the shard lock may have been freed or moved since).
  bool IsLive(uint32_t id) const {
    return id < (chunks_.size() << kChunkShift) &&
           Slot(id).vm_slot != kFreeEntrySlot;
  }
  // Calls fn(entry number, entry) for every page, VM by VM, each VM's
  // from least to most recently used. O(pages in this shard).
  // Pinned pages come after all LRU pages.
  template <typename Fn>
  void ForEachPage(Fn&& fn) const {
    for (const std::vector<LruList>* lists : {&lru_, &pinned_}) {
      for (const LruList& list : *lists) {
        for (uint32_t e = list.tail; e != kNoEntry; e = Slot(e).lru_prev) {
          fn(e, Slot(e));
        }
      }
    }
  }
  const ObjectNode& object(uint32_t id) const { return Obj(id); }
  // Least recently used entry of a VM in this shard, or kNoEntry. Pinned
  // pages are never returned.
  uint32_t LruTail(uint16_t vm_slot) const;
  // Least recently used pinned entry of a VM in this shard, or kNoEntry.
  uint32_t PinnedTail(uint16_t vm_slot) const;

  // Entries of every object of `pool_key` (for invalidate-pool): O(that
  // pool's objects and pages in this shard), whatever else the shard holds.
  std::vector<uint32_t> PagesOfPool(uint64_t pool_key) const;
  // Entries of one object.
  std::vector<uint32_t> PagesOfObject(uint32_t object) const;

  // Gives back whole chunks of entries and object nodes that removals left
  // free: while more than kChunkEntries + kChunkEntries / 4 entries (or
  // nodes) are free, the live ones of the highest chunk move into free
  // slots below it and that chunk is freed and uncharged. So evicting pages
  // frees budget bytes a chunk at a time, not only when the whole shard
  // empties. Entry numbers change: call it only while no entry number is
  // held, and `on_move(from, to)` is told of every moved entry. An object
  // node moves only if its object holds at most kMaxMovedObjectPages pages
  // (each of its pages is re-indexed); a larger one keeps its chunk.
  // Returns the work done: entries and nodes moved plus pages re-indexed,
  // at most 2 * kChunkEntries * (1 + kMaxMovedObjectPages) per chunk freed.
  template <typename OnMove>
  uint64_t Compact(OnMove&& on_move);
  static constexpr uint32_t kMaxMovedObjectPages = 16;

  uint64_t pages() const { return pages_; }
  uint64_t free_entries() const { return free_entries_; }
  uint64_t free_objects() const { return free_objects_; }
  uint64_t chunks_released() const { return chunks_released_; }
  uint64_t metadata_bytes() const;
  // Object nodes PagesOfPool has looked at since construction: the work a
  // pool-wide operation did, which must follow that pool's own objects.
  uint64_t objects_visited() const { return objects_visited_; }

 private:
  static constexpr uint32_t kChunkShift = 8;
  static constexpr uint32_t kChunkEntries = 1u << kChunkShift;

  struct LruList {
    uint32_t head = kNoEntry;  // most recently used
    uint32_t tail = kNoEntry;  // least recently used
  };

  // Lookup keys for the transparent hash sets.
  struct PageKey {
    uint32_t object;
    PageIndex index;
  };
  struct ObjectKey {
    uint64_t pool_key;
    const ObjectId* oid;
  };
  struct PageHash {
    using is_transparent = void;
    const ShardTable* table;
    size_t operator()(uint32_t e) const;
    size_t operator()(const PageKey& k) const;
  };
  struct PageEq {
    using is_transparent = void;
    const ShardTable* table;
    bool operator()(uint32_t a, uint32_t b) const { return a == b; }
    bool operator()(uint32_t e, const PageKey& k) const;
    bool operator()(const PageKey& k, uint32_t e) const {
      return (*this)(e, k);
    }
  };
  struct ObjectHash {
    using is_transparent = void;
    const ShardTable* table;
    size_t operator()(uint32_t n) const;
    size_t operator()(const ObjectKey& k) const;
  };
  struct ObjectEq {
    using is_transparent = void;
    const ShardTable* table;
    bool operator()(uint32_t a, uint32_t b) const { return a == b; }
    bool operator()(uint32_t n, const ObjectKey& k) const;
    bool operator()(const ObjectKey& k, uint32_t n) const {
      return (*this)(n, k);
    }
  };

  PageEntry& Slot(uint32_t id) {
    return chunks_[id >> kChunkShift][id & (kChunkEntries - 1)];
  }
  const PageEntry& Slot(uint32_t id) const {
    return chunks_[id >> kChunkShift][id & (kChunkEntries - 1)];
  }
  ObjectNode& Obj(uint32_t id) {
    return object_chunks_[id >> kChunkShift][id & (kChunkEntries - 1)];
  }
  const ObjectNode& Obj(uint32_t id) const {
    return object_chunks_[id >> kChunkShift][id & (kChunkEntries - 1)];
  }
  uint32_t AllocEntry();
  uint32_t AllocObject(uint64_t pool_key, const ObjectId& oid);
  // The list `e` is on: its VM's LRU list, or its pinned list.
  LruList& ListOf(const PageEntry& e) {
    return e.pinned ? pinned_[e.vm_slot] : lru_[e.vm_slot];
  }
  void LruUnlink(PageEntry& e, uint32_t id);
  void LruPushHead(PageEntry& e, uint32_t id);
  bool PrepareInsert(uint64_t pool_key, uint16_t vm_slot, bool new_object,
                     bool pinned);
  template <typename Set>
  static bool ReserveIndex(Set& set, ChargedCapacity& charge, size_t needed);
  void ReleaseWhileEmpty();
  // Moves live entry `from` into free slot `to` and relinks it.
  void MoveEntry(uint32_t from, uint32_t to);
  void MoveObject(uint32_t from, uint32_t to);
  // Free entries / nodes are marked so a chunk's live ones can be told
  // apart without walking the free list.
  static constexpr uint16_t kFreeEntrySlot = UINT16_MAX;
  // Frees the top `count` entry chunks, moving their live entries below
  // (recorded in `moves`). One pass over the free list plus the chunks.
  void ReleaseTopEntryChunks(size_t count,
                             std::vector<std::pair<uint32_t, uint32_t>>& moves);
  // The same for object chunks; frees fewer (or none) where a live object
  // is too large to move. Adds its work to `work`.
  void ReleaseTopObjectChunks(size_t count, uint64_t& work);

  MemoryBudget* const budget_;
  std::vector<std::unique_ptr<PageEntry[]>> chunks_;
  uint32_t free_entry_ = kNoEntry;
  std::vector<std::unique_ptr<ObjectNode[]>> object_chunks_;
  uint32_t free_object_ = kNoEntry;
  std::vector<LruList> lru_;  // indexed by VM slot
  // Indexed by VM slot; grown only for VMs that put pinned pages here.
  std::vector<LruList> pinned_;
  absl::flat_hash_set<uint32_t, PageHash, PageEq> page_index_;
  absl::flat_hash_set<uint32_t, ObjectHash, ObjectEq> object_index_;
  // Pool key -> first object of that pool's list in this shard. Only pools
  // with objects here have an entry.
  absl::flat_hash_map<uint64_t, uint32_t> pool_heads_;
  uint64_t pages_ = 0;
  uint64_t free_entries_ = 0;
  uint64_t free_objects_ = 0;
  uint64_t chunks_released_ = 0;
  mutable uint64_t objects_visited_ = 0;
  ChargedCapacity chunk_list_charge_;  // chunks_ pointer array
  ChargedCapacity page_index_charge_;
  ChargedCapacity object_index_charge_;
  ChargedCapacity pool_heads_charge_;
  ChargedCapacity object_chunk_list_charge_;  // object_chunks_ pointer array
  ChargedCapacity lru_charge_;
  ChargedCapacity pinned_charge_;
};

template <typename OnMove>
uint64_t ShardTable::Compact(OnMove&& on_move) {
  constexpr uint64_t kSlack = kChunkEntries + kChunkEntries / 4;
  uint64_t work = 0;
  if (free_entries_ > kSlack && chunks_.size() > 1) {
    const size_t count = std::min<size_t>(
        chunks_.size() - 1,
        (free_entries_ - kSlack + kChunkEntries - 1) / kChunkEntries);
    std::vector<std::pair<uint32_t, uint32_t>> moves;
    ReleaseTopEntryChunks(count, moves);
    for (const auto& [from, to] : moves) on_move(from, to);
    work += moves.size();
  }
  if (free_objects_ > kSlack && object_chunks_.size() > 1) {
    const size_t count = std::min<size_t>(
        object_chunks_.size() - 1,
        (free_objects_ - kSlack + kChunkEntries - 1) / kChunkEntries);
    ReleaseTopObjectChunks(count, work);
  }
  return work;
}

}  // namespace tmem

#endif  // TMEMD_BACKEND_SHARD_TABLE_H_
