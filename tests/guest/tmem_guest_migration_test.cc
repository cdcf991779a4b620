// Live migration and a vanishing host, seen from the guest core
// (guest-driver/core/, shared with the kernel module): the
// destination tmemd resets the foreign region it received under a running
// guest whose entries are still in flight, and a source that stops
// consuming must never hold the guest past its configured bounds.
//
// What the destination does (host-agent/channel: IsForeign/OnForeignRegion,
// SharedRegion::ResetTo) is FakeHost::Reset's sequence on the same mapping:
// RESET, a new generation, indices and flush fields zeroed, no pools, READY.
// The guest's core state (tail, pending table, slots, flush barrier) is
// whatever it was on the source when the VM was stopped.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "guest-driver/userspace/workloads.h"
#include "tests/guest/fake_host.h"

namespace tmem {
namespace {

using testing::FakeHost;
using testing::FakeHostOptions;
using Page = std::array<uint8_t, TMEM_PAGE_SIZE>;
using Clock = std::chrono::steady_clock;

constexpr TmemGuest::ObjectId kFile = {1, 2, 3, 4, 5, 6};

Page MakePage(uint64_t seed) {
  Page p;
  FillPage(7, seed, 1, p.data());
  return p;
}

TmemGuestOptions Options() {
  TmemGuestOptions o;
  o.get_timeout = std::chrono::milliseconds(20);
  o.attach_timeout = std::chrono::milliseconds(200);
  o.pool_create_timeout = std::chrono::milliseconds(100);
  o.skip_unsent_gets = false;  // every get below must reach the host
  return o;
}

std::unique_ptr<TmemGuest> MustCreate(FakeHost* host,
                                      const TmemGuestOptions& o) {
  absl::StatusOr<std::unique_ptr<TmemGuest>> g = TmemGuest::Create(host, o);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(*g) : nullptr;
}

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The VM stops on the source with a full ring: puts, invalidates and a
// pending flush barrier that the source never executed. The destination
// resets the region. Every slot and entry must come back, no page from the
// source may be served, and tmem must work again.
TEST(TmemGuestMigrationTest, ResetUnderEntriesInFlightRecoversEverything) {
  FakeHost host;  // 16 SQ entries, 48 slots
  auto guest = MustCreate(&host, Options());
  ASSERT_NE(guest, nullptr);
  const int pool = *guest->InitFs();
  for (uint64_t i = 0; i < 4; ++i) guest->Put(pool, kFile, i, MakePage(i));
  ASSERT_EQ(host.page_count(), 4u);

  // The source stops consuming (the VM is being stopped for the last copy).
  host.paused = true;
  for (uint64_t i = 10; i < 40; ++i) guest->Put(pool, kFile, i, MakePage(i));
  for (uint64_t i = 0; i < 4; ++i) guest->InvalidatePage(pool, kFile, i);
  ASSERT_GT(guest->in_flight(), 0u);
  ASSERT_LT(guest->free_slots(), guest->slots_usable());
  const uint64_t resets_before = guest->counters().host_resets_seen;

  // Arrived: the destination resets what it received.
  host.Reset();
  host.paused = false;

  // No page of the source comes back, and nothing waits for its entries.
  Page out{};
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_FALSE(guest->Get(pool, kFile, i, out)) << "page " << i;
  }
  EXPECT_EQ(guest->counters().host_resets_seen, resets_before + 1);
  EXPECT_EQ(guest->in_flight(), 0u) << "the source's entries are void";
  EXPECT_EQ(guest->free_slots(), guest->slots_usable());
  EXPECT_EQ(host.header()->flush_request, 0u) << "no barrier survives";

  // Used again on the destination (the pool is made again lazily).
  guest->Put(pool, kFile, 1, MakePage(101));
  guest->Put(pool, kFile, 1, MakePage(101));
  ASSERT_TRUE(guest->Get(pool, kFile, 1, out));
  EXPECT_EQ(out, MakePage(101));
  EXPECT_EQ(guest->counters().gets_timeout, 0u);
  EXPECT_EQ(guest->counters().errors, 0u);
}

// A get waiting for its completion when the destination resets the region
// ends at once as a miss, instead of sitting out its timeout.
TEST(TmemGuestMigrationTest, GetWaitingAcrossTheResetEndsAsAMiss) {
  FakeHost host;
  TmemGuestOptions o = Options();
  o.get_timeout = std::chrono::seconds(20);
  o.stall_after_timeouts = 0;
  auto guest = MustCreate(&host, o);
  ASSERT_NE(guest, nullptr);
  const int pool = *guest->InitFs();
  guest->Put(pool, kFile, 1, MakePage(1));
  ASSERT_EQ(host.page_count(), 1u);
  host.paused = true;  // the source will never answer this get

  std::atomic<bool> returned{false};
  bool hit = true;
  Page out{};
  const Clock::time_point t0 = Clock::now();
  std::thread reader([&] {
    hit = guest->Get(pool, kFile, 1, out);
    returned = true;
  });
  // Wait until the get is posted: its SQE is in the ring.
  while (__atomic_load_n(&host.header()->sq_tail.value, __ATOMIC_ACQUIRE) ==
             host.sq_head() &&
         Seconds(Clock::now() - t0) < 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(returned.load()) << "the get waits for its completion";
  host.Reset();
  reader.join();
  const double waited = Seconds(Clock::now() - t0);

  EXPECT_FALSE(hit) << "the source's page must not come back";
  EXPECT_LT(waited, 10.0) << "the reset ended the wait, not the 20 s timeout";
  EXPECT_EQ(guest->counters().gets_timeout, 0u);
  EXPECT_EQ(guest->counters().gets_miss_local, 1u);
  // The abandoned entry and its slot are freed by the re-attach that the
  // next operation (here a poll) makes on the new rings.
  guest->Poll();
  EXPECT_EQ(guest->in_flight(), 0u);
  EXPECT_EQ(guest->free_slots(), guest->slots_usable());
}

// The source is gone and nobody consumes (host_state still READY, as a
// killed tmemd or a quit source QEMU leaves it): every guest operation
// returns within its bound, and each give-up has its counter.
TEST(TmemGuestMigrationTest, AVanishedHostNeverHoldsTheGuestPastItsBounds) {
  FakeHostOptions ho;
  ho.sq_entries = 8;
  FakeHost host(ho);
  TmemGuestOptions o = Options();
  o.stall_after_timeouts = 0;  // every get waits its full timeout
  auto guest = MustCreate(&host, o);
  ASSERT_NE(guest, nullptr);
  const int pool = *guest->InitFs();
  host.paused = true;

  const Clock::time_point t0 = Clock::now();
  // A new pool: NEW_POOL is never answered.
  absl::StatusOr<TmemGuest::PoolHandle> second = guest->InitFs();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(guest->counters().pool_create_timeouts, 1u);
  // Puts fill the ring and then drop; they never wait.
  for (uint64_t i = 0; i < 32; ++i) guest->Put(pool, kFile, i, MakePage(i));
  EXPECT_GT(guest->counters().puts_dropped_ring_full, 0u);
  // Invalidates on a full ring wait for room (deferred), then fall back to
  // the flush barrier.
  for (uint64_t i = 0; i < 32; ++i) guest->InvalidatePage(pool, kFile, i);
  EXPECT_GE(guest->counters().invalidates_deferred +
                guest->counters().flush_fallbacks,
            1u);
  // Gets time out into misses.
  Page out{};
  EXPECT_FALSE(guest->Get(pool, kFile, 0, out));
  EXPECT_EQ(guest->counters().gets_timeout + guest->counters().gets_miss_local,
            1u);
  // Bounds: 100 ms pool creation + 20 ms get + 64 ring-full spins of at
  // most a few us each; 5 s is slack for a loaded, sanitized run.
  EXPECT_LT(Seconds(Clock::now() - t0), 5.0);

  // A destination shows up: everything works again.
  host.Reset();
  host.paused = false;
  guest->Put(pool, kFile, 7, MakePage(7));
  guest->Put(pool, kFile, 7, MakePage(7));
  ASSERT_TRUE(guest->Get(pool, kFile, 7, out));
  EXPECT_EQ(out, MakePage(7));
}

}  // namespace
}  // namespace tmem
