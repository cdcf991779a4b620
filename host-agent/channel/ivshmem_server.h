// IvshmemServer: the ivshmem-doorbell server side of one VM's channel.
//
// Speaks QEMU 7.2's ivshmem server protocol on a UNIX socket (QEMU's
// docs/specs/ivshmem-spec.rst, docs/data-plane.md): each message is one
// little-endian int64, optionally with one fd (SCM_RIGHTS). To a new client it
// sends, in order: the protocol version 0; the client's peer id (1); -1 with
// the shared memory fd; tmemd's own peer id (0) `vectors` times, each with one
// of tmemd's doorbell eventfds; then the client's id (1) `vectors` times with
// the client's own (interrupt) eventfds. A guest doorbell (0 << 16) | v
// then signals doorbell_fd(v); tmemd interrupts the guest by writing
// interrupt_fd(v).
//
// One client at a time (QEMU connects once per device); a second
// connection while one is attached is closed at once and counted, unless
// the attached one has hung up meanwhile: then it leaves first (its
// observer told, see below) and the newcomer is served. The
// handshake is a handful of small messages sent with MSG_DONTWAIT on a
// fresh socket, so it never blocks tmemd: if the kernel buffer cannot take
// it, the client is dropped and counted. A client that sends any byte (QEMU
// never does) or hangs up is dropped; the listening socket and the shared
// memory stay, ready for the next client (e.g. a restarted guestsim).
//
// The eventfds are created once (EFD_NONBLOCK) and survive client
// reconnects, so the worker's epoll set does not change.
//
// Observer: the owner (Channel) is told of each step of a client's life,
// in order, before the server acts on it: a connection accepted (before
// any handshake byte is sent; the owner may refuse it), the handshake
// sent, a handshake that failed, and an attached client leaving (before
// its fd is closed and before any other connection is handled). Every way
// a client goes (hang-up, garbage, found dead when another connects) goes
// through ClientLeaving.
//
// Out of descriptors: the server keeps kReserveFds spare descriptors. When
// accept fails with EMFILE/ENFILE it closes them and accepts again, so a
// queued guest is always answered (or refused) rather than left queued.
// With no reserve left (or ENOBUFS/ENOMEM), OnListenReadable returns with
// accept_blocked() set: the caller must stop polling the listening socket
// (it stays readable) and retry later; each such stop is counted in
// accept_backoffs().
//
// Peer ids: tmemd is `host_peer_id` and the VM the other of {0, 1}. With
// host_peer_id 1 the VM is peer 0, which QEMU needs for a migratable device
// (ivshmem master=on, the default for peer 0); host_peer_id 0 is the
// pre-v2 layout (guests that always ring peer 0).
//
// Restart: Adopt() takes over the descriptors a previous tmemd handed over
// (listening socket, shared memory, eventfds, and QEMU's connection if it
// is still there), so a running VM keeps its device across a tmemd restart.
// KeepSocketPath() makes the destructor leave the path for the next tmemd.
//
// Not thread-safe: one worker thread calls OnListenReadable/OnClientEvent
// from its epoll loop; NotifyGuest may be called from that same thread.
#ifndef TMEMD_HOST_AGENT_CHANNEL_IVSHMEM_SERVER_H_
#define TMEMD_HOST_AGENT_CHANNEL_IVSHMEM_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "host-agent/channel/channel_metrics.h"

namespace tmem {

struct IvshmemServerOptions {
  std::string socket_path;            // created; an existing stale socket
                                      // file is replaced, any other file is
                                      // an error
  int vectors = 1;                    // 1..16, must match QEMU's vectors=
  mode_t socket_mode = 0660;          // QEMU often runs as another user
  std::optional<uid_t> socket_owner;  // chown after bind when set
  std::optional<gid_t> socket_group;
  int host_peer_id = 0;  // 0 or 1; the VM gets the other
};

// Descriptors of a running server, as handed from one tmemd to the next.
// Owned: Adopt closes every one of them when it fails.
struct IvshmemServerFds {
  int listen = -1;
  int shm = -1;
  int client = -1;  // -1: no VM was attached
  // A connection stored before its handshake (see Channel); -1 if none.
  // With `client` set it is the same connection and is closed. Alone, the
  // handshake (one sendmmsg: all or nothing) may or may not have gone out:
  // Adopt keeps it as the client if the guest has bytes of it still
  // unread (SIOCOUTQ), and otherwise refuses it (the guest sees EOF, never
  // a silent stall).
  int attaching = -1;
  std::vector<int> doorbells;
  std::vector<int> interrupts;
};

// Told of each step of a client's life (see the file comment). Called on
// the server's thread, from OnListenReadable or OnClientEvent.
class IvshmemClientObserver {
 public:
  enum class LeaveReason { kHangup, kGarbage };
  virtual ~IvshmemClientObserver() = default;
  // `fd` was accepted; nothing has been sent to it. False refuses it: it
  // is closed at once and counted as a handshake failure.
  virtual bool BeforeHandshake(int fd) = 0;
  // `fd` got its whole handshake and is the attached client from now on.
  virtual void AfterHandshake(int fd) = 0;
  // `fd`'s handshake failed; it is closed after this returns.
  virtual void HandshakeFailed(int fd) = 0;
  // The attached client `fd` is leaving; it is closed after this returns.
  virtual void ClientLeaving(int fd, LeaveReason reason) = 0;
};

class IvshmemServer {
 public:
  // Spare descriptors closed to let an accept through on EMFILE: one for
  // the connection, one for the fd store's notify socket.
  static constexpr int kReserveFds = 2;

  // Binds and listens (non-blocking). `shm_fd` is dup'ed; the caller keeps
  // its own. `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<IvshmemServer>> Listen(
      const IvshmemServerOptions& options, int shm_fd, ChannelMetrics* metrics);
  // Takes over `fds` (see IvshmemServerFds), checking each is what its name
  // says (a listening UNIX stream socket, a power-of-two memfd, eventfds,
  // a connected UNIX stream socket). The socket path is the one the
  // listening socket is bound to. A client that hung up meanwhile is closed
  // and counted as a disconnect (client_fd() is then -1).
  static absl::StatusOr<std::unique_ptr<IvshmemServer>> Adopt(
      const IvshmemServerOptions& options, const IvshmemServerFds& fds,
      ChannelMetrics* metrics);
  ~IvshmemServer();  // closes everything and unlinks the socket path
  // The destructor leaves the socket file: a restarted tmemd takes the
  // listening socket over (fd store or exec handoff).
  void KeepSocketPath() { keep_path_ = true; }
  int shm_fd() const { return shm_fd_; }
  int host_peer_id() const { return host_peer_id_; }
  IvshmemServer(const IvshmemServer&) = delete;
  IvshmemServer& operator=(const IvshmemServer&) = delete;

  int listen_fd() const { return listen_fd_; }
  // -1 when no client is attached.
  int client_fd() const { return client_fd_; }
  // Any thread (status readers); the fd itself is the worker's.
  bool connected() const { return connected_.load(std::memory_order_relaxed); }
  int vectors() const { return static_cast<int>(doorbell_fds_.size()); }
  // Signalled by the guest's doorbell on vector v (read it to clear).
  int doorbell_fd(int v) const { return doorbell_fds_[v]; }
  // Written by tmemd to interrupt the guest on vector v.
  int interrupt_fd(int v) const { return interrupt_fds_[v]; }

  // Must outlive the server; nullptr (the default) tells nobody.
  void SetObserver(IvshmemClientObserver* observer) { observer_ = observer; }

  // Accepts pending connections and performs the handshake. Returns true if
  // a new client became attached. When it returns with accept_blocked(),
  // connections are still queued but no descriptor could be had for them.
  bool OnListenReadable();
  bool accept_blocked() const { return accept_blocked_; }
  // Times OnListenReadable stopped with accept_blocked() (the caller backs
  // off), and accepts that went through only thanks to the reserve.
  uint64_t accept_backoffs() const { return accept_backoffs_; }
  uint64_t accepts_from_reserve() const { return accepts_from_reserve_; }
  int reserve_fds() const { return static_cast<int>(reserve_.size()); }
  // The client fd is readable or hung up: drops the client if it hung up
  // or sent anything. Returns true if the client was dropped.
  bool OnClientEvent();
  // Raises interrupt vector v on the guest (no-op without a client).
  void NotifyGuest(int v);

  const std::string& socket_path() const { return socket_path_; }

 private:
  IvshmemServer(std::string socket_path, int listen_fd, int shm_fd,
                std::vector<int> doorbell_fds, std::vector<int> interrupt_fds,
                ChannelMetrics* metrics, int host_peer_id);
  bool SendHandshake(int fd);
  void DropClient(IvshmemClientObserver::LeaveReason reason);
  // A connection, or -1 when none is pending or none can be had (then
  // accept_blocked_ is set).
  int AcceptOne();
  void RefillReserve();

  std::string socket_path_;
  int listen_fd_;
  int shm_fd_;
  int client_fd_ = -1;
  std::atomic<bool> connected_{false};  // client_fd_ >= 0, for other threads
  std::vector<int> doorbell_fds_;
  std::vector<int> interrupt_fds_;
  ChannelMetrics* metrics_;
  int host_peer_id_;
  bool keep_path_ = false;
  IvshmemClientObserver* observer_ = nullptr;
  std::vector<int> reserve_;  // open /dev/null descriptors
  bool accept_blocked_ = false;
  uint64_t accept_backoffs_ = 0;
  uint64_t accepts_from_reserve_ = 0;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_IVSHMEM_SERVER_H_
