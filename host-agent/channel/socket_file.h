// SocketFile: creating UNIX socket files safely in a directory tmemd owns.
//
// Contract:
//  * CheckSocketDirectory refuses a directory another user could change: one
//    that is a symlink, is not a directory, is owned by someone other than
//    root or tmemd's effective user, or is writable by its group or by
//    others. In such a directory a local user could swap a socket for a
//    symlink between tmemd's bind() and chmod() and turn a file of tmemd's
//    choosing world-writable.
//  * PrivateSocketDir gives a bind() a private place: a fresh 0700 directory
//    beside the final path. The socket is bound there (by tmemd or by a
//    library such as gRPC), its mode and owner set there where nobody else
//    can reach it, and only then renamed onto the final path, without
//    replacing anything (RENAME_NOREPLACE). No step follows a link planted at
//    the final path, and the socket never exists at the final path with a
//    mode other than the intended one.
//  * ClearStaleSocket makes the final path free: nothing there, or a socket
//    nobody listens on (left by a crash), which is removed. A live socket or
//    any other kind of file (a symlink included) is never removed.
//  * SocketPathInDirectory: a path named from outside (libvirt domain XML)
//    must be `dir`/NAME with NAME a plain file name, else refused with the
//    reason.
// Thread-compatible: each object is used by one thread.
#ifndef TMEMD_HOST_AGENT_CHANNEL_SOCKET_FILE_H_
#define TMEMD_HOST_AGENT_CHANNEL_SOCKET_FILE_H_

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tmem {

absl::Status CheckSocketDirectory(const std::string& dir);

absl::Status ClearStaleSocket(const std::string& path);

absl::Status SocketPathInDirectory(const std::string& path,
                                   const std::string& dir);

struct SocketFileMode {
  mode_t mode = 0600;
  std::optional<uid_t> owner;
  std::optional<gid_t> group;
};

class PrivateSocketDir {
 public:
  // Checks final_path's directory (CheckSocketDirectory) and clears a stale
  // socket there, then makes the private directory.
  static absl::StatusOr<PrivateSocketDir> Create(const std::string& final_path);
  PrivateSocketDir(PrivateSocketDir&& other) noexcept;
  PrivateSocketDir& operator=(PrivateSocketDir&&) = delete;
  PrivateSocketDir(const PrivateSocketDir&) = delete;
  PrivateSocketDir& operator=(const PrivateSocketDir&) = delete;
  // Removes the private directory and anything left in it.
  ~PrivateSocketDir();

  // Where to bind: inside the private directory.
  const std::string& bind_path() const { return bind_path_; }
  // Sets the socket's mode and owner, then renames it onto the final path.
  absl::Status Publish(const SocketFileMode& mode);

 private:
  PrivateSocketDir(std::string dir, std::string bind_path,
                   std::string final_path);
  std::string dir_;
  std::string bind_path_;
  std::string final_path_;
};

// Binds `fd` (an AF_UNIX stream socket) at `path` through a
// PrivateSocketDir and listens on it (`backlog`) before the rename: the path
// never exists without a listener behind it (QEMU refuses to start a VM
// whose socket refuses the connection, and never retries).
absl::Status BindUnixSocket(int fd, const std::string& path,
                            const SocketFileMode& mode, int backlog = 64);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_SOCKET_FILE_H_
