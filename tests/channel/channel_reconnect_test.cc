// A guest that connects just as the previous one hangs up: the channel's
// host side (Channel over a TmemStore, with an fd store) driven by a test
// thread in the order epoll may report events -- the listening socket
// before the old connection's hang-up -- and real guests (TmemGuest over
// IvshmemClient). The predecessor must leave the whole way (pools dropped,
// region reset, fd store cleaned) before the newcomer is answered, so the
// newcomer sees nothing of it.
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "guest-driver/userspace/workloads.h"
#include "host-agent/channel/channel.h"
#include "host-agent/channel/fd_handoff.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using testing::TempDir;
using PageBuf = std::array<uint8_t, TMEM_PAGE_SIZE>;

constexpr TmemGuest::ObjectId kFile = {1, 2, 3, 4, 5, 6};
constexpr uint64_t kPages = 64;

// systemd's fd store, in memory: keeps its own duplicate of each fd.
class MemoryFdStore final : public FdStore {
 public:
  ~MemoryFdStore() override {
    for (auto& [name, fd] : fds_) close(fd);
  }
  bool Store(const std::string& name, int fd) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fds_.find(name);
    if (it != fds_.end()) close(it->second);
    fds_[name] = dup(fd);
    return true;
  }
  void Remove(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fds_.find(name);
    if (it == fds_.end()) return;
    close(it->second);
    fds_.erase(it);
  }
  // The inode of what is stored under `name`, 0 if nothing.
  ino_t Inode(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fds_.find(name);
    struct stat st {};
    if (it == fds_.end() || fstat(it->second, &st) != 0) return 0;
    return st.st_ino;
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> fds_;
};

ino_t InodeOf(int fd) {
  struct stat st {};
  return fd >= 0 && fstat(fd, &st) == 0 ? st.st_ino : 0;
}

// The worker's part, on a thread: the listening socket first, then the
// client, then the ring. Pause() holds it between rounds.
class Host {
 public:
  Host(TmemStore* store, const std::string& path, FdStore* fd_store) {
    ChannelOptions o;
    o.vm_name = "vm0";
    o.server.socket_path = path;
    o.region_bytes = uint64_t{2} << 20;
    o.fd_store = fd_store;
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        Channel::Create(o, store, /*host_generation=*/1000);
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (!ch.ok()) return;
    channel_ = std::move(*ch);
    thread_ = std::thread([this] { Loop(); });
  }
  ~Host() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;

  Channel* channel() { return channel_.get(); }
  // Returns once the host thread is between rounds and stays there.
  void Pause() {
    pause_ = true;
    while (!paused_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void Resume() { pause_ = false; }

 private:
  void Loop() {
    IvshmemServer& server = channel_->server();
    while (!stop_) {
      if (pause_) {
        paused_ = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      paused_ = false;
      pollfd fds[2] = {{server.listen_fd(), POLLIN, 0},
                       {server.client_fd(), POLLIN | POLLRDHUP, 0}};
      poll(fds, 2, 1);
      if ((fds[0].revents & POLLIN) != 0) server.OnListenReadable();
      // The connection polled above may be gone (and its number reused)
      // if the listen path dropped it.
      if (fds[1].fd >= 0 && fds[1].fd == server.client_fd() &&
          fds[1].revents != 0) {
        server.OnClientEvent();
      }
      if (!server.connected()) continue;
      for (;;) {
        const RingConsumer::DrainResult r = channel_->consumer().Drain(64);
        if (r.interrupt) server.NotifyGuest(0);
        if (r.consumed == 0) break;
      }
    }
    paused_ = true;
  }

  std::unique_ptr<Channel> channel_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> pause_{false};
  std::atomic<bool> paused_{false};
};

struct Guest {
  std::unique_ptr<IvshmemClient> client;
  std::unique_ptr<TmemGuest> guest;
};

Guest Connect(const std::string& socket) {
  Guest g;
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(socket, IvshmemClientOptions{});
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return g;
  g.client = std::move(*c);
  TmemGuestOptions o;
  o.get_timeout = std::chrono::milliseconds(500);
  absl::StatusOr<std::unique_ptr<TmemGuest>> t =
      TmemGuest::Create(g.client.get(), o);
  EXPECT_TRUE(t.ok()) << t.status();
  if (t.ok()) g.guest = std::move(*t);
  return g;
}

bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 10000 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

TEST(ChannelReconnectTest, NewcomerAcceptedBeforeTheHangupSeesNothingOfIt) {
  TempDir dir("channel-reconnect");
  StoreOptions so;
  so.memory_cap_bytes = uint64_t{64} << 20;
  so.address_space_bytes = uint64_t{1} << 30;
  absl::StatusOr<std::unique_ptr<TmemStore>> store = TmemStore::Create(so);
  ASSERT_TRUE(store.ok()) << store.status();
  MemoryFdStore fd_store;
  const std::string socket = dir.path() + "/vm0.sock";
  Host host(store->get(), socket, &fd_store);
  ASSERT_NE(host.channel(), nullptr);
  Channel& ch = *host.channel();

  // The first guest stores pages and reads one back (the host has them).
  Guest first = Connect(socket);
  ASSERT_NE(first.guest, nullptr);
  absl::StatusOr<TmemGuest::PoolHandle> pool = first.guest->InitFs();
  ASSERT_TRUE(pool.ok()) << pool.status();
  PageBuf page{};
  for (uint64_t k = 0; k < kPages; ++k) {
    FillPage(0, k, 1, page.data());
    first.guest->Put(*pool, kFile, k, page);
  }
  ASSERT_TRUE(Eventually([&] {
    first.guest->Poll();
    return first.guest->in_flight() == 0;
  }));
  PageBuf out{};
  ASSERT_TRUE(first.guest->Get(*pool, kFile, 0, out));
  // The host's state is read only while its thread is paused.
  host.Pause();
  const ino_t first_conn = InodeOf(ch.server().client_fd());
  EXPECT_EQ(fd_store.Inode("vm0/client"), first_conn);

  // The race: the first guest hangs up and the next connects while the
  // host looks away; it then sees the listening socket first.
  first.guest.reset();
  first.client.reset();
  std::future<Guest> next =
      std::async(std::launch::async, [&] { return Connect(socket); });
  pollfd queued{ch.server().listen_fd(), POLLIN, 0};
  ASSERT_EQ(poll(&queued, 1, 10000), 1) << "the newcomer never connected";
  host.Resume();
  Guest second = next.get();
  ASSERT_NE(second.guest, nullptr);
  host.Pause();

  // The predecessor left the whole way before the newcomer was answered.
  EXPECT_EQ(ch.metrics().Get(ChannelCounter::kClientDisconnects), 1u);
  EXPECT_EQ(ch.metrics().Get(ChannelCounter::kChannelResets), 1u);
  EXPECT_EQ(ch.metrics().Get(ChannelCounter::kClientsAccepted), 2u);
  absl::StatusOr<VmStats> stats = (*store)->GetVmStats(ch.vm());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->pools.empty()) << "the first guest's pools stayed";
  EXPECT_NE(fd_store.Inode("vm0/client"), first_conn)
      << "the fd store kept the dead connection";
  EXPECT_EQ(fd_store.Inode("vm0/client"), InodeOf(ch.server().client_fd()));
  EXPECT_EQ(fd_store.Inode("vm0/attaching"), 0u);
  host.Resume();

  // And it reads none of the first guest's pages.
  absl::StatusOr<TmemGuest::PoolHandle> pool2 = second.guest->InitFs();
  ASSERT_TRUE(pool2.ok()) << pool2.status();
  uint64_t hits = 0;
  for (uint64_t k = 0; k < kPages; ++k) {
    if (second.guest->Get(*pool2, kFile, k, out)) ++hits;
  }
  EXPECT_EQ(hits, 0u) << "the newcomer read its predecessor's pages";
}

}  // namespace
}  // namespace tmem
