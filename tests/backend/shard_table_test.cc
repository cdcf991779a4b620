// Tests for ShardTable (backend/shard_table.h): page lookup, per-VM LRU
// order, per-object and per-pool page lists, and the budget charging of
// entry chunks and tables.
#include "backend/shard_table.h"

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "backend/memory_budget.h"
#include "gtest/gtest.h"

namespace tmem {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kChunkBytes = 1024 * sizeof(PageEntry);

constexpr uint64_t kPoolA = 101;
constexpr uint64_t kPoolB = 202;

ObjectId Oid(uint64_t n) { return ObjectId::FromInode(n); }

std::set<uint32_t> AsSet(const std::vector<uint32_t>& v) {
  return {v.begin(), v.end()};
}

TEST(ShardTableTest, InsertFindRemove) {
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(1), 0), kNoEntry);
  EXPECT_EQ(table.FindObject(kPoolA, Oid(1)), kNoEntry);

  const uint32_t e = table.InsertPage(kPoolA, Oid(1), 7, /*vm_slot=*/3,
                                      StorageKind::kLz4, 0xabcdef);
  ASSERT_NE(e, kNoEntry);
  EXPECT_EQ(table.pages(), 1u);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(1), 7), e);
  const PageEntry& entry = table.entry(e);
  EXPECT_EQ(entry.index, 7u);
  EXPECT_EQ(entry.payload, 0xabcdefu);
  EXPECT_EQ(entry.vm_slot, 3);
  EXPECT_EQ(entry.kind, StorageKind::kLz4);
  const uint32_t obj = table.FindObject(kPoolA, Oid(1));
  ASSERT_NE(obj, kNoEntry);
  EXPECT_EQ(entry.object, obj);
  EXPECT_EQ(table.object(obj).pool_key, kPoolA);
  EXPECT_EQ(table.object(obj).oid, Oid(1));
  EXPECT_EQ(table.object(obj).pages, 1u);

  // Same object and index in another pool, another object, another index:
  // all distinct keys.
  EXPECT_EQ(table.FindPage(kPoolB, Oid(1), 7), kNoEntry);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(2), 7), kNoEntry);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(1), 8), kNoEntry);
  const uint32_t e2 =
      table.InsertPage(kPoolB, Oid(1), 7, 3, StorageKind::kRaw, 1);
  ASSERT_NE(e2, kNoEntry);
  EXPECT_NE(e2, e);
  EXPECT_EQ(table.FindPage(kPoolB, Oid(1), 7), e2);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(1), 7), e);

  const PageEntry removed = table.RemovePage(e).entry;
  EXPECT_EQ(removed.index, 7u);
  EXPECT_EQ(removed.payload, 0xabcdefu);
  EXPECT_EQ(removed.kind, StorageKind::kLz4);
  EXPECT_EQ(removed.vm_slot, 3);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(1), 7), kNoEntry);
  EXPECT_EQ(table.FindPage(kPoolB, Oid(1), 7), e2);
  EXPECT_EQ(table.pages(), 1u);
}

TEST(ShardTableTest, ObjectIdsDifferingInAnyWordAreDistinct) {
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  std::vector<uint32_t> entries;
  for (int word = 0; word < 6; ++word) {
    ObjectId oid;
    oid.words[word] = 1;
    const uint32_t e =
        table.InsertPage(kPoolA, oid, 0, 0, StorageKind::kZero, 0);
    ASSERT_NE(e, kNoEntry);
    entries.push_back(e);
  }
  for (int word = 0; word < 6; ++word) {
    ObjectId oid;
    oid.words[word] = 1;
    EXPECT_EQ(table.FindPage(kPoolA, oid, 0), entries[word]);
  }
  EXPECT_EQ(table.FindPage(kPoolA, ObjectId{}, 0), kNoEntry);
}

TEST(ShardTableTest, LruTailIsLeastRecentlyInsertedOrTouched) {
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  EXPECT_EQ(table.LruTail(0), kNoEntry);
  EXPECT_EQ(table.LruTail(1000), kNoEntry) << "a VM never seen has no pages";

  const uint32_t e1 =
      table.InsertPage(kPoolA, Oid(1), 1, 0, StorageKind::kRaw, 0);
  const uint32_t e2 =
      table.InsertPage(kPoolA, Oid(1), 2, 0, StorageKind::kRaw, 0);
  const uint32_t e3 =
      table.InsertPage(kPoolA, Oid(2), 3, 0, StorageKind::kRaw, 0);
  // VM 1's list is separate.
  const uint32_t f1 =
      table.InsertPage(kPoolB, Oid(1), 1, 1, StorageKind::kRaw, 0);
  EXPECT_EQ(table.LruTail(0), e1);
  EXPECT_EQ(table.LruTail(1), f1);

  table.Touch(e1);  // order, least recent first: e2 e3 e1
  EXPECT_EQ(table.LruTail(0), e2);
  table.Touch(e3);  // e2 e1 e3
  EXPECT_EQ(table.LruTail(0), e2);
  table.Touch(e3);  // touching the head changes nothing
  EXPECT_EQ(table.LruTail(0), e2);

  table.RemovePage(e2);  // e1 e3
  EXPECT_EQ(table.LruTail(0), e1);
  table.RemovePage(e1);
  EXPECT_EQ(table.LruTail(0), e3);
  table.RemovePage(e3);
  EXPECT_EQ(table.LruTail(0), kNoEntry);
  EXPECT_EQ(table.LruTail(1), f1) << "VM 1 is untouched by VM 0's removals";
}

TEST(ShardTableTest, DrainingByLruTailFollowsRecencyOrder) {
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  std::mt19937_64 rng(7);
  // Model: per VM, entries from least to most recently used.
  std::map<uint16_t, std::list<uint32_t>> recency;
  std::vector<uint32_t> all;
  for (int i = 0; i < 3000; ++i) {
    const auto vm = static_cast<uint16_t>(rng() % 4);
    const uint32_t e =
        table.InsertPage(kPoolA, Oid(rng() % 50), i, vm, StorageKind::kLz4, i);
    ASSERT_NE(e, kNoEntry);
    recency[vm].push_back(e);
    all.push_back(e);
  }
  for (int i = 0; i < 5000; ++i) {
    const uint32_t e = all[rng() % all.size()];
    table.Touch(e);
    std::list<uint32_t>& list = recency[table.entry(e).vm_slot];
    list.remove(e);
    list.push_back(e);
  }
  for (auto& [vm, list] : recency) {
    for (uint32_t expected : list) {
      ASSERT_EQ(table.LruTail(vm), expected) << "vm " << vm;
      table.RemovePage(expected);
    }
    EXPECT_EQ(table.LruTail(vm), kNoEntry);
  }
  EXPECT_EQ(table.pages(), 0u);
}

TEST(ShardTableTest, PagesOfObjectAndPool) {
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  std::set<uint32_t> obj1, obj2, pool_b;
  for (PageIndex i = 0; i < 10; ++i) {
    obj1.insert(table.InsertPage(kPoolA, Oid(1), i, 0, StorageKind::kZero, 0));
    obj2.insert(
        table.InsertPage(kPoolA, Oid(2), i * 3, 1, StorageKind::kZero, 0));
    pool_b.insert(
        table.InsertPage(kPoolB, Oid(1), i, 0, StorageKind::kZero, 0));
  }
  const uint32_t o1 = table.FindObject(kPoolA, Oid(1));
  const uint32_t o2 = table.FindObject(kPoolA, Oid(2));
  ASSERT_NE(o1, kNoEntry);
  ASSERT_NE(o2, kNoEntry);
  EXPECT_NE(o1, o2);
  EXPECT_EQ(AsSet(table.PagesOfObject(o1)), obj1);
  EXPECT_EQ(table.PagesOfObject(o1).size(), 10u) << "no duplicates";
  EXPECT_EQ(AsSet(table.PagesOfObject(o2)), obj2);
  std::set<uint32_t> pool_a = obj1;
  pool_a.insert(obj2.begin(), obj2.end());
  EXPECT_EQ(AsSet(table.PagesOfPool(kPoolA)), pool_a);
  EXPECT_EQ(table.PagesOfPool(kPoolA).size(), 20u);
  EXPECT_EQ(AsSet(table.PagesOfPool(kPoolB)), pool_b);
  EXPECT_TRUE(table.PagesOfPool(999).empty());

  // Removing pages, including the object's list head, keeps the lists right.
  for (PageIndex i = 0; i < 10; i += 2) {
    const uint32_t e = table.FindPage(kPoolA, Oid(1), i);
    obj1.erase(e);
    table.RemovePage(e);
  }
  EXPECT_EQ(AsSet(table.PagesOfObject(o1)), obj1);
  EXPECT_EQ(table.object(o1).pages, 5u);
  // Every listed page names its object.
  for (uint32_t e : table.PagesOfPool(kPoolA)) {
    const uint32_t object = table.entry(e).object;
    EXPECT_EQ(table.object(object).pool_key, kPoolA);
  }
}

TEST(ShardTableTest, RandomizedAgainstAModel) {
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  std::mt19937_64 rng(99);
  using Key = std::tuple<uint64_t, uint64_t, PageIndex>;  // pool, inode, index
  std::map<Key, uint64_t> model;                          // key -> payload
  for (int step = 0; step < 30000; ++step) {
    const Key key{1 + rng() % 3, rng() % 20, rng() % 40};
    const auto& [pool, ino, index] = key;
    const uint32_t found = table.FindPage(pool, Oid(ino), index);
    auto it = model.find(key);
    ASSERT_EQ(found != kNoEntry, it != model.end()) << "step " << step;
    if (found != kNoEntry) {
      ASSERT_EQ(table.entry(found).payload, it->second);
      ASSERT_EQ(table.entry(found).index, index);
      if (rng() % 2 == 0) {
        table.RemovePage(found);
        model.erase(it);
      } else {
        table.Touch(found);
      }
    } else {
      const uint64_t payload = rng();
      ASSERT_NE(table.InsertPage(pool, Oid(ino), index,
                                 static_cast<uint16_t>(rng() % 3),
                                 StorageKind::kLz4, payload),
                kNoEntry);
      model[key] = payload;
    }
    ASSERT_EQ(table.pages(), model.size());
    if (step % 1000 == 0) {
      // The per-pool object lists stay exact through removals anywhere.
      for (uint64_t pool = 1; pool <= 3; ++pool) {
        size_t expected = 0;
        for (const auto& [key, payload] : model)
          expected += std::get<0>(key) == pool;
        ASSERT_EQ(table.PagesOfPool(pool).size(), expected) << "step " << step;
      }
    }
  }
  for (uint64_t pool = 1; pool <= 3; ++pool) {
    size_t expected = 0;
    for (const auto& [key, payload] : model)
      expected += std::get<0>(key) == pool;
    EXPECT_EQ(table.PagesOfPool(pool).size(), expected);
  }
}

TEST(ShardTableTest, MetadataIsChargedAndReleasedOnDestruction) {
  MemoryBudget budget(kGiB);
  {
    ShardTable table(&budget);
    ASSERT_NE(table.InsertPage(kPoolA, Oid(1), 0, 0, StorageKind::kZero, 0),
              kNoEntry);
    // At least the entry is charged, before use.
    EXPECT_GE(budget.used(), sizeof(PageEntry));
    EXPECT_EQ(budget.used(), table.metadata_bytes());
    for (PageIndex i = 1; i < 5000; ++i) {
      ASSERT_NE(
          table.InsertPage(kPoolA, Oid(i % 100), i, 0, StorageKind::kZero, 0),
          kNoEntry);
      ASSERT_EQ(budget.used(), table.metadata_bytes()) << i;
    }
    // 5000 entries of 40 bytes plus an index slot each.
    EXPECT_GE(budget.used(), 5000 * (sizeof(PageEntry) + sizeof(uint32_t)));
    // A 40-byte entry plus about 5 bytes per index slot: well under 100
    // bytes per page at this size.
    EXPECT_LT(table.metadata_bytes(), 5000u * 100u);
  }
  EXPECT_EQ(budget.used(), 0u);
}

TEST(ShardTableTest, EmptyTableGivesBackWhatItGrew) {
  // tmem_store.h: "An empty shard returns its entry chunks and tables beyond
  // the first chunk."
  MemoryBudget budget(kGiB);
  ShardTable table(&budget);
  for (PageIndex i = 0; i < 20000; ++i) {
    ASSERT_NE(
        table.InsertPage(kPoolA, Oid(i % 500), i, static_cast<uint16_t>(i % 3),
                         StorageKind::kZero, 0),
        kNoEntry);
  }
  const uint64_t peak = table.metadata_bytes();
  EXPECT_GE(peak, 20000 * sizeof(PageEntry));
  for (PageIndex i = 0; i < 20000; ++i) {
    table.RemovePage(table.FindPage(kPoolA, Oid(i % 500), i));
  }
  EXPECT_EQ(table.pages(), 0u);
  EXPECT_EQ(budget.used(), table.metadata_bytes());
  // At most one chunk (at most 1024 entries) and small tables remain.
  EXPECT_LE(table.metadata_bytes(),
            size_t{1024} * sizeof(PageEntry) + size_t{8} * 1024)
      << "peak was " << peak;
  // And the table works as before.
  const uint32_t e =
      table.InsertPage(kPoolB, Oid(1), 1, 0, StorageKind::kRaw, 5);
  ASSERT_NE(e, kNoEntry);
  EXPECT_EQ(table.FindPage(kPoolB, Oid(1), 1), e);
  EXPECT_EQ(table.FindPage(kPoolA, Oid(0), 0), kNoEntry);
  EXPECT_EQ(table.LruTail(0), e);
  EXPECT_EQ(table.LruTail(1), kNoEntry);
}

TEST(ShardTableTest, InsertReturnsNoEntryWhenTheChunkDoesNotFit) {
  {
    // Not even one entry fits, whatever the chunk size.
    MemoryBudget budget(sizeof(PageEntry) - 1);
    ShardTable table(&budget);
    EXPECT_EQ(table.InsertPage(kPoolA, Oid(1), 0, 0, StorageKind::kZero, 0),
              kNoEntry);
    EXPECT_EQ(table.pages(), 0u);
    EXPECT_EQ(table.FindPage(kPoolA, Oid(1), 0), kNoEntry);
    EXPECT_LE(budget.used(), budget.cap());
  }
  // Room for a few chunks: fill until the table says no.
  MemoryBudget budget(2 * kChunkBytes - 1);
  {
    ShardTable table(&budget);
    uint64_t inserted = 0;
    uint32_t refused_at = kNoEntry;
    for (PageIndex i = 0; i < 5000; ++i) {
      const uint64_t used_before = budget.used();
      const uint32_t e =
          table.InsertPage(kPoolA, Oid(1), i, 0, StorageKind::kZero, 0);
      if (e == kNoEntry) {
        refused_at = static_cast<uint32_t>(i);
        EXPECT_EQ(budget.used(), used_before)
            << "a failed insert charges nothing";
        break;
      }
      ++inserted;
    }
    ASSERT_NE(refused_at, kNoEntry) << "the budget never ran out";
    EXPECT_GT(inserted, 0u);
    // Entry chunks are charged before use, so only table growth (charged
    // after the fact) can exceed the cap.
    EXPECT_LE(inserted * sizeof(PageEntry), budget.cap());
    EXPECT_EQ(table.pages(), inserted);
    EXPECT_EQ(table.FindPage(kPoolA, Oid(1), refused_at), kNoEntry);
    // The table still works, and a freed entry is reusable without a chunk.
    EXPECT_NE(table.FindPage(kPoolA, Oid(1), inserted - 1), kNoEntry);
    table.RemovePage(table.FindPage(kPoolA, Oid(1), 5));
    EXPECT_NE(table.InsertPage(kPoolA, Oid(2), 0, 0, StorageKind::kZero, 0),
              kNoEntry);
    EXPECT_EQ(table.pages(), inserted);
    // Once entries are freed, a refused key can be inserted too.
    table.RemovePage(table.FindPage(kPoolA, Oid(1), 6));
    EXPECT_NE(
        table.InsertPage(kPoolA, Oid(1), refused_at, 0, StorageKind::kZero, 0),
        kNoEntry);
  }
  EXPECT_EQ(budget.used(), 0u);
}

// Removals that leave the shard non-empty give whole chunks back once more
// than 1.25 chunks are free: live entries and small objects move down, and
// every remaining page is still found under its key with its payload, in
// its VM's LRU order and its object's page list.
TEST(ShardTableTest, CompactGivesChunksBackAndKeepsEveryPage) {
  MemoryBudget budget(uint64_t{1} << 30);
  ShardTable table(&budget);
  constexpr uint64_t kPool = 0x1000;
  constexpr int kPages = 20000;
  std::vector<uint32_t> ids;
  for (int i = 0; i < kPages; ++i) {
    // Half the pages one object each, half in objects of 8 pages.
    const uint64_t ino = i % 2 == 0 ? 1000000 + i : i / 16;
    const uint32_t e = table.InsertPage(
        kPool, ObjectId::FromInode(ino), i, static_cast<uint16_t>(i % 3),
        StorageKind::kZero, static_cast<uint64_t>(i));
    ASSERT_NE(e, kNoEntry);
    ids.push_back(e);
  }
  const uint64_t peak = table.metadata_bytes();
  std::map<uint32_t, uint32_t> moved;  // old number -> new
  // Keep one page in 10.
  for (int i = 0; i < kPages; ++i) {
    if (i % 10 != 0) table.RemovePage(ids[i]);
  }
  const uint64_t work =
      table.Compact([&](uint32_t from, uint32_t to) { moved[from] = to; });
  EXPECT_GT(work, 0u);
  EXPECT_GT(table.chunks_released(), 0u);
  EXPECT_LE(table.free_entries(), 256u + 64u);
  EXPECT_LE(table.free_objects(), 256u + 64u);
  EXPECT_LT(table.metadata_bytes(), peak / 2);
  EXPECT_EQ(budget.used(), table.metadata_bytes());
  for (int i = 0; i < kPages; i += 10) {
    const uint64_t ino = i % 2 == 0 ? 1000000 + i : i / 16;
    const uint32_t e = table.FindPage(kPool, ObjectId::FromInode(ino), i);
    ASSERT_NE(e, kNoEntry) << i;
    EXPECT_EQ(table.entry(e).payload, static_cast<uint64_t>(i));
    EXPECT_EQ(table.entry(e).vm_slot, i % 3);
    const auto it = moved.find(ids[i]);
    EXPECT_EQ(e, it == moved.end() ? ids[i] : it->second) << i;
  }
  // Each VM's LRU list still runs oldest to newest over its pages.
  for (uint16_t vm = 0; vm < 3; ++vm) {
    uint64_t last = 0;
    int count = 0;
    bool first = true;
    for (uint32_t e = table.LruTail(vm); e != kNoEntry;
         e = table.entry(e).lru_prev) {
      if (!first) {
        EXPECT_GT(table.entry(e).payload, last);
      }
      last = table.entry(e).payload;
      first = false;
      ++count;
    }
    int expected = 0;
    for (int i = 0; i < kPages; i += 10) expected += i % 3 == vm ? 1 : 0;
    EXPECT_EQ(count, expected) << "vm " << vm;
  }
  // The rest goes too, and the table is reusable.
  for (int i = 0; i < kPages; i += 10) {
    const uint64_t ino = i % 2 == 0 ? 1000000 + i : i / 16;
    table.RemovePage(table.FindPage(kPool, ObjectId::FromInode(ino), i));
  }
  EXPECT_EQ(table.pages(), 0u);
  EXPECT_NE(table.InsertPage(kPool, ObjectId::FromInode(1), 1, 0,
                             StorageKind::kZero, 0),
            kNoEntry);
}

// Pinned pages (a persistent pool's) are on their VM's pinned list, never
// on its LRU list, through touches, removals and compaction moving them.
TEST(ShardTableTest, PinnedPagesStayOffTheLruListThroughCompaction) {
  MemoryBudget budget(uint64_t{1} << 30);
  ShardTable table(&budget);
  constexpr uint64_t kPool = 0x2000;
  constexpr uint64_t kPinnedPool = 0x3000;
  constexpr int kPages = 6000;
  std::vector<uint32_t> ids;
  for (int i = 0; i < kPages; ++i) {
    const bool pinned = i % 3 == 0;
    const uint32_t e = table.InsertPage(
        pinned ? kPinnedPool : kPool, ObjectId::FromInode(i / 4), i,
        static_cast<uint16_t>(i % 2), StorageKind::kZero,
        static_cast<uint64_t>(i), pinned);
    ASSERT_NE(e, kNoEntry);
    EXPECT_EQ(table.entry(e).pinned, pinned ? 1 : 0);
    ids.push_back(e);
  }
  table.Touch(ids[0]);  // a pinned page: moves within its pinned list
  for (int i = 0; i < kPages; ++i) {
    if (i % 5 != 0) table.RemovePage(ids[i]);
  }
  EXPECT_GT(table.Compact([](uint32_t, uint32_t) {}), 0u);
  EXPECT_GT(table.chunks_released(), 0u);
  for (uint16_t vm = 0; vm < 2; ++vm) {
    int lru = 0;
    for (uint32_t e = table.LruTail(vm); e != kNoEntry;
         e = table.entry(e).lru_prev) {
      ASSERT_EQ(table.entry(e).pinned, 0) << "vm " << vm;
      ASSERT_EQ(table.entry(e).payload % 3 == 0, false);
      ++lru;
    }
    int pinned = 0;
    for (uint32_t e = table.PinnedTail(vm); e != kNoEntry;
         e = table.entry(e).lru_prev) {
      ASSERT_EQ(table.entry(e).pinned, 1) << "vm " << vm;
      ASSERT_EQ(table.entry(e).payload % 3, 0u);
      ++pinned;
    }
    int want_lru = 0;
    int want_pinned = 0;
    for (int i = 0; i < kPages; i += 5) {
      if (i % 2 != vm) continue;
      (i % 3 == 0 ? want_pinned : want_lru) += 1;
    }
    EXPECT_EQ(lru, want_lru) << "vm " << vm;
    EXPECT_EQ(pinned, want_pinned) << "vm " << vm;
  }
  int visited = 0;
  table.ForEachPage([&](uint32_t, const PageEntry&) { ++visited; });
  EXPECT_EQ(visited, kPages / 5);
  EXPECT_EQ(budget.used(), table.metadata_bytes());
}

}  // namespace
}  // namespace tmem
