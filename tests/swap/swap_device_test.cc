// SwapDevice over a real UNIX socket, with the test playing QEMU (the
// vhost-user front-end: handshake, memfd guest memory, eventfds) and the
// guest driver (VirtqDriver on the shared memfd). Checks data integrity
// through the whole stack, reconnection, and that hostile front-ends and
// guests are refused with counters while a neighbour device serves its
// client with no error.
#include "host-agent/swap/swap_device.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "host-agent/swap/memory_swap_backing.h"
#include "host-agent/swap/vhost_user_message.h"
#include "tests/swap/vhost_user_front_end.h"
#include "tests/swap/virtq_driver.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

using testing::Bit;
using testing::FrontEnd;
using testing::Guest;
using testing::kGpa;
using testing::kGuestBytes;
using testing::kQ;
using testing::kWait;
using testing::MemTable;
using testing::State;
using testing::U64;
using testing::VirtqDriver;

constexpr uint64_t kPages = 1024;  // 4 MiB device

class SwapDeviceTest : public ::testing::Test {
 protected:
  std::unique_ptr<SwapDevice> StartDevice(const std::string& name,
                                          MemorySwapBacking* backing) {
    SwapDeviceOptions o;
    o.socket_path = dir_.path() + "/" + name + ".swap.sock";
    auto dev = SwapDevice::Start(std::move(o), backing);
    EXPECT_TRUE(dev.ok()) << dev.status();
    return dev.ok() ? *std::move(dev) : nullptr;
  }
  bool WaitFor(const std::function<bool()>& cond) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!cond()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  tmem::testing::TempDir dir_{"swapdev"};
};

TEST_F(SwapDeviceTest, PagesRoundTripThroughTheWholeStack) {
  MemorySwapBacking backing(kPages);
  auto dev = StartDevice("vm1", &backing);
  ASSERT_NE(dev, nullptr);
  auto fe = FrontEnd::Connect(dev->socket_path());
  ASSERT_NE(fe, nullptr);
  Guest g;
  g.Handshake(fe.get());
  for (uint8_t s : g.WritePages(0, 100, 7)) ASSERT_EQ(s, kVirtioBlkSOk);
  EXPECT_EQ(g.VerifyPages(0, 100, 7), 0);
  EXPECT_EQ(backing.stored_pages(), 100u);
  // Negative control: a page changed inside the store fails the check.
  ASSERT_TRUE(backing.CorruptPage(42));
  EXPECT_EQ(g.VerifyPages(0, 100, 7), 1);
  EXPECT_EQ(dev->metrics().Get(SwapCounter::kWrites), 100u);
  EXPECT_GT(dev->metrics().Get(SwapCounter::kCalls), 0u);
  EXPECT_EQ(dev->metrics().Get(SwapCounter::kSessionResets), 0u);
  EXPECT_EQ(dev->metrics().Get(SwapCounter::kQueuesBroken), 0u);
}

// The CPU of every queue pass reaches the owner (tmemd charges it to the
// VM's token bucket), measured on the loop thread's own clock.
TEST_F(SwapDeviceTest, QueuePassesChargeTheirCpu) {
  MemorySwapBacking backing(kPages);
  std::atomic<int64_t> charged{0};
  std::atomic<int> charges{0};
  SwapDeviceOptions o;
  o.socket_path = dir_.path() + "/vm1.swap.sock";
  o.charge_cpu = [&](int64_t ns) {
    EXPECT_GT(ns, 0);
    charged.fetch_add(ns);
    charges.fetch_add(1);
  };
  auto dev = SwapDevice::Start(std::move(o), &backing);
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto fe = FrontEnd::Connect((*dev)->socket_path());
  ASSERT_NE(fe, nullptr);
  Guest g;
  g.Handshake(fe.get());
  for (uint8_t s : g.WritePages(0, 100, 3)) ASSERT_EQ(s, kVirtioBlkSOk);
  EXPECT_EQ(g.VerifyPages(0, 100, 3), 0);
  EXPECT_GT(charges.load(), 0);
  EXPECT_GT(charged.load(), 0);
}

// After Stop (tmemd then writes the backing back before it exits), a
// reconnecting front-end is refused, so it retries until the next tmemd
// listens; a connect that succeeded into the stopped device's backlog
// would leave QEMU waiting on a reply that never comes.
TEST_F(SwapDeviceTest, StoppedDeviceRefusesConnections) {
  MemorySwapBacking backing(kPages);
  auto dev = StartDevice("vm1", &backing);
  ASSERT_NE(dev, nullptr);
  {
    auto fe = FrontEnd::Connect(dev->socket_path());
    ASSERT_NE(fe, nullptr);
    Guest g;
    g.Handshake(fe.get());
    dev->Stop();
    EXPECT_TRUE(fe->Closed());
  }
  EXPECT_EQ(FrontEnd::Connect(dev->socket_path()), nullptr);
}

TEST_F(SwapDeviceTest, GetVringBaseStopsTheRingAndReconnectKeepsPages) {
  MemorySwapBacking backing(kPages);
  auto dev = StartDevice("vm1", &backing);
  ASSERT_NE(dev, nullptr);
  Guest g;
  {
    auto fe = FrontEnd::Connect(dev->socket_path());
    ASSERT_NE(fe, nullptr);
    g.Handshake(fe.get(), /*event_idx=*/false);
    g.WritePages(10, 20, 3);
    ASSERT_TRUE(fe->Send(11, State(0, 0)));
    auto base = fe->Recv();
    ASSERT_TRUE(base.has_value());
    ASSERT_EQ(base->size(), 8u);
    uint32_t num;
    std::memcpy(&num, base->data() + 4, 4);
    EXPECT_EQ(num, g.submitted());
  }
  ASSERT_TRUE(WaitFor([&] { return !dev->connected(); }));
  // QEMU reconnects (reconnect=1) and restores the ring where it was.
  auto fe = FrontEnd::Connect(dev->socket_path());
  ASSERT_NE(fe, nullptr);
  ASSERT_TRUE(WaitFor([&] { return dev->connected(); }));
  ASSERT_TRUE(fe->Send(16, U64(Bit(kProtocolFeatureReplyAck))));
  ASSERT_TRUE(
      fe->Send(2, U64(Bit(kVirtioFVersion1) | Bit(kVirtioRingFIndirectDesc) |
                      Bit(kVhostUserFeatureProtocolFeatures))));
  ASSERT_TRUE(
      fe->Send(5, MemTable({{kGpa, kGuestBytes, g.uva(), 0}}), {g.memfd()}));
  g.StartRing(fe.get(), g.submitted());
  EXPECT_EQ(g.VerifyPages(10, 20, 3), 0);
  EXPECT_EQ(dev->metrics().Get(SwapCounter::kClientDisconnects), 1u);
}

TEST_F(SwapDeviceTest, FailedStartLeavesAnotherServersSocketAlone) {
  MemorySwapBacking backing(kPages);
  auto first = StartDevice("vm1", &backing);
  ASSERT_NE(first, nullptr);
  SwapDeviceOptions o;
  o.socket_path = first->socket_path();
  auto second = SwapDevice::Start(std::move(o), &backing);
  EXPECT_FALSE(second.ok());
  // Start probed the live socket (a connection the first device accepted
  // and saw go); once that is over, the socket is still there and served.
  ASSERT_TRUE(WaitFor([&] {
    return first->metrics().Get(SwapCounter::kClientDisconnects) == 1;
  }));
  auto fe = FrontEnd::Connect(first->socket_path());
  ASSERT_NE(fe, nullptr);
  ASSERT_TRUE(fe->Send(1, {}));
  EXPECT_TRUE(fe->RecvU64().has_value());
}

TEST_F(SwapDeviceTest, SecondFrontEndIsRejected) {
  MemorySwapBacking backing(kPages);
  auto dev = StartDevice("vm1", &backing);
  ASSERT_NE(dev, nullptr);
  auto a = FrontEnd::Connect(dev->socket_path());
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(WaitFor([&] { return dev->connected(); }));
  auto b = FrontEnd::Connect(dev->socket_path());
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(b->Closed());
  EXPECT_EQ(dev->metrics().Get(SwapCounter::kClientsRejectedBusy), 1u);
  ASSERT_TRUE(a->Send(1, {}));
  EXPECT_TRUE(a->RecvU64().has_value());
}

// Each hostile front-end is dropped with its counter while a neighbour
// device keeps serving a verified guest.
TEST_F(SwapDeviceTest, HostileFrontEndsBesideAVerifiedNeighbour) {
  MemorySwapBacking nb_backing(kPages);
  auto neighbour = StartDevice("good", &nb_backing);
  MemorySwapBacking backing(kPages);
  auto dev = StartDevice("evil", &backing);
  ASSERT_NE(neighbour, nullptr);
  ASSERT_NE(dev, nullptr);
  auto good_fe = FrontEnd::Connect(neighbour->socket_path());
  Guest good;
  good.Handshake(good_fe.get());
  uint32_t round = 0;
  const auto neighbour_ok = [&] {
    ++round;
    for (uint8_t s : good.WritePages(uint64_t{round} * 8, 8, round)) {
      EXPECT_EQ(s, kVirtioBlkSOk);
    }
    EXPECT_EQ(good.VerifyPages(uint64_t{round} * 8, 8, round), 0);
  };

  struct Case {
    const char* name;
    std::function<void(FrontEnd*, Guest*)> send;
    SwapCounter counter;
  };
  const std::vector<Case> cases = {
      {"bad version",
       [](FrontEnd* fe, Guest*) {
         std::vector<uint8_t> raw(12, 0);
         raw[0] = 1;
         raw[4] = 2;  // version 2
         ASSERT_EQ(send(fe->fd(), raw.data(), raw.size(), MSG_NOSIGNAL), 12);
       },
       SwapCounter::kMessagesMalformed},
      {"oversized payload",
       [](FrontEnd* fe, Guest*) { fe->Send(1, {}, {}, false, 1u << 20); },
       SwapCounter::kMessagesMalformed},
      {"fd on GET_FEATURES",
       [](FrontEnd* fe, Guest* g) { fe->Send(1, {}, {g->kick_fd()}); },
       SwapCounter::kMessagesMalformed},
      {"overlapping memory table",
       [](FrontEnd* fe, Guest* g) {
         fe->Send(5,
                  MemTable({{0, 0x200000, g->uva(), 0},
                            {0x100000, 0x200000, g->uva() + 0x400000, 0}}),
                  {g->memfd(), g->memfd()});
       },
       SwapCounter::kMemTablesRefused},
      {"region past the end of its file",
       [](FrontEnd* fe, Guest* g) {
         fe->Send(5, MemTable({{0, kGuestBytes, g->uva(), 4096}}),
                  {g->memfd()});
       },
       SwapCounter::kMemTablesRefused},
      {"features never offered",
       [](FrontEnd* fe, Guest*) { fe->Send(2, U64(Bit(63))); },
       SwapCounter::kFeaturesRefused},
      {"vring index out of range",
       [](FrontEnd* fe, Guest*) { fe->Send(8, State(200, 128)); },
       SwapCounter::kVringSetupRefused},
      {"unsupported request", [](FrontEnd* fe, Guest*) { fe->Send(31, {}); },
       SwapCounter::kMessagesUnsupported},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const uint64_t before = dev->metrics().Get(c.counter);
    auto fe = FrontEnd::Connect(dev->socket_path());
    ASSERT_NE(fe, nullptr);
    Guest g;
    c.send(fe.get(), &g);
    EXPECT_TRUE(fe->Closed());
    EXPECT_EQ(dev->metrics().Get(c.counter), before + 1);
    fe.reset();
    ASSERT_TRUE(WaitFor([&] { return !dev->connected(); }));
    neighbour_ok();
  }
  EXPECT_EQ(dev->metrics().Get(SwapCounter::kSessionResets), cases.size());

  // A guest whose descriptors loop: the queue stops, the device does not
  // crash, nothing was completed from that chain.
  {
    auto fe = FrontEnd::Connect(dev->socket_path());
    Guest g;
    g.Handshake(fe.get());
    g.drv().WriteDesc(0, 0x10000, 16, kVirtqDescFNext, 1);
    g.drv().WriteDesc(1, 0x10000, 16, kVirtqDescFNext, 0);
    g.drv().Publish(0);
    g.Kick();
    ASSERT_TRUE(WaitFor(
        [&] { return dev->metrics().Get(SwapCounter::kQueuesBroken) == 1; }));
    EXPECT_EQ(dev->metrics().Get(SwapCounter::kChainTooLong), 1u);
    EXPECT_EQ(g.drv().UsedIdx(), 0);
    // While that front-end holds the device, nobody else gets it.
    auto fe2 = FrontEnd::Connect(dev->socket_path());  // busy: rejected
    EXPECT_TRUE(fe2->Closed());
  }
  neighbour_ok();
  EXPECT_EQ(neighbour->metrics().Get(SwapCounter::kSessionResets), 0u);
  EXPECT_EQ(neighbour->metrics().Get(SwapCounter::kBackingErrors), 0u);
  EXPECT_EQ(neighbour->metrics().Get(SwapCounter::kQueuesBroken), 0u);
  EXPECT_EQ(neighbour->metrics().Get(SwapCounter::kRequestsBadLayout), 0u);
}

}  // namespace
}  // namespace tmem::swap
