// The guest side against tmemd's real data plane, in one process: an
// IvshmemServer, SharedRegion and RingConsumer over a TmemStore, driven by a
// small host loop in a thread (poll on the listening socket, the client and
// the doorbell eventfd; or, in polling mode, no doorbells and a short sleep
// loop), and IvshmemClient + TmemGuest connecting over the real socket.
// Also runs the tmem-guestsim binary against it.
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "backend/tmem_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "guest-driver/userspace/workloads.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/ivshmem_server.h"
#include "host-agent/channel/region_layout.h"
#include "host-agent/channel/ring_consumer.h"
#include "host-agent/channel/shared_region.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using ::testing::HasSubstr;
using ::tmem::testing::TempDir;
using Page = std::array<uint8_t, TMEM_PAGE_SIZE>;

constexpr TmemGuest::ObjectId kFile = {1, 2, 3, 4, 5, 6};
constexpr TmemGuest::ObjectId kOtherFile = {7, 7, 7, 7, 7, 7};

Page MakePage(uint64_t key, uint64_t version = 1) {
  Page p;
  FillPage(0, key, version, p.data());
  return p;
}

struct HostOptions {
  std::string vm_name = "vm0";
  uint64_t region_bytes = 1 << 20;
  uint32_t ring_entries = 64;
  bool polling = false;  // host_flags without NEEDS_DOORBELL, sleep loop
};

// One VM's channel and the thread that drives it: what tmemd's worker does,
// reduced to what a test needs.
class InProcessTmemd {
 public:
  InProcessTmemd(TmemStore* store, const std::string& socket_path,
                 const HostOptions& options)
      : store_(store), options_(options) {
    absl::StatusOr<VmId> vm = store->AddVm(options.vm_name, VmPolicy{});
    EXPECT_TRUE(vm.ok()) << vm.status();
    vm_ = *vm;
    absl::StatusOr<RegionLayout> layout =
        RegionLayout::ForSize(options.region_bytes, options.ring_entries);
    EXPECT_TRUE(layout.ok()) << layout.status();
    absl::StatusOr<std::unique_ptr<SharedRegion>> region =
        SharedRegion::Create("test-" + options.vm_name, *layout, 1000);
    EXPECT_TRUE(region.ok()) << region.status();
    region_ = std::move(*region);
    consumer_ =
        std::make_unique<RingConsumer>(region_.get(), store, vm_, &metrics_);
    IvshmemServerOptions so;
    so.socket_path = socket_path;
    absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
        IvshmemServer::Listen(so, region_->fd(), &metrics_);
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    SetPolling();
    thread_ = std::thread([this] { Loop(); });
  }
  ~InProcessTmemd() {
    stop_ = true;
    thread_.join();
    server_.reset();
    consumer_.reset();
    region_.reset();
    (void)store_->ForgetVm(vm_);
  }

  // Has the host thread re-initialize the region (a tmemd-side reset).
  void RequestReset() { reset_requested_ = true; }
  uint64_t resets_done() const { return resets_done_.load(); }
  bool connected() const { return connected_.load(); }
  const ChannelMetrics& metrics() const { return metrics_; }

 private:
  void SetPolling() {
    if (options_.polling) {
      __atomic_store_n(&region_->header()->host_flags, 0u, __ATOMIC_RELEASE);
    }
  }

  void ResetRegion() {
    consumer_->DropPools();
    region_->Reset();
    consumer_ =
        std::make_unique<RingConsumer>(region_.get(), store_, vm_, &metrics_);
    ++resets_done_;
  }

  void Loop() {
    while (!stop_.load()) {
      pollfd fds[3] = {{server_->listen_fd(), POLLIN, 0},
                       {server_->client_fd(), POLLIN | POLLRDHUP, 0},
                       {server_->doorbell_fd(0), POLLIN, 0}};
      poll(fds, 3, options_.polling ? 0 : 1);
      if ((fds[0].revents & POLLIN) != 0) server_->OnListenReadable();
      if (fds[1].fd >= 0 && fds[1].revents != 0 && server_->OnClientEvent()) {
        ResetRegion();  // the guest left: the next one starts clean
      }
      connected_ = server_->connected();
      if ((fds[2].revents & POLLIN) != 0) {
        uint64_t v;
        (void)!read(server_->doorbell_fd(0), &v, sizeof(v));
      }
      if (reset_requested_.exchange(false)) ResetRegion();
      if (!server_->connected()) continue;
      uint32_t consumed = 0;
      for (;;) {
        const RingConsumer::DrainResult r = consumer_->Drain(64);
        if (r.interrupt) server_->NotifyGuest(0);
        consumed += r.consumed;
        if (r.consumed == 0) break;
      }
      if (options_.polling && consumed == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  TmemStore* store_;
  HostOptions options_;
  VmId vm_ = 0;
  ChannelMetrics metrics_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<RingConsumer> consumer_;
  std::unique_ptr<IvshmemServer> server_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> reset_requested_{false};
  std::atomic<uint64_t> resets_done_{0};
  std::atomic<bool> connected_{false};
};

// Polls `done` for up to 5 s (the host thread updates what it checks).
template <typename F>
bool Eventually(F done) {
  for (int i = 0; i < 5000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

std::unique_ptr<TmemStore> MakeStore() {
  StoreOptions o;
  o.memory_cap_bytes = uint64_t{256} << 20;
  o.address_space_bytes = uint64_t{1} << 30;
  absl::StatusOr<std::unique_ptr<TmemStore>> s = TmemStore::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

TmemGuestOptions GuestOptions() {
  TmemGuestOptions o;
  // Generous: sanitizer builds on a loaded 2-core machine are slow, and a
  // timeout here would only make a hit a miss.
  o.get_timeout = std::chrono::milliseconds(500);
  return o;
}

// A connected guest: the client must outlive the TmemGuest on it.
struct Guest {
  std::unique_ptr<IvshmemClient> client;
  std::unique_ptr<TmemGuest> guest;
  TmemGuest* operator->() { return guest.get(); }
};

Guest Connect(const std::string& socket) {
  Guest g;
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(socket, IvshmemClientOptions{});
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return g;
  g.client = std::move(*c);
  absl::StatusOr<std::unique_ptr<TmemGuest>> t =
      TmemGuest::Create(g.client.get(), GuestOptions());
  EXPECT_TRUE(t.ok()) << t.status();
  if (t.ok()) g.guest = std::move(*t);
  return g;
}

class GuestChannelTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    store_ = MakeStore();
    socket_ = dir_.path() + "/vm0.sock";
    HostOptions o;
    o.polling = GetParam();
    host_ = std::make_unique<InProcessTmemd>(store_.get(), socket_, o);
  }
  void TearDown() override {
    // Nothing the guest sent may have been malformed.
    const ChannelMetrics& m = host_->metrics();
    EXPECT_EQ(m.Get(ChannelCounter::kSqeBadOpcode), 0u);
    EXPECT_EQ(m.Get(ChannelCounter::kSqeBadFlags), 0u);
    EXPECT_EQ(m.Get(ChannelCounter::kSqeBadSlot), 0u);
    if (!host_resets_under_load_) {
      EXPECT_EQ(m.Get(ChannelCounter::kRingCorruptIndex), 0u);
    }
    EXPECT_EQ(m.Get(ChannelCounter::kClientGarbage), 0u);
    host_.reset();
  }

  // SharedRegion::Reset zeroes the guest-owned sq_tail and cq_head; a guest
  // in the middle of a post can store its old index over the zero, which
  // the consumer rightly takes for a corrupt ring (and resets again).
  bool host_resets_under_load_ = false;
  TempDir dir_{"guest-channel-test"};
  std::unique_ptr<TmemStore> store_;
  std::string socket_;
  std::unique_ptr<InProcessTmemd> host_;
};

TEST_P(GuestChannelTest, HandshakeWithTheRealServer) {
  absl::StatusOr<std::unique_ptr<IvshmemClient>> c =
      IvshmemClient::Connect(socket_, IvshmemClientOptions{});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->own_id(), 1);
  EXPECT_EQ((*c)->peer_eventfd_count(0), 1);
  EXPECT_EQ((*c)->shm_size(), uint64_t{1} << 20);
  absl::StatusOr<std::unique_ptr<TmemGuest>> g =
      TmemGuest::Create(c->get(), GuestOptions());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->host_generation(), 1000u);
  // Counted after the handshake was sent, so possibly after we read it.
  EXPECT_TRUE(Eventually([&] {
    return host_->metrics().Get(ChannelCounter::kClientsAccepted) == 1;
  }));
}

TEST_P(GuestChannelTest, EveryOpRoundTrips) {
  Guest g = Connect(socket_);
  ASSERT_NE(g.guest, nullptr);
  absl::StatusOr<int> pool = g->InitFs();
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_GE(g->host_pool_id(*pool), 0);
  Page out{};

  g->Put(*pool, kFile, 1, MakePage(1));
  EXPECT_TRUE(g->Get(*pool, kFile, 1, out));
  EXPECT_EQ(out, MakePage(1));
  EXPECT_FALSE(g->Get(*pool, kFile, 1, out)) << "private: exclusive";

  g->Put(*pool, kFile, 1, MakePage(1, 1));
  g->Put(*pool, kFile, 1, MakePage(1, 2));  // replaces
  EXPECT_TRUE(g->Get(*pool, kFile, 1, out));
  EXPECT_EQ(out, MakePage(1, 2));

  g->Put(*pool, kFile, 2, MakePage(2));
  g->InvalidatePage(*pool, kFile, 2);
  EXPECT_FALSE(g->Get(*pool, kFile, 2, out));

  g->Put(*pool, kFile, 3, MakePage(3));
  g->Put(*pool, kFile, 4, MakePage(4));
  g->Put(*pool, kOtherFile, 3, MakePage(5));
  g->InvalidateObject(*pool, kFile);
  EXPECT_FALSE(g->Get(*pool, kFile, 3, out));
  EXPECT_FALSE(g->Get(*pool, kFile, 4, out));
  EXPECT_TRUE(g->Get(*pool, kOtherFile, 3, out));
  EXPECT_EQ(out, MakePage(5));

  g->Put(*pool, kFile, 6, MakePage(6));
  g->InvalidatePool(*pool);
  EXPECT_FALSE(g->Get(*pool, kFile, 6, out));

  // A second private pool is separate.
  const int second = *g->InitFs();
  g->Put(second, kFile, 1, MakePage(7));
  EXPECT_FALSE(g->Get(*pool, kFile, 1, out));
  EXPECT_TRUE(g->Get(second, kFile, 1, out));

  const GuestCounters& c = g->counters();
  EXPECT_EQ(c.errors, 0u);
  EXPECT_EQ(c.gets_timeout, 0u);
  // Only gets of keys never put (the second pool's key 1 in the first
  // pool) or that a batch just reported absent are answered locally.
  EXPECT_EQ(c.gets_miss_local,
            c.gets_skipped_never_sent + c.gets_negative_cached);
  EXPECT_EQ(c.puts_dropped_by_host, 0u);
  EXPECT_EQ(c.pools_created, 2u);
  if (GetParam()) {
    EXPECT_EQ(c.doorbells, 0u) << "a polling host needs no doorbells";
  } else {
    EXPECT_GT(c.doorbells, 0u);
  }
}

TEST_P(GuestChannelTest, SharedPoolsNeedAuthorization) {
  Guest g = Connect(socket_);
  ASSERT_NE(g.guest, nullptr);
  TmemGuest::Uuid uuid{};
  uuid[0] = 0xab;
  absl::StatusOr<int> refused = g->InitSharedFs(uuid);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);

  PoolUuid pool_uuid;
  pool_uuid.bytes = uuid;
  store_->AuthorizeSharedPool(pool_uuid, "vm0");
  absl::StatusOr<int> pool = g->InitSharedFs(uuid);
  ASSERT_TRUE(pool.ok()) << pool.status();
  Page out{};
  g->Put(*pool, kFile, 1, MakePage(1));
  EXPECT_TRUE(g->Get(*pool, kFile, 1, out));
  EXPECT_TRUE(g->Get(*pool, kFile, 1, out)) << "shared: not exclusive";
  EXPECT_EQ(out, MakePage(1));
}

TEST_P(GuestChannelTest, CoherencyWorkloadPasses) {
  Guest g = Connect(socket_);
  ASSERT_NE(g.guest, nullptr);
  WorkloadConfig config;
  config.kind = WorkloadKind::kCoherency;
  config.pages = 512;
  config.ops = 20'000;
  config.seed = 7;
  WorkloadResult r = RunWorkload(*g.guest, config);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.mismatches, 0u) << r.mismatch_report;
  EXPECT_GT(r.hits, 1000u);
  EXPECT_EQ(g->counters().errors, 0u);
}

TEST_P(GuestChannelTest, RestartedGuestStartsClean) {
  {
    Guest first = Connect(socket_);
    ASSERT_NE(first.guest, nullptr);
    const int pool = *first->InitFs();
    first->Put(pool, kFile, 1, MakePage(1));
    first->Poll();
  }  // disconnects: tmemd drops its pools and resets the region
  EXPECT_TRUE(Eventually([&] { return !host_->connected(); }));
  Guest second = Connect(socket_);
  ASSERT_NE(second.guest, nullptr);
  const int pool = *second->InitFs();
  Page out{};
  EXPECT_FALSE(second->Get(pool, kFile, 1, out)) << "nothing of the first";
  second->Put(pool, kFile, 1, MakePage(2));
  EXPECT_TRUE(second->Get(pool, kFile, 1, out));
  EXPECT_EQ(out, MakePage(2));
  EXPECT_GE(host_->resets_done(), 1u);
}

TEST_P(GuestChannelTest, CoherencyHoldsAcrossHostResets) {
  host_resets_under_load_ = true;
  Guest g = Connect(socket_);
  ASSERT_NE(g.guest, nullptr);
  std::atomic<bool> done{false};
  std::thread resetter([&] {
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(15));
      host_->RequestReset();
    }
  });
  WorkloadConfig config;
  config.kind = WorkloadKind::kCoherency;
  config.pages = 256;
  config.ops = 15'000;
  config.seed = 11;
  WorkloadResult r = RunWorkload(*g.guest, config);
  done = true;
  resetter.join();
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.mismatches, 0u) << r.mismatch_report;
  EXPECT_GE(g->counters().host_resets_seen, 1u);
  EXPECT_GT(g->counters().pools_created, 1u) << "re-created after resets";
}

INSTANTIATE_TEST_SUITE_P(Host, GuestChannelTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Polling" : "Doorbell";
                         });

TEST(GuestChannelSmallRingTest, CoherencyUnderRingPressure) {
  // 8 entries: puts drop, invalidates go to the reserve and the barrier.
  TempDir dir{"guest-channel-test"};
  std::unique_ptr<TmemStore> store = MakeStore();
  HostOptions o;
  o.region_bytes = 256 << 10;
  o.ring_entries = 8;
  const std::string socket = dir.path() + "/small.sock";
  InProcessTmemd host(store.get(), socket, o);
  Guest g = Connect(socket);
  ASSERT_NE(g.guest, nullptr);
  WorkloadConfig config;
  config.kind = WorkloadKind::kCoherency;
  config.pages = 128;
  config.ops = 20'000;
  config.seed = 3;
  WorkloadResult r = RunWorkload(*g.guest, config);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.mismatches, 0u) << r.mismatch_report;
  EXPECT_EQ(g->counters().errors, 0u);
}

// ---------------------------------------------------------------------------
// tmem-guestsim, the binary.

struct GuestsimRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

GuestsimRun RunGuestsim(const std::string& args) {
  GuestsimRun run;
  const std::string cmd =
      std::string(TMEM_GUESTSIM_PATH) + " " + args + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return run;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) run.output.append(buf, n);
  const int status = pclose(f);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

TEST(GuestsimTest, CoherencyOnTwoVmsReportsJson) {
  TempDir dir{"guest-channel-test"};
  std::unique_ptr<TmemStore> store = MakeStore();
  HostOptions a;
  a.vm_name = "vm-a";
  HostOptions b;
  b.vm_name = "vm-b";
  b.polling = true;
  const std::string sa = dir.path() + "/a.sock";
  const std::string sb = dir.path() + "/b.sock";
  InProcessTmemd host_a(store.get(), sa, a);
  InProcessTmemd host_b(store.get(), sb, b);
  GuestsimRun run = RunGuestsim("--socket " + sa + " --socket " + sb +
                                " --workload coherency --pages 256 --ops 5000"
                                " --seed 5 --report json --progress-ms 0"
                                " --get-timeout-us 500000");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("\"workload\": \"coherency\""));
  EXPECT_THAT(run.output, HasSubstr("\"mismatches\": 0"));
  EXPECT_THAT(run.output, HasSubstr("\"puts_sent\": "));
  EXPECT_EQ(host_a.metrics().Get(ChannelCounter::kClientsAccepted), 1u);
  EXPECT_EQ(host_b.metrics().Get(ChannelCounter::kClientsAccepted), 1u);
}

TEST(GuestsimTest, EveryWorkloadRunsWithATextReport) {
  TempDir dir{"guest-channel-test"};
  std::unique_ptr<TmemStore> store = MakeStore();
  const std::string s = dir.path() + "/vm.sock";
  InProcessTmemd host(store.get(), s, HostOptions{});
  for (const char* w : {"seq", "reread", "random"}) {
    // One guest at a time: the server takes one client per socket, and
    // frees it when the previous guestsim exits.
    GuestsimRun run =
        RunGuestsim(std::string("--socket ") + s + " --workload " + w +
                    " --pages 300 --ops 2000 --progress-ms 0");
    EXPECT_EQ(run.exit_code, 0) << w << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr("puts_sent")) << w;
    EXPECT_THAT(run.output, HasSubstr("ops/s")) << w;
    EXPECT_TRUE(Eventually([&] { return !host.connected(); })) << w;
  }
}

TEST(GuestsimTest, StopsWhenTmemdGoesAway) {
  TempDir dir{"guest-channel-test"};
  std::unique_ptr<TmemStore> store = MakeStore();
  const std::string s = dir.path() + "/vm.sock";
  auto host = std::make_unique<InProcessTmemd>(store.get(), s, HostOptions{});
  GuestsimRun run;
  std::thread guestsim([&] {
    run = RunGuestsim("--socket " + s +
                      " --workload reread --pages 1000 --ops 100000000"
                      " --progress-ms 0");
  });
  ASSERT_TRUE(Eventually([&] { return host->connected(); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto killed = std::chrono::steady_clock::now();
  host.reset();  // closes the socket; the region stays READY in the guest
  guestsim.join();
  EXPECT_LT(std::chrono::steady_clock::now() - killed,
            std::chrono::seconds(10));
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("tmemd went away"));
  EXPECT_THAT(run.output, HasSubstr("puts_sent")) << "still reports";
}

TEST(GuestsimTest, UsageErrorsExitTwo) {
  EXPECT_EQ(RunGuestsim("--workload seq").exit_code, 2) << "no --socket";
  GuestsimRun guests = RunGuestsim("--socket /nonexistent.sock --guests 2");
  EXPECT_EQ(guests.exit_code, 2);
  EXPECT_THAT(guests.output, HasSubstr("own VM socket"));
  GuestsimRun missing =
      RunGuestsim("--socket /tmp/no-such-tmemd.sock --progress-ms 0");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.output, HasSubstr("is tmemd running"));
  GuestsimRun uuid = RunGuestsim("--socket x --shared-uuid xyz");
  EXPECT_EQ(uuid.exit_code, 2);
  EXPECT_THAT(uuid.output, HasSubstr("not 32 hex digits"));
}

}  // namespace
}  // namespace tmem
