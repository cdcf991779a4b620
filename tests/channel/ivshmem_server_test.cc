// Tests for IvshmemServer (host-agent/channel/ivshmem_server.h) over real
// UNIX sockets. The test client reads the handshake the way QEMU 7.2's
// ivshmem_recv_msg does -- one little-endian int64 per recvmsg, with at most
// one SCM_RIGHTS fd -- and then uses the received descriptors the way the
// device does: maps the shared memory, writes peer 0's eventfd for a
// doorbell, waits on its own eventfds for interrupts.
#include "host-agent/channel/ivshmem_server.h"

#include <endian.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/region_layout.h"
#include "host-agent/channel/shared_region.h"
#include "proto/tmem_abi.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

// strerror is not thread-safe (clang-tidy concurrency-mt-unsafe).
std::string ErrnoText(int err = errno) {
  char buf[256];
  return strerror_r(err, buf, sizeof(buf));  // GNU: returns the message
}

constexpr uint64_t kRegionBytes = uint64_t{2} << 20;
constexpr int kTimeoutMs = 2000;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

bool Readable(int fd, int timeout_ms) {
  pollfd pfd{fd, POLLIN, 0};
  return poll(&pfd, 1, timeout_ms) == 1 && (pfd.revents & POLLIN) != 0;
}

uint64_t ReadEventfd(int fd) {
  uint64_t value = 0;
  EXPECT_EQ(read(fd, &value, sizeof(value)),
            static_cast<ssize_t>(sizeof(value)))
      << ErrnoText();
  return value;
}

void WriteEventfd(int fd, uint64_t value) {
  ASSERT_EQ(write(fd, &value, sizeof(value)),
            static_cast<ssize_t>(sizeof(value)))
      << ErrnoText();
}

int CountOpenFds() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    ++n;
  }
  return n - 1;  // the iterator's own descriptor
}

Fd Connect(const std::string& path) {
  Fd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_GE(fd.get(), 0) << ErrnoText();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(
      connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)),
      0)
      << path << ": " << ErrnoText();
  return fd;
}

struct Message {
  enum Kind { kOk, kEof, kTimeout, kError } kind = kError;
  int64_t value = 0;
  Fd fd;  // -1 when the message carried none
};

// One protocol message, as QEMU reads it: exactly 8 bytes (little-endian)
// and the fd that came with them.
Message Recv(int sock, int timeout_ms = kTimeoutMs) {
  Message m;
  uint8_t buf[8];
  size_t got = 0;
  while (got < sizeof(buf)) {
    pollfd pfd{sock, POLLIN, 0};
    const int ready = poll(&pfd, 1, timeout_ms);
    if (ready == 0) {
      m.kind = Message::kTimeout;
      return m;
    }
    if (ready < 0) {
      if (errno == EINTR) continue;
      ADD_FAILURE() << "poll: " << ErrnoText();
      return m;
    }
    iovec iov{buf + got, sizeof(buf) - got};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n == 0) {
      m.kind = Message::kEof;
      return m;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      ADD_FAILURE() << "recvmsg: " << ErrnoText();
      m.kind = Message::kError;
      return m;
    }
    EXPECT_EQ(msg.msg_flags & MSG_CTRUNC, 0) << "more fds than expected";
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      EXPECT_EQ(fds, 1u) << "one fd per message";
      EXPECT_LT(m.fd.get(), 0) << "one fd per message";
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c), sizeof(fd));
      m.fd = Fd(fd);
    }
    got += static_cast<size_t>(n);
  }
  uint64_t le = 0;
  std::memcpy(&le, buf, sizeof(le));
  m.value = static_cast<int64_t>(le64toh(le));
  m.kind = Message::kOk;
  return m;
}

struct Handshake {
  Fd shm;
  std::vector<Fd> server_eventfds;  // peer 0: the guest's doorbells
  std::vector<Fd> own_eventfds;     // peer 1: the guest's interrupts
};

// Reads and checks a complete handshake for a device with `vectors`.
void ReadHandshake(int sock, int vectors, Handshake* out) {
  Message m = Recv(sock);
  ASSERT_EQ(m.kind, Message::kOk);
  EXPECT_EQ(m.value, 0) << "protocol version";
  EXPECT_LT(m.fd.get(), 0) << "the version message carries no fd";

  m = Recv(sock);
  ASSERT_EQ(m.kind, Message::kOk);
  EXPECT_EQ(m.value, 1) << "the client's own peer id";
  EXPECT_LT(m.fd.get(), 0) << "the id message carries no fd";

  m = Recv(sock);
  ASSERT_EQ(m.kind, Message::kOk);
  EXPECT_EQ(m.value, -1) << "shared memory message";
  ASSERT_GE(m.fd.get(), 0) << "the shared memory fd";
  struct stat st {};
  ASSERT_EQ(fstat(m.fd.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kRegionBytes)
      << "QEMU sizes BAR2 from fstat";
  out->shm = std::move(m.fd);

  for (int v = 0; v < vectors; ++v) {
    m = Recv(sock);
    ASSERT_EQ(m.kind, Message::kOk);
    EXPECT_EQ(m.value, 0) << "tmemd's eventfd " << v << " is peer 0's";
    ASSERT_GE(m.fd.get(), 0);
    out->server_eventfds.push_back(std::move(m.fd));
  }
  for (int v = 0; v < vectors; ++v) {
    m = Recv(sock);
    ASSERT_EQ(m.kind, Message::kOk);
    EXPECT_EQ(m.value, 1) << "the client's own eventfd " << v;
    ASSERT_GE(m.fd.get(), 0);
    out->own_eventfds.push_back(std::move(m.fd));
  }
  // Nothing more: extra eventfds would be an error in QEMU ("Too many
  // eventfd received").
  m = Recv(sock, /*timeout_ms=*/50);
  EXPECT_EQ(m.kind, Message::kTimeout) << "unexpected message " << m.value;
}

class IvshmemServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.empty()) << "mkdtemp: " << ErrnoText();
    absl::StatusOr<RegionLayout> layout = RegionLayout::ForSize(kRegionBytes);
    ASSERT_TRUE(layout.ok()) << layout.status();
    absl::StatusOr<std::unique_ptr<SharedRegion>> region =
        SharedRegion::Create("ivshmem-test", *layout, 1);
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = std::move(region).value();
  }

  IvshmemServerOptions Options(int vectors = 2) const {
    IvshmemServerOptions o;
    o.socket_path = path_;
    o.vectors = vectors;
    return o;
  }

  std::unique_ptr<IvshmemServer> Listen(const IvshmemServerOptions& o) {
    absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
        IvshmemServer::Listen(o, region_->fd(), &metrics_);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(server).value() : nullptr;
  }

  // Connects a client, lets the server accept it, and reads the handshake.
  Fd Attach(IvshmemServer* server, Handshake* hs) {
    Fd client = Connect(path_);
    EXPECT_TRUE(server->OnListenReadable());
    EXPECT_TRUE(server->connected());
    ReadHandshake(client.get(), server->vectors(), hs);
    return client;
  }

  uint64_t Count(ChannelCounter c) const { return metrics_.Get(c); }

  tmem::testing::TempDir tmp_{"tmem-ivshmem"};
  std::string dir_ = tmp_.path();
  std::string path_ = dir_ + "/vm.sock";
  std::unique_ptr<SharedRegion> region_;
  ChannelMetrics metrics_;
};

TEST_F(IvshmemServerTest, HandshakeFollowsQemuProtocol) {
  auto server = Listen(Options(/*vectors=*/2));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->vectors(), 2);
  EXPECT_FALSE(server->connected());
  EXPECT_EQ(server->client_fd(), -1);

  Fd client = Connect(path_);
  EXPECT_TRUE(server->OnListenReadable());
  ASSERT_TRUE(server->connected());
  EXPECT_EQ(Count(ChannelCounter::kClientsAccepted), 1u);
  // The worker's epoll loop must never block on the client.
  EXPECT_NE(fcntl(server->client_fd(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_NE(fcntl(server->client_fd(), F_GETFD) & FD_CLOEXEC, 0);

  Handshake hs;
  ReadHandshake(client.get(), 2, &hs);
  ASSERT_EQ(hs.server_eventfds.size(), 2u);
  ASSERT_EQ(hs.own_eventfds.size(), 2u);

  // The received shm fd is tmemd's region: the header is there.
  void* map = mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   hs.shm.get(), 0);
  ASSERT_NE(map, MAP_FAILED) << ErrnoText();
  const auto* header = static_cast<const tmem_shm_header*>(map);
  EXPECT_EQ(header->magic, TMEM_ABI_MAGIC);
  EXPECT_EQ(header->region_size, kRegionBytes);
  munmap(map, kRegionBytes);
  EXPECT_EQ(fcntl(hs.shm.get(), F_GET_SEALS),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);

  // Doorbell: the guest writes (0 << 16) | v, QEMU writes peer 0's eventfd
  // v, tmemd's doorbell_fd(v) wakes -- and only that one.
  for (int v = 0; v < 2; ++v) {
    EXPECT_NE(fcntl(server->doorbell_fd(v), F_GETFL) & O_NONBLOCK, 0);
    EXPECT_FALSE(Readable(server->doorbell_fd(v), 0));
    WriteEventfd(hs.server_eventfds[v].get(), 1);
    EXPECT_TRUE(Readable(server->doorbell_fd(v), kTimeoutMs)) << v;
    EXPECT_FALSE(Readable(server->doorbell_fd(1 - v), 0)) << v;
    EXPECT_EQ(ReadEventfd(server->doorbell_fd(v)), 1u);
  }

  // Interrupt: NotifyGuest(v) wakes the client's own eventfd v only.
  for (int v = 0; v < 2; ++v) {
    EXPECT_FALSE(Readable(hs.own_eventfds[v].get(), 0));
    server->NotifyGuest(v);
    EXPECT_TRUE(Readable(hs.own_eventfds[v].get(), kTimeoutMs)) << v;
    EXPECT_FALSE(Readable(hs.own_eventfds[1 - v].get(), 0)) << v;
    EXPECT_EQ(ReadEventfd(hs.own_eventfds[v].get()), 1u);
  }
  EXPECT_EQ(Count(ChannelCounter::kInterruptsSent), 2u);

  // Out-of-range vectors are ignored, not written past the array.
  server->NotifyGuest(-1);
  server->NotifyGuest(2);
  EXPECT_EQ(Count(ChannelCounter::kInterruptsSent), 2u);

  // Nothing pending: OnListenReadable returns at once (non-blocking
  // listener) and OnClientEvent does not drop a quiet client.
  EXPECT_FALSE(server->OnListenReadable());
  EXPECT_FALSE(server->OnClientEvent());
  EXPECT_TRUE(server->connected());
  EXPECT_EQ(Count(ChannelCounter::kHandshakeFailures), 0u);
}

TEST_F(IvshmemServerTest, NotifyGuestWithoutClientIsNoOp) {
  auto server = Listen(Options(1));
  ASSERT_NE(server, nullptr);
  server->NotifyGuest(0);
  EXPECT_EQ(Count(ChannelCounter::kInterruptsSent), 0u);
  EXPECT_FALSE(Readable(server->interrupt_fd(0), 0));
  EXPECT_FALSE(server->OnClientEvent());
}

TEST_F(IvshmemServerTest, SecondClientIsRefusedWhileOneIsAttached) {
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Handshake first;
  Fd a = Attach(server.get(), &first);
  const int attached_fd = server->client_fd();

  Fd b = Connect(path_);
  EXPECT_FALSE(server->OnListenReadable());
  EXPECT_EQ(Count(ChannelCounter::kClientsRejectedBusy), 1u);
  EXPECT_EQ(Count(ChannelCounter::kClientsAccepted), 1u);
  EXPECT_EQ(server->client_fd(), attached_fd) << "first client keeps going";
  // The refused client sees EOF without a single handshake byte.
  EXPECT_EQ(Recv(b.get()).kind, Message::kEof);

  // The attached client still works.
  server->NotifyGuest(0);
  EXPECT_TRUE(Readable(first.own_eventfds[0].get(), kTimeoutMs));
}

TEST_F(IvshmemServerTest, DisconnectIsDetectedAndNextClientAttaches) {
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Handshake first;
  Fd a = Attach(server.get(), &first);
  // An interrupt the first client never consumes must not leak to the next.
  server->NotifyGuest(0);
  const std::vector<int> doorbells = {server->doorbell_fd(0),
                                      server->doorbell_fd(1)};

  a.Reset();
  ASSERT_TRUE(Readable(server->client_fd(), kTimeoutMs));
  EXPECT_TRUE(server->OnClientEvent());
  EXPECT_FALSE(server->connected());
  EXPECT_EQ(server->client_fd(), -1);
  EXPECT_EQ(Count(ChannelCounter::kClientDisconnects), 1u);
  EXPECT_EQ(Count(ChannelCounter::kClientGarbage), 0u);
  EXPECT_FALSE(server->OnClientEvent()) << "nothing left to drop";
  EXPECT_EQ(Count(ChannelCounter::kClientDisconnects), 1u);

  Handshake second;
  Fd b = Attach(server.get(), &second);
  EXPECT_EQ(Count(ChannelCounter::kClientsAccepted), 2u);
  EXPECT_FALSE(Readable(second.own_eventfds[0].get(), 0))
      << "stale interrupt from the previous client";
  // Same eventfds as before (the worker's epoll set does not change), and
  // the new client's copies reach them.
  EXPECT_EQ(server->doorbell_fd(0), doorbells[0]);
  EXPECT_EQ(server->doorbell_fd(1), doorbells[1]);
  WriteEventfd(second.server_eventfds[1].get(), 3);
  ASSERT_TRUE(Readable(server->doorbell_fd(1), kTimeoutMs));
  EXPECT_EQ(ReadEventfd(server->doorbell_fd(1)), 3u);
  server->NotifyGuest(1);
  EXPECT_TRUE(Readable(second.own_eventfds[1].get(), kTimeoutMs));
}

TEST_F(IvshmemServerTest, RestartedClientIsNotRefusedForItsDeadPredecessor) {
  // Epoll may report the new connection before the old client's hangup.
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Handshake first;
  Fd a = Attach(server.get(), &first);
  a.Reset();
  Fd b = Connect(path_);
  EXPECT_TRUE(server->OnListenReadable());
  EXPECT_EQ(Count(ChannelCounter::kClientDisconnects), 1u);
  EXPECT_EQ(Count(ChannelCounter::kClientsRejectedBusy), 0u);
  Handshake second;
  ReadHandshake(b.get(), 2, &second);
}

TEST_F(IvshmemServerTest, ClientSendingBytesIsDropped) {
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Handshake hs;
  Fd client = Attach(server.get(), &hs);
  ASSERT_EQ(send(client.get(), "hello", 5, MSG_NOSIGNAL), 5);
  ASSERT_TRUE(Readable(server->client_fd(), kTimeoutMs));
  EXPECT_TRUE(server->OnClientEvent());
  EXPECT_FALSE(server->connected());
  EXPECT_EQ(Count(ChannelCounter::kClientGarbage), 1u);
  EXPECT_EQ(Count(ChannelCounter::kClientDisconnects), 0u);
  EXPECT_EQ(Recv(client.get()).kind, Message::kEof);
  // The server is ready for the next client.
  Handshake next;
  Fd again = Attach(server.get(), &next);
}

TEST_F(IvshmemServerTest, FdsSentByAClientAreNotLeaked) {
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Handshake hs;
  Fd client = Attach(server.get(), &hs);
  Fd efd(eventfd(0, EFD_CLOEXEC));
  ASSERT_GE(efd.get(), 0);
  const int before = CountOpenFds();

  char byte = 'x';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  const int sent_fd = efd.get();
  std::memcpy(CMSG_DATA(c), &sent_fd, sizeof(sent_fd));
  ASSERT_EQ(sendmsg(client.get(), &msg, MSG_NOSIGNAL), 1);

  ASSERT_TRUE(Readable(server->client_fd(), kTimeoutMs));
  EXPECT_TRUE(server->OnClientEvent());
  EXPECT_EQ(Count(ChannelCounter::kClientGarbage), 1u);
  // The server closed its end of the connection; nothing else appeared.
  EXPECT_EQ(CountOpenFds(), before - 1);
}

TEST_F(IvshmemServerTest, ClientThatNeverReadsDoesNotBlockServer) {
  // The biggest handshake (16 vectors: 35 messages, 33 fds) to a client that
  // never reads: sent without blocking, or the client is dropped.
  auto server = Listen(Options(/*vectors=*/16));
  ASSERT_NE(server, nullptr);
  Fd lazy = Connect(path_);
  const auto start = std::chrono::steady_clock::now();
  const bool attached = server->OnListenReadable();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, std::chrono::milliseconds(200));
  EXPECT_EQ(attached ? 1u : 0u, Count(ChannelCounter::kClientsAccepted));
  EXPECT_EQ(attached ? 0u : 1u, Count(ChannelCounter::kHandshakeFailures));
  EXPECT_TRUE(attached) << "a 35-message handshake fits any socket buffer";

  // Still not reading; the server keeps serving its other duties promptly.
  const auto start2 = std::chrono::steady_clock::now();
  for (int v = 0; v < 16; ++v) server->NotifyGuest(v);
  EXPECT_FALSE(server->OnClientEvent());
  EXPECT_FALSE(server->OnListenReadable());
  EXPECT_LT(std::chrono::steady_clock::now() - start2,
            std::chrono::milliseconds(200));

  // And the handshake is complete and intact when the client finally reads.
  Handshake hs;
  ReadHandshake(lazy.get(), 16, &hs);
  EXPECT_EQ(hs.own_eventfds.size(), 16u);
}

// Out of descriptors with a guest queued: the server's reserve makes room,
// so the guest is answered instead of left queued on a listening socket
// that stays readable (the worker would spin on it).
TEST_F(IvshmemServerTest, ReserveLetsAQueuedGuestInWhenOutOfDescriptors) {
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->reserve_fds(), IvshmemServer::kReserveFds);
  Fd client = Connect(path_);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 4096);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;
  int err = 0;
  for (;;) {
    const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      err = errno;
      break;
    }
    filler.push_back(fd);
  }
  const bool attached = server->OnListenReadable();
  const bool blocked = server->accept_blocked();
  for (int fd : filler) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_EQ(err, EMFILE);
  EXPECT_TRUE(attached);
  EXPECT_FALSE(blocked);
  EXPECT_EQ(server->accepts_from_reserve(), 1u);
  EXPECT_EQ(server->accept_backoffs(), 0u);
  EXPECT_EQ(Count(ChannelCounter::kAcceptsFromReserve), 1u);
  EXPECT_EQ(Count(ChannelCounter::kAcceptBackoffs), 0u);
  Handshake hs;
  ReadHandshake(client.get(), server->vectors(), &hs);
  EXPECT_EQ(hs.own_eventfds.size(), 2u);
  // Refilled for the next time.
  EXPECT_FALSE(server->OnListenReadable());
  EXPECT_EQ(server->reserve_fds(), IvshmemServer::kReserveFds);
}

// With no descriptor to be had at all (the reserve cannot help), accept
// stops and says so, so the caller backs off; the connection stays queued
// and is served once descriptors are back.
TEST_F(IvshmemServerTest, WithNoDescriptorAtAllAcceptStopsAndSaysSo) {
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Fd client = Connect(path_);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit none = old;
  none.rlim_cur = 3;  // every new descriptor number is refused
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  const bool attached = server->OnListenReadable();
  const bool blocked = server->accept_blocked();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_FALSE(attached);
  EXPECT_TRUE(blocked);
  EXPECT_EQ(server->accept_backoffs(), 1u);
  EXPECT_EQ(Count(ChannelCounter::kAcceptBackoffs), 1u);
  EXPECT_EQ(Count(ChannelCounter::kHandshakeFailures), 1u);
  EXPECT_FALSE(server->connected());

  EXPECT_TRUE(server->OnListenReadable());
  EXPECT_FALSE(server->accept_blocked());
  Handshake hs;
  ReadHandshake(client.get(), server->vectors(), &hs);
  EXPECT_EQ(hs.own_eventfds.size(), 2u);
}

TEST_F(IvshmemServerTest, ClientClosingBeforeHandshakeIsCountedWithoutSigpipe) {
  // With SIGPIPE at its default action, a send without MSG_NOSIGNAL to the
  // closed peer would kill this test binary.
  struct sigaction old {};
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ASSERT_EQ(sigaction(SIGPIPE, &dfl, &old), 0);

  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  { Fd gone = Connect(path_); }  // closed before the server even accepted it
  EXPECT_FALSE(server->OnListenReadable());
  EXPECT_FALSE(server->connected());
  EXPECT_EQ(Count(ChannelCounter::kHandshakeFailures), 1u);
  EXPECT_EQ(Count(ChannelCounter::kClientsAccepted), 0u);

  // A client that stopped reading (shutdown) fails the same way.
  Fd deaf = Connect(path_);
  ASSERT_EQ(shutdown(deaf.get(), SHUT_RD), 0);
  EXPECT_FALSE(server->OnListenReadable());
  EXPECT_EQ(Count(ChannelCounter::kHandshakeFailures), 2u);

  // The server is unharmed.
  Handshake hs;
  Fd ok = Attach(server.get(), &hs);
  EXPECT_EQ(Count(ChannelCounter::kClientsAccepted), 1u);
  sigaction(SIGPIPE, &old, nullptr);
}

TEST_F(IvshmemServerTest, RefusesToReplaceRegularFileOrDirectory) {
  {
    std::ofstream f(path_);
    f << "not a socket";
  }
  absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
      IvshmemServer::Listen(Options(), region_->fd(), &metrics_);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(server.status().message().find("regular file"), std::string::npos)
      << server.status();
  std::ifstream f(path_);
  std::string content;
  std::getline(f, content);
  EXPECT_EQ(content, "not a socket") << "the file must be left alone";
  ASSERT_EQ(unlink(path_.c_str()), 0);

  ASSERT_EQ(mkdir(path_.c_str(), 0700), 0);
  server = IvshmemServer::Listen(Options(), region_->fd(), &metrics_);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition)
      << server.status();
  ASSERT_EQ(rmdir(path_.c_str()), 0);
}

TEST_F(IvshmemServerTest, ReplacesStaleSocket) {
  // A socket file left behind by a crashed tmemd: bound, never unlinked.
  {
    Fd stale(socket(AF_UNIX, SOCK_STREAM, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(bind(stale.get(), reinterpret_cast<const sockaddr*>(&addr),
                   sizeof(addr)),
              0);
  }
  struct stat st {};
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  ASSERT_TRUE(S_ISSOCK(st.st_mode));
  auto server = Listen(Options());
  ASSERT_NE(server, nullptr);
  Handshake hs;
  Fd client = Attach(server.get(), &hs);
}

TEST_F(IvshmemServerTest, DoesNotStealLiveSocket) {
  auto first = Listen(Options());
  ASSERT_NE(first, nullptr);
  ChannelMetrics other_metrics;
  absl::StatusOr<std::unique_ptr<IvshmemServer>> second =
      IvshmemServer::Listen(Options(), region_->fd(), &other_metrics);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists)
      << second.status();
  // The first server still owns the path. (The probe's connection shows up
  // as one failed handshake.)
  Handshake hs;
  Fd client = Attach(first.get(), &hs);
  EXPECT_EQ(Count(ChannelCounter::kHandshakeFailures), 1u);
}

TEST_F(IvshmemServerTest, AppliesSocketModeOwnerAndGroup) {
  IvshmemServerOptions o = Options();
  o.socket_mode = 0600;
  {
    auto server = Listen(o);
    ASSERT_NE(server, nullptr);
    struct stat st {};
    ASSERT_EQ(stat(path_.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0600u);
  }
  o.socket_mode = 0666;  // wider than any usual umask lets bind() create
  const mode_t old_umask = umask(077);
  {
    auto server = Listen(o);
    umask(old_umask);
    ASSERT_NE(server, nullptr);
    struct stat st {};
    ASSERT_EQ(stat(path_.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0666u);
  }
  umask(old_umask);

  // Root can hand the socket to any user (QEMU's libvirt-qemu); others can
  // at least set one of their own groups.
  const bool root = geteuid() == 0;
  o.socket_mode = 0660;
  o.socket_owner = root ? std::optional<uid_t>(65534) : std::nullopt;
  o.socket_group = root ? 65534 : getegid();
  auto server = Listen(o);
  ASSERT_NE(server, nullptr);
  struct stat st {};
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_EQ(st.st_gid, *o.socket_group);
  if (root) {
    EXPECT_EQ(st.st_uid, 65534u);
  }
}

TEST_F(IvshmemServerTest, ChownFailureIsAnErrorAndLeavesNoFile) {
  // Only a privileged process may give a file to root, so Listen runs in a
  // child that drops to nobody when the test runs as root. Exit codes say
  // which expectation failed (no gtest in the child).
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << ErrnoText();
  if (pid == 0) {
    if (geteuid() == 0) {
      // The socket directory must be the (unprivileged) daemon's own: a
      // world-writable one is refused (socket_file.h).
      if (chown(dir_.c_str(), 65534, 65534) != 0 ||
          setgroups(0, nullptr) != 0 || setgid(65534) != 0 ||
          setuid(65534) != 0) {
        _exit(10);
      }
    }
    IvshmemServerOptions o = Options();
    o.socket_owner = 0;
    absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
        IvshmemServer::Listen(o, region_->fd(), &metrics_);
    if (server.ok()) _exit(11);
    if (server.status().code() != absl::StatusCode::kPermissionDenied) {
      _exit(12);
    }
    if (server.status().message().find("chown") == std::string::npos) {
      _exit(13);
    }
    struct stat st {};
    if (lstat(path_.c_str(), &st) == 0) _exit(14);  // socket left behind
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10: cannot drop privileges, 11: Listen succeeded, 12: wrong code, "
         "13: message does not name chown, 14: socket file left behind";
}

// The socket's mode is set on the fd before bind(), never by path: whoever
// could swap the fresh socket for a symlink between bind() and a chmod() by
// path would change the mode of a file of their choosing. Here a thread keeps
// replacing the socket path with a symlink to a 0600 file while Listen runs
// again and again: the file's mode must never change, whatever each Listen
// returns.
TEST_F(IvshmemServerTest, SymlinkSwapNeverRedirectsTheChmod) {
  const std::string victim = dir_ + "/victim";
  { std::ofstream(victim) << "secret"; }
  ASSERT_EQ(chmod(victim.c_str(), 0600), 0);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> swaps{0};
  std::thread attacker([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      unlink(path_.c_str());
      if (symlink(victim.c_str(), path_.c_str()) == 0) {
        swaps.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
  int listened = 0;
  for (int i = 0; i < 2000; ++i) {
    IvshmemServerOptions o = Options();
    o.socket_mode = 0666;
    absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
        IvshmemServer::Listen(o, region_->fd(), &metrics_);
    listened += server.ok();
    server = absl::UnknownError("closed");  // destroy before the next round
    struct stat st {};
    ASSERT_EQ(stat(victim.c_str(), &st), 0);
    ASSERT_EQ(st.st_mode & 07777, 0600u)
        << "round " << i << ": a symlink redirected the socket's chmod";
  }
  stop = true;
  attacker.join();
  EXPECT_GT(swaps.load(), 0u);
  std::printf("[ race ] %d of 2000 Listen calls succeeded, %llu swaps\n",
              listened, static_cast<unsigned long long>(swaps.load()));
  unlink(victim.c_str());
}

TEST_F(IvshmemServerTest, DestructorRemovesSocketPath) {
  {
    auto server = Listen(Options());
    ASSERT_NE(server, nullptr);
    Handshake hs;
    Fd client = Attach(server.get(), &hs);
  }
  struct stat st {};
  EXPECT_NE(lstat(path_.c_str(), &st), 0);
  EXPECT_EQ(errno, ENOENT);
  auto again = Listen(Options());
  EXPECT_NE(again, nullptr);
}

TEST_F(IvshmemServerTest, RejectsBadOptions) {
  for (int vectors : {0, -1, 17}) {
    absl::StatusOr<std::unique_ptr<IvshmemServer>> s =
        IvshmemServer::Listen(Options(vectors), region_->fd(), &metrics_);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << vectors;
  }
  IvshmemServerOptions long_path = Options();
  long_path.socket_path = dir_ + "/" + std::string(120, 'a');
  EXPECT_EQ(IvshmemServer::Listen(long_path, region_->fd(), &metrics_)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  IvshmemServerOptions empty = Options();
  empty.socket_path.clear();
  EXPECT_EQ(
      IvshmemServer::Listen(empty, region_->fd(), &metrics_).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(IvshmemServer::Listen(Options(), -1, &metrics_).ok());
  EXPECT_FALSE(IvshmemServer::Listen(Options(), region_->fd(), nullptr).ok());

  // A shared memory fd that QEMU could not map as BAR2.
  Fd odd(memfd_create("odd", MFD_CLOEXEC));
  ASSERT_GE(odd.get(), 0);
  ASSERT_EQ(ftruncate(odd.get(), off_t{3} * 4096), 0);
  absl::StatusOr<std::unique_ptr<IvshmemServer>> s =
      IvshmemServer::Listen(Options(), odd.get(), &metrics_);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("power of two"), std::string::npos)
      << s.status();

  // Bad directory: the error names the path and the errno text.
  IvshmemServerOptions missing = Options();
  missing.socket_path = dir_ + "/no/such/dir.sock";
  s = IvshmemServer::Listen(missing, region_->fd(), &metrics_);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("No such file"), std::string::npos)
      << s.status();
  struct stat st {};
  EXPECT_NE(lstat(path_.c_str(), &st), 0) << "no socket left behind";
}

TEST_F(IvshmemServerTest, CallerMayCloseItsShmFd) {
  absl::StatusOr<RegionLayout> layout = RegionLayout::ForSize(kRegionBytes);
  ASSERT_TRUE(layout.ok());
  std::unique_ptr<IvshmemServer> server;
  {
    absl::StatusOr<std::unique_ptr<SharedRegion>> region =
        SharedRegion::Create("short-lived", *layout, 5);
    ASSERT_TRUE(region.ok());
    absl::StatusOr<std::unique_ptr<IvshmemServer>> s =
        IvshmemServer::Listen(Options(), (*region)->fd(), &metrics_);
    ASSERT_TRUE(s.ok()) << s.status();
    server = std::move(s).value();
  }  // region (and its fd) gone; the server holds its own dup
  Handshake hs;
  Fd client = Attach(server.get(), &hs);
  void* map =
      mmap(nullptr, kRegionBytes, PROT_READ, MAP_SHARED, hs.shm.get(), 0);
  ASSERT_NE(map, MAP_FAILED) << ErrnoText();
  EXPECT_EQ(static_cast<const tmem_shm_header*>(map)->host_generation, 5u);
  munmap(map, kRegionBytes);
}

}  // namespace
}  // namespace tmem
