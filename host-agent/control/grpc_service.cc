#include "host-agent/control/grpc_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "host-agent/channel/socket_file.h"

namespace tmem {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path,
                                    const std::string& what) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read the TLS ", what, " '", path,
        "' ([control] tls_cert/tls_key/tls_ca or --control-tls-*)"));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// Room for a burst of connects while the acceptor serves another listener.
constexpr int kListenBacklog = 128;

// Owns one descriptor until Release().
class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.Release()) {}
  UniqueFd& operator=(UniqueFd&&) = delete;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// "host:port" or "[v6]:port" (port 0: any, reported in *port), listening
// and non-blocking, as gRPC would have bound it.
absl::StatusOr<UniqueFd> ListenTcp(const std::string& address, int* port) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string service =
      colon == std::string::npos ? address : address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  auto refuse = [&](const std::string& why) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for the control plane on '", address, "': ", why));
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                                 service.c_str(), &hints, &found);
      rc != 0) {
    return refuse(gai_strerror(rc));
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    UniqueFd fd(
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) continue;
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 ||
        listen(fd.get(), kListenBacklog) != 0) {
      why = std::generic_category().message(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    *port = ntohs(bound.ss_family == AF_INET6
                      ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                      : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    freeaddrinfo(found);
    return fd;
  }
  freeaddrinfo(found);
  return refuse(why);
}

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* out) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *out = std::move(*result);
  return grpc::Status::OK;
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl::StatusCode and grpc::StatusCode share their numbering.
  return {static_cast<grpc::StatusCode>(status.code()),
          std::string(status.message())};
}

void StopSignal::Stop() {
  {
    MutexLock lock(&mu_);
    stopped_ = true;
  }
  cv_.NotifyAll();
}

bool StopSignal::stopped() const {
  MutexLock lock(&mu_);
  return stopped_;
}

bool StopSignal::WaitFor(int ms) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  MutexLock lock(&mu_);
  while (!stopped_ && cv_.WaitUntil(&mu_, deadline)) {
  }
  return stopped_;
}

TmemControlService::TmemControlService(
    ControlPlane* control, ControlAccess access,
    std::vector<std::string> admin_identities, StopSignal* stop,
    int max_watch_streams)
    : control_(control),
      access_(access),
      admin_identities_(std::move(admin_identities)),
      stop_(stop),
      max_watch_streams_(max_watch_streams) {}

grpc::Status TmemControlService::CheckAdmin(grpc::ServerContext* ctx,
                                            std::string_view rpc) const {
  switch (access_) {
    case ControlAccess::kAdmin:
      return grpc::Status::OK;
    case ControlAccess::kReadOnly:
      return {grpc::StatusCode::PERMISSION_DENIED,
              absl::StrCat(std::string(rpc),
                           " changes tmemd's state and this socket is "
                           "read-only: use the admin socket (mode 0600, "
                           "[control] socket) as its owner")};
    case ControlAccess::kByCertificate:
      break;
  }
  std::string who;
  const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth != nullptr) {
    for (const char* prop :
         {"x509_common_name", "x509_subject_alternative_name"}) {
      for (const grpc::string_ref& v : auth->FindPropertyValues(prop)) {
        const std::string id(v.data(), v.size());
        if (who.empty()) who = id;
        if (std::find(admin_identities_.begin(), admin_identities_.end(), id) !=
            admin_identities_.end()) {
          return grpc::Status::OK;
        }
      }
    }
  }
  return {grpc::StatusCode::PERMISSION_DENIED,
          absl::StrCat(std::string(rpc), " changes tmemd's state and client '",
                       who.empty() ? "(no certificate name)" : who,
                       "' is read-only: add its certificate CN or SAN to "
                       "[control] admin on this host")};
}

grpc::Status TmemControlService::Status(grpc::ServerContext* /*ctx*/,
                                        const v1::StatusRequest* /*req*/,
                                        v1::HostStatus* resp) {
  *resp = control_->Status();
  return grpc::Status::OK;
}

grpc::Status TmemControlService::ListVms(grpc::ServerContext* /*ctx*/,
                                         const v1::ListVmsRequest* /*req*/,
                                         v1::ListVmsResponse* resp) {
  *resp = control_->ListVms();
  return grpc::Status::OK;
}

grpc::Status TmemControlService::GetVm(grpc::ServerContext* /*ctx*/,
                                       const v1::GetVmRequest* req,
                                       v1::VmDetail* resp) {
  return Reply(control_->GetVm(req->vm()), resp);
}

grpc::Status TmemControlService::SetVmPolicy(grpc::ServerContext* ctx,
                                             const v1::SetVmPolicyRequest* req,
                                             v1::SetVmPolicyResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "SetVmPolicy"); !s.ok()) return s;
  return Reply(control_->SetVmPolicy(*req), resp);
}

grpc::Status TmemControlService::SetHostPolicy(
    grpc::ServerContext* ctx, const v1::SetHostPolicyRequest* req,
    v1::SetHostPolicyResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "SetHostPolicy"); !s.ok()) return s;
  return Reply(control_->SetHostPolicy(*req), resp);
}

grpc::Status TmemControlService::FreezeVm(grpc::ServerContext* ctx,
                                          const v1::VmRequest* req,
                                          v1::SetVmPolicyResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "FreezeVm"); !s.ok()) return s;
  return Reply(control_->SetFrozen(req->vm(), true), resp);
}

grpc::Status TmemControlService::ThawVm(grpc::ServerContext* ctx,
                                        const v1::VmRequest* req,
                                        v1::SetVmPolicyResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "ThawVm"); !s.ok()) return s;
  return Reply(control_->SetFrozen(req->vm(), false), resp);
}

grpc::Status TmemControlService::FlushVm(grpc::ServerContext* ctx,
                                         const v1::VmRequest* req,
                                         v1::FlushVmResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "FlushVm"); !s.ok()) return s;
  return Reply(control_->FlushVm(req->vm()), resp);
}

grpc::Status TmemControlService::AddSwapDevice(
    grpc::ServerContext* ctx, const v1::AddSwapDeviceRequest* req,
    v1::SwapDevice* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "AddSwapDevice"); !s.ok()) return s;
  return Reply(control_->AddSwapDevice(req->vm(), req->size_bytes()), resp);
}

grpc::Status TmemControlService::RemoveSwapDevice(
    grpc::ServerContext* ctx, const v1::VmRequest* req,
    v1::RemoveSwapDeviceResponse* /*resp*/) {
  if (grpc::Status s = CheckAdmin(ctx, "RemoveSwapDevice"); !s.ok()) return s;
  return ToGrpcStatus(control_->RemoveSwapDevice(req->vm()));
}

grpc::Status TmemControlService::AuthorizeSharedPool(
    grpc::ServerContext* ctx, const v1::AuthorizeSharedPoolRequest* req,
    v1::AuthorizeSharedPoolResponse* /*resp*/) {
  if (grpc::Status s = CheckAdmin(ctx, "AuthorizeSharedPool"); !s.ok()) {
    return s;
  }
  return ToGrpcStatus(control_->AuthorizeSharedPool(*req));
}

grpc::Status TmemControlService::AttachDomain(grpc::ServerContext* ctx,
                                              const v1::DomainRequest* req,
                                              v1::DomainState* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "AttachDomain"); !s.ok()) return s;
  return Reply(control_->AttachDomain(*req), resp);
}

grpc::Status TmemControlService::DetachDomain(grpc::ServerContext* ctx,
                                              const v1::DomainRequest* req,
                                              v1::DomainState* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "DetachDomain"); !s.ok()) return s;
  return Reply(control_->DetachDomain(*req), resp);
}

grpc::Status TmemControlService::LibvirtHook(grpc::ServerContext* ctx,
                                             const v1::LibvirtHookRequest* req,
                                             v1::DomainState* resp) {
  if (grpc::Status s = CheckAdmin(ctx, "LibvirtHook"); !s.ok()) return s;
  return Reply(control_->LibvirtHook(*req), resp);
}

grpc::Status TmemControlService::ListDomains(
    grpc::ServerContext* /*ctx*/, const v1::ListDomainsRequest* /*req*/,
    v1::ListDomainsResponse* resp) {
  return Reply(control_->ListDomains(), resp);
}

grpc::Status TmemControlService::WatchStats(
    grpc::ServerContext* ctx, const v1::WatchStatsRequest* req,
    grpc::ServerWriter<v1::StatsSample>* writer) {
  const uint32_t interval = req->interval_ms() == 0 ? 1000 : req->interval_ms();
  if (interval < 100 || interval > 60000) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("interval ", interval,
                         " ms is out of range: use 100..60000 ms")};
  }
  for (const std::string& vm : req->vms()) {
    if (absl::StatusOr<v1::VmDetail> d = control_->GetVm(vm); !d.ok()) {
      return ToGrpcStatus(d.status());
    }
  }
  // A stream holds a handler thread for as long as it lives: bounded per
  // listener, so watchers cannot take every thread of a socket.
  if (streams_.fetch_add(1) >= max_watch_streams_) {
    streams_.fetch_sub(1);
    streams_refused_.fetch_add(1);
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("too many WatchStats streams on this socket (",
                         max_watch_streams_, "): close one and retry")};
  }
  struct Release {
    std::atomic<int>* n;
    ~Release() { n->fetch_sub(1); }
  } release{&streams_};
  constexpr int kCancelCheckMs = 100;
  while (!ctx->IsCancelled() && !stop_->stopped()) {
    if (!writer->Write(control_->Sample(*req))) break;  // client went away
    // Wake early on shutdown, and notice a cancelled or vanished client
    // within kCancelCheckMs, not at the end of a long interval.
    bool stopped = false;
    for (int left = static_cast<int>(interval); left > 0 && !stopped;
         left -= kCancelCheckMs) {
      stopped =
          stop_->WaitFor(std::min(left, kCancelCheckMs)) || ctx->IsCancelled();
    }
    if (stopped) break;
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<ControlServer>> ControlServer::Start(
    const ControlServerOptions& options, ControlPlane* control) {
  std::unique_ptr<ControlServer> self(new ControlServer());
  self->options_ = options;
  self->control_ = control;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::vector<ControlListenerSpec> listeners;
  auto close_all = [&listeners] {
    for (const ControlListenerSpec& l : listeners) close(l.listen_fd);
  };
  // One gRPC server per listener, fed by the acceptor, never by gRPC's own
  // accept loop (control_acceptor.h says why).
  auto start = [&](UniqueFd listen_fd, const std::string& name,
                   int max_connections,
                   const std::shared_ptr<grpc::ServerCredentials>& creds,
                   ControlAccess access) -> absl::Status {
    auto service = std::make_unique<TmemControlService>(
        control, access, options.admin_identities, &self->stop_,
        options.max_watch_streams);
    grpc::ServerBuilder builder;
    std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> to_grpc =
        builder.experimental().AddExternalConnectionAcceptor(
            grpc::ServerBuilder::experimental_type::ExternalConnectionType::
                FROM_FD,
            creds);
    builder.SetMaxReceiveMessageSize(
        access == ControlAccess::kAdmin
            ? std::max(options.max_request_bytes, kAdminUnixMaxRequestBytes)
            : options.max_request_bytes);
    grpc::ResourceQuota quota(absl::StrCat("tmemd-control-", name));
    quota.SetMaxThreads(options.max_threads);
    builder.SetResourceQuota(quota);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                               options.max_streams_per_connection);
    // A TCP peer that vanished without a FIN is found by keepalive pings.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.RegisterService(service.get());
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr || to_grpc == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "cannot start the control plane's ", name, " gRPC server"));
    }
    server->GetHealthCheckService()->SetServingStatus(true);
    self->services_.push_back(std::move(service));
    self->servers_.push_back(std::move(server));
    listeners.push_back(
        {name, listen_fd.Release(), max_connections, std::move(to_grpc)});
    return absl::OkStatus();
  };
  // The socket is bound in a private directory tmemd made; its mode is set
  // there and it is renamed into place, so no chmod follows a link planted
  // at `path` and the socket never sits there with the umask's mode
  // (host-agent/channel/socket_file.h).
  auto unix_listener = [&](const std::string& path, mode_t mode,
                           const std::string& name, int max_connections,
                           ControlAccess access) -> absl::Status {
    if (path.empty()) return absl::OkStatus();
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) {
      return absl::UnavailableError(
          absl::StrCat("control socket: socket(): ",
                       std::generic_category().message(errno)));
    }
    if (absl::Status s = BindUnixSocket(
            fd.get(), path, {mode, std::nullopt, std::nullopt}, kListenBacklog);
        !s.ok()) {
      return {s.code(), absl::StrCat("control socket: ", s.message())};
    }
    return start(std::move(fd), name, max_connections,
                 grpc::InsecureServerCredentials(), access);
  };
  absl::Status status =
      unix_listener(options.unix_socket, 0600, "admin",
                    options.max_admin_connections, ControlAccess::kAdmin);
  if (status.ok()) {
    status = unix_listener(options.readonly_unix_socket, 0666, "readonly",
                           options.max_readonly_connections,
                           ControlAccess::kReadOnly);
  }
  if (status.ok() && !options.tcp_address.empty()) {
    status = [&]() -> absl::Status {
      absl::StatusOr<std::string> cert =
          ReadPem(options.tls_cert, "certificate");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadPem(options.tls_key, "key");
      if (!key.ok()) return key.status();
      absl::StatusOr<std::string> ca = ReadPem(options.tls_ca, "CA bundle");
      if (!ca.ok()) return ca.status();
      absl::StatusOr<UniqueFd> fd =
          ListenTcp(options.tcp_address, &self->tcp_port_);
      if (!fd.ok()) return fd.status();
      grpc::SslServerCredentialsOptions ssl(
          GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      ssl.pem_root_certs = *ca;
      ssl.pem_key_cert_pairs.push_back({*key, *cert});
      return start(std::move(*fd), "tcp", options.max_tcp_connections,
                   grpc::SslServerCredentials(ssl),
                   ControlAccess::kByCertificate);
    }();
  }
  if (!status.ok()) {
    close_all();
    return status;
  }
  absl::StatusOr<std::unique_ptr<ControlAcceptor>> acceptor =
      ControlAcceptor::Start(std::move(listeners));
  if (!acceptor.ok()) return acceptor.status();
  self->acceptor_ = std::move(*acceptor);
  control->SetListenerCounters(
      [p = self.get()] { return p->ListenerCounters(); });
  return self;
}

void ControlServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (control_ != nullptr) control_->SetListenerCounters(nullptr);
  stop_.Stop();
  // No new connections; gRPC closes the ones it has.
  if (acceptor_ != nullptr) acceptor_->Stop();
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(2);
  for (auto& s : servers_) s->Shutdown(deadline);
  for (auto& s : servers_) s->Wait();
  for (const std::string& path :
       {options_.unix_socket, options_.readonly_unix_socket}) {
    if (!path.empty()) unlink(path.c_str());
  }
}

int ControlServer::active_streams() const {
  int n = 0;
  for (const auto& s : services_) n += s->active_streams();
  return n;
}

uint64_t ControlServer::streams_refused() const {
  uint64_t n = 0;
  for (const auto& s : services_) n += s->streams_refused();
  return n;
}

std::vector<ControlListenerStats> ControlServer::ListenerStats() const {
  return acceptor_ == nullptr ? std::vector<ControlListenerStats>{}
                              : acceptor_->Stats();
}

std::vector<v1::Counter> ControlServer::ListenerCounters() const {
  std::vector<v1::Counter> out;
  auto add = [&out](std::string name, uint64_t value, bool gauge) {
    v1::Counter& c = out.emplace_back();
    c.set_name(std::move(name));
    c.set_value(value);
    c.set_gauge(gauge);
  };
  for (const ControlListenerStats& l : ListenerStats()) {
    const std::string p = absl::StrCat("control_", l.name, "_");
    add(p + "connections_open", static_cast<uint64_t>(l.open), true);
    add(p + "connections_max", static_cast<uint64_t>(l.max_connections), true);
    add(p + "connections_refused", l.refused, false);
    add(p + "accept_failures", l.accept_failures, false);
  }
  return out;
}

void ControlServer::AppendConnectionMetrics(PrometheusText& out) const {
  static constexpr MetricFamily kOpen{
      "tmem_control_connections_open", MetricType::kGauge,
      "Connections open now on a gRPC control listener."};
  static constexpr MetricFamily kMax{
      "tmem_control_connections_max", MetricType::kGauge,
      "The most connections a gRPC control listener keeps open at once."};
  static constexpr MetricFamily kRefused{
      "tmem_control_connections_refused_total", MetricType::kCounter,
      "Connections to a gRPC control listener closed at accept: its "
      "connection limit was reached."};
  static constexpr MetricFamily kFailures{
      "tmem_control_accept_failures_total", MetricType::kCounter,
      "accept() failures on a gRPC control listener for want of descriptors "
      "or memory; the listener retries."};
  for (const ControlListenerStats& l : ListenerStats()) {
    const std::vector<MetricLabel> labels = {{"listener", l.name}};
    out.Add(kOpen, labels, static_cast<uint64_t>(l.open));
    out.Add(kMax, labels, static_cast<uint64_t>(l.max_connections));
    out.Add(kRefused, labels, l.refused);
    out.Add(kFailures, labels, l.accept_failures);
  }
}

ControlServer::~ControlServer() { Shutdown(); }

}  // namespace tmem
