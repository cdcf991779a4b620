// tmemd's swap device end to end: the real binary started with
// --swap vm1=64M (and --vm vm1: one VM with both frontends), the test
// playing QEMU's vhost-user front-end and the guest's virtio-blk driver
// over the device's real socket. Pages written are read back and verified;
// tmemctl (-o json and the table) and /metrics (promtool-clean) show the
// device; SIGTERM leaves no socket behind, and the next tmemd over the same
// state directory reads every page back. Bad --swap values and a bad
// [swap.NAME] are refused with their source.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/control/test_util.h"
#include "tests/process.h"
#include "tests/swap/vhost_user_front_end.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using nlohmann::json;
using swap::testing::FrontEnd;
using swap::testing::Guest;
using testing::HttpGet;
using testing::LogInt;
using testing::Process;
using testing::ReadFile;
using testing::WaitUntil;

constexpr uint64_t kDeviceBytes = uint64_t{64} << 20;
#ifdef TMEM_TSAN_SKIP_GRPC
constexpr bool kRpcChecks = false;
#else
constexpr bool kRpcChecks = true;
#endif
constexpr int kPagesWritten = 256;

// Proto JSON writes 64-bit integers as strings.
uint64_t U64Of(const json& j) {
  return j.is_string() ? std::stoull(j.get<std::string>()) : j.get<uint64_t>();
}

class TmemdSwapTest : public ::testing::Test {
 protected:
  testing::RunResult Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {TMEMCTL_BIN, "-s", dir_ + "/c.sock"};
    argv.insert(argv.end(), args.begin(), args.end());
    Process p(argv, dir_ + "/tmemctl-" + std::to_string(++runs_) + ".log");
    testing::RunResult r;
    r.code = p.Wait();
    r.output = p.Log();
    return r;
  }

  tmem::testing::TempDir tmp_{"tmemd-swap"};
  std::string dir_ = tmp_.path();
  int runs_ = 0;
};

TEST_F(TmemdSwapTest, ServesVerifiedPagesShowsThemAndLeavesNoSocket) {
  const std::string sockets = dir_ + "/s";
  Process tmemd(
      {TMEMD_BIN, "--socket-dir", sockets, "--swap", "vm1=64M", "--vm", "vm1",
       "--control-socket", dir_ + "/c.sock", "--metrics-port", "0",
       "--state-dir", dir_ + "/state", "--workers", "1", "--no-fd-store"},
      dir_ + "/tmemd.log");
  ASSERT_TRUE(WaitUntil(
      [&] {
        return tmemd.Log().find("event=tmemd_ready") != std::string::npos;
      },
      30000))
      << tmemd.Log();
  const std::string swap_sock = sockets + "/vm1.swap.sock";
  struct stat st {};
  ASSERT_EQ(stat(swap_sock.c_str(), &st), 0) << tmemd.Log();
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u) << "the ivshmem sockets' mode";

  auto fe = FrontEnd::Connect(swap_sock);
  ASSERT_NE(fe, nullptr);
  // tmemd offers four queues (QEMU uses up to its num-queues of them).
  Guest g(kDeviceBytes / 4096, 4);
  g.Handshake(fe.get());
  for (uint8_t s : g.WritePages(0, kPagesWritten, 11)) {
    ASSERT_EQ(s, swap::kVirtioBlkSOk);
  }
  // The device's last page too: the whole 64 MiB is addressable.
  const uint64_t last = kDeviceBytes / 4096 - 1;
  for (uint8_t s : g.WritePages(last, 1, 11)) ASSERT_EQ(s, swap::kVirtioBlkSOk);
  EXPECT_EQ(g.VerifyPages(0, kPagesWritten, 11), 0);
  EXPECT_EQ(g.VerifyPages(last, 1, 11), 0);
  // Negative control: another pattern fails every page.
  EXPECT_EQ(g.VerifyPages(0, 8, 12), 8);
  const uint64_t stored = kPagesWritten + 1;

  // Debian's gRPC is not TSan-instrumented (tests/control/CMakeLists.txt):
  // under TSan the tmemctl checks are left out, the data path still runs.
  if (kRpcChecks) {
    // tmemctl -o json: the VM has both frontends, the device its pages.
    testing::RunResult r = Ctl({"-o", "json", "vms"});
    ASSERT_EQ(r.code, 0) << r.output;
    const json vms = json::parse(r.output.substr(r.output.find('{')));
    ASSERT_EQ(vms["vms"].size(), 1u) << r.output;
    const json& vm = vms["vms"][0];
    EXPECT_EQ(vm["name"], "vm1");
    EXPECT_TRUE(vm["has_channel"].get<bool>());
    const json& sw = vm["swap"];
    EXPECT_EQ(sw["socket_path"], swap_sock);
    EXPECT_EQ(U64Of(sw["size_bytes"]), kDeviceBytes);
    EXPECT_TRUE(sw["connected"].get<bool>());
    EXPECT_EQ(U64Of(sw["stored_pages"]), stored);
    // In memory (the persistent pool) or spilled: every page is somewhere.
    EXPECT_EQ(U64Of(sw["memory_pages"]) + U64Of(sw["spilled_pages"]), stored);
    EXPECT_EQ(U64Of(sw["lost_pages"]), 0u);
    EXPECT_EQ(U64Of(sw["writes"]), stored);
    EXPECT_EQ(U64Of(sw["reads"]), stored + 8);
    EXPECT_EQ(U64Of(sw["write_calls"]), stored);
    EXPECT_GT(U64Of(sw["write_ns"]), 0u);

    // The table shows the swap columns.
    r = Ctl({"vms"});
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("SWPAGES"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("64.0MiB"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(std::to_string(stored)), std::string::npos)
        << r.output;
  }

  // /metrics: the tmem_swap_* families, in an exposition promtool accepts.
  const int64_t port = LogInt(tmemd.Log(), "control_ready", "metrics_port");
  ASSERT_GT(port, 0) << tmemd.Log();
  const std::string metrics = HttpGet(static_cast<int>(port));
  ASSERT_NE(metrics.find("200 OK"), std::string::npos) << metrics;
  for (const std::string& series :
       {"tmem_swap_stored_pages{vm=\"vm1\"} " + std::to_string(stored),
        std::string("# TYPE tmem_swap_memory_pages gauge"),
        std::string("# TYPE tmem_swap_backing_events_total counter"),
        "tmem_swap_writes_total{vm=\"vm1\"} " + std::to_string(stored),
        std::string("tmem_swap_connected{vm=\"vm1\"} 1"),
        std::string("tmem_swap_size_bytes{vm=\"vm1\"} 67108864"),
        std::string("# TYPE tmem_swap_backing_write_seconds_total counter")}) {
    EXPECT_NE(metrics.find(series), std::string::npos) << series;
  }
  const std::string body = metrics.substr(metrics.find("\r\n\r\n") + 4);
  std::ofstream(dir_ + "/metrics.txt") << body;
  if (access("/usr/bin/promtool", X_OK) == 0) {
    const std::string promtool = "promtool check metrics < '" + dir_ +
                                 "/metrics.txt' > '" + dir_ +
                                 "/promtool.out' 2>&1";
    // No other thread of ours runs here.
    // NOLINTNEXTLINE(concurrency-mt-unsafe)
    EXPECT_EQ(std::system(promtool.c_str()), 0)
        << ReadFile(dir_ + "/promtool.out");
  }

  // SIGTERM with the front-end still attached: a clean exit, the pages
  // written back (logged), and no socket left.
  EXPECT_EQ(tmemd.Stop(), 0) << tmemd.Log();
  EXPECT_EQ(LogInt(tmemd.Log(), "swap_written_back", "stored_pages"),
            static_cast<int64_t>(stored))
      << tmemd.Log();
  EXPECT_FALSE(testing::PathExists(swap_sock));
  EXPECT_FALSE(testing::PathExists(sockets + "/vm1.sock"));

  // The next tmemd over the same state directory serves the same disk:
  // every page the first one held comes back from the image.
  Process next({TMEMD_BIN, "--socket-dir", sockets, "--swap", "vm1=64M",
                "--control-socket", "", "--state-dir", dir_ + "/state",
                "--workers", "1", "--no-fd-store"},
               dir_ + "/tmemd-next.log");
  ASSERT_TRUE(WaitUntil(
      [&] { return next.Log().find("event=tmemd_ready") != std::string::npos; },
      30000))
      << next.Log();
  auto again = FrontEnd::Connect(swap_sock);
  ASSERT_NE(again, nullptr);
  Guest g2(kDeviceBytes / 4096, 4);
  g2.Handshake(again.get());
  EXPECT_EQ(g2.VerifyPages(0, kPagesWritten, 11), 0) << next.Log();
  EXPECT_EQ(g2.VerifyPages(last, 1, 11), 0) << next.Log();
  again.reset();
  EXPECT_EQ(next.Stop(), 0) << next.Log();
}

// A SIGKILL leaves the device's pages that tmemd held in memory nowhere:
// the next tmemd refuses that device (naming its in-use mark), never
// serving zeros where the guest wrote, and serves every other VM.
TEST_F(TmemdSwapTest, DeviceKilledWithoutWriteBackIsRefusedOthersServe) {
  const std::string sockets = dir_ + "/s";
  const std::vector<std::string> base = {
      TMEMD_BIN, "--socket-dir", sockets,         "--control-socket",
      "",        "--state-dir",  dir_ + "/state", "--workers",
      "1",       "--no-fd-store"};
  std::vector<std::string> first = base;
  first.insert(first.end(), {"--swap", "vm1=64M"});
  Process killed(first, dir_ + "/tmemd-killed.log");
  ASSERT_TRUE(WaitUntil(
      [&] {
        return killed.Log().find("event=tmemd_ready") != std::string::npos;
      },
      30000))
      << killed.Log();
  auto fe = FrontEnd::Connect(sockets + "/vm1.swap.sock");
  ASSERT_NE(fe, nullptr);
  Guest g(kDeviceBytes / 4096, 4);
  g.Handshake(fe.get());
  g.WritePages(0, 8, 5);  // held in tmemd's memory
  ASSERT_EQ(::kill(killed.pid(), SIGKILL), 0);
  killed.Wait();
  fe.reset();
  const std::string mark = dir_ + "/state/swap/vm1.img.inuse";
  ASSERT_TRUE(testing::PathExists(mark));

  std::vector<std::string> second = base;
  second.insert(second.end(), {"--swap", "vm1=64M", "--swap", "vm2=64M"});
  Process next(second, dir_ + "/tmemd-next.log");
  ASSERT_TRUE(WaitUntil(
      [&] { return next.Log().find("event=tmemd_ready") != std::string::npos; },
      30000))
      << next.Log();
  EXPECT_NE(next.Log().find("event=swap_device_refused"), std::string::npos)
      << next.Log();
  EXPECT_NE(next.Log().find(mark), std::string::npos) << next.Log();
  // The killed tmemd's socket file may remain; nobody answers on it.
  EXPECT_EQ(FrontEnd::Connect(sockets + "/vm1.swap.sock"), nullptr);
  auto other = FrontEnd::Connect(sockets + "/vm2.swap.sock");
  ASSERT_NE(other, nullptr) << next.Log();
  Guest g2(kDeviceBytes / 4096, 4);
  g2.Handshake(other.get());
  g2.WritePages(0, 8, 6);
  EXPECT_EQ(g2.VerifyPages(0, 8, 6), 0) << next.Log();
  other.reset();
  EXPECT_EQ(next.Stop(), 0) << next.Log();
  EXPECT_TRUE(testing::PathExists(mark)) << "kept until the operator acts";
}

TEST_F(TmemdSwapTest, BadSwapSettingsAreRefusedWithTheirSource) {
  for (const char* bad : {"vm1=4097", "vm1=0", "vm1", "../x=4G"}) {
    Process p({TMEMD_BIN, "--socket-dir", dir_ + "/s", "--swap", bad,
               "--control-socket", ""},
              dir_ + "/bad.log");
    EXPECT_EQ(p.Wait(), 2) << bad;
    EXPECT_NE(p.Log().find("flag=--swap"), std::string::npos) << p.Log();
    EXPECT_NE(p.Log().find(std::string("--swap '") + bad + "'"),
              std::string::npos)
        << p.Log();
    EXPECT_FALSE(testing::PathExists(dir_ + "/s")) << "refused before start";
  }
  const std::string file = dir_ + "/bad.toml";
  std::ofstream(file) << "[swap.vm1]\nsize = \"5000\"\n";
  Process check({TMEMD_BIN, "--check-config", file}, dir_ + "/check.log");
  EXPECT_EQ(check.Wait(), 2);
  EXPECT_NE(check.Log().find(file + ":2"), std::string::npos) << check.Log();
  EXPECT_NE(check.Log().find("not a multiple of 4096"), std::string::npos)
      << check.Log();
}

}  // namespace
}  // namespace tmem
