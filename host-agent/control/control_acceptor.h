// ControlAcceptor: tmemd's own accept loop for the gRPC control listeners.
//
// gRPC 1.51's listener (src/core/lib/iomgr/tcp_server_posix.cc, on_read)
// treats any accept4() error other than EINTR/EAGAIN, EMFILE included, as
// fatal for that port: it logs "Failed accept4" and never re-arms the read
// notification, so one moment out of descriptors silences a socket until
// tmemd restarts. It also has no per-listener connection limit (no
// GRPC_ARG_MAX_ALLOWED_INCOMING_CONNECTIONS before 1.53). So tmemd owns the
// listening sockets and hands each accepted connection to gRPC through
// ServerBuilder's ExternalConnectionAcceptor (TLS handshakes included).
//
// Contract, per listener:
//  * at most `max_connections` connections are open at once; one more is
//    accepted and closed at once (the client sees the connection end, not a
//    hang), counted in `refused` and logged (at most once a second per
//    listener, with how many were not logged);
//  * an accept() that fails for want of descriptors or memory (EMFILE,
//    ENFILE, ENOBUFS, ENOMEM) is counted in `accept_failures`, logged the
//    same rate-limited way, and the listener is left out of the poll set for
//    kRetryAfter, then tried again: it always recovers, and it never spins
//    on a listen socket it cannot accept from;
//  * a connection counts as open from accept until gRPC closes it or its
//    peer hangs up. tmemd learns that through a duplicate of the socket it
//    keeps and polls (POLLRDHUP/POLLHUP: gRPC shuts a socket down before it
//    closes it): each open connection costs two descriptors.
//
// Thread-safe: one thread runs the loop; Stats() may be called from any
// thread. Stop() (and the destructor) ends the loop, closes the listening
// sockets and the duplicates; gRPC keeps and closes its own descriptors.
#ifndef TMEMD_HOST_AGENT_CONTROL_CONTROL_ACCEPTOR_H_
#define TMEMD_HOST_AGENT_CONTROL_CONTROL_ACCEPTOR_H_

#include <grpcpp/server_builder.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace tmem {

// Descriptors one open control connection costs (gRPC's socket and the
// duplicate the acceptor watches).
inline constexpr int kDescriptorsPerControlConnection = 2;

struct ControlListenerSpec {
  std::string name;    // "admin", "readonly", "tcp": in counters and logs
  int listen_fd = -1;  // listening, non-blocking; the acceptor owns it
  int max_connections = 1;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> to_grpc;
};

struct ControlListenerStats {
  std::string name;
  int open = 0;
  int max_connections = 0;
  uint64_t refused = 0;          // closed at accept: max_connections open
  uint64_t accept_failures = 0;  // accept() out of descriptors or memory
};

class ControlAcceptor {
 public:
  static constexpr std::chrono::milliseconds kRetryAfter{100};

  static absl::StatusOr<std::unique_ptr<ControlAcceptor>> Start(
      std::vector<ControlListenerSpec> listeners);
  ~ControlAcceptor();
  ControlAcceptor(const ControlAcceptor&) = delete;
  ControlAcceptor& operator=(const ControlAcceptor&) = delete;

  void Stop();
  std::vector<ControlListenerStats> Stats() const;

 private:
  struct Listener {
    ControlListenerSpec spec;
    std::atomic<int> open{0};
    std::atomic<uint64_t> refused{0};
    std::atomic<uint64_t> accept_failures{0};
    // Loop thread only.
    std::chrono::steady_clock::time_point retry_at{};
    std::chrono::steady_clock::time_point last_log{};
    uint64_t unlogged = 0;
  };
  struct Watch {
    int fd;  // duplicate of a connection handed to gRPC
    Listener* listener;
  };

  explicit ControlAcceptor(int wake_fd);
  void Loop();
  void AcceptFrom(Listener& l, std::chrono::steady_clock::time_point now);
  static void LogRateLimited(Listener& l, const char* event, int err,
                             std::chrono::steady_clock::time_point now);

  std::vector<std::unique_ptr<Listener>> listeners_;
  std::vector<Watch> watches_;  // loop thread only (until joined)
  const int wake_fd_;           // eventfd: Stop() wakes the poll
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_CONTROL_ACCEPTOR_H_
