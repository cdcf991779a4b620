#include "host-agent/fleet/etcd_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace tmem {

std::string EtcdPrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(end.back() + 1);
      return end;
    }
    end.pop_back();
  }
  return {'\0'};  // every key
}

EtcdOptions EtcdOptionsFor(std::vector<std::string> endpoints, std::string cert,
                           std::string key, std::string ca,
                           const std::string& setting_prefix) {
  EtcdOptions o;
  o.endpoints = std::move(endpoints);
  o.tls.cert = std::move(cert);
  o.tls.key = std::move(key);
  o.tls.ca = std::move(ca);
  o.tls.cert_source = setting_prefix + "cert";
  o.tls.key_source = setting_prefix + "key";
  o.tls.ca_source = setting_prefix + "ca";
  return o;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(
    const EtcdOptions& options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("no etcd endpoints");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  std::optional<grpc::SslCredentialsOptions> ssl;
  if (options.tls.any()) {
    absl::StatusOr<grpc::SslCredentialsOptions> loaded =
        LoadEtcdTls(options.tls);
    if (!loaded.ok()) return loaded.status();
    ssl = *loaded;
    creds = grpc::SslCredentials(*ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  std::unique_ptr<EtcdClient> client(
      new EtcdClient(options, std::move(ssl), creds));
  client->Connect();
  return client;
}

void EtcdClient::Connect() {
  grpc::ChannelArguments args;
  // A member that vanished without closing TCP is noticed in seconds.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Reconnect attempts stay short: Rotate() moves on anyway.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  channel_ = grpc::CreateCustomChannel(endpoint(), credentials_, args);
  kv_ = etcdserverpb::KV::NewStub(channel_);
  watch_ = etcdserverpb::Watch::NewStub(channel_);
  lease_ = etcdserverpb::Lease::NewStub(channel_);
}

void EtcdClient::Rotate() {
  current_ = (current_ + 1) % options_.endpoints.size();
  Connect();
}

void EtcdClient::Prepare(grpc::ClientContext* context, bool stream) const {
  context->AddMetadata("hasleader", "true");
  if (!stream) {
    context->set_deadline(std::chrono::system_clock::now() +
                          options_.call_timeout);
  }
}

absl::Status EtcdClient::FromGrpc(const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (code == absl::StatusCode::kUnavailable ||
      code == absl::StatusCode::kUnknown) {
    const std::string tls = DiagnoseEtcdTls(
        endpoint(), ssl_ ? &*ssl_ : nullptr,
        std::min(options_.call_timeout, std::chrono::milliseconds(2000)));
    if (!tls.empty()) {
      absl::Status s(code,
                     absl::StrCat("etcd ", endpoint(), ": ", tls,
                                  " (gRPC: ", status.error_message(), ")"));
      s.SetPayload(kEtcdTlsErrorPayload, absl::Cord(tls));
      return s;
    }
  }
  return {code,
          absl::StrCat("etcd ", endpoint(), ": ", status.error_message())};
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(
    const etcdserverpb::RangeRequest& request) {
  grpc::ClientContext context;
  Prepare(&context, false);
  etcdserverpb::RangeResponse response;
  if (absl::Status s = FromGrpc(kv_->Range(&context, request, &response));
      !s.ok()) {
    return s;
  }
  return response;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(
    const etcdserverpb::TxnRequest& request) {
  grpc::ClientContext context;
  Prepare(&context, false);
  etcdserverpb::TxnResponse response;
  if (absl::Status s = FromGrpc(kv_->Txn(&context, request, &response));
      !s.ok()) {
    return s;
  }
  return response;
}

absl::StatusOr<etcdserverpb::PutResponse> EtcdClient::Put(
    const etcdserverpb::PutRequest& request) {
  grpc::ClientContext context;
  Prepare(&context, false);
  etcdserverpb::PutResponse response;
  if (absl::Status s = FromGrpc(kv_->Put(&context, request, &response));
      !s.ok()) {
    return s;
  }
  return response;
}

}  // namespace tmem
