// Fleet policy against a real etcd: a 3-member etcd cluster on
// loopback ports started from the Debian package's binary, real tmemd
// processes with [fleet] configured, and tmemctl fleet. Skipped (with the
// reason) only when /usr/bin/etcd is missing; scripts/install-deps.sh
// installs it, so CI runs these.
//
// Every wait is a poll with a deadline; no sleep decides an assertion.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "host-agent/fleet/etcd_client.h"
#include "host-agent/fleet/fleet_policy.h"
#include "host-agent/tmemctl/fleet_commands.h"
#include "tests/control/test_util.h"
#include "tests/fleet/etcd_cluster.h"
#include "tests/process.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using nlohmann::json;
using testing::EtcdCerts;
using testing::EtcdCluster;
using testing::kEtcdBinary;
using testing::kEtcdctlBinary;
using testing::MakeEtcdCerts;
using testing::PathExists;
using testing::Process;
using testing::RunResult;
using testing::TempDir;
using testing::WaitUntil;

// Deadlines for a loaded 2-core machine under sanitizers, not targets.
constexpr int kConvergeMs = 60000;

// How a tmemd talks to etcd.
enum class AgentTls {
  kNone,    // plaintext
  kValid,   // CA + client certificate etcd trusts
  kCaOnly,  // CA, no client certificate
  kRogue,   // CA + a client certificate from a CA etcd does not trust
};

class FleetEtcdTest : public ::testing::Test {
 protected:
  virtual bool UseTls() const { return false; }

  void SetUp() override {
#ifdef TMEM_TSAN_SKIP_GRPC
    GTEST_SKIP() << "skipped under TSan: Debian's gRPC is not TSan-"
                    "instrumented, so the etcd client's RPC traffic reports "
                    "races inside gRPC (as tests/control); runs in release "
                    "and ASan";
#endif
    if (!PathExists(kEtcdBinary)) {
      GTEST_SKIP() << kEtcdBinary
                   << " is missing: install etcd-server "
                      "(scripts/install-deps.sh does)";
    }
    ASSERT_FALSE(dir_.path().empty());
    if (UseTls()) {
      const std::string d = dir_.path() + "/certs";
      std::filesystem::create_directories(d);
      certs_ = MakeEtcdCerts(d);
      ASSERT_TRUE(certs_.error.empty()) << certs_.error;
    }
    cluster_ = std::make_unique<EtcdCluster>(3, dir_.path(),
                                             UseTls() ? &certs_ : nullptr);
    cluster_->StartAll();
    EtcdOptions eo;
    eo.endpoints = Endpoints();
    if (UseTls()) {
      eo.tls.cert = certs_.client_cert;
      eo.tls.key = certs_.client_key;
      eo.tls.ca = certs_.ca;
    }
    absl::StatusOr<std::unique_ptr<EtcdClient>> c = EtcdClient::Create(eo);
    ASSERT_TRUE(c.ok()) << c.status();
    etcd_ = std::move(*c);
    ASSERT_TRUE(WaitUntil([&] { return EtcdAnswers(); }, 30000))
        << cluster_->member(0).Log();
  }

  std::vector<std::string> Endpoints() const { return cluster_->Endpoints(); }
  std::string EndpointList() const { return cluster_->EndpointList(); }
  void StartMember(int i) { cluster_->Start(i); }
  Process& Member(int i) { return cluster_->member(i); }

  bool EtcdAnswers() {
    etcdserverpb::RangeRequest r;
    r.set_key("/health-probe");
    for (size_t i = 0; i < 3; ++i) {
      if (etcd_->Range(r).ok()) return true;
      etcd_->Rotate();
    }
    return false;
  }

  AgentTls DefaultTls() const {
    return UseTls() ? AgentTls::kValid : AgentTls::kNone;
  }

  // One tmemd with [fleet], host name h<i>, group odd/even, a small cap
  // and one worker; not waited for (WaitReady).
  void LaunchTmemd(int i, AgentTls tls) {
    const std::string d = absl::StrCat(dir_.path(), "/h", i);
    std::filesystem::create_directories(d);
    std::vector<std::string> quoted;
    for (const std::string& e : Endpoints()) quoted.push_back("\"" + e + "\"");
    std::ofstream toml(d + "/tmemd.toml");
    toml << "[store]\nmemory_cap = \"64MiB\"\n"
         << "[channels]\nsocket_dir = \"" << d << "\"\n"
         << "[control]\nstate_file = \"" << d << "/state.json\"\n"
         << "[fleet]\nendpoints = [" << absl::StrJoin(quoted, ", ") << "]\n"
         << "host = \"h" << i << "\"\n"
         << "groups = [\"" << (i % 2 ? "odd" : "even") << "\"]\n"
         << "lease_ttl_seconds = 3\n";
    if (tls != AgentTls::kNone) toml << "tls_ca = \"" << certs_.ca << "\"\n";
    if (tls == AgentTls::kValid) {
      toml << "tls_cert = \"" << certs_.client_cert << "\"\n"
           << "tls_key = \"" << certs_.client_key << "\"\n";
    } else if (tls == AgentTls::kRogue) {
      toml << "tls_cert = \"" << certs_.rogue_cert << "\"\n"
           << "tls_key = \"" << certs_.rogue_key << "\"\n";
    }
    toml.close();
    if (tmemds_.size() <= static_cast<size_t>(i)) tmemds_.resize(i + 1);
    tmemds_[i].reset();
    tmemds_[i] = std::make_unique<Process>(
        std::vector<std::string>{TMEMD_BIN, "-c", d + "/tmemd.toml",
                                 "--workers", "1"},
        absl::StrCat(d, "/tmemd-", ++runs_, ".log"));
  }
  void WaitReady(int i) {
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
  void StartTmemd(int i) { StartTmemd(i, DefaultTls()); }
  void StartTmemd(int i, AgentTls tls) {
    LaunchTmemd(i, tls);
    WaitReady(i);
  }

  RunResult Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {TMEMCTL_BIN, "fleet", "--etcd",
                                     EndpointList()};
    if (UseTls()) {
      argv.insert(argv.end(), {"--etcd-cert", certs_.client_cert, "--etcd-key",
                               certs_.client_key, "--etcd-ca", certs_.ca});
    }
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
  // A host counter from h<i>'s Status (fleet_* included); -1 if absent.
  int64_t HostCounter(int i, const std::string& name) {
    json s = HostStatus(i);
    if (!s.is_object() || !s.contains("counters")) return -1;
    for (const json& c : s["counters"]) {
      if (c.value("name", "") != name) continue;
      if (!c.contains("value")) return 0;  // proto3 JSON leaves 0 out
      const json& v = c["value"];
      return v.is_string() ? std::stoll(v.get<std::string>())
                           : v.get<int64_t>();
    }
    return -1;
  }
  bool KeyExists(const std::string& key) {
    etcdserverpb::RangeRequest r;
    r.set_key(key);
    absl::StatusOr<etcdserverpb::RangeResponse> resp = etcd_->Range(r);
    return resp.ok() && resp->kvs_size() > 0;
  }
  // Every host's status key, read from etcd here (no process per poll: on a
  // loaded machine 50 tmemctl runs a second cost the agents their CPU).
  std::map<std::string, json> StatusKeys() {
    std::map<std::string, json> out;
    etcdserverpb::RangeRequest r;
    r.set_key(kFleetStatusPrefix);
    r.set_range_end(EtcdPrefixEnd(kFleetStatusPrefix));
    absl::StatusOr<etcdserverpb::RangeResponse> resp = etcd_->Range(r);
    if (!resp.ok()) return out;
    for (const mvccpb::KeyValue& kv : resp->kvs()) {
      out[kv.key().substr(std::string(kFleetStatusPrefix).size())] =
          json::parse(kv.value(), nullptr, false);
    }
    return out;
  }
  // All `hosts` report `revision` applied with the budget `budget(host)`.
  bool AllReport(int hosts, int64_t revision,
                 const std::function<double(int)>& budget) {
    std::map<std::string, json> st = StatusKeys();
    if (st.size() != static_cast<size_t>(hosts)) return false;
    for (int i = 0; i < hosts; ++i) {
      auto it = st.find(absl::StrCat("h", i));
      if (it == st.end() || !it->second.is_object() ||
          it->second.value("applied_revision", int64_t{0}) < revision ||
          it->second.value("cpu_budget_percent", -1.0) != budget(i)) {
        return false;
      }
    }
    return true;
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
  EtcdCerts certs_;
  std::unique_ptr<EtcdCluster> cluster_;
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
  if (PathExists(kEtcdctlBinary)) {
    RunResult c = testing::Run({kEtcdctlBinary, "--endpoints", EndpointList(),
                                "compact", std::to_string(AppliedRevision(d))},
                               dir_.path() + "/compact.out");
    ASSERT_EQ(c.code, 0) << c.output;
  }
  StartTmemd(1);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << tmemds_[1]->Log();
  EXPECT_DOUBLE_EQ(CpuBudget(1), 46);
  if (PathExists(kEtcdctlBinary)) {
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

// Raw bytes through etcd, as etcdctl can write them.
int64_t PutRaw(EtcdClient& etcd, const std::string& key,
               const std::string& value) {
  etcdserverpb::PutRequest r;
  r.set_key(key);
  r.set_value(value);
  absl::StatusOr<etcdserverpb::PutResponse> p = etcd.Put(r);
  return p.ok() ? p->header().revision() : -1;
}

int64_t DeleteRaw(EtcdClient& etcd, const std::string& key) {
  etcdserverpb::TxnRequest txn;
  txn.add_success()->mutable_request_delete_range()->set_key(key);
  absl::StatusOr<etcdserverpb::TxnResponse> t = etcd.Txn(txn);
  return t.ok() ? t->header().revision() : -1;
}

// Keys and values in etcd are bytes: one that is not UTF-8, or a key
// outside the layout, is refused with its reason (escaped), counted and
// logged; the host keeps its last good policy and stays up, also across a
// restart while the bad key is still there.
TEST_F(FleetEtcdTest, BadBytesAndKeysOutsideTheLayoutAreRefusedNotFatal) {
  StartTmemd(0);
  ASSERT_EQ(Apply(R"({"fleet": {"host": {"cpu_budget_percent": 25}}})").code,
            0);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));
  const std::string p = kFleetPolicyPrefix;
  // h0's status key once it has seen `revision`.
  auto seen = [&](int64_t revision) {
    json st;
    EXPECT_TRUE(WaitUntil(
        [&] {
          std::map<std::string, json> all = StatusKeys();
          auto it = all.find("h0");
          if (it == all.end() || !it->second.is_object()) return false;
          st = it->second;
          return st.value("seen_revision", int64_t{0}) >= revision;
        },
        kConvergeMs))
        << tmemds_[0]->Log();
    return st;
  };
  auto rejected_with = [&](int64_t revision, const std::string& reason) {
    const json st = seen(revision);
    EXPECT_GE(st.value("rejected_revision", int64_t{0}), revision) << st.dump();
    EXPECT_NE(st.value("rejected_reason", std::string()).find(reason),
              std::string::npos)
        << st.dump();
    ASSERT_TRUE(tmemds_[0]->Running()) << tmemds_[0]->Log();
    EXPECT_DOUBLE_EQ(CpuBudget(0), 25);  // the last good policy stays
  };

  // 1. A fleet value that is one byte 0xff.
  const int64_t r1 = PutRaw(*etcd_, p + "fleet", "\xff");
  ASSERT_GT(r1, 0);
  rejected_with(r1, "fleet: value: byte 0xff at offset 0 is not UTF-8");
  EXPECT_GE(HostCounter(0, "fleet_revisions_rejected"), 1);
  EXPECT_NE(tmemds_[0]->Log().find("event=fleet_policy_rejected"),
            std::string::npos);
  RunResult table = Ctl({"status"});
  EXPECT_EQ(table.code, kFleetNotConverged);
  EXPECT_NE(table.output.find("0xff"), std::string::npos) << table.output;

  // 2. Restarted with the bad key still there (its revision saved): no
  // crash loop, still refused, the saved policy enforced.
  ASSERT_EQ(tmemds_[0]->Stop(), 0) << tmemds_[0]->Log();
  StartTmemd(0);
  rejected_with(r1, "not UTF-8");
  const int64_t r2 = PutRaw(
      *etcd_, p + "fleet", R"({"version":1,"host":{"cpu_budget_percent":33}})");
  ASSERT_TRUE(WaitUntil([&] { return CpuBudget(0) == 33; }, kConvergeMs));
  EXPECT_EQ(seen(r2).value("rejected_reason", std::string("?")), "");

  // 3. A vms/ key whose name and value are not UTF-8: shown escaped.
  ASSERT_TRUE(PutRaw(*etcd_, p + "fleet",
                     R"({"version":1,"host":{"cpu_budget_percent":25}})") > 0);
  ASSERT_TRUE(WaitUntil([&] { return CpuBudget(0) == 25; }, kConvergeMs));
  const int64_t r3 = PutRaw(*etcd_, p + "vms/web\xff", "\xfe\xff");
  ASSERT_GT(r3, 0);
  rejected_with(r3, "key '/tmemd/v1/policy/vms/web\\xff'");
  // A later valid change is held back too: the revision is refused whole.
  const int64_t r4 = PutRaw(
      *etcd_, p + "fleet", R"({"version":1,"host":{"cpu_budget_percent":44}})");
  ASSERT_GT(r4, 0);
  rejected_with(r4, "vms/web\\xff");
  // Restarted again, from the journal this time.
  ASSERT_EQ(tmemds_[0]->Stop(), 0) << tmemds_[0]->Log();
  StartTmemd(0);
  rejected_with(r4, "vms/web\\xff");
  ASSERT_GT(DeleteRaw(*etcd_, p + "vms/web\xff"), 0);
  ASSERT_TRUE(WaitUntil([&] { return CpuBudget(0) == 44; }, kConvergeMs));

  // 4. A key outside the layout is refused, not ignored, until deleted.
  const int64_t r5 = PutRaw(*etcd_, p + "host/h0", R"({"version":1})");
  ASSERT_GT(r5, 0);
  const json st = seen(r5);
  EXPECT_NE(st.value("rejected_reason", std::string())
                .find("key '/tmemd/v1/policy/host/h0': want"),
            std::string::npos)
      << st.dump();
  ASSERT_GT(DeleteRaw(*etcd_, p + "host/h0"), 0);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << Ctl({"status"}).output;
  EXPECT_DOUBLE_EQ(CpuBudget(0), 44);
  ASSERT_TRUE(tmemds_[0]->Running());
}

// CPU seconds (user + system) a process has used so far.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  std::vector<std::string> v;
  while (fields >> f) v.push_back(f);
  if (v.size() < 13) return -1;
  // Fields 14 and 15 of proc(5): utime, stime; v[0] is field 3.
  return static_cast<double>(std::stoll(v[11]) + std::stoll(v[12])) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

// A revision costs in proportion to what it changed: with 10,000 vms/ keys
// held, each of 300 single-key revisions parses one value and appends one
// journal line, not the whole view (the counters are the work; the CPU
// seconds are printed for the record, not asserted).
TEST_F(FleetEtcdTest, TenThousandVmKeysCostInProportionToTheChange) {
  constexpr int kVms = 10000;
  constexpr int kChanges = 300;
  StartTmemd(0);
  auto value = [](int quota_mib) {
    return absl::StrCat(R"({"version":1,"vm":{"quota_bytes":)",
                        int64_t{quota_mib} << 20, R"(,"weight":100}})");
  };
  int64_t last = 0;
  for (int i = 0; i < kVms; i += 100) {
    etcdserverpb::TxnRequest txn;
    for (int j = i; j < i + 100; ++j) {
      etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
      put->set_key(absl::StrFormat("%svms/vm-%05d", kFleetPolicyPrefix, j));
      put->set_value(value(64));
    }
    absl::StatusOr<etcdserverpb::TxnResponse> t = etcd_->Txn(txn);
    ASSERT_TRUE(t.ok()) << t.status();
    last = t->header().revision();
  }
  auto seen = [&](int64_t revision) {
    return WaitUntil(
        [&] {
          std::map<std::string, json> all = StatusKeys();
          auto it = all.find("h0");
          return it != all.end() && it->second.is_object() &&
                 it->second.value("applied_revision", int64_t{0}) >= revision;
        },
        kConvergeMs * 4);
  };
  ASSERT_TRUE(seen(last)) << tmemds_[0]->Log();
  const pid_t pid = tmemds_[0]->pid();
  const double cpu0 = CpuSeconds(pid);
  const int64_t parsed0 = HostCounter(0, "fleet_layers_parsed");
  const int64_t bytes0 = HostCounter(0, "fleet_state_bytes_written");
  for (int i = 0; i < kChanges; ++i) {
    last = PutRaw(*etcd_,
                  absl::StrFormat("%svms/vm-%05d", kFleetPolicyPrefix,
                                  i * (kVms / kChanges)),
                  value(65 + i % 7));
    ASSERT_GT(last, 0);
  }
  ASSERT_TRUE(seen(last)) << tmemds_[0]->Log();
  const double cpu = CpuSeconds(pid) - cpu0;
  const int64_t parsed = HostCounter(0, "fleet_layers_parsed") - parsed0;
  const int64_t bytes = HostCounter(0, "fleet_state_bytes_written") - bytes0;
  std::cout << "[ MEASURED ] " << kChanges << " single-key revisions over "
            << kVms << " vms/ keys: tmemd CPU " << cpu << " s, values parsed "
            << parsed << ", state bytes written " << bytes << "\n";
  ASSERT_GE(parsed0, kVms);
  ASSERT_GE(bytes0, 0);
  EXPECT_LE(parsed, kChanges);
  // One journal line a revision (well under 1 KiB each), no snapshot: the
  // whole view is ~0.8 MB, rewritten 300 times that would be ~240 MB.
  EXPECT_LE(bytes, int64_t{kChanges} * 1024);
  EXPECT_GT(bytes, 0);
}

TEST_F(FleetEtcdTest, EtcdMemberKilledThenWholeClusterDownAndBack) {
  for (int i = 0; i < 3; ++i) StartTmemd(i);
  ASSERT_EQ(Apply(R"({"fleet": {"host": {"cpu_budget_percent": 21}}})").code,
            0);
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs));
  // Member 0 is every tmemd's first endpoint: they must move on.
  ASSERT_EQ(kill(Member(0).pid(), SIGKILL), 0);
  Member(0).Wait();
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
  ASSERT_EQ(kill(Member(1).pid(), SIGKILL), 0);
  Member(1).Wait();
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
  cluster_->KillAll();
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

// 50 tmemds (no VMs, 64 MiB caps, one worker each) converge on a layered
// policy and on a change of it; the bound is a deadline for a loaded
// 2-core machine, not a target (bench/fleet_propagation_bench measures).
TEST_F(FleetEtcdTest, FiftyHostsConverge) {
  constexpr int kHosts = 50;
  for (int i = 0; i < kHosts; ++i) LaunchTmemd(i, AgentTls::kNone);
  for (int i = 0; i < kHosts; ++i) WaitReady(i);
  ASSERT_TRUE(
      WaitUntil([&] { return StatusKeys().size() == kHosts; }, kConvergeMs))
      << StatusKeys().size() << " of " << kHosts << " hosts report";
  RunResult a = Apply(kPolicyA);
  ASSERT_EQ(a.code, 0) << a.output;
  const int64_t rev_a = AppliedRevision(a);
  const auto start = std::chrono::steady_clock::now();
  auto budget_a = [](int i) { return i % 2 ? 30.0 : 40.0; };
  ASSERT_TRUE(WaitUntil([&] { return AllReport(kHosts, rev_a, budget_a); },
                        kConvergeMs))
      << Ctl({"status"}).output;
  const auto converged = std::chrono::steady_clock::now() - start;
  // tmemctl's view agrees, and the layers landed (mode per host).
  int code = -1;
  json st = FleetStatus(&code);
  ASSERT_EQ(code, 0) << st.dump();
  ASSERT_EQ(st["hosts"].size(), static_cast<size_t>(kHosts));
  for (const json& h : st["hosts"]) {
    EXPECT_EQ(h["state"], "converged") << h.dump();
    EXPECT_EQ(h["mode"], h["host"] == "h2" ? "off" : "always") << h.dump();
  }
  // What the status keys say is what tmemd enforces (its control socket).
  for (int i : {0, 1, 2, 49}) EXPECT_DOUBLE_EQ(CpuBudget(i), budget_a(i));

  RunResult b = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 55}},
                          "hosts": {"h49": {"host": {"cpu_budget_percent": 12}}}})");
  ASSERT_EQ(b.code, 0) << b.output;
  auto budget_b = [](int i) { return i == 49 ? 12.0 : 55.0; };
  ASSERT_TRUE(
      WaitUntil([&] { return AllReport(kHosts, AppliedRevision(b), budget_b); },
                kConvergeMs))
      << Ctl({"status"}).output;
  for (int i : {0, 1, 48, 49}) EXPECT_DOUBLE_EQ(CpuBudget(i), budget_b(i));
  std::cout << "[ INFO     ] " << kHosts << " hosts applied it and reported so "
            << std::chrono::duration_cast<std::chrono::milliseconds>(converged)
                   .count()
            << " ms after the tmemctl fleet apply process was reaped\n";
}

// etcd with TLS on its client port and --client-cert-auth.
class FleetEtcdTlsTest : public FleetEtcdTest {
 protected:
  bool UseTls() const override { return true; }
};

TEST_F(FleetEtcdTlsTest, OnlyAgentsWithATrustedClientCertificateGetPolicy) {
  StartTmemd(0, AgentTls::kValid);
  RunResult a = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 31}}})");
  ASSERT_EQ(a.code, 0) << a.output;
  ASSERT_TRUE(WaitUntil([&] { return AllConverged(); }, kConvergeMs))
      << Ctl({"status"}).output << tmemds_[0]->Log();
  EXPECT_DOUBLE_EQ(CpuBudget(0), 31);
  EXPECT_EQ(HostCounter(0, "fleet_etcd_tls_errors"), 0);

  // No client certificate, and one from a CA etcd does not trust: they get
  // nothing (never registered, their own config's budget), say why in
  // their log, and count it.
  StartTmemd(1, AgentTls::kCaOnly);
  StartTmemd(2, AgentTls::kRogue);
  for (int i : {1, 2}) {
    ASSERT_TRUE(
        WaitUntil([&] { return HostCounter(i, "fleet_etcd_tls_errors") > 0; },
                  kConvergeMs))
        << tmemds_[i]->Log();
    const std::string log = tmemds_[i]->Log();
    EXPECT_NE(log.find("event=fleet_etcd_tls_error"), std::string::npos) << log;
    EXPECT_NE(log.find(i == 1 ? "we sent no client certificate"
                              : "it does not accept our client certificate"),
              std::string::npos)
        << log;
    EXPECT_GE(HostCounter(i, "fleet_etcd_errors"),
              HostCounter(i, "fleet_etcd_tls_errors"));
    EXPECT_EQ(HostCounter(i, "fleet_revisions_applied"), 0);
    EXPECT_DOUBLE_EQ(CpuBudget(i), 25);  // tmemd's default, not 31
    EXPECT_FALSE(KeyExists(absl::StrCat(kFleetMembersPrefix, "h", i)));
    EXPECT_FALSE(KeyExists(absl::StrCat(kFleetStatusPrefix, "h", i)));
  }

  // h0 comes back with the rogue certificate: it keeps enforcing what it
  // applied, gets nothing of the next apply, and counts the refusals.
  ASSERT_EQ(tmemds_[0]->Stop(), 0);
  StartTmemd(0, AgentTls::kRogue);
  RunResult b = Apply(R"({"fleet": {"host": {"cpu_budget_percent": 32}}})");
  ASSERT_EQ(b.code, 0) << b.output;
  ASSERT_TRUE(WaitUntil(
      [&] { return HostCounter(0, "fleet_etcd_tls_errors") > 0; }, kConvergeMs))
      << tmemds_[0]->Log();
  EXPECT_DOUBLE_EQ(CpuBudget(0), 31);
  EXPECT_EQ(HostCounter(0, "fleet_revisions_applied"), 0);
  // With its certificate back it catches up.
  ASSERT_EQ(tmemds_[0]->Stop(), 0);
  StartTmemd(0, AgentTls::kValid);
  ASSERT_TRUE(WaitUntil([&] { return CpuBudget(0) == 32; }, kConvergeMs))
      << tmemds_[0]->Log();

  // tmemctl: refused by etcd without a certificate, with the reason; a key
  // that is not the certificate's is refused before any connection.
  RunResult plain =
      testing::Run({TMEMCTL_BIN, "fleet", "--etcd", EndpointList(), "status"},
                   dir_.path() + "/plain.out");
  EXPECT_EQ(plain.code, 1) << plain.output;
  EXPECT_NE(plain.output.find("it serves TLS"), std::string::npos)
      << plain.output;
  RunResult ca_only =
      testing::Run({TMEMCTL_BIN, "fleet", "--etcd", EndpointList(), "--etcd-ca",
                    certs_.ca, "status"},
                   dir_.path() + "/ca-only.out");
  EXPECT_EQ(ca_only.code, 1) << ca_only.output;
  EXPECT_NE(ca_only.output.find("we sent no client certificate"),
            std::string::npos)
      << ca_only.output;
  RunResult wrong_ca =
      testing::Run({TMEMCTL_BIN, "fleet", "--etcd", EndpointList(), "--etcd-ca",
                    certs_.rogue_ca, "--etcd-cert", certs_.client_cert,
                    "--etcd-key", certs_.client_key, "status"},
                   dir_.path() + "/wrong-ca.out");
  EXPECT_EQ(wrong_ca.code, 1) << wrong_ca.output;
  EXPECT_NE(wrong_ca.output.find("does not verify against our CA"),
            std::string::npos)
      << wrong_ca.output;
  RunResult mismatch =
      testing::Run({TMEMCTL_BIN, "fleet", "--etcd", EndpointList(), "--etcd-ca",
                    certs_.ca, "--etcd-cert", certs_.client_cert, "--etcd-key",
                    certs_.rogue_key, "status"},
                   dir_.path() + "/mismatch.out");
  EXPECT_EQ(mismatch.code, 1) << mismatch.output;
  EXPECT_NE(mismatch.output.find("--etcd-key '" + certs_.rogue_key +
                                 "': does not match the certificate of "
                                 "--etcd-cert"),
            std::string::npos)
      << mismatch.output;
}

TEST_F(FleetEtcdTlsTest, TmemdRefusesBadTlsFilesAtStartWithTheirSetting) {
  // The CA file given as the client certificate's key: refused, tmemd
  // exits, the message names the setting and the file.
  const std::string d = dir_.path() + "/bad";
  std::filesystem::create_directories(d);
  std::ofstream(d + "/tmemd.toml")
      << "[channels]\nsocket_dir = \"" << d << "\"\n"
      << "[control]\nstate_file = \"" << d << "/state.json\"\n"
      << "[fleet]\nendpoints = [\"" << Endpoints()[0] << "\"]\n"
      << "host = \"bad\"\n"
      << "tls_ca = \"" << certs_.ca << "\"\n"
      << "tls_cert = \"" << certs_.client_cert << "\"\n"
      << "tls_key = \"" << certs_.ca << "\"\n";
  Process p({TMEMD_BIN, "-c", d + "/tmemd.toml", "--workers", "1"},
            d + "/tmemd.log");
  int code = -1;
  ASSERT_TRUE(p.WaitFor(30000, &code)) << p.Log();
  EXPECT_EQ(code, 1);
  EXPECT_NE(p.Log().find("[fleet] tls_key '" + certs_.ca +
                         "': not an unencrypted PEM private key"),
            std::string::npos)
      << p.Log();
}

}  // namespace
}  // namespace tmem
