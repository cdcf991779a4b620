// Batched gets (TMEM_OP_GET_BATCH) in the guest core, through TmemGuest
// against FakeHost: one round trip per readahead window, prefetched pages
// served locally, the negative cache, and exactness: every put, invalidate,
// flush and host reset wins over a prefetched copy. The model check at the
// end drives random interleavings and checks every hit against the latest
// put of its key.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "gtest/gtest.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "tests/guest/fake_host.h"

namespace tmem {
namespace {

using testing::FakeHost;
using testing::FakeHostOptions;
using Page = std::array<uint8_t, TMEM_PAGE_SIZE>;

constexpr TmemGuest::ObjectId kFile = {1, 2, 3, 4, 5, 6};
constexpr TmemGuest::ObjectId kOther = {7, 7, 7, 7, 7, 7};

template <typename T>
T Load(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

// A page that says which key and version it is.
Page MakePage(const TmemGuest::ObjectId& oid, uint64_t index,
              uint64_t version) {
  Page p{};
  const uint64_t words[4] = {oid[0], index, version, ~version};
  for (size_t off = 0; off < p.size(); off += sizeof(words)) {
    std::memcpy(p.data() + off, words, sizeof(words));
  }
  return p;
}

uint64_t VersionOf(const Page& p) {
  uint64_t v;
  std::memcpy(&v, p.data() + 16, sizeof(v));
  return v;
}

FakeHostOptions BatchHost() {
  FakeHostOptions o;
  o.region_bytes = 2 << 20;
  o.sq_entries = 64;
  o.cq_entries = 64;
  o.slot_count = 400;  // 64 ordinary slots + 6 windows of 32
  o.features |= TMEM_FEAT_GET_BATCH;
  return o;
}

TmemGuestOptions Options() {
  TmemGuestOptions o;
  o.get_timeout = std::chrono::milliseconds(200);
  o.attach_timeout = std::chrono::milliseconds(200);
  o.pool_create_timeout = std::chrono::milliseconds(200);
  return o;
}

std::unique_ptr<TmemGuest> MustCreate(FakeHost* host,
                                      const TmemGuestOptions& o = Options()) {
  auto g = TmemGuest::Create(host, o);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(*g) : nullptr;
}

// Version 1 of pages 0 .. n - 1 of kFile, handed to the host.
void PutPages(TmemGuest* guest, int pool, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    guest->Put(pool, kFile, i, MakePage(kFile, i, 1));
  }
  guest->Poll();
}

class BatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    guest_ = MustCreate(&host_);
    ASSERT_NE(guest_, nullptr);
    ASSERT_GT(guest_->prefetch_windows(), 0u);
    pool_ = *guest_->InitFs();
  }
  void PutRange(const TmemGuest::ObjectId& oid, uint64_t from, uint64_t to,
                uint64_t version = 1) {
    for (uint64_t i = from; i < to; ++i) {
      guest_->Put(pool_, oid, i, MakePage(oid, i, version));
    }
    guest_->Poll();
  }
  uint64_t RoundTrips() const {
    return host_.op_count(TMEM_OP_GET) + host_.op_count(TMEM_OP_GET_BATCH);
  }

  FakeHost host_{BatchHost()};
  std::unique_ptr<TmemGuest> guest_;
  int pool_ = -1;
  Page out_{};
};

TEST_F(BatchTest, OneRoundTripServesAWholeWindow) {
  PutRange(kFile, 0, 32);
  for (uint64_t i = 0; i < 32; ++i) {
    ASSERT_TRUE(guest_->Get(pool_, kFile, i, out_)) << i;
    EXPECT_EQ(out_, MakePage(kFile, i, 1)) << i;
  }
  EXPECT_EQ(RoundTrips(), 1u);
  EXPECT_EQ(host_.batch_pages(), 32u);
  const GuestCounters& c = guest_->counters();
  EXPECT_EQ(c.get_batches, 1u);
  EXPECT_EQ(c.gets_hit, 32u);
  EXPECT_EQ(c.prefetch_used, 31u);
  EXPECT_EQ(c.prefetch_unused, 0u);
  EXPECT_EQ(host_.page_count(), 0u) << "exclusive: the host forgot them";
  EXPECT_EQ(Load(&host_.header()->guest_prefetch_used), 31u);
}

TEST_F(BatchTest, TheFileEndBoundsTheBatch) {
  PutRange(kFile, 0, 32);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_, /*pages_to_end=*/4));
  EXPECT_EQ(host_.batch_pages(), 4u);
  EXPECT_TRUE(guest_->Get(pool_, kFile, 3, out_));
  EXPECT_EQ(RoundTrips(), 1u);
  EXPECT_TRUE(guest_->Get(pool_, kFile, 4, out_)) << "past the window";
  EXPECT_EQ(RoundTrips(), 2u);
}

// A batch takes its pages from the host (exclusive), so random reads must
// not batch: a prefetched page nobody reads is a page lost. Only a get
// that follows the last one (or reads a file's first page) asks for more.
TEST_F(BatchTest, RandomGetsArePlainAndLeaveTheRestOnTheHost) {
  PutRange(kFile, 0, 64);
  for (uint64_t i : {40u, 7u, 55u, 20u}) {
    ASSERT_TRUE(guest_->Get(pool_, kFile, i, out_)) << i;
    EXPECT_EQ(out_, MakePage(kFile, i, 1)) << i;
  }
  EXPECT_EQ(host_.op_count(TMEM_OP_GET_BATCH), 0u);
  EXPECT_EQ(guest_->counters().gets_not_sequential, 4u);
  EXPECT_EQ(host_.page_count(), 60u) << "only the four pages read left";
  // The page after the last one read: a sequential reader, batch from it.
  ASSERT_TRUE(guest_->Get(pool_, kFile, 21, out_));
  EXPECT_EQ(host_.op_count(TMEM_OP_GET_BATCH), 1u);
}

// Read-ahead: once a reader goes on past a batch's first page, the next
// windows of the object are asked for without waiting, so a sequential
// reader pays one round trip for the whole file, not one per window.
TEST_F(BatchTest, ReadAheadKeepsASequentialReaderAheadOfTheHost) {
  PutRange(kFile, 0, 128);
  for (uint64_t i = 0; i < 128; ++i) {
    ASSERT_TRUE(guest_->Get(pool_, kFile, i, out_)) << i;
    ASSERT_EQ(out_, MakePage(kFile, i, 1)) << i;
  }
  const GuestCounters& c = guest_->counters();
  EXPECT_EQ(c.get_batches, 4u);
  EXPECT_EQ(c.readaheads, 3u) << "one batch waited for, three asked ahead";
  EXPECT_EQ(host_.batch_pages(), 128u);
  EXPECT_EQ(c.prefetch_used, 127u);
  EXPECT_EQ(c.prefetch_unused, 0u);
  EXPECT_EQ(host_.page_count(), 0u);
  EXPECT_EQ(guest_->free_slots(), guest_->slots_usable()) << "no slot leaks";
  EXPECT_EQ(guest_->in_flight(), 0u);
}

TEST_F(BatchTest, ReadAheadStopsAtTheFileEnd) {
  PutRange(kFile, 0, 128);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_, /*pages_to_end=*/40));
  ASSERT_TRUE(guest_->Get(pool_, kFile, 1, out_, /*pages_to_end=*/39));
  guest_->Poll();
  EXPECT_EQ(guest_->counters().readaheads, 1u);
  EXPECT_EQ(host_.batch_pages(), 40u) << "32, then the 8 left to the end";
  EXPECT_EQ(host_.page_count(), 88u);
}

TEST_F(BatchTest, ReadAheadCanBeTurnedOff) {
  TmemGuestOptions o = Options();
  o.readahead_windows = 0;
  FakeHost host(BatchHost());
  auto guest = MustCreate(&host, o);
  ASSERT_NE(guest, nullptr);
  const int pool = *guest->InitFs();
  PutPages(guest.get(), pool, 64);
  for (uint64_t i = 0; i < 64; ++i) {
    ASSERT_TRUE(guest->Get(pool, kFile, i, out_)) << i;
  }
  EXPECT_EQ(guest->counters().readaheads, 0u);
  EXPECT_EQ(guest->counters().get_batches, 2u) << "one waited-for batch each";
}

// A read-ahead is in flight (the host has not run it) when the reader
// invalidates one of its pages and puts a new version of another: neither
// old copy may be served, whatever the host returns for the batch.
TEST_F(BatchTest, InvalidateAndPutWinOverAReadAheadInFlight) {
  PutRange(kFile, 0, 64);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  host_.paused = true;
  ASSERT_TRUE(guest_->Get(pool_, kFile, 1, out_));  // asks for 32..63
  ASSERT_EQ(guest_->counters().readaheads, 1u);
  guest_->InvalidatePage(pool_, kFile, 40);
  guest_->Put(pool_, kFile, 41, MakePage(kFile, 41, 2));
  host_.paused = false;
  host_.Step(1000);
  EXPECT_FALSE(guest_->Get(pool_, kFile, 40, out_)) << "invalidated";
  ASSERT_TRUE(guest_->Get(pool_, kFile, 41, out_));
  EXPECT_EQ(VersionOf(out_), 2u) << "the later put wins";
  ASSERT_TRUE(guest_->Get(pool_, kFile, 42, out_));
  EXPECT_EQ(out_, MakePage(kFile, 42, 1));
  EXPECT_EQ(guest_->in_flight(), 0u);
}

// A reader that catches up with a read-ahead still being filled waits for
// it rather than asking the host for the same pages again (which would
// miss: the read-ahead took them, exclusive).
TEST(BatchThreadedTest, AReaderWaitsForTheReadAheadItCaughtUpWith) {
  FakeHost host(BatchHost());
  TmemGuestOptions o = Options();
  o.get_timeout = std::chrono::seconds(10);
  auto guest = MustCreate(&host, o);
  ASSERT_NE(guest, nullptr);
  const int pool = *guest->InitFs();
  PutPages(guest.get(), pool, 64);
  Page out{};
  ASSERT_TRUE(guest->Get(pool, kFile, 0, out));
  host.paused = true;
  ASSERT_TRUE(guest->Get(pool, kFile, 1, out));  // asks for 32..63
  std::atomic<bool> released{false};
  std::thread host_thread([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    released = true;
    host.paused = false;
    host.Step();
  });
  for (uint64_t i = 2; i < 64; ++i) {
    ASSERT_TRUE(guest->Get(pool, kFile, i, out)) << i;
    ASSERT_EQ(out, MakePage(kFile, i, 1)) << i;
  }
  EXPECT_TRUE(released) << "page 32 came from the read-ahead, after it ran";
  host_thread.join();
  EXPECT_EQ(host.op_count(TMEM_OP_GET_BATCH), 2u);
  EXPECT_EQ(host.op_count(TMEM_OP_GET), 0u) << "no page asked for twice";
  EXPECT_EQ(guest->in_flight(), 0u);
}

TEST_F(BatchTest, NeverSentTailIsNotAskedFor) {
  PutRange(kFile, 0, 10);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  EXPECT_EQ(host_.batch_pages(), 10u);
}

TEST_F(BatchTest, InvalidatedPrefetchedPageIsNeverServed) {
  PutRange(kFile, 0, 8);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  guest_->InvalidatePage(pool_, kFile, 5);
  EXPECT_FALSE(guest_->Get(pool_, kFile, 5, out_));
  EXPECT_EQ(guest_->counters().prefetch_unused, 1u);
  EXPECT_TRUE(guest_->Get(pool_, kFile, 6, out_)) << "its neighbours stay";
}

TEST_F(BatchTest, APutReplacesThePrefetchedCopy) {
  PutRange(kFile, 0, 8);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  guest_->Put(pool_, kFile, 5, MakePage(kFile, 5, 2));
  ASSERT_TRUE(guest_->Get(pool_, kFile, 5, out_));
  EXPECT_EQ(VersionOf(out_), 2u) << "never the prefetched version 1";
}

TEST_F(BatchTest, ADroppedPutStillKillsThePrefetchedCopy) {
  PutRange(kFile, 0, 8);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  host_.SetAdmissionHint(0);  // the put is not sent
  guest_->Put(pool_, kFile, 5, MakePage(kFile, 5, 2));
  EXPECT_FALSE(guest_->Get(pool_, kFile, 5, out_));
}

TEST_F(BatchTest, ObjectAndPoolInvalidatesDropWindows) {
  PutRange(kFile, 0, 8);
  PutRange(kOther, 0, 8);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  ASSERT_TRUE(guest_->Get(pool_, kOther, 0, out_));
  guest_->InvalidateObject(pool_, kFile);
  EXPECT_FALSE(guest_->Get(pool_, kFile, 1, out_));
  EXPECT_TRUE(guest_->Get(pool_, kOther, 1, out_));
  guest_->InvalidatePool(pool_);
  EXPECT_FALSE(guest_->Get(pool_, kOther, 2, out_));
  EXPECT_EQ(guest_->counters().prefetch_unused, 7u + 6u);
}

TEST_F(BatchTest, HostResetForgetsPrefetchedPages) {
  PutRange(kFile, 0, 8);
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));
  host_.Reset();
  EXPECT_FALSE(guest_->Get(pool_, kFile, 1, out_));
  EXPECT_EQ(guest_->counters().prefetch_unused, 7u);
  EXPECT_EQ(guest_->free_slots(), guest_->slots_usable());
}

TEST_F(BatchTest, MissesAreRememberedUntilTheKeyIsPut) {
  guest_->Put(pool_, kFile, 0, MakePage(kFile, 0, 1));
  host_.Step();
  // Page 1 was sent (the sent-keys filter cannot rule it out) but the host
  // dropped it: the window says it is missing.
  host_.drop_puts = true;
  guest_->Put(pool_, kFile, 1, MakePage(kFile, 1, 1));
  host_.Step();
  guest_->Poll();
  ASSERT_EQ(guest_->counters().puts_dropped_by_host, 1u);
  host_.drop_puts = false;
  guest_->Put(pool_, kFile, 2, MakePage(kFile, 2, 1));
  guest_->Poll();
  ASSERT_TRUE(guest_->Get(pool_, kFile, 0, out_));  // window 0..2
  const uint64_t trips = RoundTrips();
  EXPECT_FALSE(guest_->Get(pool_, kFile, 1, out_));
  EXPECT_EQ(guest_->counters().gets_negative_cached, 1u);
  EXPECT_EQ(RoundTrips(), trips) << "answered locally";
  guest_->Put(pool_, kFile, 1, MakePage(kFile, 1, 2));
  ASSERT_TRUE(guest_->Get(pool_, kFile, 1, out_)) << "put again: ask the host";
  EXPECT_EQ(VersionOf(out_), 2u);
}

TEST_F(BatchTest, WindowsAreReusedLeastRecentlyUsedFirst) {
  const uint32_t windows = guest_->prefetch_windows();
  for (uint32_t f = 0; f <= windows; ++f) {
    const TmemGuest::ObjectId oid = {f, 0, 0, 0, 0, 9};
    PutRange(oid, 0, 4);
    ASSERT_TRUE(guest_->Get(pool_, oid, 0, out_));
  }
  // The first object's window was the least recently used: reused.
  EXPECT_EQ(guest_->counters().prefetch_unused, 3u);
  const TmemGuest::ObjectId first = {0, 0, 0, 0, 0, 9};
  EXPECT_FALSE(guest_->Get(pool_, first, 1, out_));
  const TmemGuest::ObjectId last = {windows, 0, 0, 0, 0, 9};
  EXPECT_TRUE(guest_->Get(pool_, last, 1, out_));
  EXPECT_EQ(guest_->free_slots(), guest_->slots_usable()) << "no slot leaks";
  EXPECT_EQ(guest_->in_flight(), 0u);
}

TEST_F(BatchTest, SharedPoolsUsePlainGets) {
  const int shared = *guest_->InitSharedFs(TmemGuest::Uuid{1});
  for (uint64_t i = 0; i < 4; ++i) {
    guest_->Put(shared, kFile, i, MakePage(kFile, i, 1));
  }
  guest_->Poll();
  EXPECT_TRUE(guest_->Get(shared, kFile, 0, out_));
  EXPECT_TRUE(guest_->Get(shared, kFile, 1, out_));
  EXPECT_EQ(host_.op_count(TMEM_OP_GET_BATCH), 0u);
  EXPECT_EQ(host_.op_count(TMEM_OP_GET), 2u);
}

TEST(BatchFallbackTest, WithoutTheFeatureGetsArePlain) {
  FakeHostOptions o = BatchHost();
  o.features &= ~TMEM_FEAT_GET_BATCH;
  FakeHost host(o);
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  for (uint64_t i = 0; i < 4; ++i) {
    guest->Put(pool, kFile, i, MakePage(kFile, i, 1));
  }
  Page out{};
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(guest->Get(pool, kFile, i, out));
  EXPECT_EQ(guest->prefetch_windows(), 0u);
  EXPECT_EQ(host.op_count(TMEM_OP_GET_BATCH), 0u);
  EXPECT_EQ(host.op_count(TMEM_OP_GET), 4u);
  EXPECT_EQ(Load(&host.header()->features_guest) & TMEM_FEAT_GET_BATCH, 0u);
}

// ---------------------------------------------------------------------------
// Model check: random interleavings of puts (some not sent), sequential get
// runs (the readahead pattern that fills windows), page/object/pool
// invalidates, dropped puts, and host resets. A hit must be the latest put
// of its key, never invalidated since, and (private pool) not already got.

struct ModelResult {
  uint64_t hits = 0;
  uint64_t stale = 0;
  std::string first_stale;
};

ModelResult RunModel(FakeHost& host, uint32_t seed, int ops) {
  auto guest = MustCreate(&host);
  ModelResult r;
  if (guest == nullptr) return r;
  const int pool = *guest->InitFs();
  std::mt19937 rng(seed);
  constexpr uint64_t kPages = 40;
  const std::array<TmemGuest::ObjectId, 2> oids = {kFile, kOther};
  // Latest version put per (object, index); 0: nothing may hit.
  std::map<std::pair<int, uint64_t>, uint64_t> model;
  uint64_t version = 1;
  Page out{};
  auto check_hit = [&](int o, uint64_t i) {
    ++r.hits;
    const uint64_t want = model[{o, i}];
    if (VersionOf(out) != want || want == 0 ||
        out != MakePage(oids[o], i, want)) {
      if (r.stale++ == 0) {
        r.first_stale = "object " + std::to_string(o) + " page " +
                        std::to_string(i) + ": got version " +
                        std::to_string(VersionOf(out)) + ", expected " +
                        (want == 0 ? std::string("a miss")
                                   : "version " + std::to_string(want));
      }
    }
    model[{o, i}] = 0;  // exclusive: the only copy is gone
  };
  for (int n = 0; n < ops; ++n) {
    const int o = static_cast<int>(rng() % 2);
    const uint64_t i = rng() % kPages;
    const uint32_t pick = rng() % 100;
    if (pick < 35) {
      const uint64_t run = 1 + rng() % 16;
      for (uint64_t k = i; k < std::min(kPages, i + run); ++k) {
        ++version;
        guest->Put(pool, oids[o], k, MakePage(oids[o], k, version));
        model[{o, k}] = version;
      }
    } else if (pick < 70) {
      const uint64_t run = 1 + rng() % 12;
      for (uint64_t k = i; k < std::min(kPages, i + run); ++k) {
        if (guest->Get(pool, oids[o], k, out,
                       static_cast<uint32_t>(kPages - k))) {
          check_hit(o, k);
        }
      }
    } else if (pick < 82) {
      guest->InvalidatePage(pool, oids[o], i);
      model[{o, i}] = 0;
    } else if (pick < 86) {
      guest->InvalidateObject(pool, oids[o]);
      for (uint64_t k = 0; k < kPages; ++k) model[{o, k}] = 0;
    } else if (pick < 88) {
      guest->InvalidatePool(pool);
      for (auto& [key, v] : model) v = 0;
    } else if (pick < 90) {
      host.Reset();  // forgets everything: the model only loses hits
    } else if (pick < 95) {
      host.SetAdmissionHint(rng() % 2 ? TMEM_ADMIT_ALL : TMEM_ADMIT_ALL / 4);
    } else {
      guest->Poll();
    }
  }
  EXPECT_EQ(guest->counters().errors, 0u);
  EXPECT_GT(guest->counters().prefetch_used, 0u) << "windows were exercised";
  return r;
}

TEST(BatchModelTest, EveryHitIsTheLatestPutOfItsKey) {
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    FakeHost host(BatchHost());
    const ModelResult r = RunModel(host, seed, 3000);
    EXPECT_EQ(r.stale, 0u) << "seed " << seed << ": " << r.first_stale;
    EXPECT_GT(r.hits, 100u) << "seed " << seed;
  }
}

TEST(BatchModelTest, WithACrampedRing) {
  FakeHostOptions o = BatchHost();
  o.sq_entries = 8;  // ring-full drops and flush barriers
  o.cq_entries = 8;
  for (uint32_t seed = 10; seed <= 13; ++seed) {
    FakeHost host(o);
    const ModelResult r = RunModel(host, seed, 3000);
    EXPECT_EQ(r.stale, 0u) << "seed " << seed << ": " << r.first_stale;
  }
}

// The check must be able to fail: a host that ignores invalidates serves
// invalidated pages, through windows or not.
TEST(BatchModelTest, CatchesAHostThatIgnoresInvalidates) {
  FakeHost host(BatchHost());
  host.ignore_invalidates = true;
  const ModelResult r = RunModel(host, 3, 3000);
  EXPECT_GT(r.stale, 0u);
}

}  // namespace
}  // namespace tmem
