// A local user against tmemd's descriptors: a real tmemd process, its real
// control sockets, real tmemctl calls and real tmem-guestsim guests.
//
//  * A flood of idle connections to the world-accessible read-only socket,
//    more than its cap and more than tmemd's RLIMIT_NOFILE, leaves the
//    admin socket and a new guest's channel served, is counted (Status and
//    /metrics, promtool-clean), and once it ends the read-only socket
//    serves again.
//  * A moment with no descriptor at all (the soft limit lowered under the
//    running tmemd with prlimit) while clients wait on every listener: no
//    listener spins, and each one accepts again once descriptors are back.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/control/test_util.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using nlohmann::json;
using testing::HttpGet;
using testing::LogInt;
using testing::Process;
using testing::RunResult;
using testing::WaitUntil;

// A non-blocking connect to a UNIX socket; -1 if refused or the backlog is
// full.
int ConnectUnix(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  path.copy(a.sun_path, sizeof(a.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int ConnectTcp(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 &&
      errno != EINPROGRESS) {
    close(fd);
    return -1;
  }
  return fd;
}

std::vector<int> OpenFds(pid_t pid) {
  std::vector<int> fds;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    fds.push_back(std::stoi(e.path().filename().string()));
  }
  std::sort(fds.begin(), fds.end());
  return fds;
}

// Time each thread of `pid` spent runnable (on a CPU or waiting for one),
// in seconds, by thread id (/proc/PID/task/*/schedstat). A thread that
// spins is runnable all the time however loaded the machine is; one that
// sleeps in poll() is not, so this tells the two apart where CPU time
// would not (a spinner on a busy machine gets little CPU).
std::map<std::string, double> RunnableByThread(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  std::map<std::string, double> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path().string() + "/schedstat");
    uint64_t on_cpu = 0, waiting = 0;
    if (in >> on_cpu >> waiting) {
      out[e.path().filename().string()] =
          static_cast<double>(on_cpu + waiting) / 1e9;
    }
  }
  return out;
}

// The most runnable time one thread gained between two readings. Per
// thread, not summed: on a loaded machine each of tmemd's dozen threads
// waits in the run queue at every wake-up (ticker, workers), and the sum
// of those waits is not a spinner; a spinner is one thread runnable for
// the whole window.
double MaxThreadGain(const std::map<std::string, double>& before,
                     const std::map<std::string, double>& after) {
  double most = 0;
  for (const auto& [tid, t] : after) {
    const auto it = before.find(tid);
    most = std::max(most, t - (it == before.end() ? 0.0 : it->second));
  }
  return most;
}

uint64_t Counter(const json& status, const std::string& name) {
  for (const json& c : status.value("counters", json::array())) {
    if (c.value("name", "") == name) {
      const json& v = c.at("value");
      return v.is_string() ? std::stoull(v.get<std::string>())
                           : v.get<uint64_t>();
    }
  }
  ADD_FAILURE() << "no counter " << name << " in " << status.dump();
  return 0;
}

class ControlFdExhaustionTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef TMEM_TSAN_SKIP_GRPC
    GTEST_SKIP() << "skipped under TSan: Debian's gRPC is not TSan-"
                    "instrumented (see tests/control/CMakeLists.txt)";
#endif
    tmp_ = std::make_unique<testing::TempDir>("tmem-fdx");
    ASSERT_FALSE(tmp_->path().empty());
    dir_ = tmp_->path();
    // The flood's client ends live in this process.
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    if (lim.rlim_cur < 2048 && lim.rlim_max >= 2048) {
      lim.rlim_cur = 2048;
      setrlimit(RLIMIT_NOFILE, &lim);
    }
  }
  void TearDown() override {
    CloseFlood();
    tmemd_.reset();
    tmp_.reset();
  }

  void StartTmemd(const std::vector<std::string>& prefix,
                  const std::vector<std::string>& extra) {
    std::vector<std::string> argv = prefix;
    for (const std::string& a :
         {std::string(TMEMD_BIN), std::string("--socket-dir"), dir_,
          std::string("--memory-cap"), std::string("64MiB"),
          std::string("--workers"), std::string("1"), std::string("--vm"),
          std::string("g1"), std::string("--vm"), std::string("g2"),
          std::string("--control-readonly-socket"), Ro(),
          std::string("--metrics-port"), std::string("0")}) {
      argv.push_back(a);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    tmemd_ = std::make_unique<Process>(argv, dir_ + "/tmemd.log");
    ASSERT_TRUE(WaitUntil(
        [&] {
          return tmemd_->Log().find("event=tmemd_ready") != std::string::npos ||
                 !tmemd_->Running();
        },
        20000))
        << tmemd_->Log();
    ASSERT_TRUE(tmemd_->Running()) << tmemd_->Log();
    metrics_port_ = static_cast<int>(
        LogInt(tmemd_->Log(), "control_ready", "metrics_port"));
    ASSERT_GT(metrics_port_, 0) << tmemd_->Log();
  }

  std::string Admin() const { return dir_ + "/control.sock"; }
  std::string Ro() const { return dir_ + "/ro.sock"; }

  RunResult Ctl(const std::string& socket,
                const std::vector<std::string>& args) {
    std::vector<std::string> argv = {TMEMCTL_BIN, "-s", socket, "-t", "10"};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::Run(argv,
                        dir_ + "/tmemctl-" + std::to_string(++runs_) + ".out");
  }
  json Status(const std::string& socket) {
    RunResult r = Ctl(socket, {"-o", "json", "status"});
    EXPECT_EQ(r.code, 0) << r.output;
    try {
      return json::parse(r.output);
    } catch (const json::exception& e) {
      ADD_FAILURE() << e.what() << "\n" << r.output;
      return json::object();
    }
  }
  int Guest(const std::string& vm) {
    Process p(
        {GUESTSIM_BIN, "--socket", dir_ + "/" + vm + ".sock", "--progress-ms",
         "0", "--get-timeout-us", "2000000", "--workload", "reread", "--pages",
         "64", "--ops", "300", "--seed", "5"},
        dir_ + "/guestsim-" + std::to_string(++runs_) + ".log");
    const int code = p.Wait();
    EXPECT_EQ(code, 0) << p.Log();
    return code;
  }
  void CloseFlood() {
    for (int fd : flood_) close(fd);
    flood_.clear();
  }

  std::unique_ptr<testing::TempDir> tmp_;
  std::string dir_;  // tmp_'s path
  std::unique_ptr<Process> tmemd_;
  std::vector<int> flood_;
  int metrics_port_ = -1;
  int runs_ = 0;
};

TEST_F(ControlFdExhaustionTest, ReadOnlyFloodLeavesAdminAndGuestsServed) {
  // tmemd gets 256 descriptors, hard limit included: the flood below opens
  // more connections than that.
  constexpr int kNofile = 256;
  constexpr int kReadonlyCap = 4;
  constexpr int kFlood = 400;
  StartTmemd(
      {"/usr/bin/prlimit",
       "--nofile=" + std::to_string(kNofile) + ":" + std::to_string(kNofile),
       "--"},
      {"--control-max-readonly-connections", std::to_string(kReadonlyCap),
       "--control-max-admin-connections", "16", "--reserved-vm-channels", "4"});
  if (LogInt(tmemd_->Log(), "descriptor_budget", "max_readonly_connections") >=
      0) {
    EXPECT_EQ(
        LogInt(tmemd_->Log(), "descriptor_budget", "max_readonly_connections"),
        kReadonlyCap)
        << tmemd_->Log();
  }
  const size_t fds_at_start = OpenFds(tmemd_->pid()).size();

  // Idle connections: a connect succeeds once tmemd accepted it or it sits
  // in the backlog; keep connecting until kFlood are open or the socket
  // pushes back for a while.
  for (int tries = 0; flood_.size() < kFlood && tries < 20 * kFlood; ++tries) {
    const int fd = ConnectUnix(Ro());
    if (fd >= 0) {
      flood_.push_back(fd);
    } else {
      usleep(1000);
    }
  }
  EXPECT_GT(flood_.size(), static_cast<size_t>(kNofile)) << "flood too small";

  // The admin socket answers during the flood; the read-only listener holds
  // at most its cap and counts the rest.
  json st;
  ASSERT_TRUE(WaitUntil(
      [&] {
        st = Status(Admin());
        return !st.empty() &&
               Counter(st, "control_readonly_connections_refused") +
                       Counter(st, "control_readonly_connections_open") >=
                   flood_.size() - 128;  // all but a backlog's worth
      },
      30000))
      << st.dump() << tmemd_->Log();
  EXPECT_LE(Counter(st, "control_readonly_connections_open"),
            static_cast<uint64_t>(kReadonlyCap));
  EXPECT_EQ(Counter(st, "control_readonly_connections_max"),
            static_cast<uint64_t>(kReadonlyCap));
  EXPECT_GT(Counter(st, "control_readonly_connections_refused"), 0u);
  // tmemd's descriptors did not grow with the flood.
  EXPECT_LE(OpenFds(tmemd_->pid()).size(),
            fds_at_start + size_t{2} * kReadonlyCap + 8);

  // A guest attaches (QEMU's handshake on its channel socket) during the
  // flood, and an admin write goes through.
  EXPECT_EQ(Guest("g2"), 0) << tmemd_->Log();
  RunResult r = Ctl(Admin(), {"set-weight", "g1", "250"});
  EXPECT_EQ(r.code, 0) << r.output;

  // Counted on /metrics too, in an exposition promtool accepts.
  const std::string metrics = HttpGet(metrics_port_);
  ASSERT_NE(metrics.find("200 OK"), std::string::npos) << metrics;
  EXPECT_NE(
      metrics.find(
          "tmem_control_connections_refused_total{listener=\"readonly\"} "),
      std::string::npos)
      << metrics;
  const std::string body = metrics.substr(metrics.find("\r\n\r\n") + 4);
  std::ofstream(dir_ + "/metrics.txt") << body;
  const std::string promtool = "promtool check metrics < '" + dir_ +
                               "/metrics.txt' > '" + dir_ +
                               "/promtool.out' 2>&1";
  if (access("/usr/bin/promtool", X_OK) == 0) {
    // Called with no other thread of ours running.
    // NOLINTNEXTLINE(concurrency-mt-unsafe)
    EXPECT_EQ(std::system(promtool.c_str()), 0)
        << testing::ReadFile(dir_ + "/promtool.out");
  }

  // After the flood the read-only socket serves again.
  CloseFlood();
  ASSERT_TRUE(WaitUntil([&] { return Ctl(Ro(), {"status"}).code == 0; }, 30000))
      << tmemd_->Log();
  EXPECT_EQ(Ctl(Admin(), {"status"}).code, 0);
  EXPECT_EQ(tmemd_->Stop(), 0) << tmemd_->Log();
}

TEST_F(ControlFdExhaustionTest, ListenersRecoverWhenDescriptorsComeBack) {
  constexpr int kWindowUs = 2'000'000;
  StartTmemd({}, {});
  const pid_t pid = tmemd_->pid();
  // Warm up every listener once, so nothing below is a first-use cost.
  ASSERT_EQ(Ctl(Ro(), {"status"}).code, 0);
  ASSERT_EQ(Ctl(Admin(), {"status"}).code, 0);
  ASSERT_NE(HttpGet(metrics_port_).find("200 OK"), std::string::npos);

  // No free descriptor number below the new soft limit: every accept fails.
  rlimit saved{};
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, nullptr, &saved), 0);
  const std::vector<int> fds = OpenFds(pid);
  int lowest_free = 0;
  while (std::binary_search(fds.begin(), fds.end(), lowest_free)) {
    ++lowest_free;
  }
  rlimit exhausted = saved;
  exhausted.rlim_cur = static_cast<rlim_t>(lowest_free);
  // The same span idle first, as the yardstick.
  const auto idle_before = RunnableByThread(pid);
  usleep(kWindowUs);
  const double idle = MaxThreadGain(idle_before, RunnableByThread(pid));
  const auto exhausted_before = RunnableByThread(pid);
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, &exhausted, nullptr), 0);

  // Clients wait on each listener meanwhile: on the read-only and admin
  // sockets, and on /metrics.
  for (int i = 0; i < 3; ++i) {
    for (const std::string& s : {Ro(), Admin()}) {
      if (const int fd = ConnectUnix(s); fd >= 0) flood_.push_back(fd);
    }
    if (const int fd = ConnectTcp(metrics_port_); fd >= 0) {
      flood_.push_back(fd);
    }
  }
  // Two seconds with connections pending and no descriptor to take them.
  usleep(kWindowUs);
  const double busy = MaxThreadGain(exhausted_before, RunnableByThread(pid));
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, &saved, nullptr), 0);
  CloseFlood();

  // A listener that spun on its readable socket would have kept its thread
  // runnable for the whole window on top of the idle figure; waiting out a
  // retry adds next to nothing.
  EXPECT_LT(busy, idle + 0.5 * kWindowUs / 1e6)
      << "a tmemd thread was runnable " << busy << " s of " << kWindowUs / 1e6
      << " s while out of descriptors (the most of any thread idle: " << idle
      << " s)";

  // Every listener accepts again.
  ASSERT_TRUE(WaitUntil([&] { return Ctl(Ro(), {"status"}).code == 0; }, 30000))
      << tmemd_->Log();
  EXPECT_EQ(Ctl(Admin(), {"status"}).code, 0) << tmemd_->Log();
  std::string metrics;
  ASSERT_TRUE(WaitUntil(
      [&] {
        metrics = HttpGet(metrics_port_);
        return metrics.find("200 OK") != std::string::npos;
      },
      30000))
      << tmemd_->Log();
  json st = Status(Admin());
  EXPECT_GT(Counter(st, "control_readonly_accept_failures"), 0u) << st.dump();
  EXPECT_GT(Counter(st, "control_admin_accept_failures"), 0u) << st.dump();
  EXPECT_EQ(metrics.find("tmem_metrics_http_accept_failures_total 0"),
            std::string::npos)
      << metrics;
  // And a guest still attaches.
  EXPECT_EQ(Guest("g1"), 0) << tmemd_->Log();
  EXPECT_EQ(tmemd_->Stop(), 0) << tmemd_->Log();
}

}  // namespace
}  // namespace tmem
