// FakeSystemd: plays systemd's part for a daemon under test, on a machine
// where systemd is not PID 1 (containers, CI runners). It is what systemd does
// for a Type=notify service with FileDescriptorStoreMax= set:
//  * $NOTIFY_SOCKET: a datagram socket receiving "READY=1", "STOPPING=1",
//    "FDSTORE=1\nFDNAME=x" with descriptors (SCM_RIGHTS) and
//    "FDSTOREREMOVE=1\nFDNAME=x";
//  * on (re)start, the stored descriptors as fds 3.., with LISTEN_FDS,
//    LISTEN_FDNAMES and LISTEN_PID set for the child.
// Not thread-safe: the test thread calls Pump() while it waits.
#ifndef TMEMD_TESTS_INTEGRATION_FAKE_SYSTEMD_H_
#define TMEMD_TESTS_INTEGRATION_FAKE_SYSTEMD_H_

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tests/process.h"

extern char** environ;

namespace tmem::testing {

class FakeSystemd {
 public:
  explicit FakeSystemd(std::string socket_path)
      : path_(std::move(socket_path)) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd_);
      fd_ = -1;
    }
    // Room for a burst of FDSTORE messages while nobody pumps.
    int buf = 4 << 20;
    setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  }
  ~FakeSystemd() {
    for (auto& [name, fd] : store_) close(fd);
    if (fd_ >= 0) close(fd_);
  }
  FakeSystemd(const FakeSystemd&) = delete;
  FakeSystemd& operator=(const FakeSystemd&) = delete;

  bool ok() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

  // Reads every pending notification and applies it.
  void Pump() {
    for (;;) {
      char data[4096];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 64)];
      iovec iov{data, sizeof(data) - 1};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      const ssize_t n = recvmsg(fd_, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) return;
      std::vector<int> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
           c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.push_back(fd);
        }
      }
      Apply(std::string(data, static_cast<size_t>(n)), fds);
    }
  }

  std::map<std::string, int> stored() {
    Pump();
    return store_;
  }
  bool Has(const std::string& name) {
    Pump();
    return store_.contains(name);
  }
  int ready_count() {
    Pump();
    return ready_;
  }
  int rejected_messages() const { return rejected_; }
  // Every message received, in order, as its text.
  std::vector<std::string> messages() {
    Pump();
    return messages_;
  }

  // Starts `argv` as systemd would start the service: NOTIFY_SOCKET set,
  // and (when `pass_store`) the stored descriptors as fds 3.. with
  // LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID. Output goes to `log_path`.
  std::unique_ptr<Process> Start(const std::vector<std::string>& argv,
                                 const std::string& log_path, bool pass_store) {
    Pump();
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string v = *e;
      if (v.rfind("NOTIFY_SOCKET=", 0) == 0 || v.rfind("LISTEN_", 0) == 0) {
        continue;
      }
      env.push_back(v);
    }
    env.push_back("NOTIFY_SOCKET=" + path_);
    std::vector<int> fds;
    if (pass_store && !store_.empty()) {
      std::string names;
      for (const auto& [name, fd] : store_) {
        names += (names.empty() ? "" : ":") + name;
        fds.push_back(fd);
      }
      env.push_back("LISTEN_FDS=" + std::to_string(fds.size()));
      env.push_back("LISTEN_FDNAMES=" + names);
      // Filled in by the child: only it knows its pid before exec.
      env.emplace_back("LISTEN_PID=0000000000");
    }
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& v : env) envp.push_back(v.data());
    envp.push_back(nullptr);
    char* listen_pid = fds.empty() ? nullptr : env.back().data() + 11;
    const int log_fd =
        open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const pid_t pid = fork();
    if (pid == 0) {
      // Only async-signal-safe calls from here to exec.
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
      // Out of the way of 3..N first, then into place (dup2 clears
      // close-on-exec on the copy).
      std::vector<int>& src = fds;
      for (int& fd : src) fd = fcntl(fd, F_DUPFD_CLOEXEC, 1000);
      for (size_t i = 0; i < src.size(); ++i) {
        dup2(src[i], 3 + static_cast<int>(i));
      }
      if (listen_pid != nullptr) {
        // Decimal without leading zeros (systemd would read those as
        // octal).
        char digits[16];
        int n = 0;
        for (pid_t me = getpid(); me > 0; me /= 10) {
          digits[n++] = static_cast<char>('0' + me % 10);
        }
        for (int i = 0; i < n; ++i) listen_pid[i] = digits[n - 1 - i];
        listen_pid[n] = '\0';
      }
      execve(args[0], args.data(), envp.data());
      _exit(127);
    }
    close(log_fd);
    return std::make_unique<Process>(pid, log_path);
  }

 private:
  void Apply(const std::string& text, const std::vector<int>& fds) {
    messages_.push_back(text);
    std::map<std::string, std::string> kv;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      const size_t eq = line.find('=');
      if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    }
    if (kv["READY"] == "1") ++ready_;
    if (kv["FDSTORE"] == "1" && fds.size() == 1 && !kv["FDNAME"].empty()) {
      // systemd replaces nothing: a second fd under one name is stored
      // too. Keep the newest, which is what a restarted daemon wants.
      auto it = store_.find(kv["FDNAME"]);
      if (it != store_.end()) close(it->second);
      store_[kv["FDNAME"]] = fds[0];
      return;
    }
    if (kv["FDSTOREREMOVE"] == "1") {
      auto it = store_.find(kv["FDNAME"]);
      if (it != store_.end()) {
        close(it->second);
        store_.erase(it);
      }
    }
    if (!fds.empty()) ++rejected_;
    for (int fd : fds) close(fd);
  }

  std::string path_;
  int fd_ = -1;
  std::map<std::string, int> store_;
  int ready_ = 0;
  int rejected_ = 0;
  std::vector<std::string> messages_;
};

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_INTEGRATION_FAKE_SYSTEMD_H_
