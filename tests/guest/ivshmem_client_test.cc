// IvshmemClient against a scripted fake server on a real UNIX socket that
// speaks QEMU's ivshmem protocol (one little-endian int64 per message, at
// most one SCM_RIGHTS fd), correctly and in many wrong ways.
#include "guest-driver/userspace/ivshmem_client.h"

#include <endian.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

int CountOpenFds() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    ++n;
  }
  return n;
}

// One scripted message. `fds` are sent with it (none, one, or several for
// the malformed cases); `split` sends the 8 bytes in two writes, the fds
// with the first.
struct Msg {
  int64_t value;
  std::vector<int> fds = {};
  bool split = false;
};

// False once the client is gone (it hung up after refusing an earlier
// message, which is what many tests expect): the script then ends.
bool SendRaw(int sock, const void* data, size_t len,
             const std::vector<int>& fds) {
  iovec iov{const_cast<void*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(
      CMSG_SPACE(sizeof(int) * (fds.empty() ? 1 : fds.size())));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return false;
  EXPECT_EQ(n, static_cast<ssize_t>(len)) << "errno " << errno;
  return n == static_cast<ssize_t>(len);
}

bool Send(int sock, const Msg& m) {
  const uint64_t wire = htole64(static_cast<uint64_t>(m.value));
  const auto* bytes = reinterpret_cast<const uint8_t*>(&wire);
  if (m.split) {
    if (!SendRaw(sock, bytes, 3, m.fds)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return SendRaw(sock, bytes + 3, 5, {});
  }
  return SendRaw(sock, bytes, 8, m.fds);
}

// A listening socket in a fresh directory, and a thread that accepts one
// client and plays a script, then holds the connection until the client
// closes it (or closes it first when `hang_up`).
class FakeServer {
 public:
  FakeServer() {
    EXPECT_FALSE(dir_.path().empty()) << "mkdtemp failed";
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path_.c_str());
    EXPECT_EQ(
        bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listen_fd_, 4), 0);
  }
  ~FakeServer() {
    if (thread_.joinable()) thread_.join();
    for (int fd : owned_) close(fd);
    close(listen_fd_);
  }

  const std::string& path() const { return path_; }

  // Fds the server keeps (its copies of what it sends).
  int Shm(uint64_t size) {
    const int fd = memfd_create("fake-shm", MFD_CLOEXEC);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    owned_.push_back(fd);
    return fd;
  }
  int Eventfd() {
    const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    owned_.push_back(fd);
    return fd;
  }

  // The tmemd handshake: peer 0 = `host` eventfds, us = 1 with `own`.
  std::vector<Msg> TmemdScript(int shm, const std::vector<int>& host,
                               const std::vector<int>& own) {
    std::vector<Msg> s = {{0}, {1}, {-1, {shm}}};
    for (int fd : host) s.push_back({0, {fd}});
    for (int fd : own) s.push_back({1, {fd}});
    return s;
  }

  void Play(std::vector<Msg> script, bool hang_up = false,
            std::vector<uint8_t> trailing = {}) {
    thread_ = std::thread([this, script = std::move(script), hang_up,
                           trailing = std::move(trailing)] {
      const int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      ASSERT_GE(c, 0);
      bool alive = true;
      for (const Msg& m : script) {
        alive = alive && Send(c, m);
      }
      if (alive && !trailing.empty()) {
        SendRaw(c, trailing.data(), trailing.size(), {});
      }
      if (!hang_up) {
        // QEMU never writes to the server: the next thing we read must be
        // the client's EOF.
        char b;
        pollfd pfd{c, POLLIN, 0};
        while (!stop_.load()) {
          if (poll(&pfd, 1, 10) > 0) {
            client_wrote_ = recv(c, &b, 1, 0) > 0;
            break;
          }
        }
      }
      if (client_fd_keep_) {
        client_fd_ = c;
        return;
      }
      close(c);
    });
  }
  // Keep the accepted fd open for later messages (PollServer tests).
  void KeepClientFd() { client_fd_keep_ = true; }
  int client_fd() const { return client_fd_; }
  void StopWaiting() { stop_ = true; }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  bool client_wrote() const { return client_wrote_; }

 private:
  tmem::testing::TempDir dir_{"ivshmem-client-test"};
  std::string path_ = dir_.path() + "/sock";
  int listen_fd_ = -1;
  std::vector<int> owned_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  bool client_wrote_ = false;
  bool client_fd_keep_ = false;
  int client_fd_ = -1;
};

IvshmemClientOptions Options(int vectors = 1, int timeout_ms = 2000) {
  IvshmemClientOptions o;
  o.vectors = vectors;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

// Connects expecting failure; checks no fd leaked.
absl::Status ConnectFails(FakeServer& server, const IvshmemClientOptions& o) {
  const int before = CountOpenFds();
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(server.path(), o);
  EXPECT_FALSE(c.ok());
  server.StopWaiting();
  server.Join();
  EXPECT_EQ(CountOpenFds(), before) << "an fd leaked on a failed handshake";
  return c.ok() ? absl::OkStatus() : c.status();
}

TEST(IvshmemClientTest, HandshakeLikeTmemdMapsAndWiresDoorbells) {
  FakeServer server;
  const int shm = server.Shm(1 << 16);
  const int host0 = server.Eventfd();
  const int host1 = server.Eventfd();
  const int own0 = server.Eventfd();
  const int own1 = server.Eventfd();
  server.Play(server.TmemdScript(shm, {host0, host1}, {own0, own1}));

  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(server.path(), Options(2));
  ASSERT_TRUE(c.ok()) << c.status();
  IvshmemClient& client = **c;
  EXPECT_EQ(client.own_id(), 1);
  EXPECT_EQ(client.vectors(), 2);
  EXPECT_EQ(client.shm_size(), 1u << 16);
  EXPECT_THAT(client.peer_ids(), ElementsAre(0));
  EXPECT_EQ(client.peer_eventfd_count(0), 2);

  // Shared: what the client writes, the server's fd sees.
  std::memcpy(client.shm_base() + 100, "tmem", 4);
  char seen[4];
  ASSERT_EQ(pread(shm, seen, 4, 100), 4);
  EXPECT_EQ(std::memcmp(seen, "tmem", 4), 0);

  // Doorbell v = write 1 to peer 0's eventfd v.
  client.Doorbell(1);
  uint64_t v = 0;
  EXPECT_EQ(read(host0, &v, 8), -1) << "vector 0 not rung";
  ASSERT_EQ(read(host1, &v, 8), 8);
  EXPECT_EQ(v, 1u);
  client.Doorbell(0x100);  // QEMU keeps only the low 8 bits: vector 0
  ASSERT_EQ(read(host0, &v, 8), 8);
  client.Doorbell(7);  // no such vector: dropped, as QEMU drops it

  // Interrupt v = our own eventfd v.
  const uint64_t one = 1;
  ASSERT_EQ(write(own1, &one, 8), 8);
  pollfd pfd{client.interrupt_fd(1), POLLIN, 0};
  EXPECT_EQ(poll(&pfd, 1, 1000), 1);
  pfd = {client.interrupt_fd(0), POLLIN, 0};
  EXPECT_EQ(poll(&pfd, 1, 0), 0);
  EXPECT_EQ(client.interrupt_fd(2), -1);

  c->reset();  // disconnect: the server sees EOF, never a byte
  server.Join();
  EXPECT_FALSE(server.client_wrote());
}

TEST(IvshmemClientTest, MessagesSplitAcrossReadsAreReassembled) {
  FakeServer server;
  const int shm = server.Shm(4096);
  std::vector<Msg> script =
      server.TmemdScript(shm, {server.Eventfd()}, {server.Eventfd()});
  for (Msg& m : script) m.split = true;
  server.Play(script);
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(server.path(), Options());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->shm_size(), 4096u);
  c->reset();
}

TEST(IvshmemClientTest, OtherPeersAreAcceptedBeforeOurOwn) {
  FakeServer server;
  const int shm = server.Shm(4096);
  server.Play({{0},
               {3},
               {-1, {shm}},
               {0, {server.Eventfd()}},
               {5, {server.Eventfd()}},
               {3, {server.Eventfd()}}});
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(server.path(), Options());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->own_id(), 3);
  EXPECT_THAT((*c)->peer_ids(), ElementsAre(0, 5));
  c->reset();
}

TEST(IvshmemClientTest, WrongVersionIsRefused) {
  FakeServer server;
  server.Play({{1}, {1}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("version 1"));
}

TEST(IvshmemClientTest, VersionWithAnFdIsRefused) {
  FakeServer server;
  server.Play({{0, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("version message carries"));
}

TEST(IvshmemClientTest, BadOwnIdIsRefused) {
  for (const Msg& id : {Msg{-3}, Msg{70000}, Msg{1, {-1}}}) {
    FakeServer server;
    Msg m = id;
    if (!m.fds.empty()) m.fds = {server.Eventfd()};
    server.Play({{0}, m});
    absl::Status s = ConnectFails(server, Options());
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(s.message(), HasSubstr("peer id message"));
  }
}

// Own id 0 (tmemd is peer 1, its default since devices are migratable):
// tmemd's eventfds are then peer 1's, and a short run of them is refused.
TEST(IvshmemClientTest, OwnIdZeroMeansTmemdIsPeerOne) {
  FakeServer server;
  server.Play({{0},
               {0},
               {-1, {server.Shm(4096)}},
               {1, {server.Eventfd()}},
               {0, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("peer 1 (tmemd) sent 1 eventfds"));
}

TEST(IvshmemClientTest, ShmMessageWithoutFdIsRefused) {
  FakeServer server;
  server.Play({{0}, {1}, {-1}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("no file descriptor"));
}

TEST(IvshmemClientTest, PeerMessageWhereShmBelongsIsRefused) {
  FakeServer server;
  server.Play({{0}, {1}, {0, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("shared-memory message"));
}

TEST(IvshmemClientTest, ShmSizeMustBeAPowerOfTwo) {
  for (uint64_t size : {uint64_t{12288}, uint64_t{0}}) {
    FakeServer server;
    server.Play({{0}, {1}, {-1, {server.Shm(size)}}});
    absl::Status s = ConnectFails(server, Options());
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("power of two"));
  }
}

TEST(IvshmemClientTest, TruncatedHandshakeIsReported) {
  FakeServer server;
  server.Play({{0}, {1}, {-1, {server.Shm(4096)}}}, /*hang_up=*/true);
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("truncated handshake"));
}

TEST(IvshmemClientTest, PartialMessageIsReported) {
  FakeServer server;
  server.Play({{0}}, /*hang_up=*/true, /*trailing=*/{1, 0, 0, 0});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("4 of 8 bytes"));
}

TEST(IvshmemClientTest, StalledServerTimesOut) {
  FakeServer server;
  server.Play({{0}, {1}});
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = ConnectFails(server, Options(1, 150));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("stalled"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST(IvshmemClientTest, MoreEventfdsThanVectorsIsRefused) {
  FakeServer server;
  server.Play({{0},
               {1},
               {-1, {server.Shm(4096)}},
               {0, {server.Eventfd()}},
               {0, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("more eventfds than"));
}

TEST(IvshmemClientTest, HostPeerWithTooFewEventfdsIsRefused) {
  FakeServer server;
  server.Play({{0},
               {1},
               {-1, {server.Shm(4096)}},
               {0, {server.Eventfd()}},
               {1, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("peer 0 (tmemd) sent 1 eventfds for 2"));
}

TEST(IvshmemClientTest, MissingHostPeerIsRefused) {
  FakeServer server;
  server.Play({{0}, {1}, {-1, {server.Shm(4096)}}, {1, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("peer 0 (tmemd) sent 0"));
}

TEST(IvshmemClientTest, PeerAfterOwnEventfdsIsOutOfOrder) {
  FakeServer server;
  server.Play({{0},
               {1},
               {-1, {server.Shm(4096)}},
               {0, {server.Eventfd()}},
               {0, {server.Eventfd()}},
               {1, {server.Eventfd()}},
               {0, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("after our own eventfds"));
}

TEST(IvshmemClientTest, InterleavedPeersAreOutOfOrder) {
  FakeServer server;
  server.Play({{0},
               {1},
               {-1, {server.Shm(4096)}},
               {0, {server.Eventfd()}},
               {2, {server.Eventfd()}},
               {0, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("not contiguous"));
}

TEST(IvshmemClientTest, PeerMessageWithoutFdDuringHandshakeIsRefused) {
  FakeServer server;
  server.Play({{0}, {1}, {-1, {server.Shm(4096)}}, {0}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("carries no eventfd"));
}

TEST(IvshmemClientTest, GarbageValueIsRefused) {
  FakeServer server;
  server.Play({{0},
               {1},
               {-1, {server.Shm(4096)}},
               {int64_t{0x7fffffffffff}, {server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("expected a peer id"));
}

TEST(IvshmemClientTest, TwoFdsInOneMessageIsRefused) {
  FakeServer server;
  server.Play({{0}, {1}, {-1, {server.Shm(4096), server.Eventfd()}}});
  absl::Status s = ConnectFails(server, Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("carried 2 file descriptors"));
}

TEST(IvshmemClientTest, NoServerIsAClearError) {
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c = IvshmemClient::Connect(
      "/tmp/definitely-not-a-tmemd-socket-for-this-test", Options());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("is tmemd running"));
  EXPECT_EQ(
      IvshmemClient::Connect(std::string(200, 'x'), Options()).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(IvshmemClientTest, PollServerFollowsPeersAndNoticesHangUp) {
  FakeServer server;
  server.KeepClientFd();
  server.Play(server.TmemdScript(server.Shm(4096), {server.Eventfd()},
                                 {server.Eventfd()}),
              /*hang_up=*/true);
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(server.path(), Options());
  ASSERT_TRUE(c.ok()) << c.status();
  server.Join();
  const int s = server.client_fd();
  EXPECT_TRUE((*c)->PollServer().ok());
  Send(s, {7, {server.Eventfd()}});  // peer 7 connected
  Send(s, {7, {}, /*split=*/true});  // ... and left again, split message
  Send(s, {9, {server.Eventfd()}});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE((*c)->PollServer().ok());
  EXPECT_THAT((*c)->peer_ids(), ElementsAre(0, 9));
  close(s);
  absl::Status gone = (*c)->PollServer();
  EXPECT_EQ(gone.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(gone.message(), HasSubstr("closed"));
}

}  // namespace
}  // namespace tmem
