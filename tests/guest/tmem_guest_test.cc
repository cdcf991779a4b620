// TmemGuest against FakeHost (tests/guest/fake_host.h): attach, slots,
// doorbells, admission hint, the flush barrier, generations and resets.
#include "guest-driver/userspace/tmem_guest.h"

#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "guest-driver/userspace/workloads.h"
#include "tests/guest/fake_host.h"

namespace tmem {
namespace {

using testing::FakeHost;
using testing::FakeHostOptions;
using ::testing::HasSubstr;
using Page = std::array<uint8_t, TMEM_PAGE_SIZE>;

constexpr TmemGuest::ObjectId kFile = {1, 2, 3, 4, 5, 6};
constexpr TmemGuest::ObjectId kOtherFile = {9, 9, 9, 9, 9, 9};

Page MakePage(uint64_t seed) {
  Page p;
  FillPage(7, seed, 1, p.data());
  return p;
}

TmemGuestOptions FastOptions() {
  TmemGuestOptions o;
  o.get_timeout = std::chrono::milliseconds(20);
  o.attach_timeout = std::chrono::milliseconds(200);
  o.pool_create_timeout = std::chrono::milliseconds(100);
  return o;
}

std::unique_ptr<TmemGuest> MustCreate(
    FakeHost* host, const TmemGuestOptions& o = FastOptions()) {
  absl::StatusOr<std::unique_ptr<TmemGuest>> g = TmemGuest::Create(host, o);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(*g) : nullptr;
}

uint64_t Load64(const uint64_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
uint32_t Load32(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

// ---------------------------------------------------------------------------
// Attach

TEST(TmemGuestAttachTest, WritesNonzeroGenerationAndAcceptedFeatures) {
  FakeHost host;
  auto guest = MustCreate(&host);
  ASSERT_NE(guest, nullptr);
  EXPECT_TRUE(guest->attached());
  EXPECT_NE(Load64(&host.header()->guest_generation), 0u);
  EXPECT_EQ(Load64(&host.header()->guest_generation),
            guest->guest_generation());
  EXPECT_EQ(Load32(&host.header()->features_guest),
            TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT |
                TMEM_FEAT_FLUSH_BARRIER);
  EXPECT_EQ(guest->host_generation(), 100u);
}

TEST(TmemGuestAttachTest, TwoGuestsPickDifferentGenerations) {
  FakeHost a, b;
  auto ga = MustCreate(&a);
  auto gb = MustCreate(&b);
  EXPECT_NE(ga->guest_generation(), gb->guest_generation());
}

TEST(TmemGuestAttachTest, RejectsWrongMagic) {
  FakeHost host;
  host.header()->magic = 0x12345678;
  absl::StatusOr<std::unique_ptr<TmemGuest>> g =
      TmemGuest::Create(&host, FastOptions());
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("magic"));
}

TEST(TmemGuestAttachTest, RejectsSlotsOutsideTheRegion) {
  FakeHost host;
  host.header()->slot_count = 1'000'000;
  absl::StatusOr<std::unique_ptr<TmemGuest>> g =
      TmemGuest::Create(&host, FastOptions());
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("outside"));
}

TEST(TmemGuestAttachTest, RejectsNonPowerOfTwoRing) {
  FakeHost host;
  host.header()->sq_entries = 12;
  EXPECT_EQ(TmemGuest::Create(&host, FastOptions()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(TmemGuestAttachTest, TimesOutWhenNeverReady) {
  FakeHostOptions o;
  o.publish_ready = false;
  FakeHost host(o);
  absl::StatusOr<std::unique_ptr<TmemGuest>> g =
      TmemGuest::Create(&host, FastOptions());
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(g.status().message(), HasSubstr("READY"));
}

TEST(TmemGuestAttachTest, WaitsForReady) {
  FakeHostOptions o;
  o.publish_ready = false;
  FakeHost host(o);
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    host.SetState(TMEM_HOST_STATE_READY);
  });
  absl::StatusOr<std::unique_ptr<TmemGuest>> g =
      TmemGuest::Create(&host, FastOptions());
  later.join();
  EXPECT_TRUE(g.ok()) << g.status();
}

// ---------------------------------------------------------------------------
// Ops

TEST(TmemGuestOpsTest, PutThenGetHitsOnceInAPrivatePool) {
  FakeHost host;
  auto guest = MustCreate(&host);
  absl::StatusOr<int> pool = guest->InitFs();
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(guest->host_pool_id(*pool), 0);
  const Page in = MakePage(1);
  guest->Put(*pool, kFile, 7, in);
  Page out{};
  EXPECT_TRUE(guest->Get(*pool, kFile, 7, out));
  EXPECT_EQ(out, in);
  EXPECT_FALSE(guest->Get(*pool, kFile, 7, out))
      << "private gets are exclusive";
  EXPECT_FALSE(guest->Get(*pool, kFile, 8, out));
  const GuestCounters& c = guest->counters();
  EXPECT_EQ(c.puts_sent, 1u);
  EXPECT_EQ(c.gets_hit, 1u);
  EXPECT_EQ(c.gets_miss, 2u);
  // Key 8 was never put: the sent-keys filter answers without the host.
  EXPECT_EQ(c.gets_miss_local, 1u);
  EXPECT_EQ(c.gets_skipped_never_sent, 1u);
  EXPECT_EQ(c.pools_created, 1u);
  EXPECT_EQ(c.errors, 0u);
}

TEST(TmemGuestOpsTest, SharedPoolSendsUuidAndIsNotExclusive) {
  FakeHost host;
  auto guest = MustCreate(&host);
  TmemGuest::Uuid uuid;
  for (size_t i = 0; i < uuid.size(); ++i)
    uuid[i] = static_cast<uint8_t>(i + 1);
  absl::StatusOr<int> pool = guest->InitSharedFs(uuid);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const tmem_sqe& new_pool = host.sqe_at(0);
  EXPECT_EQ(new_pool.opcode, TMEM_OP_NEW_POOL);
  EXPECT_EQ(new_pool.flags, TMEM_SQE_F_IRQ | TMEM_SQE_F_SHARED);
  EXPECT_EQ(std::memcmp(new_pool.oid, uuid.data(), uuid.size()), 0);
  const Page in = MakePage(2);
  guest->Put(*pool, kFile, 1, in);
  Page out{};
  EXPECT_TRUE(guest->Get(*pool, kFile, 1, out));
  EXPECT_TRUE(guest->Get(*pool, kFile, 1, out));
  EXPECT_EQ(out, in);
}

TEST(TmemGuestOpsTest, RefusedSharedPoolIsAnError) {
  FakeHost host;
  auto guest = MustCreate(&host);
  host.refuse_pools = true;
  absl::StatusOr<int> pool = guest->InitSharedFs(TmemGuest::Uuid{});
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(TmemGuestOpsTest, InvalidatesTakeEffectBeforeLaterGets) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  Page out{};
  guest->Put(pool, kFile, 1, MakePage(1));
  guest->InvalidatePage(pool, kFile, 1);
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));

  guest->Put(pool, kFile, 1, MakePage(1));
  guest->Put(pool, kFile, 2, MakePage(2));
  guest->Put(pool, kOtherFile, 1, MakePage(3));
  guest->InvalidateObject(pool, kFile);
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_FALSE(guest->Get(pool, kFile, 2, out));
  EXPECT_TRUE(guest->Get(pool, kOtherFile, 1, out));

  guest->Put(pool, kFile, 1, MakePage(1));
  guest->InvalidatePool(pool);
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(guest->counters().invalidates, 3u);
  EXPECT_EQ(guest->counters().flush_fallbacks, 0u);
}

TEST(TmemGuestOpsTest, BadHandleIsCountedNotFatal) {
  FakeHost host;
  auto guest = MustCreate(&host);
  Page out{};
  guest->Put(5, kFile, 1, MakePage(1));
  EXPECT_FALSE(guest->Get(-1, kFile, 1, out));
  EXPECT_EQ(guest->counters().errors, 2u);
}

TEST(TmemGuestOpsTest, TooManyPoolsIsResourceExhausted) {
  FakeHost host;
  auto guest = MustCreate(&host);
  for (uint32_t i = 0; i < TMEM_MAX_POOLS; ++i) {
    ASSERT_TRUE(guest->InitFs().ok()) << i;
    guest->Poll();  // reap, so NEW_POOLs do not fill the small test ring
  }
  EXPECT_EQ(guest->InitFs().status().code(),
            absl::StatusCode::kResourceExhausted);
}

// ---------------------------------------------------------------------------
// Doorbells and interrupts

// A guest whose puts and invalidates ring a sleeping host once per `batch`.
std::unique_ptr<TmemGuest> MustCreateWithDoorbellBatch(FakeHost* host,
                                                       uint32_t batch) {
  TmemGuestOptions o = FastOptions();
  o.posted_doorbell_batch = batch;
  return MustCreate(host, o);
}

TEST(TmemGuestDoorbellTest, RingsOnlyWhenTheHostAsks) {
  FakeHost host;
  auto guest = MustCreateWithDoorbellBatch(&host, 1);
  const int pool = *guest->InitFs();
  const uint64_t before = host.doorbells();
  guest->Put(pool, kFile, 1, MakePage(1));
  EXPECT_EQ(host.doorbells(), before + 1);

  host.SetNeedsDoorbell(false);  // "I am polling"
  guest->Put(pool, kFile, 2, MakePage(2));
  guest->Put(pool, kFile, 3, MakePage(3));
  EXPECT_EQ(host.doorbells(), before + 1);
  EXPECT_EQ(host.Step(), 2u);  // the host finds them by polling
  EXPECT_EQ(guest->counters().doorbells, host.doorbells());
}

TEST(TmemGuestDoorbellTest, RingsThePeerTheHostNames) {
  FakeHostOptions o;
  o.host_peer_id = 3;  // ABI v2: a migratable host is not peer 0
  FakeHost host(o);
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Put(pool, kFile, 1, MakePage(1));
  Page out{};
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
  EXPECT_GT(host.doorbells(), 0u);
  EXPECT_EQ(host.wrong_peer_doorbells(), 0u);
  EXPECT_EQ(guest->counters().doorbells, host.doorbells());
}

TEST(TmemGuestDoorbellTest, PutsToASleepingHostRingOncePerBatch) {
  FakeHost host;
  auto guest = MustCreateWithDoorbellBatch(&host, 4);
  const int pool = *guest->InitFs();
  const uint64_t before = host.doorbells();
  for (uint64_t i = 0; i < 3; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_EQ(host.doorbells(), before) << "three puts wait for the batch";
  EXPECT_EQ(guest->counters().doorbells_deferred, 3u);
  guest->Put(pool, kFile, 3, MakePage(3));
  EXPECT_EQ(host.doorbells(), before + 1) << "the fourth fills it";
  guest->InvalidatePage(pool, kFile, 0);
  EXPECT_EQ(host.doorbells(), before + 1) << "invalidates batch too";
  // A get waits: it rings for itself and for every entry before it, which
  // the host executes first (ring order), so it sees the invalidate.
  host.Start();
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 0, out));
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(out, MakePage(1));
  host.Stop();
  EXPECT_GE(host.doorbells(), before + 2);
  EXPECT_EQ(guest->counters().doorbells, host.doorbells());
}

TEST(TmemGuestDoorbellTest, PutsDoNotAskForInterruptsGetsDo) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  host.paused = true;
  guest->Put(pool, kFile, 1, MakePage(1));
  const uint32_t put_index = host.sq_head();
  EXPECT_EQ(host.sqe_at(put_index).opcode, TMEM_OP_PUT);
  EXPECT_EQ(host.sqe_at(put_index).flags, 0u);
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));  // times out: host paused
  EXPECT_EQ(host.sqe_at(put_index + 1).opcode, TMEM_OP_GET);
  EXPECT_EQ(host.sqe_at(put_index + 1).flags, TMEM_SQE_F_IRQ);
}

TEST(TmemGuestDoorbellTest, GetSleepsOnTheInterruptWithAThreadedHost) {
  FakeHost host;
  host.SetNeedsDoorbell(false);
  host.Start();
  TmemGuestOptions o = FastOptions();
  o.get_spin = std::chrono::microseconds(0);  // go straight to the interrupt
  o.get_timeout = std::chrono::seconds(5);
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  const Page in = MakePage(4);
  guest->Put(pool, kFile, 1, in);
  Page out{};
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(out, in);
  host.Stop();
  EXPECT_EQ(guest->counters().gets_timeout, 0u);
}

// A get answered while it still spins takes no interrupt wait. The host
// answers 20 ms after the get is posted: with get_spin_min far above that
// the get spins through it; with none it sleeps on the interrupt.
uint64_t InterruptWaitsOfAGetAnsweredAfter20Ms(
    std::chrono::microseconds get_spin_min) {
  FakeHost host;
  TmemGuestOptions o = FastOptions();
  o.get_spin = std::chrono::microseconds(0);
  o.get_spin_min = get_spin_min;
  o.get_timeout = std::chrono::seconds(10);
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  const Page in = MakePage(6);
  guest->Put(pool, kFile, 1, in);
  guest->Poll();
  host.paused = true;
  std::thread answer([&host] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    host.paused = false;
    host.Step();
  });
  Page out{};
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
  answer.join();
  EXPECT_EQ(out, in);
  EXPECT_EQ(guest->counters().gets_timeout, 0u);
  return guest->counters().interrupt_waits;
}

TEST(TmemGuestDoorbellTest, AGetSpinsAtLeastGetSpinMinBeforeSleeping) {
  EXPECT_EQ(InterruptWaitsOfAGetAnsweredAfter20Ms(std::chrono::seconds(5)), 0u);
  EXPECT_GE(InterruptWaitsOfAGetAnsweredAfter20Ms(std::chrono::microseconds(0)),
            1u);
}

// ---------------------------------------------------------------------------
// Slots and a full ring

TEST(TmemGuestSlotTest, SlotsAreOwnedUntilTheirCompletionIsReaped) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Poll();
  const uint32_t all = guest->free_slots();
  EXPECT_EQ(all, guest->slots_usable());
  host.paused = true;
  for (uint64_t i = 0; i < 5; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_EQ(guest->free_slots(), all - 5);
  std::set<uint32_t> slots;
  for (uint32_t i = 0; i < 5; ++i)
    slots.insert(host.sqe_at(host.sq_head() + i).slot);
  EXPECT_EQ(slots.size(), 5u) << "each in-flight put has its own slot";

  EXPECT_EQ(host.Step(), 5u);  // the host copied them out ...
  EXPECT_EQ(guest->free_slots(), all - 5) << "... but the CQEs are not reaped";
  guest->Poll();
  EXPECT_EQ(guest->free_slots(), all);
  EXPECT_EQ(guest->in_flight(), 0u);
}

TEST(TmemGuestSlotTest, FullRingDropsPutsAndInvalidatesTheirKeys) {
  FakeHost host;  // 16 SQ entries, reserve 2
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  const uint32_t reserve = guest->invalidate_reserve();
  ASSERT_EQ(reserve, 2u);
  const uint32_t puts_fit = 16 - reserve;
  // Every key once, so the host may hold an old version of each.
  for (uint64_t i = 0; i < puts_fit + reserve; ++i) {
    guest->Put(pool, kFile, i, MakePage(i));
  }
  guest->Poll();
  const GuestCounters before = guest->counters();
  host.paused = true;
  for (uint64_t i = 0; i < puts_fit + reserve; ++i) {
    guest->Put(pool, kFile, i, MakePage(i + 100));
  }
  const GuestCounters& c = guest->counters();
  EXPECT_EQ(c.puts_sent - before.puts_sent, puts_fit);
  EXPECT_EQ(c.puts_dropped_ring_full, reserve);
  // Each dropped put became an INVAL_PAGE in the reserve.
  EXPECT_EQ(c.invalidates_for_dropped_puts, reserve);
  const uint32_t first_inval = host.sq_head() + puts_fit;
  EXPECT_EQ(host.sqe_at(first_inval).opcode, TMEM_OP_INVAL_PAGE);
  EXPECT_EQ(host.sqe_at(first_inval).index, puts_fit);
  EXPECT_EQ(c.flush_fallbacks, 0u);
  EXPECT_EQ(guest->in_flight(), 16u);
}

TEST(TmemGuestSlotTest, DroppingANeverSentKeyCostsNoRingEntry) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Poll();
  host.paused = true;
  // A stream of new keys against a stalled host: the ring fills with puts,
  // the rest drop, and nothing needs invalidating.
  for (uint64_t i = 0; i < 200; ++i) guest->Put(pool, kFile, i, MakePage(i));
  const GuestCounters& c = guest->counters();
  EXPECT_EQ(c.puts_sent, 14u);
  EXPECT_EQ(c.puts_dropped_ring_full, 186u);
  EXPECT_EQ(c.drop_invalidates_avoided, 186u);
  EXPECT_EQ(c.invalidates_for_dropped_puts, 0u);
  EXPECT_EQ(c.flush_fallbacks, 0u) << "the pool's pages survive";
  EXPECT_EQ(guest->in_flight(), 14u);
}

TEST(TmemGuestSlotTest, SharedPoolsAlwaysInvalidateDroppedPuts) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitSharedFs(TmemGuest::Uuid{3});
  host.SetAdmissionHint(0);
  guest->Put(pool, kFile, 1, MakePage(1));  // another VM may hold key 1
  EXPECT_EQ(guest->counters().invalidates_for_dropped_puts, 1u);
  EXPECT_EQ(host.op_count(TMEM_OP_INVAL_PAGE), 1u);
}

TEST(TmemGuestSlotTest, SentFilterStartsOverAfterAPoolInvalidate) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  for (uint64_t i = 0; i < 10; ++i) guest->Put(pool, kFile, i, MakePage(i));
  host.SetAdmissionHint(0);
  for (uint64_t i = 0; i < 10; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_EQ(guest->counters().invalidates_for_dropped_puts, 10u);
  guest->InvalidatePool(pool);  // the host holds nothing of it after this
  for (uint64_t i = 0; i < 10; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_EQ(guest->counters().invalidates_for_dropped_puts, 10u);
  EXPECT_EQ(guest->counters().drop_invalidates_avoided, 10u);
}

// The filter groups runs of an object's pages in one cache line (a reader's
// page-cache misses touch one line per run, not two random words per page):
// it must still never forget a sent key, and its false positives must stay
// rare at a realistic load.
TEST(TmemGuestSlotTest, SentFilterNeverForgetsAndRarelyLies) {
  FakeHostOptions ho;
  ho.region_bytes = 8 << 20;
  FakeHost host(ho);
  TmemGuestOptions o = FastOptions();
  o.sent_filter_bits = 1u << 16;  // 8 KiB: the load below sets ~12% of it
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  auto oid = [](uint64_t n) {
    return TmemGuest::ObjectId{static_cast<uint32_t>(n + 1), 9, 0, 0, 0, 0};
  };
  constexpr uint64_t kObjects = 8, kPages = 256;  // 2048 keys sent
  for (uint64_t n = 0; n < kObjects; ++n) {
    for (uint64_t i = 0; i < kPages; ++i) {
      guest->Put(pool, oid(n), i, MakePage(i));
      host.Step();
      guest->Poll();
    }
  }
  ASSERT_EQ(guest->counters().puts_sent, kObjects * kPages);
  host.SetAdmissionHint(0);
  const auto refuse_all = [&](uint64_t first_object) {
    const uint64_t before = host.op_count(TMEM_OP_INVAL_PAGE);
    for (uint64_t n = first_object; n < first_object + kObjects; ++n) {
      for (uint64_t i = 0; i < kPages; ++i) {
        guest->Put(pool, oid(n), i, MakePage(i));
        host.Step();
        guest->Poll();
      }
    }
    return host.op_count(TMEM_OP_INVAL_PAGE) - before;
  };
  // Every sent key's older page dies: no false negative.
  EXPECT_EQ(refuse_all(0), kObjects * kPages);
  // Keys never sent: at this load the filter lies for ~0.1% of them (four
  // bits in a 512-bit line); 1% would mean keys crowd into few lines.
  EXPECT_LE(refuse_all(1000), kObjects * kPages / 100);
}

TEST(TmemGuestSlotTest, WithoutTheFilterEveryDropInvalidates) {
  FakeHost host;
  TmemGuestOptions o = FastOptions();
  o.sent_filter_bits = 0;
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  // Once anything reached the pool, only a filter could tell which keys
  // did: without one, every dropped put invalidates.
  guest->Put(pool, kFile, 100, MakePage(100));
  host.SetAdmissionHint(0);
  for (uint64_t i = 0; i < 10; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_EQ(guest->counters().invalidates_for_dropped_puts, 10u);
  EXPECT_EQ(guest->counters().drop_invalidates_avoided, 0u);
}

// A streamer's cost per page-cache event: once the pool holds
// something, a put the hint refuses of a key never sent, and a get of such a
// key, are decided by the sent-keys filter alone: no ring entry, no wait,
// not even a reap of the completion waiting in the CQ.
TEST(TmemGuestSlotTest, RefusedNewKeysAndTheirGetsNeverTouchTheRing) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Poll();  // the pool is ready
  guest->Put(pool, kFile, 100, MakePage(100));
  host.Step();
  const auto unreaped = [&host] {
    return __atomic_load_n(&host.header()->cq_tail.value, __ATOMIC_ACQUIRE) -
           __atomic_load_n(&host.header()->cq_head.value, __ATOMIC_ACQUIRE);
  };
  ASSERT_EQ(unreaped(), 1u) << "the put's completion waits in the CQ";
  host.paused = true;
  host.SetAdmissionHint(0);
  const GuestCounters before = guest->counters();
  const uint64_t get_ns = guest->get_ns(), put_ns = guest->put_ns();
  for (uint64_t i = 1000; i < 2000; ++i) {
    guest->Put(pool, kFile, i, MakePage(i));
    Page out{};
    EXPECT_FALSE(guest->Get(pool, kFile, 1000 + i, out));
  }
  const GuestCounters& c = guest->counters();
  EXPECT_EQ(c.sqes_posted, before.sqes_posted);
  EXPECT_EQ(c.puts_skipped_by_hint - before.puts_skipped_by_hint, 1000u);
  EXPECT_EQ(c.drop_invalidates_avoided - before.drop_invalidates_avoided,
            1000u);
  EXPECT_EQ(c.gets_skipped_never_sent - before.gets_skipped_never_sent, 1000u);
  EXPECT_EQ(c.gets_timeout, before.gets_timeout);
  EXPECT_EQ(c.completions_reaped, before.completions_reaped);
  EXPECT_EQ(unreaped(), 1u) << "no reap: the filter alone decided";
  // Nor the clock (two reads per call cost a TCG guest more than the
  // decision): counted above, not timed.
  EXPECT_EQ(guest->get_ns(), get_ns);
  EXPECT_EQ(guest->put_ns(), put_ns);
  // Key 100 was sent: refusing its new version must still invalidate the
  // old one, behind the paused host.
  guest->Put(pool, kFile, 100, MakePage(101));
  EXPECT_EQ(guest->counters().invalidates_for_dropped_puts, 1u);
  host.paused = false;
  host.Step();
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 100, out)) << "the old version died";
}

// Cheap when off: before any put reached a private pool the host
// holds nothing of it, filter or not, so nothing crosses the ring.
TEST(TmemGuestSlotTest, NothingSentYetNeedsNoInvalidateEvenWithoutAFilter) {
  FakeHost host;
  TmemGuestOptions o = FastOptions();
  o.sent_filter_bits = 0;
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  host.Step();
  const uint32_t tail =
      __atomic_load_n(&host.header()->sq_tail.value, __ATOMIC_ACQUIRE);
  host.SetAdmissionHint(0);
  Page out{};
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_FALSE(guest->Get(pool, kFile, i, out));
    guest->Put(pool, kFile, i, MakePage(i));
    guest->InvalidatePage(pool, kFile, i);
  }
  EXPECT_EQ(__atomic_load_n(&host.header()->sq_tail.value, __ATOMIC_ACQUIRE),
            tail);
  const GuestCounters& c = guest->counters();
  EXPECT_EQ(c.invalidates_for_dropped_puts, 0u);
  EXPECT_EQ(c.drop_invalidates_avoided, 10u);
  EXPECT_EQ(c.gets_skipped_never_sent, 10u);
  EXPECT_EQ(c.invalidates_skipped_never_sent, 10u);
}

TEST(TmemGuestSlotTest, DroppedPutNeverLetsAnOlderVersionBack) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Put(pool, kFile, 1, MakePage(1));  // v1 stored
  host.SetAdmissionHint(0);
  guest->Put(pool, kFile, 1, MakePage(2));  // v2 skipped
  EXPECT_EQ(guest->counters().puts_skipped_by_hint, 1u);
  host.SetAdmissionHint(TMEM_ADMIT_ALL);
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out)) << "v1 must not come back";
}

// ---------------------------------------------------------------------------
// Flush barrier

// Fills the whole ring of a paused host: puts of keys 0.. up to the
// invalidate reserve, then invalidates of keys that were put (those of
// never-sent keys cost no entry).
void FillRing(FakeHost* host, TmemGuest* guest, int pool) {
  host->paused = true;
  for (uint64_t i = 0; guest->in_flight() < 16; ++i) {
    if (guest->in_flight() < 14) {
      guest->Put(pool, kFile, i, MakePage(i));
    } else {
      guest->InvalidatePage(pool, kFile, i % 14);
    }
  }
}

// The barrier itself: no page invalidate waits for room (deferred
// invalidates are tested below).
TmemGuestOptions NoDeferredInvalidates() {
  TmemGuestOptions o = FastOptions();
  o.deferred_invalidates = 0;
  return o;
}

class FlushBarrierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    guest_ = MustCreate(&host_, NoDeferredInvalidates());
    pool_ = *guest_->InitFs();
    other_ = *guest_->InitFs();
    guest_->Put(pool_, kFile, 100, MakePage(100));   // stored before
    guest_->Put(other_, kFile, 100, MakePage(101));  // stored before
    guest_->Poll();
    FillRing(&host_, guest_.get(), pool_);
    ASSERT_EQ(guest_->counters().flush_fallbacks, 0u);
  }

  FakeHost host_;
  std::unique_ptr<TmemGuest> guest_;
  int pool_ = -1;
  int other_ = -1;
};

TEST_F(FlushBarrierTest, InvalidateOnAFullRingRequestsABarrier) {
  guest_->InvalidatePage(pool_, kFile, 100);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 1u);
  EXPECT_TRUE(guest_->flush_pending());
  tmem_shm_header* h = host_.header();
  EXPECT_EQ(Load64(&h->flush_request),
            uint64_t{1} << guest_->host_pool_id(pool_));
  EXPECT_EQ(Load64(&h->flush_request_seq), Load32(&h->sq_tail.value))
      << "seq = sq_tail at the request";

  // While pending: gets of the pool miss without the ring, puts drop.
  Page out{};
  const uint64_t posted = Load32(&h->sq_tail.value);
  EXPECT_FALSE(guest_->Get(pool_, kFile, 100, out));
  guest_->Put(pool_, kFile, 5, MakePage(5));
  EXPECT_EQ(guest_->counters().gets_miss_local, 1u);
  EXPECT_EQ(guest_->counters().puts_dropped_flush_pending, 1u);
  // More invalidates of the flagged pool are covered: nothing new.
  guest_->InvalidateObject(pool_, kFile);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 1u);
  EXPECT_EQ(Load32(&h->sq_tail.value), posted);

  // The host catches up, applies the barrier, acks it.
  host_.paused = false;
  EXPECT_EQ(host_.Step(), 16u);
  EXPECT_EQ(host_.flushes_applied(), 1u);
  guest_->Poll();
  EXPECT_FALSE(guest_->flush_pending());
  EXPECT_EQ(Load64(&h->flush_request), 0u) << "bits cleared once acked";
  EXPECT_EQ(guest_->free_slots(), guest_->slots_usable());
  EXPECT_FALSE(guest_->Get(pool_, kFile, 100, out)) << "flushed";
  EXPECT_TRUE(guest_->Get(other_, kFile, 100, out)) << "other pool untouched";
  // And the pool works again.
  guest_->Put(pool_, kFile, 100, MakePage(100));
  EXPECT_TRUE(guest_->Get(pool_, kFile, 100, out));
  EXPECT_EQ(out, MakePage(100));
}

TEST_F(FlushBarrierTest, ASecondPoolWaitsForThePendingBarrier) {
  guest_->InvalidatePage(pool_, kFile, 100);
  guest_->InvalidatePage(other_, kFile, 100);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 2u);
  // Only the first pool's bit is in the header: bits added to a barrier the
  // host might be acking right now could be acked unflushed.
  EXPECT_EQ(Load64(&host_.header()->flush_request),
            uint64_t{1} << guest_->host_pool_id(pool_));
  Page out{};
  EXPECT_FALSE(guest_->Get(other_, kFile, 100, out)) << "flagged meanwhile";
  EXPECT_EQ(guest_->counters().gets_miss_local, 1u);

  host_.paused = false;
  host_.Step();    // executes the ring, applies the first barrier
  guest_->Poll();  // sees the ack, sends INVAL_POOL for the second pool
  host_.Step();
  guest_->Poll();
  EXPECT_FALSE(guest_->flush_pending());
  EXPECT_GE(host_.op_count(TMEM_OP_INVAL_POOL), 1u);
  EXPECT_FALSE(guest_->Get(other_, kFile, 100, out)) << "invalidated";
}

TEST_F(FlushBarrierTest, DroppedPutOnAFullRingFallsBackToTheBarrier) {
  guest_->Put(pool_, kFile, 100, MakePage(999));  // dropped, ring full
  EXPECT_EQ(guest_->counters().puts_dropped_ring_full, 1u);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 1u);
  host_.paused = false;
  host_.Step();
  guest_->Poll();
  Page out{};
  EXPECT_FALSE(guest_->Get(pool_, kFile, 100, out)) << "old version killed";
}

// ---------------------------------------------------------------------------
// Deferred invalidates: a page invalidate that finds the ring full waits for
// room instead of flushing the whole pool.

class DeferredInvalidateTest : public ::testing::Test {
 protected:
  virtual TmemGuestOptions Options() { return FastOptions(); }

  void SetUp() override {
    guest_ = MustCreate(&host_, Options());
    ASSERT_NE(guest_, nullptr);
    pool_ = *guest_->InitFs();
    for (uint64_t i = 100; i < 104; ++i) {
      guest_->Put(pool_, kFile, i, MakePage(i));  // stored before
    }
    guest_->Poll();
    host_.Step();
    guest_->Poll();
    FillRing(&host_, guest_.get(), pool_);
    ASSERT_EQ(guest_->counters().invalidates_deferred, 0u);
  }

  // Lets the host run the ring, the guest reap (posting what waits), and
  // the host run those.
  void CatchUp() {
    host_.paused = false;
    host_.Step();
    guest_->Poll();
    host_.Step();
    guest_->Poll();
  }

  FakeHost host_;
  std::unique_ptr<TmemGuest> guest_;
  int pool_ = -1;
};

TEST_F(DeferredInvalidateTest, InvalidateOnAFullRingWaitsForRoom) {
  const uint32_t posted = Load32(&host_.header()->sq_tail.value);
  guest_->InvalidatePage(pool_, kFile, 100);
  EXPECT_EQ(guest_->counters().invalidates_deferred, 1u);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 0u);
  EXPECT_FALSE(guest_->flush_pending());
  // Meanwhile a get of that key misses without the ring.
  Page out{};
  EXPECT_FALSE(guest_->Get(pool_, kFile, 100, out));
  EXPECT_EQ(guest_->counters().gets_skipped_invalidating, 1u);
  EXPECT_EQ(Load32(&host_.header()->sq_tail.value), posted);

  const uint64_t invals = host_.op_count(TMEM_OP_INVAL_PAGE);
  CatchUp();
  // The two that filled the ring, and the one that waited.
  EXPECT_EQ(host_.op_count(TMEM_OP_INVAL_PAGE), invals + 3);
  EXPECT_FALSE(guest_->Get(pool_, kFile, 100, out)) << "killed on the host";
  // The rest of the pool survives (a flush would have taken it).
  EXPECT_TRUE(guest_->Get(pool_, kFile, 101, out));
  EXPECT_EQ(out, MakePage(101));
  EXPECT_EQ(host_.flushes_applied(), 0u);
}

TEST_F(DeferredInvalidateTest, DroppedPutKillsTheOlderPageOnceThereIsRoom) {
  guest_->Put(pool_, kFile, 101, MakePage(999));  // dropped: ring full
  EXPECT_EQ(guest_->counters().puts_dropped_ring_full, 1u);
  EXPECT_EQ(guest_->counters().invalidates_deferred, 1u);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 0u);
  CatchUp();
  Page out{};
  EXPECT_FALSE(guest_->Get(pool_, kFile, 101, out)) << "old version killed";
  EXPECT_TRUE(guest_->Get(pool_, kFile, 102, out));
  EXPECT_EQ(out, MakePage(102));
}

TEST_F(DeferredInvalidateTest, ALaterPutOfTheKeySupersedesIt) {
  guest_->InvalidatePage(pool_, kFile, 100);
  ASSERT_EQ(guest_->counters().invalidates_deferred, 1u);
  // The host consumes the ring; before the guest reaps, a new version of
  // the key is put: it replaces the host's page in ring order, so the
  // waiting invalidate must not follow it.
  host_.paused = false;
  host_.Step();
  guest_->Put(pool_, kFile, 100, MakePage(555));
  const uint64_t invals = host_.op_count(TMEM_OP_INVAL_PAGE);
  host_.Step();
  guest_->Poll();
  host_.Step();
  EXPECT_EQ(host_.op_count(TMEM_OP_INVAL_PAGE), invals);
  Page out{};
  EXPECT_TRUE(guest_->Get(pool_, kFile, 100, out));
  EXPECT_EQ(out, MakePage(555));
}

class TwoDeferredInvalidatesTest : public DeferredInvalidateTest {
 protected:
  TmemGuestOptions Options() override {
    TmemGuestOptions o = FastOptions();
    o.deferred_invalidates = 2;
    return o;
  }
};

TEST_F(TwoDeferredInvalidatesTest, PastTheBoundThePoolFallsBackToTheBarrier) {
  guest_->InvalidatePage(pool_, kFile, 100);
  guest_->InvalidatePage(pool_, kFile, 101);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 0u);
  guest_->InvalidatePage(pool_, kFile, 102);
  EXPECT_EQ(guest_->counters().invalidates_deferred, 2u);
  EXPECT_EQ(guest_->counters().flush_fallbacks, 1u);
  EXPECT_TRUE(guest_->flush_pending());
  CatchUp();
  Page out{};
  EXPECT_FALSE(guest_->Get(pool_, kFile, 103, out)) << "flushed";
}

TEST(TmemGuestFlushTest, WithoutBarrierSupportTheGuestResetsItsGeneration) {
  FakeHostOptions o;
  o.features = TMEM_FEAT_SHARED_POOLS;
  FakeHost host(o);
  auto guest = MustCreate(&host, NoDeferredInvalidates());
  const int pool = *guest->InitFs();
  // Sent keys: invalidates of never-sent keys cost no ring entry.
  guest->Put(pool, kFile, 1, MakePage(1));
  guest->Put(pool, kFile, 2, MakePage(2));
  guest->Poll();
  host.paused = true;
  while (guest->in_flight() < 16) guest->InvalidatePage(pool, kFile, 1);
  const uint64_t gen = guest->guest_generation();
  guest->InvalidatePage(pool, kFile, 2);
  EXPECT_EQ(guest->counters().guest_resets, 1u);
  EXPECT_NE(guest->guest_generation(), gen);
  EXPECT_EQ(Load64(&host.header()->guest_generation),
            guest->guest_generation());
  EXPECT_EQ(guest->host_pool_id(pool), -1) << "pool ids void";
  host.paused = false;
  host.Step();
  EXPECT_EQ(host.guest_generation_changes(), 1u);
}

// ---------------------------------------------------------------------------
// Admission hint

// The hint admits its fraction of the puts in whole blocks of
// TMEM_GET_BATCH_MAX pages (the choice moves every 4096 puts; here the
// epochs start at block boundaries), and a block shut out in one epoch gets
// its chance in the next. Whole blocks of
// TMEM_GET_BATCH_MAX pages of an object, so a re-read window is served wholly
// by tmem or wholly by the disk (per-page samples would fragment the disk's
// readahead).
TEST(TmemGuestHintTest, AdmitsTheHintedFractionInWholeBlocks) {
  FakeHostOptions o;
  o.region_bytes = 8 << 20;
  FakeHost host(o);
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  host.SetAdmissionHint(TMEM_ADMIT_ALL / 4);
  constexpr uint64_t kObjects = 64;
  constexpr uint64_t kPagesPerObject = uint64_t{4} * TMEM_GET_BATCH_MAX;
  auto oid = [](uint64_t n) {
    return TmemGuest::ObjectId{static_cast<uint32_t>(n + 1), 7, 0, 0, 0, 0};
  };
  for (uint64_t n = 0; n < kObjects; ++n) {
    for (uint64_t i = 0; i < kPagesPerObject; ++i) {
      guest->Put(pool, oid(n), i, MakePage(i));
      if (i % 4 == 3) {  // the host keeps up: no put is lost to a full ring
        host.Step();
        guest->Poll();
      }
    }
  }
  host.Step();
  guest->Poll();
  const GuestCounters& c = guest->counters();
  ASSERT_EQ(host.op_count(TMEM_OP_PUT), c.puts_sent);
  const uint64_t all = kObjects * kPagesPerObject;
  EXPECT_EQ(c.puts_sent + c.puts_skipped_by_hint, all);
  EXPECT_EQ(c.puts_dropped_ring_full, 0u);
  // 256 blocks at 1/4 each: 64 expected; far outside 32..96 means the
  // hint is not what decides.
  EXPECT_GE(c.puts_sent, uint64_t{32} * TMEM_GET_BATCH_MAX);
  EXPECT_LE(c.puts_sent, uint64_t{96} * TMEM_GET_BATCH_MAX);
  EXPECT_EQ(c.puts_sent % TMEM_GET_BATCH_MAX, 0u);
  // New keys: skipping them needs no invalidate, except where the sent-keys
  // filter (a Bloom filter: false positives, never false negatives) cannot
  // rule the key out; then the invalidate is sent, never skipped.
  EXPECT_EQ(c.drop_invalidates_avoided + host.op_count(TMEM_OP_INVAL_PAGE),
            c.puts_skipped_by_hint);
  EXPECT_LE(host.op_count(TMEM_OP_INVAL_PAGE), c.puts_skipped_by_hint / 100);
  uint64_t held = 0;
  for (uint64_t n = 0; n < kObjects; ++n) {
    for (uint64_t b = 0; b < kPagesPerObject; b += TMEM_GET_BATCH_MAX) {
      const bool first = host.HasPage(0, oid(n), b);
      for (uint64_t i = b; i < b + TMEM_GET_BATCH_MAX; ++i) {
        ASSERT_EQ(host.HasPage(0, oid(n), i), first)
            << "object " << n << " page " << i << ": a block was split";
      }
      held += first ? TMEM_GET_BATCH_MAX : 0;
    }
  }
  EXPECT_EQ(held, c.puts_sent);

  // The same keys again, in later epochs: other blocks get their chance
  // (a block refused now is also invalidated, so the host holds exactly
  // the blocks this round admitted).
  std::vector<bool> before;
  for (uint64_t n = 0; n < kObjects; ++n) {
    for (uint64_t b = 0; b < kPagesPerObject; b += TMEM_GET_BATCH_MAX) {
      before.push_back(host.HasPage(0, oid(n), b));
    }
  }
  for (uint64_t n = 0; n < kObjects; ++n) {
    for (uint64_t i = 0; i < kPagesPerObject; ++i) {
      guest->Put(pool, oid(n), i, MakePage(i + 1));
      if (i % 4 == 3) {
        host.Step();
        guest->Poll();
      }
    }
  }
  host.Step();
  guest->Poll();
  size_t k = 0, newly = 0;
  for (uint64_t n = 0; n < kObjects; ++n) {
    for (uint64_t b = 0; b < kPagesPerObject; b += TMEM_GET_BATCH_MAX) {
      newly += host.HasPage(0, oid(n), b) && !before[k];
      ++k;
    }
  }
  EXPECT_GT(newly, 0u) << "the same blocks were chosen again";
}

TEST(TmemGuestHintTest, SkippedPutsKillWhatTheHostHolds) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  for (uint64_t i = 0; i < 250; ++i) guest->Put(pool, kFile, i, MakePage(i));
  guest->Poll();
  EXPECT_EQ(guest->counters().puts_sent, 250u);
  // The same keys again, all skipped: the 250 the host may hold must have
  // their older pages killed (the filter may add a few false positives).
  host.SetAdmissionHint(0);
  for (uint64_t i = 0; i < 250; ++i) guest->Put(pool, kFile, i, MakePage(i));
  guest->Poll();
  const GuestCounters& c = guest->counters();
  EXPECT_EQ(c.puts_sent, 250u);
  EXPECT_GE(c.invalidates_for_dropped_puts, 250u);
  EXPECT_LE(c.invalidates_for_dropped_puts, 260u);
  EXPECT_EQ(host.op_count(TMEM_OP_INVAL_PAGE), c.invalidates_for_dropped_puts);
  for (uint64_t i = 0; i < 250; ++i) {
    EXPECT_FALSE(host.HasPage(0, kFile, i)) << i;
  }
}

TEST(TmemGuestHintTest, IgnoredWhenTheHostDoesNotOfferIt) {
  FakeHostOptions o;
  o.features = TMEM_FEAT_FLUSH_BARRIER;
  FakeHost host(o);
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  host.SetAdmissionHint(0);
  for (uint64_t i = 0; i < 10; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_EQ(guest->counters().puts_sent, 10u);
}

TEST(TmemGuestHintTest, HostDroppedPutsAreCounted) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  host.drop_puts = true;
  guest->Put(pool, kFile, 1, MakePage(1));
  guest->Poll();
  EXPECT_EQ(guest->counters().puts_sent, 1u);
  EXPECT_EQ(guest->counters().puts_dropped_by_host, 1u);
  EXPECT_EQ(guest->counters().errors, 0u);
}

// ---------------------------------------------------------------------------
// Timeouts, generations, resets, hostile hosts

TEST(TmemGuestTimeoutTest, GetTimesOutIntoAMissAndKeepsItsSlot) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Put(pool, kFile, 1, MakePage(1));
  guest->Poll();
  const uint32_t all = guest->free_slots();
  host.paused = true;
  Page out{};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_GE(std::chrono::steady_clock::now() - start,
            std::chrono::milliseconds(20));
  EXPECT_EQ(guest->counters().gets_timeout, 1u);
  EXPECT_EQ(guest->counters().gets_miss, 1u);
  EXPECT_EQ(guest->free_slots(), all - 1) << "the host may still write it";
  host.paused = false;
  host.Step();  // the late GET hits (and, exclusive, removes the page)
  guest->Poll();
  EXPECT_EQ(guest->free_slots(), all);
  EXPECT_EQ(guest->counters().gets_hit, 0u) << "a late hit is not delivered";
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
}

TEST(TmemGuestTimeoutTest, ADeadHostStopsCostingATimeoutPerGet) {
  FakeHost host;
  TmemGuestOptions o = FastOptions();
  o.skip_unsent_gets = false;  // these gets must reach the (stalled) host
  o.get_timeout = std::chrono::milliseconds(5);
  o.stall_after_timeouts = 3;
  o.stall_probe_interval = std::chrono::milliseconds(200);
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  host.paused = true;  // "killed": READY stays, nothing consumes
  Page out{};
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(guest->Get(pool, kFile, i, out));
  EXPECT_EQ(guest->counters().gets_timeout, 3u);
  EXPECT_EQ(guest->counters().host_stalls, 1u);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(guest->Get(pool, kFile, i, out));
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            std::chrono::milliseconds(100))
      << "no more waiting";
  EXPECT_EQ(guest->counters().gets_skipped_stalled, 100u);
  EXPECT_EQ(guest->counters().gets_timeout, 3u);

  // The host comes back: its progress ends the stall at once.
  host.paused = false;
  host.Step();
  guest->Put(pool, kFile, 1, MakePage(1));
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(guest->counters().gets_skipped_stalled, 100u);
}

TEST(TmemGuestTimeoutTest, AStalledHostIsProbedAgain) {
  FakeHost host;
  TmemGuestOptions o = FastOptions();
  o.skip_unsent_gets = false;  // these gets must reach the (stalled) host
  o.get_timeout = std::chrono::milliseconds(5);
  o.stall_after_timeouts = 2;
  o.stall_probe_interval = std::chrono::milliseconds(20);
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  host.paused = true;
  Page out{};
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(guest->Get(pool, kFile, i, out));
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(guest->counters().gets_skipped_stalled, 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(25));
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));  // the probe: waits again
  EXPECT_EQ(guest->counters().gets_timeout, 3u);
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(guest->counters().gets_skipped_stalled, 2u);
}

TEST(TmemGuestTimeoutTest, ASlowButMovingHostIsNotStalled) {
  FakeHost host;
  TmemGuestOptions o = FastOptions();
  o.skip_unsent_gets = false;  // these gets must reach the (stalled) host
  o.get_timeout = std::chrono::milliseconds(5);
  o.stall_after_timeouts = 2;
  auto guest = MustCreate(&host, o);
  const int pool = *guest->InitFs();
  host.paused = true;
  Page out{};
  for (int i = 0; i < 5; ++i) {
    EXPECT_FALSE(guest->Get(pool, kFile, i, out));
    host.Step(1);  // consumes something between the timeouts
  }
  EXPECT_EQ(guest->counters().gets_timeout, 5u);
  EXPECT_EQ(guest->counters().host_stalls, 0u);
  EXPECT_EQ(guest->counters().gets_skipped_stalled, 0u);
}

TEST(TmemGuestResetTest, HostResetVoidsPoolsWhichComeBackLazily) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Put(pool, kFile, 1, MakePage(1));
  const uint64_t gen = guest->guest_generation();

  host.Reset();
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(guest->counters().host_resets_seen, 1u);
  EXPECT_EQ(guest->counters().gets_miss_local, 1u);
  EXPECT_EQ(guest->host_generation(), 101u);
  EXPECT_NE(guest->guest_generation(), gen) << "re-attach, new generation";
  EXPECT_EQ(Load64(&host.header()->guest_generation),
            guest->guest_generation());
  EXPECT_EQ(guest->free_slots(), guest->slots_usable()) << "new rings";

  // That Get started re-creating the pool; the same handle works again.
  guest->Put(pool, kFile, 1, MakePage(11));
  EXPECT_EQ(guest->host_pool_id(pool), 0);
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(out, MakePage(11));
  EXPECT_EQ(guest->counters().pools_created, 2u);
  EXPECT_EQ(guest->counters().errors, 0u);
}

TEST(TmemGuestResetTest, PutsDropUntilThePoolIsRecreated) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  host.Reset();
  host.paused = true;  // NEW_POOL not answered yet
  guest->Put(pool, kFile, 1, MakePage(1));
  guest->Put(pool, kFile, 2, MakePage(2));
  EXPECT_EQ(guest->counters().puts_dropped_no_pool, 2u);
  EXPECT_EQ(host.op_count(TMEM_OP_NEW_POOL), 1u);
  host.paused = false;
  host.Step();
  guest->Put(pool, kFile, 3, MakePage(3));
  EXPECT_EQ(guest->counters().puts_sent, 1u);
}

TEST(TmemGuestResetTest, HostNotReadyMeansMissesAndDrops) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  host.SetState(TMEM_HOST_STATE_RESET);
  Page out{};
  guest->Put(pool, kFile, 1, MakePage(1));
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_FALSE(guest->attached());
  EXPECT_EQ(guest->counters().puts_dropped_no_pool, 1u);
  EXPECT_EQ(guest->counters().gets_miss_local, 1u);
  host.Reset();                             // READY with a new generation
  guest->Put(pool, kFile, 1, MakePage(1));  // triggers re-creation
  guest->Put(pool, kFile, 1, MakePage(1));
  EXPECT_TRUE(guest->Get(pool, kFile, 1, out));
}

TEST(TmemGuestResetTest, SharedPoolIsWipedWhenRejoinedAfterAReset) {
  // Other VMs keep a shared pool alive across our reset, and our invalidates
  // still in the ring were lost with it: the rejoin starts with INVAL_POOL.
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitSharedFs(TmemGuest::Uuid{1});
  guest->Put(pool, kFile, 1, MakePage(1));
  host.Reset();
  guest->Poll();
  guest->Put(pool, kFile, 2, MakePage(2));  // starts re-creating
  guest->Put(pool, kFile, 2, MakePage(2));  // ready: INVAL_POOL, then put
  EXPECT_EQ(host.op_count(TMEM_OP_INVAL_POOL), 1u);
  Page out{};
  EXPECT_TRUE(guest->Get(pool, kFile, 2, out));
}

TEST(TmemGuestHostileTest, CorruptCqTailStopsTheRingUntilAReset) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  guest->Put(pool, kFile, 1, MakePage(1));
  guest->Poll();
  __atomic_store_n(&host.header()->cq_tail.value, 1000u, __ATOMIC_RELEASE);
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(guest->counters().errors, 1u);
  EXPECT_FALSE(guest->attached());
  guest->Put(pool, kFile, 2, MakePage(2));
  EXPECT_EQ(guest->counters().puts_dropped_no_pool, 1u);
  host.Reset();
  guest->Put(pool, kFile, 2, MakePage(2));
  guest->Put(pool, kFile, 2, MakePage(2));
  EXPECT_TRUE(guest->Get(pool, kFile, 2, out));
  EXPECT_EQ(guest->counters().errors, 1u);
}

TEST(TmemGuestHostileTest, CorruptSqHeadIsAFault) {
  FakeHost host;
  auto guest = MustCreate(&host);
  const int pool = *guest->InitFs();
  __atomic_store_n(&host.header()->sq_head.value, 5000u, __ATOMIC_RELEASE);
  guest->Put(pool, kFile, 1, MakePage(1));
  EXPECT_EQ(guest->counters().errors, 1u);
  EXPECT_EQ(guest->counters().puts_sent, 0u);
}

TEST(TmemGuestHostileTest, UnknownCompletionTagsAreSkipped) {
  FakeHost host;
  auto guest = MustCreate(&host);
  (void)*guest->InitFs();
  guest->Poll();
  tmem_shm_header* h = host.header();
  const uint32_t tail = Load32(&h->cq_tail.value);
  tmem_cqe bogus{0xdeadbeef, TMEM_OK, 1};
  std::memcpy(
      host.shm_base() + host.cq_offset() + (tail & 15) * sizeof(tmem_cqe),
      &bogus, sizeof(bogus));
  __atomic_store_n(&h->cq_tail.value, tail + 1, __ATOMIC_RELEASE);
  guest->Poll();
  EXPECT_EQ(guest->counters().stale_completions, 1u);
  EXPECT_EQ(Load32(&h->cq_head.value), tail + 1);
}

// ---------------------------------------------------------------------------
// Coherency against a threaded host, roomy and cramped.

struct CoherencyCase {
  uint32_t sq_entries;
  uint32_t slots;
  bool doorbell;
  uint32_t hint;
};

class TmemGuestCoherencyTest : public ::testing::TestWithParam<CoherencyCase> {
};

TEST_P(TmemGuestCoherencyTest, EveryHitIsTheLatestPut) {
  const CoherencyCase& p = GetParam();
  FakeHostOptions o;
  o.sq_entries = p.sq_entries;
  o.cq_entries = p.sq_entries;
  o.slot_count = p.slots;
  o.region_bytes = 1 << 20;
  o.needs_doorbell = p.doorbell;
  FakeHost host(o);
  host.SetAdmissionHint(p.hint);
  host.Start();
  TmemGuestOptions go = FastOptions();
  go.get_timeout = std::chrono::milliseconds(200);
  auto guest = MustCreate(&host, go);
  WorkloadConfig config;
  config.kind = WorkloadKind::kCoherency;
  config.pages = 300;
  config.ops = 20'000;
  config.seed = p.sq_entries * 31 + p.hint;
  WorkloadResult r = RunWorkload(*guest, config);
  host.Stop();
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.mismatches, 0u) << r.mismatch_report;
  EXPECT_GT(r.hits, 0u);
  EXPECT_EQ(r.verified_hits, r.hits);
  EXPECT_EQ(guest->counters().errors, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Rings, TmemGuestCoherencyTest,
    ::testing::Values(CoherencyCase{64, 128, true, TMEM_ADMIT_ALL},
                      CoherencyCase{64, 128, false, TMEM_ADMIT_ALL},
                      CoherencyCase{8, 16, false, TMEM_ADMIT_ALL},
                      CoherencyCase{16, 32, true, TMEM_ADMIT_ALL / 3}));

// The check itself must catch a broken host, or its passing means nothing.
// Runs the coherency workload against `host` (already configured broken).
WorkloadResult RunCoherencyAgainst(FakeHost& host) {
  host.Start();
  auto guest = MustCreate(&host);
  WorkloadConfig config;
  config.kind = WorkloadKind::kCoherency;
  // Few keys, many ops: a host thread racing the guest drops puts (ring
  // full), which invalidates keys and hides the fault; the broken case must
  // come up anyway.
  config.pages = 16;
  config.ops = 20000;
  WorkloadResult r = RunWorkload(*guest, config);
  host.Stop();
  return r;
}

TEST(TmemGuestCoherencyCheckTest, CatchesAHostThatIgnoresInvalidates) {
  FakeHost host;
  host.ignore_invalidates = true;
  const WorkloadResult r = RunCoherencyAgainst(host);
  EXPECT_GT(r.mismatches, 0u);
  EXPECT_THAT(r.mismatch_report, HasSubstr("expected a miss"));
}

TEST(TmemGuestCoherencyCheckTest, CatchesAHostThatKeepsStaleVersions) {
  FakeHost host;
  host.keep_first_put = true;
  const WorkloadResult r = RunCoherencyAgainst(host);
  EXPECT_GT(r.mismatches, 0u);
  EXPECT_THAT(r.mismatch_report, HasSubstr("STALE version"));
}

}  // namespace
}  // namespace tmem
