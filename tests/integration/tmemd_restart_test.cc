// tmemd restart and upgrade under a running guest, end to end: the real
// daemon, tmem-guestsim processes over real ivshmem sockets, and a test
// playing systemd (NOTIFY_SOCKET fd store, LISTEN_FDS on restart). The
// guest process is never restarted and never reconnects: it must keep
// its device across tmemd's restart, see the new host generation, resume
// puts and hits, and never read a stale page.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tests/integration/fake_systemd.h"
#include "tests/process.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using testing::FakeSystemd;
using testing::PathExists;
using testing::Process;
using testing::TempDir;
using testing::WaitUntil;

// The value of `key=` in the last log line with `event=EVENT` (and
// ` vm=VM ` when vm is non-empty); -1 if absent.
int64_t LogValue(const std::string& log, const std::string& event,
                 const std::string& vm, const std::string& key) {
  std::istringstream in(log);
  std::string line;
  int64_t value = -1;
  while (std::getline(in, line)) {
    if (line.find("event=" + event + " ") == std::string::npos) continue;
    if (!vm.empty() && line.find(" vm=" + vm + " ") == std::string::npos)
      continue;
    const size_t at = line.find(" " + key + "=");
    if (at == std::string::npos) continue;
    value = std::strtoll(line.c_str() + at + key.size() + 2, nullptr, 10);
  }
  return value;
}

// `"key": N` in guestsim's JSON report (the last one: the total).
int64_t JsonValue(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\": ";
  const size_t at = json.rfind(needle);
  if (at == std::string::npos) return -1;
  return std::strtoll(json.c_str() + at + needle.size(), nullptr, 10);
}

class TmemdRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    ASSERT_TRUE(systemd_.ok());
  }
  std::string Sock(const std::string& vm) const {
    return dir_.path() + "/" + vm + ".sock";
  }
  std::vector<std::string> TmemdArgs(const std::vector<std::string>& vms) {
    // mode always: the valve must not throttle on a busy CI machine; this
    // test is about the channel surviving, not about admission.
    std::vector<std::string> argv = {
        TMEMD_BIN, "--socket-dir",     dir_.path(), "--memory-cap",
        "64MiB",   "--mode",           "always",    "--control-socket",
        "",        "--stats-interval", "1"};
    for (const std::string& vm : vms) {
      argv.emplace_back("--vm");
      argv.push_back(vm);
    }
    return argv;
  }
  // `abort_at`: TMEMD_TEST_ABORT_AT for this tmemd (fault_point.h).
  std::unique_ptr<Process> StartTmemd(const std::vector<std::string>& vms,
                                      bool pass_store,
                                      const std::string& abort_at = "") {
    // NOLINTNEXTLINE(concurrency-mt-unsafe): set before the fork, one thread.
    if (!abort_at.empty()) setenv("TMEMD_TEST_ABORT_AT", abort_at.c_str(), 1);
    auto p = systemd_.Start(
        TmemdArgs(vms),
        dir_.path() + "/tmemd-" + std::to_string(++starts_) + ".log",
        pass_store);
    unsetenv("TMEMD_TEST_ABORT_AT");  // NOLINT(concurrency-mt-unsafe)
    const int ready_before = ready_;
    EXPECT_TRUE(WaitUntil(
        [&] { return systemd_.ready_count() > ready_before || !p->Running(); },
        60000))
        << p->Log();
    ready_ = systemd_.ready_count();
    EXPECT_TRUE(p->Running()) << p->Log();
    return p;
  }
  // A coherency run (every hit verified against the guest's own model).
  // With kUntilStopped it runs until SIGTERM (ExpectGuestResumed): a guest
  // whose host is down skips its gets and runs through any fixed number of ops
  // in a second or two, less than a sanitizer build's restart on a loaded
  // machine takes.
  static constexpr int64_t kUntilStopped = -1;
  std::unique_ptr<Process> Guestsim(const std::string& vm, int64_t ops) {
    const std::string log = dir_.path() + "/guestsim-" + vm + "-" +
                            std::to_string(++guests_) + ".log";
    const bool until_stopped = ops == kUntilStopped;
    std::vector<std::string> argv = {
        GUESTSIM_BIN,
        "--socket",
        Sock(vm),
        "--workload",
        "coherency",
        "--pages",
        "2000",
        "--ops",
        std::to_string(until_stopped ? int64_t{1} << 50 : ops),
        "--report",
        "json",
        "--progress-ms",
        "0",
        "--stop-on-signal"};
    return std::make_unique<Process>(argv, log);
  }
  // The guest is attached and tmemd has served it some hits.
  void WaitForTraffic(Process& tmemd, const std::string& vm) {
    ASSERT_TRUE(WaitUntil([&] { return systemd_.Has(vm + "/client"); }, 10000))
        << "QEMU's (guestsim's) connection never reached the fd store\n"
        << tmemd.Log();
    ASSERT_TRUE(WaitUntil(
        [&] { return LogValue(tmemd.Log(), "vm_stats", vm, "gets_hit") > 0; },
        20000))
        << tmemd.Log();
  }
  // The restart benchmark row: from the signal to the first guest request
  // the new tmemd served (the guest re-creating its pool, then its puts).
  void ReportRestartLatency(Process& tmemd, const std::string& kind,
                            std::chrono::steady_clock::time_point signalled) {
    ASSERT_TRUE(WaitUntil(
        [&] {
          return tmemd.Log().find("event=first_request_after_restore") !=
                 std::string::npos;
        },
        30000))
        << tmemd.Log();
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - signalled)
                        .count();
    std::printf(
        "BENCH restart kind=%s signal_to_first_request_ms<=%lld "
        "restore_to_first_request_us=%lld\n",
        kind.c_str(), static_cast<long long>(ms),
        static_cast<long long>(LogValue(
            tmemd.Log(), "first_request_after_restore", "a", "after_us")));
  }
  // After the restart: the guest, still the same process, finishes with
  // no stale page, having seen the host change, and the new tmemd served
  // it puts and hits.
  void ExpectGuestResumed(Process& tmemd, Process& guest, const std::string& vm,
                          bool saw_old_host = true) {
    // After an exec in place the log is the same file: only what the new
    // image wrote counts.
    auto since_restart = [&] {
      const std::string log = tmemd.Log();
      const size_t at = log.rfind("event=restart_recovered ");
      return at == std::string::npos ? log : log.substr(at);
    };
    ASSERT_TRUE(WaitUntil(
        [&] {
          return LogValue(since_restart(), "vm_stats", vm, "gets_hit") > 0;
        },
        60000))
        << "no hit served by the restarted tmemd\n"
        << tmemd.Log() << "\nthe guest (running: " << guest.Running() << "):\n"
        << guest.Log();
    ASSERT_TRUE(guest.Running()) << guest.Log();
    kill(guest.pid(), SIGTERM);
    EXPECT_EQ(guest.Wait(), 0) << guest.Log();
    const std::string report = guest.Log();
    EXPECT_EQ(JsonValue(report, "mismatches"), 0) << report;
    EXPECT_GT(JsonValue(report, "verified_hits"), 0) << report;
    if (saw_old_host) {
      EXPECT_GE(JsonValue(report, "host_resets_seen"), 1) << report;
    }
    EXPECT_EQ(JsonValue(report, "errors"), 0) << report;
    kill(tmemd.pid(), SIGTERM);
    int code = -1;
    ASSERT_TRUE(tmemd.WaitFor(15000, &code)) << tmemd.Log();
    EXPECT_EQ(code, 0) << tmemd.Log();
    const std::string log = since_restart();
    EXPECT_GT(LogValue(log, "vm_stats", vm, "sqe_processed"), 0) << log;
    EXPECT_GT(LogValue(log, "vm_stats", vm, "gets_hit"), 0) << log;
    EXPECT_EQ(LogValue(log, "vm_stats", vm, "bad_entries"), 0) << log;
  }

  TempDir dir_{"tmemd-restart"};
  FakeSystemd systemd_{dir_.path() + "/notify.sock"};
  int starts_ = 0;
  int ready_ = 0;
  int guests_ = 0;
};

TEST_F(TmemdRestartTest, SigtermRestartFromFdStoreKeepsTheGuest) {
  auto tmemd = StartTmemd({"a"}, /*pass_store=*/false);
  auto guest = Guestsim("a", kUntilStopped);
  WaitForTraffic(*tmemd, "a");
  ASSERT_TRUE(guest->Running()) << "guest finished before the restart";
  const auto signalled = std::chrono::steady_clock::now();
  kill(tmemd->pid(), SIGTERM);
  int code = -1;
  ASSERT_TRUE(tmemd->WaitFor(15000, &code)) << tmemd->Log();
  EXPECT_EQ(code, 0) << tmemd->Log();
  // The socket stays for the successor (the store holds its listener).
  EXPECT_TRUE(PathExists(Sock("a")));
  ASSERT_TRUE(guest->Running()) << "guest finished during the restart";

  auto next = StartTmemd({"a"}, /*pass_store=*/true);
  const std::string log = next->Log();
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "restored"), 1) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "guests_kept"), 1) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "fds_rejected"), 0) << log;
  EXPECT_NE(log.find("source=systemd"), std::string::npos) << log;
  ReportRestartLatency(*next, "sigterm+fdstore", signalled);
  ExpectGuestResumed(*next, *guest, "a");
}

// A stop tells systemd it is at work and extends its own timeout (the
// swap write-back may outlast TimeoutStopSec=), after STOPPING=1, and ends
// with exit status 0.
TEST_F(TmemdRestartTest, SigtermExtendsTheStopTimeoutWhileItStops) {
  auto tmemd = StartTmemd({"a"}, /*pass_store=*/false);
  kill(tmemd->pid(), SIGTERM);
  int code = -1;
  ASSERT_TRUE(tmemd->WaitFor(15000, &code)) << tmemd->Log();
  EXPECT_EQ(code, 0) << tmemd->Log();
  const std::vector<std::string> messages = systemd_.messages();
  const auto stopping =
      std::find(messages.begin(), messages.end(), std::string("STOPPING=1"));
  ASSERT_NE(stopping, messages.end()) << ::testing::PrintToString(messages);
  const auto extend =
      std::find_if(stopping, messages.end(), [](const std::string& m) {
        return m.find("EXTEND_TIMEOUT_USEC=30000000\n") != std::string::npos &&
               m.find("WATCHDOG=1\n") != std::string::npos &&
               m.find("STATUS=stopping for ") != std::string::npos;
      });
  EXPECT_NE(extend, messages.end()) << ::testing::PrintToString(messages);
}

// A crash: nothing is cleaned up, nothing is said to the guest. The
// restarted tmemd recovers every channel from the store, and a VM whose
// QEMU went away while no tmemd ran (and that is no longer configured) is
// removed, its socket and stored descriptors with it.
TEST_F(TmemdRestartTest, SigkillRestartRecoversChannelsAndDropsGoneVms) {
  auto tmemd = StartTmemd({"a", "gone"}, /*pass_store=*/false);
  auto guest = Guestsim("a", kUntilStopped);
  auto leaving = Guestsim("gone", kUntilStopped);
  WaitForTraffic(*tmemd, "a");
  ASSERT_TRUE(WaitUntil([&] { return systemd_.Has("gone/client"); }, 10000));
  ASSERT_TRUE(guest->Running()) << "guest finished before the restart";
  const auto signalled = std::chrono::steady_clock::now();
  kill(tmemd->pid(), SIGKILL);
  tmemd->Wait();
  // The second VM's QEMU quits while tmemd is down.
  kill(leaving->pid(), SIGKILL);
  leaving->Wait();

  auto next = StartTmemd({"a"}, /*pass_store=*/true);
  const std::string log = next->Log();
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "restored"), 2) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "guests_kept"), 1)
      << log << "\nthe guest (running: " << guest->Running() << "):\n"
      << guest->Log();
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "vms_gone"), 1) << log;
  EXPECT_FALSE(PathExists(Sock("gone")));
  EXPECT_FALSE(systemd_.Has("gone/shm"));
  EXPECT_FALSE(systemd_.Has("gone/listen"));
  EXPECT_FALSE(systemd_.Has("gone/client"));
  EXPECT_TRUE(systemd_.Has("a/client"));
  ReportRestartLatency(*next, "sigkill+fdstore", signalled);
  ExpectGuestResumed(*next, *guest, "a");
}

// A planned upgrade: SIGHUP makes tmemd exec its binary in place (same
// pid, as systemd expects of a reload), handing the channels over in the
// environment.
TEST_F(TmemdRestartTest, SighupExecsInPlaceAndKeepsTheGuest) {
  auto tmemd = StartTmemd({"a"}, /*pass_store=*/false);
  auto guest = Guestsim("a", kUntilStopped);
  WaitForTraffic(*tmemd, "a");
  ASSERT_TRUE(guest->Running()) << "guest finished before the upgrade";
  const int ready_before = systemd_.ready_count();
  const auto signalled = std::chrono::steady_clock::now();
  kill(tmemd->pid(), SIGHUP);
  ASSERT_TRUE(WaitUntil(
      [&] {
        return systemd_.ready_count() > ready_before || !tmemd->Running();
      },
      20000))
      << tmemd->Log();
  ASSERT_TRUE(tmemd->Running()) << tmemd->Log();
  const std::string log = tmemd->Log();
  EXPECT_NE(log.find("event=upgrade "), std::string::npos) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "guests_kept"), 1) << log;
  EXPECT_NE(log.find("source=exec"), std::string::npos) << log;
  ReportRestartLatency(*tmemd, "sighup-exec", signalled);
  ExpectGuestResumed(*tmemd, *guest, "a");
}

// Hostile or broken hand-over: descriptors that are not what their names
// say are refused (and counted), and tmemd still serves the configured VM
// on a fresh channel.
TEST_F(TmemdRestartTest, BadHandedOverDescriptorsAreRejected) {
  // "a/shm" is a pipe and "junk" names nothing of ours.
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  int sock[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sock), 0);
  // Put them into the fake store as tmemd would have.
  {
    int fake = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, systemd_.path().c_str(),
                 sizeof(addr.sun_path) - 1);
    auto send_fd = [&](const std::string& name, int fd) {
      const std::string text = "FDSTORE=1\nFDNAME=" + name;
      iovec iov{const_cast<char*>(text.data()), text.size()};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr msg{};
      msg.msg_name = &addr;
      msg.msg_namelen = sizeof(addr);
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
      ASSERT_GT(sendmsg(fake, &msg, 0), 0);
    };
    send_fd("a/shm", pipefd[0]);
    send_fd("a/listen", sock[0]);
    send_fd("a/db0", pipefd[1]);
    send_fd("a/irq0", sock[1]);
    send_fd("junk", pipefd[0]);
    close(fake);
  }
  close(pipefd[0]);
  close(pipefd[1]);
  close(sock[0]);
  close(sock[1]);
  ASSERT_EQ(systemd_.stored().size(), 5u);

  auto tmemd = StartTmemd({"a"}, /*pass_store=*/true);
  const std::string log = tmemd->Log();
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "fds_rejected"), 1) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "failed"), 1) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "restored"), 0) << log;
  EXPECT_NE(log.find("event=channel_restore_failed"), std::string::npos) << log;
  // The configured VM is served on a fresh channel.
  auto guest = Guestsim("a", 20000);
  EXPECT_EQ(guest->Wait(), 0) << guest->Log();
  EXPECT_EQ(JsonValue(guest->Log(), "mismatches"), 0);
}

// tmemd killed at each step of a guest's attach and detach (fault points,
// host-agent/fault_point.h), then restarted over the fd store: a guest
// whose handshake was recorded is served again, with verified pages; one
// whose handshake had not gone out is refused cleanly (EOF: the guest
// exits, never hangs) and a guest connecting afterwards is served. Nothing
// of a guest that left survives in the store.
enum class Outcome { kKept, kRefused, kEither };
struct CrashStep {
  const char* step;
  Outcome outcome;  // of the guest that was attaching
};

std::string StepName(const ::testing::TestParamInfo<CrashStep>& info) {
  return info.param.step;
}

class TmemdCrashStepTest : public TmemdRestartTest,
                           public ::testing::WithParamInterface<CrashStep> {
 protected:
  // A fresh guest on the restarted tmemd runs a whole coherency workload.
  void ExpectNewGuestServed() {
    auto fresh = Guestsim("a", 20000);
    int code = -1;
    ASSERT_TRUE(fresh->WaitFor(60000, &code)) << fresh->Log();
    const std::string report = fresh->Log();
    EXPECT_EQ(code, 0) << report;
    EXPECT_EQ(JsonValue(report, "mismatches"), 0) << report;
    EXPECT_GT(JsonValue(report, "verified_hits"), 0) << report;
  }
  void KilledAt(Process& tmemd, const std::string& step) {
    int code = -1;
    ASSERT_TRUE(tmemd.WaitFor(30000, &code))
        << "tmemd never reached " << step << "\n"
        << tmemd.Log();
    EXPECT_EQ(code, 128 + SIGKILL) << tmemd.Log();
    EXPECT_NE(tmemd.Log().find("event=fault_point step=" + step + " "),
              std::string::npos)
        << tmemd.Log();
  }
};

class TmemdAttachCrashTest : public TmemdCrashStepTest {};
class TmemdDetachCrashTest : public TmemdCrashStepTest {};

TEST_P(TmemdAttachCrashTest, GuestKeptOrRefusedCleanly) {
  const std::string step = GetParam().step;
  auto tmemd = StartTmemd({"a"}, /*pass_store=*/false, step);
  auto guest = Guestsim("a", kUntilStopped);
  KilledAt(*tmemd, step);

  auto next = StartTmemd({"a"}, /*pass_store=*/true);
  const std::string log = next->Log();
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "restored"), 1) << log;
  EXPECT_FALSE(systemd_.Has("a/attaching"));
  const int64_t kept = LogValue(log, "restart_recovered", "", "guests_kept");
  const Outcome want = GetParam().outcome;
  if (want != Outcome::kEither) {
    EXPECT_EQ(kept, want == Outcome::kKept ? 1 : 0) << log << "\nthe guest:\n"
                                                    << guest->Log();
  }
  if (kept == 1) {
    EXPECT_TRUE(systemd_.Has("a/client"));
    // It may have mapped the region only after the restart.
    ExpectGuestResumed(*next, *guest, "a", /*saw_old_host=*/false);
    return;
  }
  // Refused: the guest learns it (EOF where its handshake stopped, or a
  // hang-up) and ends instead of waiting on a device nobody serves.
  int code = 0;
  ASSERT_TRUE(guest->WaitFor(60000, &code)) << guest->Log();
  EXPECT_NE(code, 0) << guest->Log();
  EXPECT_FALSE(systemd_.Has("a/client"));
  ExpectNewGuestServed();
}

TEST_P(TmemdDetachCrashTest, NothingOfTheGuestSurvives) {
  const std::string step = GetParam().step;
  auto tmemd = StartTmemd({"a"}, /*pass_store=*/false, step);
  // A guest that stores pages, then leaves: tmemd dies detaching it.
  auto leaving = Guestsim("a", 20000);
  EXPECT_EQ(leaving->Wait(), 0) << leaving->Log();
  KilledAt(*tmemd, step);

  auto next = StartTmemd({"a"}, /*pass_store=*/true);
  const std::string log = next->Log();
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "restored"), 1) << log;
  EXPECT_EQ(LogValue(log, "restart_recovered", "", "guests_kept"), 0) << log;
  EXPECT_FALSE(systemd_.Has("a/client"));
  EXPECT_FALSE(systemd_.Has("a/attaching"));
  ExpectNewGuestServed();
}

// attach_answered: the handshake went out but is not recorded. The guest
// is kept if it had not read it all when the successor looked (SIOCOUTQ),
// else refused; both are clean.
INSTANTIATE_TEST_SUITE_P(
    Steps, TmemdAttachCrashTest,
    ::testing::Values(CrashStep{"attach_accepted", Outcome::kRefused},
                      CrashStep{"attach_stored", Outcome::kRefused},
                      CrashStep{"attach_answered", Outcome::kEither},
                      CrashStep{"attach_recorded", Outcome::kKept},
                      CrashStep{"attach_done", Outcome::kKept}),
    StepName);

INSTANTIATE_TEST_SUITE_P(
    Steps, TmemdDetachCrashTest,
    ::testing::Values(CrashStep{"detach_begin", Outcome::kRefused},
                      CrashStep{"detach_unstored", Outcome::kRefused},
                      CrashStep{"detach_reset", Outcome::kRefused}),
    StepName);

}  // namespace
}  // namespace tmem
