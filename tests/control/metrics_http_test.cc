// The /metrics responder against hostile and slow clients: a
// client that connects and sends nothing, one that trickles its request, and
// more clients than the server keeps open must never keep a well-behaved
// scraper from its answer, and each is counted.
#include "host-agent/control/metrics_http.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "host-agent/agent.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (fd < 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// Reads until the server closes or `limit` passes; what arrived.
std::string ReadAll(int fd, milliseconds limit) {
  std::string out;
  const auto deadline = steady_clock::now() + limit;
  while (steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Closed by the peer (read returns 0 or an error) without waiting?
bool ClosedByServer(int fd) {
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

std::string Scrape(int port) {
  const int fd = Connect(port);
  if (fd < 0) return "connect failed";
  const std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string r = ReadAll(fd, milliseconds(10'000));
  close(fd);
  return r;
}

template <typename F>
bool WaitFor(F done, milliseconds limit) {
  const auto deadline = steady_clock::now() + limit;
  while (steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return done();
}

class MetricsHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AgentOptions o;
    o.socket_dir = tmp_.path();
    o.store.memory_cap_bytes = 16 << 20;
    o.store.address_space_bytes = 64 << 20;
    o.workers = 1;
    o.run_valve_ticker = false;
    absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = std::move(*a);
    auto s = MetricsServer::Start(agent_.get(), "127.0.0.1", 0);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  void TearDown() override {
    server_.reset();
    agent_.reset();
  }

  tmem::testing::TempDir tmp_{"tmem-metrics-test"};
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(MetricsHttpTest, SilentClientsDoNotDelayAScrape) {
  std::vector<int> silent;
  for (int i = 0; i < 3; ++i) {
    silent.push_back(Connect(server_->port()));
    ASSERT_GE(silent.back(), 0);
  }
  std::this_thread::sleep_for(milliseconds(50));  // accepted before us
  const std::string r = Scrape(server_->port());
  EXPECT_EQ(r.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << r.substr(0, 200);
  EXPECT_NE(r.find("tmem_"), std::string::npos);
  // Answered while the silent clients still had their slots: the server
  // did not wait for them to time out first.
  for (int fd : silent) EXPECT_FALSE(ClosedByServer(fd));
  // Then each is closed at its deadline, and counted.
  EXPECT_TRUE(WaitFor([&] { return server_->timed_out() >= 3; },
                      MetricsServer::kClientDeadline + milliseconds(8'000)));
  for (int fd : silent) {
    EXPECT_TRUE(
        WaitFor([&] { return ClosedByServer(fd); }, milliseconds(2000)));
    close(fd);
  }
}

TEST_F(MetricsHttpTest, ATrickledRequestIsAnsweredAndOthersServedMeanwhile) {
  const int slow = Connect(server_->port());
  ASSERT_GE(slow, 0);
  const std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
  for (size_t i = 0; i < 5; ++i) {
    (void)!write(slow, &req[i], 1);
    // Someone else is served between two bytes of the slow request.
    EXPECT_EQ(Scrape(server_->port()).rfind("HTTP/1.0 200 OK", 0), 0u);
  }
  (void)!write(slow, req.data() + 5, req.size() - 5);
  const std::string r = ReadAll(slow, milliseconds(10'000));
  close(slow);
  EXPECT_EQ(r.rfind("HTTP/1.0 200 OK", 0), 0u) << r.substr(0, 200);
}

TEST_F(MetricsHttpTest, ConnectionsBeyondTheLimitAreRefusedAndCounted) {
  std::vector<int> held;
  for (size_t i = 0; i < MetricsServer::kMaxClients; ++i) {
    held.push_back(Connect(server_->port()));
    ASSERT_GE(held.back(), 0);
  }
  // The kernel completes the handshake; the server closes the extra one.
  const int extra = Connect(server_->port());
  ASSERT_GE(extra, 0);
  EXPECT_TRUE(
      WaitFor([&] { return ClosedByServer(extra); }, milliseconds(5000)));
  close(extra);
  EXPECT_GE(server_->refused(), 1u);
  // Once the held ones time out, scrapes are served again.
  EXPECT_TRUE(WaitFor(
      [&] { return server_->timed_out() >= MetricsServer::kMaxClients; },
      MetricsServer::kClientDeadline + milliseconds(8'000)));
  for (int fd : held) close(fd);
  EXPECT_EQ(Scrape(server_->port()).rfind("HTTP/1.0 200 OK", 0), 0u);
}

TEST_F(MetricsHttpTest, GarbageGetsA400AndOtherPathsA404) {
  auto ask = [&](const std::string& req) {
    const int fd = Connect(server_->port());
    (void)!write(fd, req.data(), req.size());
    std::string r = ReadAll(fd, milliseconds(10'000));
    close(fd);
    return r;
  };
  EXPECT_EQ(ask("HELLO\r\n\r\n").rfind("HTTP/1.0 400", 0), 0u);
  EXPECT_EQ(ask("GET /secret HTTP/1.0\r\n\r\n").rfind("HTTP/1.0 404", 0), 0u);
  // An endless request line is cut at 8 KiB and answered, not buffered on.
  EXPECT_EQ(ask(std::string(8192, 'A')).rfind("HTTP/1.0 400", 0), 0u);
}

}  // namespace
}  // namespace tmem
