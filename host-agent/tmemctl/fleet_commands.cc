#include "host-agent/tmemctl/fleet_commands.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "host-agent/fleet/etcd_client.h"
#include "host-agent/fleet/fleet_policy.h"

namespace tmem {
namespace {

using nlohmann::json;

bool IsLayerKey(const std::string& key) { return key != kFleetAppliedKey; }

struct Snapshot {
  std::map<std::string, std::string> layers;  // policy keys, not "applied"
  int64_t applied_mod_revision = 0;           // 0: never applied
  int64_t newest_layer_revision = 0;
  int64_t revision = 0;  // header revision
};

absl::StatusOr<Snapshot> ReadPolicy(EtcdClient& etcd, int64_t at_revision) {
  etcdserverpb::RangeRequest r;
  r.set_key(kFleetPolicyPrefix);
  r.set_range_end(EtcdPrefixEnd(kFleetPolicyPrefix));
  r.set_revision(at_revision);
  absl::StatusOr<etcdserverpb::RangeResponse> resp = etcd.Range(r);
  if (!resp.ok()) return resp.status();
  Snapshot s;
  s.revision = resp->header().revision();
  for (const mvccpb::KeyValue& kv : resp->kvs()) {
    if (IsLayerKey(kv.key())) {
      s.layers[kv.key()] = kv.value();
      s.newest_layer_revision =
          std::max(s.newest_layer_revision, kv.mod_revision());
    } else {
      s.applied_mod_revision = kv.mod_revision();
    }
  }
  return s;
}

// Writes `desired` as the whole policy, guarded by the snapshot's applied
// revision (a concurrent apply makes this one fail, not interleave).
int Apply(EtcdClient& etcd, const std::map<std::string, std::string>& desired,
          const std::string& source, bool dry_run, std::ostream& out,
          std::ostream& err) {
  absl::StatusOr<Snapshot> now = ReadPolicy(etcd, 0);
  if (!now.ok()) {
    err << "tmemctl: " << now.status().message() << "\n";
    return 1;
  }
  int changes = 0;
  for (const auto& [k, v] : desired) {
    auto it = now->layers.find(k);
    if (it == now->layers.end()) {
      out << "+ " << k << " " << v << "\n";
      ++changes;
    } else if (it->second != v) {
      out << "~ " << k << " " << it->second << " -> " << v << "\n";
      ++changes;
    }
  }
  std::vector<std::string> removed;
  for (const auto& [k, v] : now->layers) {
    if (desired.count(k) == 0) {
      out << "- " << k << "\n";
      removed.push_back(k);
      ++changes;
    }
  }
  if (changes == 0) out << "no change to the policy keys\n";
  if (dry_run) {
    out << "dry run: nothing written (" << changes << " changes)\n";
    return 0;
  }
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* guard = txn.add_compare();
  guard->set_key(kFleetAppliedKey);
  guard->set_result(etcdserverpb::Compare::EQUAL);
  if (now->applied_mod_revision == 0) {
    guard->set_target(etcdserverpb::Compare::VERSION);
    guard->set_version(0);
  } else {
    guard->set_target(etcdserverpb::Compare::MOD);
    guard->set_mod_revision(now->applied_mod_revision);
  }
  // Every key is written even if unchanged, and the applied key always:
  // each apply is one new revision every watcher sees.
  for (const auto& [k, v] : desired) {
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(k);
    put->set_value(v);
  }
  for (const std::string& k : removed) {
    txn.add_success()->mutable_request_delete_range()->set_key(k);
  }
  etcdserverpb::PutRequest* mark = txn.add_success()->mutable_request_put();
  mark->set_key(kFleetAppliedKey);
  mark->set_value(json{{"version", kFleetFormatVersion},
                       {"source", source},
                       {"keys", desired.size()}}
                      .dump());
  absl::StatusOr<etcdserverpb::TxnResponse> resp = etcd.Txn(txn);
  if (!resp.ok()) {
    err << "tmemctl: " << resp.status().message() << "\n";
    return 1;
  }
  if (!resp->succeeded()) {
    err << "tmemctl: another apply happened meanwhile; nothing written. "
           "Check `tmemctl fleet history` and retry.\n";
    return 1;
  }
  out << "applied at revision " << resp->header().revision() << " (" << changes
      << " changes)\n";
  return 0;
}

int Status(EtcdClient& etcd, bool as_json, std::ostream& out,
           std::ostream& err) {
  absl::StatusOr<Snapshot> policy = ReadPolicy(etcd, 0);
  if (!policy.ok()) {
    err << "tmemctl: " << policy.status().message() << "\n";
    return 1;
  }
  const int64_t desired =
      std::max(policy->applied_mod_revision, policy->newest_layer_revision);
  std::map<std::string, json> hosts;  // host -> status (null: none)
  for (const char* prefix : {kFleetMembersPrefix, kFleetStatusPrefix}) {
    etcdserverpb::RangeRequest r;
    r.set_key(prefix);
    r.set_range_end(EtcdPrefixEnd(prefix));
    absl::StatusOr<etcdserverpb::RangeResponse> resp = etcd.Range(r);
    if (!resp.ok()) {
      err << "tmemctl: " << resp.status().message() << "\n";
      return 1;
    }
    const bool is_status = std::string(prefix) == kFleetStatusPrefix;
    for (const mvccpb::KeyValue& kv : resp->kvs()) {
      const std::string host = kv.key().substr(std::string(prefix).size());
      json& slot = hosts[host];
      if (is_status) {
        slot = json::parse(kv.value(), nullptr, false);
        if (slot.is_discarded() || !slot.is_object()) {
          slot = json{{"rejected_reason", "unreadable status value"}};
        }
      }
    }
  }
  int converged = 0;
  json rows = json::array();
  for (const auto& [host, st] : hosts) {
    std::string state;
    int64_t applied = 0;
    std::string reason;
    if (st.is_null()) {
      state = "gone";
    } else {
      applied = st.value("applied_revision", int64_t{0});
      reason = st.value("rejected_reason", std::string());
      if (!reason.empty()) {
        state = "rejected";
      } else if (applied >= desired) {
        state = "converged";
        ++converged;
      } else {
        state = "lagging";
      }
    }
    rows.push_back({{"host", host},
                    {"state", state},
                    {"applied_revision", applied},
                    {"reason", reason},
                    {"mode", st.is_null() ? "" : st.value("mode", "")},
                    {"vms", st.is_null() ? 0 : st.value("vms", 0)}});
  }
  if (as_json) {
    out << json{{"desired_revision", desired}, {"hosts", rows}}.dump(2) << "\n";
  } else {
    out << "desired revision " << desired << ": " << converged << " of "
        << hosts.size() << " hosts converged\n";
    for (const json& r : rows) {
      out << r["host"].get<std::string>() << "\t"
          << r["state"].get<std::string>() << "\trevision "
          << r["applied_revision"].get<int64_t>() << "\t"
          << r["mode"].get<std::string>() << "\tvms "
          << r["vms"].get<int64_t>();
      if (!r["reason"].get<std::string>().empty()) {
        out << "\t" << r["reason"].get<std::string>();
      }
      out << "\n";
    }
  }
  const bool all =
      !hosts.empty() && converged == static_cast<int>(hosts.size());
  return all ? 0 : kFleetNotConverged;
}

int History(EtcdClient& etcd, std::ostream& out, std::ostream& err) {
  int64_t at = 0;  // 0: now
  int shown = 0;
  for (; shown < 50; ++shown) {
    etcdserverpb::RangeRequest r;
    r.set_key(kFleetAppliedKey);
    r.set_revision(at);
    absl::StatusOr<etcdserverpb::RangeResponse> resp = etcd.Range(r);
    if (!resp.ok()) {
      // Older versions were compacted away: the history ends here.
      if (resp.status().code() == absl::StatusCode::kOutOfRange) break;
      err << "tmemctl: " << resp.status().message() << "\n";
      return 1;
    }
    if (resp->kvs().empty()) break;
    const mvccpb::KeyValue& kv = resp->kvs(0);
    out << "revision " << kv.mod_revision() << "\t" << kv.value() << "\n";
    at = kv.mod_revision() - 1;
    if (at <= 0) break;
  }
  if (shown == 0) out << "no fleet apply yet\n";
  return 0;
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseFleetFile(
    const std::string& text, const std::string& source) {
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a JSON object"));
  }
  std::map<std::string, std::string> keys;
  auto add = [&](const std::string& key, json value) -> absl::Status {
    if (value.is_object() && !value.contains("version")) {
      value["version"] = kFleetFormatVersion;
    }
    absl::StatusOr<FleetLayer> layer = ParseFleetLayer(key, value.dump());
    if (!layer.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", layer.status().message()));
    }
    keys[key] = FormatFleetLayer(*layer);
    return absl::OkStatus();
  };
  for (const auto& [section, v] : j.items()) {
    if (section == "fleet") {
      if (absl::Status s = add(absl::StrCat(kFleetPolicyPrefix, "fleet"), v);
          !s.ok()) {
        return s;
      }
    } else if (section == "groups" || section == "hosts" || section == "vms") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ": '", section, "' must map names to policies"));
      }
      for (const auto& [name, layer] : v.items()) {
        if (absl::Status s = add(
                absl::StrCat(kFleetPolicyPrefix, section, "/", name), layer);
            !s.ok()) {
          return s;
        }
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": unknown section '", section,
                       "' (fleet, groups, hosts, vms)"));
    }
  }
  return keys;
}

int RunFleetCommand(const FleetCliOptions& o, std::ostream& out,
                    std::ostream& err) {
  const EtcdOptions eo =
      EtcdOptionsFor(o.endpoints, o.tls_cert, o.tls_key, o.tls_ca, "--etcd-");
  absl::StatusOr<std::unique_ptr<EtcdClient>> etcd = EtcdClient::Create(eo);
  if (!etcd.ok()) {
    err << "tmemctl: " << etcd.status().message() << "\n";
    return 1;
  }
  // A dead member is skipped: try each endpoint once for the first read.
  for (size_t i = 0; i + 1 < o.endpoints.size(); ++i) {
    etcdserverpb::RangeRequest probe;
    probe.set_key(kFleetAppliedKey);
    probe.set_count_only(true);
    if ((*etcd)->Range(probe).ok()) break;
    (*etcd)->Rotate();
  }
  if (o.command == "apply") {
    std::ifstream in(o.file);
    if (!in) {
      err << "tmemctl: cannot read '" << o.file << "'\n";
      return 1;
    }
    std::stringstream buf;
    buf << in.rdbuf();
    absl::StatusOr<std::map<std::string, std::string>> keys =
        ParseFleetFile(buf.str(), o.file);
    if (!keys.ok()) {
      err << "tmemctl: " << keys.status().message() << "\n";
      return 1;
    }
    return Apply(**etcd, *keys, o.file, o.dry_run, out, err);
  }
  if (o.command == "status") return Status(**etcd, o.json, out, err);
  if (o.command == "history") return History(**etcd, out, err);
  if (o.command == "rollback") {
    if (o.revision <= 0) {
      err << "tmemctl: rollback needs a revision (tmemctl fleet history)\n";
      return 1;
    }
    absl::StatusOr<Snapshot> then = ReadPolicy(**etcd, o.revision);
    if (!then.ok()) {
      err << "tmemctl: cannot read the policy at revision " << o.revision
          << ": " << then.status().message() << "\n";
      return 1;
    }
    return Apply(**etcd, then->layers,
                 absl::StrCat("rollback to revision ", o.revision), o.dry_run,
                 out, err);
  }
  err << "tmemctl: unknown fleet command '" << o.command << "'\n";
  return 1;
}

}  // namespace tmem
