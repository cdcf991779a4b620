// The tmemd binary with --libvirt-uri: connects (test:///default, which
// tmemd opens in its own process), reports ready, shuts down cleanly on
// SIGTERM; an unreachable libvirtd is waited for in the background.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/libvirt/libvirt_test_support.h"
#include "tests/temp_dir.h"

extern char** environ;

namespace tmem {
namespace {

class TmemdLibvirtTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.empty()) << "mkdtemp failed"; }
  void TearDown() override {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  void Spawn(const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {TMEMD_BIN, "--socket-dir", dir_ + "/sock"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, Log().c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ASSERT_EQ(
        posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ),
        0);
    posix_spawn_file_actions_destroy(&actions);
  }
  std::string Log() const { return dir_ + "/tmemd.log"; }
  std::string LogText() const {
    std::ifstream in(Log());
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  int Wait() {
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }

  tmem::testing::TempDir tmp_{"tmemd-lvd"};
  std::string dir_ = tmp_.path();
  pid_t pid_ = -1;
};

TEST_F(TmemdLibvirtTest, ConnectsReportsReadyAndStopsCleanly) {
  Spawn({"--libvirt-uri", "test:///default"});
  // The connection is made in the background: it may follow the ready line.
  ASSERT_TRUE(WaitFor(
      [&] {
        const std::string log = LogText();
        return log.find("event=tmemd_ready") != std::string::npos &&
               log.find("event=libvirt_synced") != std::string::npos;
      },
      std::chrono::milliseconds(10000)))
      << LogText();
  const std::string log = LogText();
  EXPECT_NE(log.find("event=libvirt_connected uri=test:///default"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("event=libvirt_ready"), std::string::npos) << log;
  EXPECT_EQ(log.find("no_vms"), std::string::npos) << log;
  kill(pid_, SIGTERM);
  EXPECT_EQ(Wait(), 0) << LogText();
  EXPECT_NE(LogText().find("event=tmemd_stopped"), std::string::npos);
}

// libvirtd not there when tmemd starts (down, or ordered after tmemd at
// boot): tmemd is ready at once, says why it is not connected, keeps
// trying, and syncs with libvirt when libvirtd appears at the URI (here
// the system libvirtd's socket, reached through a symlink made later).
TEST_F(TmemdLibvirtTest, LibvirtdNotThereYetIsWaitedForInTheBackground) {
  const std::string socket = dir_ + "/libvirt-sock";
  const std::string uri = "qemu+unix:///system?socket=" + socket;
  Spawn({"--libvirt-uri", uri});
  ASSERT_TRUE(WaitFor(
      [&] {
        const std::string log = LogText();
        return log.find("event=tmemd_ready") != std::string::npos &&
               log.find("event=libvirt_connect_failed") != std::string::npos;
      },
      std::chrono::milliseconds(10000)))
      << LogText();
  std::string log = LogText();
  EXPECT_NE(log.find("event=libvirt_waiting"), std::string::npos) << log;
  // The reason is libvirt's own (the socket that is not there).
  EXPECT_NE(log.find(socket), std::string::npos) << log;
  EXPECT_EQ(log.find("event=libvirt_connected"), std::string::npos) << log;
  EXPECT_EQ(kill(pid_, 0), 0) << "tmemd exited\n" << log;

  const char* system_socket = "/run/libvirt/libvirt-sock";
  if (access(system_socket, F_OK) != 0) {
    GTEST_SKIP() << "no system libvirtd at " << system_socket
                 << " (scripts/start-libvirtd.sh starts one): the "
                    "connection after the wait is not tested";
  }
  ASSERT_EQ(symlink(system_socket, socket.c_str()), 0);
  // Retries back off to 5 s.
  ASSERT_TRUE(WaitFor(
      [&] {
        return LogText().find("event=libvirt_synced") != std::string::npos;
      },
      std::chrono::milliseconds(20000)))
      << LogText();
  log = LogText();
  EXPECT_NE(log.find("event=libvirt_connected"), std::string::npos) << log;
  kill(pid_, SIGTERM);
  EXPECT_EQ(Wait(), 0) << LogText();
}

}  // namespace
}  // namespace tmem
