#include "host-agent/libvirt/domain_manager.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "host-agent/channel/socket_file.h"
#include "host-agent/config.h"
#include "host-agent/log.h"

namespace tmem {

using std::chrono::steady_clock;

DomainManager::DomainManager(Agent* agent, Hypervisor* hypervisor,
                             DomainManagerOptions options)
    : agent_(agent), hv_(hypervisor), options_(std::move(options)) {}

DomainManager::~DomainManager() { Stop(); }

absl::Status DomainManager::Start() {
  hv_->SetEventHandler([this](const DomainEvent& e) { OnEvent(e); });
  if (hv_->Connected()) {
    MutexLock op(&op_mu_);
    absl::StatusOr<std::vector<DomainSummary>> all = hv_->ListDomains();
    if (!all.ok()) return all.status();
    FirstSyncLocked();
  } else {
    // Connecting in the background: its kReconnected makes the first sync.
    Log(LogLevel::kInfo, "libvirt_waiting", {{"uri", hv_->Uri()}});
  }
  MutexLock l(&mu_);
  stop_ = false;
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void DomainManager::FirstSyncLocked() {
  synced_ = true;
  SyncAllLocked(/*autoattach=*/true);
  // A domain already running with the device was attached to an earlier
  // tmemd: QEMU never reconnects to a new socket (docs/operations.md), so say
  // how to get tmem back rather than serve a channel nobody will use.
  for (auto& [name, st] : domains_) {
    if (!st.live_device || !st.channel) continue;
    absl::StatusOr<VmInfo> vm = agent_->GetVm(st.vm);
    if (vm.ok() && vm->connected) continue;
    st.detail =
        "running since before this tmemd started: QEMU does not reconnect "
        "to the new socket; restart the domain (or detach and attach "
        "again once the guest acks) to get tmem back";
    Log(LogLevel::kWarn, "libvirt_stale_device",
        {{"domain", name}, {"vm", st.vm}});
  }
  Log(LogLevel::kInfo, "libvirt_synced",
      {{"uri", hv_->Uri()},
       {"domains", static_cast<uint64_t>(domains_.size())}});
}

void DomainManager::Stop() {
  hv_->SetEventHandler(nullptr);
  {
    MutexLock l(&mu_);
    if (!started_) return;
    stop_ = true;
    started_ = false;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void DomainManager::OnEvent(const DomainEvent& event) {
  {
    MutexLock l(&mu_);
    queue_.push_back(event);
  }
  cv_.NotifyAll();
}

void DomainManager::Flush() {
  MutexLock l(&mu_);
  while ((!queue_.empty() || !hook_releases_.empty() || busy_) && started_) {
    cv_.Wait(&mu_);
  }
}

uint64_t DomainManager::events_handled() const {
  MutexLock l(&mu_);
  return handled_;
}

void DomainManager::Loop() {
  mu_.Lock();
  while (!stop_) {
    if (queue_.empty()) {
      // Wake at least every 100 ms to check detach deadlines.
      const auto check_at =
          steady_clock::now() + std::chrono::milliseconds(100);
      while (!stop_ && queue_.empty() && hook_releases_.empty() &&
             cv_.WaitUntil(&mu_, check_at)) {
      }
    }
    std::optional<DomainEvent> event;
    if (!queue_.empty()) {
      event = std::move(queue_.front());
      queue_.pop_front();
    }
    std::deque<HookRelease> releases;
    releases.swap(hook_releases_);
    busy_ = true;
    mu_.Unlock();
    {
      MutexLock op(&op_mu_);
      if (event) HandleLocked(*event);
      for (const HookRelease& r : releases) {
        ReleaseHookChannelLocked(r.domain, r.generation, "release hook");
      }
      CheckDeadlinesLocked();
    }
    mu_.Lock();
    busy_ = false;
    if (event) ++handled_;
    cv_.NotifyAll();
  }
  mu_.Unlock();
}

void DomainManager::HandleLocked(const DomainEvent& e) {
  using Kind = DomainEvent::Kind;
  Log(LogLevel::kDebug, "libvirt_event",
      {{"kind", static_cast<int>(e.kind)},
       {"domain", e.domain},
       {"alias", e.alias},
       {"detail", e.detail}});
  switch (e.kind) {
    case Kind::kDefined:
    case Kind::kUndefined:
      ReconcileLocked(e.domain, /*autoattach=*/false);
      break;
    case Kind::kStarted:
    case Kind::kMetadataChanged:
      ReconcileLocked(e.domain, /*autoattach=*/true);
      ReleaseHookChannelLocked(e.domain, 0, "");  // forgets it if adopted
      break;
    case Kind::kStopped: {
      auto it = domains_.find(e.domain);
      absl::StatusOr<DomainSummary> now = hv_->GetDomain(e.domain);
      if (it != domains_.end() && now.ok() && now->active) {
        // Started again before this event was handled: the new QEMU may
        // already be connected to the socket, which must stay. Its guest
        // restart resets the channel and the old boot's pools.
        Log(LogLevel::kInfo, "libvirt_restarted_before_stop_handled",
            {{"domain", e.domain}, {"detail", e.detail}});
        ReconcileLocked(e.domain, /*autoattach=*/false);
        break;
      }
      if (it != domains_.end()) {
        DomainState& st = it->second;
        st.detach_pending = false;
        st.detach_timed_out = false;
        st.live_device = false;
        st.alias.clear();
        if (st.channel) {
          ReleaseChannelLocked(st,
                               absl::StrCat("domain stopped (", e.detail, ")"));
        }
        st.detail = absl::StrCat("domain stopped (", e.detail,
                                 "): pages and channel released");
      }
      ReconcileLocked(e.domain, /*autoattach=*/false);
      break;
    }
    case Kind::kDeviceRemoved: {
      auto it = domains_.find(e.domain);
      if (it == domains_.end()) break;
      DomainState& st = it->second;
      if (!st.alias.empty() && !e.alias.empty() && st.alias != e.alias) break;
      absl::StatusOr<std::string> xml = hv_->GetXml(e.domain, false);
      if (xml.ok() && FindTmemDevice(*xml).has_value()) break;  // not ours
      Log(LogLevel::kInfo, "libvirt_detached",
          {{"domain", e.domain}, {"alias", e.alias}});
      st.detach_pending = false;
      st.detach_timed_out = false;
      st.live_device = false;
      st.alias.clear();
      if (st.channel) ReleaseChannelLocked(st, "device removed");
      st.detail = "detached (DEVICE_REMOVED)";
      ReconcileLocked(e.domain, /*autoattach=*/false);
      break;
    }
    case Kind::kDeviceRemovalFailed: {
      auto it = domains_.find(e.domain);
      if (it == domains_.end() || !it->second.detach_pending) break;
      if (!it->second.alias.empty() && it->second.alias != e.alias) break;
      it->second.detach_pending = false;
      it->second.detail =
          "detach failed: the guest refused to release the device";
      Log(LogLevel::kWarn, "libvirt_detach_failed", {{"domain", e.domain}});
      break;
    }
    case Kind::kConnectionLost:
      Log(LogLevel::kWarn, "libvirt_connection_lost", {{"uri", hv_->Uri()}});
      for (auto& [name, st] : domains_) {
        st.detail = "libvirt connection lost; channel kept, reconnecting";
      }
      break;
    case Kind::kReconnected:
      if (!synced_) {
        FirstSyncLocked();
        break;
      }
      Log(LogLevel::kInfo, "libvirt_resync", {{"uri", hv_->Uri()}});
      SyncAllLocked(/*autoattach=*/true);
      break;
  }
}

void DomainManager::CheckDeadlinesLocked() {
  const auto now = steady_clock::now();
  for (auto& [name, st] : domains_) {
    if (!st.detach_pending || st.detach_timed_out || now < st.detach_deadline)
      continue;
    st.detach_timed_out = true;
    st.detail = absl::StrCat(
        "detach timed out after ",
        std::chrono::duration_cast<std::chrono::seconds>(
            options_.detach_timeout)
            .count(),
        "s: the guest has not acked the unplug (no OS running, or no ACPI "
        "PCI hotplug in the guest); the device and channel stay until it "
        "does or the domain stops");
    Log(LogLevel::kWarn, "libvirt_detach_timeout",
        {{"domain", name}, {"vm", st.vm}});
  }
}

void DomainManager::SyncAllLocked(bool autoattach) {
  absl::StatusOr<std::vector<DomainSummary>> all = hv_->ListDomains();
  if (!all.ok()) {
    Log(LogLevel::kWarn, "libvirt_list_failed",
        {{"error", all.status().message()}});
    return;
  }
  std::map<std::string, bool> seen;
  for (const DomainSummary& d : *all) seen[d.name] = true;
  std::vector<std::string> gone;
  for (const auto& [name, st] : domains_) {
    if (!seen.count(name)) gone.push_back(name);
  }
  for (const std::string& name : gone) ReconcileLocked(name, false);
  for (const DomainSummary& d : *all) ReconcileLocked(d.name, autoattach);
  // A hook channel whose domain is not running now: prepared for a start
  // that failed later, or for a domain that started and stopped while the
  // connection was down (its events and, maybe, its release were lost).
  std::map<std::string, bool> active;
  for (const DomainSummary& d : *all) active[d.name] = d.active;
  std::vector<std::string> prepared;
  {
    MutexLock h(&hook_mu_);
    for (const auto& [name, ch] : hook_channels_) prepared.push_back(name);
  }
  for (const std::string& name : prepared) {
    auto a = active.find(name);
    const bool running = a != active.end() && a->second;
    // A running one is only forgotten, once adopted.
    ReleaseHookChannelLocked(
        name, 0, running ? "" : "domain not running at the libvirt sync");
  }
}

void DomainManager::ReleaseHookChannelLocked(const std::string& domain,
                                             uint64_t generation,
                                             const std::string& why) {
  HookChannel ch;
  {
    MutexLock h(&hook_mu_);
    auto it = hook_channels_.find(domain);
    if (it == hook_channels_.end()) return;
    if (generation != 0 && it->second.generation != generation) return;
    auto followed = domains_.find(domain);
    if (followed != domains_.end() && followed->second.channel) {
      // Adopted by a reconcile: the domain's own events release it.
      hook_channels_.erase(it);
      return;
    }
    if (why.empty()) return;  // running, its STARTED not handled yet
    ch = it->second;
    hook_channels_.erase(it);
  }
  absl::StatusOr<bool> removed = RemoveVmOnSocket(ch.vm, ch.socket_path);
  if (!removed.ok()) {
    Log(LogLevel::kWarn, "libvirt_hook_release_failed",
        {{"domain", domain},
         {"vm", ch.vm},
         {"error", removed.status().message()}});
    return;
  }
  if (*removed) {
    Log(LogLevel::kInfo, "libvirt_hook_released",
        {{"domain", domain}, {"vm", ch.vm}, {"why", why}});
  }
}

absl::StatusOr<bool> DomainManager::RemoveVmOnSocket(
    const std::string& vm, const std::string& socket_path) {
  // A VM of the same name on another socket is someone else's.
  absl::StatusOr<VmInfo> info = agent_->GetVm(vm);
  if (!info.ok() || info->socket_path != socket_path) return false;
  if (absl::Status s = agent_->RemoveVm(vm); !s.ok() && !absl::IsNotFound(s)) {
    return s;
  }
  return true;
}

namespace {

// Every field the metadata element carries.
bool SamePolicy(const VmPolicy& a, const VmPolicy& b) {
  return a.quota_bytes == b.quota_bytes && a.weight == b.weight &&
         a.enabled == b.enabled && a.frozen == b.frozen && a.mode == b.mode &&
         a.swap_quota_bytes == b.swap_quota_bytes && a.swap_mode == b.swap_mode;
}

// The hook's domain: its name and VM name from the XML, which must have both
// <name> and <uuid> (libvirt always writes them).
absl::Status HookDomain(const std::string& domain_xml, DomainAttachState* out,
                        std::string* uuid) {
  out->domain = DomainXmlElement(domain_xml, "name");
  *uuid = DomainXmlElement(domain_xml, "uuid");
  if (out->domain.empty() || uuid->empty()) {
    return absl::InvalidArgumentError(
        "libvirt hook: the domain XML has no <name> or <uuid>");
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<DomainAttachState> DomainManager::PrepareFromHook(
    const std::string& domain_xml) {
  DomainAttachState out;
  std::string uuid;
  if (absl::Status s = HookDomain(domain_xml, &out, &uuid); !s.ok()) return s;
  const std::optional<TmemDevice> device = FindTmemDevice(domain_xml);
  if (!device) {
    out.detail = "no tmem device: nothing to prepare";
    return out;
  }
  absl::StatusOr<TmemMetadata> meta = DomainTmemMetadata(domain_xml);
  if (!meta.ok()) {
    // A typo in the element must not start the VM on default settings.
    return absl::InvalidArgumentError(
        absl::StrCat("domain '", out.domain, "': ", meta.status().message()));
  }
  if (device->server_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "domain '", out.domain, "': the tmem device has no <server path>"));
  }
  // The channel exactly as for a domain the glue follows; the STARTED
  // reconcile then adopts it (same VM name and socket).
  DomainState st;
  st.name = out.domain;
  st.uuid = uuid;
  st.metadata = *meta;
  if (absl::Status s = EnsureChannel(st, device->server_path); !s.ok()) {
    return s;
  }
  {
    MutexLock h(&hook_mu_);
    hook_channels_[out.domain] =
        HookChannel{st.vm, st.socket_path, ++hook_generation_};
  }
  out.vm = st.vm;
  out.detail = "socket listening for QEMU";
  Log(LogLevel::kInfo, "libvirt_hook_prepared",
      {{"domain", out.domain},
       {"vm", out.vm},
       {"socket", device->server_path}});
  return out;
}

absl::StatusOr<DomainAttachState> DomainManager::ReleaseFromHook(
    const std::string& domain_xml) {
  DomainAttachState out;
  std::string uuid;
  if (absl::Status s = HookDomain(domain_xml, &out, &uuid); !s.ok()) return s;
  const std::optional<TmemDevice> device = FindTmemDevice(domain_xml);
  out.vm = VmNameFor(out.domain, uuid);
  {
    // A domain the manager follows is released by its STOPPED event (and
    // its channel made again if its config keeps the device). try_lock: the
    // manager may be inside a libvirt call that waits for this hook.
    if (!op_mu_.TryLock()) {
      // An operation holds the manager (a resync, a libvirt call that may
      // be waiting for this very hook): a channel the hook made is
      // released by the manager's thread once it is free; any other is a
      // followed domain's, released by its STOPPED event or the resync.
      uint64_t generation = 0;
      {
        MutexLock h(&hook_mu_);
        auto it = hook_channels_.find(out.domain);
        if (it != hook_channels_.end()) generation = it->second.generation;
      }
      if (generation == 0) {
        out.detail = "left to the domain's STOPPED event";
        return out;
      }
      {
        MutexLock l(&mu_);
        hook_releases_.push_back(HookRelease{out.domain, generation});
      }
      cv_.NotifyAll();
      out.detail = "queued: released by tmemd's libvirt thread";
      return out;
    }
    const bool followed = domains_.count(out.domain) > 0;
    op_mu_.Unlock();
    if (followed) {
      out.detail = "left to the domain's STOPPED event";
      return out;
    }
  }
  {
    MutexLock h(&hook_mu_);
    hook_channels_.erase(out.domain);
  }
  absl::StatusOr<bool> removed =
      device ? RemoveVmOnSocket(out.vm, device->server_path) : false;
  if (!removed.ok()) return removed.status();
  if (!*removed) {
    out.detail = "nothing to release";
    return out;
  }
  out.detail = "released";
  Log(LogLevel::kInfo, "libvirt_hook_released",
      {{"domain", out.domain}, {"vm", out.vm}});
  return out;
}

std::string DomainManager::VmNameFor(const std::string& name,
                                     const std::string& uuid) const {
  return ValidateVmName(name).ok() ? name : uuid;
}

std::string DomainManager::DefaultSocketPath(const std::string& uuid) const {
  return absl::StrCat(agent_->options().socket_dir, "/", uuid, ".sock");
}

absl::StatusOr<TmemMetadata> DomainManager::ReadMetadataLocked(
    const std::string& name, bool active) {
  absl::StatusOr<std::optional<std::string>> xml =
      hv_->GetMetadata(name, /*inactive=*/!active);
  if (!xml.ok()) return xml.status();
  if (!xml->has_value()) return TmemMetadata{};
  return ParseTmemMetadata(**xml);
}

absl::Status DomainManager::EnsureChannel(DomainState& st,
                                          const std::string& path) {
  if (st.channel) return absl::OkStatus();
  // Whoever can define a domain names this path: tmemd binds, chmods,
  // chowns and unlinks there, so it must be a file directly in tmemd's own
  // socket directory.
  if (!path.empty()) {
    if (absl::Status s =
            SocketPathInDirectory(path, agent_->options().socket_dir);
        !s.ok()) {
      Log(LogLevel::kError, "libvirt_socket_path_refused",
          {{"domain", st.name}, {"socket", path}, {"error", s.message()}});
      return {s.code(), absl::StrCat("domain '", st.name, "': ", s.message())};
    }
  }
  st.vm = VmNameFor(st.name, st.uuid);
  st.socket_path = path.empty() ? DefaultSocketPath(st.uuid) : path;
  absl::StatusOr<VmInfo> added =
      agent_->AddVm(st.vm, st.metadata.policy, st.socket_path);
  if (absl::IsAlreadyExists(added.status())) {
    // Restored from a previous tmemd (fd store or upgrade) on the same
    // socket: the running QEMU is still connected to it; take it over.
    absl::StatusOr<VmInfo> existing = agent_->GetVm(st.vm);
    if (existing.ok() && existing->socket_path == st.socket_path) {
      added = std::move(existing);
      (void)agent_->SetVmPolicy(st.vm, st.metadata.policy);
      Log(LogLevel::kInfo, "libvirt_channel_adopted",
          {{"domain", st.name}, {"vm", st.vm}, {"socket", st.socket_path}});
    }
  }
  if (!added.ok()) {
    Log(LogLevel::kError, "libvirt_channel_error",
        {{"domain", st.name},
         {"vm", st.vm},
         {"error", added.status().message()}});
    return {added.status().code(),
            absl::StrCat("domain '", st.name, "': ", added.status().message())};
  }
  st.channel = true;
  if (st.metadata.present) {
    // The domain's element wins over this host's state file (AddVm's
    // resolver): it is what travelled with the domain.
    if (absl::Status s = agent_->SetVmPolicy(st.vm, st.metadata.policy);
        !s.ok()) {
      st.detail =
          absl::StrCat("policy from metadata not applied: ", s.message());
    }
  }
  st.applied = st.metadata;
  Log(LogLevel::kInfo, "libvirt_channel_created",
      {{"domain", st.name}, {"vm", st.vm}, {"socket", st.socket_path}});
  return absl::OkStatus();
}

void DomainManager::ReleaseChannelLocked(DomainState& st,
                                         const std::string& why) {
  if (!st.channel) return;
  absl::Status s = agent_->RemoveVm(st.vm);
  Log(s.ok() ? LogLevel::kInfo : LogLevel::kWarn, "libvirt_channel_released",
      {{"domain", st.name},
       {"vm", st.vm},
       {"why", why},
       {"error", s.ok() ? std::string() : std::string(s.message())}});
  st.channel = false;
  st.applied.reset();
}

void DomainManager::ApplyPolicyLocked(DomainState& st, bool force) {
  // A swap device alone: only an element says anything (without one the VM
  // keeps the state file's policy, as a channel's does when it is made).
  if (!st.channel && !(st.swap_device && st.metadata.present)) return;
  if (!force && st.applied &&
      SamePolicy(st.applied->policy, st.metadata.policy)) {
    return;
  }
  absl::Status s = agent_->SetVmPolicy(st.vm, st.metadata.policy);
  if (!s.ok()) {
    st.detail = absl::StrCat("policy from metadata not applied: ", s.message());
    Log(LogLevel::kWarn, "libvirt_policy_error",
        {{"domain", st.name}, {"error", s.message()}});
    return;
  }
  st.applied = st.metadata;
  Log(LogLevel::kInfo, "libvirt_policy_applied",
      {{"domain", st.name},
       {"vm", st.vm},
       {"quota", st.metadata.policy.quota_bytes},
       {"weight", st.metadata.policy.weight},
       {"enabled", st.metadata.policy.enabled},
       {"mode", ValveModeName(st.metadata.policy.mode)},
       {"swap_quota", st.metadata.policy.swap_quota_bytes},
       {"swap_mode", ValveModeName(st.metadata.policy.swap_mode)}});
}

void DomainManager::ReconcileLocked(const std::string& name, bool autoattach) {
  absl::StatusOr<DomainSummary> d = hv_->GetDomain(name);
  auto it = domains_.find(name);
  if (!d.ok()) {
    if (d.status().code() != absl::StatusCode::kNotFound) {
      Log(LogLevel::kWarn, "libvirt_domain_error",
          {{"domain", name}, {"error", d.status().message()}});
      return;
    }
    if (it != domains_.end()) {
      ReleaseChannelLocked(it->second, "domain undefined");
      domains_.erase(it);
    }
    return;
  }
  std::optional<TmemDevice> live;
  std::optional<TmemDevice> config;
  if (d->active) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, false);
    if (xml.ok()) live = FindTmemDevice(*xml);
  }
  if (d->persistent) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, true);
    if (xml.ok()) config = FindTmemDevice(*xml);
  }
  absl::StatusOr<TmemMetadata> meta = ReadMetadataLocked(name, d->active);
  if (meta.status().code() == absl::StatusCode::kNotFound) {
    // Undefined while we looked; its UNDEFINED/STOPPED event follows.
    return;
  }
  // A swap device the Agent serves for this domain (AttachSwap, [swap.VM],
  // AddSwapDevice): its VM takes the element's policy like a channel's.
  const std::string vm = VmNameFor(name, d->uuid);
  absl::StatusOr<VmInfo> vm_info = agent_->GetVm(vm);
  const bool swap_device = vm_info.ok() && vm_info->swap.has_value();
  const bool wanted =
      live || config || swap_device || (meta.ok() && meta->autoattach);
  if (it == domains_.end()) {
    if (!wanted) return;  // nothing of tmem's in this domain
    it = domains_.emplace(name, DomainState{}).first;
    it->second.name = name;
  }
  DomainState& st = it->second;
  st.uuid = d->uuid;
  st.live_device = live.has_value();
  st.config_device = config.has_value();
  st.alias = live ? live->alias : "";
  if (meta.ok()) {
    st.metadata = *meta;
  } else {
    st.detail = absl::StrCat("metadata ignored: ", meta.status().message());
    Log(LogLevel::kWarn, "libvirt_metadata_error",
        {{"domain", name}, {"error", meta.status().message()}});
  }

  if (live || config) {
    const std::string path = live ? live->server_path : config->server_path;
    if (absl::Status s = EnsureChannel(st, path); !s.ok()) {
      st.detail = std::string(s.message());
    }
  } else if (st.channel && !st.detach_pending) {
    ReleaseChannelLocked(st, "device no longer in the domain");
  }
  if (swap_device && !st.swap_device && st.metadata.present) {
    // A device new to this manager: apply the element even if a channel
    // applied the same one before (the device's VM may be a new one).
    st.applied.reset();
  }
  st.swap_device = swap_device;
  if (swap_device && !st.channel) st.vm = vm;
  ApplyPolicyLocked(st, /*force=*/false);

  if (autoattach && d->active && !live && !st.detach_pending &&
      st.metadata.autoattach) {
    absl::StatusOr<DomainAttachState> a = AttachLocked(name, false);
    Log(a.ok() ? LogLevel::kInfo : LogLevel::kWarn, "libvirt_autoattach",
        {{"domain", name},
         {"error",
          a.ok() ? std::string() : std::string(a.status().message())}});
    if (!a.ok()) {
      domains_[name].detail =
          absl::StrCat("autoattach failed: ", a.status().message());
    }
  }
  // Keep a state only while something of tmem's is left to report.
  it = domains_.find(name);
  if (it != domains_.end() && !it->second.channel && !it->second.live_device &&
      !it->second.config_device && !it->second.swap_device &&
      !it->second.metadata.autoattach && !it->second.detach_pending) {
    domains_.erase(it);
  }
}

absl::Status DomainManager::SetMasterOverrideLocked(const std::string& name,
                                                    bool on) {
  absl::StatusOr<std::string> xml = hv_->GetXml(name, /*inactive=*/true);
  if (!xml.ok()) return xml.status();
  absl::StatusOr<std::string> next =
      on ? WithTmemMasterOverride(*xml)
         : absl::StatusOr<std::string>(WithoutTmemMasterOverride(*xml));
  if (!next.ok()) return next.status();
  if (*next == *xml) return absl::OkStatus();
  return hv_->DefineXml(*next);
}

void DomainManager::WaitForConnection() const {
  // Polled: a command waits here rarely (right after a start or while
  // libvirtd restarts), and the hypervisor has no connected event for it.
  const auto deadline = steady_clock::now() + options_.connect_wait;
  while (!hv_->Connected() && steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

absl::StatusOr<DomainAttachState> DomainManager::Attach(
    const std::string& domain, bool persistent) {
  WaitForConnection();
  MutexLock op(&op_mu_);
  return AttachLocked(domain, persistent);
}

absl::StatusOr<DomainAttachState> DomainManager::AttachLocked(
    const std::string& name, bool persistent) {
  absl::StatusOr<DomainSummary> d = hv_->GetDomain(name);
  if (!d.ok()) return d.status();
  if (!d->active && !persistent) {
    return absl::FailedPreconditionError(absl::StrCat(
        "domain '", name,
        "' is not running: start it first, or attach persistently to add the "
        "device to its config for the next start"));
  }
  if (persistent && !d->persistent && !d->active) {
    return absl::FailedPreconditionError(
        absl::StrCat("domain '", name, "' is neither running nor defined"));
  }
  std::string live_xml;
  std::optional<TmemDevice> live;
  std::optional<TmemDevice> config;
  if (d->active) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, false);
    if (!xml.ok()) return xml.status();
    live_xml = *xml;
    live = FindTmemDevice(live_xml);
  }
  if (d->persistent) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, true);
    if (!xml.ok()) return xml.status();
    config = FindTmemDevice(*xml);
  }
  const bool do_live = d->active && !live;
  const bool do_config = persistent && d->persistent && !config;
  if (!do_live && !do_config) {
    return absl::AlreadyExistsError(
        absl::StrCat("tmem is already attached to domain '", name, "'",
                     config ? " (live and persistent config)" : ""));
  }
  if (do_live) {
    if (absl::Status s = CheckPciHotplug(live_xml); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot attach tmem to domain '", name, "': ", s.message()));
    }
  }
  DomainState& st = domains_[name];
  st.name = name;
  st.uuid = d->uuid;
  if (absl::StatusOr<TmemMetadata> meta = ReadMetadataLocked(name, d->active);
      meta.ok()) {
    st.metadata = *meta;
  }
  const bool had_channel = st.channel;
  // The socket must listen before QEMU connects to it during the attach.
  std::string path = live     ? live->server_path
                     : config ? config->server_path
                              : "";
  if (absl::Status s = EnsureChannel(st, path); !s.ok()) return s;
  absl::Status s = hv_->AttachDevice(
      name, TmemShmemXml(st.socket_path, options_.vectors, Master()), do_live,
      do_config);
  if (!s.ok()) {
    if (!had_channel && !live && !config) {
      ReleaseChannelLocked(st, "attach failed");
      // An autoattach domain stays listed, with the error as its detail.
      if (!st.metadata.autoattach) domains_.erase(name);
    }
    Log(LogLevel::kWarn, "libvirt_attach_failed",
        {{"domain", name}, {"error", s.message()}});
    return absl::Status(s.code(), absl::StrCat("attach tmem to domain '", name,
                                               "': ", s.message()));
  }
  st.live_device = st.live_device || do_live || live.has_value();
  st.config_device = st.config_device || do_config || config.has_value();
  if (do_live) {
    if (absl::StatusOr<std::string> xml = hv_->GetXml(name, false); xml.ok()) {
      if (auto dev = FindTmemDevice(*xml)) st.alias = dev->alias;
    }
  }
  st.detach_pending = false;
  st.detach_timed_out = false;
  st.detail = do_live ? "attached" : "added to the persistent config";
  // Migratable: only a device QEMU starts with master=on (domain_xml.h).
  std::string migration;
  bool migratable_config = false;
  if (Master() && st.config_device) {
    absl::Status o = SetMasterOverrideLocked(name, true);
    migratable_config = o.ok();
    if (!o.ok()) {
      migration = absl::StrCat(
          "; not migratable: the persistent definition did not take the "
          "master=on override (",
          o.message(), ")");
      Log(LogLevel::kWarn, "libvirt_override_failed",
          {{"domain", name}, {"error", o.message()}});
    } else if (do_live) {
      migration =
          "; migratable from the next start (the hot-plugged device runs in "
          "QEMU's peer mode until then)";
    }
  } else if (Master() && do_live) {
    migration =
        "; not migratable: QEMU runs a hot-plugged device in peer mode "
        "(libvirt 9.0 drops role='master'); attach --persistent and restart "
        "the domain to migrate it";
  }
  st.detail += migration;
  Log(LogLevel::kInfo, "libvirt_attached",
      {{"domain", name},
       {"vm", st.vm},
       {"socket", st.socket_path},
       {"live", do_live},
       {"config", do_config},
       {"alias", st.alias},
       {"migratable_config", migratable_config}});
  return ToState(st);
}

absl::StatusOr<DomainAttachState> DomainManager::Detach(const std::string& name,
                                                        bool persistent) {
  WaitForConnection();
  MutexLock op(&op_mu_);
  absl::StatusOr<DomainSummary> d = hv_->GetDomain(name);
  if (!d.ok()) return d.status();
  std::optional<TmemDevice> live;
  std::optional<TmemDevice> config;
  if (d->active) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, false);
    if (!xml.ok()) return xml.status();
    live = FindTmemDevice(*xml);
  }
  if (d->persistent) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, true);
    if (!xml.ok()) return xml.status();
    config = FindTmemDevice(*xml);
  }
  const bool do_config = persistent && config.has_value();
  if (!live && !do_config) {
    return absl::NotFoundError(absl::StrCat(
        "tmem is not attached to domain '", name, "'",
        config ? " (only in its persistent config: detach persistently)" : ""));
  }
  DomainState& st = domains_[name];
  st.name = name;
  st.uuid = d->uuid;
  const std::string path =
      live ? live->server_path : config->server_path;  // same device
  const std::string xml = TmemShmemXml(path, options_.vectors, Master());
  if (do_config) {
    if (absl::Status s = hv_->DetachDevice(name, xml, false, true); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("detach tmem from the config of '", name,
                                       "': ", s.message()));
    }
    st.config_device = false;
    // The override names a device that is gone; libvirt would keep it.
    if (absl::Status o = SetMasterOverrideLocked(name, false); !o.ok()) {
      Log(LogLevel::kWarn, "libvirt_override_failed",
          {{"domain", name}, {"error", o.message()}});
    }
  }
  if (live) {
    if (absl::Status s = hv_->DetachDevice(name, xml, true, false); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("detach tmem from domain '",
                                                 name, "': ", s.message()));
    }
    absl::StatusOr<std::string> now = hv_->GetXml(name, false);
    if (now.ok() && !FindTmemDevice(*now)) {
      // The guest acked while libvirt waited.
      st.live_device = false;
      st.alias.clear();
      ReleaseChannelLocked(st, "detached");
      st.detail = "detached";
    } else {
      st.detach_pending = true;
      st.detach_timed_out = false;
      st.detach_deadline = steady_clock::now() + options_.detach_timeout;
      st.detail = "detach requested, waiting for the guest to ack";
    }
  } else {
    ReleaseChannelLocked(st, "removed from the persistent config");
    st.detail = "removed from the persistent config";
  }
  Log(LogLevel::kInfo, "libvirt_detach",
      {{"domain", name}, {"persistent", do_config}, {"detail", st.detail}});
  DomainAttachState out = ToState(st);
  if (!st.channel && !st.live_device && !st.config_device &&
      !st.detach_pending && !st.metadata.autoattach) {
    domains_.erase(name);
  }
  return out;
}

std::vector<DomainAttachState> DomainManager::List() {
  MutexLock op(&op_mu_);
  CheckDeadlinesLocked();
  std::vector<DomainAttachState> out;
  for (const auto& [name, st] : domains_) out.push_back(ToState(st));
  return out;
}

absl::Status DomainManager::WritePolicyLocked(const std::string& name,
                                              bool live,
                                              const VmPolicy& policy) {
  TmemMetadata m;
  absl::StatusOr<std::optional<std::string>> old =
      hv_->GetMetadata(name, /*inactive=*/!live);
  if (!old.ok()) return old.status();
  if (old->has_value()) {
    // A side whose element does not parse gets a fresh one (its error was
    // reported when it was read); autoattach is kept where it parses.
    if (absl::StatusOr<TmemMetadata> parsed = ParseTmemMetadata(**old);
        parsed.ok()) {
      m = *parsed;
    }
  }
  m.policy = policy;
  return hv_->SetMetadata(name, FormatTmemMetadata(m), /*live=*/live,
                          /*config=*/!live);
}

absl::Status DomainManager::PolicyChanged(const std::string& vm,
                                          const VmPolicy& policy) {
  MutexLock op(&op_mu_);
  DomainState* st = nullptr;
  for (auto& [name, s] : domains_) {
    if ((s.channel || s.swap_device) && s.vm == vm) st = &s;
  }
  if (st == nullptr) return absl::OkStatus();  // not a libvirt domain's VM
  absl::StatusOr<DomainSummary> d = hv_->GetDomain(st->name);
  if (!d.ok()) return d.status();
  // Recorded first: the METADATA_CHANGE event this write causes then finds
  // nothing new to apply.
  st->metadata.policy = policy;
  st->metadata.present = true;
  st->applied = st->metadata;
  absl::Status out = absl::OkStatus();
  for (const bool live : {true, false}) {
    if (live ? !d->active : !d->persistent) continue;
    if (absl::Status s = WritePolicyLocked(st->name, live, policy); !s.ok()) {
      out =
          absl::Status(s.code(), absl::StrCat("writing the policy into the ",
                                              live ? "live" : "persistent",
                                              " metadata of domain '", st->name,
                                              "' failed: ", s.message()));
    }
  }
  Log(out.ok() ? LogLevel::kInfo : LogLevel::kWarn, "libvirt_policy_written",
      {{"domain", st->name},
       {"vm", vm},
       {"quota", policy.quota_bytes},
       {"weight", policy.weight},
       {"mode", ValveModeName(policy.mode)},
       {"swap_quota", policy.swap_quota_bytes},
       {"swap_mode", ValveModeName(policy.swap_mode)},
       {"error", out.ok() ? std::string() : std::string(out.message())}});
  return out;
}

DomainAttachState DomainManager::ToState(const DomainState& st) {
  DomainAttachState s;
  s.domain = st.name;
  s.vm = st.channel ? st.vm : "";
  s.attached = st.live_device;
  s.persistent = st.config_device;
  s.detail = st.detail;
  return s;
}

absl::StatusOr<DomainAttachState> DomainManager::AttachSwap(
    const std::string& name, uint64_t size_bytes) {
  if (!options_.add_swap_device) {
    return absl::FailedPreconditionError(
        "this tmemd has no swap devices (docs/swap-device.md)");
  }
  if (size_bytes == 0) {
    return absl::InvalidArgumentError("swap size: 0 bytes");
  }
  WaitForConnection();
  MutexLock op(&op_mu_);
  absl::StatusOr<DomainSummary> d = hv_->GetDomain(name);
  if (!d.ok()) return d.status();
  if (!d->persistent) {
    return absl::FailedPreconditionError(absl::StrCat(
        "domain '", name,
        "' is transient: the swap device goes into the persistent "
        "definition, which a transient domain does not have (virsh define "
        "it first)"));
  }
  absl::StatusOr<std::string> xml = hv_->GetXml(name, /*inactive=*/true);
  if (!xml.ok()) return xml.status();
  DomainAttachState out;
  out.domain = name;
  out.vm = VmNameFor(name, d->uuid);
  const std::string socket =
      SwapSocketPath(agent_->options().socket_dir, out.vm);
  // The definition is checked before the device is made, so a refused
  // <memoryBacking> leaves nothing behind.
  absl::StatusOr<SwapDiskEdit> edit = WithSwapDisk(*xml, socket);
  if (!edit.ok()) {
    return absl::Status(
        edit.status().code(),
        absl::StrCat("domain '", name, "': ", edit.status().message()));
  }
  const absl::Status added = options_.add_swap_device(out.vm, size_bytes);
  if (!added.ok() && !absl::IsAlreadyExists(added)) return added;
  if (edit->changed()) {
    if (absl::Status s = hv_->DefineXml(edit->xml); !s.ok()) {
      if (added.ok()) (void)options_.remove_swap_device(out.vm);
      return absl::Status(
          s.code(), absl::StrCat("domain '", name,
                                 "': libvirt refused the definition with the "
                                 "swap device: ",
                                 s.message()));
    }
  }
  out.attached = true;
  out.persistent = true;
  out.detail = absl::StrCat(
      "swap device ", edit->target_dev, " on ", socket,
      edit->disk_added ? " written into" : " already in",
      " the persistent definition",
      edit->memory_backing_added
          ? ", with the guest's memory shared (<memoryBacking> memfd, shared)"
          : "",
      added.ok() ? "" : " (tmemd already had the device)", "; ",
      d->active
          ? "takes effect at the domain's next cold boot (shut it off, then "
            "start it): a reboot inside the guest keeps the running QEMU, "
            "which has neither the disk nor shared memory"
          : "takes effect when the domain next starts",
      // The device lives in this tmemd; libvirt would wait for its socket
      // at every start after a tmemd restart.
      "; to serve it after tmemd restarts too, add [swap.", out.vm,
      "] size = \"", size_bytes, "\" to tmemd's config");
  Log(LogLevel::kInfo, "libvirt_swap_attached",
      {{"domain", name},
       {"vm", out.vm},
       {"socket", socket},
       {"target", edit->target_dev},
       {"size_bytes", size_bytes},
       {"definition_changed", edit->changed()},
       {"active", d->active}});
  // The device's VM takes the domain's metadata policy now, not at the
  // DEFINED event (there is none when the definition was already right).
  ReconcileLocked(name, /*autoattach=*/false);
  return out;
}

absl::StatusOr<DomainAttachState> DomainManager::DetachSwap(
    const std::string& name) {
  if (!options_.remove_swap_device) {
    return absl::FailedPreconditionError(
        "this tmemd has no swap devices (docs/swap-device.md)");
  }
  WaitForConnection();
  MutexLock op(&op_mu_);
  absl::StatusOr<DomainSummary> d = hv_->GetDomain(name);
  if (!d.ok()) return d.status();
  DomainAttachState out;
  out.domain = name;
  out.vm = VmNameFor(name, d->uuid);
  const std::string socket =
      SwapSocketPath(agent_->options().socket_dir, out.vm);
  std::string config_note = "the persistent definition has no swap disk";
  if (d->persistent) {
    absl::StatusOr<std::string> xml = hv_->GetXml(name, /*inactive=*/true);
    if (!xml.ok()) return xml.status();
    const SwapDiskRemoval r = WithoutSwapDisk(*xml, socket);
    if (r.removed) {
      if (absl::Status s = hv_->DefineXml(r.xml); !s.ok()) return s;
      config_note =
          "swap disk removed from the persistent definition (its "
          "<memoryBacking>, shared memfd, stays: remove it by hand if "
          "nothing else needs it)";
    }
  }
  // A running QEMU with the disk still reads and writes it: the guest's
  // swapped-out pages are there.
  bool in_use = false;
  if (d->active) {
    absl::StatusOr<std::string> live = hv_->GetXml(name, /*inactive=*/false);
    if (!live.ok()) return live.status();
    for (const std::string& p : VhostUserDiskSockets(*live)) {
      in_use = in_use || p == socket;
    }
  }
  std::string device_note;
  if (in_use) {
    device_note =
        "; tmemd keeps serving the device while the running QEMU uses it: "
        "detach again once the domain is shut off to free it";
  } else {
    const absl::Status s = options_.remove_swap_device(out.vm);
    if (!s.ok() && !absl::IsNotFound(s)) return s;
    device_note = s.ok() ? "; tmemd's swap device removed" : "";
  }
  out.attached = in_use;
  out.persistent = false;
  out.detail = config_note + device_note;
  Log(LogLevel::kInfo, "libvirt_swap_detached",
      {{"domain", name}, {"vm", out.vm}, {"in_use", in_use}});
  ReconcileLocked(name, /*autoattach=*/false);
  return out;
}

absl::StatusOr<DomainAttachState> DomainManager::MigrateFromHook(
    const std::string& domain_xml) {
  DomainAttachState out;
  out.domain = DomainXmlElement(domain_xml, "name");
  const absl::Status s =
      CheckMigratableWithSwap(domain_xml, agent_->options().socket_dir);
  if (!s.ok()) {
    Log(LogLevel::kWarn, "libvirt_migration_refused",
        {{"domain", out.domain}, {"reason", s.message()}});
    return s;
  }
  out.detail = "no tmemd swap device: migration allowed";
  return out;
}

}  // namespace tmem
