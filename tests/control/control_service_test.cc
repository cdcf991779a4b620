// tmem.v1 over real gRPC on real sockets: an in-process Agent, the
// ControlPlane and ControlServer listening on an admin UNIX socket, a
// read-only UNIX socket and TCP with mutual TLS (certificates from a
// throwaway CA made with the openssl CLI). Every RPC, its errors and the
// access rules.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "host-agent/agent.h"
#include "host-agent/control/control_plane.h"
#include "host-agent/control/grpc_service.h"
#include "host-agent/control/policy_store.h"
#include "proto/tmem/v1/control.grpc.pb.h"
#include "tests/control/test_util.h"
#include "tests/temp_dir.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using testing::MakeTestCerts;
using testing::ReadFile;
using testing::TestCerts;

class FakeDomains : public DomainControl {
 public:
  absl::StatusOr<DomainAttachState> Attach(const std::string& domain,
                                           bool persistent) override {
    if (domain == "missing") {
      return absl::NotFoundError("no domain 'missing'");
    }
    return DomainAttachState{domain, domain, true, persistent, "attached"};
  }
  absl::StatusOr<DomainAttachState> Detach(const std::string& domain,
                                           bool persistent) override {
    return DomainAttachState{domain, domain, false, persistent,
                             "detach requested, waiting for guest ack"};
  }
  std::vector<DomainAttachState> List() override {
    return {{"web1", "web1", true, false, ""}};
  }
  absl::StatusOr<DomainAttachState> PrepareFromHook(
      const std::string& xml) override {
    return DomainAttachState{"hooked", "hooked", false, false,
                             absl::StrCat("prepared ", xml.size(), " bytes")};
  }
  absl::StatusOr<DomainAttachState> ReleaseFromHook(
      const std::string& /*xml*/) override {
    return DomainAttachState{"hooked", "hooked", false, false, "released"};
  }
  // Records what the control plane writes back; `fail_vm` plays a domain
  // whose metadata write fails (libvirtd gone).
  absl::Status PolicyChanged(const std::string& vm,
                             const VmPolicy& policy) override {
    std::lock_guard<std::mutex> l(mu);
    if (vm == fail_vm) {
      return absl::UnavailableError("fake: libvirtd is gone");
    }
    written.emplace_back(vm, policy);
    return absl::OkStatus();
  }
  absl::StatusOr<DomainAttachState> AttachSwap(const std::string& domain,
                                               uint64_t size) override {
    return DomainAttachState{domain, domain, true, true,
                             absl::StrCat("swap ", size, " bytes")};
  }
  absl::StatusOr<DomainAttachState> DetachSwap(
      const std::string& domain) override {
    return DomainAttachState{domain, domain, false, true, "swap removed"};
  }
  absl::StatusOr<DomainAttachState> MigrateFromHook(
      const std::string& xml) override {
    if (xml.find("swap.sock") != std::string::npos) {
      return absl::FailedPreconditionError("fake: has a swap device");
    }
    return DomainAttachState{"hooked", "hooked", false, false, "migratable"};
  }
  std::mutex mu;
  std::string fail_vm;                                    // guarded by mu
  std::vector<std::pair<std::string, VmPolicy>> written;  // guarded by mu
};

class ControlServiceTest : public ::testing::Test {
 protected:
  static constexpr int kMaxWatchStreams = 4;

  static void SetUpTestSuite() {
    cert_dir_ = new testing::TempDir("tmem-certs");
    certs_ = new TestCerts(MakeTestCerts(cert_dir_->path()));
  }
  static void TearDownTestSuite() {
    delete certs_;
    delete cert_dir_;
  }

  void SetUp() override {
#ifdef TMEM_TSAN_SKIP_GRPC
    GTEST_SKIP() << "skipped under TSan: Debian's gRPC is not TSan-"
                    "instrumented, so RPC traffic reports races inside gRPC "
                    "(see tests/control/CMakeLists.txt); runs in release/asan";
#endif
    ASSERT_TRUE(certs_->error.empty()) << certs_->error;
    tmp_ = std::make_unique<testing::TempDir>("tmem-control");
    ASSERT_FALSE(tmp_->path().empty());
    dir_ = tmp_->path();
    StartAll(/*with_domains=*/true);
  }
  void TearDown() override {
    StopAll();
    tmp_.reset();
  }

  void StartAll(bool with_domains) {
    AgentOptions opts;
    opts.store.memory_cap_bytes = uint64_t{64} << 20;
    opts.socket_dir = dir_;
    opts.workers = 1;
    opts.run_valve_ticker = false;
    auto agent = Agent::Create(opts);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    auto policies = PolicyStore::Open(dir_ + "/state.json");
    ASSERT_TRUE(policies.ok()) << policies.status();
    policies_ = std::move(*policies);
    control_ = std::make_unique<ControlPlane>(
        agent_.get(), policies_.get(), with_domains ? &domains_ : nullptr);
    agent_->SetVmPolicyResolver(
        [c = control_.get()](const std::string& name, const VmPolicy& p) {
          return c->ResolveVmPolicy(name, p);
        });
    for (const char* vm : {"g1", "g2"}) {
      ASSERT_TRUE(agent_->AddVm(vm, VmPolicy{}).ok());
    }
    ASSERT_TRUE(control_->ApplyStoredPolicies().ok());
    ControlServerOptions so;
    so.unix_socket = dir_ + "/control.sock";
    so.readonly_unix_socket = dir_ + "/control-ro.sock";
    so.tcp_address = "127.0.0.1:0";
    so.tls_cert = certs_->server_cert;
    so.tls_key = certs_->server_key;
    so.tls_ca = certs_->ca;
    so.admin_identities = {"ops-admin"};
    so.max_watch_streams = kMaxWatchStreams;
    auto server = ControlServer::Start(so, control_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    admin_ = Stub("unix:" + so.unix_socket);
    readonly_ = Stub("unix:" + so.readonly_unix_socket);
  }
  void StopAll() {
    admin_.reset();
    readonly_.reset();
    server_.reset();
    control_.reset();
    policies_.reset();
    agent_.reset();
  }

  static std::unique_ptr<v1::TmemControl::Stub> Stub(
      const std::string& target) {
    return v1::TmemControl::NewStub(
        grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  }
  std::unique_ptr<v1::TmemControl::Stub> TlsStub(const std::string& cert,
                                                 const std::string& key) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(certs_->ca);
    if (!cert.empty()) {
      ssl.pem_cert_chain = ReadFile(cert);
      ssl.pem_private_key = ReadFile(key);
    }
    return v1::TmemControl::NewStub(
        grpc::CreateChannel("localhost:" + std::to_string(server_->tcp_port()),
                            grpc::SslCredentials(ssl)));
  }

  // Puts `n` text pages into a private pool of `vm` straight into the store
  // (what a guest's ring would do); returns the pool id.
  PoolId PutPages(const std::string& vm, int n, bool* all_stored = nullptr,
                  PoolKind kind = PoolKind::kEphemeral) {
    absl::StatusOr<VmInfo> info = agent_->GetVm(vm);
    EXPECT_TRUE(info.ok());
    absl::StatusOr<PoolId> pool =
        agent_->store().NewPool(info->stats.id, nullptr, kind);
    EXPECT_TRUE(pool.ok()) << pool.status();
    bool stored = true;
    for (int i = 0; i < n; ++i) {
      const test::Page page = test::TextPage(i + 1);
      auto r = agent_->store().Put(info->stats.id, *pool,
                                   ObjectId::FromInode(1), i, ConstPage(page));
      EXPECT_TRUE(r.ok()) << r.status();
      stored = stored && r.ok() && r->stored;
    }
    if (all_stored != nullptr) *all_stored = stored;
    return *pool;
  }

  static grpc::Status SetPolicy(v1::TmemControl::Stub& stub,
                                const v1::SetVmPolicyRequest& req,
                                v1::SetVmPolicyResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::SetVmPolicyResponse ignored;
    return stub.SetVmPolicy(&ctx, req, resp ? resp : &ignored);
  }
  static grpc::Status SetHost(v1::TmemControl::Stub& stub,
                              const v1::SetHostPolicyRequest& req,
                              v1::SetHostPolicyResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::SetHostPolicyResponse ignored;
    return stub.SetHostPolicy(&ctx, req, resp ? resp : &ignored);
  }
  v1::VmDetail GetVm(const std::string& vm) {
    grpc::ClientContext ctx;
    v1::GetVmRequest req;
    req.set_vm(vm);
    v1::VmDetail d;
    EXPECT_TRUE(admin_->GetVm(&ctx, req, &d).ok());
    return d;
  }

  static inline testing::TempDir* cert_dir_ = nullptr;
  static inline TestCerts* certs_ = nullptr;
  std::unique_ptr<testing::TempDir> tmp_;
  std::string dir_;  // tmp_'s path
  FakeDomains domains_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<PolicyStore> policies_;
  std::unique_ptr<ControlPlane> control_;
  std::unique_ptr<ControlServer> server_;
  std::unique_ptr<v1::TmemControl::Stub> admin_, readonly_;
};

uint64_t Count(const google::protobuf::RepeatedPtrField<v1::Counter>& cs,
               const std::string& name) {
  for (const auto& c : cs) {
    if (c.name() == name) return c.value();
  }
  ADD_FAILURE() << "no counter " << name;
  return 0;
}

TEST_F(ControlServiceTest, StatusReportsHost) {
  grpc::ClientContext ctx;
  v1::HostStatus st;
  ASSERT_TRUE(admin_->Status(&ctx, v1::StatusRequest(), &st).ok());
  EXPECT_EQ(st.memory_cap_bytes(), uint64_t{64} << 20);
  EXPECT_FALSE(st.version().empty());
  EXPECT_EQ(st.vms(), 2);
  EXPECT_EQ(st.workers(), 1);
  EXPECT_EQ(st.policy().default_mode(), v1::MODE_ADAPTIVE);
  EXPECT_DOUBLE_EQ(st.cpu_budget_percent(), 25.0);
  EXPECT_GE(st.uptime_seconds(), 0);
  EXPECT_GT(st.counters_size(), 10);
}

TEST_F(ControlServiceTest, ListAndGetVmWithPoolStats) {
  PutPages("g1", 20);
  grpc::ClientContext ctx;
  v1::ListVmsResponse list;
  ASSERT_TRUE(admin_->ListVms(&ctx, v1::ListVmsRequest(), &list).ok());
  ASSERT_EQ(list.vms_size(), 2);
  EXPECT_EQ(list.vms(0).name(), "g1");
  EXPECT_EQ(list.vms(0).pages(), 20u);
  EXPECT_EQ(list.vms(1).pages(), 0u);
  const v1::VmDetail d = GetVm("g1");
  EXPECT_EQ(d.summary().name(), "g1");
  EXPECT_EQ(Count(d.counters(), "pages_held"), 20u);
  ASSERT_EQ(d.pools_size(), 1);
  EXPECT_FALSE(d.pools(0).shared());
  EXPECT_EQ(Count(d.pools(0).counters(), "pages_held"), 20u);
  EXPECT_EQ(d.socket_path(), dir_ + "/g1.sock");
  EXPECT_GT(d.channel_counters_size(), 5);
  EXPECT_GT(d.valve().counters_size(), 5);
}

TEST_F(ControlServiceTest, UnknownVmIsNotFoundAndEmptyNameInvalid) {
  for (const char* vm : {"nope", ""}) {
    grpc::ClientContext ctx;
    v1::GetVmRequest req;
    req.set_vm(vm);
    v1::VmDetail d;
    const grpc::Status s = admin_->GetVm(&ctx, req, &d);
    EXPECT_EQ(s.error_code(), *vm ? grpc::StatusCode::NOT_FOUND
                                  : grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
  }
  v1::SetVmPolicyRequest req;
  req.set_vm("nope");
  req.set_weight(10);
  const grpc::Status s = SetPolicy(*admin_, req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("tmemctl vms"), std::string::npos);
}

TEST_F(ControlServiceTest, SetVmPolicyPatchesAppliesAndPersists) {
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_quota_bytes(uint64_t{8} << 20);
  req.set_weight(300);
  req.set_mode(v1::MODE_ALWAYS);
  v1::SetVmPolicyResponse resp;
  ASSERT_TRUE(SetPolicy(*admin_, req, &resp).ok());
  EXPECT_EQ(resp.policy().generation(), 1u);
  // A patch: only the weight changes.
  v1::SetVmPolicyRequest w;
  w.set_vm("g1");
  w.set_weight(50);
  ASSERT_TRUE(SetPolicy(*admin_, w, &resp).ok());
  EXPECT_EQ(resp.policy().generation(), 2u);
  EXPECT_EQ(resp.policy().quota_bytes(), uint64_t{8} << 20);
  const v1::VmDetail d = GetVm("g1");
  EXPECT_EQ(d.summary().policy().weight(), 50u);
  EXPECT_EQ(d.summary().policy().mode(), v1::MODE_ALWAYS);
  EXPECT_EQ(d.valve().effective_mode(), v1::MODE_ALWAYS);
  // Applied to the agent (store and valve), and on disk.
  EXPECT_EQ(agent_->GetVmPolicy("g1")->quota_bytes, uint64_t{8} << 20);
  EXPECT_EQ(agent_->GetVm("g1")->valve.weight, 50u);
  const std::string state = ReadFile(dir_ + "/state.json");
  EXPECT_NE(state.find("\"g1\""), std::string::npos) << state;
  EXPECT_NE(state.find("8388608"), std::string::npos) << state;
  // quota 0 = unlimited.
  v1::SetVmPolicyRequest q;
  q.set_vm("g1");
  q.set_quota_bytes(0);
  ASSERT_TRUE(SetPolicy(*admin_, q).ok());
  EXPECT_EQ(agent_->GetVmPolicy("g1")->quota_bytes, kUnlimitedQuota);
}

// Per-VM policy travels with a libvirt domain: the whole policy after the
// patch goes to DomainControl (which writes the domain's metadata); a
// failed write is an error naming what did not happen, while the policy
// stays applied here.
TEST_F(ControlServiceTest, SetVmPolicyIsWrittenBackToTheDomain) {
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_quota_bytes(uint64_t{8} << 20);
  req.set_weight(300);
  req.set_mode(v1::MODE_ALWAYS);
  ASSERT_TRUE(SetPolicy(*admin_, req).ok());
  v1::SetVmPolicyRequest w;
  w.set_vm("g1");
  w.set_weight(50);
  ASSERT_TRUE(SetPolicy(*admin_, w).ok());
  {
    std::lock_guard<std::mutex> l(domains_.mu);
    ASSERT_EQ(domains_.written.size(), 2u);
    const auto& [vm, p] = domains_.written[1];
    EXPECT_EQ(vm, "g1");
    EXPECT_EQ(p.quota_bytes, uint64_t{8} << 20);  // kept from the first
    EXPECT_EQ(p.weight, 50u);
    EXPECT_EQ(p.mode, ValveMode::kAlways);
  }
  {
    std::lock_guard<std::mutex> l(domains_.mu);
    domains_.fail_vm = "g2";
  }
  v1::SetVmPolicyRequest g2;
  g2.set_vm("g2");
  g2.set_weight(70);
  const grpc::Status s = SetPolicy(*admin_, g2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("not in the domain's metadata"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(agent_->GetVm("g2")->valve.weight, 70u);
}

TEST_F(ControlServiceTest, BadPolicyValuesAreInvalidArgument) {
  for (int64_t weight : {int64_t{0}, int64_t{-5}, int64_t{2000000}}) {
    v1::SetVmPolicyRequest req;
    req.set_vm("g1");
    req.set_weight(weight);
    const grpc::Status s = SetPolicy(*admin_, req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << weight;
    EXPECT_NE(s.error_message().find("weight must be in [1, 1000000]"),
              std::string::npos)
        << s.error_message();
  }
  v1::SetVmPolicyRequest quota;
  quota.set_vm("g1");
  quota.set_quota_bytes(uint64_t{1} << 30);  // cap is 64 MiB
  grpc::Status s = SetPolicy(*admin_, quota);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("above the host memory cap"),
            std::string::npos)
      << s.error_message();
  v1::SetVmPolicyRequest mode;
  mode.set_vm("g1");
  mode.set_mode(static_cast<v1::Mode>(42));
  EXPECT_EQ(SetPolicy(*admin_, mode).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Nothing of the above was applied, and no generation was used up.
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 100u);
  EXPECT_EQ(GetVm("g1").summary().policy().generation(), 0u);

  v1::SetHostPolicyRequest h;
  h.set_cpu_budget_percent(0);
  EXPECT_EQ(SetHost(*admin_, h).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  h.set_cpu_budget_percent(150);
  EXPECT_EQ(SetHost(*admin_, h).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::SetHostPolicyRequest dm;
  dm.set_default_mode(v1::MODE_DEFAULT);
  EXPECT_EQ(SetHost(*admin_, dm).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::SetHostPolicyRequest cap;
  cap.set_memory_cap_bytes(100);
  EXPECT_EQ(SetHost(*admin_, cap).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// The swap quota and swap mode: patched like the other fields, returned by
// SetVmPolicy, GetVm and ListVms, written back to the domain, saved in the
// state file and restored from it.
TEST_F(ControlServiceTest, SwapPolicyIsSetReadBackAndPersisted) {
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_swap_quota_bytes(uint64_t{8} << 20);
  req.set_swap_mode(v1::MODE_OFF);
  v1::SetVmPolicyResponse resp;
  ASSERT_TRUE(SetPolicy(*admin_, req, &resp).ok());
  EXPECT_EQ(resp.policy().swap_quota_bytes(), uint64_t{8} << 20);
  EXPECT_EQ(resp.policy().swap_mode(), v1::MODE_OFF);
  EXPECT_EQ(resp.policy().quota_bytes(), 0u);  // not said: unchanged
  {
    std::lock_guard<std::mutex> l(domains_.mu);
    ASSERT_EQ(domains_.written.size(), 1u);
    EXPECT_EQ(domains_.written[0].second.swap_quota_bytes, uint64_t{8} << 20);
    EXPECT_EQ(domains_.written[0].second.swap_mode, ValveMode::kOff);
  }
  const std::string state = ReadFile(dir_ + "/state.json");
  EXPECT_NE(state.find("\"swap_quota_bytes\": 8388608"), std::string::npos)
      << state;
  EXPECT_NE(state.find("\"swap_mode\": \"off\""), std::string::npos) << state;

  // A patch of another field keeps them; the agent carries them.
  v1::SetVmPolicyRequest w;
  w.set_vm("g1");
  w.set_weight(50);
  ASSERT_TRUE(SetPolicy(*admin_, w, &resp).ok());
  EXPECT_EQ(resp.policy().swap_quota_bytes(), uint64_t{8} << 20);
  EXPECT_EQ(resp.policy().swap_mode(), v1::MODE_OFF);
  EXPECT_EQ(agent_->GetVmPolicy("g1")->swap_quota_bytes, uint64_t{8} << 20);
  const v1::VmDetail d = GetVm("g1");
  EXPECT_EQ(d.summary().policy().swap_quota_bytes(), uint64_t{8} << 20);
  EXPECT_EQ(d.summary().policy().swap_mode(), v1::MODE_OFF);
  EXPECT_EQ(d.summary().policy().mode(), v1::MODE_DEFAULT);  // apart
  {
    grpc::ClientContext ctx;
    v1::ListVmsResponse list;
    ASSERT_TRUE(admin_->ListVms(&ctx, v1::ListVmsRequest(), &list).ok());
    ASSERT_EQ(list.vms_size(), 2);
    EXPECT_EQ(list.vms(0).name(), "g1");
    EXPECT_EQ(list.vms(0).policy().swap_quota_bytes(), uint64_t{8} << 20);
    EXPECT_EQ(list.vms(0).policy().swap_mode(), v1::MODE_OFF);
    // A VM nobody set: unlimited (0), following its mode.
    EXPECT_EQ(list.vms(1).policy().swap_quota_bytes(), 0u);
    EXPECT_EQ(list.vms(1).policy().swap_mode(), v1::MODE_DEFAULT);
  }

  // A restart restores them from the state file.
  StopAll();
  StartAll(/*with_domains=*/true);
  ASSERT_EQ(policies_->Vm("g1")->policy.swap_mode, ValveMode::kOff);
  const v1::VmDetail after = GetVm("g1");
  EXPECT_EQ(after.summary().policy().swap_quota_bytes(), uint64_t{8} << 20);
  EXPECT_EQ(after.summary().policy().swap_mode(), v1::MODE_OFF);

  // 0: unlimited again.
  v1::SetVmPolicyRequest q;
  q.set_vm("g1");
  q.set_swap_quota_bytes(0);
  ASSERT_TRUE(SetPolicy(*admin_, q, &resp).ok());
  EXPECT_EQ(resp.policy().swap_quota_bytes(), 0u);
  EXPECT_EQ(policies_->Vm("g1")->policy.swap_quota_bytes, kUnlimitedQuota);
}

TEST_F(ControlServiceTest, BadSwapPolicyValuesNameTheirField) {
  for (uint64_t bytes : {(uint64_t{1} << 50) + 1, ~uint64_t{0}}) {
    v1::SetVmPolicyRequest req;
    req.set_vm("g1");
    req.set_swap_quota_bytes(bytes);
    const grpc::Status s = SetPolicy(*admin_, req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bytes;
    EXPECT_NE(s.error_message().find("swap_quota_bytes"), std::string::npos)
        << s.error_message();
  }
  v1::SetVmPolicyRequest mode;
  mode.set_vm("g1");
  mode.set_swap_mode(static_cast<v1::Mode>(42));
  mode.set_weight(7);  // a valid field in the same request is not applied
  const grpc::Status s = SetPolicy(*admin_, mode);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("swap_mode"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 100u);
  EXPECT_EQ(GetVm("g1").summary().policy().generation(), 0u);
  EXPECT_FALSE(policies_->Vm("g1").has_value());
}

// A whole policy set (what the fleet watcher applies): defaults overlaid by
// each VM's own fields, swap fields included, checked before anything
// applies.
TEST_F(ControlServiceTest, PolicySetCarriesTheSwapFields) {
  PolicySet set;
  set.vm_defaults.set_swap_quota_bytes(uint64_t{4} << 20);
  set.vm_defaults.set_swap_mode(v1::MODE_ALWAYS);
  set.vms["g2"].set_swap_mode(v1::MODE_OFF);
  EXPECT_EQ(set.ForVm("g2").swap_quota_bytes(), uint64_t{4} << 20);
  EXPECT_EQ(set.ForVm("g2").swap_mode(), v1::MODE_OFF);
  ASSERT_TRUE(control_->ApplyPolicySet(set).ok());
  EXPECT_EQ(policies_->Vm("g1")->policy.swap_quota_bytes, uint64_t{4} << 20);
  EXPECT_EQ(policies_->Vm("g1")->policy.swap_mode, ValveMode::kAlways);
  EXPECT_EQ(policies_->Vm("g2")->policy.swap_mode, ValveMode::kOff);
  EXPECT_EQ(GetVm("g2").summary().policy().swap_mode(), v1::MODE_OFF);

  PolicySet bad;
  bad.vms["g1"].set_swap_quota_bytes(~uint64_t{0});
  const absl::Status s = control_->ApplyPolicySet(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("swap_quota_bytes"), std::string::npos) << s;
  EXPECT_EQ(policies_->Vm("g1")->policy.swap_quota_bytes, uint64_t{4} << 20);
}

TEST_F(ControlServiceTest, StaleGenerationIsRejected) {
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_weight(200);
  req.set_generation(5);
  ASSERT_TRUE(SetPolicy(*admin_, req).ok());
  for (uint64_t stale : {uint64_t{5}, uint64_t{3}}) {
    req.set_generation(stale);
    req.set_weight(7);
    const grpc::Status s = SetPolicy(*admin_, req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("not newer"), std::string::npos)
        << s.error_message();
  }
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 200u);
  req.set_generation(0);  // "the next one"
  v1::SetVmPolicyResponse resp;
  ASSERT_TRUE(SetPolicy(*admin_, req, &resp).ok());
  EXPECT_EQ(resp.policy().generation(), 6u);
  // Per VM: g2 has its own generations.
  v1::SetVmPolicyRequest g2;
  g2.set_vm("g2");
  g2.set_generation(1);
  g2.set_weight(10);
  EXPECT_TRUE(SetPolicy(*admin_, g2).ok());

  v1::SetHostPolicyRequest h;
  h.set_cpu_budget_percent(40);
  h.set_generation(9);
  ASSERT_TRUE(SetHost(*admin_, h).ok());
  h.set_cpu_budget_percent(10);
  h.set_generation(8);
  EXPECT_EQ(SetHost(*admin_, h).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_DOUBLE_EQ(agent_->GetValveOptions().cpu_budget_percent, 40);
}

TEST_F(ControlServiceTest, SetHostPolicyAppliesCapBudgetAndMode) {
  PutPages("g1", 200);
  v1::SetHostPolicyRequest h;
  h.set_memory_cap_bytes(uint64_t{32} << 20);
  h.set_cpu_budget_percent(12.5);
  h.set_default_mode(v1::MODE_OFF);
  v1::SetHostPolicyResponse resp;
  ASSERT_TRUE(SetHost(*admin_, h, &resp).ok());
  EXPECT_EQ(resp.policy().memory_cap_bytes(), uint64_t{32} << 20);
  EXPECT_EQ(resp.policy().generation(), 1u);
  EXPECT_EQ(agent_->Status().store.memory_cap_bytes, uint64_t{32} << 20);
  EXPECT_DOUBLE_EQ(agent_->GetValveOptions().cpu_budget_percent, 12.5);
  EXPECT_EQ(agent_->GetValveOptions().default_mode, ValveMode::kOff);
  EXPECT_EQ(GetVm("g1").valve().effective_mode(), v1::MODE_OFF);
  // The cap now bounds quotas.
  v1::SetVmPolicyRequest q;
  q.set_vm("g1");
  q.set_quota_bytes(uint64_t{48} << 20);
  EXPECT_EQ(SetPolicy(*admin_, q).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ControlServiceTest, FreezeRefusesPutsButServesGets) {
  const PoolId pool = PutPages("g1", 4);
  grpc::ClientContext ctx;
  v1::VmRequest req;
  req.set_vm("g1");
  v1::SetVmPolicyResponse resp;
  ASSERT_TRUE(admin_->FreezeVm(&ctx, req, &resp).ok());
  EXPECT_TRUE(resp.policy().frozen());
  const VmId id = agent_->GetVm("g1")->stats.id;
  const test::Page page = test::TextPage(99);
  auto put =
      agent_->store().Put(id, pool, ObjectId::FromInode(2), 0, ConstPage(page));
  ASSERT_TRUE(put.ok());
  EXPECT_FALSE(put->stored);
  test::Page out{};
  auto get = agent_->store().Get(id, pool, ObjectId::FromInode(1), 0,
                                 MutablePage(out));
  ASSERT_TRUE(get.ok());
  EXPECT_TRUE(*get) << "a frozen VM still gets its pages back";
  EXPECT_EQ(GetVm("g1").summary().decision(), "frozen");
  grpc::ClientContext ctx2;
  ASSERT_TRUE(admin_->ThawVm(&ctx2, req, &resp).ok());
  EXPECT_FALSE(resp.policy().frozen());
  put =
      agent_->store().Put(id, pool, ObjectId::FromInode(2), 0, ConstPage(page));
  ASSERT_TRUE(put.ok());
  EXPECT_TRUE(put->stored);
}

TEST_F(ControlServiceTest, FlushDropsEveryPageOfTheVmOnly) {
  PutPages("g1", 30);
  PutPages("g2", 10);
  grpc::ClientContext ctx;
  v1::VmRequest req;
  req.set_vm("g1");
  v1::FlushVmResponse resp;
  ASSERT_TRUE(admin_->FlushVm(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.pages_dropped(), 30u);
  EXPECT_EQ(GetVm("g1").summary().pages(), 0u);
  EXPECT_EQ(GetVm("g2").summary().pages(), 10u);
  grpc::ClientContext ctx2;
  req.set_vm("nope");
  EXPECT_EQ(admin_->FlushVm(&ctx2, req, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

// A flush drops cached pages only: a persistent pool holds the VM's swap
// device's pages, which are its memory and must survive.
TEST_F(ControlServiceTest, FlushKeepsTheSwapDevicesPersistentPages) {
  PutPages("g1", 12);
  const PoolId swap_pool = PutPages("g1", 5, nullptr, PoolKind::kPersistent);
  grpc::ClientContext ctx;
  v1::VmRequest req;
  req.set_vm("g1");
  v1::FlushVmResponse resp;
  ASSERT_TRUE(admin_->FlushVm(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.pages_dropped(), 12u);
  EXPECT_EQ(GetVm("g1").summary().pages(), 5u);
  const VmId vm = agent_->GetVm("g1")->stats.id;
  for (int i = 0; i < 5; ++i) {
    test::Page out{};
    absl::StatusOr<bool> hit = agent_->store().Get(
        vm, swap_pool, ObjectId::FromInode(1), i, MutablePage(out));
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_TRUE(*hit) << i;
    EXPECT_EQ(out, test::TextPage(i + 1)) << i;
  }
}

TEST_F(ControlServiceTest, AuthorizeSharedPoolGrantsRevokesAndPersists) {
  const std::string uuid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
  absl::StatusOr<PoolUuid> parsed = ParsePoolUuid(uuid);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(FormatPoolUuid(*parsed), uuid);
  const VmId id = agent_->GetVm("g1")->stats.id;
  EXPECT_EQ(agent_->store().NewPool(id, &*parsed).status().code(),
            absl::StatusCode::kPermissionDenied);
  v1::AuthorizeSharedPoolRequest req;
  req.set_vm("g1");
  req.set_uuid(uuid);
  v1::AuthorizeSharedPoolResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->AuthorizeSharedPool(&ctx, req, &resp).ok());
  }
  EXPECT_TRUE(agent_->store().NewPool(id, &*parsed).ok());
  EXPECT_NE(ReadFile(dir_ + "/state.json").find(uuid), std::string::npos);
  req.set_uuid("not-a-uuid");
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(admin_->AuthorizeSharedPool(&ctx, req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  req.set_uuid(uuid);
  req.set_revoke(true);
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->AuthorizeSharedPool(&ctx, req, &resp).ok());
  }
  EXPECT_EQ(ReadFile(dir_ + "/state.json").find(uuid), std::string::npos);
}

TEST_F(ControlServiceTest, DomainsForwardToDomainControl) {
  v1::DomainRequest req;
  req.set_domain("web1");
  req.set_persistent(true);
  v1::DomainState st;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->AttachDomain(&ctx, req, &st).ok());
    EXPECT_TRUE(st.attached());
    EXPECT_TRUE(st.persistent());
  }
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->DetachDomain(&ctx, req, &st).ok());
    EXPECT_FALSE(st.attached());
  }
  {
    grpc::ClientContext ctx;
    v1::ListDomainsResponse list;
    ASSERT_TRUE(
        admin_->ListDomains(&ctx, v1::ListDomainsRequest(), &list).ok());
    EXPECT_EQ(list.domains_size(), 1);
  }
  req.set_domain("missing");
  grpc::ClientContext ctx;
  EXPECT_EQ(admin_->AttachDomain(&ctx, req, &st).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ControlServiceTest, SwapAttachAndDetachForwardWithTheirSize) {
  v1::DomainRequest req;
  req.set_domain("web1");
  req.set_swap(true);
  req.set_swap_size_bytes(64 << 20);
  v1::DomainState st;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->AttachDomain(&ctx, req, &st).ok());
    EXPECT_EQ(st.detail(), "swap 67108864 bytes");
  }
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->DetachDomain(&ctx, req, &st).ok());
    EXPECT_EQ(st.detail(), "swap removed");
  }
  // A size without swap, or swap without a size: refused, naming the field.
  for (bool swap : {false, true}) {
    req.set_swap(swap);
    req.set_swap_size_bytes(swap ? 0 : 4096);
    grpc::ClientContext ctx;
    const grpc::Status s = admin_->AttachDomain(&ctx, req, &st);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << swap;
    EXPECT_NE(s.error_message().find("swap_size_bytes"), std::string::npos);
  }
}

TEST_F(ControlServiceTest, LibvirtHookForwardsAndRefusesUnknownOperations) {
  v1::LibvirtHookRequest req;
  req.set_operation("prepare");
  req.set_domain_xml("<domain/>");
  v1::DomainState st;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->LibvirtHook(&ctx, req, &st).ok());
    EXPECT_EQ(st.detail(), "prepared 9 bytes");
  }
  {
    req.set_operation("release");
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->LibvirtHook(&ctx, req, &st).ok());
    EXPECT_EQ(st.detail(), "released");
  }
  {
    // migrate: the domain's verdict, refused with its reason.
    req.set_operation("migrate");
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->LibvirtHook(&ctx, req, &st).ok());
    EXPECT_EQ(st.detail(), "migratable");
    req.set_domain_xml("<domain><x path='/run/tmemd/a.swap.sock'/></domain>");
    grpc::ClientContext ctx2;
    const grpc::Status s = admin_->LibvirtHook(&ctx2, req, &st);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("swap device"), std::string::npos);
    req.set_domain_xml("<domain/>");
  }
  {
    req.set_operation("started");
    grpc::ClientContext ctx;
    const grpc::Status s = admin_->LibvirtHook(&ctx, req, &st);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("operation"), std::string::npos);
  }
  {
    req.set_operation("prepare");
    req.clear_domain_xml();
    grpc::ClientContext ctx;
    const grpc::Status s = admin_->LibvirtHook(&ctx, req, &st);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("domain_xml"), std::string::npos);
  }
}

TEST_F(ControlServiceTest, WithoutLibvirtDomainsAreFailedPrecondition) {
  StopAll();
  StartAll(/*with_domains=*/false);
  v1::DomainRequest req;
  req.set_domain("web1");
  v1::DomainState st;
  grpc::ClientContext ctx;
  const grpc::Status s = admin_->AttachDomain(&ctx, req, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("--libvirt-uri"), std::string::npos);
}

TEST_F(ControlServiceTest, WatchStatsStreamsAtTheRequestedInterval) {
  PutPages("g2", 5);
  grpc::ClientContext ctx;
  v1::WatchStatsRequest req;
  req.set_interval_ms(100);
  req.add_vms("g2");
  auto reader = readonly_->WatchStats(&ctx, req);  // read-only may watch
  v1::StatsSample sample;
  std::vector<int64_t> stamps;
  while (stamps.size() < 3 && reader->Read(&sample)) {
    stamps.push_back(sample.timestamp_unix_ms());
    ASSERT_EQ(sample.vms_size(), 1);
    EXPECT_EQ(sample.vms(0).summary().name(), "g2");
    EXPECT_EQ(sample.vms(0).summary().pages(), 5u);
  }
  ASSERT_EQ(stamps.size(), 3u);
  EXPECT_GE(stamps[2] - stamps[0], 180);  // two intervals of 100 ms
  ctx.TryCancel();
  reader->Finish();

  for (auto [interval, vm, code] :
       {std::tuple{50u, "g1", grpc::StatusCode::INVALID_ARGUMENT},
        std::tuple{100u, "nope", grpc::StatusCode::NOT_FOUND}}) {
    grpc::ClientContext c;
    v1::WatchStatsRequest r;
    r.set_interval_ms(interval);
    r.add_vms(vm);
    auto bad = admin_->WatchStats(&c, r);
    while (bad->Read(&sample)) {
    }
    EXPECT_EQ(bad->Finish().error_code(), code);
  }
}

TEST_F(ControlServiceTest, ShutdownEndsOpenWatchStreams) {
  grpc::ClientContext ctx;
  v1::WatchStatsRequest req;
  req.set_interval_ms(60000);
  auto reader = admin_->WatchStats(&ctx, req);
  v1::StatsSample sample;
  ASSERT_TRUE(reader->Read(&sample));
  const auto t0 = std::chrono::steady_clock::now();
  server_->Shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  while (reader->Read(&sample)) {
  }
  reader->Finish();
}

// 10 connections x 100 streams on the world-accessible socket must not
// make a thread each: streams are bounded per listener; a refused one says
// why; a cancelled one frees its slot within its cancel check, not at the
// end of its (here 60 s) interval.
TEST_F(ControlServiceTest, WatchStreamsPerSocketAreBoundedAndFreedOnCancel) {
  v1::WatchStatsRequest req;
  req.set_interval_ms(60000);
  v1::StatsSample sample;
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::StatsSample>>> readers;
  for (int i = 0; i < kMaxWatchStreams; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    readers.push_back(readonly_->WatchStats(ctxs.back().get(), req));
    ASSERT_TRUE(readers.back()->Read(&sample)) << "stream " << i;
  }
  EXPECT_EQ(server_->active_streams(), kMaxWatchStreams);
  {
    grpc::ClientContext c;
    auto extra = readonly_->WatchStats(&c, req);
    EXPECT_FALSE(extra->Read(&sample));
    const grpc::Status st = extra->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(st.error_message().find("too many WatchStats streams"),
              std::string::npos)
        << st.error_message();
  }
  EXPECT_EQ(server_->streams_refused(), 1u);
  // The admin socket is another listener: not starved by the read-only one.
  {
    grpc::ClientContext c;
    auto admin_watch = admin_->WatchStats(&c, req);
    EXPECT_TRUE(admin_watch->Read(&sample));
    c.TryCancel();
    admin_watch->Finish();
  }
  // Cancel one: its slot is free again well before its 60 s interval ends.
  const auto t0 = std::chrono::steady_clock::now();
  ctxs[0]->TryCancel();
  readers[0]->Finish();
  while (server_->active_streams() >= kMaxWatchStreams &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  grpc::ClientContext again;
  auto reader = readonly_->WatchStats(&again, req);
  EXPECT_TRUE(reader->Read(&sample));
  again.TryCancel();
  reader->Finish();
  for (size_t i = 1; i < ctxs.size(); ++i) {
    ctxs[i]->TryCancel();
    readers[i]->Finish();
  }
}

TEST_F(ControlServiceTest, OversizedRequestIsRefused) {
  grpc::ClientContext ctx;
  v1::GetVmRequest req;
  req.set_vm(std::string(300 << 10, 'x'));  // 300 KiB > 256 KiB
  v1::VmDetail detail;
  const grpc::Status st = readonly_->GetVm(&ctx, req, &detail);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << st.error_message();
}

// libvirt's qemu hook sends a whole domain XML, which libvirt allows up to
// 4 MiB: the admin socket takes it (here tmemd has no libvirt, so the
// answer is about that, not the size); the limit still holds above it.
TEST_F(ControlServiceTest, AdminSocketTakesADomainXmlUpToLibvirtsLimit) {
  v1::LibvirtHookRequest req;
  req.set_operation("prepare");
  req.set_domain_xml(std::string(1 << 20, 'x'));  // 1 MiB > 256 KiB
  v1::DomainState st;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = admin_->LibvirtHook(&ctx, req, &st);
    EXPECT_NE(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << s.error_message();
  }
  req.set_domain_xml(std::string(5 << 20, 'x'));  // 5 MiB > libvirt's 4 MiB
  grpc::ClientContext ctx;
  const grpc::Status s = admin_->LibvirtHook(&ctx, req, &st);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
}

TEST_F(ControlServiceTest, ReadOnlySocketRefusesEveryWrite) {
  struct stat st {};
  ASSERT_EQ(stat((dir_ + "/control.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat((dir_ + "/control-ro.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u);
  {
    grpc::ClientContext ctx;
    v1::HostStatus hs;
    EXPECT_TRUE(readonly_->Status(&ctx, v1::StatusRequest(), &hs).ok());
  }
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_weight(500);
  grpc::Status s = SetPolicy(*readonly_, req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(s.error_message().find("read-only"), std::string::npos);
  v1::SetHostPolicyRequest h;
  h.set_cpu_budget_percent(50);
  EXPECT_EQ(SetHost(*readonly_, h).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::VmRequest vm;
  vm.set_vm("g1");
  v1::SetVmPolicyResponse pr;
  v1::FlushVmResponse fr;
  v1::DomainRequest dr;
  dr.set_domain("web1");
  v1::DomainState ds;
  v1::LibvirtHookRequest hr;
  hr.set_operation("prepare");
  hr.set_domain_xml("<domain/>");
  v1::AuthorizeSharedPoolRequest ar;
  ar.set_vm("g1");
  ar.set_uuid("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0");
  v1::AuthorizeSharedPoolResponse ap;
  v1::AddSwapDeviceRequest sr;
  sr.set_vm("g1");
  sr.set_size_bytes(1 << 20);
  v1::SwapDevice sd;
  v1::RemoveSwapDeviceResponse rs;
  std::vector<std::function<grpc::Status(grpc::ClientContext*)>> writes = {
      [&](auto* c) { return readonly_->FreezeVm(c, vm, &pr); },
      [&](auto* c) { return readonly_->ThawVm(c, vm, &pr); },
      [&](auto* c) { return readonly_->FlushVm(c, vm, &fr); },
      [&](auto* c) { return readonly_->AttachDomain(c, dr, &ds); },
      [&](auto* c) { return readonly_->DetachDomain(c, dr, &ds); },
      [&](auto* c) { return readonly_->LibvirtHook(c, hr, &ds); },
      [&](auto* c) { return readonly_->AuthorizeSharedPool(c, ar, &ap); },
      [&](auto* c) { return readonly_->AddSwapDevice(c, sr, &sd); },
      [&](auto* c) { return readonly_->RemoveSwapDevice(c, vm, &rs); },
  };
  for (auto& w : writes) {
    grpc::ClientContext ctx;
    EXPECT_EQ(w(&ctx).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 100u);
  EXPECT_FALSE(agent_->GetVmPolicy("g1")->frozen);
  EXPECT_FALSE(agent_->GetVm("g1")->swap.has_value());
}

// A VM's swap device over the admin socket: added beside its channel (one
// VM), shown in ListVms/GetVm, refused twice or with a bad size, removed.
TEST_F(ControlServiceTest, SwapDeviceAddedShownAndRemoved) {
  v1::AddSwapDeviceRequest req;
  req.set_vm("g1");
  req.set_size_bytes(4 << 20);
  v1::SwapDevice dev;
  {
    grpc::ClientContext ctx;
    grpc::Status s = admin_->AddSwapDevice(&ctx, req, &dev);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(dev.socket_path(), dir_ + "/g1.swap.sock");
  EXPECT_EQ(dev.size_bytes(), 4u << 20);
  EXPECT_FALSE(dev.connected());
  EXPECT_GT(dev.counters_size(), 0);
  {
    grpc::ClientContext ctx;
    v1::ListVmsResponse list;
    ASSERT_TRUE(admin_->ListVms(&ctx, v1::ListVmsRequest(), &list).ok());
    ASSERT_EQ(list.vms_size(), 2) << "the device joins g1, no new VM";
    for (const v1::VmSummary& v : list.vms()) {
      EXPECT_TRUE(v.has_channel());
      EXPECT_EQ(v.has_swap(), v.name() == "g1") << v.name();
    }
  }
  {
    grpc::ClientContext ctx;
    grpc::Status s = admin_->AddSwapDevice(&ctx, req, &dev);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  }
  for (uint64_t bad : {uint64_t{0}, uint64_t{4097}}) {
    v1::AddSwapDeviceRequest b;
    b.set_vm("g2");
    b.set_size_bytes(bad);
    grpc::ClientContext ctx;
    EXPECT_EQ(admin_->AddSwapDevice(&ctx, b, &dev).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << bad;
  }
  v1::VmRequest vm;
  vm.set_vm("g1");
  v1::RemoveSwapDeviceResponse rr;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->RemoveSwapDevice(&ctx, vm, &rr).ok());
  }
  EXPECT_FALSE(agent_->GetVm("g1")->swap.has_value());
  EXPECT_TRUE(agent_->GetVm("g1")->has_channel);
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(admin_->RemoveSwapDevice(&ctx, vm, &rr).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(ControlServiceTest, MutualTlsAdminByCertificateName) {
  auto admin = TlsStub(certs_->admin_cert, certs_->admin_key);
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_weight(321);
  grpc::Status s = SetPolicy(*admin, req);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 321u);

  auto monitor = TlsStub(certs_->monitor_cert, certs_->monitor_key);
  {
    grpc::ClientContext ctx;
    v1::HostStatus hs;
    EXPECT_TRUE(monitor->Status(&ctx, v1::StatusRequest(), &hs).ok());
  }
  req.set_weight(1);
  s = SetPolicy(*monitor, req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(s.error_message().find("'monitor'"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 321u);

  // No client certificate, or one from a CA the server does not trust: the
  // handshake fails, no RPC runs.
  for (auto& stub :
       {TlsStub("", ""), TlsStub(certs_->rogue_cert, certs_->rogue_key)}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    v1::HostStatus hs;
    s = stub->Status(&ctx, v1::StatusRequest(), &hs);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << s.error_message();
  }
}

// grpc.health.v1 and server reflection answer (through the generic stub:
// their generated stubs are not part of Debian's packages).
TEST_F(ControlServiceTest, HealthCheckingAndReflectionAreOn) {
  auto channel = grpc::CreateChannel("unix:" + dir_ + "/control-ro.sock",
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  // HealthCheckRequest{service: ""} is the empty message.
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                    &request, &response,
                    [&done](const grpc::Status& s) { done.set_value(s); });
  const grpc::Status s = done.get_future().get();
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const auto& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  EXPECT_EQ(bytes, std::string("\x08\x01", 2)) << "status: SERVING";

  // ServerReflectionRequest{list_services: ""} (field 7).
  grpc::CompletionQueue cq;
  grpc::ClientContext rctx;
  auto call = generic.PrepareCall(
      &rctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  grpc::Slice list_services(std::string("\x3a\x00", 2));
  grpc::ByteBuffer rreq(&list_services, 1);
  call->Write(rreq, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  grpc::ByteBuffer rresp;
  call->Read(&rresp, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  slices.clear();
  ASSERT_TRUE(rresp.Dump(&slices).ok());
  bytes.clear();
  for (const auto& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  EXPECT_NE(bytes.find("tmem.v1.TmemControl"), std::string::npos);
  rctx.TryCancel();
  grpc::Status fin;
  call->Finish(&fin, reinterpret_cast<void*>(4));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_F(ControlServiceTest, PoliciesSurviveARestart) {
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_weight(777);
  req.set_frozen(true);
  req.set_generation(12);
  ASSERT_TRUE(SetPolicy(*admin_, req).ok());
  v1::SetHostPolicyRequest h;
  h.set_memory_cap_bytes(uint64_t{48} << 20);
  h.set_generation(3);
  ASSERT_TRUE(SetHost(*admin_, h).ok());
  StopAll();
  StartAll(true);  // same state file
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 777u);
  EXPECT_TRUE(agent_->GetVmPolicy("g1")->frozen);
  EXPECT_EQ(agent_->GetVmPolicy("g2")->weight, 100u);
  EXPECT_EQ(agent_->Status().store.memory_cap_bytes, uint64_t{48} << 20);
  // Generations survive too.
  req.set_generation(11);
  EXPECT_EQ(SetPolicy(*admin_, req).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(GetVm("g1").summary().policy().generation(), 12u);
}

TEST_F(ControlServiceTest, AVmAddedAgainGetsItsPushedPolicyBack) {
  v1::SetVmPolicyRequest req;
  req.set_vm("g1");
  req.set_weight(555);
  req.set_mode(v1::MODE_OFF);
  ASSERT_TRUE(SetPolicy(*admin_, req).ok());
  ASSERT_TRUE(agent_->RemoveVm("g1").ok());
  VmPolicy configured;
  configured.weight = 1;
  ASSERT_TRUE(agent_->AddVm("g1", configured).ok());
  EXPECT_EQ(agent_->GetVmPolicy("g1")->weight, 555u);
  const v1::VmDetail d = GetVm("g1");
  EXPECT_EQ(d.summary().policy().mode(), v1::MODE_OFF);
  EXPECT_EQ(d.valve().effective_mode(), v1::MODE_OFF);
  // A VM nobody pushed a policy for keeps its configured one.
  ASSERT_TRUE(agent_->AddVm("g3", configured).ok());
  EXPECT_EQ(agent_->GetVmPolicy("g3")->weight, 1u);
}

}  // namespace
}  // namespace tmem
