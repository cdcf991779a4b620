// Tests for RingConsumer (host-agent/channel/ring_consumer.h): a real
// TmemStore, a real SharedRegion (memfd), and a small in-test guest that
// speaks proto/tmem_abi.h with the ABI's memory ordering. Covers every op,
// every kind of bad entry, a full completion ring, corrupt indices, guest
// restarts, the flush barrier, a guest scribbling on the header, and a
// randomized coherency check against a reference model (single-threaded and
// with the guest on its own thread).
#include "host-agent/channel/ring_consumer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "backend/compaction_queue.h"
#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "backend/types.h"
#include "gtest/gtest.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/region_layout.h"
#include "host-agent/channel/shared_region.h"
#include "proto/tmem_abi.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::FilledWith;
using test::Page;
using test::RandomPage;
using test::TextPage;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kRegionBytes = 256 << 10;
constexpr uint32_t kRingEntries = 8;

// ---------------------------------------------------------------- pages

// A distinct page per version, through every storage kind the store has.
Page VersionPage(uint64_t version) {
  switch (version % 3) {
    case 0:
      return TextPage(version);
    case 1:
      return RandomPage(version);
    default:
      return FilledWith(version * 0x9E3779B97F4A7C15ull | 1);
  }
}

// ---------------------------------------------------------------- SQEs

tmem_sqe Sqe(uint8_t opcode, uint64_t tag) {
  tmem_sqe s{};
  s.opcode = opcode;
  s.tag = tag;
  return s;
}

tmem_sqe NewPoolSqe(uint64_t tag) { return Sqe(TMEM_OP_NEW_POOL, tag); }

tmem_sqe SharedPoolSqe(uint64_t tag, const PoolUuid& uuid) {
  tmem_sqe s = Sqe(TMEM_OP_NEW_POOL, tag);
  s.flags = TMEM_SQE_F_SHARED;
  std::memcpy(s.oid, uuid.bytes.data(), uuid.bytes.size());
  return s;
}

tmem_sqe PoolSqe(uint8_t opcode, uint32_t pool, uint64_t tag) {
  tmem_sqe s = Sqe(opcode, tag);
  s.pool = static_cast<uint16_t>(pool);
  return s;
}

tmem_sqe PageSqe(uint8_t opcode, uint32_t pool, uint64_t ino, uint64_t index,
                 uint32_t slot, uint64_t tag) {
  tmem_sqe s = PoolSqe(opcode, pool, tag);
  const ObjectId oid = ObjectId::FromInode(ino);
  std::memcpy(s.oid, oid.words.data(), sizeof(s.oid));
  s.index = index;
  s.slot = slot;
  return s;
}

// ---------------------------------------------------------------- guest

// The guest side of the ABI, as the kernel module does it: geometry read
// from the header once at attach, entries written before a release of
// sq_tail, completions read after an acquire of cq_tail and released with
// cq_head. Deliberately not thread-safe: one guest thread owns it.
class TestGuest {
 public:
  explicit TestGuest(SharedRegion* region) : region_(region) { Attach(); }

  void Attach() {
    tmem_shm_header* h = header();
    ASSERT_EQ(__atomic_load_n(&h->host_state, __ATOMIC_ACQUIRE),
              TMEM_HOST_STATE_READY);
    sq_offset_ = h->sq_offset;
    sq_entries_ = h->sq_entries;
    cq_offset_ = h->cq_offset;
    cq_entries_ = h->cq_entries;
    slots_offset_ = h->slots_offset;
    slot_count_ = h->slot_count;
    sq_tail_ = __atomic_load_n(&h->sq_tail.value, __ATOMIC_RELAXED);
    cq_head_ = __atomic_load_n(&h->cq_head.value, __ATOMIC_RELAXED);
  }

  tmem_shm_header* header() const { return region_->header(); }
  uint32_t sq_entries() const { return sq_entries_; }
  uint32_t slot_count() const { return slot_count_; }
  uint32_t sq_tail() const { return sq_tail_; }
  uint8_t* slot(uint32_t i) const {
    return region_->base() + slots_offset_ + uint64_t{i} * kPageSize;
  }

  uint32_t SqSpace() const {
    const uint32_t head =
        __atomic_load_n(&header()->sq_head.value, __ATOMIC_ACQUIRE);
    return sq_entries_ - (sq_tail_ - head);
  }

  // Writes the entry, then publishes it (release).
  void Post(const tmem_sqe& sqe) {
    std::memcpy(region_->base() + sq_offset_ +
                    size_t{sq_tail_ & (sq_entries_ - 1)} * sizeof(tmem_sqe),
                &sqe, sizeof(sqe));
    ++sq_tail_;
    __atomic_store_n(&header()->sq_tail.value, sq_tail_, __ATOMIC_RELEASE);
  }

  void PutIntoSlot(uint32_t i, const Page& page) {
    std::memcpy(slot(i), page.data(), kPageSize);
  }
  Page SlotPage(uint32_t i) const {
    Page page;
    std::memcpy(page.data(), slot(i), kPageSize);
    return page;
  }

  // Reaps up to `max` completions.
  std::vector<tmem_cqe> Reap(size_t max = SIZE_MAX) {
    std::vector<tmem_cqe> out;
    const uint32_t tail =
        __atomic_load_n(&header()->cq_tail.value, __ATOMIC_ACQUIRE);
    while (cq_head_ != tail && out.size() < max) {
      tmem_cqe cqe{};
      std::memcpy(&cqe,
                  region_->base() + cq_offset_ +
                      (cq_head_ & (cq_entries_ - 1)) * sizeof(tmem_cqe),
                  sizeof(cqe));
      out.push_back(cqe);
      ++cq_head_;
    }
    __atomic_store_n(&header()->cq_head.value, cq_head_, __ATOMIC_RELEASE);
    return out;
  }

  void SetGeneration(uint64_t gen) {
    __atomic_store_n(&header()->guest_generation, gen, __ATOMIC_RELEASE);
  }

  // The ABI's never-lost invalidate: OR the pool bits, then publish the
  // sequence (release).
  void RequestFlush(uint64_t pool_bits, uint64_t seq) {
    __atomic_fetch_or(&header()->flush_request, pool_bits, __ATOMIC_RELAXED);
    __atomic_store_n(&header()->flush_request_seq, seq, __ATOMIC_RELEASE);
  }
  uint64_t FlushDone() const {
    return __atomic_load_n(&header()->flush_done_seq, __ATOMIC_ACQUIRE);
  }

 private:
  SharedRegion* region_;
  uint32_t sq_offset_ = 0, sq_entries_ = 0, cq_offset_ = 0, cq_entries_ = 0;
  uint32_t slots_offset_ = 0, slot_count_ = 0;
  uint32_t sq_tail_ = 0, cq_head_ = 0;
};

// ---------------------------------------------------------------- fixture

StoreOptions SmallStore() {
  StoreOptions o;
  o.memory_cap_bytes = 64 * kMiB;
  o.address_space_bytes = 256 * kMiB;
  o.num_shards = 4;
  return o;
}

std::unique_ptr<SharedRegion> MakeRegion(const std::string& name,
                                         uint64_t bytes = kRegionBytes,
                                         uint32_t entries = kRingEntries) {
  absl::StatusOr<RegionLayout> layout = RegionLayout::ForSize(bytes, entries);
  EXPECT_TRUE(layout.ok()) << layout.status();
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(name, *layout, /*host_generation=*/100);
  EXPECT_TRUE(region.ok()) << region.status();
  return std::move(*region);
}

class FixedAdvisor : public PutAdvisor {
 public:
  PutMode Advise(uint32_t /*vm*/, uint64_t /*key_hash*/,
                 bool /*guest_applies_hint*/) override {
    return mode;
  }
  PutMode mode = PutMode::kCompress;
};

// One VM's channel: region, metrics, consumer and guest.
struct Channel {
  Channel(TmemStore* store, const std::string& name,
          PutAdvisor* advisor = nullptr)
      : region(MakeRegion(name)) {
    absl::StatusOr<VmId> id = store->AddVm(name, VmPolicy{});
    EXPECT_TRUE(id.ok()) << id.status();
    vm = *id;
    consumer = std::make_unique<RingConsumer>(region.get(), store, vm, &metrics,
                                              advisor);
    guest = std::make_unique<TestGuest>(region.get());
  }

  // Posts one entry, drains, and reaps its one completion.
  tmem_cqe Call(const tmem_sqe& sqe) {
    guest->Post(sqe);
    const RingConsumer::DrainResult r = consumer->Drain(64);
    EXPECT_EQ(r.consumed, 1u);
    EXPECT_FALSE(r.reset);
    std::vector<tmem_cqe> cqes = guest->Reap();
    EXPECT_EQ(cqes.size(), 1u);
    if (cqes.empty()) return tmem_cqe{0, 12345, 12345};
    EXPECT_EQ(cqes[0].tag, sqe.tag);
    return cqes[0];
  }

  uint32_t NewPool() {
    const tmem_cqe c = Call(NewPoolSqe(++tag));
    EXPECT_EQ(c.status, TMEM_OK);
    return c.result;
  }

  int32_t Put(uint32_t pool, uint64_t ino, uint64_t index, const Page& page,
              uint32_t slot = 0) {
    guest->PutIntoSlot(slot, page);
    return Call(PageSqe(TMEM_OP_PUT, pool, ino, index, slot, ++tag)).status;
  }

  // nullopt: miss (or an error, which the test then sees as a failure).
  std::optional<Page> Get(uint32_t pool, uint64_t ino, uint64_t index,
                          uint32_t slot = 1) {
    const tmem_cqe c =
        Call(PageSqe(TMEM_OP_GET, pool, ino, index, slot, ++tag));
    EXPECT_EQ(c.status, TMEM_OK);
    if (c.status != TMEM_OK || c.result == 0) return std::nullopt;
    EXPECT_EQ(c.result, 1u);
    return guest->SlotPage(slot);
  }

  int32_t Op(uint8_t opcode, uint32_t pool, uint64_t ino = 0,
             uint64_t index = 0) {
    return Call(PageSqe(opcode, pool, ino, index, 0, ++tag)).status;
  }

  uint64_t Count(ChannelCounter c) const { return metrics.Get(c); }

  std::unique_ptr<SharedRegion> region;
  ChannelMetrics metrics;
  VmId vm = 0;
  std::unique_ptr<RingConsumer> consumer;
  std::unique_ptr<TestGuest> guest;
  uint64_t tag = 1000;
};

class RingConsumerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TmemStore>> store =
        TmemStore::Create(SmallStore());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    ch_ = std::make_unique<Channel>(store_.get(), "vm1", &advisor_);
  }

  uint64_t PagesHeld(VmId vm) const {
    absl::StatusOr<VmStats> s = store_->GetVmStats(vm);
    EXPECT_TRUE(s.ok()) << s.status();
    return s->counters[static_cast<int>(Counter::kPagesHeld)];
  }
  // Pages held in one pool, read without a get (which would take them).
  uint64_t PoolPages(VmId vm, uint32_t pool) const {
    absl::StatusOr<VmStats> s = store_->GetVmStats(vm);
    EXPECT_TRUE(s.ok()) << s.status();
    for (const PoolStats& p : s->pools) {
      if (p.id == static_cast<PoolId>(pool)) {
        return p.counters[static_cast<int>(Counter::kPagesHeld)];
      }
    }
    ADD_FAILURE() << "no pool " << pool;
    return 0;
  }
  size_t PoolCount(VmId vm) const {
    absl::StatusOr<VmStats> s = store_->GetVmStats(vm);
    EXPECT_TRUE(s.ok()) << s.status();
    return s->pools.size();
  }

  FixedAdvisor advisor_;
  std::unique_ptr<TmemStore> store_;
  std::unique_ptr<Channel> ch_;
};

// ------------------------------------------------------------ round trips

TEST_F(RingConsumerTest, NopEchoesTagAndPublishesIndices) {
  const tmem_cqe c = ch_->Call(Sqe(TMEM_OP_NOP, 0xfeedface12345678ull));
  EXPECT_EQ(c.tag, 0xfeedface12345678ull);
  EXPECT_EQ(c.status, TMEM_OK);
  EXPECT_EQ(c.result, 0u);
  tmem_shm_header* h = ch_->region->header();
  EXPECT_EQ(__atomic_load_n(&h->sq_head.value, __ATOMIC_ACQUIRE), 1u);
  EXPECT_EQ(__atomic_load_n(&h->cq_tail.value, __ATOMIC_ACQUIRE), 1u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kSqeProcessed), 1u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kCqeWritten), 1u);
  EXPECT_EQ(ch_->consumer->Pending(), 0u);
}

TEST_F(RingConsumerTest, EmptyRingDrainsNothing) {
  const RingConsumer::DrainResult r = ch_->consumer->Drain(64);
  EXPECT_EQ(r.consumed, 0u);
  EXPECT_FALSE(r.more);
  EXPECT_FALSE(r.reset);
  EXPECT_FALSE(r.interrupt);
}

TEST_F(RingConsumerTest, NewPoolHandsOutIdsAndDestroyForgetsThem) {
  EXPECT_EQ(ch_->NewPool(), 0u);
  EXPECT_EQ(ch_->NewPool(), 1u);
  EXPECT_EQ(PoolCount(ch_->vm), 2u);
  EXPECT_EQ(ch_->Op(TMEM_OP_DESTROY_POOL, 0), TMEM_OK);
  EXPECT_EQ(PoolCount(ch_->vm), 1u);
  // The destroyed id is unknown now, on every op that names a pool.
  EXPECT_EQ(ch_->Put(0, 1, 1, TextPage(1)), TMEM_ERR_NOENT);
  EXPECT_EQ(ch_->Op(TMEM_OP_DESTROY_POOL, 0), TMEM_ERR_NOENT);
  EXPECT_EQ(ch_->Count(ChannelCounter::kSqeBadPool), 2u);
  // Ids are reused like cleancache's.
  EXPECT_EQ(ch_->NewPool(), 0u);
}

TEST_F(RingConsumerTest, PutsThenGetsReturnExactBytes) {
  const uint32_t pool = ch_->NewPool();
  const std::vector<Page> pages = {TextPage(1), RandomPage(2), FilledWith(0),
                                   FilledWith(0x0123456789abcdefull),
                                   TextPage(5)};
  for (size_t i = 0; i < pages.size(); ++i) {
    ASSERT_EQ(ch_->Put(pool, 7, i, pages[i], static_cast<uint32_t>(i)),
              TMEM_OK);
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    // Poison the slot first: a hit must write every byte.
    std::memset(ch_->guest->slot(20), 0xA5, kPageSize);
    std::optional<Page> got = ch_->Get(pool, 7, i, /*slot=*/20);
    ASSERT_TRUE(got.has_value()) << "index " << i;
    EXPECT_TRUE(*got == pages[i]) << "index " << i;
  }
  EXPECT_EQ(ch_->Count(ChannelCounter::kSqeStoreErrors), 0u);
}

// While other VMs wait on the worker (Drain's compress_later),
// a put the advisor would compress is stored raw with its compression
// queued for the compactor, counted, and reads back exactly; without it,
// or for a put the advisor stores raw anyway, nothing is queued.
TEST(RingConsumerCompressLaterTest, QueuesTheCompressionOnlyWhenAsked) {
  CompactionQueue queue(64);
  StoreOptions o = SmallStore();
  o.compaction_queue = &queue;
  absl::StatusOr<std::unique_ptr<TmemStore>> store = TmemStore::Create(o);
  ASSERT_TRUE(store.ok()) << store.status();
  FixedAdvisor advisor;
  Channel ch(store->get(), "vm1", &advisor);
  const uint32_t pool = ch.NewPool();
  auto put = [&](uint64_t index, bool later) {
    ch.guest->PutIntoSlot(0, TextPage(index));
    ch.guest->Post(PageSqe(TMEM_OP_PUT, pool, 5, index, 0, ++ch.tag));
    EXPECT_EQ(ch.consumer->Drain(64, later).consumed, 1u);
    const std::vector<tmem_cqe> cqes = ch.guest->Reap();
    ASSERT_EQ(cqes.size(), 1u);
    EXPECT_EQ(cqes[0].status, TMEM_OK);
  };
  put(1, false);
  EXPECT_EQ(queue.length(), 0u) << "compressed in the put";
  put(2, true);
  EXPECT_EQ(queue.length(), 1u) << "stored raw, compression queued";
  EXPECT_EQ(ch.Count(ChannelCounter::kPutsCompressionDeferred), 1u);
  std::array<CompactionTicket, 1> ticket;
  ASSERT_EQ(queue.PopBatch(ticket), 1u);
  EXPECT_TRUE(ticket[0].idle_only) << "idle priority even under pressure";
  advisor.mode = PutMode::kRaw;
  put(3, true);
  EXPECT_EQ(queue.length(), 0u) << "a raw put has nothing to defer";
  EXPECT_EQ(ch.Count(ChannelCounter::kPutsCompressionDeferred), 1u);
  for (uint64_t i = 1; i <= 3; ++i) {
    std::optional<Page> got = ch.Get(pool, 5, i);
    ASSERT_TRUE(got.has_value()) << i;
    EXPECT_TRUE(*got == TextPage(i)) << i;
  }
}

TEST_F(RingConsumerTest, PutReplacesEarlierPage) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(2)), TMEM_OK);
  std::optional<Page> got = ch_->Get(pool, 1, 1);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(*got == TextPage(2));
}

TEST_F(RingConsumerTest, PrivateGetIsExclusive) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 3, 9, TextPage(9)), TMEM_OK);
  EXPECT_TRUE(ch_->Get(pool, 3, 9).has_value());
  EXPECT_FALSE(ch_->Get(pool, 3, 9).has_value());
}

TEST_F(RingConsumerTest, MissReturnsZeroAndLeavesSlotAlone) {
  const uint32_t pool = ch_->NewPool();
  std::memset(ch_->guest->slot(4), 0x5A, kPageSize);
  const tmem_cqe c = ch_->Call(PageSqe(TMEM_OP_GET, pool, 1, 1, 4, 77));
  EXPECT_EQ(c.status, TMEM_OK);
  EXPECT_EQ(c.result, 0u);
  EXPECT_TRUE(ch_->guest->SlotPage(4) == FilledWith(0x5A5A5A5A5A5A5A5Aull));
}

// ------------------------------------------------------------ GET_BATCH

tmem_sqe BatchSqe(uint32_t pool, uint64_t ino, uint64_t index, uint32_t slot,
                  uint32_t count, uint64_t tag) {
  tmem_sqe s = PageSqe(TMEM_OP_GET_BATCH, pool, ino, index, slot, tag);
  s.count = static_cast<uint16_t>(count);
  return s;
}

TEST_F(RingConsumerTest, HostOffersGetBatch) {
  const tmem_shm_header* h = ch_->region->header();
  EXPECT_NE(h->features_host & TMEM_FEAT_GET_BATCH, 0u);
  EXPECT_EQ(h->version, 3u);
  EXPECT_EQ(h->host_peer_id, 0u);
}

TEST_F(RingConsumerTest, GetBatchReturnsHitBitmapExactBytesAndIsExclusive) {
  const uint32_t pool = ch_->NewPool();
  // Pages 0, 1, 3, 5 of object 7 (of every storage kind); page 2 belongs to
  // another object and must not be confused with object 7's.
  const std::vector<uint64_t> present = {0, 1, 3, 5};
  for (uint64_t i : present) {
    ASSERT_EQ(ch_->Put(pool, 7, i, VersionPage(i)), TMEM_OK);
  }
  ASSERT_EQ(ch_->Put(pool, 8, 2, VersionPage(99)), TMEM_OK);
  for (uint32_t k = 0; k < 6; ++k) {
    std::memset(ch_->guest->slot(10 + k), 0xA5, kPageSize);
  }
  const tmem_cqe c = ch_->Call(BatchSqe(pool, 7, 0, 10, 6, 55));
  ASSERT_EQ(c.status, TMEM_OK);
  EXPECT_EQ(c.result, 0b101011u);
  for (uint64_t i : present) {
    EXPECT_TRUE(ch_->guest->SlotPage(10 + static_cast<uint32_t>(i)) ==
                VersionPage(i))
        << "index " << i;
  }
  // Exclusive: object 7's pages are gone, object 8's page stays.
  EXPECT_EQ(PagesHeld(ch_->vm), 1u);
  EXPECT_EQ(ch_->Call(BatchSqe(pool, 7, 0, 10, 6, 56)).result, 0u);
  EXPECT_FALSE(ch_->Get(pool, 7, 3).has_value());
  EXPECT_TRUE(ch_->Get(pool, 8, 2).has_value());
  EXPECT_EQ(ch_->Count(ChannelCounter::kGetBatches), 2u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGetBatchPages), 12u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGetBatchHits), 4u);
  // The store counts every page of a batch as one get.
  absl::StatusOr<VmStats> s = store_->GetVmStats(ch_->vm);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->counters[static_cast<int>(Counter::kGetsHit)], 4u + 1u);
  EXPECT_EQ(s->counters[static_cast<int>(Counter::kGetsMiss)], 8u + 1u);
}

TEST_F(RingConsumerTest, GetBatchOfTheMaximumIntoTheLastSlots) {
  const uint32_t pool = ch_->NewPool();
  const uint32_t slots = ch_->region->layout().slot_count;
  ASSERT_GE(slots, TMEM_GET_BATCH_MAX);
  const uint64_t base = (uint64_t{1} << 40) - 3;  // runs over 2^40: no wrap
  for (uint32_t k = 0; k < TMEM_GET_BATCH_MAX; k += 2) {
    ASSERT_EQ(ch_->Put(pool, 3, base + k, TextPage(k)), TMEM_OK);
  }
  const uint32_t first_slot = slots - TMEM_GET_BATCH_MAX;
  const tmem_cqe c =
      ch_->Call(BatchSqe(pool, 3, base, first_slot, TMEM_GET_BATCH_MAX, 9));
  ASSERT_EQ(c.status, TMEM_OK);
  EXPECT_EQ(c.result, 0x55555555u);
  for (uint32_t k = 0; k < TMEM_GET_BATCH_MAX; k += 2) {
    EXPECT_TRUE(ch_->guest->SlotPage(first_slot + k) == TextPage(k)) << k;
  }
  EXPECT_EQ(PagesHeld(ch_->vm), 0u);
}

TEST_F(RingConsumerTest, GetBatchHonoursEarlierInvalidatesAndPuts) {
  const uint32_t pool = ch_->NewPool();
  for (uint64_t i = 0; i < 4; ++i) {
    ASSERT_EQ(ch_->Put(pool, 1, i, VersionPage(i)), TMEM_OK);
  }
  // In one drain, in ring order: drop page 1, replace page 2, then batch.
  ch_->guest->PutIntoSlot(0, VersionPage(100));
  ch_->guest->Post(PageSqe(TMEM_OP_INVAL_PAGE, pool, 1, 1, 0, 1));
  ch_->guest->Post(PageSqe(TMEM_OP_PUT, pool, 1, 2, 0, 2));
  ch_->guest->Post(BatchSqe(pool, 1, 0, 20, 4, 3));
  ch_->guest->Post(PageSqe(TMEM_OP_INVAL_OBJECT, pool, 1, 0, 0, 4));
  ch_->guest->Post(BatchSqe(pool, 1, 0, 24, 4, 5));
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 5u);
  const std::vector<tmem_cqe> cqes = ch_->guest->Reap();
  ASSERT_EQ(cqes.size(), 5u);
  EXPECT_EQ(cqes[2].status, TMEM_OK);
  EXPECT_EQ(cqes[2].result, 0b1101u);
  EXPECT_TRUE(ch_->guest->SlotPage(20) == VersionPage(0));
  EXPECT_TRUE(ch_->guest->SlotPage(22) == VersionPage(100));
  EXPECT_TRUE(ch_->guest->SlotPage(23) == VersionPage(3));
  EXPECT_EQ(cqes[4].result, 0u);
}

TEST_F(RingConsumerTest, GetBatchRefusesSharedPools) {
  PoolUuid uuid;
  uuid.bytes[0] = 0x42;
  store_->AuthorizeSharedPool(uuid, "vm1");
  const tmem_cqe p = ch_->Call(SharedPoolSqe(1, uuid));
  ASSERT_EQ(p.status, TMEM_OK);
  ASSERT_EQ(ch_->Put(p.result, 5, 0, TextPage(5)), TMEM_OK);
  const tmem_cqe c = ch_->Call(BatchSqe(p.result, 5, 0, 0, 2, 2));
  EXPECT_EQ(c.status, TMEM_ERR_INVAL);
  EXPECT_EQ(c.result, 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGetBatchSharedPool), 1u);
  // The shared page is still there, for a single (non-exclusive) get.
  EXPECT_TRUE(ch_->Get(p.result, 5, 0).has_value());
  // A private pool that reuses the id after the shared one is destroyed
  // batches again.
  EXPECT_EQ(ch_->Op(TMEM_OP_DESTROY_POOL, p.result), TMEM_OK);
  EXPECT_EQ(ch_->NewPool(), p.result);
  EXPECT_EQ(ch_->Call(BatchSqe(p.result, 5, 0, 0, 2, 3)).status, TMEM_OK);
}

TEST_F(RingConsumerTest, GetBatchTellsTheAdvisorOnlyOfRealGets) {
  class Recorder : public FixedAdvisor {
   public:
    void OnGet(uint32_t /*vm*/, uint64_t key_hash, bool hit) override {
      seen.emplace_back(key_hash, hit);
    }
    std::vector<std::pair<uint64_t, bool>> seen;
  } recorder;
  Channel ch(store_.get(), "vm-advised", &recorder);
  const uint32_t pool = ch.NewPool();
  ASSERT_EQ(ch.Put(pool, 4, 2, TextPage(2)), TMEM_OK);
  // Page 0 (asked) misses, 1 (prefetch) misses, 2 (prefetch) hits.
  ASSERT_EQ(ch.Call(BatchSqe(pool, 4, 0, 0, 3, 1)).result, 0b100u);
  const ObjectId oid = ObjectId::FromInode(4);
  ASSERT_EQ(recorder.seen.size(), 2u);
  EXPECT_EQ(recorder.seen[0], std::make_pair(KeyHash(oid, 0), false));
  EXPECT_EQ(recorder.seen[1], std::make_pair(KeyHash(oid, 2), true));
}

// Live migration copies the source host's region (header, rings) into the
// destination's memory: a generation this tmemd never wrote is foreign.
TEST_F(RingConsumerTest, ForeignHostGenerationResetsTheChannel) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  tmem_shm_header* h = ch_->region->header();
  const uint64_t ours = ch_->region->host_generation();
  __atomic_store_n(&h->host_generation, ours ^ 0x5a5a, __ATOMIC_RELEASE);
  ch_->guest->Post(Sqe(TMEM_OP_NOP, 1));
  const RingConsumer::DrainResult r = ch_->consumer->Drain(64);
  EXPECT_TRUE(r.reset);
  EXPECT_EQ(r.consumed, 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kRegionForeign), 1u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
  EXPECT_EQ(PagesHeld(ch_->vm), 0u);
  // A fresh generation of our own, neither the old one nor the foreign one.
  EXPECT_NE(ch_->region->host_generation(), ours);
  EXPECT_NE(ch_->region->host_generation(), ours ^ 0x5a5a);
  EXPECT_EQ(h->host_generation, ch_->region->host_generation());
  ch_->guest->Attach();
  EXPECT_EQ(ch_->NewPool(), pool);
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
}

TEST(SharedRegionGeneration, RandomNonzeroAndNeverThePrevious) {
  uint64_t previous = 0;
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t g = SharedRegion::NewHostGeneration(previous);
    EXPECT_NE(g, 0u);
    EXPECT_NE(g, previous);
    seen.insert(g);
    previous = g;
  }
  // 64 random bits: 1000 draws never collide (p ~ 2.7e-14).
  EXPECT_EQ(seen.size(), 1000u);
}

TEST_F(RingConsumerTest, InvalidatePageObjectAndPool) {
  const uint32_t pool = ch_->NewPool();
  for (uint64_t ino = 1; ino <= 2; ++ino) {
    for (uint64_t idx = 0; idx < 3; ++idx) {
      ASSERT_EQ(ch_->Put(pool, ino, idx, TextPage(ino * 10 + idx)), TMEM_OK);
    }
  }
  EXPECT_EQ(PagesHeld(ch_->vm), 6u);
  EXPECT_EQ(ch_->Op(TMEM_OP_INVAL_PAGE, pool, 1, 0), TMEM_OK);
  EXPECT_FALSE(ch_->Get(pool, 1, 0).has_value());
  EXPECT_EQ(PagesHeld(ch_->vm), 5u);
  EXPECT_EQ(ch_->Op(TMEM_OP_INVAL_OBJECT, pool, 1), TMEM_OK);
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
  EXPECT_FALSE(ch_->Get(pool, 1, 2).has_value());
  EXPECT_EQ(PagesHeld(ch_->vm), 3u);
  EXPECT_EQ(ch_->Op(TMEM_OP_INVAL_POOL, pool), TMEM_OK);
  EXPECT_EQ(PagesHeld(ch_->vm), 0u);
  EXPECT_FALSE(ch_->Get(pool, 2, 0).has_value());
  // The pool itself survives an invalidate.
  EXPECT_EQ(ch_->Put(pool, 2, 0, TextPage(1)), TMEM_OK);
}

TEST_F(RingConsumerTest, DestroyPoolDropsItsPages) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  EXPECT_EQ(ch_->Op(TMEM_OP_DESTROY_POOL, pool), TMEM_OK);
  EXPECT_EQ(PagesHeld(ch_->vm), 0u);
  EXPECT_EQ(ch_->NewPool(), pool);
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
}

TEST_F(RingConsumerTest, SharedPoolsNeedAuthorizationAndAreNotExclusive) {
  Channel other(store_.get(), "vm2");
  Channel stranger(store_.get(), "vm3");
  PoolUuid uuid;
  for (size_t i = 0; i < uuid.bytes.size(); ++i) uuid.bytes[i] = 0xC0 + i;
  store_->AuthorizeSharedPool(uuid, "vm1");
  store_->AuthorizeSharedPool(uuid, "vm2");

  const tmem_cqe a = ch_->Call(SharedPoolSqe(1, uuid));
  ASSERT_EQ(a.status, TMEM_OK);
  const tmem_cqe b = other.Call(SharedPoolSqe(2, uuid));
  ASSERT_EQ(b.status, TMEM_OK);
  ASSERT_EQ(ch_->Put(a.result, 42, 0, TextPage(42)), TMEM_OK);
  // Another VM reads it, more than once (shared hits are not exclusive).
  for (int i = 0; i < 2; ++i) {
    std::optional<Page> got = other.Get(b.result, 42, 0);
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(*got == TextPage(42));
  }

  const tmem_cqe denied = stranger.Call(SharedPoolSqe(3, uuid));
  EXPECT_EQ(denied.status, TMEM_ERR_PERM);
  EXPECT_EQ(stranger.Count(ChannelCounter::kSqeStoreErrors), 1u);
  // A different uuid is a different pool: nothing to see there.
  PoolUuid other_uuid = uuid;
  other_uuid.bytes[15] ^= 1;
  store_->AuthorizeSharedPool(other_uuid, "vm2");
  const tmem_cqe c = other.Call(SharedPoolSqe(4, other_uuid));
  ASSERT_EQ(c.status, TMEM_OK);
  EXPECT_FALSE(other.Get(c.result, 42, 0).has_value());
}

TEST_F(RingConsumerTest, AdvisorDropCompletesDroppedAndRemovesOldPage) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  advisor_.mode = PutMode::kDrop;
  EXPECT_EQ(ch_->Put(pool, 1, 1, TextPage(2)), TMEM_ERR_DROPPED);
  EXPECT_EQ(ch_->Count(ChannelCounter::kPutsDroppedByHost), 1u);
  // The guest's copy changed: the old bytes must not come back.
  advisor_.mode = PutMode::kCompress;
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
}

TEST_F(RingConsumerTest, AdvisorRawStoresVerbatim) {
  advisor_.mode = PutMode::kRaw;
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(3)), TMEM_OK);
  absl::StatusOr<VmStats> s = store_->GetVmStats(ch_->vm);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->counters[static_cast<int>(Counter::kPutsRaw)], 1u);
  std::optional<Page> got = ch_->Get(pool, 1, 1);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(*got == TextPage(3));
}

TEST_F(RingConsumerTest, QuotaRefusalCompletesDropped) {
  VmPolicy policy;
  policy.quota_bytes = 16;  // not even one page's metadata
  ASSERT_TRUE(store_->SetVmPolicy(ch_->vm, policy).ok());
  const uint32_t pool = ch_->NewPool();
  EXPECT_EQ(ch_->Put(pool, 1, 1, RandomPage(1)), TMEM_ERR_DROPPED);
  EXPECT_EQ(ch_->Count(ChannelCounter::kPutsDroppedByHost), 1u);
}

TEST_F(RingConsumerTest, IrqFlagRequestsInterrupt) {
  ch_->guest->Post(Sqe(TMEM_OP_NOP, 1));
  EXPECT_FALSE(ch_->consumer->Drain(64).interrupt);
  tmem_sqe irq = Sqe(TMEM_OP_NOP, 2);
  irq.flags = TMEM_SQE_F_IRQ;
  ch_->guest->Post(Sqe(TMEM_OP_NOP, 3));
  ch_->guest->Post(irq);
  EXPECT_TRUE(ch_->consumer->Drain(64).interrupt);
  // Even on an error completion: the guest may be waiting on it.
  tmem_sqe bad = Sqe(200, 4);
  bad.flags = TMEM_SQE_F_IRQ;
  ch_->guest->Post(bad);
  EXPECT_TRUE(ch_->consumer->Drain(64).interrupt);
  EXPECT_EQ(ch_->guest->Reap().size(), 4u);
}

// A guest blocked on an entry (a get, TMEM_SQE_F_IRQ) gets its interrupt
// before the puts queued behind it are done: the drain ends right after it.
TEST_F(RingConsumerTest, DrainStopsRightAfterAnEntryTheGuestWaitsOn) {
  ch_->guest->Post(Sqe(TMEM_OP_NOP, 1));
  tmem_sqe irq = Sqe(TMEM_OP_NOP, 2);
  irq.flags = TMEM_SQE_F_IRQ;
  ch_->guest->Post(irq);
  for (uint64_t t = 3; t <= 5; ++t) ch_->guest->Post(Sqe(TMEM_OP_NOP, t));
  RingConsumer::DrainResult r = ch_->consumer->Drain(64);
  EXPECT_EQ(r.consumed, 2u);
  EXPECT_TRUE(r.interrupt);
  EXPECT_TRUE(r.more);
  std::vector<tmem_cqe> cqes = ch_->guest->Reap();
  ASSERT_EQ(cqes.size(), 2u);
  EXPECT_EQ(cqes[1].tag, 2u);
  r = ch_->consumer->Drain(64);
  EXPECT_EQ(r.consumed, 3u);
  EXPECT_FALSE(r.interrupt);
  EXPECT_FALSE(r.more);
  // The last entry of the ring: nothing more after it.
  ch_->guest->Post(irq);
  r = ch_->consumer->Drain(64);
  EXPECT_EQ(r.consumed, 1u);
  EXPECT_FALSE(r.more);
}

TEST_F(RingConsumerTest, MaxEntriesBoundsADrain) {
  for (uint64_t t = 0; t < 5; ++t) ch_->guest->Post(Sqe(TMEM_OP_NOP, t));
  EXPECT_EQ(ch_->consumer->Pending(), 5u);
  RingConsumer::DrainResult r = ch_->consumer->Drain(2);
  EXPECT_EQ(r.consumed, 2u);
  EXPECT_TRUE(r.more);
  EXPECT_EQ(ch_->consumer->Pending(), 3u);
  r = ch_->consumer->Drain(64);
  EXPECT_EQ(r.consumed, 3u);
  EXPECT_FALSE(r.more);
  const std::vector<tmem_cqe> cqes = ch_->guest->Reap();
  ASSERT_EQ(cqes.size(), 5u);
  for (uint64_t t = 0; t < 5; ++t) EXPECT_EQ(cqes[t].tag, t);
}

// ------------------------------------------------------------ bad entries

struct BadEntryCase {
  std::string name;
  tmem_sqe sqe;
  int32_t status;
  ChannelCounter counter;
};

TEST_F(RingConsumerTest, BadEntriesGetErrorsAndCountersAndProcessingGoesOn) {
  const uint32_t pool = ch_->NewPool();  // 0
  const uint32_t last_slot = ch_->region->layout().slot_count - 1;
  std::vector<BadEntryCase> cases;
  auto add = [&](std::string name, tmem_sqe sqe, int32_t status,
                 ChannelCounter counter) {
    cases.push_back({std::move(name), sqe, status, counter});
  };
  add("opcode TMEM_OP_MAX", Sqe(TMEM_OP_MAX, 0), TMEM_ERR_INVAL,
      ChannelCounter::kSqeBadOpcode);
  add("opcode 255", Sqe(255, 0), TMEM_ERR_INVAL, ChannelCounter::kSqeBadOpcode);
  for (int bit = 2; bit < 8; ++bit) {
    tmem_sqe s = PageSqe(TMEM_OP_PUT, pool, 1, 1, 0, 0);
    s.flags = static_cast<uint8_t>(1u << bit);
    add("unknown flag bit " + std::to_string(bit), s, TMEM_ERR_INVAL,
        ChannelCounter::kSqeBadFlags);
  }
  {
    tmem_sqe s = PageSqe(TMEM_OP_PUT, pool, 1, 1, 0, 0);
    s.flags = TMEM_SQE_F_SHARED;  // meaningful on NEW_POOL only
    add("SHARED on a put", s, TMEM_ERR_INVAL, ChannelCounter::kSqeBadFlags);
  }
  for (size_t i : {size_t{0}, size_t{7}, size_t{13}}) {
    tmem_sqe s = PageSqe(TMEM_OP_GET, pool, 1, 1, 0, 0);
    s.reserved[i] = 1;
    add("reserved byte " + std::to_string(i), s, TMEM_ERR_INVAL,
        ChannelCounter::kSqeBadFlags);
  }
  add("pool never created", PageSqe(TMEM_OP_GET, 1, 1, 1, 0, 0), TMEM_ERR_NOENT,
      ChannelCounter::kSqeBadPool);
  add("pool TMEM_MAX_POOLS", PageSqe(TMEM_OP_PUT, TMEM_MAX_POOLS, 1, 1, 0, 0),
      TMEM_ERR_NOENT, ChannelCounter::kSqeBadPool);
  add("pool 0xffff", PoolSqe(TMEM_OP_INVAL_POOL, 0xffff, 0), TMEM_ERR_NOENT,
      ChannelCounter::kSqeBadPool);
  add("destroy unknown pool", PoolSqe(TMEM_OP_DESTROY_POOL, 9, 0),
      TMEM_ERR_NOENT, ChannelCounter::kSqeBadPool);
  add("inval object, unknown pool",
      PageSqe(TMEM_OP_INVAL_OBJECT, 5, 1, 0, 0, 0), TMEM_ERR_NOENT,
      ChannelCounter::kSqeBadPool);
  add("put slot == slot_count",
      PageSqe(TMEM_OP_PUT, pool, 1, 1, last_slot + 1, 0), TMEM_ERR_INVAL,
      ChannelCounter::kSqeBadSlot);
  add("get slot 0xffffffff", PageSqe(TMEM_OP_GET, pool, 1, 1, 0xffffffffu, 0),
      TMEM_ERR_INVAL, ChannelCounter::kSqeBadSlot);
  add("get slot 1<<20", PageSqe(TMEM_OP_GET, pool, 1, 1, 1u << 20, 0),
      TMEM_ERR_INVAL, ChannelCounter::kSqeBadSlot);

  auto batch = [&](uint32_t pool_id, uint64_t index, uint32_t slot,
                   uint32_t count) {
    tmem_sqe s = PageSqe(TMEM_OP_GET_BATCH, pool_id, 1, index, slot, 0);
    s.count = static_cast<uint16_t>(count);
    return s;
  };
  add(
      "count on a GET",
      [&] {
        tmem_sqe s = PageSqe(TMEM_OP_GET, pool, 1, 1, 0, 0);
        s.count = 1;
        return s;
      }(),
      TMEM_ERR_INVAL, ChannelCounter::kSqeBadFlags);
  add(
      "count on a PUT",
      [&] {
        tmem_sqe s = PageSqe(TMEM_OP_PUT, pool, 1, 1, 0, 0);
        s.count = 1;
        return s;
      }(),
      TMEM_ERR_INVAL, ChannelCounter::kSqeBadFlags);
  add("batch count 0", batch(pool, 0, 0, 0), TMEM_ERR_INVAL,
      ChannelCounter::kGetBatchBadCount);
  add("batch count MAX + 1", batch(pool, 0, 0, TMEM_GET_BATCH_MAX + 1),
      TMEM_ERR_INVAL, ChannelCounter::kGetBatchBadCount);
  add("batch count 0xffff", batch(pool, 0, 0, 0xffff), TMEM_ERR_INVAL,
      ChannelCounter::kGetBatchBadCount);
  add("batch indices wrap", batch(pool, UINT64_MAX, 0, 2), TMEM_ERR_INVAL,
      ChannelCounter::kGetBatchBadCount);
  add("batch past the last slot", batch(pool, 0, last_slot, 2), TMEM_ERR_INVAL,
      ChannelCounter::kGetBatchBadSlots);
  add("batch slot == slot_count", batch(pool, 0, last_slot + 1, 1),
      TMEM_ERR_INVAL, ChannelCounter::kGetBatchBadSlots);
  add("batch slot 0xffffffff", batch(pool, 0, 0xffffffffu, 32), TMEM_ERR_INVAL,
      ChannelCounter::kGetBatchBadSlots);
  add("batch unknown pool", batch(7, 0, 0, 4), TMEM_ERR_NOENT,
      ChannelCounter::kSqeBadPool);
  add(
      "batch with the SHARED flag",
      [&] {
        tmem_sqe s = batch(pool, 0, 0, 4);
        s.flags = TMEM_SQE_F_SHARED;
        return s;
      }(),
      TMEM_ERR_INVAL, ChannelCounter::kSqeBadFlags);

  const Page page = TextPage(77);
  for (const BadEntryCase& c : cases) {
    SCOPED_TRACE(c.name);
    const uint64_t before = ch_->Count(c.counter);
    tmem_sqe sqe = c.sqe;
    sqe.tag = ++ch_->tag;
    const tmem_cqe cqe = ch_->Call(sqe);
    EXPECT_EQ(cqe.status, c.status);
    EXPECT_EQ(cqe.result, 0u);
    EXPECT_EQ(ch_->Count(c.counter), before + 1);
    // The channel still works after it.
    ASSERT_EQ(ch_->Put(pool, 2, 3, page, last_slot), TMEM_OK);
    std::optional<Page> got = ch_->Get(pool, 2, 3);
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(*got == page);
  }
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kChannelResets), 0u);
}

TEST_F(RingConsumerTest, BadEntriesInsideABatchDoNotStopIt) {
  const uint32_t pool = ch_->NewPool();
  ch_->guest->PutIntoSlot(0, TextPage(1));
  ch_->guest->Post(Sqe(99, 1));
  ch_->guest->Post(PageSqe(TMEM_OP_PUT, pool, 1, 1, 0, 2));
  ch_->guest->Post(PageSqe(TMEM_OP_PUT, 33, 1, 1, 0, 3));
  ch_->guest->Post(PageSqe(TMEM_OP_GET, pool, 1, 1, 5, 4));
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 4u);
  const std::vector<tmem_cqe> cqes = ch_->guest->Reap();
  ASSERT_EQ(cqes.size(), 4u);
  EXPECT_EQ(cqes[0].status, TMEM_ERR_INVAL);
  EXPECT_EQ(cqes[1].status, TMEM_OK);
  EXPECT_EQ(cqes[2].status, TMEM_ERR_NOENT);
  EXPECT_EQ(cqes[3].status, TMEM_OK);
  EXPECT_EQ(cqes[3].result, 1u);
  EXPECT_TRUE(ch_->guest->SlotPage(5) == TextPage(1));
}

TEST_F(RingConsumerTest, PoolIdsBeyondTheWireLimitAreRefused) {
  for (uint32_t i = 0; i < TMEM_MAX_POOLS; ++i) ASSERT_EQ(ch_->NewPool(), i);
  const tmem_cqe c = ch_->Call(NewPoolSqe(5));
  EXPECT_EQ(c.status, TMEM_ERR_NOSPC);
  EXPECT_EQ(ch_->Count(ChannelCounter::kSqeBadPool), 1u);
  // The store's pool 64 was given back at once.
  EXPECT_EQ(PoolCount(ch_->vm), TMEM_MAX_POOLS);
  ch_->consumer->DropPools();
  EXPECT_EQ(PoolCount(ch_->vm), 0u);
}

// ------------------------------------------------------------ full rings

TEST_F(RingConsumerTest, FullCompletionRingStopsConsumingAndResumes) {
  const uint32_t pool = ch_->NewPool();
  const uint32_t n = ch_->guest->sq_entries();
  ASSERT_EQ(n, kRingEntries);
  const uint32_t head0 = ch_->guest->sq_tail();
  // A full batch of puts; the guest does not reap.
  for (uint32_t i = 0; i < n; ++i) {
    ch_->guest->PutIntoSlot(i, VersionPage(i));
    ch_->guest->Post(PageSqe(TMEM_OP_PUT, pool, 1, i, i, i));
  }
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, n);
  // The SQ is free again, but the CQ is full: gets wait in the SQ.
  for (uint32_t i = 0; i < n; ++i) {
    ch_->guest->Post(PageSqe(TMEM_OP_GET, pool, 1, i, n + i, n + i));
  }
  EXPECT_EQ(ch_->guest->SqSpace(), 0u);
  RingConsumer::DrainResult r = ch_->consumer->Drain(64);
  EXPECT_EQ(r.consumed, 0u);
  EXPECT_FALSE(r.more);  // only the guest can unblock it
  EXPECT_EQ(ch_->consumer->Pending(), n);
  EXPECT_EQ(
      __atomic_load_n(&ch_->guest->header()->sq_head.value, __ATOMIC_ACQUIRE),
      head0 + n);

  std::vector<tmem_cqe> seen = ch_->guest->Reap(3);
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 3u);
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 0u);
  for (const tmem_cqe& c : ch_->guest->Reap()) seen.push_back(c);
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, n - 3);
  for (const tmem_cqe& c : ch_->guest->Reap()) seen.push_back(c);

  // Nothing lost, nothing reordered, every get hit with its bytes.
  ASSERT_EQ(seen.size(), 2 * n);
  for (uint32_t i = 0; i < 2 * n; ++i) {
    EXPECT_EQ(seen[i].tag, i);
    EXPECT_EQ(seen[i].status, TMEM_OK);
    if (i >= n) {
      EXPECT_EQ(seen[i].result, 1u);
      EXPECT_TRUE(ch_->guest->SlotPage(i) == VersionPage(i - n)) << i;
    }
  }
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
}

TEST_F(RingConsumerTest, ManyLapsOfTheRings) {
  // Ring positions are index & (entries - 1) of free-running indices; run
  // both rings round many times with full batches.
  const uint32_t pool = ch_->NewPool();
  for (uint32_t lap = 0; lap < 40; ++lap) {
    for (uint32_t i = 0; i < kRingEntries; ++i) {
      ch_->guest->PutIntoSlot(i, VersionPage(lap * kRingEntries + i));
      ch_->guest->Post(PageSqe(TMEM_OP_PUT, pool, lap, i, i, i));
    }
    ASSERT_EQ(ch_->consumer->Drain(64).consumed, kRingEntries);
    const std::vector<tmem_cqe> cqes = ch_->guest->Reap();
    ASSERT_EQ(cqes.size(), kRingEntries);
    for (uint32_t i = 0; i < kRingEntries; ++i) {
      EXPECT_EQ(cqes[i].tag, i);
      EXPECT_EQ(cqes[i].status, TMEM_OK);
    }
  }
  for (uint32_t i = 0; i < kRingEntries; ++i) {
    std::optional<Page> got = ch_->Get(pool, 39, i);
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(*got == VersionPage(39 * kRingEntries + i));
  }
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
}

// ------------------------------------------------------------ corruption

enum class Scribble { kSqTailTooFar, kSqHead, kCqTail, kCqHeadAhead };

class CorruptIndexTest : public RingConsumerTest,
                         public ::testing::WithParamInterface<Scribble> {};

TEST_P(CorruptIndexTest, ResetsChannelAndDropsPools) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  ASSERT_EQ(PagesHeld(ch_->vm), 1u);
  tmem_shm_header* h = ch_->guest->header();
  const uint64_t gen_before = ch_->region->host_generation();
  const uint32_t resets_before = h->resets;

  switch (GetParam()) {
    case Scribble::kSqTailTooFar:
      __atomic_store_n(&h->sq_tail.value, ch_->guest->sq_tail() + 9,
                       __ATOMIC_RELEASE);
      break;
    case Scribble::kSqHead:  // a host-owned field
      __atomic_store_n(&h->sq_head.value, 0u, __ATOMIC_RELEASE);
      break;
    case Scribble::kCqTail:  // a host-owned field
      __atomic_store_n(&h->cq_tail.value, 77u, __ATOMIC_RELEASE);
      break;
    case Scribble::kCqHeadAhead:  // claims to have reaped unwritten CQEs
      __atomic_store_n(&h->cq_head.value, h->cq_tail.value + 1,
                       __ATOMIC_RELEASE);
      break;
  }
  const RingConsumer::DrainResult r = ch_->consumer->Drain(64);
  EXPECT_TRUE(r.reset);
  EXPECT_EQ(r.consumed, 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 1u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kChannelResets), 1u);
  EXPECT_NE(ch_->region->host_generation(), gen_before);
  EXPECT_EQ(h->host_generation, ch_->region->host_generation());
  EXPECT_EQ(h->resets, resets_before + 1);
  EXPECT_EQ(h->sq_tail.value, 0u);
  EXPECT_EQ(h->cq_tail.value, 0u);
  // The VM's pages went with its pools.
  EXPECT_EQ(PoolCount(ch_->vm), 0u);
  EXPECT_EQ(PagesHeld(ch_->vm), 0u);

  // The guest re-attaches and re-creates its pool (same id): no stale data.
  ch_->guest->Attach();
  EXPECT_EQ(ch_->NewPool(), pool);
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(2)), TMEM_OK);
  std::optional<Page> got = ch_->Get(pool, 1, 1);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(*got == TextPage(2));
  EXPECT_EQ(ch_->Count(ChannelCounter::kChannelResets), 1u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGuestRestarts), 0u);
}

INSTANTIATE_TEST_SUITE_P(AllScribbles, CorruptIndexTest,
                         ::testing::Values(Scribble::kSqTailTooFar,
                                           Scribble::kSqHead, Scribble::kCqTail,
                                           Scribble::kCqHeadAhead));

TEST_F(RingConsumerTest, ScribbledGeometryIsNeverUsed) {
  const RegionLayout& layout = ch_->region->layout();
  const uint32_t pool = ch_->NewPool();
  tmem_shm_header* h = ch_->guest->header();
  // A hostile guest rewrites every number it could hope tmemd trusts.
  __atomic_store_n(&h->slot_count, 0xffffffffu, __ATOMIC_RELAXED);
  __atomic_store_n(&h->sq_entries, 1u << 30, __ATOMIC_RELAXED);
  __atomic_store_n(&h->cq_entries, 1u << 30, __ATOMIC_RELAXED);
  __atomic_store_n(&h->sq_offset, 0xfffff000u, __ATOMIC_RELAXED);
  __atomic_store_n(&h->cq_offset, 0xfffff000u, __ATOMIC_RELAXED);
  __atomic_store_n(&h->slots_offset, 0xfffff000u, __ATOMIC_RELAXED);
  __atomic_store_n(&h->region_size, ~uint64_t{0}, __ATOMIC_RELAXED);

  // The last real slot works; one past it is refused, not read.
  const uint32_t last = layout.slot_count - 1;
  ASSERT_EQ(ch_->Put(pool, 1, 1, RandomPage(3), last), TMEM_OK);
  std::optional<Page> got = ch_->Get(pool, 1, 1, last);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(*got == RandomPage(3));
  const tmem_cqe c =
      ch_->Call(PageSqe(TMEM_OP_GET, pool, 1, 1, layout.slot_count, 9));
  EXPECT_EQ(c.status, TMEM_ERR_INVAL);
  EXPECT_EQ(ch_->Count(ChannelCounter::kSqeBadSlot), 1u);

  // A tail within the scribbled ring size but beyond the real one is
  // corrupt, not an invitation to read past the SQ.
  __atomic_store_n(&h->sq_tail.value, ch_->guest->sq_tail() + 1000,
                   __ATOMIC_RELEASE);
  EXPECT_TRUE(ch_->consumer->Drain(1 << 20).reset);
  // The reset rewrote the header from tmemd's layout.
  EXPECT_EQ(h->slot_count, layout.slot_count);
  EXPECT_EQ(h->sq_entries, layout.sq_entries);
  EXPECT_EQ(h->slots_offset, layout.slots_offset);
}

TEST_F(RingConsumerTest, ResetByTheRegionOwnerResyncs) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  ch_->region->Reset();  // e.g. the worker, on a new QEMU connection
  ch_->guest->Attach();
  ch_->guest->Post(Sqe(TMEM_OP_NOP, 1));
  EXPECT_EQ(ch_->consumer->Pending(), 1u);
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 1u);
  ch_->guest->Reap();
  // Not mistaken for a guest scribbling on the indices...
  EXPECT_EQ(ch_->NewPool(), pool);
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
  // ...and the old guest's pools did not survive it.
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
  EXPECT_EQ(PoolCount(ch_->vm), 1u);
}

TEST_F(RingConsumerTest, GuestGenerationChangeDropsPools) {
  ch_->guest->SetGeneration(5);
  const uint32_t pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_OK);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGuestRestarts), 0u);  // first: noted
  ch_->consumer->Drain(64);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGuestRestarts), 0u);  // unchanged

  const uint64_t host_gen = ch_->region->host_generation();
  ch_->guest->SetGeneration(6);  // the guest restarted
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kGuestRestarts), 1u);
  EXPECT_EQ(PoolCount(ch_->vm), 0u);
  EXPECT_EQ(PagesHeld(ch_->vm), 0u);
  // No region reset for that.
  EXPECT_EQ(ch_->region->host_generation(), host_gen);
  EXPECT_EQ(ch_->Count(ChannelCounter::kChannelResets), 0u);
  // The old id is gone; the new guest's pool starts empty.
  EXPECT_EQ(ch_->Op(TMEM_OP_GET, pool, 1, 1), TMEM_ERR_NOENT);
  EXPECT_EQ(ch_->NewPool(), pool);
  EXPECT_FALSE(ch_->Get(pool, 1, 1).has_value());
}

TEST_F(RingConsumerTest, GuestGenerationSeenWithItsEntries) {
  // A restarted guest writes its generation, then posts: the consumer must
  // drop the old pools before it runs the new guest's NEW_POOL.
  ch_->guest->SetGeneration(1);
  const uint32_t old_pool = ch_->NewPool();
  ASSERT_EQ(ch_->Put(old_pool, 1, 1, TextPage(1)), TMEM_OK);
  ch_->guest->SetGeneration(2);
  ch_->guest->Post(NewPoolSqe(1));
  ch_->guest->Post(PageSqe(TMEM_OP_GET, 0, 1, 1, 3, 2));
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 2u);
  const std::vector<tmem_cqe> cqes = ch_->guest->Reap();
  ASSERT_EQ(cqes.size(), 2u);
  EXPECT_EQ(cqes[0].status, TMEM_OK);
  EXPECT_EQ(cqes[0].result, 0u);
  EXPECT_EQ(cqes[1].status, TMEM_OK);
  EXPECT_EQ(cqes[1].result, 0u);  // miss: the old page did not survive
  EXPECT_EQ(PoolCount(ch_->vm), 1u);
}

// ------------------------------------------------------------ flush

TEST_F(RingConsumerTest, FlushBarrierDropsFlaggedPoolsOnceHeadReachesSeq) {
  const uint32_t a = ch_->NewPool();
  const uint32_t b = ch_->NewPool();
  for (uint64_t i = 0; i < 4; ++i) {
    ASSERT_EQ(ch_->Put(a, 1, i, TextPage(i)), TMEM_OK);
    ASSERT_EQ(ch_->Put(b, 1, i, TextPage(100 + i)), TMEM_OK);
  }
  // Fill the CQ (not reaped), then the SQ: the guest has no ring space for
  // an invalidate, so it asks for a flush barrier at its tail.
  const uint32_t n = ch_->guest->sq_entries();
  for (uint32_t i = 0; i < n; ++i) ch_->guest->Post(Sqe(TMEM_OP_NOP, i));
  ASSERT_EQ(ch_->consumer->Drain(64).consumed, n);
  for (uint32_t i = 0; i < n; ++i) ch_->guest->Post(Sqe(TMEM_OP_NOP, n + i));
  ASSERT_EQ(ch_->guest->SqSpace(), 0u);
  const uint64_t seq = ch_->guest->sq_tail();
  ch_->guest->RequestFlush(uint64_t{1} << a, seq);

  // sq_head has not reached seq: nothing flushed yet.
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 0u);
  EXPECT_NE(ch_->guest->FlushDone(), seq);
  EXPECT_EQ(PoolPages(ch_->vm, a), 4u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kFlushBarriers), 0u);

  ch_->guest->Reap();
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, n);
  EXPECT_EQ(ch_->guest->FlushDone(), seq);
  EXPECT_EQ(ch_->Count(ChannelCounter::kFlushBarriers), 1u);
  EXPECT_EQ(PoolPages(ch_->vm, a), 0u);
  EXPECT_EQ(PoolPages(ch_->vm, b), 4u);
  ch_->guest->Reap();
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_FALSE(ch_->Get(a, 1, i).has_value());
    std::optional<Page> got = ch_->Get(b, 1, i);
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(*got == TextPage(100 + i));
  }
  // Applied once: later drains do not flush again.
  ASSERT_EQ(ch_->Put(a, 2, 0, TextPage(7)), TMEM_OK);
  ch_->consumer->Drain(64);
  EXPECT_EQ(ch_->Count(ChannelCounter::kFlushBarriers), 1u);
  EXPECT_EQ(PoolPages(ch_->vm, a), 1u);
}

TEST_F(RingConsumerTest, FlushBarrierSitsExactlyBetweenEntries) {
  const uint32_t a = ch_->NewPool();
  // Four puts, the flush request, then a fifth put: all drained at once.
  for (uint32_t i = 0; i < 4; ++i) {
    ch_->guest->PutIntoSlot(i, TextPage(i));
    ch_->guest->Post(PageSqe(TMEM_OP_PUT, a, 1, i, i, i));
  }
  const uint64_t seq = ch_->guest->sq_tail();
  ch_->guest->RequestFlush(uint64_t{1} << a, seq);
  ch_->guest->PutIntoSlot(4, TextPage(4));
  ch_->guest->Post(PageSqe(TMEM_OP_PUT, a, 1, 4, 4, 4));
  EXPECT_EQ(ch_->consumer->Drain(64).consumed, 5u);
  EXPECT_EQ(ch_->guest->FlushDone(), seq);
  ch_->guest->Reap();
  // Before the barrier: flushed. After it: kept.
  for (uint64_t i = 0; i < 4; ++i) EXPECT_FALSE(ch_->Get(a, 1, i).has_value());
  std::optional<Page> got = ch_->Get(a, 1, 4);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(*got == TextPage(4));
}

TEST_F(RingConsumerTest, FlushRequestsAtOneTailAreToldApartByHighBits) {
  const uint32_t a = ch_->NewPool();
  const uint32_t b = ch_->NewPool();
  ASSERT_EQ(ch_->Put(a, 1, 1, TextPage(1)), TMEM_OK);
  ASSERT_EQ(ch_->Put(b, 1, 1, TextPage(2)), TMEM_OK);
  const uint64_t tail = ch_->guest->sq_tail();
  ch_->guest->RequestFlush(uint64_t{1} << a, tail);
  ch_->consumer->Drain(64);  // head == tail already: applied at once
  EXPECT_EQ(ch_->guest->FlushDone(), tail);
  EXPECT_EQ(PoolPages(ch_->vm, a), 0u);
  // A second request at the same tail, named by a request count above bit
  // 32, is a new request.
  const uint64_t seq2 = (uint64_t{1} << 32) | tail;
  ch_->guest->RequestFlush(uint64_t{1} << b, seq2);
  ch_->consumer->Drain(64);
  EXPECT_EQ(ch_->guest->FlushDone(), seq2);
  EXPECT_EQ(PoolPages(ch_->vm, b), 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kFlushBarriers), 2u);
}

TEST_F(RingConsumerTest, FlushIgnoresPoolsThisConsumerDidNotCreate) {
  Channel other(store_.get(), "vm2");
  const uint32_t mine = ch_->NewPool();
  const uint32_t theirs = other.NewPool();
  ASSERT_EQ(theirs, 0u);
  ASSERT_EQ(other.Put(theirs, 1, 1, TextPage(1)), TMEM_OK);
  // Every bit set: only our own pools are touched (and the scribbled
  // flush_done_seq is not trusted).
  __atomic_store_n(&ch_->guest->header()->flush_done_seq, uint64_t{12345},
                   __ATOMIC_RELAXED);
  ch_->guest->RequestFlush(~uint64_t{0}, ch_->guest->sq_tail());
  ch_->consumer->Drain(64);
  EXPECT_EQ(ch_->Count(ChannelCounter::kFlushBarriers), 1u);
  EXPECT_EQ(PoolPages(other.vm, theirs), 1u);
  EXPECT_EQ(mine, 0u);
  EXPECT_EQ(PoolCount(ch_->vm), 1u);
}

// ------------------------------------------------------------ store errors

TEST_F(RingConsumerTest, ForgottenVmAnswersNoentAndCounts) {
  const uint32_t pool = ch_->NewPool();
  ASSERT_TRUE(store_->ForgetVm(ch_->vm).ok());
  EXPECT_EQ(ch_->Put(pool, 1, 1, TextPage(1)), TMEM_ERR_NOENT);
  EXPECT_EQ(ch_->Op(TMEM_OP_INVAL_POOL, pool), TMEM_ERR_NOENT);
  EXPECT_EQ(ch_->Call(NewPoolSqe(3)).status, TMEM_ERR_NOENT);
  EXPECT_EQ(ch_->Count(ChannelCounter::kSqeStoreErrors), 3u);
  ch_->consumer->DropPools();  // tolerates pools the store already dropped
}

// ------------------------------------------------------------ coherency

// A guest that issues random ops through the ring and checks every get
// against a reference model of the latest put per key. A hit must return
// exactly the latest put's bytes; a miss is always allowed (pages are
// ephemeral, and a private hit takes the page). Invalidates and pool
// destruction erase from the model, so any hit after them fails.
class CoherencyGuest {
 public:
  CoherencyGuest(TestGuest* guest, uint64_t seed) : guest_(guest), rng_(seed) {
    for (uint32_t s = 0; s < std::min(guest->slot_count(), 32u); ++s) {
      free_slots_.push_back(s);
    }
  }

  struct Key {
    uint32_t pool = 0;
    uint64_t ino = 0;
    uint64_t index = 0;
    friend bool operator<(const Key& a, const Key& b) {
      return std::tie(a.pool, a.ino, a.index) <
             std::tie(b.pool, b.ino, b.index);
    }
  };
  struct InFlight {
    uint8_t opcode = TMEM_OP_NOP;
    uint32_t slot = 0;
    std::optional<uint64_t> expect;  // GET: latest version at post time
    Key key;
    // GET_BATCH: pages key.index + k, k < expects.size(), into slot + k.
    std::vector<std::optional<uint64_t>> expects;
  };

  // Makes up to `max` random moves (most post an entry), bounded by ring
  // space and free slots.
  void PostSome(uint32_t max) {
    for (uint32_t i = 0;
         i < max && guest_->SqSpace() > 0 && !free_slots_.empty(); ++i) {
      PostOne();
    }
  }

  // Reaps and checks. Returns the completions seen.
  size_t ReapAndCheck(size_t max = SIZE_MAX) {
    const std::vector<tmem_cqe> cqes = guest_->Reap(max);
    for (const tmem_cqe& c : cqes) Check(c);
    return cqes.size();
  }

  size_t in_flight() const { return in_flight_.size(); }
  uint64_t hits() const { return hits_; }
  uint64_t gets() const { return gets_; }
  uint64_t failures() const { return failures_; }

 private:
  void PostOne() {
    // Pools are created once, synchronously with the first ops: pool ids
    // 0 and 1 (NEW_POOL goes through the ring like everything else).
    const uint64_t tag = next_tag_++;
    if (pools_created_ < 2) {
      in_flight_[tag] = {TMEM_OP_NEW_POOL,
                         kNoSlot,
                         std::nullopt,
                         Key{static_cast<uint32_t>(pools_created_), 0, 0},
                         {}};
      guest_->Post(NewPoolSqe(tag));
      ++pools_created_;
      return;
    }
    const Key key{static_cast<uint32_t>(rng_() % 2), rng_() % 3, rng_() % 6};
    const uint32_t dice = rng_() % 100;
    if (dice < 45) {  // put
      const uint32_t slot = TakeSlot();
      const uint64_t version = next_version_++;
      guest_->PutIntoSlot(slot, VersionPage(version));
      model_[key] = version;
      in_flight_[tag] = {TMEM_OP_PUT, slot, std::nullopt, key, {}};
      guest_->Post(
          PageSqe(TMEM_OP_PUT, key.pool, key.ino, key.index, slot, tag));
    } else if (dice < 55) {  // a batched get of a run of the object
      if (FlushPending(key.pool) || batch_in_flight_ ||
          guest_->slot_count() < kBatchSlot + kBatchMax) {
        return;
      }
      const uint64_t count = 1 + rng_() % (kBatchMax - key.index);
      InFlight f{TMEM_OP_GET_BATCH, kNoSlot, std::nullopt, key, {}};
      for (uint64_t k = 0; k < count; ++k) {
        std::optional<uint64_t> expect;
        Key page = key;
        page.index += k;
        if (auto it = model_.find(page); it != model_.end()) {
          expect = it->second;
          model_.erase(it);  // exclusive, as a single get
        }
        f.expects.push_back(expect);
      }
      in_flight_[tag] = f;
      batch_in_flight_ = true;
      tmem_sqe sqe = PageSqe(TMEM_OP_GET_BATCH, key.pool, key.ino, key.index,
                             kBatchSlot, tag);
      sqe.count = static_cast<uint16_t>(count);
      guest_->Post(sqe);
    } else if (dice < 85) {  // get
      if (FlushPending(key.pool)) {
        // The ABI's rule: while a flush of the pool is pending, a get is a
        // miss without asking (an earlier request's position may have been
        // overwritten by a later one, so the host may flush only later).
        return;
      }
      const uint32_t slot = TakeSlot();
      std::optional<uint64_t> expect;
      if (auto it = model_.find(key); it != model_.end()) {
        expect = it->second;
        model_.erase(it);  // private pool: a hit takes it, a miss means gone
      }
      in_flight_[tag] = {TMEM_OP_GET, slot, expect, key, {}};
      guest_->Post(
          PageSqe(TMEM_OP_GET, key.pool, key.ino, key.index, slot, tag));
    } else if (dice < 93) {
      model_.erase(key);
      in_flight_[tag] = {TMEM_OP_INVAL_PAGE, kNoSlot, std::nullopt, key, {}};
      guest_->Post(
          PageSqe(TMEM_OP_INVAL_PAGE, key.pool, key.ino, key.index, 0, tag));
    } else if (dice < 97) {
      std::erase_if(model_, [&](const auto& kv) {
        return kv.first.pool == key.pool && kv.first.ino == key.ino;
      });
      in_flight_[tag] = {TMEM_OP_INVAL_OBJECT, kNoSlot, std::nullopt, key, {}};
      guest_->Post(PageSqe(TMEM_OP_INVAL_OBJECT, key.pool, key.ino, 0, 0, tag));
    } else if (dice < 99) {
      std::erase_if(model_,
                    [&](const auto& kv) { return kv.first.pool == key.pool; });
      in_flight_[tag] = {TMEM_OP_INVAL_POOL, kNoSlot, std::nullopt, key, {}};
      guest_->Post(PoolSqe(TMEM_OP_INVAL_POOL, key.pool, tag));
    } else {
      // The never-lost invalidate, without ring space: a flush barrier at
      // the current tail. Entries posted from now on run after it, so the
      // model forgets the pool right here. A finished request's bits are
      // cleared first; the request count in the high bits tells requests
      // at one tail apart.
      if (guest_->FlushDone() == flush_seq_) {
        __atomic_store_n(&guest_->header()->flush_request, uint64_t{0},
                         __ATOMIC_RELAXED);
        flagged_ = 0;
      }
      flagged_ |= uint64_t{1} << key.pool;
      flush_seq_ = (++flush_requests_ << 32) | guest_->sq_tail();
      std::erase_if(model_,
                    [&](const auto& kv) { return kv.first.pool == key.pool; });
      guest_->RequestFlush(uint64_t{1} << key.pool, flush_seq_);
    }
  }

  bool FlushPending(uint32_t pool) const {
    return (flagged_ >> pool & 1) != 0 && guest_->FlushDone() != flush_seq_;
  }

  uint32_t TakeSlot() {
    const uint32_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }

  void Check(const tmem_cqe& c) {
    auto it = in_flight_.find(c.tag);
    if (it == in_flight_.end()) {
      ADD_FAILURE() << "completion for unknown tag " << c.tag;
      ++failures_;
      return;
    }
    const InFlight f = it->second;
    in_flight_.erase(it);
    if (f.slot != kNoSlot) free_slots_.push_back(f.slot);
    // A put may be dropped (quota); everything else must succeed.
    const bool ok = c.status == TMEM_OK ||
                    (f.opcode == TMEM_OP_PUT && c.status == TMEM_ERR_DROPPED);
    if (!ok) {
      ADD_FAILURE() << "op " << int{f.opcode} << " tag " << c.tag << " status "
                    << c.status;
      ++failures_;
    }
    if (f.opcode == TMEM_OP_NEW_POOL && c.result != f.key.pool) {
      ADD_FAILURE() << "NEW_POOL returned " << c.result << ", want "
                    << f.key.pool;
      ++failures_;
    }
    if (f.opcode == TMEM_OP_GET_BATCH) {
      batch_in_flight_ = false;
      CheckBatch(f, c);
      return;
    }
    if (f.opcode != TMEM_OP_GET) return;
    ++gets_;
    if (c.result == 0) return;  // a miss is always allowed
    ++hits_;
    if (!f.expect.has_value()) {
      ADD_FAILURE() << "stale hit: key (" << f.key.pool << "," << f.key.ino
                    << "," << f.key.index << ") was invalidated or never put";
      ++failures_;
      return;
    }
    if (!(guest_->SlotPage(f.slot) == VersionPage(*f.expect))) {
      ADD_FAILURE() << "hit returned other bytes than version " << *f.expect;
      ++failures_;
    }
  }

  void CheckBatch(const InFlight& f, const tmem_cqe& c) {
    const size_t count = f.expects.size();
    if ((uint64_t{c.result} >> count) != 0) {
      ADD_FAILURE() << "GET_BATCH of " << count << " pages set bits beyond "
                    << "them: " << c.result;
      ++failures_;
    }
    for (size_t k = 0; k < count; ++k) {
      ++gets_;
      ++batch_pages_;
      if (((c.result >> k) & 1) == 0) continue;
      ++hits_;
      ++batch_hits_;
      if (!f.expects[k].has_value()) {
        ADD_FAILURE() << "stale batched hit: key (" << f.key.pool << ","
                      << f.key.ino << "," << f.key.index + k << ")";
        ++failures_;
      } else if (!(guest_->SlotPage(kBatchSlot + static_cast<uint32_t>(k)) ==
                   VersionPage(*f.expects[k]))) {
        ADD_FAILURE() << "batched hit returned other bytes than version "
                      << *f.expects[k];
        ++failures_;
      }
    }
  }

 public:
  uint64_t batch_pages() const { return batch_pages_; }
  uint64_t batch_hits() const { return batch_hits_; }

 private:
  static constexpr uint32_t kNoSlot = ~0u;
  // Batches use their own slots, after the ones single ops take.
  static constexpr uint32_t kBatchSlot = 32;
  static constexpr uint64_t kBatchMax = 6;  // the random keys' index range
  bool batch_in_flight_ = false;
  uint64_t batch_pages_ = 0, batch_hits_ = 0;
  TestGuest* guest_;
  std::mt19937_64 rng_;
  std::vector<uint32_t> free_slots_;
  std::map<uint64_t, InFlight> in_flight_;
  std::map<Key, uint64_t> model_;
  uint64_t next_tag_ = 1;
  uint64_t next_version_ = 1;
  int pools_created_ = 0;
  uint64_t flush_seq_ = 0;
  uint64_t flush_requests_ = 0;
  uint64_t flagged_ = 0;  // pools named since the last finished request
  uint64_t hits_ = 0, gets_ = 0, failures_ = 0;
};

TEST_F(RingConsumerTest, RandomizedCoherencyAgainstModel) {
  // A tight quota makes the store evict, so misses and drops happen too.
  VmPolicy policy;
  policy.quota_bytes = uint64_t{24} << 10;
  ASSERT_TRUE(store_->SetVmPolicy(ch_->vm, policy).ok());
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    ch_->consumer->DropPools();
    ch_->region->Reset();
    ch_->guest->Attach();
    advisor_.mode = PutMode::kCompress;
    CoherencyGuest g(ch_->guest.get(), seed);
    std::mt19937_64 rng(seed * 7919);
    for (int step = 0; step < 5000 && g.failures() == 0; ++step) {
      g.PostSome(1 + rng() % kRingEntries);
      // Drains and reaps of random sizes: full and partial CQs, bounded
      // drains, batches split at any point.
      ch_->consumer->Drain(1 + rng() % 12);
      g.ReapAndCheck(rng() % 2 == 0 ? SIZE_MAX : rng() % 4);
      // Now and then the valve drops or stores raw.
      const uint32_t v = rng() % 50;
      advisor_.mode = v == 0   ? PutMode::kDrop
                      : v == 1 ? PutMode::kRaw
                               : PutMode::kCompress;
    }
    while (g.in_flight() > 0 && g.failures() == 0) {
      ch_->consumer->Drain(64);
      g.ReapAndCheck();
    }
    EXPECT_EQ(g.failures(), 0u);
    EXPECT_GT(g.hits(), g.gets() / 10) << "the test should see real hits";
    EXPECT_GT(g.batch_hits(), 0u) << "and batched ones";
  }
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
}

// The same with the guest on its own thread and a worker thread draining,
// as in tmemd: exercises the acquire/release pairs for real (and under
// TSan, checks there is no data race in the protocol).
TEST_F(RingConsumerTest, ThreadedCoherencyAgainstModel) {
  std::atomic<bool> stop{false};
  std::thread worker([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      if (ch_->consumer->Drain(32).consumed == 0) std::this_thread::yield();
    }
  });
  CoherencyGuest g(ch_->guest.get(), 42);
  std::mt19937_64 rng(4242);
  for (int step = 0; step < 20000 && g.failures() == 0; ++step) {
    g.PostSome(1 + rng() % kRingEntries);
    if (g.ReapAndCheck() == 0) std::this_thread::yield();
  }
  while (g.in_flight() > 0 && g.failures() == 0) {
    if (g.ReapAndCheck() == 0) std::this_thread::yield();
  }
  stop.store(true, std::memory_order_relaxed);
  worker.join();
  EXPECT_EQ(g.failures(), 0u);
  EXPECT_GT(g.hits(), 0u);
  EXPECT_GT(g.batch_pages(), 0u);
  EXPECT_EQ(ch_->Count(ChannelCounter::kRingCorruptIndex), 0u);
}

}  // namespace
}  // namespace tmem
