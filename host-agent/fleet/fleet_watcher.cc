#include "host-agent/fleet/fleet_watcher.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <system_error>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "host-agent/log.h"

namespace tmem {
namespace {

using nlohmann::json;

// Writes all of `text` to `fd` (retrying short writes and EINTR); false
// with errno set on the first failure.
bool WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  auto fail = [&](const char* what) {
    absl::Status s = absl::InternalError(absl::StrCat(
        what, " '", tmp, "': ", std::generic_category().message(errno)));
    unlink(tmp.c_str());
    return s;
  };
  (void)unlink(tmp.c_str());
  const int fd = open(
      tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot create");
  if (!WriteAll(fd, text)) {
    close(fd);
    return fail("cannot write");
  }
  if (fsync(fd) != 0) {
    close(fd);
    return fail("cannot fsync");
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) return fail("cannot rename");
  return absl::OkStatus();
}

absl::Status AppendFileSynced(const std::string& path,
                              const std::string& text) {
  auto fail = [&](const char* what) {
    return absl::InternalError(absl::StrCat(
        what, " '", path, "': ", std::generic_category().message(errno)));
  };
  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC,
           0600);
  if (fd < 0) return fail("cannot open");
  if (!WriteAll(fd, text)) {
    close(fd);
    return fail("cannot write");
  }
  if (fdatasync(fd) != 0) {
    close(fd);
    return fail("cannot sync");
  }
  close(fd);
  return absl::OkStatus();
}

// JSON text, never throwing: every string put in is UTF-8 by construction
// (BytesJson, escaped reasons), and a slip shows as U+FFFD, not an abort.
std::string Dump(const json& j, int indent = -1) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

// etcd bytes in the state files: a UTF-8 string as itself (readable), any
// other as {"base64": ...}.
json BytesJson(const std::string& s) {
  if (!InvalidUtf8Offset(s)) return s;
  return json{{"base64", absl::Base64Escape(s)}};
}

bool BytesFromJson(const json& j, std::string* out) {
  if (j.is_string()) {
    *out = j.get<std::string>();
    return true;
  }
  return j.is_object() && j.contains("base64") && j["base64"].is_string() &&
         absl::Base64Unescape(j["base64"].get<std::string>(), out);
}

// The journal is folded into a new snapshot once it is larger than the
// snapshot (so both stay within twice the view) or than this, whichever is
// more: rewriting a small view often costs little either way.
constexpr uint64_t kMinJournalBytes = 64 << 10;

}  // namespace

absl::StatusOr<std::unique_ptr<FleetWatcher>> FleetWatcher::Start(
    const FleetConfig& config, ControlPlane* control, Agent* agent) {
  if (config.host.empty()) {
    return absl::InvalidArgumentError("fleet: no host name");
  }
  const EtcdOptions eo =
      EtcdOptionsFor(config.endpoints, config.tls_cert, config.tls_key,
                     config.tls_ca, "[fleet] tls_");
  absl::StatusOr<std::unique_ptr<EtcdClient>> watch = EtcdClient::Create(eo);
  if (!watch.ok()) return watch.status();
  absl::StatusOr<std::unique_ptr<EtcdClient>> status = EtcdClient::Create(eo);
  if (!status.ok()) return status.status();
  std::unique_ptr<FleetWatcher> w(new FleetWatcher(
      config, control, agent, std::move(*watch), std::move(*status)));
  w->LoadState();
  control->SetExtraCounters([p = w.get()] {
    const FleetCounters c = p->Counters();
    return std::vector<std::pair<std::string, uint64_t>>{
        {"fleet_etcd_errors", c.etcd_errors},
        {"fleet_etcd_tls_errors", c.etcd_tls_errors},
        {"fleet_revisions_applied", c.revisions_applied},
        {"fleet_revisions_rejected", c.revisions_rejected},
        {"fleet_layers_parsed", c.layers_parsed},
        {"fleet_state_bytes_written", c.state_bytes_written}};
  });
  w->watch_thread_ = std::thread([p = w.get()] { p->WatchLoop(); });
  w->status_thread_ = std::thread([p = w.get()] { p->StatusLoop(); });
  return w;
}

FleetWatcher::FleetWatcher(FleetConfig config, ControlPlane* control,
                           Agent* agent,
                           std::unique_ptr<EtcdClient> watch_client,
                           std::unique_ptr<EtcdClient> status_client)
    : config_(std::move(config)),
      state_path_(config_.state_dir.empty()
                      ? std::string()
                      : config_.state_dir + "/fleet-state.json"),
      control_(control),
      agent_(agent),
      watch_client_(std::move(watch_client)),
      view_(config_.host, config_.groups),
      journal_path_(config_.state_dir.empty()
                        ? std::string()
                        : config_.state_dir + "/fleet-state.journal"),
      status_client_(std::move(status_client)) {}

FleetWatcher::~FleetWatcher() { Stop(); }

void FleetWatcher::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  cv_.NotifyAll();
  if (watch_thread_.joinable()) watch_thread_.join();
  if (status_thread_.joinable()) status_thread_.join();
  control_->SetExtraCounters(nullptr);
}

FleetProgress FleetWatcher::Progress() const {
  MutexLock lock(&mu_);
  return progress_;
}

FleetCounters FleetWatcher::Counters() const {
  MutexLock lock(&mu_);
  return counters_;
}

void FleetWatcher::RecordEtcdError(const absl::Status& s,
                                   const EtcdClient& etcd, const char* step) {
  const bool tls = s.GetPayload(kEtcdTlsErrorPayload).has_value();
  {
    MutexLock lock(&mu_);
    ++counters_.etcd_errors;
    if (tls) ++counters_.etcd_tls_errors;
  }
  Log(LogLevel::kWarn, tls ? "fleet_etcd_tls_error" : "fleet_etcd_unavailable",
      {{"endpoint", etcd.endpoint()}, {"step", step}, {"error", s.message()}});
}

bool FleetWatcher::Pause(std::chrono::milliseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  MutexLock lock(&mu_);
  while (!stop_ && cv_.WaitUntil(&mu_, until)) {
  }
  return !stop_;
}

bool FleetWatcher::Stopping() const {
  MutexLock lock(&mu_);
  return stop_;
}

void FleetWatcher::LoadState() {
  if (state_path_.empty()) return;
  std::ifstream in(state_path_);
  if (!in) return;  // first start
  std::stringstream buf;
  buf << in.rdbuf();
  snapshot_bytes_ = buf.str().size();
  const json j = json::parse(buf.str(), nullptr, false);
  FleetProgress p;
  std::map<std::string, std::string> keys;
  size_t replayed = 0;
  try {
    const int version = j.is_discarded() ? 0 : j.value("version", 0);
    if ((version != 1 && version != 2) ||
        j.at("host").get<std::string>() != config_.host) {
      throw std::runtime_error("not this host's version 1 or 2 state");
    }
    auto progress = [](const json& from, FleetProgress* to) {
      to->seen_revision = from.at("seen_revision").get<int64_t>();
      to->applied_revision = from.at("applied_revision").get<int64_t>();
      to->rejected_revision = from.at("rejected_revision").get<int64_t>();
      to->rejected_reason = from.at("rejected_reason").get<std::string>();
    };
    progress(j, &p);
    if (version == 1) {  // keys as an object of strings
      for (const auto& [k, v] : j.at("keys").items()) {
        keys[k] = v.get<std::string>();
      }
    } else {
      for (const json& kv : j.at("keys")) {
        std::string k;
        std::string v;
        if (!kv.is_array() || kv.size() != 2 || !BytesFromJson(kv[0], &k) ||
            !BytesFromJson(kv[1], &v)) {
          throw std::runtime_error("a key is not [key, value]");
        }
        keys[std::move(k)] = std::move(v);
      }
    }
    // The journal's revisions after the snapshot's. A line cut short (a
    // crash while appending) and what follows are not used: their
    // revisions come again from etcd, after the last one saved whole.
    std::ifstream jin(journal_path_);
    std::string line;
    while (jin && std::getline(jin, line) && !jin.eof()) {
      const json e = json::parse(line, nullptr, false);
      if (e.is_discarded() || !e.is_object() || !e.contains("changes")) break;
      FleetProgress q;
      progress(e, &q);
      if (q.seen_revision <= p.seen_revision) continue;
      for (const json& c : e.at("changes")) {
        std::string k;
        std::string v;
        if (!c.is_array() || c.size() != 2 || !BytesFromJson(c[0], &k)) {
          throw std::runtime_error("a journal change is not [key, value]");
        }
        if (c[1].is_null()) {
          keys.erase(k);
        } else if (BytesFromJson(c[1], &v)) {
          keys[k] = v;
        } else {
          throw std::runtime_error("a journal value is not bytes");
        }
      }
      p = q;
      ++replayed;
    }
  } catch (const std::exception& e) {
    // Nothing is lost: the policy itself is in tmemd's state file, and a
    // full read from etcd rebuilds the view.
    Log(LogLevel::kWarn, "fleet_state_ignored",
        {{"file", state_path_}, {"error", e.what()}});
    return;
  }
  for (const auto& [k, v] : keys) view_.Put(k, v);
  absl::StatusOr<const PolicySet*> resolved = view_.Resolve();
  if (resolved.ok() && p.rejected_reason.empty()) {
    if (absl::Status s = control_->ApplyPolicySet(**resolved); s.ok()) {
      view_.MarkApplied();
    } else {
      Log(LogLevel::kWarn, "fleet_state_reapply_failed",
          {{"error", s.message()}});
    }
  }
  {
    MutexLock lock(&mu_);
    progress_ = p;
    counters_.layers_parsed = view_.layers_parsed();
  }
  // A fresh snapshot folds the journal in, so no torn line ever sits
  // before the next appended one.
  snapshot_due_ = true;
  if (absl::Status s = WriteSnapshot(); !s.ok()) {
    Log(LogLevel::kError, "fleet_state_error", {{"error", s.message()}});
  }
  Log(LogLevel::kInfo, "fleet_state_loaded",
      {{"seen_revision", p.seen_revision},
       {"applied_revision", p.applied_revision},
       {"journal_revisions", static_cast<uint64_t>(replayed)}});
}

namespace {
json ProgressJson(const FleetProgress& p) {
  return json{{"seen_revision", p.seen_revision},
              {"applied_revision", p.applied_revision},
              {"rejected_revision", p.rejected_revision},
              {"rejected_reason", p.rejected_reason}};
}
}  // namespace

absl::Status FleetWatcher::WriteSnapshot() {
  json j = ProgressJson(Progress());
  j["version"] = 2;
  j["host"] = config_.host;
  json keys = json::array();
  for (const auto& [k, v] : view_.keys()) {
    keys.push_back(json::array({BytesJson(k), BytesJson(v)}));
  }
  j["keys"] = std::move(keys);
  const std::string text = Dump(j, 1) + "\n";
  if (absl::Status s = WriteFileAtomically(state_path_, text); !s.ok()) {
    return s;
  }
  // The snapshot holds every journal line's revision: the lines are
  // skipped on load even if this truncation is lost in a crash.
  if (truncate(journal_path_.c_str(), 0) != 0 && errno != ENOENT) {
    snapshot_due_ = true;
    return absl::InternalError(
        absl::StrCat("cannot truncate '", journal_path_,
                     "': ", std::generic_category().message(errno)));
  }
  snapshot_due_ = false;
  snapshot_bytes_ = text.size();
  journal_bytes_ = 0;
  MutexLock lock(&mu_);
  counters_.state_bytes_written += text.size();
  return absl::OkStatus();
}

absl::Status FleetWatcher::SaveState(const Changes& changes) {
  if (state_path_.empty()) return absl::OkStatus();
  if (snapshot_due_ ||
      journal_bytes_ > std::max<uint64_t>(snapshot_bytes_, kMinJournalBytes)) {
    return WriteSnapshot();
  }
  json line = ProgressJson(Progress());
  json c = json::array();
  for (const auto& [k, v] : changes) {
    c.push_back(json::array({BytesJson(k), v ? BytesJson(*v) : json()}));
  }
  line["changes"] = std::move(c);
  const std::string text = Dump(line) + "\n";
  if (absl::Status s = AppendFileSynced(journal_path_, text); !s.ok()) {
    snapshot_due_ = true;  // the line may be torn: fold it away next time
    return s;
  }
  journal_bytes_ += text.size();
  MutexLock lock(&mu_);
  counters_.state_bytes_written += text.size();
  return absl::OkStatus();
}

// After an apply each host writes its status key at its own offset in this
// spread (from a hash of its name): a fleet that applied one change together
// would otherwise send etcd one write per host at once, while etcd is still
// delivering that change to the hosts that have not seen it yet. fleet
// status shows a host converged up to this much later.
constexpr std::chrono::milliseconds kStatusSpread{500};

void FleetWatcher::Process(int64_t revision, const Changes& changes) {
  absl::StatusOr<const PolicySet*> resolved = view_.Resolve();
  absl::Status outcome = resolved.status();
  bool changed = false;
  if (resolved.ok() && view_.changed()) {
    outcome = control_->ApplyPolicySet(**resolved);
    if (outcome.ok()) {
      view_.MarkApplied();
      changed = true;
    }
  }
  {
    MutexLock lock(&mu_);
    counters_.layers_parsed = view_.layers_parsed();
    progress_.seen_revision = revision;
    if (changed) ++counters_.revisions_applied;
    if (!outcome.ok()) ++counters_.revisions_rejected;
    if (outcome.ok()) {
      progress_.applied_revision = revision;
      progress_.rejected_revision = 0;
      progress_.rejected_reason.clear();
    } else {
      progress_.rejected_revision = revision;
      progress_.rejected_reason = std::string(outcome.message());
    }
    if (!status_dirty_) {
      status_due_ =
          std::chrono::steady_clock::now() +
          std::chrono::milliseconds(std::hash<std::string>{}(config_.host) %
                                    static_cast<size_t>(kStatusSpread.count()));
    }
    status_dirty_ = true;
  }
  cv_.NotifyAll();
  // After ApplyPolicySet saved the policy: the saved revision never runs
  // ahead of it.
  if (absl::Status s = SaveState(changes); !s.ok()) {
    Log(LogLevel::kError, "fleet_state_error", {{"error", s.message()}});
  }
  if (!outcome.ok()) {
    Log(LogLevel::kWarn, "fleet_policy_rejected",
        {{"revision", revision}, {"reason", outcome.message()}});
  } else if (changed) {
    Log(LogLevel::kInfo, "fleet_policy_applied", {{"revision", revision}});
  }
}

absl::Status FleetWatcher::FullRead() {
  etcdserverpb::RangeRequest r;
  r.set_key(kFleetPolicyPrefix);
  r.set_range_end(EtcdPrefixEnd(kFleetPolicyPrefix));
  absl::StatusOr<etcdserverpb::RangeResponse> resp = watch_client_->Range(r);
  if (!resp.ok()) return resp.status();
  Log(LogLevel::kInfo, "fleet_full_read",
      {{"endpoint", watch_client_->endpoint()},
       {"revision", resp->header().revision()}});
  view_.Clear();
  for (const mvccpb::KeyValue& kv : resp->kvs())
    view_.Put(kv.key(), kv.value());
  snapshot_due_ = true;  // the whole view changed
  Process(resp->header().revision(), {});
  return absl::OkStatus();
}

absl::Status FleetWatcher::RunWatch(bool* compacted) {
  grpc::ClientContext context;
  watch_client_->Prepare(&context, /*stream=*/true);
  {
    MutexLock lock(&mu_);
    if (stop_) return absl::OkStatus();
    watch_context_ = &context;
  }
  auto stream = watch_client_->watch().Watch(&context);
  etcdserverpb::WatchRequest request;
  etcdserverpb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(kFleetPolicyPrefix);
  create->set_range_end(EtcdPrefixEnd(kFleetPolicyPrefix));
  create->set_start_revision(Progress().seen_revision + 1);
  Log(LogLevel::kInfo, "fleet_watch",
      {{"endpoint", watch_client_->endpoint()},
       {"start_revision", create->start_revision()}});
  absl::Status result = absl::OkStatus();
  if (stream->Write(request)) {
    etcdserverpb::WatchResponse response;
    while (stream->Read(&response)) {
      if (response.compact_revision() > 0) {
        *compacted = true;
        break;
      }
      if (response.canceled()) {
        result = absl::UnavailableError(
            absl::StrCat("watch canceled: ", response.cancel_reason()));
        break;
      }
      if (response.events().empty()) continue;
      // One response holds whole revisions (etcd never splits one), so
      // the state after its last event is a revision's complete state.
      Changes changes;
      for (const mvccpb::Event& e : response.events()) {
        const std::string& key = e.kv().key();
        if (e.type() == mvccpb::Event::PUT) {
          if (view_.Put(key, e.kv().value())) {
            changes.emplace_back(key, e.kv().value());
          }
        } else if (view_.Delete(key)) {
          changes.emplace_back(key, std::nullopt);
        }
      }
      Process(response.events(response.events_size() - 1).kv().mod_revision(),
              changes);
    }
  }
  context.TryCancel();
  grpc::Status finished = stream->Finish();
  {
    MutexLock lock(&mu_);
    watch_context_ = nullptr;
  }
  if (result.ok() && !*compacted) result = watch_client_->FromGrpc(finished);
  if (result.ok() && !*compacted) {
    result = absl::UnavailableError("watch stream ended");
  }
  return result;
}

void FleetWatcher::WatchLoop() {
  bool need_full_read = Progress().seen_revision == 0;
  std::chrono::milliseconds backoff(100);
  for (;;) {
    if (Stopping()) return;
    absl::Status s = absl::OkStatus();
    if (need_full_read) {
      s = FullRead();
      if (s.ok()) need_full_read = false;
    }
    if (s.ok()) {
      bool compacted = false;
      s = RunWatch(&compacted);
      if (compacted) {
        Log(LogLevel::kInfo, "fleet_watch_compacted",
            {{"revision", Progress().seen_revision}});
        need_full_read = true;
        backoff = std::chrono::milliseconds(100);
        continue;
      }
    }
    if (Stopping()) return;
    RecordEtcdError(s, *watch_client_, "watch");
    watch_client_->Rotate();
    if (!Pause(backoff)) return;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }
}

std::string FleetWatcher::StatusJson() const {
  const FleetProgress p = Progress();
  json j;
  j["version"] = 1;
  j["host"] = config_.host;
  j["seen_revision"] = p.seen_revision;
  j["applied_revision"] = p.applied_revision;
  j["rejected_revision"] = p.rejected_revision;
  j["rejected_reason"] = p.rejected_reason;
  const ValveOptions valve = agent_->GetValveOptions();
  j["mode"] = std::string(ValveModeName(valve.default_mode));
  j["cpu_budget_percent"] = valve.cpu_budget_percent;
  j["vms"] = agent_->VmNames().size();
  j["pid"] = static_cast<int64_t>(getpid());
  return Dump(j);
}

void FleetWatcher::StatusLoop() {
  const auto ttl = std::chrono::seconds(config_.lease_ttl_seconds);
  const auto keepalive_every =
      std::chrono::duration_cast<std::chrono::milliseconds>(ttl) / 3;
  int64_t lease = 0;
  bool registered = false;
  auto next_keepalive = std::chrono::steady_clock::now();
  EtcdClient& etcd = *status_client_;
  auto failed = [&](const absl::Status& s, const char* what) {
    RecordEtcdError(s, etcd, what);
    etcd.Rotate();
    return Pause(std::chrono::milliseconds(500));
  };
  for (;;) {
    if (Stopping()) break;
    if (!registered) {
      etcdserverpb::PutRequest r;
      r.set_key(absl::StrCat(kFleetMembersPrefix, config_.host));
      r.set_value(json{{"version", 1}, {"host", config_.host}}.dump());
      if (absl::StatusOr<etcdserverpb::PutResponse> p = etcd.Put(r); !p.ok()) {
        if (!failed(p.status(), "register")) break;
        continue;
      }
      registered = true;
    }
    if (lease == 0) {
      grpc::ClientContext context;
      etcd.Prepare(&context, false);
      etcdserverpb::LeaseGrantRequest r;
      r.set_ttl(config_.lease_ttl_seconds);
      etcdserverpb::LeaseGrantResponse resp;
      absl::Status s =
          etcd.FromGrpc(etcd.lease().LeaseGrant(&context, r, &resp));
      if (s.ok() && !resp.error().empty()) {
        s = absl::UnavailableError(resp.error());
      }
      if (!s.ok()) {
        if (!failed(s, "lease_grant")) break;
        continue;
      }
      lease = resp.id();
      next_keepalive = std::chrono::steady_clock::now() + keepalive_every;
      MutexLock lock(&mu_);
      status_dirty_ = true;
      status_due_ = {};  // a new lease: the status at once
    }
    bool dirty = false;
    {
      MutexLock lock(&mu_);
      dirty = status_dirty_ && std::chrono::steady_clock::now() >= status_due_;
      if (dirty) status_dirty_ = false;
    }
    if (dirty) {
      etcdserverpb::PutRequest r;
      r.set_key(absl::StrCat(kFleetStatusPrefix, config_.host));
      r.set_value(StatusJson());
      r.set_lease(lease);
      if (absl::StatusOr<etcdserverpb::PutResponse> p = etcd.Put(r); !p.ok()) {
        {
          MutexLock lock(&mu_);
          status_dirty_ = true;
          status_due_ = {};
        }
        // "requested lease not found": it expired while we were away.
        if (p.status().code() == absl::StatusCode::kNotFound) lease = 0;
        if (!failed(p.status(), "status_put")) break;
        continue;
      }
    }
    if (std::chrono::steady_clock::now() >= next_keepalive) {
      grpc::ClientContext context;
      etcd.Prepare(&context, false);
      auto stream = etcd.lease().LeaseKeepAlive(&context);
      etcdserverpb::LeaseKeepAliveRequest r;
      r.set_id(lease);
      etcdserverpb::LeaseKeepAliveResponse resp;
      const bool answered = stream->Write(r) && stream->Read(&resp);
      stream->WritesDone();
      context.TryCancel();
      (void)stream->Finish();
      if (!answered) {
        if (!failed(absl::UnavailableError("no keepalive answer"),
                    "keepalive")) {
          break;
        }
        continue;
      }
      if (resp.ttl() <= 0) {  // expired: a new lease, the status again
        lease = 0;
        continue;
      }
      next_keepalive = std::chrono::steady_clock::now() + keepalive_every;
    }
    MutexLock lock(&mu_);
    while (!stop_ && !(status_dirty_ &&
                       std::chrono::steady_clock::now() >= status_due_)) {
      const auto until = status_dirty_ ? std::min(next_keepalive, status_due_)
                                       : next_keepalive;
      if (!cv_.WaitUntil(&mu_, until)) break;  // timed out: keepalive or due
    }
  }
  if (lease != 0) {
    // Gone at once rather than after the TTL.
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(1));
    etcdserverpb::LeaseRevokeRequest r;
    r.set_id(lease);
    etcdserverpb::LeaseRevokeResponse resp;
    (void)etcd.lease().LeaseRevoke(&context, r, &resp);
  }
}

}  // namespace tmem
