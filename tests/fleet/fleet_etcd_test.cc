// Fleet policy against a real etcd (issue 19): a 3-member etcd cluster on
// loopback ports started from the Debian package's binary, real tmemd
// processes with [fleet] configured, and tmemctl fleet. Skipped (with the
// reason) only when /usr/bin/etcd is missing; scripts/install-deps.sh
// installs it, so CI runs these.
//
// Every wait is a poll with a deadline; no sleep decides an assertion.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "host-agent/fleet/etcd_client.h"
#include "host-agent/fleet/fleet_policy.h"
#include "host-agent/tmemctl/fleet_commands.h"
#include "tests/control/test_util.h"
#include "tests/process.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using nlohmann::json;
using testing::PathExists;
using testing::Process;
using testing::RunResult;
using testing::TempDir;
using testing::WaitUntil;

constexpr char kEtcd[] = "/usr/bin/etcd";
constexpr char kEtcdctl[] = "/usr/bin/etcdctl";
// Deadlines for a loaded 2-core machine under sanitizers, not targets.
constexpr int kConvergeMs = 60000;

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

class FleetEtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef TMEM_TSAN_SKIP_GRPC
    GTEST_SKIP() << "skipped under TSan: Debian's gRPC is not TSan-"
                    "instrumented, so the etcd client's RPC traffic reports "
                    "races inside gRPC (as tests/control); runs in release "
                    "and ASan";
#endif
    if (!PathExists(kEtcd)) {
      GTEST_SKIP() << kEtcd
                   << " is missing: install etcd-server "
                      "(scripts/install-deps.sh does)";
    }
    ASSERT_FALSE(dir_.path().empty());
    for (int i = 0; i < 3; ++i) {
      client_ports_.push_back(FreePort());
      peer_ports_.push_back(FreePort());
    }
    for (int i = 0; i < 3; ++i) StartMember(i);
    EtcdOptions eo;
    eo.endpoints = Endpoints();
    absl::StatusOr<std::unique_ptr<EtcdClient>> c = EtcdClient::Create(eo);
    ASSERT_TRUE(c.ok());
    etcd_ = std::move(*c);
    ASSERT_TRUE(WaitUntil([&] { return EtcdAnswers(); }, 30000))
        << members_[0]->Log();
  }

  std::vector<std::string> Endpoints() const {
    std::vector<std::string> e;
    for (int p : client_ports_) e.push_back(absl::StrCat("127.0.0.1:", p));
    return e;
  }
  std::string EndpointList() const { return absl::StrJoin(Endpoints(), ","); }

  void StartMember(int i) {
    std::vector<std::string> cluster;
    for (int j = 0; j < 3; ++j) {
      cluster.push_back(
          absl::StrCat("m", j, "=http://127.0.0.1:", peer_ports_[j]));
    }
    const std::string client =
        absl::StrCat("http://127.0.0.1:", client_ports_[i]);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports_[i]);
    std::vector<std::string> argv = {
        kEtcd, "--name", absl::StrCat("m", i), "--data-dir",
        absl::StrCat(dir_.path(), "/etcd", i), "--listen-client-urls", client,
        "--advertise-client-urls", client, "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer, "--initial-cluster",
        absl::StrJoin(cluster, ","), "--initial-cluster-token",
        "tmemd-fleet-test", "--initial-cluster-state", "new",
        // A loaded 2-core machine: slower heartbeats than the default, so
        // a busy moment does not start elections.
        "--heartbeat-interval", "200", "--election-timeout", "2000",
        "--log-level", "warn"};
    if (members_.size() <= static_cast<size_t>(i)) members_.resize(i + 1);
    members_[i] = std::make_unique<Process>(
        argv, absl::StrCat(dir_.path(), "/etcd", i, "-", ++runs_, ".log"));
  }

  bool EtcdAnswers() {
    etcdserverpb::RangeRequest r;
    r.set_key("/health-probe");
    for (size_t i = 0; i < 3; ++i) {
      if (etcd_->Range(r).ok()) return true;
      etcd_->Rotate();
    }
    return false;
  }

  // One tmemd with [fleet], host name h<i>, group odd/even.
  void StartTmemd(int i) {
    const std::string d = absl::StrCat(dir_.path(), "/h", i);
    std::filesystem::create_directories(d);
    std::vector<std::string> quoted;
    for (const std::string& e : Endpoints()) quoted.push_back("\"" + e + "\"");
    std::ofstream(d + "/tmemd.toml")
        << "[channels]\nsocket_dir = \"" << d << "\"\n"
        << "[control]\nstate_file = \"" << d << "/state.json\"\n"
        << "[fleet]\nendpoints = [" << absl::StrJoin(quoted, ", ") << "]\n"
        << "host = \"h" << i << "\"\n"
        << "groups = [\"" << (i % 2 ? "odd" : "even") << "\"]\n"
        << "lease_ttl_seconds = 3\n";
    if (tmemds_.size() <= static_cast<size_t>(i)) tmemds_.resize(i + 1);
    tmemds_[i].reset();
    tmemds_[i] = std::make_unique<Process>(
        std::vector<std::string>{TMEMD_BIN, "-c", d + "/tmemd.toml",
                                 "--workers", "1"},
        absl::StrCat(d, "/tmemd-", ++runs_, ".log"));
    Process& p = *tmemds_[i];
    ASSERT_TRUE(WaitUntil(
        [&] {
          return p.Log().find("event=fleet_ready") != std::string::npos ||
                 !p.Running();
        },
        30000))
        << p.Log();
    ASSERT_TRUE(p.Running()) << p.Log();
  }

  RunResult Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {TMEMCTL_BIN, "fleet", "--etcd",
                                     EndpointList()};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::Run(
        argv, absl::StrCat(dir_.path(), "/tmemctl-", ++runs_, ".out"));
  }
  RunResult Apply(const std::string& policy_json) {
    const std::string f =
        absl::StrCat(dir_.path(), "/policy-", ++runs_, ".json");
    std::ofstream(f) << policy_json;
    return Ctl({"apply", f});
  }
  // The revision tmemctl reported ("applied at revision N").
  static int64_t AppliedRevision(const RunResult& r) {
    const size_t at = r.output.find("applied at revision ");
    if (at == std::string::npos) return -1;
    return std::stoll(r.output.substr(at + 20));
  }
  // Host h<i>'s own view, over its control socket.
  json HostStatus(int i) {
    RunResult r = testing::Run(
        {TMEMCTL_BIN, "-s", absl::StrCat(dir_.path(), "/h", i, "/control.sock"),
         "-o", "json", "status"},
        absl::StrCat(dir_.path(), "/status-", ++runs_, ".out"));
    if (r.code != 0) return {};
    return json::parse(r.output, nullptr, false);
  }
  double CpuBudget(int i) {
    json s = HostStatus(i);
    if (!s.is_object()) return -1;
    return s.value("cpu_budget_percent", -1.0);
  }
  // tmemctl fleet status --json, with its exit code.
  json FleetStatus(int* code) {
    RunResult r = Ctl({"status", "--json"});
    *code = r.code;
    return json::parse(r.output, nullptr, false);
  }
  std::string HostState(const json& status, const std::string& host) {
    if (!status.is_object()) return "";
    for (const json& h : status["hosts"]) {
      if (h["host"] == host) return h["state"].get<std::string>();
    }
    return "absent";
  }
  bool AllConverged() {
    int code = -1;
    (void)FleetStatus(&code);
    return code == 0;
  }

  TempDir dir_{"tmemd-fleet"};
  std::vector<int> client_ports_;
  std::vector<int> peer_ports_;
  std::vector<std::unique_ptr<Process>> members_;
  std::vector<std::unique_ptr<Process>> tmemds_;
  std::unique_ptr<EtcdClient> etcd_;
  int runs_ = 0;
};

constexpr char kPolicyA[] = R"({
  "fleet": {"host": {"cpu_budget_percent": 40, "mode": "always"}},
  "groups": {"odd": {"host": {"cpu_budget_percent": 30}}},
  "hosts": {"h2": {"host": {"mode": "off"}}}
})";

TEST_F(FleetEtcdTest, TenHostsConvergeWithLayersAndRollBack) {
  constexpr int kHosts = 10;
  for (int i = 0; i < kHosts; ++i) StartTmemd(i);
  // Before any apply: every host registered and reporting, none converged
  // to anything yet is still "converged" on the empty policy.
  ASSERT_TRUE(WaitUntil(
      [&] {
        int code = -1;
        json s = FleetStatus(&code);
        return s.is_object() && s["hosts"].size() == kHosts;
      },
      kConvergeMs));

  // --dry-run prints the diff and writes nothing.
  const std::string f = dir_.path() + "/a.json";
  std::ofstream(f) << kPolicyA;
  RunResult dry = Ctl({"apply", f, "--dry-run"});
  ASSERT_EQ(dry.code, 0) << dry.output;
  EXPECT_NE(dry.output.find("+ /tmemd/v1/policy/groups/odd"), std::string::npos)
      << dry.output;
  EXPECT_NE(dry.output.find("dry run: nothing written"), std::string::npos);
  etcdserverpb::RangeRequest probe;
  probe.set_key(kFleetAppliedKey);
  absl::StatusOr<etcdserverpb::RangeResponse> none = etcd_->Range(probe);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->kvs_size(), 0);

  RunResult a = Ctl({"apply", f});
  ASSERT_EQ(a.code, 0) << a.output;
  const int64_t rev_a = AppliedRevision(a);
  ASSERT_GT(rev_a, 0) << a.output;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << Ctl({"status"}).output;
  // Most specific wins, as each tmemd reports it and as it enforces it.
  for (int i = 0; i < kHosts; ++i) {
    EXPECT_DOUBLE_EQ(CpuBudget(i), i % 2 ? 30 : 40) << "h" << i;
  }
  int code = -1;
  json st = FleetStatus(&code);
  for (const json& h : st["hosts"]) {
    EXPECT_EQ(h["mode"], h["host"] == "h2" ? "off" : "always") << h.dump();
    EXPECT_GE(h["applied_revision"].get<int64_t>(), rev_a);
  }

  // A second apply; then roll back to the first.
  RunResult b = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 55}}})");
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("- /tmemd/v1/policy/groups/odd"), std::string::npos);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));
  for (int i = 0; i < kHosts; ++i) EXPECT_DOUBLE_EQ(CpuBudget(i), 55);
  RunResult hist = Ctl({"history"});
  ASSERT_EQ(hist.code, 0);
  EXPECT_NE(hist.output.find(absl::StrCat("revision ", rev_a)),
            std::string::npos)
      << hist.output;
  RunResult rb = Ctl({"rollback", std::to_string(rev_a)});
  ASSERT_EQ(rb.code, 0) << rb.output;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));
  for (int i = 0; i < kHosts; ++i) {
    EXPECT_DOUBLE_EQ(CpuBudget(i), i % 2 ? 30 : 40) << "h" << i;
  }
}

TEST_F(FleetEtcdTest, RestartedHostResumesAndDownHostCatchesUp) {
  StartTmemd(0);
  StartTmemd(1);
  RunResult a = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 20}}})");
  ASSERT_EQ(a.code, 0) << a.output;
  const int64_t rev_a = AppliedRevision(a);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));

  // h1 stops cleanly: its lease is revoked, fleet status says gone.
  ASSERT_EQ(tmemds_[1]->Stop(), 0);
  ASSERT_TRUE(WaitUntil(
      [&] {
        int code = -1;
        json s = FleetStatus(&code);
        return HostState(s, "h1") == "gone" && code == kFleetNotConverged;
      },
      kConvergeMs));

  // Applied while h1 is down.
  RunResult b = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 35}}})");
  ASSERT_EQ(b.code, 0) << b.output;
  const int64_t rev_b = AppliedRevision(b);
  ASSERT_GT(rev_b, rev_a);

  // Back up: it enforces its saved policy at once, resumes watching after
  // the revision it had seen (no full read), and catches up.
  StartTmemd(1);
  const std::string log = tmemds_[1]->Log();
  EXPECT_NE(log.find("event=fleet_state_loaded"), std::string::npos) << log;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << tmemds_[1]->Log();
  EXPECT_DOUBLE_EQ(CpuBudget(1), 35);
  const std::string log2 = tmemds_[1]->Log();
  EXPECT_EQ(log2.find("event=fleet_full_read"), std::string::npos) << log2;
  EXPECT_NE(log2.find("event=fleet_watch"), std::string::npos);

  // Down again; two more applies, then etcd compacts the revisions h1 would
  // resume from: it re-reads everything and converges.
  ASSERT_EQ(tmemds_[1]->Stop(), 0);
  ASSERT_EQ(Apply(R"({"fleet": {"host": {"cpu_budget_percent": 45}}})").code,
            0);
  RunResult d = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 46}}})");
  ASSERT_EQ(d.code, 0);
  if (PathExists(kEtcdctl)) {
    RunResult c = testing::Run({kEtcdctl, "--endpoints", EndpointList(),
                                "compact", std::to_string(AppliedRevision(d))},
                               dir_.path() + "/compact.out");
    ASSERT_EQ(c.code, 0) << c.output;
  }
  StartTmemd(1);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << tmemds_[1]->Log();
  EXPECT_DOUBLE_EQ(CpuBudget(1), 46);
  if (PathExists(kEtcdctl)) {
    EXPECT_NE(tmemds_[1]->Log().find("event=fleet_watch_compacted"),
              std::string::npos)
        << tmemds_[1]->Log();
  }
}

TEST_F(FleetEtcdTest, InvalidPolicyIsRejectedWithItsReasonAndNotApplied) {
  StartTmemd(0);
  StartTmemd(1);
  ASSERT_EQ(Apply(R"({"fleet": {"host": {"cpu_budget_percent": 25}}})").code,
            0);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));

  // tmemctl refuses it before writing anything.
  RunResult bad = Apply(R"({"groups": {"odd": {"vm": {"weight": 0}}}})");
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_NE(bad.output.find("weight must be in"), std::string::npos)
      << bad.output;

  // Written past tmemctl (etcdctl, another tool): the odd group's host
  // refuses the whole revision -- the valid budget beside it included --
  // and says why; the even host applies it.
  etcdserverpb::TxnRequest txn;
  auto put = [&](const std::string& k, const std::string& v) {
    etcdserverpb::PutRequest* p = txn.add_success()->mutable_request_put();
    p->set_key(absl::StrCat(kFleetPolicyPrefix, k));
    p->set_value(v);
  };
  put("fleet", R"({"version":1,"host":{"cpu_budget_percent":60}})");
  put("groups/odd", R"({"version":1,"host":{"cpu_budget_percent":101}})");
  ASSERT_TRUE(etcd_->Txn(txn).ok());
  int code = -1;
  ASSERT_TRUE(WaitUntil(
      [&] {
        json s = FleetStatus(&code);
        return HostState(s, "h1") == "rejected" &&
               HostState(s, "h0") == "converged";
      },
      kConvergeMs));
  json s = FleetStatus(&code);
  EXPECT_EQ(code, kFleetNotConverged);
  for (const json& h : s["hosts"]) {
    if (h["host"] == "h1") {
      EXPECT_NE(h["reason"].get<std::string>().find(
                    "groups/odd: host.cpu_budget_percent"),
                std::string::npos)
          << h.dump();
    }
  }
  EXPECT_DOUBLE_EQ(CpuBudget(0), 60);
  EXPECT_DOUBLE_EQ(CpuBudget(1), 25);  // nothing of the revision applied
  RunResult table = Ctl({"status"});
  EXPECT_EQ(table.code, kFleetNotConverged);
  EXPECT_NE(table.output.find("rejected"), std::string::npos) << table.output;

  // Fixed: everyone converges.
  ASSERT_EQ(Apply(R"({"fleet": {"host": {"cpu_budget_percent": 60}}})").code,
            0);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));
  EXPECT_DOUBLE_EQ(CpuBudget(1), 60);
}

TEST_F(FleetEtcdTest, EtcdMemberKilledThenWholeClusterDownAndBack) {
  for (int i = 0; i < 3; ++i) StartTmemd(i);
  ASSERT_EQ(Apply(R"({"fleet": {"host": {"cpu_budget_percent": 21}}})").code,
            0);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));
  // Member 0 is every tmemd's first endpoint: they must move on.
  ASSERT_EQ(kill(members_[0]->pid(), SIGKILL), 0);
  members_[0]->Wait();
  RunResult a;
  ASSERT_TRUE(WaitUntil(
      [&] {
        a = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 22}}})");
        return a.code == 0;
      },
      kConvergeMs))
      << a.output;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << Ctl({"status"}).output;
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(CpuBudget(i), 22);
  // Back, and then another member goes.
  StartMember(0);
  ASSERT_EQ(kill(members_[1]->pid(), SIGKILL), 0);
  members_[1]->Wait();
  ASSERT_TRUE(WaitUntil(
      [&] {
        a = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 23}}})");
        return a.code == 0;
      },
      kConvergeMs))
      << a.output;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << Ctl({"status"}).output;
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(CpuBudget(i), 23);

  // The whole cluster stops: the hosts keep serving and enforcing what they
  // applied; when it returns they catch up with the next apply.
  for (auto& m : members_) {
    if (m->Running()) {
      kill(m->pid(), SIGKILL);
      m->Wait();
    }
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(tmemds_[i]->Running()) << tmemds_[i]->Log();
    EXPECT_DOUBLE_EQ(CpuBudget(i), 23);
  }
  for (int i = 0; i < 3; ++i) StartMember(i);
  ASSERT_TRUE(WaitUntil(
      [&] {
        a = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 24}}})");
        return a.code == 0;
      },
      kConvergeMs))
      << a.output;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << Ctl({"status"}).output;
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(CpuBudget(i), 24);
}

}  // namespace
}  // namespace tmem
