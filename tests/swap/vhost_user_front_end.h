// The vhost-user front-end (what QEMU does) and a guest driving one
// virtio-blk queue through guest memory it shares with the device, for
// tests of a swap device over its real UNIX socket: FrontEnd speaks the
// protocol, Guest holds the memfd "RAM" and the eventfds, does QEMU 7.2's
// handshake, and writes and verifies page patterns. Single-threaded.
#ifndef TMEMD_TESTS_SWAP_VHOST_USER_FRONT_END_H_
#define TMEMD_TESTS_SWAP_VHOST_USER_FRONT_END_H_

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
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "host-agent/swap/vhost_user_message.h"
#include "tests/swap/virtq_driver.h"

namespace tmem::swap::testing {

inline constexpr uint64_t kGuestBytes = 8 << 20;
inline constexpr uint64_t kGpa = 0;
inline constexpr uint16_t kQ = 128;
// Generous: the suite runs under sanitizers on a loaded machine. Only a
// hang reaches it.
inline constexpr std::chrono::seconds kWait{30};

inline uint64_t Bit(int b) { return 1ull << b; }

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

inline std::vector<uint8_t> U64(uint64_t v) {
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), &v, 8);
  return b;
}
inline std::vector<uint8_t> State(uint32_t index, uint32_t num) {
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), &index, 4);
  std::memcpy(b.data() + 4, &num, 4);
  return b;
}
inline std::vector<uint8_t> MemTable(
    const std::vector<std::array<uint64_t, 4>>& regions) {
  // Sized once and filled by memcpy: GCC 12 misreads the inlined
  // byte-by-byte inserts as an overflow (-Wstringop-overflow).
  std::vector<uint8_t> b(8 + 32 * regions.size(), 0);
  const auto n = static_cast<uint32_t>(regions.size());
  std::memcpy(b.data(), &n, 4);
  size_t at = 8;
  for (const auto& r : regions) {
    std::memcpy(b.data() + at, r.data(), 32);
    at += 32;
  }
  return b;
}

// Guest RAM (a memfd the "QEMU" side maps) plus one queue's eventfds.
class Guest {
 public:
  // `device_pages`, `device_queues`: the capacity and queue count the
  // handshake expects the device to offer (the guest uses queue 0).
  explicit Guest(uint64_t device_pages = 1024, uint64_t device_queues = 1)
      : device_pages_(device_pages), device_queues_(device_queues) {
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
    EXPECT_EQ(fe->RecvU64(), device_queues_);
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
    EXPECT_EQ(capacity, device_pages_ * 8);
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
  uint64_t device_pages_;
  uint64_t device_queues_;
};

}  // namespace tmem::swap::testing

#endif  // TMEMD_TESTS_SWAP_VHOST_USER_FRONT_END_H_
