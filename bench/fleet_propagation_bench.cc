// Fleet policy propagation: how long one policy change in etcd
// takes to be applied by every tmemd, against etcd's own watch
// notification latency in the same run, and the etcd write load the
// agents cause in steady state.
//
// Starts an etcd cluster (tests/fleet/etcd_cluster.h: /usr/bin/etcd, data
// on tmpfs) and --agents tmemd processes (no VMs, 64 MiB caps, one worker,
// [fleet] state on tmpfs), and a plain watcher of the policy prefix in this
// process (one gRPC Watch stream: etcd's notification latency). Then
// --changes times: put /tmemd/v1/policy/fleet (a new cpu budget), note the
// wall time before the put, and take
//   - the watcher's latency: put -> the watch event received here;
//   - each agent's latency: put -> its fleet_policy_applied log line for
//     that revision (tmemd's log time, millisecond resolution; logged after
//     the policy is applied and fleet-state.json is fsynced);
//   - all-applied: the slowest agent.
// The target row: p99 of all-applied / p99 of the watcher's latency
// (nearest rank, over the changes); for information, ratio = all-applied /
// watcher latency per change, p50 and p99. Then --steady-seconds without
// changes: deltas of etcd's /metrics counters (member 0's raft proposals and
// MVCC puts; lease renewals and LeaseKeepAlive messages summed over members),
// per agent per minute.
//
// A measurement on whatever machine runs it; no assertion on the numbers
// (ctest runs a small smoke configuration: --agents 3 --changes 2).
// --results FILE records the printed rows in the results file
// (bench/results_file.h, section "fleet-propagation"); exit 1 if it could
// not be written.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/method.h"
#include "bench/results_file.h"
#include "host-agent/fleet/etcd_client.h"
#include "host-agent/fleet/fleet_policy.h"
#include "tests/fleet/etcd_cluster.h"
#include "tests/process.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

using Clock = std::chrono::system_clock;
using testing::EtcdCluster;
using testing::Process;
using testing::TempDir;

struct Options {
  int agents = 100;
  int changes = 10;
  int members = 3;
  int steady_seconds = 60;
  int lease_ttl_seconds = 10;
  int timeout_seconds = 300;
  std::string tmemd;
  std::string results;  // results file (bench/results_file.h), if any
  std::string command;  // this run's command line, for the results file
};

// Thrown, not exit(): unwinding kills the etcd members and tmemds started
// so far (Process's destructor).
[[noreturn]] void Die(const std::string& why) { throw std::runtime_error(why); }

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// tmemd's "ts=2026-12-01T18:50:02.137Z" -> wall time.
bool ParseLogTime(const std::string& line, Clock::time_point* t) {
  const size_t at = line.find("ts=");
  if (at == std::string::npos || line.size() < at + 27) return false;
  std::tm tm{};
  int ms = 0;
  if (sscanf(line.c_str() + at + 3, "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ", &tm.tm_year,
             &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec,
             &ms) != 7) {
    return false;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  *t = Clock::from_time_t(timegm(&tm)) + std::chrono::milliseconds(ms);
  return true;
}

// The time of `log`'s fleet_policy_applied line for `revision`.
bool AppliedAt(const std::string& log, int64_t revision, Clock::time_point* t) {
  const std::string needle =
      absl::StrCat("event=fleet_policy_applied revision=", revision);
  size_t at = log.find(needle);
  while (at != std::string::npos) {
    const size_t end = at + needle.size();
    if (end == log.size() || log[end] == '\n' || log[end] == ' ') {
      const size_t nl = log.rfind('\n', at);
      const size_t begin = nl == std::string::npos ? 0 : nl + 1;
      return ParseLogTime(log.substr(begin, at - begin), t);
    }
    at = log.find(needle, end);
  }
  return false;
}

// GET /metrics over plain HTTP -> "name{labels}" -> value.
std::map<std::string, double> FetchMetrics(int port) {
  std::map<std::string, double> out;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return out;
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string body;
  char buf[65536];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    body.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  size_t pos = body.find("\r\n\r\n");
  pos = pos == std::string::npos ? 0 : pos + 4;
  while (pos < body.size()) {
    size_t eol = body.find('\n', pos);
    if (eol == std::string::npos) eol = body.size();
    const std::string line = body.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    double v = 0;
    if (sp != std::string::npos && absl::SimpleAtod(line.substr(sp + 1), &v)) {
      out[line.substr(0, sp)] = v;
    }
  }
  return out;
}

// Sums every series whose name (before any label) is `name` and whose
// labels contain `label` ("" for any).
double Sum(const std::map<std::string, double>& m, const std::string& name,
           const std::string& label = "") {
  double s = 0;
  for (const auto& [k, v] : m) {
    if (k.compare(0, name.size(), name) != 0) continue;
    if (k.size() > name.size() && k[name.size()] != '{') continue;
    if (!label.empty() && k.find(label) == std::string::npos) continue;
    s += v;
  }
  return s;
}

// A plain watcher of the policy prefix: revision -> time it arrived.
class PlainWatcher {
 public:
  explicit PlainWatcher(EtcdClient* etcd) : etcd_(etcd) {
    thread_ = std::thread([this] { Run(); });
  }
  ~PlainWatcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      context_.TryCancel();
    }
    thread_.join();
  }
  PlainWatcher(const PlainWatcher&) = delete;
  PlainWatcher& operator=(const PlainWatcher&) = delete;

  bool ready() const { return ready_.load(); }
  bool Seen(int64_t revision, Clock::time_point* t) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seen_.find(revision);
    if (it == seen_.end()) return false;
    *t = it->second;
    return true;
  }

 private:
  void Run() {
    etcd_->Prepare(&context_, /*stream=*/true);
    auto stream = etcd_->watch().Watch(&context_);
    etcdserverpb::WatchRequest request;
    request.mutable_create_request()->set_key(kFleetPolicyPrefix);
    request.mutable_create_request()->set_range_end(
        EtcdPrefixEnd(kFleetPolicyPrefix));
    if (!stream->Write(request)) return;
    etcdserverpb::WatchResponse response;
    while (stream->Read(&response)) {
      const Clock::time_point now = Clock::now();
      if (response.created()) ready_ = true;
      std::lock_guard<std::mutex> lock(mu_);
      for (const mvccpb::Event& e : response.events()) {
        seen_.emplace(e.kv().mod_revision(), now);
      }
    }
    (void)stream->Finish();
  }

  EtcdClient* const etcd_;
  grpc::ClientContext context_;
  std::atomic<bool> ready_{false};
  std::mutex mu_;
  bool stop_ = false;                          // guarded by mu_
  std::map<int64_t, Clock::time_point> seen_;  // guarded by mu_
  std::thread thread_;
};

int64_t CountKeys(EtcdClient& etcd, const std::string& prefix) {
  etcdserverpb::RangeRequest r;
  r.set_key(prefix);
  r.set_range_end(EtcdPrefixEnd(prefix));
  r.set_count_only(true);
  absl::StatusOr<etcdserverpb::RangeResponse> resp = etcd.Range(r);
  return resp.ok() ? resp->count() : -1;
}

int Run(const Options& o) {
  if (!testing::PathExists(testing::kEtcdBinary)) {
    Die(absl::StrCat(testing::kEtcdBinary, " is missing (etcd-server)"));
  }
  TempDir logs("tmemd-fleet-bench");
  TempDir state("tmemd-fleet-bench-state", testing::PathExists("/dev/shm")
                                               ? std::string("/dev/shm")
                                               : "/tmp");
  EtcdCluster cluster(o.members, logs.path(), nullptr);
  cluster.StartAll();
  EtcdOptions eo;
  eo.endpoints = cluster.Endpoints();
  absl::StatusOr<std::unique_ptr<EtcdClient>> made = EtcdClient::Create(eo);
  if (!made.ok()) Die(std::string(made.status().message()));
  EtcdClient& etcd = **made;
  if (!testing::WaitUntil([&] { return CountKeys(etcd, "/") >= 0; }, 60000)) {
    Die("etcd does not answer: " + cluster.member(0).Log());
  }

  const auto t_start = Clock::now();
  std::vector<std::unique_ptr<Process>> agents;
  for (int i = 0; i < o.agents; ++i) {
    const std::string d = absl::StrCat(state.path(), "/a", i);
    std::filesystem::create_directories(d);
    std::vector<std::string> quoted;
    for (const std::string& e : cluster.Endpoints()) {
      quoted.push_back("\"" + e + "\"");
    }
    std::ofstream(d + "/tmemd.toml")
        << "[store]\nmemory_cap = \"64MiB\"\n"
        << "[channels]\nsocket_dir = \"" << d << "\"\n"
        << "[control]\nstate_file = \"" << d << "/state.json\"\n"
        << "[fleet]\nendpoints = [" << absl::StrJoin(quoted, ", ") << "]\n"
        << "host = \"a" << i << "\"\n"
        << "lease_ttl_seconds = " << o.lease_ttl_seconds << "\n";
    agents.push_back(std::make_unique<Process>(
        std::vector<std::string>{o.tmemd, "-c", d + "/tmemd.toml", "--workers",
                                 "1"},
        absl::StrCat(logs.path(), "/a", i, ".log")));
  }
  if (!testing::WaitUntil(
          [&] { return CountKeys(etcd, kFleetStatusPrefix) == o.agents; },
          o.timeout_seconds * 1000)) {
    for (auto& a : agents) {
      if (!a->Running()) Die("a tmemd exited: " + a->Log());
    }
    Die(absl::StrCat("only ", CountKeys(etcd, kFleetStatusPrefix), " of ",
                     o.agents, " agents reported"));
  }
  std::cout << o.agents << " agents reporting after "
            << Ms(Clock::now() - t_start) / 1000 << " s\n";

  PlainWatcher watcher(&etcd);
  if (!testing::WaitUntil([&] { return watcher.ready(); }, 30000)) {
    Die("the plain watcher did not start");
  }
  std::vector<double> watch_ms, all_ms, ratio, agent_ms;
  for (int k = 0; k < o.changes; ++k) {
    etcdserverpb::PutRequest put;
    put.set_key(absl::StrCat(kFleetPolicyPrefix, "fleet"));
    put.set_value(absl::StrCat(R"({"version":1,"host":{"cpu_budget_percent":)",
                               10 + k % 80, "}}"));
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<etcdserverpb::PutResponse> r = etcd.Put(put);
    if (!r.ok()) Die(std::string(r.status().message()));
    const int64_t rev = r->header().revision();
    Clock::time_point seen;
    if (!testing::WaitUntil([&] { return watcher.Seen(rev, &seen); }, 30000)) {
      Die(absl::StrCat("the plain watcher never saw revision ", rev));
    }
    std::vector<Clock::time_point> applied(agents.size());
    std::vector<bool> done(agents.size(), false);
    size_t remaining = agents.size();
    // The times come from the logs; polling them slowly only delays
    // reading them, and leaves the CPU to the agents.
    const auto deadline =
        Clock::now() + std::chrono::seconds(o.timeout_seconds);
    while (remaining > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      for (size_t i = 0; i < agents.size(); ++i) {
        if (!done[i] && AppliedAt(agents[i]->Log(), rev, &applied[i])) {
          done[i] = true;
          --remaining;
        }
      }
    }
    if (remaining > 0) {
      Die(absl::StrCat(remaining, " agents never applied revision ", rev));
    }
    const double w = Ms(seen - t0);
    double slowest = 0;
    for (const Clock::time_point& t : applied) {
      agent_ms.push_back(Ms(t - t0));
      slowest = std::max(slowest, Ms(t - t0));
    }
    watch_ms.push_back(w);
    all_ms.push_back(slowest);
    ratio.push_back(slowest / std::max(w, 0.001));
    std::printf(
        "change %d rev %lld: watcher %.2f ms, all %d applied %.1f ms, "
        "ratio %.1f\n",
        k + 1, static_cast<long long>(rev), w, o.agents, slowest, ratio.back());
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }

  // Steady state: no changes; what do the agents cost etcd?
  std::vector<std::map<std::string, double>> before, after;
  for (int m = 0; m < o.members; ++m) {
    before.push_back(FetchMetrics(cluster.metrics_port(m)));
  }
  const Clock::time_point s0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(o.steady_seconds));
  const double minutes = Ms(Clock::now() - s0) / 60000.0;
  for (int m = 0; m < o.members; ++m) {
    after.push_back(FetchMetrics(cluster.metrics_port(m)));
  }
  auto per_agent_minute = [&](double delta) {
    return delta / o.agents / minutes;
  };
  auto delta_member0 = [&](const std::string& name) {
    return Sum(after[0], name) - Sum(before[0], name);
  };
  auto delta_all = [&](const std::string& name, const std::string& label) {
    double d = 0;
    for (int m = 0; m < o.members; ++m) {
      d += Sum(after[m], name, label) - Sum(before[m], name, label);
    }
    return d;
  };

  const double watch_p50 = bench::NearestRankPercentile(watch_ms, 50);
  const double watch_p99 = bench::NearestRankPercentile(watch_ms, 99);
  const double all_p50 = bench::NearestRankPercentile(all_ms, 50);
  const double all_p99 = bench::NearestRankPercentile(all_ms, 99);
  const double agent_p50 = bench::NearestRankPercentile(agent_ms, 50);
  const double agent_p99 = bench::NearestRankPercentile(agent_ms, 99);
  std::printf(
      "\nagents %d, etcd members %d, changes %d (etcd and agent "
      "state on tmpfs)\n",
      o.agents, o.members, o.changes);
  std::printf("plain watcher latency   p50 %.2f ms  p99 %.2f ms\n", watch_p50,
              watch_p99);
  std::printf("all agents applied      p50 %.1f ms  p99 %.1f ms\n", all_p50,
              all_p99);
  std::printf("one agent applied       p50 %.1f ms  p99 %.1f ms  (%zu)\n",
              agent_p50, agent_p99, agent_ms.size());
  // The target row: the fleet's p99 against etcd's own p99 over the same
  // changes. The per-change ratio below it is information: with 100 agent
  // processes on a 2-core machine, a change the watcher saw in a few ms
  // still waits for every agent to be scheduled once.
  const double p99_ratio = all_p99 / watch_p99;
  const char* verdict = p99_ratio <= 2 ? "PASS" : "FAIL";
  std::printf("p99 all applied / p99 watcher  %.2f  (target <= 2) %s\n",
              p99_ratio, verdict);
  const double ratio_p50 = bench::NearestRankPercentile(ratio, 50);
  const double ratio_p99 = bench::NearestRankPercentile(ratio, 99);
  std::printf(
      "ratio all/watcher per change  p50 %.1f  p99 %.1f  (information)\n",
      ratio_p50, ratio_p99);
  std::printf("steady state over %.2f min, per agent per minute:\n", minutes);
  const double proposals =
      per_agent_minute(delta_member0("etcd_server_proposals_committed_total"));
  const double mvcc_puts =
      per_agent_minute(delta_member0("etcd_debugging_mvcc_put_total"));
  const double renewals =
      per_agent_minute(delta_all("etcd_debugging_lease_renewed_total", ""));
  const double keepalives = per_agent_minute(delta_all(
      "grpc_server_msg_received_total", "grpc_method=\"LeaseKeepAlive\""));
  std::printf("  raft proposals committed (member 0)  %.2f\n", proposals);
  std::printf("  MVCC puts (member 0)                 %.2f\n", mvcc_puts);
  std::printf("  lease renewals (all members)         %.2f\n", renewals);
  std::printf("  LeaseKeepAlive messages (all members) %.2f\n", keepalives);

  bench::BenchmarkSection section;
  section.benchmark = "fleet-propagation";
  section.command = o.command;
  const std::string setup =
      absl::StrCat(o.agents, " agents, ", o.members, " etcd members, ",
                   o.changes, " changes");
  auto info = [&](const std::string& name, double value,
                  const std::string& unit, const std::string& note) {
    bench::ResultRecord r;
    r.name = name;
    r.value = value;
    r.unit = unit;
    r.verdict = "info";
    r.note = note;
    section.rows.push_back(std::move(r));
  };
  {
    bench::ResultRecord r;
    r.name = "p99 all applied / p99 watcher";
    r.value = p99_ratio;
    r.unit = "x";
    r.goal = "<=";
    r.target = 2;
    r.verdict = verdict;
    r.note = absl::StrFormat("%s; all applied p99 %.1f ms, watcher p99 %.2f ms",
                             setup, all_p99, watch_p99);
    section.rows.push_back(std::move(r));
  }
  info("plain watcher latency p50", watch_p50, "ms", setup);
  info("plain watcher latency p99", watch_p99, "ms", setup);
  info("all agents applied p50", all_p50, "ms", setup);
  info("all agents applied p99", all_p99, "ms", setup);
  info("one agent applied p50", agent_p50, "ms",
       absl::StrCat(agent_ms.size(), " samples"));
  info("one agent applied p99", agent_p99, "ms",
       absl::StrCat(agent_ms.size(), " samples"));
  info("ratio all/watcher per change p50", ratio_p50, "x", setup);
  info("ratio all/watcher per change p99", ratio_p99, "x", setup);
  const std::string steady =
      absl::StrFormat("steady state over %.2f min", minutes);
  info("raft proposals committed (member 0) per agent per minute", proposals,
       "1/min", steady);
  info("MVCC puts (member 0) per agent per minute", mvcc_puts, "1/min", steady);
  info("lease renewals (all members) per agent per minute", renewals, "1/min",
       steady);
  info("LeaseKeepAlive messages (all members) per agent per minute", keepalives,
       "1/min", steady);
  bench::AssignRowIds(section.rows);
  const bool recorded = bench::RecordResults(o.results, section);

  for (auto& a : agents) {
    if (!a->Running()) Die("a tmemd exited: " + a->Log());
    kill(a->pid(), SIGTERM);
  }
  // All stop at once on a shared machine: a generous bound, then a count
  // (the destructors SIGKILL what is left).
  int slow = 0;
  for (auto& a : agents) {
    if (!testing::WaitUntil([&] { return !a->Running(); }, 60000)) ++slow;
  }
  if (slow > 0) {
    std::printf("%d tmemds did not stop within 60 s of SIGTERM\n", slow);
    return 1;
  }
  return recorded ? 0 : 1;
}

}  // namespace
}  // namespace tmem

int main(int argc, char** argv) try {
  tmem::Options o;
  CLI::App app{
      "fleet_propagation_bench: one policy change in etcd to N tmemds, as a "
      "ratio to a plain etcd watcher's latency; steady-state etcd load"};
  app.add_option("--tmemd", o.tmemd, "the tmemd binary")->required();
  app.add_option("--agents", o.agents, "tmemds watching the fleet policy")
      ->check(CLI::Range(1, 100000));
  app.add_option("--changes", o.changes, "policy changes timed")
      ->check(CLI::Range(1, 100000));
  app.add_option("--members", o.members, "etcd cluster members")
      ->check(CLI::Range(1, 99));
  app.add_option("--steady-seconds", o.steady_seconds,
                 "how long the steady-state etcd load is measured")
      ->check(CLI::Range(1, 86400));
  app.add_option("--lease-ttl", o.lease_ttl_seconds,
                 "the tmemds' etcd lease TTL (s)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--timeout", o.timeout_seconds,
                 "give up on a change after this long (s)")
      ->check(CLI::Range(1, 86400));
  app.add_option("--results", o.results,
                 "record the rows in this results file (.json), section "
                 "\"fleet-propagation\"");
  o.command = tmem::bench::CommandLine(argc, argv);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints why, naming the flag (or the help).
    return app.exit(e) == 0 ? 0 : 2;
  }
  return tmem::Run(o);
} catch (const std::exception& e) {
  std::cerr << "fleet_propagation_bench: " << e.what() << "\n";
  return 1;
}
