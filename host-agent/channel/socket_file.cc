#include "host-agent/channel/socket_file.h"

#include <fcntl.h>
#include <stdio.h>   // renameat2
#include <stdlib.h>  // mkdtemp
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string Octal(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// "a regular file", "a directory", ...: for messages about what is in the
// way.
const char* FileTypeName(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFLNK:
      return "a symbolic link";
    case S_IFIFO:
      return "a FIFO";
    case S_IFCHR:
    case S_IFBLK:
      return "a device node";
    default:
      return "not a socket";
  }
}

bool FitsSunPath(const std::string& path) {
  return !path.empty() && path.size() < sizeof(sockaddr_un{}.sun_path);
}

}  // namespace

absl::Status CheckSocketDirectory(const std::string& dir) {
  struct stat st {};
  if (lstat(dir.c_str(), &st) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("socket directory '", dir,
                            "' cannot be inspected (does it exist?)"));
  }
  if (S_ISLNK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory '", dir,
        "' is a symlink; refusing it: configure the real directory"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory '", dir, "' is not a directory"));
  }
  if (st.st_uid != 0 && st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory '", dir, "' is owned by uid ", st.st_uid,
        ", not by root or tmemd's user (uid ", geteuid(),
        "); its owner could replace tmemd's sockets: use a directory tmemd "
        "owns"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory '", dir, "' has mode ", Octal(st.st_mode),
        " and is writable by its group or by others, who could swap tmemd's "
        "sockets for symlinks; run 'chmod go-w ",
        dir, "' or use another directory"));
  }
  return absl::OkStatus();
}

absl::Status ClearStaleSocket(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::ErrnoToStatus(
        errno, absl::StrCat("cannot inspect socket path ", path,
                            " (is its directory searchable by tmemd?)"));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket path ", path, " exists and is ", FileTypeName(st.st_mode),
        ", not a socket; refusing to replace it: remove it or configure "
        "another path"));
  }
  const int probe =
      socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (probe < 0) {
    return absl::ErrnoToStatus(
        errno, "socket(AF_UNIX) for probing an existing socket failed");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (!FitsSunPath(path)) {
    close(probe);
    return absl::InvalidArgumentError(
        absl::StrCat("socket path ", path, " is too long for a UNIX socket"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int err = connect(probe, reinterpret_cast<const sockaddr*>(&addr),
                          sizeof(addr)) == 0
                      ? 0
                      : errno;
  close(probe);
  if (err == 0 || err == EAGAIN) {  // EAGAIN: its backlog is full: alive
    return absl::AlreadyExistsError(absl::StrCat(
        "socket path ", path,
        " is a live socket another process listens on (another tmemd?); "
        "stop it or configure another path"));
  }
  if (err != ECONNREFUSED) {
    return absl::ErrnoToStatus(
        err, absl::StrCat("cannot tell whether existing socket ", path,
                          " is stale (connect probe failed)"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("cannot remove stale socket ", path));
  }
  return absl::OkStatus();
}

absl::Status SocketPathInDirectory(const std::string& path,
                                   const std::string& dir) {
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  const std::string prefix = base == "/" ? "/" : base + "/";
  const bool inside = path.size() > prefix.size() &&
                      path.compare(0, prefix.size(), prefix) == 0;
  const std::string name = inside ? path.substr(prefix.size()) : "";
  if (!inside || name.find('/') != std::string::npos || name == "." ||
      name == ".." || name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path '", path,
        "' is not a file directly in tmemd's socket "
        "directory '",
        base,
        "'; tmemd creates, chmods and removes sockets only there: set the "
        "device's <server path> to '",
        prefix, "NAME.sock'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PrivateSocketDir> PrivateSocketDir::Create(
    const std::string& final_path) {
  if (!FitsSunPath(final_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path \"", final_path, "\" must be 1 to ",
        sizeof(sockaddr_un{}.sun_path) - 1,
        " bytes long (a UNIX socket address limit); use a shorter directory"));
  }
  const std::string dir = DirectoryOf(final_path);
  if (absl::Status s = CheckSocketDirectory(dir); !s.ok()) return s;
  if (absl::Status s = ClearStaleSocket(final_path); !s.ok()) return s;
  std::string tmpl = dir + "/.tmemd-XXXXXX";
  if (!FitsSunPath(tmpl + "/s")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket directory '", dir,
        "' is too long to bind sockets in privately (a UNIX socket address "
        "holds ",
        sizeof(sockaddr_un{}.sun_path) - 1, " bytes); use a shorter one"));
  }
  if (mkdtemp(tmpl.data()) == nullptr) {  // mode 0700
    return absl::ErrnoToStatus(
        errno, absl::StrCat("cannot create a private directory in ", dir,
                            " to bind ", final_path, " in"));
  }
  return PrivateSocketDir(tmpl, tmpl + "/s", final_path);
}

PrivateSocketDir::PrivateSocketDir(std::string dir, std::string bind_path,
                                   std::string final_path)
    : dir_(std::move(dir)),
      bind_path_(std::move(bind_path)),
      final_path_(std::move(final_path)) {}

PrivateSocketDir::PrivateSocketDir(PrivateSocketDir&& other) noexcept
    : dir_(std::exchange(other.dir_, std::string())),
      bind_path_(std::exchange(other.bind_path_, std::string())),
      final_path_(std::exchange(other.final_path_, std::string())) {}

PrivateSocketDir::~PrivateSocketDir() {
  if (dir_.empty()) return;
  unlink(bind_path_.c_str());  // still here if Publish did not run or failed
  rmdir(dir_.c_str());
}

absl::Status PrivateSocketDir::Publish(const SocketFileMode& mode) {
  // Only tmemd can reach into the 0700 directory, so these path-based calls
  // act on the socket tmemd bound and on nothing else.
  if (chmod(bind_path_.c_str(), mode.mode) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("chmod ", Octal(mode.mode), " of the socket for ",
                            final_path_, " failed"));
  }
  if (mode.owner.has_value() || mode.group.has_value()) {
    const uid_t owner = mode.owner.value_or(static_cast<uid_t>(-1));
    const gid_t group = mode.group.value_or(static_cast<gid_t>(-1));
    if (chown(bind_path_.c_str(), owner, group) != 0) {
      return absl::ErrnoToStatus(
          errno,
          absl::StrCat("chown of socket ", final_path_, " to uid ",
                       mode.owner.has_value() ? absl::StrCat(*mode.owner)
                                              : "(unchanged)",
                       " gid ",
                       mode.group.has_value() ? absl::StrCat(*mode.group)
                                              : "(unchanged)",
                       " failed (tmemd needs CAP_CHOWN, or must be in the "
                       "group, to hand the socket to QEMU's user)"));
    }
  }
  if (renameat2(AT_FDCWD, bind_path_.c_str(), AT_FDCWD, final_path_.c_str(),
                RENAME_NOREPLACE) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("cannot move the new socket onto ", final_path_,
                            errno == EEXIST
                                ? " (something was created there meanwhile; "
                                  "refusing to replace it)"
                                : ""));
  }
  return absl::OkStatus();
}

absl::Status BindUnixSocket(int fd, const std::string& path,
                            const SocketFileMode& mode, int backlog) {
  absl::StatusOr<PrivateSocketDir> priv = PrivateSocketDir::Create(path);
  if (!priv.ok()) return priv.status();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, priv->bind_path().c_str(),
              priv->bind_path().size() + 1);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("bind for socket ", path, " failed"));
  }
  if (listen(fd, backlog) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("listen on socket ", path, " failed"));
  }
  return priv->Publish(mode);
}

}  // namespace tmem
