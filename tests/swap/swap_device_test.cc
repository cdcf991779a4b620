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
#include "tests/swap/virtq_driver.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

using testing::VirtqDriver;

constexpr uint64_t kGuestBytes = 8 << 20;
constexpr uint64_t kGpa = 0;
constexpr uint16_t kQ = 128;
constexpr uint64_t kPages = 1024;  // 4 MiB device
// Generous: the suite runs under sanitizers on a loaded machine. Only a
// hang reaches it.
constexpr std::chrono::seconds kWait{30};

uint64_t Bit(int b) { return 1ull << b; }

// The vhost-user front-end side of a connection.
class FrontEnd {
 public:
  static std::unique_ptr<FrontEnd> Connect(const std::string& path) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close(fd);
      return nullptr;
    }
    timeval tv{30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return std::unique_ptr<FrontEnd>(new FrontEnd(fd));
  }
  ~FrontEnd() { close(fd_); }

  bool Send(uint32_t request, const std::vector<uint8_t>& payload,
            std::vector<int> fds = {}, bool need_reply = false,
            std::optional<uint32_t> size_override = {}) {
    std::vector<uint8_t> b(12);
    const uint32_t flags =
        kVhostUserVersion | (need_reply ? kVhostUserFlagNeedReply : 0);
    const uint32_t size =
        size_override.value_or(static_cast<uint32_t>(payload.size()));
    std::memcpy(b.data(), &request, 4);
    std::memcpy(b.data() + 4, &flags, 4);
    std::memcpy(b.data() + 8, &size, 4);
    b.insert(b.end(), payload.begin(), payload.end());
    iovec iov{b.data(), b.size()};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int) * 16)> ctl{};
    if (!fds.empty()) {
      mh.msg_control = ctl.data();
      mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    return sendmsg(fd_, &mh, MSG_NOSIGNAL) == static_cast<ssize_t>(b.size());
  }
  // Reads one reply; its payload, or nullopt on EOF/timeout.
  std::optional<std::vector<uint8_t>> Recv() {
    std::array<uint8_t, 12> h{};
    if (!ReadAll(h.data(), h.size())) return std::nullopt;
    uint32_t size;
    std::memcpy(&size, h.data() + 8, 4);
    std::vector<uint8_t> p(size);
    if (!ReadAll(p.data(), p.size())) return std::nullopt;
    return p;
  }
  std::optional<uint64_t> RecvU64() {
    auto p = Recv();
    if (!p || p->size() != 8) return std::nullopt;
    uint64_t v;
    std::memcpy(&v, p->data(), 8);
    return v;
  }
  // True when the device closed the connection.
  bool Closed() {
    uint8_t c;
    return recv(fd_, &c, 1, 0) == 0;
  }
  int fd() const { return fd_; }

 private:
  explicit FrontEnd(int fd) : fd_(fd) {}
  bool ReadAll(uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t r = recv(fd_, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  int fd_;
};

std::vector<uint8_t> U64(uint64_t v) {
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), &v, 8);
  return b;
}
std::vector<uint8_t> State(uint32_t index, uint32_t num) {
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), &index, 4);
  std::memcpy(b.data() + 4, &num, 4);
  return b;
}
std::vector<uint8_t> MemTable(
    const std::vector<std::array<uint64_t, 4>>& regions) {
  std::vector<uint8_t> b(8, 0);
  const auto n = static_cast<uint32_t>(regions.size());
  std::memcpy(b.data(), &n, 4);
  for (const auto& r : regions) {
    for (uint64_t v : r) {
      const auto* p = reinterpret_cast<const uint8_t*>(&v);
      b.insert(b.end(), p, p + 8);
    }
  }
  return b;
}

// Guest RAM (a memfd the "QEMU" side maps) plus one queue's eventfds.
class Guest {
 public:
  Guest() {
    memfd_ = memfd_create("guest-ram", MFD_CLOEXEC);
    EXPECT_EQ(ftruncate(memfd_, kGuestBytes), 0);
    void* p = mmap(nullptr, kGuestBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   memfd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    ram_ = static_cast<uint8_t*>(p);
    uva_ = reinterpret_cast<uint64_t>(p);
    kick_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    call_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    drv_ = std::make_unique<VirtqDriver>(ram_, kGpa, uva_, kGuestBytes, kQ);
  }
  ~Guest() {
    munmap(ram_, kGuestBytes);
    close(memfd_);
    close(kick_);
    close(call_);
  }

  // The handshake QEMU 7.2's vhost-user-blk does, then one ring started.
  void Handshake(FrontEnd* fe, bool event_idx = true) {
    ASSERT_TRUE(fe->Send(1, {}));
    const std::optional<uint64_t> features = fe->RecvU64();
    ASSERT_TRUE(features.has_value());
    EXPECT_NE(*features & Bit(kVhostUserFeatureProtocolFeatures), 0u);
    ASSERT_TRUE(fe->Send(15, {}));
    const std::optional<uint64_t> pf = fe->RecvU64();
    ASSERT_TRUE(pf.has_value());
    EXPECT_EQ(*pf & Bit(kProtocolFeatureInflightShmfd), 0u);
    const uint64_t want_pf = Bit(kProtocolFeatureReplyAck) |
                             Bit(kProtocolFeatureConfig) |
                             Bit(kProtocolFeatureMq);
    ASSERT_EQ(*pf & want_pf, want_pf);
    ASSERT_TRUE(fe->Send(16, U64(want_pf)));
    ASSERT_TRUE(fe->Send(17, {}));
    EXPECT_EQ(fe->RecvU64(), 1u);
    ASSERT_TRUE(fe->Send(3, {}));
    // GET_CONFIG of QEMU's struct size (60 bytes).
    std::vector<uint8_t> cfg(12 + 60, 0);
    const uint32_t sz = 60;
    std::memcpy(cfg.data() + 4, &sz, 4);
    ASSERT_TRUE(fe->Send(24, cfg));
    auto reply = fe->Recv();
    ASSERT_TRUE(reply.has_value());
    ASSERT_EQ(reply->size(), 72u);
    uint64_t capacity;
    std::memcpy(&capacity, reply->data() + 12, 8);
    EXPECT_EQ(capacity, kPages * 8);
    uint64_t acked = Bit(kVirtioFVersion1) | Bit(kVirtioRingFIndirectDesc) |
                     Bit(kVirtioBlkFFlush) | Bit(kVirtioBlkFDiscard) |
                     Bit(kVhostUserFeatureProtocolFeatures);
    if (event_idx) acked |= Bit(kVirtioRingFEventIdx);
    ASSERT_TRUE(fe->Send(2, U64(acked & *features)));
    // SET_MEM_TABLE with NEED_REPLY: the device acks once mapped.
    ASSERT_TRUE(fe->Send(5, MemTable({{kGpa, kGuestBytes, uva_, 0}}), {memfd_},
                         /*need_reply=*/true));
    EXPECT_EQ(fe->RecvU64(), 0u);
    StartRing(fe, 0);
  }
  void StartRing(FrontEnd* fe, uint16_t base) {
    ASSERT_TRUE(fe->Send(8, State(0, kQ)));
    ASSERT_TRUE(fe->Send(10, State(0, base)));
    std::vector<uint8_t> addr(40, 0);
    const uint64_t d = drv_->desc_uva(), u = drv_->used_uva(),
                   a = drv_->avail_uva();
    std::memcpy(addr.data() + 8, &d, 8);
    std::memcpy(addr.data() + 16, &u, 8);
    std::memcpy(addr.data() + 24, &a, 8);
    ASSERT_TRUE(fe->Send(9, addr));
    ASSERT_TRUE(fe->Send(12, U64(0), {kick_}));
    ASSERT_TRUE(fe->Send(13, U64(0), {call_}));
    ASSERT_TRUE(fe->Send(18, State(0, 1), {}, /*need_reply=*/true));
    EXPECT_EQ(fe->RecvU64(), 0u);
  }

  void Kick() {
    const uint64_t one = 1;
    ASSERT_EQ(write(kick_, &one, 8), 8);
  }
  // Waits until the used index reaches `want` (with interrupts).
  bool WaitUsed(uint16_t want) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (drv_->UsedIdx() != want) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      pollfd p{call_, POLLIN, 0};
      poll(&p, 1, 100);
      uint64_t v;
      [[maybe_unused]] ssize_t n = read(call_, &v, 8);
    }
    return true;
  }

  // Writes `pages` pages starting at `first`, page i filled with a pattern
  // of (seed, page); returns the statuses.
  // In batches that fit the queue (a direct request takes 3 descriptors).
  static constexpr int kBatch = kQ / 4;
  std::vector<uint8_t> WritePages(uint64_t first, int pages, uint32_t seed) {
    std::vector<uint8_t> out;
    for (int done = 0; done < pages; done += kBatch) {
      std::vector<uint8_t> part =
          WriteBatch(first + done, std::min(kBatch, pages - done), seed);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
  int VerifyPages(uint64_t first, int pages, uint32_t seed) {
    int bad = 0;
    for (int done = 0; done < pages; done += kBatch) {
      bad += VerifyBatch(first + done, std::min(kBatch, pages - done), seed);
    }
    return bad;
  }
  std::vector<uint8_t> WriteBatch(uint64_t first, int pages, uint32_t seed) {
    std::vector<uint64_t> status(pages);
    for (int i = 0; i < pages; ++i) {
      uint64_t data;
      const uint16_t head = drv_->BlkRequest(
          kVirtioBlkTOut, (first + i) * 8, 4096, i % 2 == 1, &data, &status[i]);
      Fill(drv_->Host(data), seed, first + i);
      drv_->Publish(head);
      ++submitted_;
    }
    Kick();
    EXPECT_TRUE(WaitUsed(submitted_));
    std::vector<uint8_t> out;
    for (uint64_t s : status) out.push_back(*drv_->Host(s));
    drv_->ResetHeap();
    return out;
  }
  // Reads pages back; counts pages whose content is not the pattern.
  int VerifyBatch(uint64_t first, int pages, uint32_t seed) {
    std::vector<uint64_t> status(pages);
    std::vector<uint64_t> data(pages);
    for (int i = 0; i < pages; ++i) {
      const uint16_t head =
          drv_->BlkRequest(kVirtioBlkTIn, (first + i) * 8, 4096, i % 3 == 0,
                           &data[i], &status[i]);
      drv_->Publish(head);
      ++submitted_;
    }
    Kick();
    EXPECT_TRUE(WaitUsed(submitted_));
    int bad = 0;
    std::array<uint8_t, 4096> want{};
    for (int i = 0; i < pages; ++i) {
      Fill(want.data(), seed, first + i);
      if (*drv_->Host(status[i]) != kVirtioBlkSOk ||
          std::memcmp(drv_->Host(data[i]), want.data(), 4096) != 0) {
        ++bad;
      }
    }
    drv_->ResetHeap();
    return bad;
  }
  static void Fill(uint8_t* p, uint32_t seed, uint64_t page) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + page + 1;
    for (size_t i = 0; i < 4096; i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(p + i, &x, 8);
    }
  }

  VirtqDriver& drv() { return *drv_; }
  uint16_t submitted() const { return submitted_; }
  int memfd() const { return memfd_; }
  uint64_t uva() const { return uva_; }
  int kick_fd() const { return kick_; }

 private:
  int memfd_ = -1;
  uint8_t* ram_ = nullptr;
  uint64_t uva_ = 0;
  int kick_ = -1;
  int call_ = -1;
  std::unique_ptr<VirtqDriver> drv_;
  uint16_t submitted_ = 0;
};

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
