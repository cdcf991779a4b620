// tmemctl: the command line for tmemd's control plane (tmem.v1 over gRPC).
//
//   tmemctl status | vms | vm NAME | watch [VM...]
//   tmemctl set-quota NAME SIZE | set-weight NAME N | set-mode NAME MODE
//   tmemctl set-policy NAME [--quota SIZE] [--weight N] [--mode MODE]
//                           [--swap-quota SIZE] [--swap-mode MODE]
//   tmemctl set-host [--memory-cap SIZE] [--cpu-budget PCT] [--mode MODE]
//   tmemctl freeze NAME | thaw NAME | flush NAME
//   tmemctl authorize NAME UUID [--revoke]
//   tmemctl attach DOMAIN [--persistent] | detach DOMAIN [--persistent]
//   tmemctl attach --swap SIZE DOMAIN | detach --swap DOMAIN
//   tmemctl policy apply FILE
//   tmemctl libvirt-hook DOMAIN OPERATION SUB-OP EXTRA  (libvirt's qemu hook;
//     the domain XML on stdin)
//
// One host by default (the local admin socket). With --host (repeatable) or
// --hosts FILE the command runs on every host at once, each under its own
// deadline, and prints one result per host; the exit code is 0 only when
// every host succeeded (1: a single host failed or bad usage, 3: some hosts
// of a fleet failed, the others applied).
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "host-agent/common/proto_mode.h"
#include "host-agent/common/size_text.h"
#include "host-agent/tmemctl/fleet_commands.h"
#include "host-agent/tmemctl/policy_file.h"
#include "proto/tmem/v1/control.grpc.pb.h"

namespace tmem {
namespace {

using nlohmann::json;

struct Options {
  std::string socket = "/run/tmemd/control.sock";
  std::vector<std::string> hosts;
  std::string hosts_file;
  std::string ca, cert, key, server_name;
  double timeout_s = 5;
  std::string output = "table";
  uint64_t generation = 0;
  // Command arguments.
  std::string vm, value, domain, uuid, file;
  bool persistent = false, revoke = false;
  std::string swap_size;  // attach --swap SIZE
  uint64_t swap_bytes = 0;
  bool swap = false;  // attach --swap / detach --swap
  std::string memory_cap, mode;
  // set-policy: "" leaves the field unchanged.
  std::string quota, weight, swap_quota, swap_mode;
  double cpu_budget = -1;
  std::vector<std::string> watch_vms;
  int interval_ms = 1000;
  int count = 0;                       // watch: 0 = until interrupted
  std::vector<std::string> hook_args;  // libvirt-hook: DOMAIN OPERATION ...
};

// What one host answered: JSON for -o json, text for people.
struct Result {
  json data;
  std::string text;
};

std::string Bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) {
    return absl::StrFormat("%.2fGiB", static_cast<double>(b) / (1 << 30));
  }
  if (b >= (uint64_t{1} << 20)) {
    return absl::StrFormat("%.1fMiB", static_cast<double>(b) / (1 << 20));
  }
  if (b >= 1024) {
    return absl::StrFormat("%.1fKiB", static_cast<double>(b) / 1024);
  }
  return absl::StrCat(b, "B");
}

// A left-aligned text table.
class Table {
 public:
  explicit Table(std::vector<std::string> header) {
    rows_.push_back(std::move(header));
  }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const {
    std::vector<size_t> w;
    for (const auto& r : rows_) {
      for (size_t i = 0; i < r.size(); ++i) {
        if (w.size() <= i) w.push_back(0);
        w[i] = std::max(w[i], r[i].size());
      }
    }
    std::string out;
    for (const auto& r : rows_) {
      std::string line;
      for (size_t i = 0; i < r.size(); ++i) {
        line += r[i];
        if (i + 1 < r.size()) line += std::string(w[i] - r[i].size() + 2, ' ');
      }
      out += line + "\n";
    }
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

json ToJson(const google::protobuf::Message& m) {
  std::string text;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &text, opts);
  return json::parse(text);
}

uint64_t CounterValue(
    const google::protobuf::RepeatedPtrField<v1::Counter>& counters,
    std::string_view name) {
  for (const v1::Counter& c : counters) {
    if (c.name() == name) return c.value();
  }
  return 0;
}

std::string Quota(uint64_t q) { return q == 0 ? "unlimited" : Bytes(q); }

std::string State(const v1::VmPolicy& p) {
  if (!p.enabled()) return "disabled";
  if (p.frozen()) return "frozen";
  return "active";
}

std::string Pct(double f) { return absl::StrFormat("%.1f%%", 100 * f); }

absl::Status FromGrpc(const grpc::Status& s) {
  return {static_cast<absl::StatusCode>(s.error_code()), s.error_message()};
}

std::string CodeName(absl::StatusCode code) {
  return absl::StatusCodeToString(code);
}

// --- one host -----------------------------------------------------------

class Host {
 public:
  Host(std::string target, const Options& o) : target_(std::move(target)) {
    if (target_.rfind("unix:", 0) == 0) {
      channel_ =
          grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
    } else {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = Read(o.ca);
      ssl.pem_private_key = Read(o.key);
      ssl.pem_cert_chain = Read(o.cert);
      grpc::ChannelArguments args;
      if (!o.server_name.empty()) {
        args.SetSslTargetNameOverride(o.server_name);
      }
      channel_ =
          grpc::CreateCustomChannel(target_, grpc::SslCredentials(ssl), args);
    }
    stub_ = v1::TmemControl::NewStub(channel_);
    deadline_ =
        std::chrono::system_clock::now() +
        std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  }
  const std::string& target() const { return target_; }
  v1::TmemControl::Stub& stub() { return *stub_; }
  void Prepare(grpc::ClientContext& ctx) const { ctx.set_deadline(deadline_); }

  template <typename Req, typename Resp>
  absl::StatusOr<Resp> Call(grpc::Status (v1::TmemControl::Stub::*method)(
                                grpc::ClientContext*, const Req&, Resp*),
                            const Req& req) {
    grpc::ClientContext ctx;
    Prepare(ctx);
    Resp resp;
    grpc::Status s = (stub_.get()->*method)(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s);
    return resp;
  }

 private:
  static std::string Read(const std::string& path) {
    if (path.empty()) return "";
    std::ifstream in(path);
    std::stringstream b;
    b << in.rdbuf();
    return b.str();
  }
  std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TmemControl::Stub> stub_;
  std::chrono::system_clock::time_point deadline_;
};

using Stub = v1::TmemControl::Stub;

// --- commands -----------------------------------------------------------

absl::StatusOr<Result> Status(Host& h) {
  auto r = h.Call(&Stub::Status, v1::StatusRequest());
  if (!r.ok()) return r.status();
  const v1::HostStatus& s = *r;
  std::string t;
  absl::StrAppendFormat(&t, "host       %s (tmemd %s, up %ds)\n", s.hostname(),
                        s.version(), s.uptime_seconds());
  absl::StrAppendFormat(
      &t, "memory     %s used of %s cap (%.1f%%), compression ratio %.2f\n",
      Bytes(s.memory_used_bytes()), Bytes(s.memory_cap_bytes()),
      s.memory_cap_bytes() == 0
          ? 0.0
          : 100.0 * static_cast<double>(s.memory_used_bytes()) /
                static_cast<double>(s.memory_cap_bytes()),
      s.compression_ratio());
  absl::StrAppendFormat(
      &t,
      "cpu        budget %.1f%% of host (now %s), tmemd uses %s, host "
      "busy %s, pressure %.1f\n",
      s.cpu_budget_percent(), Pct(s.valve().budget_fraction()),
      Pct(s.cpu_used_fraction()), Pct(s.valve().host_busy_fraction()),
      s.valve().cpu_pressure());
  absl::StrAppendFormat(&t, "valve      default mode %s, %d ticks\n",
                        ProtoModeText(s.policy().default_mode()),
                        s.valve().ticks());
  absl::StrAppendFormat(&t, "vms        %d, workers %d\n", s.vms(),
                        s.workers());
  absl::StrAppendFormat(&t, "policy     generation %d\n",
                        s.policy().generation());
  absl::StrAppendFormat(&t, "pages      %d held, gets %d hit / %d miss\n",
                        CounterValue(s.counters(), "pages_held"),
                        CounterValue(s.counters(), "gets_hit"),
                        CounterValue(s.counters(), "gets_miss"));
  return Result{ToJson(s), t};
}

absl::StatusOr<Result> Vms(Host& h) {
  auto r = h.Call(&Stub::ListVms, v1::ListVmsRequest());
  if (!r.ok()) return r.status();
  // CONN is the ivshmem channel's ("-": the VM has none); SWQUOTA and
  // SWMODE are the VM's swap policy (shown with or without a device); the
  // other SW columns are its swap device's ("-": none): size, front-end
  // attached, pages held (of them spilled to disk), read and write
  // requests.
  Table t({"NAME",    "CONN",     "STATE",   "MODE",   "QUOTA",  "WEIGHT",
           "SWQUOTA", "SWMODE",   "PAGES",   "STORED", "HIT%",   "PUTS",
           "GETS",    "DECISION", "GEN",     "SWAP",   "SWCONN", "SWPAGES",
           "SWSPILL", "SWREADS",  "SWWRITES"});
  for (const v1::VmSummary& v : r->vms()) {
    const bool sw = v.has_swap();
    const v1::SwapDevice& d = v.swap();
    auto swap_col = [sw](const std::string& text) {
      return sw ? text : std::string("-");
    };
    t.Add({v.name(),
           !v.has_channel() ? "-"
           : v.connected()  ? "yes"
                            : "no",
           State(v.policy()),
           ProtoModeText(v.policy().mode()),
           Quota(v.policy().quota_bytes()),
           absl::StrCat(v.policy().weight()),
           Quota(v.policy().swap_quota_bytes()),
           ProtoModeText(v.policy().swap_mode()),
           absl::StrCat(v.pages()),
           Bytes(v.stored_bytes()),
           Pct(v.hit_ratio()),
           absl::StrCat(v.puts()),
           absl::StrCat(v.gets_hit() + v.gets_miss()),
           v.decision(),
           absl::StrCat(v.policy().generation()),
           swap_col(Bytes(d.size_bytes())),
           swap_col(d.connected() ? "yes" : "no"),
           swap_col(absl::StrCat(d.stored_pages())),
           swap_col(absl::StrCat(d.spilled_pages())),
           swap_col(absl::StrCat(d.reads())),
           swap_col(absl::StrCat(d.writes()))});
  }
  return Result{ToJson(*r), t.Render()};
}

absl::StatusOr<Result> Vm(Host& h, const std::string& name) {
  v1::GetVmRequest req;
  req.set_vm(name);
  auto r = h.Call(&Stub::GetVm, req);
  if (!r.ok()) return r.status();
  const v1::VmSummary& s = r->summary();
  std::string t;
  absl::StrAppendFormat(&t, "vm         %s (%s, socket %s)\n", s.name(),
                        s.connected() ? "connected" : "not connected",
                        r->socket_path());
  absl::StrAppendFormat(
      &t,
      "policy     %s, mode %s, quota %s, weight %d, swap quota %s, swap "
      "mode %s, generation %d\n",
      State(s.policy()), ProtoModeText(s.policy().mode()),
      Quota(s.policy().quota_bytes()), s.policy().weight(),
      Quota(s.policy().swap_quota_bytes()),
      ProtoModeText(s.policy().swap_mode()), s.policy().generation());
  absl::StrAppendFormat(
      &t,
      "valve      %s (effective mode %s), admission %d/65536, reuse %.3f%s\n",
      s.decision(), ProtoModeText(r->valve().effective_mode()),
      r->valve().admission(), r->valve().reuse_ratio(),
      r->valve().throttled() ? ", throttled" : "");
  absl::StrAppendFormat(&t, "held       %d pages, %s stored, %s charged\n",
                        s.pages(), Bytes(s.stored_bytes()),
                        Bytes(s.charged_bytes()));
  Table c({"COUNTER", "VALUE"});
  for (const v1::Counter& k : r->counters()) {
    c.Add({k.name(), absl::StrCat(k.value())});
  }
  for (const v1::Counter& k : r->valve().counters()) {
    c.Add({"valve_" + k.name(), absl::StrCat(k.value())});
  }
  for (const v1::Counter& k : r->channel_counters()) {
    c.Add({"channel_" + k.name(), absl::StrCat(k.value())});
  }
  if (s.has_swap()) {
    const v1::SwapDevice& d = s.swap();
    auto mean_us = [](uint64_t ns, uint64_t calls) {
      return calls == 0 ? 0.0
                        : static_cast<double>(ns) / 1000.0 /
                              static_cast<double>(calls);
    };
    absl::StrAppendFormat(
        &t,
        "swap       %s at %s (%s): %d pages (%d in memory in %s, %d "
        "spilled, %d lost), %d discarded; %d reads (%.1f us), %d writes "
        "(%.1f us)\n",
        Bytes(d.size_bytes()), d.socket_path(),
        d.connected() ? "connected" : "not connected", d.stored_pages(),
        d.memory_pages(), Bytes(d.memory_bytes()), d.spilled_pages(),
        d.lost_pages(), d.discarded_pages(), d.reads(),
        mean_us(d.read_ns(), d.read_calls()), d.writes(),
        mean_us(d.write_ns(), d.write_calls()));
    for (const v1::Counter& k : d.counters()) {
      c.Add({"swap_" + k.name(), absl::StrCat(k.value())});
    }
    for (const v1::Counter& k : d.backing_counters()) {
      c.Add({"swap_backing_" + k.name(), absl::StrCat(k.value())});
    }
  }
  t += "\n" + c.Render();
  if (!r->pools().empty()) {
    Table p({"POOL", "KIND", "UUID", "PAGES", "STORED", "HITS", "MISSES"});
    for (const v1::PoolStats& ps : r->pools()) {
      p.Add({absl::StrCat(ps.id()), ps.shared() ? "shared" : "private",
             ps.shared() ? ps.uuid() : "-",
             absl::StrCat(CounterValue(ps.counters(), "pages_held")),
             Bytes(CounterValue(ps.counters(), "stored_bytes")),
             absl::StrCat(CounterValue(ps.counters(), "gets_hit")),
             absl::StrCat(CounterValue(ps.counters(), "gets_miss"))});
    }
    t += "\n" + p.Render();
  }
  return Result{ToJson(*r), t};
}

absl::StatusOr<Result> PolicyResult(
    const absl::StatusOr<v1::SetVmPolicyResponse>& r, const std::string& vm) {
  if (!r.ok()) return r.status();
  const v1::VmPolicy& p = r->policy();
  return Result{
      ToJson(*r),
      absl::StrFormat("%s: %s, mode %s, quota %s, weight %d, swap quota %s, "
                      "swap mode %s (generation %d)\n",
                      vm, State(p), ProtoModeText(p.mode()),
                      Quota(p.quota_bytes()), p.weight(),
                      Quota(p.swap_quota_bytes()), ProtoModeText(p.swap_mode()),
                      p.generation())};
}

absl::StatusOr<Result> SetVmPolicy(Host& h, const v1::SetVmPolicyRequest& req) {
  return PolicyResult(h.Call(&Stub::SetVmPolicy, req), req.vm());
}

// set-policy's flags as one patch; a flag not given leaves its field alone.
// Sizes and modes are checked here, naming the flag; ranges by tmemd.
absl::StatusOr<v1::SetVmPolicyRequest> SetPolicyRequest(const Options& o) {
  v1::SetVmPolicyRequest req;
  req.set_vm(o.vm);
  req.set_generation(o.generation);
  auto flag_error = [](std::string_view flag, const std::string& value,
                       const absl::Status& s) {
    return absl::InvalidArgumentError(absl::StrCat(
        "set-policy ", std::string(flag), " '", value, "': ", s.message()));
  };
  if (!o.quota.empty()) {
    absl::StatusOr<uint64_t> q = ParseQuota(o.quota);
    if (!q.ok()) return flag_error("--quota", o.quota, q.status());
    req.set_quota_bytes(*q);
  }
  if (!o.weight.empty()) {
    int64_t w = 0;
    if (!absl::SimpleAtoi(o.weight, &w)) {
      return flag_error("--weight", o.weight,
                        absl::InvalidArgumentError("not an integer"));
    }
    req.set_weight(w);  // range checked by tmemd
  }
  if (!o.mode.empty()) {
    absl::StatusOr<v1::Mode> m =
        ProtoModeFromText(o.mode, DefaultMode::kAllowed, "set-policy --mode");
    if (!m.ok()) return m.status();
    req.set_mode(*m);
  }
  if (!o.swap_quota.empty()) {
    absl::StatusOr<uint64_t> q = ParseQuota(o.swap_quota);
    if (!q.ok()) return flag_error("--swap-quota", o.swap_quota, q.status());
    req.set_swap_quota_bytes(*q);
  }
  if (!o.swap_mode.empty()) {
    absl::StatusOr<v1::Mode> m = ProtoModeFromText(
        o.swap_mode, DefaultMode::kAllowed, "set-policy --swap-mode");
    if (!m.ok()) return m.status();
    req.set_swap_mode(*m);
  }
  if (o.quota.empty() && o.weight.empty() && o.mode.empty() &&
      o.swap_quota.empty() && o.swap_mode.empty()) {
    return absl::InvalidArgumentError(
        "set-policy: nothing to set (give --quota, --weight, --mode, "
        "--swap-quota or --swap-mode)");
  }
  return req;
}

absl::StatusOr<Result> SetHost(Host& h, const v1::SetHostPolicyRequest& req) {
  auto r = h.Call(&Stub::SetHostPolicy, req);
  if (!r.ok()) return r.status();
  const v1::HostPolicy& p = r->policy();
  return Result{
      ToJson(*r),
      absl::StrFormat("host: memory cap %s, cpu budget %.1f%%, "
                      "default mode %s (generation %d)\n",
                      Bytes(p.memory_cap_bytes()), p.cpu_budget_percent(),
                      ProtoModeText(p.default_mode()), p.generation())};
}

absl::StatusOr<Result> Domain(Host& h, bool attach, const Options& o) {
  v1::DomainRequest req;
  req.set_domain(o.domain);
  req.set_persistent(o.persistent);
  req.set_swap(o.swap);
  if (attach) req.set_swap_size_bytes(o.swap_bytes);
  auto r = attach ? h.Call(&Stub::AttachDomain, req)
                  : h.Call(&Stub::DetachDomain, req);
  if (!r.ok()) return r.status();
  if (o.swap) {
    return Result{ToJson(*r), absl::StrFormat("%s: vm %s, %s\n", r->domain(),
                                              r->vm(), r->detail())};
  }
  return Result{ToJson(*r),
                absl::StrFormat("%s: vm %s, %s%s%s\n", r->domain(), r->vm(),
                                r->attached() ? "attached" : "not attached",
                                r->persistent() ? " (persistent)" : "",
                                r->detail().empty() ? "" : ", " + r->detail())};
}

// libvirt's qemu hook (/etc/libvirt/hooks/qemu.d/tmemd): libvirt runs it as
// root with the domain XML on stdin, for every domain and operation, and
// does not start a domain whose "prepare" hook fails. So it answers 0 at
// once for operations tmemd has nothing to do with and for domains without
// an ivshmem-doorbell device (without asking tmemd: those domains must
// start even when tmemd is down), and fails, saying why, only when a tmem
// domain's socket could not be made ready.
//
// "migrate" runs on the destination before the incoming QEMU starts, and
// a failure cancels the migration: it fails for a domain with a disk on a
// tmemd swap socket (tmemd does not migrate swap devices). It never writes
// to stdout: libvirt takes what a migrate hook prints as the domain XML to
// use instead.
int LibvirtHook(const std::vector<std::string>& targets, const Options& o) {
  if (o.hook_args.size() < 2) {
    std::cerr << "tmemctl libvirt-hook: want DOMAIN OPERATION [SUB-OP "
                 "EXTRA], as libvirt calls hooks\n";
    return 1;
  }
  const std::string& operation = o.hook_args[1];
  const bool migrate = operation == "migrate";
  if (operation != "prepare" && operation != "release" && !migrate) return 0;
  std::stringstream xml;
  xml << std::cin.rdbuf();
  // Without a vhost-user disk there is no swap device to refuse.
  const std::string_view device = migrate ? "vhostuser" : "ivshmem-doorbell";
  if (xml.str().find(device) == std::string::npos) return 0;
  if (targets.size() != 1) {
    std::cerr << "tmemctl libvirt-hook: one host (the local tmemd) only\n";
    return 1;
  }
  v1::LibvirtHookRequest req;
  req.set_operation(operation);
  req.set_domain_xml(xml.str());
  Host h(targets[0], o);
  auto r = h.Call(&Stub::LibvirtHook, req);
  if (migrate && !r.ok() &&
      r.status().code() == absl::StatusCode::kUnavailable) {
    // tmemd is down here: another program's vhost-user disk must not stop
    // the migration, but a disk on what looks like a tmemd swap socket
    // still does (tmemd cannot say which directory is its).
    if (xml.str().find(".swap.sock") == std::string::npos) return 0;
    std::cerr << "tmemctl libvirt-hook: migrate: domain '" << o.hook_args[0]
              << "' has a vhost-user disk on a *.swap.sock socket, which "
                 "looks like a tmemd swap device, and tmemd cannot migrate "
                 "swap devices; tmemd is not reachable to say otherwise ("
              << r.status().message() << ")\n";
    return 1;
  }
  if (!r.ok()) {
    // tmemd's message names the domain.
    std::cerr << "tmemctl libvirt-hook: " << operation << ": "
              << r.status().message() << "\n";
    return 1;
  }
  if (!migrate) {
    std::cout << "tmemd: " << operation << " " << r->domain() << ": "
              << r->detail() << "\n";
  }
  return 0;
}

absl::StatusOr<Result> ApplyPolicy(Host& h, const PolicyFile& file) {
  // Applies everything, reports every item; fails if any item failed.
  json items = json::array();
  std::string text;
  int failed = 0;
  auto note = [&](const std::string& what, const absl::Status& s,
                  const json& data) {
    items.push_back({{"item", what},
                     {"ok", s.ok()},
                     {"error", s.ok() ? "" : std::string(s.message())},
                     {"result", data}});
    if (s.ok()) {
      absl::StrAppend(&text, "  ", what, ": applied\n");
    } else {
      ++failed;
      absl::StrAppend(&text, "  ", what, ": FAILED (", CodeName(s.code()),
                      "): ", s.message(), "\n");
    }
  };
  if (file.host) {
    auto r = h.Call(&Stub::SetHostPolicy, *file.host);
    note("host", r.status(), r.ok() ? ToJson(*r) : json());
  }
  for (const v1::SetVmPolicyRequest& vm : file.vms) {
    auto r = h.Call(&Stub::SetVmPolicy, vm);
    note("vm " + vm.vm(), r.status(), r.ok() ? ToJson(*r) : json());
  }
  if (failed > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        failed, " of ", items.size(), " policy items failed:\n", text));
  }
  return Result{json{{"items", items}}, text};
}

// watch: one table per sample, rates from consecutive samples.
int Watch(const std::string& target, const Options& o) {
  Host h(target, o);
  grpc::ClientContext ctx;  // no deadline: runs until interrupted
  v1::WatchStatsRequest req;
  req.set_interval_ms(static_cast<uint32_t>(o.interval_ms));
  for (const std::string& vm : o.watch_vms) req.add_vms(vm);
  std::unique_ptr<grpc::ClientReader<v1::StatsSample>> reader =
      h.stub().WatchStats(&ctx, req);
  v1::StatsSample prev, cur;
  bool have_prev = false;
  int n = 0;
  const bool tty = isatty(STDOUT_FILENO) != 0 && o.output != "json";
  while (reader->Read(&cur)) {
    ++n;
    const double dt = have_prev
                          ? static_cast<double>(cur.timestamp_unix_ms() -
                                                prev.timestamp_unix_ms()) /
                                1000.0
                          : 0.0;
    auto rate = [&](const v1::VmDetail& v, uint64_t now_value,
                    uint64_t (*pick)(const v1::VmDetail&)) -> double {
      if (!have_prev || dt <= 0) return 0;
      for (const v1::VmDetail& p : prev.vms()) {
        if (p.summary().name() == v.summary().name()) {
          const uint64_t before = pick(p);
          return now_value >= before
                     ? static_cast<double>(now_value - before) / dt
                     : 0.0;
        }
      }
      return 0;
    };
    auto puts = [](const v1::VmDetail& v) { return v.summary().puts(); };
    auto gets = [](const v1::VmDetail& v) {
      return v.summary().gets_hit() + v.summary().gets_miss();
    };
    if (o.output == "json") {
      json line = ToJson(cur);
      std::cout << line.dump() << std::endl;
    } else {
      Table t({"VM", "HIT%", "PUTS/S", "GETS/S", "PAGES", "STORED", "QUOTA",
               "DECISION"});
      for (const v1::VmDetail& v : cur.vms()) {
        const v1::VmSummary& s = v.summary();
        t.Add({s.name(), Pct(s.hit_ratio()),
               absl::StrFormat("%.0f", rate(v, puts(v), puts)),
               absl::StrFormat("%.0f", rate(v, gets(v), gets)),
               absl::StrCat(s.pages()), Bytes(s.stored_bytes()),
               Quota(s.policy().quota_bytes()), s.decision()});
      }
      if (tty) std::cout << "\033[H\033[2J";
      std::cout << absl::StrFormat(
                       "%s  memory %s/%s  tmemd cpu %s  (every %d ms)\n",
                       cur.host().hostname(),
                       Bytes(cur.host().memory_used_bytes()),
                       Bytes(cur.host().memory_cap_bytes()),
                       Pct(cur.host().cpu_used_fraction()), o.interval_ms)
                << t.Render() << std::endl;
    }
    prev = cur;
    have_prev = true;
    if (o.count > 0 && n >= o.count) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
    std::cerr << "tmemctl: " << target << ": " << CodeName(FromGrpc(s).code())
              << ": " << s.error_message() << "\n";
    return 1;
  }
  return 0;
}

// --- fan-out --------------------------------------------------------------

using Command = std::function<absl::StatusOr<Result>(Host&)>;

int RunEverywhere(const std::vector<std::string>& targets, const Options& o,
                  const Command& command) {
  std::vector<absl::StatusOr<Result>> results(targets.size(),
                                              absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < targets.size(); ++i) {
    threads.emplace_back([&, i] {
      Host h(targets[i], o);
      results[i] = command(h);
    });
  }
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (const auto& r : results) failed += r.ok() ? 0 : 1;
  const bool fleet = targets.size() > 1;
  if (o.output == "json") {
    json out = json::array();
    for (size_t i = 0; i < targets.size(); ++i) {
      const auto& r = results[i];
      json e = {{"host", targets[i]}, {"ok", r.ok()}};
      if (r.ok()) {
        e["result"] = r->data;
      } else {
        e["code"] = CodeName(r.status().code());
        e["error"] = std::string(r.status().message());
      }
      out.push_back(e);
    }
    if (!fleet && results[0].ok()) {
      std::cout << results[0]->data.dump(2) << "\n";
    } else {
      std::cout << json{{"hosts", out}, {"failed", failed}}.dump(2) << "\n";
    }
  } else {
    for (size_t i = 0; i < targets.size(); ++i) {
      const auto& r = results[i];
      if (fleet) {
        std::cout << "== " << targets[i] << ": " << (r.ok() ? "OK" : "FAILED")
                  << "\n";
      }
      if (r.ok()) {
        std::cout << r->text;
      } else {
        (fleet ? std::cout : std::cerr)
            << (fleet ? "" : "tmemctl: ") << CodeName(r.status().code()) << ": "
            << r.status().message() << "\n";
      }
    }
    if (fleet) {
      std::cout << "== " << targets.size() - failed << " of " << targets.size()
                << " hosts succeeded";
      if (failed > 0) std::cout << "; " << failed << " FAILED";
      std::cout << "\n";
    }
  }
  if (failed == 0) return 0;
  return fleet && failed < static_cast<int>(targets.size()) ? 3 : 1;
}

std::vector<std::string> Targets(const Options& o, std::string* error) {
  std::vector<std::string> t = o.hosts;
  if (!o.hosts_file.empty()) {
    std::ifstream in(o.hosts_file);
    if (!in) {
      *error = "cannot read hosts file '" + o.hosts_file + "'";
      return {};
    }
    std::string line;
    while (std::getline(in, line)) {
      const size_t hash = line.find('#');
      if (hash != std::string::npos) line.resize(hash);
      const size_t a = line.find_first_not_of(" \t\r");
      if (a == std::string::npos) continue;
      const size_t b = line.find_last_not_of(" \t\r");
      t.push_back(line.substr(a, b - a + 1));
    }
  }
  if (t.empty()) t.push_back("unix:" + o.socket);
  for (std::string& h : t) {
    if (h.rfind('/', 0) == 0) h.insert(0, "unix:");
  }
  return t;
}

int Run(int argc, char** argv) {
  Options o;
  CLI::App app{
      "tmemctl: control tmemd (transcendent memory) on one host or a "
      "fleet"};
  app.require_subcommand(1);
  app.add_option("-s,--socket", o.socket,
                 "tmemd's admin socket (/run/tmemd/control.sock)");
  app.add_option("-H,--host", o.hosts,
                 "target: HOST:PORT (mTLS) or unix:PATH; repeatable");
  app.add_option("--hosts", o.hosts_file, "file with one target per line");
  app.add_option("--ca", o.ca, "CA certificate (PEM) for TCP targets");
  app.add_option("--cert", o.cert, "client certificate (PEM)");
  app.add_option("--key", o.key, "client key (PEM)");
  app.add_option("--server-name", o.server_name,
                 "expected server certificate name (default: the host)");
  auto* timeout = app.add_option("-t,--timeout", o.timeout_s,
                                 "per-host deadline, seconds (5; attach and "
                                 "detach: 30)");
  app.add_option("-o,--output", o.output, "table|json")
      ->check(CLI::IsMember({"table", "json"}));

  auto* status = app.add_subcommand("status", "host status");
  auto* vms = app.add_subcommand("vms", "list VMs");
  auto* vm = app.add_subcommand("vm", "one VM in detail");
  vm->add_option("name", o.vm)->required();
  auto* set_quota = app.add_subcommand("set-quota", "set a VM's quota");
  set_quota->add_option("name", o.vm)->required();
  set_quota->add_option("size", o.value, "e.g. 512MiB, or unlimited")
      ->required();
  auto* set_weight = app.add_subcommand("set-weight", "set a VM's weight");
  set_weight->add_option("name", o.vm)->required();
  set_weight->add_option("weight", o.value, "1..1000000")->required();
  auto* set_mode = app.add_subcommand("set-mode", "set a VM's valve mode");
  set_mode->add_option("name", o.vm)->required();
  set_mode->add_option("mode", o.value, "default|off|always|adaptive")
      ->required();
  auto* set_policy = app.add_subcommand(
      "set-policy", "set several of a VM's policy fields in one push");
  set_policy->add_option("name", o.vm)->required();
  set_policy->add_option("--quota", o.quota, "e.g. 512MiB, or unlimited");
  set_policy->add_option("--weight", o.weight, "1..1000000");
  set_policy->add_option("--mode", o.mode, "default|off|always|adaptive");
  set_policy->add_option("--swap-quota", o.swap_quota,
                         "how much of the quota swap pages may take, e.g. "
                         "256MiB, or unlimited; past it they go to the spill "
                         "image");
  set_policy->add_option("--swap-mode", o.swap_mode,
                         "how swap pages are stored: default (follow "
                         "--mode)|off (all to the spill image)|always|"
                         "adaptive");
  for (auto* c : {set_quota, set_weight, set_mode, set_policy}) {
    c->add_option("-g,--generation", o.generation,
                  "policy generation (0: the next one)");
  }
  auto* set_host = app.add_subcommand("set-host", "set host policy");
  set_host->add_option("--memory-cap", o.memory_cap, "e.g. 4GiB");
  set_host->add_option("--cpu-budget", o.cpu_budget, "percent of the host");
  set_host->add_option("--mode", o.mode, "default mode: off|always|adaptive");
  set_host->add_option("-g,--generation", o.generation,
                       "policy generation (0: the next one)");
  auto* freeze = app.add_subcommand("freeze", "refuse a VM's puts, keep gets");
  freeze->add_option("name", o.vm)->required();
  auto* thaw = app.add_subcommand("thaw", "undo freeze");
  thaw->add_option("name", o.vm)->required();
  auto* flush = app.add_subcommand("flush", "drop a VM's pages");
  flush->add_option("name", o.vm)->required();
  auto* authorize =
      app.add_subcommand("authorize", "allow a VM into a shared pool");
  authorize->add_option("name", o.vm)->required();
  authorize->add_option("uuid", o.uuid, "filesystem UUID")->required();
  authorize->add_flag("--revoke", o.revoke, "take the permission back");
  auto* attach = app.add_subcommand("attach", "attach tmem to a domain");
  attach->add_option("domain", o.domain)->required();
  auto* attach_persistent = attach->add_flag("--persistent", o.persistent,
                                             "also in the persistent XML");
  attach
      ->add_option("--swap", o.swap_size,
                   "SIZE: a tmemd swap device (e.g. 1GiB) in the persistent "
                   "XML, from the next cold boot")
      ->excludes(attach_persistent);
  auto* detach = app.add_subcommand("detach", "detach tmem from a domain");
  detach->add_option("domain", o.domain)->required();
  auto* detach_persistent = detach->add_flag("--persistent", o.persistent,
                                             "also from persistent XML");
  detach
      ->add_flag("--swap", o.swap,
                 "the swap device (from the persistent XML) instead")
      ->excludes(detach_persistent);
  auto* hook = app.add_subcommand(
      "libvirt-hook",
      "libvirt's qemu hook: DOMAIN OPERATION SUB-OP EXTRA, XML on stdin");
  hook->add_option("args", o.hook_args, "as libvirt passes them");
  // For libvirtd, not for people: not in --help or completion (tmemctl(1)).
  hook->group("");
  auto* watch = app.add_subcommand("watch", "live per-VM table");
  watch->add_option("vms", o.watch_vms, "VMs to show (all)");
  watch->add_option("-i,--interval-ms", o.interval_ms, "refresh (1000)");
  watch->add_option("-n,--count", o.count, "stop after N samples");
  auto* policy = app.add_subcommand("policy", "declarative policy");
  policy->require_subcommand(1);
  auto* apply = policy->add_subcommand("apply", "apply a TOML or JSON file");
  apply->add_option("file", o.file)->required();
  FleetCliOptions fo;
  auto* fleet = app.add_subcommand(
      "fleet", "fleet policy in etcd (docs/fleet.md); exit 3: not converged");
  fleet->require_subcommand(1);
  fleet->add_option("--etcd", fo.endpoints, "etcd endpoints host:port,...")
      ->delimiter(',')
      ->required();
  fleet->add_option("--etcd-cert", fo.tls_cert, "client certificate (PEM)");
  fleet->add_option("--etcd-key", fo.tls_key, "client key (PEM)");
  fleet->add_option("--etcd-ca", fo.tls_ca, "etcd's CA (PEM)");
  auto* fleet_apply =
      fleet->add_subcommand("apply", "make FILE the whole fleet policy");
  fleet_apply->add_option("file", fo.file)->required();
  fleet_apply->add_flag("--dry-run", fo.dry_run, "show the diff only");
  auto* fleet_status = fleet->add_subcommand("status", "hosts' convergence");
  fleet_status->add_flag("--json", fo.json, "JSON output");
  fleet->add_subcommand("history", "past applies");
  auto* fleet_rollback =
      fleet->add_subcommand("rollback", "apply the policy of revision REV");
  fleet_rollback->add_option("revision", fo.revision)->required();
  fleet_rollback->add_flag("--dry-run", fo.dry_run, "show the diff only");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // libvirt answers a live detach only after waiting up to 5 s for the
  // guest's unplug ack (a guest without ACPI hot-plug never sends it), and
  // an attach waits for QEMU's device_add: 5 s would report
  // DEADLINE_EXCEEDED for a request that went through.
  if ((*attach || *detach) && timeout->count() == 0) o.timeout_s = 30;
  if (*fleet) {
    fo.command = fleet->get_subcommands().front()->get_name();
    return RunFleetCommand(fo, std::cout, std::cerr);
  }
  std::string error;
  const std::vector<std::string> targets = Targets(o, &error);
  if (!error.empty()) {
    std::cerr << "tmemctl: " << error << "\n";
    return 1;
  }
  auto usage = [](const absl::Status& s) {
    std::cerr << "tmemctl: " << s.message() << "\n";
    return 1;
  };

  Command command;
  if (*status) {
    command = Status;
  } else if (*vms) {
    command = Vms;
  } else if (*vm) {
    command = [&](Host& h) { return Vm(h, o.vm); };
  } else if (*set_quota || *set_weight || *set_mode) {
    v1::SetVmPolicyRequest req;
    req.set_vm(o.vm);
    req.set_generation(o.generation);
    if (*set_quota) {
      absl::StatusOr<uint64_t> q = ParseQuota(o.value);
      if (!q.ok()) return usage(q.status());
      req.set_quota_bytes(*q);
    } else if (*set_weight) {
      int64_t w = 0;
      if (!absl::SimpleAtoi(o.value, &w)) {
        return usage(absl::InvalidArgumentError(
            absl::StrCat("weight '", o.value, "' is not an integer")));
      }
      req.set_weight(w);  // range checked by tmemd
    } else {
      absl::StatusOr<v1::Mode> m =
          ProtoModeFromText(o.value, DefaultMode::kAllowed, "set-mode MODE");
      if (!m.ok()) return usage(m.status());
      req.set_mode(*m);
    }
    command = [req](Host& h) { return SetVmPolicy(h, req); };
  } else if (*set_policy) {
    absl::StatusOr<v1::SetVmPolicyRequest> req = SetPolicyRequest(o);
    if (!req.ok()) return usage(req.status());
    command = [r = *req](Host& h) { return SetVmPolicy(h, r); };
  } else if (*set_host) {
    v1::SetHostPolicyRequest req;
    req.set_generation(o.generation);
    if (!o.memory_cap.empty()) {
      absl::StatusOr<uint64_t> cap = ParseSize(o.memory_cap);
      if (!cap.ok()) return usage(cap.status());
      req.set_memory_cap_bytes(*cap);
    }
    if (o.cpu_budget >= 0) req.set_cpu_budget_percent(o.cpu_budget);
    if (!o.mode.empty()) {
      absl::StatusOr<v1::Mode> m =
          ProtoModeFromText(o.mode, DefaultMode::kRefused, "set-host --mode");
      if (!m.ok()) return usage(m.status());
      req.set_default_mode(*m);
    }
    command = [req](Host& h) { return SetHost(h, req); };
  } else if (*freeze || *thaw) {
    const bool frz = freeze->parsed();
    command = [&, frz](Host& h) {
      v1::VmRequest req;
      req.set_vm(o.vm);
      return PolicyResult(
          frz ? h.Call(&Stub::FreezeVm, req) : h.Call(&Stub::ThawVm, req),
          o.vm);
    };
  } else if (*flush) {
    command = [&](Host& h) -> absl::StatusOr<Result> {
      v1::VmRequest req;
      req.set_vm(o.vm);
      auto r = h.Call(&Stub::FlushVm, req);
      if (!r.ok()) return r.status();
      return Result{ToJson(*r), absl::StrCat(o.vm, ": dropped ",
                                             r->pages_dropped(), " pages\n")};
    };
  } else if (*authorize) {
    command = [&](Host& h) -> absl::StatusOr<Result> {
      v1::AuthorizeSharedPoolRequest req;
      req.set_vm(o.vm);
      req.set_uuid(o.uuid);
      req.set_revoke(o.revoke);
      auto r = h.Call(&Stub::AuthorizeSharedPool, req);
      if (!r.ok()) return r.status();
      return Result{ToJson(*r), absl::StrCat(o.vm,
                                             o.revoke ? ": revoked from "
                                                      : ": may "
                                                        "join ",
                                             "shared pool ", o.uuid, "\n")};
    };
  } else if (*attach || *detach) {
    const bool att = attach->parsed();
    if (att && attach->count("--swap") > 0) {
      absl::StatusOr<uint64_t> size = ParseSize(o.swap_size);
      if (!size.ok()) {
        return usage(absl::InvalidArgumentError(absl::StrCat(
            "attach --swap '", o.swap_size, "': ", size.status().message())));
      }
      if (*size == 0) {
        return usage(absl::InvalidArgumentError(
            "attach --swap '" + o.swap_size + "': a swap device needs a size"));
      }
      o.swap = true;
      o.swap_bytes = *size;
    }
    command = [&, att](Host& h) { return Domain(h, att, o); };
  } else if (*hook) {
    return LibvirtHook(targets, o);
  } else if (*watch) {
    if (targets.size() != 1) {
      std::cerr << "tmemctl: watch shows one host; give one --host\n";
      return 1;
    }
    return Watch(targets[0], o);
  } else if (*apply) {
    absl::StatusOr<PolicyFile> file = LoadPolicyFile(o.file);
    if (!file.ok()) return usage(file.status());
    command = [f = *file](Host& h) { return ApplyPolicy(h, f); };
  }
  return RunEverywhere(targets, o, command);
}

}  // namespace
}  // namespace tmem

int main(int argc, char** argv) {
  try {
    return tmem::Run(argc, argv);
  } catch (const std::exception& e) {
    // Nothing here throws on purpose; a library might (std::bad_alloc).
    std::cerr << "tmemctl: " << e.what() << "\n";
    return 1;
  }
}
