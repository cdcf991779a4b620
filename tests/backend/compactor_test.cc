// Deferred compression: the compaction queue's bounds, the store's
// raw-to-compressed replacement against every way a pending page can go,
// and a randomized model test of the compactor's threads racing puts, gets,
// invalidates and evictions (run under TSan too: label "concurrency").
#include "backend/compactor.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "backend/compaction_queue.h"
#include "backend/page_codec.h"
#include "backend/thread_priority.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::Page;
using test::RandomPage;
using test::TextPage;

constexpr uint64_t kMiB = uint64_t{1} << 20;

CompactionTicket TicketFor(uint64_t stamp) {
  CompactionTicket t;
  t.stamp = stamp;
  t.index = stamp;
  return t;
}

TEST(CompactionQueueTest, BoundedOldestFirstAndCountsOverflow) {
  CompactionQueue queue(4);
  EXPECT_EQ(queue.capacity(), 4u);
  for (uint64_t i = 1; i <= 4; ++i) EXPECT_TRUE(queue.TryPush(TicketFor(i)));
  EXPECT_FALSE(queue.TryPush(TicketFor(5)));
  EXPECT_FALSE(queue.TryPush(TicketFor(6)));
  CompactionQueueStats s = queue.Stats();
  EXPECT_EQ(s.length, 4u);
  EXPECT_EQ(s.pushed, 4u);
  EXPECT_EQ(s.overflows, 2u);

  std::array<CompactionTicket, 3> out;
  ASSERT_EQ(queue.PopBatch(out), 3u);
  EXPECT_EQ(out[0].stamp, 1u);
  EXPECT_EQ(out[1].stamp, 2u);
  EXPECT_EQ(out[2].stamp, 3u);
  // Room again; order survives the wrap of the ring.
  EXPECT_TRUE(queue.TryPush(TicketFor(7)));
  EXPECT_TRUE(queue.TryPush(TicketFor(8)));
  ASSERT_EQ(queue.PopBatch(out), 3u);
  EXPECT_EQ(out[0].stamp, 4u);
  EXPECT_EQ(out[1].stamp, 7u);
  EXPECT_EQ(out[2].stamp, 8u);
  EXPECT_EQ(queue.PopBatch(out), 0u);
  EXPECT_EQ(queue.length(), 0u);
}

TEST(CompactionQueueTest, StampsAreUniqueAndNonZero) {
  CompactionQueue queue(1);
  std::vector<uint64_t> stamps;
  for (int i = 0; i < 1000; ++i) stamps.push_back(queue.NextStamp());
  std::sort(stamps.begin(), stamps.end());
  EXPECT_NE(stamps.front(), 0u);
  EXPECT_EQ(std::adjacent_find(stamps.begin(), stamps.end()), stamps.end());
}

class DeferredStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(64 * kMiB, 64); }

  void Make(uint64_t cap, size_t queue_pages) {
    store_.reset();
    queue_ = std::make_unique<CompactionQueue>(queue_pages);
    StoreOptions o;
    o.memory_cap_bytes = cap;
    o.address_space_bytes = 256 * kMiB;
    o.num_shards = 4;
    o.compaction_queue = queue_.get();
    auto s = TmemStore::Create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    auto vm = store_->AddVm("vm", VmPolicy{});
    ASSERT_TRUE(vm.ok());
    vm_ = *vm;
    auto pool = store_->NewPool(vm_, nullptr);
    ASSERT_TRUE(pool.ok());
    pool_ = *pool;
  }

  PutResult Put(uint64_t index, const Page& page,
                PutMode mode = PutMode::kDefer) {
    auto r = store_->Put(vm_, pool_, ObjectId::FromInode(1), index,
                         ConstPage(page), mode);
    EXPECT_TRUE(r.ok());
    return r.ok() ? *r : PutResult{};
  }

  std::optional<Page> Get(uint64_t index) {
    Page out{};
    auto r = store_->Get(vm_, pool_, ObjectId::FromInode(1), index,
                         MutablePage(out));
    EXPECT_TRUE(r.ok());
    if (!r.ok() || !*r) return std::nullopt;
    return out;
  }

  // Pops one ticket and runs the compactor's steps on it by hand.
  DeferredOutcome CompactOne(CompactionTicket* popped = nullptr) {
    std::array<CompactionTicket, 1> t;
    EXPECT_EQ(queue_->PopBatch(t), 1u);
    if (popped != nullptr) *popped = t[0];
    Page raw{};
    if (!store_->ReadDeferred(t[0], MutablePage(raw))) {
      return store_->CompleteDeferred(t[0], {});  // must say stale
    }
    std::array<uint8_t, kMaxCompressedPage> block{};
    const size_t n = CompressPage(ConstPage(raw), block);
    return store_->CompleteDeferred(t[0],
                                    std::span<const uint8_t>(block.data(), n));
  }

  uint64_t Charged() {
    return store_->GetVmStats(vm_)
        ->counters[static_cast<int>(Counter::kChargedBytes)];
  }
  uint64_t Skipped(CompactionSkip why) {
    return queue_->Stats().skipped[static_cast<int>(why)];
  }

  std::unique_ptr<CompactionQueue> queue_;
  std::unique_ptr<TmemStore> store_;
  VmId vm_ = 0;
  PoolId pool_ = 0;
};

TEST_F(DeferredStoreTest, StoresRawThenCompactsAndRechargesSmaller) {
  const Page page = TextPage(7);
  const PutResult r = Put(3, page);
  ASSERT_TRUE(r.stored);
  EXPECT_TRUE(r.deferred);
  EXPECT_EQ(r.kind, StorageKind::kRaw);
  EXPECT_EQ(queue_->Stats().length, 1u);
  const uint64_t raw_charge = Charged();
  const uint64_t raw_used = store_->GetHostStats().blob_slot_bytes;
  EXPECT_EQ(raw_used, kPageSize);

  EXPECT_EQ(CompactOne(), DeferredOutcome::kCompressed);
  EXPECT_LT(Charged(), raw_charge);
  EXPECT_LT(store_->GetHostStats().blob_slot_bytes, kPageSize);
  const auto back = Get(3);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, page);
  EXPECT_EQ(Charged(), 0u);  // the get took it: nothing left charged
}

TEST_F(DeferredStoreTest, SameFilledAndIncompressiblePages) {
  // Same-filled pages are metadata only: nothing to defer.
  EXPECT_FALSE(Put(1, test::FilledWith(0x55)).deferred);
  // Incompressible: queued, then kept raw.
  const Page noise = RandomPage(9);
  EXPECT_TRUE(Put(2, noise).deferred);
  std::array<CompactionTicket, 1> t;
  ASSERT_EQ(queue_->PopBatch(t), 1u);
  Page raw{};
  ASSERT_TRUE(store_->ReadDeferred(t[0], MutablePage(raw)));
  EXPECT_EQ(raw, noise);
  EXPECT_EQ(store_->CompleteDeferred(t[0], {}), DeferredOutcome::kKeptRaw);
  // No longer pending: the ticket is spent.
  EXPECT_FALSE(store_->ReadDeferred(t[0], MutablePage(raw)));
  EXPECT_EQ(*Get(2), noise);
}

TEST_F(DeferredStoreTest, WithoutQueueDeferCompressesInThePut) {
  StoreOptions o;
  o.memory_cap_bytes = 16 * kMiB;
  o.address_space_bytes = 64 * kMiB;
  o.num_shards = 1;
  auto s = TmemStore::Create(o);
  ASSERT_TRUE(s.ok());
  const VmId vm = *(*s)->AddVm("a", VmPolicy{});
  const PoolId pool = *(*s)->NewPool(vm, nullptr);
  const Page page = TextPage(1);
  auto r = (*s)->Put(vm, pool, ObjectId::FromInode(1), 0, ConstPage(page),
                     PutMode::kDefer);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->deferred);
  EXPECT_EQ(r->kind, StorageKind::kLz4);
}

TEST_F(DeferredStoreTest, PageGoneBeforeItsTurnIsSkippedAndCounted) {
  // Read (a private get takes it).
  ASSERT_TRUE(Put(1, TextPage(1)).deferred);
  ASSERT_TRUE(Get(1).has_value());
  EXPECT_EQ(Skipped(CompactionSkip::kRead), 1u);
  EXPECT_EQ(CompactOne(), DeferredOutcome::kStale);

  // Invalidated.
  ASSERT_TRUE(Put(2, TextPage(2)).deferred);
  ASSERT_TRUE(
      store_->InvalidatePage(vm_, pool_, ObjectId::FromInode(1), 2).ok());
  EXPECT_EQ(Skipped(CompactionSkip::kInvalidated), 1u);
  EXPECT_EQ(CompactOne(), DeferredOutcome::kStale);

  // Re-put: the first ticket is stale, the second compresses the new bytes.
  ASSERT_TRUE(Put(3, TextPage(30)).deferred);
  const Page newer = TextPage(31);
  ASSERT_TRUE(Put(3, newer).deferred);
  EXPECT_EQ(Skipped(CompactionSkip::kReplaced), 1u);
  EXPECT_EQ(CompactOne(), DeferredOutcome::kStale);
  EXPECT_EQ(CompactOne(), DeferredOutcome::kCompressed);
  EXPECT_EQ(*Get(3), newer);

  // Re-put synchronously after the copy was taken, before the swap: the
  // swap must not put the older bytes back.
  ASSERT_TRUE(Put(4, TextPage(40)).deferred);
  std::array<CompactionTicket, 1> t;
  ASSERT_EQ(queue_->PopBatch(t), 1u);
  Page raw{};
  ASSERT_TRUE(store_->ReadDeferred(t[0], MutablePage(raw)));
  std::array<uint8_t, kMaxCompressedPage> block{};
  const size_t n = CompressPage(ConstPage(raw), block);
  const Page latest = TextPage(41);
  ASSERT_FALSE(Put(4, latest, PutMode::kRaw).deferred);
  EXPECT_EQ(
      store_->CompleteDeferred(t[0], std::span<const uint8_t>(block.data(), n)),
      DeferredOutcome::kStale);
  EXPECT_EQ(*Get(4), latest);

  // Evicted: a cap lowered below what is held.
  ASSERT_TRUE(Put(5, TextPage(5)).deferred);
  ASSERT_TRUE(store_->SetMemoryCap(0).ok());
  EXPECT_EQ(Skipped(CompactionSkip::kEvicted), 1u);
  EXPECT_EQ(CompactOne(), DeferredOutcome::kStale);
  EXPECT_EQ(queue_->Stats().length, 0u);
}

TEST_F(DeferredStoreTest, FullQueueLeavesThePageRaw) {
  Make(64 * kMiB, 2);
  EXPECT_TRUE(Put(1, TextPage(1)).deferred);
  EXPECT_TRUE(Put(2, TextPage(2)).deferred);
  const PutResult third = Put(3, TextPage(3));
  EXPECT_TRUE(third.stored);
  EXPECT_FALSE(third.deferred);
  EXPECT_EQ(third.kind, StorageKind::kRaw);
  EXPECT_EQ(queue_->Stats().overflows, 1u);
  EXPECT_EQ(*Get(3), TextPage(3));
}

// The compactor's threads, idle or not, make every queued page compressed.
TEST_F(DeferredStoreTest, CompactorDrainsTheQueue) {
  Make(64 * kMiB, 1024);
  for (uint64_t i = 0; i < 500; ++i) ASSERT_TRUE(Put(i, TextPage(i)).deferred);
  Compactor compactor(store_.get(), queue_.get(), CompactorOptions{});
  ASSERT_TRUE(compactor.Start().ok());
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::seconds(120);  // generous: loaded hosts
  while (compactor.Stats().compressed < 500 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  compactor.Stop();
  const CompactorStats s = compactor.Stats();
  EXPECT_EQ(s.compressed, 500u);
  uint64_t in_histogram = 0;
  for (uint64_t b : s.latency) in_histogram += b;
  EXPECT_EQ(in_histogram, 500u);
  EXPECT_EQ(s.queue.length, 0u);
  EXPECT_GT(s.idle_cpu_ns + s.normal_cpu_ns, 0u);
  for (uint64_t i = 0; i < 500; ++i) EXPECT_EQ(*Get(i), TextPage(i));
}

// Pages of a VM that shows no reuse (a streamer the valve throttled) are
// left raw unread; another VM's are compressed. Both read back exactly.
TEST_F(DeferredStoreTest, PagesOfAVmShowingNoReuseAreLeftRawUnread) {
  Make(64 * kMiB, 1024);
  auto other = store_->AddVm("reader", VmPolicy{});
  ASSERT_TRUE(other.ok());
  auto other_pool = store_->NewPool(*other, nullptr);
  ASSERT_TRUE(other_pool.ok());
  for (uint64_t i = 0; i < 100; ++i) {
    ASSERT_TRUE(Put(i, TextPage(i)).deferred);
    auto r = store_->Put(*other, *other_pool, ObjectId::FromInode(1), i,
                         ConstPage(TextPage(1000 + i)), PutMode::kDefer);
    ASSERT_TRUE(r.ok() && r->deferred);
  }
  const uint64_t raw_charge = Charged();
  CompactorOptions o;
  const VmId streamer = vm_;
  o.expects_no_reuse = [streamer](VmId vm) { return vm == streamer; };
  Compactor compactor(store_.get(), queue_.get(), o);
  ASSERT_TRUE(compactor.Start().ok());
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::seconds(120);  // generous: loaded hosts
  while (compactor.Stats().queue.length > 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  compactor.Stop();
  const CompactorStats s = compactor.Stats();
  EXPECT_EQ(s.skipped_no_reuse, 100u);
  EXPECT_EQ(s.compressed, 100u);
  EXPECT_EQ(s.stale, 0u);
  EXPECT_EQ(Charged(), raw_charge) << "left raw, charged raw";
  for (uint64_t i = 0; i < 100; ++i) {
    EXPECT_EQ(*Get(i), TextPage(i));
    Page out{};
    auto r = store_->Get(*other, *other_pool, ObjectId::FromInode(1), i,
                         MutablePage(out));
    ASSERT_TRUE(r.ok() && *r);
    EXPECT_EQ(out, TextPage(1000 + i));
  }
}

// Under memory pressure the compactor works at normal priority, charged to
// the VMs, except for pages deferred only to spare a neighbour
// (PutMode::kDeferIdle): those stay at SCHED_IDLE.
TEST_F(DeferredStoreTest, PagesDeferredForANeighbourStayIdleUnderPressure) {
  for (PutMode mode : {PutMode::kDeferIdle, PutMode::kDefer}) {
    SCOPED_TRACE(static_cast<int>(mode));
    Make(64 * kMiB, 1024);
    for (uint64_t i = 0; i < 64; ++i) {
      ASSERT_TRUE(Put(i, TextPage(i), mode).deferred);
    }
    CompactionTicket first;
    ASSERT_EQ(CompactOne(&first), DeferredOutcome::kCompressed);
    EXPECT_EQ(first.idle_only, mode == PutMode::kDeferIdle);
    std::atomic<uint64_t> charged_ns{0};
    CompactorOptions copt;
    copt.memory_tight = [] { return true; };
    copt.charge_cpu = [&](VmId, int64_t ns) { charged_ns += ns; };
    Compactor compactor(store_.get(), queue_.get(), copt);
    ASSERT_TRUE(compactor.Start().ok());
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (compactor.Stats().compressed < 63 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    compactor.Stop();
    const CompactorStats s = compactor.Stats();
    EXPECT_EQ(s.compressed, 63u);
    for (uint64_t i = 0; i < 64; ++i) EXPECT_EQ(*Get(i), TextPage(i));
    if (!s.idle_class_available) {
      // No SCHED_IDLE round trip here: everything runs in budget mode.
      EXPECT_GT(s.pressure_batches, 0u);
      continue;
    }
    if (mode == PutMode::kDeferIdle) {
      EXPECT_EQ(s.pressure_batches, 0u);
      EXPECT_GT(s.idle_only_batches, 0u);
      EXPECT_EQ(charged_ns.load(), 0u);
      EXPECT_GT(s.idle_cpu_ns, 0u);
    } else {
      EXPECT_GT(s.pressure_batches, 0u);
      EXPECT_EQ(s.idle_only_batches, 0u);
      EXPECT_GT(charged_ns.load(), 0u);
    }
  }
}

TEST(ThreadPriorityTest, IdleRoundTripOnThisThread) {
  std::thread t([] {
    absl::Status idle = SetCurrentThreadPriority(ThreadPriority::kIdle);
    if (!idle.ok()) {
      GTEST_SKIP() << "SCHED_IDLE refused here: " << idle;
    }
    EXPECT_EQ(CurrentThreadPriority(), ThreadPriority::kIdle);
    absl::Status back = SetCurrentThreadPriority(ThreadPriority::kNormal);
    // Leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE.
    if (back.ok()) {
      EXPECT_EQ(CurrentThreadPriority(), ThreadPriority::kNormal);
    } else {
      EXPECT_EQ(back.code(), absl::StatusCode::kPermissionDenied) << back;
    }
  });
  t.join();
}

// Randomized model test: worker threads own disjoint keys and keep an exact
// model of them (page present with these bytes, or absent), while the
// compactor's threads replace raw copies concurrently. With a cap nothing
// reaches, a present page must hit with exactly its bytes at every moment
// (no window where it is missing or stale). With a small cap, evictions
// race too: a hit must still be exact; a miss is allowed (ephemeral).
void RunModel(uint64_t cap, bool may_evict) {
  constexpr int kWorkers = 3;
  constexpr uint64_t kKeys = 64;
  constexpr int kOps = 6000;
  constexpr auto kTimeLimit = std::chrono::seconds(20);
  CompactionQueue queue(256);
  StoreOptions o;
  o.memory_cap_bytes = cap;
  o.address_space_bytes = 256 * kMiB;
  o.num_shards = 4;
  o.compaction_queue = &queue;
  auto created = TmemStore::Create(o);
  ASSERT_TRUE(created.ok());
  TmemStore& store = **created;
  const VmId vm = *store.AddVm("vm", VmPolicy{});
  const PoolId pool = *store.NewPool(vm, nullptr);

  CompactorOptions copt;
  copt.threads = 2;
  copt.batch_pages = 4;
  Compactor compactor(&store, &queue, copt);
  ASSERT_TRUE(compactor.Start().ok());

  std::atomic<uint64_t> wrong{0};
  std::atomic<uint64_t> missing{0};
  std::atomic<uint64_t> hits{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937_64 rng(1234 + w);
      std::map<uint64_t, uint64_t> model;  // index -> page seed
      uint64_t version = 0;
      const ObjectId oid = ObjectId::FromInode(100 + w);
      for (int op = 0; op < kOps; ++op) {
        if (std::chrono::steady_clock::now() - start > kTimeLimit) break;
        const uint64_t index = rng() % kKeys;
        const int what = static_cast<int>(rng() % 10);
        if (what < 5) {
          const uint64_t seed = (uint64_t{static_cast<uint32_t>(w)} << 40) |
                                (index << 20) | ++version;
          const Page page =
              (rng() % 8 == 0) ? RandomPage(seed) : TextPage(seed);
          auto r =
              store.Put(vm, pool, oid, index, ConstPage(page), PutMode::kDefer);
          if (!r.ok()) {
            wrong.fetch_add(1);
            continue;
          }
          if (r->stored) {
            model[index] = seed;
          } else {
            model.erase(index);
          }
        } else if (what < 8) {
          Page out{};
          auto r = store.Get(vm, pool, oid, index, MutablePage(out));
          if (!r.ok()) {
            wrong.fetch_add(1);
            continue;
          }
          auto it = model.find(index);
          if (*r) {
            hits.fetch_add(1);
            const uint64_t seed = it == model.end() ? 0 : it->second;
            const bool random_kind = out != TextPage(seed);
            if (it == model.end() || (random_kind && out != RandomPage(seed))) {
              wrong.fetch_add(1);
            }
          } else if (it != model.end() && !may_evict) {
            missing.fetch_add(1);
          }
          model.erase(index);  // private get: exclusive
        } else {
          if (!store.InvalidatePage(vm, pool, oid, index).ok()) {
            wrong.fetch_add(1);
          }
          model.erase(index);
        }
      }
      // Whatever is left must read back exactly (or be gone, if evictions
      // were possible).
      for (const auto& [index, seed] : model) {
        Page out{};
        auto r = store.Get(vm, pool, oid, index, MutablePage(out));
        if (!r.ok()) {
          wrong.fetch_add(1);
        } else if (*r) {
          if (out != TextPage(seed) && out != RandomPage(seed)) {
            wrong.fetch_add(1);
          }
        } else if (!may_evict) {
          missing.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  // Let the compactor finish what is queued, then stop it.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (queue.Stats().length > 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  compactor.Stop();

  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_EQ(missing.load(), 0u);
  EXPECT_GT(hits.load(), 0u);
  const CompactorStats s = compactor.Stats();
  // Every ticket ended one way or another.
  EXPECT_EQ(s.queue.length, 0u);
  EXPECT_EQ(s.compressed + s.kept_raw + s.stale + s.no_room, s.queue.pushed);
  EXPECT_GT(s.queue.pushed, 0u);
  // Not s.compressed > 0: the workers read or invalidate every page before
  // the end, and on a loaded machine (ASan, other processes) the idle-
  // priority compactor may reach none of them first -- seen in a full ASan
  // run. The swap itself is checked deterministically above.
  uint64_t skipped = 0;
  for (uint64_t v : s.queue.skipped) skipped += v;
  // A stale ticket's page left the store (counted by cause) first.
  EXPECT_GE(skipped, s.stale);
  // Whether a pending page itself was evicted depends on timing; that
  // evictions raced the compactor at all does not.
  const HostStats h = store.GetHostStats();
  if (may_evict) {
    EXPECT_GT(h.counters[static_cast<int>(Counter::kEvictionsHostCap)], 0u);
  }
  // Everything was read or invalidated: nothing is held or charged.
  EXPECT_EQ(h.counters[static_cast<int>(Counter::kPagesHeld)], 0u);
  EXPECT_EQ(h.counters[static_cast<int>(Counter::kChargedBytes)], 0u);
  EXPECT_EQ(h.counters[static_cast<int>(Counter::kStoredBytes)], 0u);
  EXPECT_EQ(h.blob_slot_bytes, 0u);
}

TEST(CompactorModelTest, ReplacementIsExactWithoutEviction) {
  RunModel(64 * kMiB, /*may_evict=*/false);
}

TEST(CompactorModelTest, ReplacementIsExactUnderEviction) {
  // Five 64 KiB slabs for 192 keys: evictions race the compactor.
  RunModel(uint64_t{320} * 1024, /*may_evict=*/true);
}

}  // namespace
}  // namespace tmem
