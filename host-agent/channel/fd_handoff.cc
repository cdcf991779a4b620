#include "host-agent/channel/fd_handoff.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "host-agent/log.h"

// getenv/setenv/unsetenv/strerror below run at startup or right before
// exec, while tmemd has one thread.
// NOLINTBEGIN(concurrency-mt-unsafe)
namespace tmem {
namespace {

constexpr char kHandoffEnv[] = "TMEMD_HANDOFF_FDS";

bool SetCloexec(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFD);
  if (flags < 0) return false;
  return fcntl(fd, F_SETFD,
               on ? (flags | FD_CLOEXEC) : (flags & ~FD_CLOEXEC)) == 0;
}

// One VM's descriptors while they are being collected.
struct Pending {
  int shm = -1;
  int listen = -1;
  int client = -1;
  int attaching = -1;
  std::map<int, int> doorbells;   // vector -> fd
  std::map<int, int> interrupts;  // vector -> fd
  std::vector<int> all;
};

// "db3" -> 3 with prefix "db"; -1 if it is not that shape.
int VectorOf(absl::string_view kind, absl::string_view prefix) {
  if (kind.substr(0, prefix.size()) != prefix) return -1;
  int v = -1;
  if (!absl::SimpleAtoi(kind.substr(prefix.size()), &v) || v < 0 || v > 64) {
    return -1;
  }
  return v;
}

// Files one descriptor under its VM; false (the caller closes it) if the
// name is not one of ours or names a descriptor twice.
bool File(std::map<std::string, Pending>& vms, const std::string& name,
          int fd) {
  const size_t slash = name.find('/');
  if (slash == std::string::npos || slash == 0) return false;
  Pending& p = vms[name.substr(0, slash)];
  const absl::string_view kind = absl::string_view(name).substr(slash + 1);
  auto put = [&](int* slot) {
    if (*slot >= 0) return false;
    *slot = fd;
    return true;
  };
  bool ok = false;
  if (kind == "shm") {
    ok = put(&p.shm);
  } else if (kind == "listen") {
    ok = put(&p.listen);
  } else if (kind == "client") {
    ok = put(&p.client);
  } else if (kind == "attaching") {
    ok = put(&p.attaching);
  } else if (int v = VectorOf(kind, "db"); v >= 0) {
    ok = p.doorbells.emplace(v, fd).second;
  } else if (int v = VectorOf(kind, "irq"); v >= 0) {
    ok = p.interrupts.emplace(v, fd).second;
  }
  if (ok) p.all.push_back(fd);
  return ok;
}

}  // namespace

std::string ChannelFdName(std::string_view vm, std::string_view kind) {
  return std::string(vm) + "/" + std::string(kind);
}

std::unique_ptr<SystemdFdStore> SystemdFdStore::FromEnvironment() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  if (socket == nullptr || *socket == '\0') return nullptr;
  return std::unique_ptr<SystemdFdStore>(new SystemdFdStore());
}

bool SystemdFdStore::Store(const std::string& name, int fd) {
  const std::string msg = absl::StrCat("FDSTORE=1\nFDNAME=", name);
  // The datagram is in systemd's queue when this returns: from then on a
  // crash of ours cannot lose the descriptor.
  const int r = sd_pid_notify_with_fds(0, 0, msg.c_str(), &fd, 1);
  if (r > 0) {
    stored_.fetch_add(1);
    return true;
  }
  failures_.fetch_add(1);
  Log(LogLevel::kWarn, "fd_store_failed",
      {{"name", name},
       {"error", r < 0 ? std::string(std::strerror(-r))
                       : std::string("NOTIFY_SOCKET not set")}});
  return false;
}

void SystemdFdStore::Remove(const std::string& name) {
  const std::string msg = absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name);
  if (sd_pid_notify(0, 0, msg.c_str()) <= 0) failures_.fetch_add(1);
}

InheritedChannels TakeInheritedChannels() {
  InheritedChannels out;
  std::vector<NamedFd> fds;
  if (const char* list = std::getenv(kHandoffEnv); list != nullptr) {
    out.source = "exec";
    for (absl::string_view entry :
         absl::StrSplit(list, ';', absl::SkipEmpty())) {
      const size_t eq = entry.rfind('=');
      int fd = -1;
      if (eq == absl::string_view::npos ||
          !absl::SimpleAtoi(entry.substr(eq + 1), &fd) || fd <= STDERR_FILENO ||
          fcntl(fd, F_GETFD) < 0) {
        ++out.rejected;
        out.errors.push_back(absl::StrCat(kHandoffEnv, " entry '", entry,
                                          "' is not NAME=FD of an open fd"));
        continue;
      }
      SetCloexec(fd, true);  // not to be leaked into anything we spawn
      fds.push_back({std::string(entry.substr(0, eq)), fd});
    }
    unsetenv(kHandoffEnv);
  } else {
    char** names = nullptr;
    const int n = sd_listen_fds_with_names(/*unset_environment=*/1, &names);
    if (n < 0) {
      out.errors.push_back(absl::StrCat("LISTEN_FDS: ", std::strerror(-n)));
    }
    if (n > 0) out.source = "systemd";
    for (int i = 0; i < n; ++i) {
      const int fd = SD_LISTEN_FDS_START + i;
      SetCloexec(fd, true);
      fds.push_back(
          {names != nullptr && names[i] != nullptr ? names[i] : "", fd});
    }
    if (names != nullptr) {
      for (int i = 0; i < n; ++i) free(names[i]);
      free(names);
    }
  }

  std::map<std::string, Pending> pending;
  for (const NamedFd& f : fds) {
    if (!File(pending, f.name, f.fd)) {
      ++out.rejected;
      out.errors.push_back(absl::StrCat("descriptor '", f.name, "' (fd ", f.fd,
                                        ") is not a channel part or a "
                                        "duplicate; closed"));
      close(f.fd);
    }
  }
  for (auto& [vm, p] : pending) {
    // Vectors must run 0..n-1 on both sides, as the server created them.
    bool complete = p.shm >= 0 && p.listen >= 0 && !p.doorbells.empty() &&
                    p.doorbells.size() == p.interrupts.size();
    int expect = 0;
    for (const auto& [v, fd] : p.doorbells) {
      if (v != expect++ || !p.interrupts.contains(v)) complete = false;
    }
    if (!complete) {
      out.rejected += p.all.size();
      out.errors.push_back(absl::StrCat(
          "VM '", vm, "': ", p.all.size(),
          " handed-over descriptors do not make a channel (need shm, listen "
          "and db0..N/irq0..N); closed"));
      for (int fd : p.all) close(fd);
      continue;
    }
    IvshmemServerFds c;
    c.shm = p.shm;
    c.listen = p.listen;
    c.client = p.client;
    c.attaching = p.attaching;
    for (const auto& [v, fd] : p.doorbells) c.doorbells.push_back(fd);
    for (const auto& [v, fd] : p.interrupts) c.interrupts.push_back(fd);
    out.vms.emplace(vm, std::move(c));
  }
  return out;
}

absl::Status ExecWithFds(const std::string& exe,
                         const std::vector<std::string>& argv,
                         const std::vector<NamedFd>& fds) {
  std::vector<std::string> entries;
  for (const NamedFd& f : fds) {
    if (!SetCloexec(f.fd, false)) {
      const int err = errno;
      for (const NamedFd& g : fds) SetCloexec(g.fd, true);
      return absl::ErrnoToStatus(
          err, absl::StrCat("descriptor ", f.name, " (fd ", f.fd,
                            ") cannot be handed over"));
    }
    entries.push_back(absl::StrCat(f.name, "=", f.fd));
  }
  setenv(kHandoffEnv, absl::StrJoin(entries, ";").c_str(), 1);
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(exe.c_str(), args.data());
  const int err = errno;
  unsetenv(kHandoffEnv);
  for (const NamedFd& f : fds) SetCloexec(f.fd, true);
  return absl::ErrnoToStatus(err, absl::StrCat("exec of ", exe, " failed"));
}

void NotifyReady(const std::string& status) {
  sd_notify(0, absl::StrCat("READY=1\nSTATUS=", status).c_str());
}
namespace {

// One datagram to $NOTIFY_SOCKET without blocking: STATUS= and WATCHDOG=1
// come from the main loop, which must keep taking signals even when the
// receiver is slow (sd_notify blocks on a full queue, and the kernel's
// default queue is 10 datagrams). A dropped one is resent next tick.
bool NotifyWithoutBlocking(const std::string& message) {
  const char* path = getenv("NOTIFY_SOCKET");
  if (path == nullptr || (path[0] != '/' && path[0] != '@')) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t len = strlen(path);
  if (len >= sizeof(addr.sun_path)) return false;
  memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  const ssize_t n =
      sendto(fd, message.data(), message.size(), MSG_DONTWAIT | MSG_NOSIGNAL,
             reinterpret_cast<const sockaddr*>(&addr),
             static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len));
  close(fd);
  return n == static_cast<ssize_t>(message.size());
}

}  // namespace

void NotifyStatus(const std::string& status) {
  NotifyWithoutBlocking(absl::StrCat("STATUS=", status));
}
// Advisory (systemd learns of the stop from the exit): a full queue must
// not hold up the shutdown.
void NotifyStopping() { NotifyWithoutBlocking("STOPPING=1"); }
void NotifyReloading() { sd_notify(0, "RELOADING=1"); }
void NotifyWatchdog(const std::string& status) {
  NotifyWithoutBlocking(absl::StrCat("WATCHDOG=1\nSTATUS=", status));
}
void NotifyStopProgress(const std::string& status,
                        std::chrono::microseconds extend) {
  NotifyWithoutBlocking(absl::StrCat(
      "WATCHDOG=1\nEXTEND_TIMEOUT_USEC=", extend.count(), "\nSTATUS=", status));
}
std::optional<std::chrono::microseconds> WatchdogInterval() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return std::nullopt;
  return std::chrono::microseconds(usec);
}

}  // namespace tmem
// NOLINTEND(concurrency-mt-unsafe)
