#include "host-agent/channel/ivshmem_server.h"

#include <endian.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/socket_file.h"

namespace tmem {
namespace {

// Peer ids of the ivshmem protocol: tmemd is host_peer_id (a guest
// doorbell (host_peer_id << 16) | v lands on tmemd's eventfd v), the VM is
// the other of {0, 1}.
constexpr int64_t kProtocolVersion = 0;
constexpr int64_t kShmMessage = -1;
constexpr int kMaxVectors = 16;
// QEMU connects once per device; a longer queue would only hold
// connections that are refused anyway.
constexpr int kListenBacklog = 4;

// Owns one descriptor until release(); keeps Listen's error paths short.
class OwnedFd {
 public:
  explicit OwnedFd(int fd = -1) : fd_(fd) {}
  ~OwnedFd() {
    if (fd_ >= 0) close(fd_);
  }
  OwnedFd(OwnedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  OwnedFd& operator=(OwnedFd&&) = delete;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;

  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Removes the socket path on scope exit unless dismissed, so a Listen that
// fails after bind() leaves no file behind.
class UnlinkOnExit {
 public:
  explicit UnlinkOnExit(std::string path) : path_(std::move(path)) {}
  ~UnlinkOnExit() {
    if (!path_.empty()) unlink(path_.c_str());
  }
  UnlinkOnExit(const UnlinkOnExit&) = delete;
  UnlinkOnExit& operator=(const UnlinkOnExit&) = delete;
  void Dismiss() { path_.clear(); }

 private:
  std::string path_;
};

// One protocol message: `value` as a little-endian int64 and, when
// fd >= 0, that fd as SCM_RIGHTS.
struct WireMessage {
  uint64_t wire = 0;
  int fd = -1;
  iovec iov{};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
};

// Sends `values`/`fds` as one protocol message each, in a single
// sendmmsg: the kernel queues them without sleeping (MSG_DONTWAIT) and a
// signal cannot stop the call half-way, so a crash of tmemd leaves the
// client either nothing or the whole handshake. Never raises SIGPIPE
// (MSG_NOSIGNAL). Returns true only if every message went out whole.
bool SendMessages(int sock, const std::vector<std::pair<int64_t, int>>& msgs) {
  std::vector<WireMessage> wire(msgs.size());
  std::vector<mmsghdr> headers(msgs.size());
  for (size_t i = 0; i < msgs.size(); ++i) {
    WireMessage& w = wire[i];
    w.wire = htole64(static_cast<uint64_t>(msgs[i].first));
    w.iov = {&w.wire, sizeof(w.wire)};
    msghdr& msg = headers[i].msg_hdr;
    msg = {};
    msg.msg_iov = &w.iov;
    msg.msg_iovlen = 1;
    const int fd = msgs[i].second;
    if (fd >= 0) {
      msg.msg_control = w.control;
      msg.msg_controllen = sizeof(w.control);
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    }
  }
  int sent;
  do {
    sent = sendmmsg(sock, headers.data(), static_cast<unsigned>(headers.size()),
                    MSG_DONTWAIT | MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent != static_cast<int>(headers.size())) return false;
  // A short message would leave the client unable to parse what follows.
  for (const mmsghdr& h : headers) {
    if (h.msg_len != sizeof(uint64_t)) return false;
  }
  return true;
}

// Reads an eventfd back to zero (EFD_NONBLOCK: returns at once if it is).
void DrainEventfd(int fd) {
  uint64_t value = 0;
  while (read(fd, &value, sizeof(value)) < 0 && errno == EINTR) {
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<IvshmemServer>> IvshmemServer::Listen(
    const IvshmemServerOptions& options, int shm_fd, ChannelMetrics* metrics) {
  const std::string& path = options.socket_path;
  if (metrics == nullptr) {
    return absl::InvalidArgumentError("IvshmemServer needs a ChannelMetrics");
  }
  if (options.vectors < 1 || options.vectors > kMaxVectors) {
    return absl::InvalidArgumentError(
        absl::StrCat("ivshmem vectors = ", options.vectors, " must be in [1, ",
                     kMaxVectors, "] and match the device's vectors= option"));
  }
  if (options.host_peer_id != 0 && options.host_peer_id != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("host_peer_id = ", options.host_peer_id,
                     " must be 0 or 1 (the VM is the other peer)"));
  }
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ivshmem socket path \"", path, "\" must be 1 to ",
        sizeof(sockaddr_un{}.sun_path) - 1,
        " bytes long (a UNIX socket address limit); use a shorter directory"));
  }
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        "ivshmem socket path must not contain a NUL byte");
  }

  // Our own copy, so the caller's fd may close without breaking later
  // handshakes.
  OwnedFd shm(shm_fd < 0 ? -1 : fcntl(shm_fd, F_DUPFD_CLOEXEC, 0));
  if (shm.get() < 0) {
    return absl::ErrnoToStatus(
        shm_fd < 0 ? EBADF : errno,
        absl::StrCat("cannot duplicate shared memory fd ", shm_fd));
  }
  struct stat shm_stat {};
  if (fstat(shm.get(), &shm_stat) != 0) {
    return absl::ErrnoToStatus(errno, "fstat of the shared memory fd failed");
  }
  // QEMU sizes BAR2 from the fd and aborts the VM if that is not a power of
  // two: better to refuse here than to crash a guest at attach time.
  if (!S_ISREG(shm_stat.st_mode) || shm_stat.st_size <= 0 ||
      !std::has_single_bit(static_cast<uint64_t>(shm_stat.st_size))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory fd ", shm_fd, " must be a memfd or file whose size (",
        shm_stat.st_size, " bytes) is a power of two; use SharedRegion"));
  }

  // Created once: they outlive client reconnects, so the worker's epoll set
  // stays the same.
  std::vector<OwnedFd> doorbells;
  std::vector<OwnedFd> interrupts;
  for (int v = 0; v < options.vectors; ++v) {
    for (std::vector<OwnedFd>* fds : {&doorbells, &interrupts}) {
      const int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (efd < 0) {
        return absl::ErrnoToStatus(
            errno, absl::StrCat("eventfd for ivshmem vector ", v,
                                " failed (out of file descriptors?)"));
      }
      fds->emplace_back(efd);
    }
  }

  OwnedFd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) {
    return absl::ErrnoToStatus(errno, "socket(AF_UNIX, SOCK_STREAM) failed");
  }
  // Bound in a private directory, mode and owner set there, then renamed
  // into place: no step follows a link someone planted at `path`, and the
  // socket is never there with another mode (socket_file.h).
  if (absl::Status s = BindUnixSocket(
          sock.get(), path,
          {options.socket_mode, options.socket_owner, options.socket_group},
          kListenBacklog);
      !s.ok()) {
    return s;
  }
  UnlinkOnExit unlink_on_error(path);

  std::vector<int> doorbell_fds;
  std::vector<int> interrupt_fds;
  for (OwnedFd& fd : doorbells) doorbell_fds.push_back(fd.release());
  for (OwnedFd& fd : interrupts) interrupt_fds.push_back(fd.release());
  unlink_on_error.Dismiss();
  return std::unique_ptr<IvshmemServer>(new IvshmemServer(
      path, sock.release(), shm.release(), std::move(doorbell_fds),
      std::move(interrupt_fds), metrics, options.host_peer_id));
}

IvshmemServer::IvshmemServer(std::string socket_path, int listen_fd, int shm_fd,
                             std::vector<int> doorbell_fds,
                             std::vector<int> interrupt_fds,
                             ChannelMetrics* metrics, int host_peer_id)
    : socket_path_(std::move(socket_path)),
      listen_fd_(listen_fd),
      shm_fd_(shm_fd),
      doorbell_fds_(std::move(doorbell_fds)),
      interrupt_fds_(std::move(interrupt_fds)),
      metrics_(metrics),
      host_peer_id_(host_peer_id) {
  RefillReserve();
}

namespace {

// What an inherited descriptor must be; each check says what it found.
absl::Status CheckUnixStream(int fd, bool listening, const char* what) {
  int domain = 0;
  int type = 0;
  int accepting = 0;
  socklen_t len = sizeof(int);
  if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) {
    return absl::ErrnoToStatus(
        errno,
        absl::StrCat("handed-over ", what, " (fd ", fd, ") is not a socket"));
  }
  len = sizeof(int);
  getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len);
  len = sizeof(int);
  getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len);
  if (domain != AF_UNIX || type != SOCK_STREAM ||
      (accepting != 0) != listening) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handed-over ", what, " (fd ", fd, ") is a socket of domain ", domain,
        ", type ", type, ", listening ", accepting,
        "; expected a UNIX stream socket", listening ? " that listens" : ""));
  }
  return absl::OkStatus();
}

absl::Status CheckEventfd(int fd, const char* what, int vector) {
  char target[64] = {};
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
  if (n < 0 || std::string_view(target, n) != "anon_inode:[eventfd]") {
    return absl::InvalidArgumentError(absl::StrCat(
        "handed-over ", what, " eventfd for vector ", vector, " (fd ", fd,
        ") is ", n < 0 ? "not open" : std::string(target, n)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<IvshmemServer>> IvshmemServer::Adopt(
    const IvshmemServerOptions& options, const IvshmemServerFds& fds,
    ChannelMetrics* metrics) {
  // Own everything first, so every error path below closes it all.
  OwnedFd listen_fd(fds.listen);
  OwnedFd shm(fds.shm);
  // A connection stored before its handshake (`attaching`): with `client`
  // it is a second descriptor of the same connection, closed. Alone, the
  // handshake is one
  // sendmmsg (SendMessages): the guest got all of it or nothing. Bytes of
  // ours it has not read yet (SIOCOUTQ) prove it got all of it: it is the
  // client. Nothing queued means nothing was sent, or the guest read it
  // all in the instant before the crash; then a refusal (EOF) is the only
  // answer that cannot leave a guest waiting forever on a handshake.
  int client_fd = fds.client;
  int attaching_fd = fds.attaching;
  if (attaching_fd >= 0 && client_fd < 0) {
    int unread = 0;
    if (ioctl(attaching_fd, SIOCOUTQ, &unread) == 0 && unread > 0) {
      client_fd = std::exchange(attaching_fd, -1);
    } else if (metrics != nullptr) {
      metrics->Inc(ChannelCounter::kHandshakeFailures);
    }
  }
  OwnedFd client(client_fd);
  OwnedFd attaching(attaching_fd);
  std::vector<OwnedFd> doorbells;
  std::vector<OwnedFd> interrupts;
  for (int fd : fds.doorbells) doorbells.emplace_back(fd);
  for (int fd : fds.interrupts) interrupts.emplace_back(fd);
  if (metrics == nullptr) {
    return absl::InvalidArgumentError("IvshmemServer needs a ChannelMetrics");
  }
  if (options.host_peer_id != 0 && options.host_peer_id != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("host_peer_id = ", options.host_peer_id,
                     " must be 0 or 1 (the VM is the other peer)"));
  }
  // The VM's device has as many vectors as it had: QEMU got exactly these.
  const size_t vectors = doorbells.size();
  if (vectors < 1 || vectors > kMaxVectors || interrupts.size() != vectors) {
    return absl::InvalidArgumentError(
        absl::StrCat("handed-over channel has ", vectors, " doorbell and ",
                     interrupts.size(),
                     " interrupt eventfds; expected the same number, 1 "
                     "to ",
                     kMaxVectors));
  }
  if (listen_fd.get() < 0 || shm.get() < 0) {
    return absl::InvalidArgumentError(
        "handed-over channel lacks its listening socket or shared memory");
  }
  if (absl::Status s =
          CheckUnixStream(listen_fd.get(), true, "listening socket");
      !s.ok()) {
    return s;
  }
  for (size_t v = 0; v < vectors; ++v) {
    if (absl::Status s =
            CheckEventfd(doorbells[v].get(), "doorbell", static_cast<int>(v));
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            CheckEventfd(interrupts[v].get(), "interrupt", static_cast<int>(v));
        !s.ok()) {
      return s;
    }
  }
  struct stat shm_stat {};
  if (fstat(shm.get(), &shm_stat) != 0 || !S_ISREG(shm_stat.st_mode) ||
      shm_stat.st_size <= 0 ||
      !std::has_single_bit(static_cast<uint64_t>(shm_stat.st_size))) {
    return absl::InvalidArgumentError(
        absl::StrCat("handed-over shared memory (fd ", shm.get(),
                     ") is not a memfd of power-of-two size"));
  }
  sockaddr_un addr{};
  socklen_t addr_len = sizeof(addr);
  if (getsockname(listen_fd.get(), reinterpret_cast<sockaddr*>(&addr),
                  &addr_len) != 0 ||
      addr.sun_family != AF_UNIX || addr.sun_path[0] == '\0') {
    return absl::InvalidArgumentError(
        absl::StrCat("handed-over listening socket (fd ", listen_fd.get(),
                     ") is not bound to a path"));
  }
  // The path it serves is the configured one: the socket was bound in a
  // private directory and renamed into place, so its bound name
  // (getsockname) is that directory's, long gone.
  const std::string path =
      !options.socket_path.empty()
          ? options.socket_path
          : std::string(addr.sun_path,
                        strnlen(addr.sun_path, sizeof(addr.sun_path)));
  // The restarted tmemd polls these from its own epoll loop.
  for (int fd : {listen_fd.get(), client.get()}) {
    if (fd < 0) continue;
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  }
  bool client_alive = false;
  if (client.get() >= 0) {
    if (absl::Status s =
            CheckUnixStream(client.get(), false, "QEMU connection");
        !s.ok()) {
      return s;
    }
    // QEMU never writes to this socket, so only a hangup or an error
    // says it went away while no tmemd was watching.
    pollfd pfd{client.get(), POLLIN | POLLRDHUP, 0};
    const int ready = poll(&pfd, 1, 0);
    client_alive =
        ready == 0 ||
        (ready > 0 && (pfd.revents & (POLLHUP | POLLRDHUP | POLLERR)) == 0);
    if (!client_alive) metrics->Inc(ChannelCounter::kClientDisconnects);
  }
  std::vector<int> doorbell_fds;
  std::vector<int> interrupt_fds;
  for (OwnedFd& fd : doorbells) doorbell_fds.push_back(fd.release());
  for (OwnedFd& fd : interrupts) interrupt_fds.push_back(fd.release());
  std::unique_ptr<IvshmemServer> server(new IvshmemServer(
      path, listen_fd.release(), shm.release(), std::move(doorbell_fds),
      std::move(interrupt_fds), metrics, options.host_peer_id));
  for (int fd : server->doorbell_fds_) DrainEventfd(fd);
  if (client_alive) {
    server->client_fd_ = client.release();
    server->connected_.store(true, std::memory_order_relaxed);
  } else {
    // Interrupts nobody will consume; the next QEMU starts clean.
    for (int fd : server->interrupt_fds_) DrainEventfd(fd);
  }
  return server;
}

IvshmemServer::~IvshmemServer() {
  for (int fd : reserve_) close(fd);
  if (client_fd_ >= 0) close(client_fd_);
  close(listen_fd_);
  // Ours: Listen either created this path or removed a stale socket and
  // refused to take over a live one, so nobody else can own it now.
  if (!keep_path_) unlink(socket_path_.c_str());
  close(shm_fd_);
  for (int fd : doorbell_fds_) close(fd);
  for (int fd : interrupt_fds_) close(fd);
}

void IvshmemServer::RefillReserve() {
  while (reserve_.size() < kReserveFds) {
    const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;  // still short: the next accept refills it
    reserve_.push_back(fd);
  }
}

int IvshmemServer::AcceptOne() {
  bool used_reserve = false;
  for (;;) {
    const int fd =
        accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      if (used_reserve) {
        ++accepts_from_reserve_;
        metrics_->Inc(ChannelCounter::kAcceptsFromReserve);
      }
      return fd;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
    if (errno == ECONNABORTED || errno == EPROTO) {
      // The client left before we accepted it: a handshake that failed.
      metrics_->Inc(ChannelCounter::kHandshakeFailures);
      continue;
    }
    if ((errno == EMFILE || errno == ENFILE) && !reserve_.empty()) {
      // Out of descriptors with a guest queued: the reserve makes room for
      // it (and for storing it), so it is answered or refused, not left
      // waiting on a socket nobody can accept from.
      for (int r : reserve_) close(r);
      reserve_.clear();
      used_reserve = true;
      continue;
    }
    // EMFILE/ENFILE with no reserve left, ENOBUFS, ENOMEM: the connection
    // stays queued and the socket readable. Polling it again at once
    // would spin; the caller backs off and retries.
    metrics_->Inc(ChannelCounter::kHandshakeFailures);
    accept_blocked_ = true;
    ++accept_backoffs_;
    metrics_->Inc(ChannelCounter::kAcceptBackoffs);
    return -1;
  }
}

bool IvshmemServer::OnListenReadable() {
  bool attached = false;
  accept_blocked_ = false;
  RefillReserve();
  for (;;) {
    const int fd = AcceptOne();
    if (fd < 0) break;
    if (connected()) {
      // The attached client may have hung up without the worker having
      // seen it yet (epoll reports both fds in one round, in any order): a
      // restarted guest must not be refused because of its dead
      // predecessor, and the predecessor leaves the whole way (observer
      // told: pools, region, fd store) before the newcomer sees anything.
      pollfd pfd{client_fd_, POLLIN | POLLRDHUP, 0};
      if (poll(&pfd, 1, 0) > 0) OnClientEvent();
    }
    if (connected()) {
      // One VM, one device, one connection: anything else is a misconfigured
      // or hostile second client. Closing tells it so (EOF, no handshake).
      metrics_->Inc(ChannelCounter::kClientsRejectedBusy);
      close(fd);
      RefillReserve();
      continue;
    }
    // The owner keeps the connection for a successor before the guest can
    // use anything: a crash after the handshake must not lose a guest
    // that already maps its region.
    if (observer_ != nullptr && !observer_->BeforeHandshake(fd)) {
      metrics_->Inc(ChannelCounter::kHandshakeFailures);
      close(fd);
      RefillReserve();
      continue;
    }
    if (!SendHandshake(fd)) {
      // The client is gone (EPIPE/ECONNRESET) or its socket could not take a
      // few hundred bytes: never wait for it, QEMU reads the handshake
      // synchronously and a live one always has room.
      metrics_->Inc(ChannelCounter::kHandshakeFailures);
      if (observer_ != nullptr) observer_->HandshakeFailed(fd);
      close(fd);
      RefillReserve();
      continue;
    }
    client_fd_ = fd;
    connected_.store(true, std::memory_order_relaxed);
    metrics_->Inc(ChannelCounter::kClientsAccepted);
    if (observer_ != nullptr) observer_->AfterHandshake(fd);
    attached = true;
    RefillReserve();
  }
  return attached;
}

bool IvshmemServer::SendHandshake(int fd) {
  // The order QEMU 7.2's ivshmem_recv_setup expects: version, own id, shared
  // memory; then the eventfds of each other peer (tmemd) and finally
  // the client's own, one message per vector, vector order implied.
  const int64_t client_peer_id = 1 - host_peer_id_;
  std::vector<std::pair<int64_t, int>> msgs = {
      {kProtocolVersion, -1}, {client_peer_id, -1}, {kShmMessage, shm_fd_}};
  for (int efd : doorbell_fds_) msgs.emplace_back(host_peer_id_, efd);
  for (int efd : interrupt_fds_) msgs.emplace_back(client_peer_id, efd);
  return SendMessages(fd, msgs);
}

bool IvshmemServer::OnClientEvent() {
  if (!connected()) return false;
  char buf[64];
  for (;;) {
    // Any fds a hostile client attaches are discarded by the kernel: no
    // control buffer is offered.
    const ssize_t n = recv(client_fd_, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      // QEMU never writes to the server socket after connecting.
      metrics_->Inc(ChannelCounter::kClientGarbage);
      DropClient(IvshmemClientObserver::LeaveReason::kGarbage);
      return true;
    }
    if (n == 0) {
      metrics_->Inc(ChannelCounter::kClientDisconnects);
      DropClient(IvshmemClientObserver::LeaveReason::kHangup);
      return true;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return false;  // spurious
    // ECONNRESET and the like: the client is gone as surely as with EOF.
    metrics_->Inc(ChannelCounter::kClientDisconnects);
    DropClient(IvshmemClientObserver::LeaveReason::kHangup);
    return true;
  }
}

void IvshmemServer::DropClient(IvshmemClientObserver::LeaveReason reason) {
  if (client_fd_ < 0) return;
  if (observer_ != nullptr) observer_->ClientLeaving(client_fd_, reason);
  close(client_fd_);
  client_fd_ = -1;
  connected_.store(false, std::memory_order_relaxed);
  // An interrupt nobody consumed would fire as soon as the next client
  // enables MSI-X. Harmless (the ring is the truth), but pointless.
  for (int fd : interrupt_fds_) DrainEventfd(fd);
}

void IvshmemServer::NotifyGuest(int v) {
  // No client: nobody would read the interrupt, and the next client must
  // not start with a stale one. A bad vector is a caller bug; ignoring it is
  // safer than indexing past the vectors.
  if (!connected() || v < 0 || v >= vectors()) return;
  const uint64_t one = 1;
  ssize_t n;
  do {
    n = write(interrupt_fds_[v], &one, sizeof(one));
  } while (n < 0 && errno == EINTR);
  // EAGAIN only when the counter is saturated, i.e. an interrupt is already
  // pending: nothing is lost.
  if (n == static_cast<ssize_t>(sizeof(one))) {
    metrics_->Inc(ChannelCounter::kInterruptsSent);
  }
}

}  // namespace tmem
