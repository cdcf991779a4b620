#include "bench/scenario/processes.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace tmem::scenario {

namespace {

using Clock = std::chrono::steady_clock;

// Every child alive (tmemd, guests, hogs), so a signal to the driver takes
// them down with it instead of leaving busy hogs behind.
constexpr int kMaxChildren = 64;
volatile sig_atomic_t g_children[kMaxChildren];

void Track(pid_t pid) {
  for (volatile sig_atomic_t& c : g_children) {
    if (c == 0) {
      c = pid;
      return;
    }
  }
}

}  // namespace

void Untrack(pid_t pid) {
  for (volatile sig_atomic_t& c : g_children) {
    if (c == pid) c = 0;
  }
}

void KillChildrenAndExit(int sig) {
  for (volatile sig_atomic_t& c : g_children) {
    if (c > 0) kill(static_cast<pid_t>(c), SIGKILL);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (out_fd >= 0) dup2(out_fd, STDOUT_FILENO);
    if (err_fd >= 0) dup2(err_fd, STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  if (pid > 0) Track(pid);
  return pid;
}

pid_t SpawnHog() {
  const pid_t pid = fork();
  if (pid == 0) {
    volatile uint64_t x = 0;
    for (;;) x = x + 1;
  }
  if (pid > 0) Track(pid);
  return pid;
}

double ProcCpuSeconds(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(f, line)) return std::nan("");
  // The command may contain spaces: fields start after the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nan("");
  std::istringstream in(line.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  // Fields 3.. (state is 3); utime is 14, stime 15.
  for (int n = 3; n <= 15 && in >> field; ++n) {
    if (n == 14) utime = std::strtod(field.c_str(), nullptr);
    if (n == 15) stime = std::strtod(field.c_str(), nullptr);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int WaitWithTimeout(pid_t pid, std::chrono::milliseconds timeout,
                    struct rusage* ru) {
  const Clock::time_point end = Clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t r = wait4(pid, &status, WNOHANG, ru);
    if (r == pid) {
      Untrack(pid);
      return status;
    }
    if (r < 0 && errno != EINTR) return -1;
    if (Clock::now() >= end) {
      kill(pid, SIGKILL);
      const int rc = wait4(pid, &status, 0, ru) == pid ? status : -1;
      Untrack(pid);
      return rc;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace tmem::scenario
