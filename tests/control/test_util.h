// Helpers for the control-plane tests: child processes with captured
// output, polling waits, and a throwaway CA with server and client
// certificates made by the openssl CLI.
#ifndef TMEMD_TESTS_CONTROL_TEST_UTIL_H_
#define TMEMD_TESTS_CONTROL_TEST_UTIL_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
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

// A child process, stdout+stderr into a file.
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
  ~Process() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  int Wait() {
    if (exited_) return status_;
    int st = 0;
    waitpid(pid_, &st, 0);
    exited_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }
  bool Running() {
    if (exited_) return false;
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      exited_ = true;
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return false;
    }
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
  std::string log_path_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
};

struct RunResult {
  int code = -1;
  std::string output;  // stdout + stderr
};

inline RunResult Run(const std::vector<std::string>& argv,
                     const std::string& log_path) {
  Process p(argv, log_path);
  RunResult r;
  r.code = p.Wait();
  r.output = p.Log();
  return r;
}

// A CA, a server certificate for localhost/127.0.0.1, client certificates
// with CN "ops-admin" and "monitor", and "ops-admin" signed by a second CA
// the server does not trust.
struct TestCerts {
  std::string dir;
  std::string ca, server_cert, server_key;
  std::string admin_cert, admin_key, monitor_cert, monitor_key;
  std::string rogue_cert, rogue_key;
  std::string error;  // non-empty if openssl failed
};

inline TestCerts MakeTestCerts(const std::string& dir) {
  TestCerts c;
  c.dir = dir;
  mkdir(dir.c_str(), 0700);
  auto sh = [&](const std::string& cmd) {
    const std::string full =
        "cd '" + dir + "' && " + cmd + " >>openssl.log 2>&1";
    // Called before any test thread exists.
    // NOLINTNEXTLINE(concurrency-mt-unsafe)
    if (c.error.empty() && std::system(full.c_str()) != 0) {
      c.error = "failed: " + cmd + "\n" + ReadFile(dir + "/openssl.log");
    }
  };
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
  std::ofstream(dir + "/server.ext")
      << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
  for (const char* ca : {"ca", "rogue-ca"}) {
    sh(std::string("openssl req -x509 ") + key + " -nodes -keyout " + ca +
       ".key -out " + ca + ".pem -days 2 -subj /CN=tmem-test-" + ca);
  }
  auto leaf = [&](const std::string& name, const std::string& cn,
                  const std::string& ca, const std::string& ext) {
    sh("openssl req " + key + " -nodes -keyout " + name + ".key -out " + name +
       ".csr -subj /CN=" + cn);
    sh("openssl x509 -req -in " + name + ".csr -CA " + ca + ".pem -CAkey " +
       ca + ".key -CAcreateserial -out " + name + ".pem -days 2" +
       (ext.empty() ? "" : " -extfile " + ext));
  };
  leaf("server", "localhost", "ca", "server.ext");
  leaf("admin", "ops-admin", "ca", "");
  leaf("monitor", "monitor", "ca", "");
  leaf("rogue", "ops-admin", "rogue-ca", "");
  c.ca = dir + "/ca.pem";
  c.server_cert = dir + "/server.pem";
  c.server_key = dir + "/server.key";
  c.admin_cert = dir + "/admin.pem";
  c.admin_key = dir + "/admin.key";
  c.monitor_cert = dir + "/monitor.pem";
  c.monitor_key = dir + "/monitor.key";
  c.rogue_cert = dir + "/rogue.pem";
  c.rogue_key = dir + "/rogue.key";
  return c;
}

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_CONTROL_TEST_UTIL_H_
