// tmem.v1 over gRPC: the service class and the servers that listen for it.
//
// TmemControlService is final and thin: per RPC it checks the caller's
// access and forwards to ControlPlane, mapping absl::Status onto
// grpc::Status code for code. There is one service object per listener,
// each with the access rule of that listener:
//  * the admin UNIX socket (mode 0600: root, or tmemd's user): admin;
//  * the read-only UNIX socket (mode 0666): read-only, for monitoring;
//  * TCP with mTLS (client certificate required and verified against the
//    CA): admin when the certificate's CN or one of its SANs is in the admin
//    list, read-only otherwise.
//
// ControlServer also turns on gRPC health checking (grpc.health.v1) and
// server reflection, and ends WatchStats streams promptly on Shutdown.
//
// Resource limits, per listener (the read-only socket is world-accessible):
// a request larger than max_request_bytes, an RPC beyond max_threads
// handler threads and a WatchStats stream beyond max_watch_streams are
// refused with RESOURCE_EXHAUSTED (streams counted in streams_refused());
// each HTTP/2 connection carries at most max_streams_per_connection calls;
// a cancelled or vanished watcher releases its thread within 100 ms, not at
// the end of its interval; TCP peers are probed with keepalives. The admin
// UNIX socket takes requests up to kAdminUnixMaxRequestBytes instead:
// libvirt's qemu hook sends a whole domain XML, which libvirt itself
// allows up to 4 MiB, and a domain must not fail to start for its size;
// only root (or tmemd's user) can connect there.
//
// Connections: tmemd accepts them itself (control_acceptor.h) and hands them
// to gRPC, so each listener has its own cap on open connections (the
// read-only socket's far below the admin one's), a connection over the cap
// is closed at once and counted, and a listener that runs out of
// descriptors retries instead of going silent. Their counters are in
// Status (control_<listener>_connections_*) and on /metrics
// (AppendConnectionMetrics).
#ifndef TMEMD_HOST_AGENT_CONTROL_GRPC_SERVICE_H_
#define TMEMD_HOST_AGENT_CONTROL_GRPC_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/mutex.h"
#include "host-agent/control/control_acceptor.h"
#include "host-agent/control/control_plane.h"
#include "host-agent/control/prometheus_text.h"
#include "proto/tmem/v1/control.grpc.pb.h"

namespace tmem {

grpc::Status ToGrpcStatus(const absl::Status& status);

enum class ControlAccess {
  kAdmin,
  kReadOnly,
  kByCertificate,  // admin iff the peer certificate's CN/SAN is listed
};

// Wakes WatchStats loops when the server shuts down.
class StopSignal {
 public:
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  bool stopped() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits up to `ms`; true if stopped.
  bool WaitFor(int ms) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A leaf: nothing else is taken under it (host-agent/lock_order.h).
  mutable Mutex mu_;
  CondVar cv_;  // stopped_ set
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

class TmemControlService final : public v1::TmemControl::Service {
 public:
  TmemControlService(ControlPlane* control, ControlAccess access,
                     std::vector<std::string> admin_identities,
                     StopSignal* stop, int max_watch_streams = 32);

  int active_streams() const { return streams_.load(); }
  uint64_t streams_refused() const { return streams_refused_.load(); }

  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::HostStatus* resp) override;
  grpc::Status ListVms(grpc::ServerContext* ctx, const v1::ListVmsRequest* req,
                       v1::ListVmsResponse* resp) override;
  grpc::Status GetVm(grpc::ServerContext* ctx, const v1::GetVmRequest* req,
                     v1::VmDetail* resp) override;
  grpc::Status SetVmPolicy(grpc::ServerContext* ctx,
                           const v1::SetVmPolicyRequest* req,
                           v1::SetVmPolicyResponse* resp) override;
  grpc::Status SetHostPolicy(grpc::ServerContext* ctx,
                             const v1::SetHostPolicyRequest* req,
                             v1::SetHostPolicyResponse* resp) override;
  grpc::Status FreezeVm(grpc::ServerContext* ctx, const v1::VmRequest* req,
                        v1::SetVmPolicyResponse* resp) override;
  grpc::Status ThawVm(grpc::ServerContext* ctx, const v1::VmRequest* req,
                      v1::SetVmPolicyResponse* resp) override;
  grpc::Status FlushVm(grpc::ServerContext* ctx, const v1::VmRequest* req,
                       v1::FlushVmResponse* resp) override;
  grpc::Status AddSwapDevice(grpc::ServerContext* ctx,
                             const v1::AddSwapDeviceRequest* req,
                             v1::SwapDevice* resp) override;
  grpc::Status RemoveSwapDevice(grpc::ServerContext* ctx,
                                const v1::VmRequest* req,
                                v1::RemoveSwapDeviceResponse* resp) override;
  grpc::Status AuthorizeSharedPool(
      grpc::ServerContext* ctx, const v1::AuthorizeSharedPoolRequest* req,
      v1::AuthorizeSharedPoolResponse* resp) override;
  grpc::Status AttachDomain(grpc::ServerContext* ctx,
                            const v1::DomainRequest* req,
                            v1::DomainState* resp) override;
  grpc::Status DetachDomain(grpc::ServerContext* ctx,
                            const v1::DomainRequest* req,
                            v1::DomainState* resp) override;
  grpc::Status LibvirtHook(grpc::ServerContext* ctx,
                           const v1::LibvirtHookRequest* req,
                           v1::DomainState* resp) override;
  grpc::Status ListDomains(grpc::ServerContext* ctx,
                           const v1::ListDomainsRequest* req,
                           v1::ListDomainsResponse* resp) override;
  grpc::Status WatchStats(grpc::ServerContext* ctx,
                          const v1::WatchStatsRequest* req,
                          grpc::ServerWriter<v1::StatsSample>* writer) override;

 private:
  // OK for admins; PERMISSION_DENIED naming the RPC otherwise.
  grpc::Status CheckAdmin(grpc::ServerContext* ctx, std::string_view rpc) const;

  ControlPlane* const control_;
  const ControlAccess access_;
  const std::vector<std::string> admin_identities_;
  StopSignal* const stop_;
  const int max_watch_streams_;
  std::atomic<int> streams_{0};
  std::atomic<uint64_t> streams_refused_{0};
};

// libvirt carries a domain XML in at most VIR_NET_MESSAGE_STRING_MAX
// (4 MiB) bytes; the rest of a LibvirtHook request is small.
inline constexpr int kAdminUnixMaxRequestBytes = (4 << 20) + (64 << 10);

struct ControlServerOptions {
  std::string unix_socket;           // admin, mode 0600; "" for none
  std::string readonly_unix_socket;  // read-only, mode 0666; "" for none
  std::string tcp_address;           // "host:port" (port 0: any); "" none
  // PEM files, all required with tcp_address.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  std::vector<std::string> admin_identities;  // certificate CN or SAN
  // Limits per listener (see the file comment).
  int max_request_bytes = 256 << 10;
  int max_threads = 64;
  int max_watch_streams = 32;
  int max_streams_per_connection = 16;
  // Open connections per listener ([control] max_*_connections; the
  // descriptor budget may lower them, descriptor_budget.h).
  int max_admin_connections = 64;
  int max_readonly_connections = 8;
  int max_tcp_connections = 32;
};

class ControlServer {
 public:
  static absl::StatusOr<std::unique_ptr<ControlServer>> Start(
      const ControlServerOptions& options, ControlPlane* control);
  ~ControlServer();  // Shutdown()
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Ends streams, then stops accepting and waits for calls in flight
  // (at most ~2 s). Idempotent.
  void Shutdown();
  int tcp_port() const { return tcp_port_; }  // 0 without TCP
  // WatchStats streams open now / refused so far, over every listener.
  int active_streams() const;
  uint64_t streams_refused() const;
  // Per listener: open connections, cap, refused, accept failures.
  std::vector<ControlListenerStats> ListenerStats() const;
  // Status's names: control_<listener>_connections_{open,max,refused},
  // control_<listener>_accept_failures.
  std::vector<v1::Counter> ListenerCounters() const;
  // The same as tmem_control_* families for /metrics.
  void AppendConnectionMetrics(PrometheusText& out) const;

 private:
  ControlServer() = default;

  ControlServerOptions options_;
  ControlPlane* control_ = nullptr;
  StopSignal stop_;
  std::unique_ptr<ControlAcceptor> acceptor_;
  std::vector<std::unique_ptr<TmemControlService>> services_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  int tcp_port_ = 0;
  bool shut_down_ = false;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_GRPC_SERVICE_H_
