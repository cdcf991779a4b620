#include "backend/shard_table.h"

#include <algorithm>
#include <bit>
#include <cassert>
#include <tuple>

#include "absl/hash/hash.h"

namespace tmem {

ShardTable::ShardTable(MemoryBudget* budget)
    : budget_(budget),
      page_index_(0, PageHash{this}, PageEq{this}),
      object_index_(0, ObjectHash{this}, ObjectEq{this}),
      chunk_list_charge_(budget),
      page_index_charge_(budget),
      object_index_charge_(budget),
      pool_heads_charge_(budget),
      object_chunk_list_charge_(budget),
      lru_charge_(budget),
      pinned_charge_(budget) {}

ShardTable::~ShardTable() {
  budget_->Release(chunks_.size() * kChunkEntries * sizeof(PageEntry) +
                   object_chunks_.size() * kChunkEntries * sizeof(ObjectNode));
}

// The hash indexes store only entry/node numbers; hashing and equality read
// the key fields through the table. This keeps each index slot at 4 bytes.
size_t ShardTable::PageHash::operator()(uint32_t e) const {
  const PageEntry& p = table->Slot(e);
  return (*this)(PageKey{p.object, p.index});
}
size_t ShardTable::PageHash::operator()(const PageKey& k) const {
  return absl::Hash<std::pair<uint32_t, uint64_t>>{}({k.object, k.index});
}
bool ShardTable::PageEq::operator()(uint32_t e, const PageKey& k) const {
  const PageEntry& p = table->Slot(e);
  return p.object == k.object && p.index == k.index;
}
size_t ShardTable::ObjectHash::operator()(uint32_t n) const {
  const ObjectNode& o = table->Obj(n);
  return (*this)(ObjectKey{o.pool_key, &o.oid});
}
size_t ShardTable::ObjectHash::operator()(const ObjectKey& k) const {
  return absl::Hash<std::pair<uint64_t, ObjectId>>{}({k.pool_key, *k.oid});
}
bool ShardTable::ObjectEq::operator()(uint32_t n, const ObjectKey& k) const {
  const ObjectNode& o = table->Obj(n);
  return o.pool_key == k.pool_key && o.oid == *k.oid;
}

uint32_t ShardTable::FindObject(uint64_t pool_key, const ObjectId& oid) const {
  auto it = object_index_.find(ObjectKey{pool_key, &oid});
  return it == object_index_.end() ? kNoEntry : *it;
}

uint32_t ShardTable::FindPage(uint64_t pool_key, const ObjectId& oid,
                              PageIndex index) const {
  const uint32_t object = FindObject(pool_key, oid);
  if (object == kNoEntry) return kNoEntry;
  auto it = page_index_.find(PageKey{object, index});
  return it == page_index_.end() ? kNoEntry : *it;
}

namespace {

// absl's flat_hash_set keeps one control byte per slot plus a group of
// cloned control bytes; slots are 4 bytes here.
uint64_t HashSetBytes(size_t capacity) {
  return capacity == 0 ? 0 : capacity * (sizeof(uint32_t) + 1) + 16;
}

// The pool-head map's slots are (uint64_t, uint32_t) pairs.
uint64_t PoolHeadsBytes(size_t capacity) {
  return capacity == 0
             ? 0
             : capacity * (sizeof(std::pair<uint64_t, uint32_t>) + 1) + 16;
}

// The capacity absl picks for reserve(n): n / (7/8) rounded up to 2^k - 1.
size_t CapacityForReserve(size_t n) {
  const size_t m = n + (n - 1) / 7;
  return m == 0 ? 1 : (~size_t{0} >> std::countl_zero(m));
}

}  // namespace

template <typename Set>
bool ShardTable::ReserveIndex(Set& set, ChargedCapacity& charge,
                              size_t needed) {
  // Keep the load at or under 3/4 ourselves, doubling the capacity exactly
  // (reserving one more than it holds), so the load after growth is 3/8.
  if (needed * 4 <= set.capacity() * 3) return true;
  const size_t target = std::max(needed, set.capacity() + 1);
  return charge.TryGrow(HashSetBytes(CapacityForReserve(target)),
                        [&] { set.reserve(target); });
}

namespace {

template <typename Map>
bool ReserveMap(Map& map, ChargedCapacity& charge, size_t needed) {
  if (needed * 4 <= map.capacity() * 3) return true;
  const size_t target = std::max(needed, map.capacity() + 1);
  return charge.TryGrow(PoolHeadsBytes(CapacityForReserve(target)),
                        [&] { map.reserve(target); });
}

}  // namespace

bool ShardTable::PrepareInsert(uint64_t pool_key, uint16_t vm_slot,
                               bool new_object, bool pinned) {
  if (free_entry_ == kNoEntry) {
    constexpr uint64_t kChunkBytes = kChunkEntries * sizeof(PageEntry);
    if (chunks_.size() >= (UINT32_MAX >> kChunkShift)) return false;
    if (chunks_.size() == chunks_.capacity()) {
      const size_t cap = std::max<size_t>(4, 2 * chunks_.capacity());
      if (!chunk_list_charge_.TryGrow(cap * sizeof(chunks_[0]),
                                      [&] { chunks_.reserve(cap); })) {
        return false;
      }
    }
    if (!budget_->TryCharge(kChunkBytes)) return false;
    // Not value-initialized: every entry is written before it is used.
    chunks_.emplace_back(new PageEntry[kChunkEntries]);
    const auto base =
        static_cast<uint32_t>((chunks_.size() - 1) << kChunkShift);
    // Thread the new entries onto the free list, lowest number first.
    for (uint32_t i = kChunkEntries; i-- > 0;) {
      Slot(base + i).lru_next = free_entry_;
      Slot(base + i).vm_slot = kFreeEntrySlot;
      free_entry_ = base + i;
    }
    free_entries_ += kChunkEntries;
  }
  if (!ReserveIndex(page_index_, page_index_charge_, pages_ + 1)) return false;
  if (new_object) {
    if (!ReserveIndex(object_index_, object_index_charge_,
                      object_index_.size() + 1)) {
      return false;
    }
    if (!pool_heads_.contains(pool_key) &&
        !ReserveMap(pool_heads_, pool_heads_charge_, pool_heads_.size() + 1)) {
      return false;
    }
    if (free_object_ == kNoEntry) {
      constexpr uint64_t kChunkBytes = kChunkEntries * sizeof(ObjectNode);
      if (object_chunks_.size() >= (UINT32_MAX >> kChunkShift)) return false;
      if (object_chunks_.size() == object_chunks_.capacity()) {
        const size_t cap = std::max<size_t>(4, 2 * object_chunks_.capacity());
        if (!object_chunk_list_charge_.TryGrow(
                cap * sizeof(object_chunks_[0]),
                [&] { object_chunks_.reserve(cap); })) {
          return false;
        }
      }
      if (!budget_->TryCharge(kChunkBytes)) return false;
      object_chunks_.emplace_back(new ObjectNode[kChunkEntries]);
      const auto base =
          static_cast<uint32_t>((object_chunks_.size() - 1) << kChunkShift);
      for (uint32_t i = kChunkEntries; i-- > 0;) {
        Obj(base + i).first_page = free_object_;
        free_object_ = base + i;
      }
      free_objects_ += kChunkEntries;
    }
  }
  if (vm_slot >= lru_.size()) {
    const size_t cap = std::max<size_t>(vm_slot + 1, 2 * lru_.size());
    if (!lru_charge_.TryGrow(cap * sizeof(LruList), [&] {
          lru_.reserve(cap);
          lru_.resize(vm_slot + 1);
        })) {
      return false;
    }
  }
  if (pinned && vm_slot >= pinned_.size()) {
    const size_t cap = std::max<size_t>(vm_slot + 1, 2 * pinned_.size());
    if (!pinned_charge_.TryGrow(cap * sizeof(LruList), [&] {
          pinned_.reserve(cap);
          pinned_.resize(vm_slot + 1);
        })) {
      return false;
    }
  }
  return true;
}

uint32_t ShardTable::AllocEntry() {
  const uint32_t id = free_entry_;
  free_entry_ = Slot(id).lru_next;
  --free_entries_;
  return id;
}

uint32_t ShardTable::AllocObject(uint64_t pool_key, const ObjectId& oid) {
  const uint32_t id = free_object_;
  ObjectNode& o = Obj(id);
  free_object_ = o.first_page;
  --free_objects_;
  o.pool_key = pool_key;
  o.oid = oid;
  o.first_page = kNoEntry;
  o.pages = 0;
  o.pool_prev = kNoEntry;
  // Push onto the front of the pool's list (the map slot was reserved).
  auto [head, is_first] = pool_heads_.try_emplace(pool_key, id);
  o.pool_next = is_first ? kNoEntry : head->second;
  if (!is_first) {
    Obj(head->second).pool_prev = id;
    head->second = id;
  }
  object_index_.insert(id);
  return id;
}

void ShardTable::LruUnlink(PageEntry& e, uint32_t id) {
  LruList& list = ListOf(e);
  if (e.lru_prev != kNoEntry) {
    Slot(e.lru_prev).lru_next = e.lru_next;
  } else {
    assert(list.head == id);
    list.head = e.lru_next;
  }
  if (e.lru_next != kNoEntry) {
    Slot(e.lru_next).lru_prev = e.lru_prev;
  } else {
    assert(list.tail == id);
    list.tail = e.lru_prev;
  }
  (void)id;
}

void ShardTable::LruPushHead(PageEntry& e, uint32_t id) {
  LruList& list = ListOf(e);
  e.lru_prev = kNoEntry;
  e.lru_next = list.head;
  if (list.head != kNoEntry) Slot(list.head).lru_prev = id;
  list.head = id;
  if (list.tail == kNoEntry) list.tail = id;
}

uint32_t ShardTable::InsertPage(uint64_t pool_key, const ObjectId& oid,
                                PageIndex index, uint16_t vm_slot,
                                StorageKind kind, uint64_t payload,
                                bool pinned) {
  uint32_t object = FindObject(pool_key, oid);
  if (!PrepareInsert(pool_key, vm_slot, object == kNoEntry, pinned)) {
    return kNoEntry;
  }
  const uint32_t id = AllocEntry();
  uint8_t charges = 0;
  if (object == kNoEntry) {
    charges = kPaysObject;
    if (!pool_heads_.contains(pool_key)) charges |= kPaysPoolInShard;
    object = AllocObject(pool_key, oid);
  }
  ObjectNode& o = Obj(object);

  PageEntry& e = Slot(id);
  e.index = index;
  e.payload = payload;
  e.object = object;
  e.vm_slot = vm_slot;
  e.kind = kind;
  e.charges = charges;
  e.pinned = pinned ? 1 : 0;
  e.obj_prev = kNoEntry;
  e.obj_next = o.first_page;
  if (o.first_page != kNoEntry) Slot(o.first_page).obj_prev = id;
  o.first_page = id;
  ++o.pages;

  LruPushHead(e, id);
  const bool inserted = page_index_.insert(id).second;
  assert(inserted && "InsertPage of an existing key");
  (void)inserted;
  ++pages_;
  return id;
}

RemovedPage ShardTable::RemovePage(uint32_t id) {
  PageEntry& e = Slot(id);
  RemovedPage out{e};
  page_index_.erase(id);
  LruUnlink(e, id);

  ObjectNode& o = Obj(e.object);
  if (e.obj_prev != kNoEntry) {
    Slot(e.obj_prev).obj_next = e.obj_next;
  } else {
    o.first_page = e.obj_next;
  }
  if (e.obj_next != kNoEntry) Slot(e.obj_next).obj_prev = e.obj_prev;
  if (--o.pages > 0) {
    // The object lives on: another of its pages pays what this one did.
    if (e.charges != 0) {
      out.heir = o.first_page;
      out.heir_gained = e.charges;
      Slot(out.heir).charges |= e.charges;
    }
  } else {
    // The last page paid for the object; the pool's presence here passes
    // to a page of the pool's next object, if it has one in this shard.
    object_index_.erase(e.object);
    uint32_t pool_heir_object = kNoEntry;
    if (o.pool_prev != kNoEntry) {
      Obj(o.pool_prev).pool_next = o.pool_next;
      pool_heir_object = o.pool_prev;
    } else if (o.pool_next != kNoEntry) {
      pool_heads_.find(o.pool_key)->second = o.pool_next;
    } else {
      pool_heads_.erase(o.pool_key);  // erasing never allocates
    }
    if (o.pool_next != kNoEntry) {
      Obj(o.pool_next).pool_prev = o.pool_prev;
      pool_heir_object = o.pool_next;
    }
    if ((e.charges & kPaysPoolInShard) && pool_heir_object != kNoEntry) {
      out.heir = Obj(pool_heir_object).first_page;
      out.heir_gained = kPaysPoolInShard;
      Slot(out.heir).charges |= kPaysPoolInShard;
    }
    o.pool_key = 0;
    o.first_page = free_object_;
    free_object_ = e.object;
    ++free_objects_;
  }

  e.lru_next = free_entry_;
  e.vm_slot = kFreeEntrySlot;
  free_entry_ = id;
  ++free_entries_;
  if (--pages_ == 0) ReleaseWhileEmpty();
  return out;
}

// An empty shard gives back what it grew for its peak, keeping one entry
// chunk (and absl's small tables) so a shard that flips between empty and a
// few pages does not churn the allocator.
void ShardTable::ReleaseWhileEmpty() {
  constexpr uint64_t kChunkBytes = kChunkEntries * sizeof(PageEntry);
  if (chunks_.size() > 1) {
    budget_->Release((chunks_.size() - 1) * kChunkBytes);
    chunks_.resize(1);
    chunks_.shrink_to_fit();
    chunk_list_charge_.Sync(chunks_.capacity() * sizeof(chunks_[0]));
    free_entry_ = kNoEntry;
    for (uint32_t i = kChunkEntries; i-- > 0;) {
      Slot(i).lru_next = free_entry_;
      Slot(i).vm_slot = kFreeEntrySlot;
      free_entry_ = i;
    }
  }
  free_entries_ = chunks_.size() * kChunkEntries;
  if (object_chunks_.size() > 1) {
    constexpr uint64_t kObjectChunkBytes = kChunkEntries * sizeof(ObjectNode);
    budget_->Release((object_chunks_.size() - 1) * kObjectChunkBytes);
    object_chunks_.resize(1);
    object_chunks_.shrink_to_fit();
    object_chunk_list_charge_.Sync(object_chunks_.capacity() *
                                   sizeof(object_chunks_[0]));
    free_object_ = kNoEntry;
    for (uint32_t i = kChunkEntries; i-- > 0;) {
      Obj(i).pool_key = 0;
      Obj(i).first_page = free_object_;
      free_object_ = i;
    }
  }
  free_objects_ = object_chunks_.size() * kChunkEntries;
  page_index_.clear();  // absl frees tables above 127 slots on clear()
  object_index_.clear();
  pool_heads_.clear();
  page_index_charge_.Sync(HashSetBytes(page_index_.capacity()));
  object_index_charge_.Sync(HashSetBytes(object_index_.capacity()));
  pool_heads_charge_.Sync(PoolHeadsBytes(pool_heads_.capacity()));
}

void ShardTable::MoveEntry(uint32_t from, uint32_t to) {
  // Out of the index while its number is still `from` (the hash reads the
  // entry's key fields, which do not change).
  page_index_.erase(from);
  const PageEntry e = Slot(from);
  Slot(to) = e;
  LruList& list = ListOf(e);
  if (e.lru_prev != kNoEntry) {
    Slot(e.lru_prev).lru_next = to;
  } else {
    list.head = to;
  }
  if (e.lru_next != kNoEntry) {
    Slot(e.lru_next).lru_prev = to;
  } else {
    list.tail = to;
  }
  if (e.obj_prev != kNoEntry) {
    Slot(e.obj_prev).obj_next = to;
  } else {
    Obj(e.object).first_page = to;
  }
  if (e.obj_next != kNoEntry) Slot(e.obj_next).obj_prev = to;
  page_index_.insert(to);
  Slot(from).vm_slot = kFreeEntrySlot;
}

void ShardTable::MoveObject(uint32_t from, uint32_t to) {
  object_index_.erase(from);
  const ObjectNode o = Obj(from);
  // The page index hashes (object number, index): each page is re-keyed.
  for (uint32_t p = o.first_page; p != kNoEntry; p = Slot(p).obj_next) {
    page_index_.erase(p);
    Slot(p).object = to;
    page_index_.insert(p);
  }
  Obj(to) = o;
  if (o.pool_prev != kNoEntry) {
    Obj(o.pool_prev).pool_next = to;
  } else {
    pool_heads_.find(o.pool_key)->second = to;
  }
  if (o.pool_next != kNoEntry) Obj(o.pool_next).pool_prev = to;
  object_index_.insert(to);
  Obj(from).pool_key = 0;
}

void ShardTable::ReleaseTopEntryChunks(
    size_t count, std::vector<std::pair<uint32_t, uint32_t>>& moves) {
  const auto keep = static_cast<uint32_t>(chunks_.size() - count);
  const uint32_t limit = keep << kChunkShift;
  // The free slots that stay, as a stack the moved entries take from.
  std::vector<uint32_t> below;
  below.reserve(free_entries_);
  for (uint32_t e = free_entry_; e != kNoEntry; e = Slot(e).lru_next) {
    if (e < limit) below.push_back(e);
  }
  for (uint32_t e = limit; e < (chunks_.size() << kChunkShift); ++e) {
    if (Slot(e).vm_slot == kFreeEntrySlot) continue;
    // More free entries than one chunk holds: a slot below always exists.
    assert(!below.empty());
    const uint32_t to = below.back();
    below.pop_back();
    MoveEntry(e, to);
    moves.emplace_back(e, to);
  }
  free_entry_ = kNoEntry;
  // Lowest free slot first on the list: the next puts fill the bottom.
  std::reverse(below.begin(), below.end());
  for (const uint32_t slot : below) {
    Slot(slot).lru_next = free_entry_;
    free_entry_ = slot;
  }
  free_entries_ = below.size();
  budget_->Release(count * kChunkEntries * sizeof(PageEntry));
  chunks_.resize(keep);
  chunks_released_ += count;
}

void ShardTable::ReleaseTopObjectChunks(size_t count, uint64_t& work) {
  // Only chunks whose objects are all small enough to move go.
  size_t can = 0;
  for (size_t c = object_chunks_.size(); can < count && c-- > 1;) {
    bool small = true;
    for (uint32_t i = 0; i < kChunkEntries && small; ++i) {
      const ObjectNode& o = object_chunks_[c][i];
      small = o.pool_key == 0 || o.pages <= kMaxMovedObjectPages;
    }
    if (!small) break;
    ++can;
  }
  work += can * kChunkEntries;
  if (can == 0) return;
  const auto keep = static_cast<uint32_t>(object_chunks_.size() - can);
  const uint32_t limit = keep << kChunkShift;
  std::vector<uint32_t> below;
  below.reserve(free_objects_);
  for (uint32_t n = free_object_; n != kNoEntry; n = Obj(n).first_page) {
    if (n < limit) below.push_back(n);
  }
  for (uint32_t n = limit; n < (object_chunks_.size() << kChunkShift); ++n) {
    if (Obj(n).pool_key == 0) continue;
    assert(!below.empty());
    const uint32_t to = below.back();
    below.pop_back();
    work += 1 + Obj(n).pages;
    MoveObject(n, to);
  }
  free_object_ = kNoEntry;
  std::reverse(below.begin(), below.end());
  for (const uint32_t node : below) {
    Obj(node).first_page = free_object_;
    free_object_ = node;
  }
  free_objects_ = below.size();
  budget_->Release(can * kChunkEntries * sizeof(ObjectNode));
  object_chunks_.resize(keep);
  chunks_released_ += can;
}

void ShardTable::Touch(uint32_t id) {
  PageEntry& e = Slot(id);
  if (ListOf(e).head == id) return;
  LruUnlink(e, id);
  LruPushHead(e, id);
}

uint32_t ShardTable::LruTail(uint16_t vm_slot) const {
  return vm_slot < lru_.size() ? lru_[vm_slot].tail : kNoEntry;
}

uint32_t ShardTable::PinnedTail(uint16_t vm_slot) const {
  return vm_slot < pinned_.size() ? pinned_[vm_slot].tail : kNoEntry;
}

std::vector<uint32_t> ShardTable::PagesOfObject(uint32_t object) const {
  std::vector<uint32_t> out;
  out.reserve(Obj(object).pages);
  for (uint32_t p = Obj(object).first_page; p != kNoEntry;
       p = Slot(p).obj_next) {
    out.push_back(p);
  }
  return out;
}

std::vector<uint32_t> ShardTable::PagesOfPool(uint64_t pool_key) const {
  std::vector<uint32_t> out;
  auto head = pool_heads_.find(pool_key);
  if (head == pool_heads_.end()) return out;
  for (uint32_t n = head->second; n != kNoEntry; n = Obj(n).pool_next) {
    ++objects_visited_;
    for (uint32_t p = Obj(n).first_page; p != kNoEntry; p = Slot(p).obj_next) {
      out.push_back(p);
    }
  }
  return out;
}

uint64_t ShardTable::metadata_bytes() const {
  return chunk_list_charge_.charged() + page_index_charge_.charged() +
         object_index_charge_.charged() + pool_heads_charge_.charged() +
         object_chunk_list_charge_.charged() + lru_charge_.charged() +
         pinned_charge_.charged() +
         chunks_.size() * kChunkEntries * sizeof(PageEntry) +
         object_chunks_.size() * kChunkEntries * sizeof(ObjectNode);
}

}  // namespace tmem
