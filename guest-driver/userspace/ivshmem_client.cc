#include "guest-driver/userspace/ivshmem_client.h"

#include <endian.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kShmMessage = -1;
// Room for a few fds, so a message carrying more than one is seen (and
// refused) rather than silently truncated by the kernel.
constexpr size_t kMaxFdsPerRecv = 8;

struct Message {
  int64_t value = 0;
  UniqueFd fd;  // invalid when the message carried none
};

// Receives into buf[got, want) and collects any SCM_RIGHTS fds into `fds`.
// Returns bytes received (0 at EOF) or -errno. Every fd the kernel hands us
// is owned by `fds` at once, so none leaks whatever happens next.
ssize_t RecvWithFds(int sock, uint8_t* buf, size_t len, int flags,
                    std::vector<UniqueFd>* fds, bool* truncated) {
  iovec iov{buf, len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRecv)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->emplace_back(fd);
    }
  }
  *truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  return n;
}

absl::Status CheckFds(std::vector<UniqueFd>* fds, bool truncated,
                      const std::string& what) {
  if (truncated) {
    return absl::DataLossError(
        absl::StrCat(what,
                     " carried more file descriptors than any message may (the "
                     "kernel truncated them)"));
  }
  if (fds->size() > 1) {
    return absl::DataLossError(absl::StrCat(what, " carried ", fds->size(),
                                            " file descriptors; a message "
                                            "carries at most one"));
  }
  return absl::OkStatus();
}

// Reads one whole 8-byte message before `deadline`. The stream may split it
// anywhere; its fd arrives with its first byte. Reads never go past the
// message, so a later message's fd is never taken with this one.
absl::StatusOr<Message> ReadMessage(int sock, Clock::time_point deadline,
                                    const std::string& what) {
  uint8_t buf[8];
  size_t got = 0;
  std::vector<UniqueFd> fds;
  while (got < sizeof(buf)) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd pfd{sock, POLLIN, 0};
    const int ready =
        left.count() <= 0 ? 0 : poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, "poll on the ivshmem socket failed");
    }
    if (ready == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "timed out waiting for ", what,
          got == 0 ? "" : absl::StrCat(" (", got, " of 8 bytes received)"),
          ": the server stalled mid-handshake"));
    }
    bool truncated = false;
    const ssize_t n =
        RecvWithFds(sock, buf + got, sizeof(buf) - got, 0, &fds, &truncated);
    if (n < 0) {
      if (n == -EAGAIN || n == -EWOULDBLOCK) continue;
      return absl::ErrnoToStatus(static_cast<int>(-n),
                                 absl::StrCat("reading ", what, " failed"));
    }
    if (absl::Status s = CheckFds(&fds, truncated, what); !s.ok()) return s;
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat(
          "the server closed the connection before ", what,
          got == 0 ? "" : absl::StrCat(" was complete (", got, " of 8 bytes)"),
          ": truncated handshake"));
    }
    got += static_cast<size_t>(n);
  }
  uint64_t wire;
  std::memcpy(&wire, buf, sizeof(wire));
  Message m;
  m.value = static_cast<int64_t>(le64toh(wire));
  if (!fds.empty()) m.fd = std::move(fds.front());
  return m;
}

absl::StatusOr<UniqueFd> ConnectSocket(const std::string& path,
                                       Clock::time_point deadline) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path) ||
      path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ivshmem socket path \"", path, "\" must be 1 to ",
        sizeof(addr.sun_path) - 1, " bytes without NUL (UNIX socket limit)"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) {
    return absl::ErrnoToStatus(errno, "socket(AF_UNIX, SOCK_STREAM) failed");
  }
  // A UNIX connect completes at once or fails with EAGAIN when the
  // listener's backlog is full; retry that until the deadline.
  for (;;) {
    if (connect(sock.get(), reinterpret_cast<const sockaddr*>(&addr),
                sizeof(addr)) == 0) {
      return sock;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN && Clock::now() < deadline) {
      usleep(1000);
      continue;
    }
    return absl::ErrnoToStatus(
        errno, absl::StrCat("cannot connect to ivshmem socket ", path,
                            errno == ENOENT || errno == ECONNREFUSED
                                ? " (is tmemd running and serving this VM?)"
                                : ""));
  }
}

void WriteEventfd(int fd) {
  const uint64_t one = 1;
  ssize_t n;
  do {
    n = write(fd, &one, sizeof(one));
  } while (n < 0 && errno == EINTR);
  // EAGAIN means the counter is saturated: a wakeup is already pending.
}

}  // namespace

// The handshake state machine (friend of IvshmemClient), kept apart from
// the socket reads so each step's check sits next to its message.
class IvshmemHandshake {
 public:
  IvshmemHandshake(IvshmemClient* client, int vectors)
      : c_(client), vectors_(vectors) {}

  absl::Status Run(Clock::time_point deadline) {
    const int sock = c_->socket_.get();

    absl::StatusOr<Message> m =
        ReadMessage(sock, deadline, "the protocol version message");
    if (!m.ok()) return m.status();
    if (m->fd.valid()) {
      return absl::DataLossError(
          "the protocol version message carries a file descriptor; it never "
          "does (not an ivshmem server?)");
    }
    if (m->value != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("the server speaks ivshmem protocol version ", m->value,
                       "; only version 0 (QEMU 7.2) is supported"));
    }

    m = ReadMessage(sock, deadline, "the peer id message");
    if (!m.ok()) return m.status();
    if (m->fd.valid() || m->value < 0 || m->value > IvshmemClient::kMaxPeerId) {
      return absl::DataLossError(absl::StrCat(
          "invalid peer id message (value ", m->value,
          m->fd.valid() ? ", with a file descriptor" : "",
          "): expected our peer id in [0, ", IvshmemClient::kMaxPeerId,
          "] without a file descriptor"));
    }
    c_->own_id_ = m->value;
    c_->host_peer_id_ = m->value == 0 ? 1 : 0;

    m = ReadMessage(sock, deadline, "the shared-memory message");
    if (!m.ok()) return m.status();
    if (m->value != kShmMessage) {
      return absl::DataLossError(absl::StrCat(
          "expected the shared-memory message (-1 with an fd) third, got ",
          m->value, m->fd.valid() ? " with an fd" : " without an fd"));
    }
    if (!m->fd.valid()) {
      return absl::DataLossError(
          "the shared-memory message (-1) carries no file descriptor");
    }
    if (absl::Status s = MapShm(std::move(m->fd)); !s.ok()) return s;

    // Peers' eventfds, then our own. `current` is the peer whose run of
    // messages we are in; a peer seen again after its run ended is out of
    // order (the server sends each peer's vectors together).
    int64_t current = -1;
    for (int index = 4;; ++index) {
      m = ReadMessage(
          sock, deadline,
          absl::StrCat("handshake message #", index, " (a peer's eventfd)"));
      if (!m.ok()) return m.status();
      const int64_t id = m->value;
      if (id < 0 || id > IvshmemClient::kMaxPeerId) {
        return absl::DataLossError(
            absl::StrCat("handshake message #", index, " has value ", id,
                         "; expected a peer id in [0, ",
                         IvshmemClient::kMaxPeerId, "] with an eventfd"));
      }
      if (!m->fd.valid()) {
        return absl::DataLossError(absl::StrCat(
            "handshake message #", index, " for peer ", id,
            " carries no eventfd (a peer disconnect during the handshake?)"));
      }
      if (id == c_->own_id_) {
        if (current != c_->own_id_) {
          if (absl::Status s = CheckHostPeer(); !s.ok()) return s;
          current = id;
        }
        c_->own_eventfds_.push_back(std::move(m->fd));
        if (static_cast<int>(c_->own_eventfds_.size()) == vectors_) {
          return absl::OkStatus();
        }
        continue;
      }
      if (current == c_->own_id_) {
        return absl::DataLossError(absl::StrCat(
            "handshake message #", index, " is for peer ", id,
            " after our own eventfds began; the server must send other "
            "peers first"));
      }
      std::vector<UniqueFd>& fds = c_->peers_[id];
      if (id != current && !fds.empty()) {
        return absl::DataLossError(
            absl::StrCat("handshake message #", index, ": peer ", id,
                         "'s eventfds are not contiguous"));
      }
      current = id;
      if (static_cast<int>(fds.size()) == vectors_) {
        return absl::DataLossError(absl::StrCat(
            "peer ", id, " sent more eventfds than the device has vectors (",
            vectors_, "); QEMU refuses that too"));
      }
      fds.push_back(std::move(m->fd));
    }
  }

 private:
  absl::Status MapShm(UniqueFd fd) {
    struct stat st {};
    if (fstat(fd.get(), &st) != 0) {
      return absl::ErrnoToStatus(errno, "fstat of the shared-memory fd failed");
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (st.st_size <= 0 || !std::has_single_bit(size)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the shared memory is ", st.st_size,
          " bytes; it must be a non-zero power of two (QEMU asserts that for "
          "BAR2)"));
    }
    void* base =
        mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (base == MAP_FAILED) {
      return absl::ErrnoToStatus(
          errno,
          absl::StrCat("mmap of the ", size, "-byte shared memory failed"));
    }
    c_->base_ = static_cast<uint8_t*>(base);
    c_->size_ = size;
    c_->shm_fd_ = std::move(fd);
    return absl::OkStatus();
  }

  // Before our own eventfds: tmemd (peer 0) must have one eventfd per vector,
  // or some doorbells would go nowhere (QEMU drops them silently).
  absl::Status CheckHostPeer() const {
    auto it = c_->peers_.find(c_->host_peer_id_);
    const int have =
        it == c_->peers_.end() ? 0 : static_cast<int>(it->second.size());
    if (have != vectors_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "peer ", c_->host_peer_id_, " (tmemd) sent ", have, " eventfds for ",
          vectors_,
          " vectors before our own; doorbells need all of them (does the "
          "server's vector count match?)"));
    }
    return absl::OkStatus();
  }

  IvshmemClient* c_;
  int vectors_;
};

absl::StatusOr<std::unique_ptr<IvshmemClient>> IvshmemClient::Connect(
    const std::string& socket_path, const IvshmemClientOptions& options) {
  if (options.vectors < 1 || options.vectors > kMaxVectors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vectors = ", options.vectors, " must be in [1, ", kMaxVectors, "]"));
  }
  const Clock::time_point deadline = Clock::now() + options.timeout;
  absl::StatusOr<UniqueFd> sock = ConnectSocket(socket_path, deadline);
  if (!sock.ok()) return sock.status();
  std::unique_ptr<IvshmemClient> c(new IvshmemClient());
  c->socket_ = std::move(*sock);
  c->vectors_ = options.vectors;
  if (absl::Status s = IvshmemHandshake(c.get(), options.vectors).Run(deadline);
      !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("ivshmem handshake on ", socket_path,
                                     " failed: ", s.message()));
  }
  return c;
}

IvshmemClient::~IvshmemClient() {
  if (base_ != nullptr) munmap(base_, size_);
}

void IvshmemClient::Doorbell(int vector) {
  DoorbellPeer(static_cast<uint32_t>(host_peer_id_), vector);
}

void IvshmemClient::DoorbellPeer(uint32_t peer, int vector) {
  // QEMU uses only the low 8 bits of the doorbell value as the vector, and
  // drops a doorbell to a peer it does not know.
  auto it = peers_.find(static_cast<int64_t>(peer));
  if (it == peers_.end() || vector < 0) return;
  const auto v = static_cast<size_t>(vector & 0xff);
  if (v >= it->second.size()) return;
  WriteEventfd(it->second[v].get());
}

int IvshmemClient::interrupt_fd(int vector) const {
  if (vector < 0 || vector >= static_cast<int>(own_eventfds_.size())) {
    return -1;
  }
  return own_eventfds_[vector].get();
}

std::vector<int64_t> IvshmemClient::peer_ids() const {
  std::vector<int64_t> ids;
  for (const auto& [id, fds] : peers_) {
    if (!fds.empty()) ids.push_back(id);
  }
  return ids;
}

int IvshmemClient::peer_eventfd_count(int64_t peer) const {
  auto it = peers_.find(peer);
  return it == peers_.end() ? 0 : static_cast<int>(it->second.size());
}

absl::Status IvshmemClient::PollServer() {
  for (;;) {
    std::vector<UniqueFd> fds;
    bool truncated = false;
    const ssize_t n = RecvWithFds(socket_.get(), partial_ + partial_len_,
                                  sizeof(partial_) - partial_len_, MSG_DONTWAIT,
                                  &fds, &truncated);
    if (n == -EAGAIN || n == -EWOULDBLOCK) return absl::OkStatus();
    if (n < 0) {
      return absl::ErrnoToStatus(static_cast<int>(-n),
                                 "reading the ivshmem socket failed");
    }
    if (absl::Status s = CheckFds(&fds, truncated, "a server message");
        !s.ok()) {
      return s;
    }
    if (n == 0) {
      return absl::UnavailableError(
          "the ivshmem server closed the connection (tmemd went away)");
    }
    if (!fds.empty()) {
      if (partial_fd_.valid()) {
        return absl::DataLossError("a server message carries two fds");
      }
      partial_fd_ = std::move(fds.front());
    }
    partial_len_ += static_cast<size_t>(n);
    if (partial_len_ < sizeof(partial_)) continue;

    uint64_t wire;
    std::memcpy(&wire, partial_, sizeof(wire));
    const auto id = static_cast<int64_t>(le64toh(wire));
    partial_len_ = 0;
    UniqueFd fd = std::move(partial_fd_);
    if (id < 0 || id > kMaxPeerId || id == own_id_) {
      return absl::DataLossError(absl::StrCat(
          "the server sent an unexpected message (value ", id, ")"));
    }
    if (fd.valid()) {
      // A peer (re)connected: one more of its eventfds, up to `vectors`.
      std::vector<UniqueFd>& peer = peers_[id];
      if (static_cast<int>(peer.size()) >= vectors_) {
        return absl::DataLossError(absl::StrCat(
            "peer ", id, " sent more eventfds than there are vectors"));
      }
      peer.push_back(std::move(fd));
    } else {
      // A peer left: its eventfds are gone with it; doorbells to it drop.
      peers_.erase(id);
    }
  }
}

}  // namespace tmem
