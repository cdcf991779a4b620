// EtcdClient: the few etcd v3 gRPC calls tmemd and tmemctl make, over
// etcd's own protos (proto/etcd). No HTTP gateway, no hand-written wire.
//
// Endpoints are "host:port"; calls go to one endpoint at a time and
// Rotate() moves to the next (a dead or partitioned member is left on the
// first UNAVAILABLE). TLS: see etcd_tls.h (the CA alone, or the CA with a
// client certificate and key); none of them is plaintext.
//
// Thread-compatible: one owner, or external locking. Stubs may be used
// from several threads (gRPC stubs are thread-safe).
#ifndef TMEMD_HOST_AGENT_FLEET_ETCD_CLIENT_H_
#define TMEMD_HOST_AGENT_FLEET_ETCD_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "host-agent/fleet/etcd_tls.h"
#include "proto/etcd/rpc.grpc.pb.h"

namespace tmem {

// The payload key FromGrpc sets on an error it traced to TLS (a refused
// client certificate, an untrusted server, TLS on one side only).
inline constexpr char kEtcdTlsErrorPayload[] = "tmemd/etcd-tls-error";

struct EtcdOptions {
  std::vector<std::string> endpoints;
  EtcdTlsFiles tls;  // none set: plaintext
  std::chrono::milliseconds call_timeout{5000};
};

// Options for `endpoints` with the TLS files `cert`, `key` and `ca` (all ""
// for plaintext), each named in errors by `setting_prefix` and its kind:
// "[fleet] tls_" names them "[fleet] tls_cert", ...; "--etcd-" names them
// "--etcd-cert", .... tmemd's [fleet] section and tmemctl's flags both
// build their client this way.
EtcdOptions EtcdOptionsFor(std::vector<std::string> endpoints, std::string cert,
                           std::string key, std::string ca,
                           const std::string& setting_prefix);

// The key just past every key starting with `prefix` (etcd's range_end).
std::string EtcdPrefixEnd(const std::string& prefix);

class EtcdClient {
 public:
  // Reads and checks the TLS files (LoadEtcdTls); INVALID_ARGUMENT naming
  // the bad one and its setting, or an empty endpoint list.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(
      const EtcdOptions& options);

  const std::string& endpoint() const { return options_.endpoints[current_]; }
  bool tls() const { return options_.tls.any(); }
  void Rotate();

  etcdserverpb::KV::Stub& kv() { return *kv_; }
  etcdserverpb::Watch::Stub& watch() { return *watch_; }
  etcdserverpb::Lease::Stub& lease() { return *lease_; }

  // A context with the call timeout (none for streams: `stream` = true).
  // Every context asks for a member with a leader ("hasleader"), so a
  // member cut off from the quorum refuses instead of serving stale data.
  void Prepare(grpc::ClientContext* context, bool stream) const;

  // Unary helpers; errors name the endpoint.
  absl::StatusOr<etcdserverpb::RangeResponse> Range(
      const etcdserverpb::RangeRequest& request);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(
      const etcdserverpb::TxnRequest& request);
  absl::StatusOr<etcdserverpb::PutResponse> Put(
      const etcdserverpb::PutRequest& request);

  // UNAVAILABLE and UNKNOWN are looked into (DiagnoseEtcdTls): when the
  // cause is TLS, the message says so plainly and the status carries the
  // kEtcdTlsErrorPayload payload.
  absl::Status FromGrpc(const grpc::Status& status) const;

 private:
  EtcdClient(EtcdOptions options,
             std::optional<grpc::SslCredentialsOptions> ssl,
             std::shared_ptr<grpc::ChannelCredentials> credentials)
      : options_(std::move(options)),
        ssl_(std::move(ssl)),
        credentials_(std::move(credentials)) {}
  void Connect();

  EtcdOptions options_;
  std::optional<grpc::SslCredentialsOptions> ssl_;  // set: TLS
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  size_t current_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch_;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_FLEET_ETCD_CLIENT_H_
