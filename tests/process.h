// Test helpers for tests that drive real binaries: a child process with its
// stdout+stderr captured in a file, polling waits, file reads.
#ifndef TMEMD_TESTS_PROCESS_H_
#define TMEMD_TESTS_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace tmem::testing {

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Polls `cond` every 10 ms until it holds or `timeout_ms` passes.
inline bool WaitUntil(const std::function<bool()>& cond, int timeout_ms) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

inline bool PathExists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

// A child process, stdout+stderr into a file. Killed (SIGKILL) and reaped
// on destruction if still running.
class Process {
 public:
  Process(const std::vector<std::string>& argv, std::string log_path)
      : log_path_(std::move(log_path)) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const std::string& a : argv) {
      args.push_back(const_cast<char*>(a.c_str()));
    }
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) !=
        0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
  }
  // A child someone else started (fork + exec with special set-up); this
  // object reaps it and reads its log.
  Process(pid_t pid, std::string log_path)
      : log_path_(std::move(log_path)), pid_(pid) {}
  ~Process() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // Exit code, or 128 + signal.
  int Wait() {
    if (exited_) return status_;
    int st = 0;
    waitpid(pid_, &st, 0);
    Exited(st);
    return status_;
  }
  bool Running() {
    if (exited_) return false;
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      Exited(st);
      return false;
    }
    return true;
  }
  // Waits up to `timeout_ms`; false if still running, else the exit code
  // (as Wait) in `*code`.
  bool WaitFor(int timeout_ms, int* code) {
    if (!WaitUntil([this] { return !Running(); }, timeout_ms)) return false;
    *code = status_;
    return true;
  }
  // SIGTERM, then the exit code (or -1 after 15 s).
  int Stop() {
    if (exited_) return status_;
    kill(pid_, SIGTERM);
    if (!WaitUntil([this] { return !Running(); }, 15000)) return -1;
    return status_;
  }
  std::string Log() const { return ReadFile(log_path_); }

 private:
  void Exited(int st) {
    exited_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }

  std::string log_path_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
};

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_PROCESS_H_
