#include "host-agent/control/control_plane.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "host-agent/common/proto_mode.h"
#include "host-agent/common/setting_ranges.h"
#include "host-agent/config.h"

#ifndef TMEMD_VERSION
#define TMEMD_VERSION "unknown"
#endif

namespace tmem {
namespace {

using google::protobuf::RepeatedPtrField;

void AddStoreCounters(const CounterValues& v,
                      RepeatedPtrField<v1::Counter>* out) {
  for (int i = 0; i < kNumCounters; ++i) {
    const auto c = static_cast<Counter>(i);
    v1::Counter* m = out->Add();
    m->set_name(std::string(CounterName(c)));
    m->set_value(v[i]);
    m->set_gauge(CounterIsGauge(c));
  }
}

// Deferred compression (backend/compactor.h), named compactor_*.
void AddCompactorCounters(const CompactorStats& k,
                          RepeatedPtrField<v1::Counter>* out) {
  auto add = [out](std::string name, uint64_t value, bool gauge) {
    v1::Counter* m = out->Add();
    m->set_name(std::move(name));
    m->set_value(value);
    m->set_gauge(gauge);
  };
  add("compactor_compressed", k.compressed, false);
  add("compactor_kept_raw", k.kept_raw, false);
  add("compactor_skipped_no_reuse", k.skipped_no_reuse, false);
  add("compactor_stale", k.stale, false);
  add("compactor_no_room", k.no_room, false);
  add("compactor_queue_length", k.queue.length, true);
  add("compactor_queue_overflows", k.queue.overflows, false);
  for (int i = 0; i < kNumCompactionSkips; ++i) {
    add(absl::StrCat(
            "compactor_skipped_",
            std::string(CompactionSkipName(static_cast<CompactionSkip>(i)))),
        k.queue.skipped[i], false);
  }
  add("compactor_idle_cpu_ns", k.idle_cpu_ns, false);
  add("compactor_normal_cpu_ns", k.normal_cpu_ns, false);
  add("compactor_priority_failures", k.priority_failures, false);
}

absl::Status UnknownVm(const std::string& vm) {
  return absl::NotFoundError(absl::StrCat(
      "no VM named '", vm, "' on this host ('tmemctl vms' lists them)"));
}

std::string FormatBytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30) && b % (uint64_t{1} << 20) == 0) {
    return absl::StrFormat("%.2fGiB", static_cast<double>(b) / (1 << 30));
  }
  if (b >= (uint64_t{1} << 20)) {
    return absl::StrFormat("%.1fMiB", static_cast<double>(b) / (1 << 20));
  }
  return absl::StrCat(b, " bytes");
}

// The VM's whole policy. The store keeps quota, weight, enabled and frozen
// but not the mode (the valve does), so Agent's VmInfo.policy.mode is always
// kDefault: take the mode from the valve.
VmPolicy CurrentPolicy(const VmInfo& info) {
  VmPolicy p = info.policy;
  p.mode = info.valve.mode;
  return p;
}

absl::Status NeedVmName(const std::string& vm) {
  if (vm.empty()) {
    return absl::InvalidArgumentError("the request names no VM (field 'vm')");
  }
  return absl::OkStatus();
}

}  // namespace

std::string TmemdVersion() { return TMEMD_VERSION; }

std::string ValveDecision(const VmPolicy& policy, const ValveVmStatus& valve) {
  if (!policy.enabled) return "disabled";
  if (policy.frozen) return "frozen";
  switch (valve.effective_mode) {
    case ValveMode::kOff:
      return "off";
    case ValveMode::kAlways:
      return "compress";
    default:
      break;
  }
  if (valve.standing_aside) return "aside";
  if (valve.throttled) return "throttled";
  if (valve.cpu_tokens_ns >= 0) return "compress";
  if (valve.cpu_tokens_ns >= -valve.cpu_share_ns) return "raw";
  return "drop";
}

absl::StatusOr<PoolUuid> ParsePoolUuid(const std::string& text) {
  PoolUuid uuid;
  size_t pos = 0;
  int n = 0;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < text.size() && n < 16;) {
    if (text[i] == '-' && (i == 8 || i == 13 || i == 18 || i == 23)) {
      ++i;
      continue;
    }
    const int hi = hex(text[i]);
    const int lo = i + 1 < text.size() ? hex(text[i + 1]) : -1;
    if (hi < 0 || lo < 0) break;
    uuid.bytes[n++] = static_cast<uint8_t>(hi << 4 | lo);
    i += 2;
    pos = i;
  }
  if (n != 16 || pos != text.size() || text.size() != 36) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text,
                     "' is not a filesystem UUID: use the 8-4-4-4-12 hex form "
                     "that blkid prints"));
  }
  return uuid;
}

std::string FormatPoolUuid(const PoolUuid& uuid) {
  std::string out;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    absl::StrAppendFormat(&out, "%02x", uuid.bytes[i]);
  }
  return out;
}

ControlPlane::ControlPlane(Agent* agent, PolicyStore* policies,
                           DomainControl* domains)
    : agent_(agent), policies_(policies), domains_(domains) {}

VmPolicy ControlPlane::ResolveVmPolicy(const std::string& vm,
                                       const VmPolicy& configured) const {
  std::optional<StoredVmPolicy> saved = policies_->Vm(vm);
  VmPolicy p = saved ? saved->policy : configured;
  std::optional<v1::SetVmPolicyRequest> fleet;
  {
    MutexLock lock(&fleet_mu_);
    if (fleet_) fleet = fleet_->ForVm(vm);
  }
  if (fleet) {
    // Already validated when the revision was applied; only the quota may
    // now exceed a cap changed since, and then the VM keeps its own.
    absl::StatusOr<VmPolicy> overlaid = PlanVmPolicy(
        *fleet, p, agent_->store().GetHostStats().memory_cap_bytes);
    if (overlaid.ok()) p = *overlaid;
  }
  return p;
}

absl::Status ControlPlane::ApplyStoredPolicies() {
  MutexLock lock(&write_mu_);
  const StoredHostPolicy host = policies_->Host();
  if (host.memory_cap_bytes) {
    if (absl::Status s = agent_->SetMemoryCap(*host.memory_cap_bytes);
        !s.ok()) {
      return s;
    }
  }
  if (host.cpu_budget_percent || host.default_mode) {
    ValveOptions opts = agent_->GetValveOptions();
    if (host.cpu_budget_percent) {
      opts.cpu_budget_percent = *host.cpu_budget_percent;
    }
    if (host.default_mode) opts.default_mode = *host.default_mode;
    if (absl::Status s = agent_->SetValveOptions(opts); !s.ok()) return s;
  }
  for (const std::string& vm : agent_->VmNames()) {
    if (std::optional<StoredVmPolicy> saved = policies_->Vm(vm)) {
      if (absl::Status s = agent_->SetVmPolicy(vm, saved->policy); !s.ok()) {
        return s;
      }
    }
  }
  for (const SharedPoolGrant& g : policies_->SharedPoolGrants()) {
    absl::StatusOr<PoolUuid> uuid = ParsePoolUuid(g.uuid);
    if (!uuid.ok()) return uuid.status();
    agent_->store().AuthorizeSharedPool(*uuid, g.vm);
  }
  return absl::OkStatus();
}

v1::HostPolicy ControlPlane::HostPolicyMessage() const {
  v1::HostPolicy p;
  const ValveOptions opts = agent_->GetValveOptions();
  p.set_memory_cap_bytes(agent_->store().GetHostStats().memory_cap_bytes);
  p.set_cpu_budget_percent(opts.cpu_budget_percent);
  p.set_default_mode(ProtoMode(opts.default_mode));
  p.set_generation(policies_->Host().generation);
  return p;
}

v1::HostStatus ControlPlane::Status() const {
  const AgentStatus st = agent_->Status();
  v1::HostStatus out;
  out.set_version(TmemdVersion());
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) out.set_hostname(host);
  out.set_uptime_seconds(st.uptime_nanos / 1000000000);
  out.set_host_generation(agent_->host_generation());
  out.set_memory_cap_bytes(st.store.memory_cap_bytes);
  out.set_memory_used_bytes(st.store.memory_used_bytes);
  out.set_cpu_budget_percent(st.valve.options.cpu_budget_percent);
  out.set_cpu_used_fraction(st.valve.agent_busy_fraction);
  v1::ValveHost* v = out.mutable_valve();
  v->set_num_cpus(st.valve.num_cpus);
  v->set_host_busy_fraction(st.valve.host_busy_fraction);
  v->set_agent_busy_fraction(st.valve.agent_busy_fraction);
  v->set_cpu_pressure(st.valve.cpu_pressure);
  v->set_budget_fraction(st.valve.budget_fraction);
  v->set_ticks(st.valve.ticks);
  *out.mutable_policy() = HostPolicyMessage();
  out.set_workers(st.workers);
  out.set_vms(static_cast<int32_t>(agent_->VmNames().size()));
  AddStoreCounters(st.store.counters, out.mutable_counters());
  // Host-only store figures: what isolation tests and operators watch for
  // a VM reaching beyond its own data or ids, and what choosing
  // whole slabs to empty costs.
  const std::pair<const char*, uint64_t> host_counters[] = {
      {"pool_scan_objects_visited", st.store.pool_scan_objects_visited},
      {"unknown_vm_ids_refused", st.store.unknown_vm_ids_refused},
      {"slabs_emptied_for_room", st.store.slabs_emptied_for_room},
      {"slab_choice_pages_walked", st.store.slab_choice_pages_walked},
      {"max_op_work", st.store.max_op_work},
      {"metadata_chunks_released", st.store.metadata_chunks_released},
      {"metadata_entries_moved", st.store.metadata_entries_moved},
      {"puts_refused_at_work_bound", st.store.puts_refused_at_work_bound},
      {"vm_charged_bytes", st.store.vm_charged_bytes},
      {"host_overhead_bytes", st.store.host_overhead_bytes}};
  for (const auto& [name, value] : host_counters) {
    v1::Counter* m = out.add_counters();
    m->set_name(name);
    m->set_value(value);
  }
  v1::Counter* vm_structs = out.add_counters();
  vm_structs->set_name("vm_structs");  // live per-VM structs in the store
  vm_structs->set_value(st.store.vm_structs);
  vm_structs->set_gauge(true);
  AddCompactorCounters(st.compactor, out.mutable_counters());
  out.set_compression_ratio(CompressionRatio(st.store.counters));
  {
    // Held across the call so SetExtraCounters(nullptr) waits for it.
    MutexLock lock(&extra_mu_);
    if (extra_counters_) {
      for (const auto& [name, value] : extra_counters_()) {
        v1::Counter* m = out.add_counters();
        m->set_name(name);
        m->set_value(value);
      }
    }
  }
  {
    MutexLock lock(&listener_mu_);
    if (listener_counters_) {
      for (v1::Counter& c : listener_counters_()) {
        *out.add_counters() = std::move(c);
      }
    }
  }
  return out;
}

void ControlPlane::SetExtraCounters(ExtraCounters source) {
  MutexLock lock(&extra_mu_);
  extra_counters_ = std::move(source);
}

void ControlPlane::SetListenerCounters(ListenerCounters source) {
  MutexLock lock(&listener_mu_);
  listener_counters_ = std::move(source);
}

v1::VmPolicy ControlPlane::PolicyMessage(const std::string& vm,
                                         const VmPolicy& policy) const {
  v1::VmPolicy p;
  p.set_quota_bytes(policy.quota_bytes == kUnlimitedQuota ? 0
                                                          : policy.quota_bytes);
  p.set_weight(policy.weight);
  p.set_mode(ProtoMode(policy.mode));
  p.set_enabled(policy.enabled);
  p.set_frozen(policy.frozen);
  p.set_swap_quota_bytes(
      policy.swap_quota_bytes == kUnlimitedQuota ? 0 : policy.swap_quota_bytes);
  p.set_swap_mode(ProtoMode(policy.swap_mode));
  std::optional<StoredVmPolicy> saved = policies_->Vm(vm);
  p.set_generation(saved ? saved->generation : 0);
  return p;
}

namespace {

v1::SwapDevice SwapMessage(const SwapDeviceInfo& info) {
  v1::SwapDevice m;
  m.set_socket_path(info.socket_path);
  m.set_size_bytes(info.size_bytes);
  m.set_connected(info.connected);
  m.set_stored_pages(info.pages.stored);
  m.set_memory_pages(info.pages.in_memory);
  m.set_memory_bytes(info.pages.memory_bytes);
  m.set_spilled_pages(info.pages.spilled);
  m.set_compressed_puts(info.pages.compressed_puts);
  m.set_raw_puts(info.pages.raw_puts);
  m.set_lost_pages(info.pages.lost);
  for (const auto& [name, value] : info.pages.counters) {
    v1::Counter* c = m.add_backing_counters();
    c->set_name(name);
    c->set_value(value);
  }
  m.set_discarded_pages(info.times.discarded_pages);
  m.set_reads(info.counters[static_cast<int>(swap::SwapCounter::kReads)]);
  m.set_writes(info.counters[static_cast<int>(swap::SwapCounter::kWrites)]);
  m.set_read_ns(info.times.read_ns);
  m.set_read_calls(info.times.read_calls);
  m.set_write_ns(info.times.write_ns);
  m.set_write_calls(info.times.write_calls);
  for (int i = 0; i < swap::kNumSwapCounters; ++i) {
    v1::Counter* c = m.add_counters();
    c->set_name(
        std::string(swap::SwapCounterName(static_cast<swap::SwapCounter>(i))));
    c->set_value(info.counters[i]);
  }
  return m;
}

}  // namespace

v1::VmDetail ControlPlane::Detail(const VmInfo& info) const {
  v1::VmDetail d;
  const CounterValues& c = info.stats.counters;
  v1::VmSummary* s = d.mutable_summary();
  s->set_name(info.name);
  s->set_connected(info.connected);
  *s->mutable_policy() = PolicyMessage(info.name, CurrentPolicy(info));
  s->set_pages(CounterValueOf(c, Counter::kPagesHeld));
  s->set_stored_bytes(CounterValueOf(c, Counter::kStoredBytes));
  s->set_charged_bytes(CounterValueOf(c, Counter::kChargedBytes));
  uint64_t puts = 0;
  for (Counter k :
       {Counter::kPutsCompressed, Counter::kPutsRaw, Counter::kPutsZero,
        Counter::kPutsSameFilled, Counter::kPutsRefusedQuota,
        Counter::kPutsRefusedPoorCompression, Counter::kPutsRefusedNoMemory,
        Counter::kPutsRefusedPolicy}) {
    puts += CounterValueOf(c, k);
  }
  s->set_puts(puts);
  const uint64_t hit = CounterValueOf(c, Counter::kGetsHit);
  const uint64_t miss = CounterValueOf(c, Counter::kGetsMiss);
  s->set_gets_hit(hit);
  s->set_gets_miss(miss);
  s->set_hit_ratio(hit + miss == 0 ? 0.0
                                   : static_cast<double>(hit) /
                                         static_cast<double>(hit + miss));
  s->set_decision(ValveDecision(info.policy, info.valve));
  s->set_has_channel(info.has_channel);
  if (info.swap) *s->mutable_swap() = SwapMessage(*info.swap);
  d.set_socket_path(info.socket_path);
  AddStoreCounters(c, d.mutable_counters());
  for (int i = 0; i < kNumChannelCounters; ++i) {
    v1::Counter* m = d.add_channel_counters();
    m->set_name(
        std::string(ChannelCounterName(static_cast<ChannelCounter>(i))));
    m->set_value(info.channel[i]);
  }
  v1::ValveVm* v = d.mutable_valve();
  v->set_mode(ProtoMode(info.valve.mode));
  v->set_effective_mode(ProtoMode(info.valve.effective_mode));
  v->set_admission(info.valve.admission);
  v->set_throttled(info.valve.throttled);
  v->set_reuse_ratio(info.valve.reuse_ratio);
  v->set_cpu_tokens_ns(info.valve.cpu_tokens_ns);
  v->set_cpu_used_ns(info.valve.cpu_used_ns);
  v->set_decision(s->decision());
  v->set_standing_aside(info.valve.standing_aside);
  for (int i = 0; i < kNumValveCounters; ++i) {
    v1::Counter* m = v->add_counters();
    m->set_name(std::string(ValveCounterName(static_cast<ValveCounter>(i))));
    m->set_value(info.valve.counters[i]);
  }
  v1::GuestReport* g = d.mutable_guest();
  g->set_standing_aside(info.guest.standing_aside);
  g->set_flags(info.guest.flags);
  g->set_features(info.guest.features);
  g->set_get_ns(info.guest.get_ns);
  g->set_miss_ns(info.guest.miss_ns);
  g->set_prefetch_used(info.guest.prefetch_used);
  g->set_prefetch_unused(info.guest.prefetch_unused);
  g->set_ram_pages(info.guest.ram_pages);
  for (const PoolStats& p : info.stats.pools) {
    v1::PoolStats* m = d.add_pools();
    m->set_id(p.id);
    m->set_shared(p.shared);
    if (p.shared) m->set_uuid(FormatPoolUuid(p.uuid));
    AddStoreCounters(p.counters, m->mutable_counters());
  }
  return d;
}

v1::ListVmsResponse ControlPlane::ListVms() const {
  v1::ListVmsResponse out;
  for (const VmInfo& info : agent_->ListVms()) {
    *out.add_vms() = Detail(info).summary();
  }
  return out;
}

absl::StatusOr<v1::VmDetail> ControlPlane::GetVm(const std::string& vm) const {
  if (absl::Status s = NeedVmName(vm); !s.ok()) return s;
  absl::StatusOr<VmInfo> info = agent_->GetVm(vm);
  if (!info.ok()) return UnknownVm(vm);
  return Detail(*info);
}

v1::StatsSample ControlPlane::Sample(
    const v1::WatchStatsRequest& request) const {
  v1::StatsSample out;
  out.set_timestamp_unix_ms(
      std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count());
  *out.mutable_host() = Status();
  for (const VmInfo& info : agent_->ListVms()) {
    bool wanted = request.vms().empty();
    for (const std::string& name : request.vms()) wanted |= name == info.name;
    if (wanted) *out.add_vms() = Detail(info);
  }
  return out;
}

absl::StatusOr<VmPolicy> ControlPlane::PlanVmPolicy(
    const v1::SetVmPolicyRequest& r, const VmPolicy& current,
    uint64_t cap) const {
  VmPolicy p = current;
  if (r.has_quota_bytes()) {
    if (absl::Status s = CheckRange(ranges::kQuota, r.quota_bytes(),
                                    absl::StrCat("VM '", r.vm(), "'"));
        !s.ok()) {
      return s;
    }
    if (r.quota_bytes() == 0) {
      p.quota_bytes = kUnlimitedQuota;
    } else if (r.quota_bytes() > cap) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quota ", FormatBytes(r.quota_bytes()), " for VM '", r.vm(),
          "' is above the host memory cap ", FormatBytes(cap),
          ": lower the quota, or raise the cap first (tmemctl set-host "
          "--memory-cap)"));
    } else {
      p.quota_bytes = r.quota_bytes();
    }
  }
  if (r.has_weight()) {
    if (absl::Status s = CheckRange(
            ranges::kWeight, static_cast<int64_t>(r.weight()),
            absl::StrCat("VM '", r.vm(), "' (100 is the default share)"));
        !s.ok()) {
      return s;
    }
    p.weight = static_cast<uint32_t>(r.weight());
  }
  if (r.mode() != v1::MODE_UNSPECIFIED) {
    absl::StatusOr<ValveMode> m = ValveModeFromProto(
        r.mode(), DefaultMode::kAllowed, absl::StrCat("VM '", r.vm(), "'"));
    if (!m.ok()) return m.status();
    p.mode = *m;
  }
  // The swap quota is not checked against the quota or the cap: both bound
  // it anyway (a swap page past any of them goes to the spill image), and
  // either may be lowered later.
  if (r.has_swap_quota_bytes()) {
    if (absl::Status s =
            CheckRange(ranges::kSwapQuota, r.swap_quota_bytes(),
                       absl::StrCat("VM '", r.vm(), "' swap_quota_bytes"));
        !s.ok()) {
      return s;
    }
    p.swap_quota_bytes = QuotaFromSetting(r.swap_quota_bytes());
  }
  if (r.swap_mode() != v1::MODE_UNSPECIFIED) {
    absl::StatusOr<ValveMode> m =
        ValveModeFromProto(r.swap_mode(), DefaultMode::kAllowed,
                           absl::StrCat("VM '", r.vm(), "' swap_mode"));
    if (!m.ok()) return m.status();
    p.swap_mode = *m;
  }
  if (r.has_enabled()) p.enabled = r.enabled();
  if (r.has_frozen()) p.frozen = r.frozen();
  return p;
}

absl::StatusOr<v1::SetVmPolicyResponse> ControlPlane::SetVmPolicy(
    const v1::SetVmPolicyRequest& r) {
  if (absl::Status s = NeedVmName(r.vm()); !s.ok()) return s;
  MutexLock lock(&write_mu_);
  absl::StatusOr<VmInfo> current = agent_->GetVm(r.vm());
  if (!current.ok()) return UnknownVm(r.vm());
  absl::StatusOr<uint64_t> generation =
      policies_->NextVmGeneration(r.vm(), r.generation());
  if (!generation.ok()) return generation.status();
  absl::StatusOr<VmPolicy> p =
      PlanVmPolicy(r, CurrentPolicy(*current),
                   agent_->store().GetHostStats().memory_cap_bytes);
  if (!p.ok()) return p.status();
  if (absl::Status s = agent_->SetVmPolicy(r.vm(), *p); !s.ok()) {
    if (s.code() == absl::StatusCode::kNotFound) return UnknownVm(r.vm());
    return s;
  }
  if (absl::Status s = policies_->CommitVm(r.vm(), {*p, *generation});
      !s.ok()) {
    return absl::InternalError(absl::StrCat(
        "the policy is applied but was not saved, so a restart loses it: ",
        s.message()));
  }
  // A libvirt domain's VM: into the domain's metadata too, so the policy
  // travels with the domain when it migrates.
  if (domains_ != nullptr) {
    if (absl::Status s = domains_->PolicyChanged(r.vm(), *p); !s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat("the policy is applied and saved on this host, but "
                       "not in the domain's metadata, so it does not travel "
                       "with the domain: ",
                       s.message()));
    }
  }
  v1::SetVmPolicyResponse out;
  *out.mutable_policy() = PolicyMessage(r.vm(), *p);
  return out;
}

absl::StatusOr<v1::SetVmPolicyResponse> ControlPlane::SetFrozen(
    const std::string& vm, bool frozen) {
  v1::SetVmPolicyRequest r;
  r.set_vm(vm);
  r.set_frozen(frozen);
  return SetVmPolicy(r);
}

absl::StatusOr<ControlPlane::HostPlan> ControlPlane::PlanHostPolicy(
    const v1::SetHostPolicyRequest& r) const {
  HostPlan plan;
  plan.stored = policies_->Host();
  plan.valve = agent_->GetValveOptions();
  if (r.has_memory_cap_bytes()) {
    if (absl::Status s =
            CheckRange(ranges::kMemoryCap, r.memory_cap_bytes(), "host");
        !s.ok()) {
      return s;
    }
    plan.memory_cap = r.memory_cap_bytes();
    plan.stored.memory_cap_bytes = r.memory_cap_bytes();
  }
  if (r.has_cpu_budget_percent()) {
    const double b = r.cpu_budget_percent();
    if (absl::Status s = CheckRange(ranges::kCpuBudgetPercent, b,
                                    "host (a percentage of the whole host)");
        !s.ok()) {
      return s;
    }
    plan.valve.cpu_budget_percent = b;
    plan.stored.cpu_budget_percent = b;
    plan.valve_changed = true;
  }
  if (r.default_mode() != v1::MODE_UNSPECIFIED) {
    absl::StatusOr<ValveMode> m = ValveModeFromProto(
        r.default_mode(), DefaultMode::kRefused, "host default_mode");
    if (!m.ok()) return m.status();
    plan.valve.default_mode = *m;
    plan.stored.default_mode = *m;
    plan.valve_changed = true;
  }
  if (plan.valve_changed) {
    if (absl::Status s = Valve::ValidateOptions(plan.valve); !s.ok()) return s;
  }
  return plan;
}

absl::Status ControlPlane::ApplyHostPlan(const HostPlan& plan) {
  if (plan.memory_cap) {
    if (absl::Status s = agent_->SetMemoryCap(*plan.memory_cap); !s.ok()) {
      return s;
    }
  }
  if (plan.valve_changed) {
    if (absl::Status s = agent_->SetValveOptions(plan.valve); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::SetHostPolicyResponse> ControlPlane::SetHostPolicy(
    const v1::SetHostPolicyRequest& r) {
  MutexLock lock(&write_mu_);
  absl::StatusOr<uint64_t> generation =
      policies_->NextHostGeneration(r.generation());
  if (!generation.ok()) return generation.status();
  absl::StatusOr<HostPlan> plan = PlanHostPolicy(r);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = ApplyHostPlan(*plan); !s.ok()) return s;
  plan->stored.generation = *generation;
  if (absl::Status s = policies_->CommitHost(plan->stored); !s.ok()) {
    return absl::InternalError(absl::StrCat(
        "the host policy is applied but was not saved, so a restart loses "
        "it: ",
        s.message()));
  }
  v1::SetHostPolicyResponse out;
  *out.mutable_policy() = HostPolicyMessage();
  return out;
}

absl::Status ControlPlane::ApplyPolicySet(const PolicySet& policy,
                                          bool dry_run) {
  MutexLock lock(&write_mu_);
  // 1. Plan everything; nothing changes until every part is valid.
  absl::StatusOr<HostPlan> host = PlanHostPolicy(policy.host);
  if (!host.ok()) return host.status();
  const uint64_t old_cap = agent_->store().GetHostStats().memory_cap_bytes;
  const uint64_t cap = host->memory_cap.value_or(old_cap);
  struct VmChange {
    std::string name;
    VmPolicy before;
    VmPolicy after;
  };
  std::vector<VmChange> vms;
  for (const std::string& name : agent_->VmNames()) {
    absl::StatusOr<VmInfo> info = agent_->GetVm(name);
    if (!info.ok()) continue;  // removed meanwhile: nothing to apply
    const VmPolicy before = CurrentPolicy(*info);
    absl::StatusOr<VmPolicy> after =
        PlanVmPolicy(policy.ForVm(name), before, cap);
    if (!after.ok()) return after.status();
    vms.push_back({name, before, *after});
  }
  if (dry_run) return absl::OkStatus();
  // 2. Apply; a failure puts back what was changed before it.
  const ValveOptions old_valve = agent_->GetValveOptions();
  auto undo = [&](size_t vms_done) {
    for (size_t i = 0; i < vms_done; ++i) {
      (void)agent_->SetVmPolicy(vms[i].name, vms[i].before);
    }
    if (host->valve_changed) (void)agent_->SetValveOptions(old_valve);
    if (host->memory_cap) (void)agent_->SetMemoryCap(old_cap);
  };
  if (absl::Status s = ApplyHostPlan(*host); !s.ok()) {
    undo(0);
    return s;
  }
  for (size_t i = 0; i < vms.size(); ++i) {
    absl::Status s = agent_->SetVmPolicy(vms[i].name, vms[i].after);
    if (s.code() == absl::StatusCode::kNotFound) continue;  // VM just left
    if (!s.ok()) {
      undo(i);
      return s;
    }
  }
  {
    MutexLock fleet_lock(&fleet_mu_);
    fleet_ = policy;
  }
  // 3. Record it, so a restart enforces it before etcd is reachable.
  absl::Status saved = absl::OkStatus();
  if (host->memory_cap || host->valve_changed) {
    absl::StatusOr<uint64_t> g = policies_->NextHostGeneration(0);
    host->stored.generation = g.ok() ? *g : host->stored.generation;
    saved.Update(policies_->CommitHost(host->stored));
  }
  for (const VmChange& vm : vms) {
    absl::StatusOr<uint64_t> g = policies_->NextVmGeneration(vm.name, 0);
    saved.Update(policies_->CommitVm(vm.name, {vm.after, g.ok() ? *g : 0}));
  }
  if (!saved.ok()) {
    return absl::InternalError(absl::StrCat(
        "the fleet policy is applied but was not saved, so a restart "
        "loses it: ",
        saved.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::FlushVmResponse> ControlPlane::FlushVm(
    const std::string& vm) {
  if (absl::Status s = NeedVmName(vm); !s.ok()) return s;
  MutexLock lock(&write_mu_);
  absl::StatusOr<VmInfo> info = agent_->GetVm(vm);
  if (!info.ok()) return UnknownVm(vm);
  const uint64_t before =
      CounterValueOf(info->stats.counters, Counter::kPagesHeld);
  // Private cache pools only: a shared pool's pages belong to every member,
  // and a persistent pool's are the swap device's (the guest's memory).
  for (const PoolStats& p : info->stats.pools) {
    if (p.shared || p.kind == PoolKind::kPersistent) continue;
    absl::Status s = agent_->store().InvalidatePool(info->stats.id, p.id);
    // The guest may have destroyed the pool meanwhile: nothing to drop.
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
  }
  absl::StatusOr<VmInfo> after = agent_->GetVm(vm);
  const uint64_t left =
      after.ok() ? CounterValueOf(after->stats.counters, Counter::kPagesHeld)
                 : 0;
  v1::FlushVmResponse out;
  out.set_pages_dropped(before > left ? before - left : 0);
  return out;
}

absl::StatusOr<v1::SwapDevice> ControlPlane::AddSwapDevice(
    const std::string& vm, uint64_t size_bytes) {
  if (absl::Status s = NeedVmName(vm); !s.ok()) return s;
  MutexLock lock(&write_mu_);
  absl::StatusOr<SwapDeviceInfo> info = agent_->AddSwapDevice(vm, size_bytes);
  if (!info.ok()) return info.status();
  return SwapMessage(*info);
}

absl::Status ControlPlane::RemoveSwapDevice(const std::string& vm) {
  if (absl::Status s = NeedVmName(vm); !s.ok()) return s;
  MutexLock lock(&write_mu_);
  return agent_->RemoveSwapDevice(vm);
}

absl::Status ControlPlane::AuthorizeSharedPool(
    const v1::AuthorizeSharedPoolRequest& r) {
  if (absl::Status s = ValidateVmName(r.vm()); !s.ok()) return s;
  absl::StatusOr<PoolUuid> uuid = ParsePoolUuid(r.uuid());
  if (!uuid.ok()) return uuid.status();
  MutexLock lock(&write_mu_);
  if (r.revoke()) {
    agent_->store().RevokeSharedPool(*uuid, r.vm());
  } else {
    agent_->store().AuthorizeSharedPool(*uuid, r.vm());
  }
  if (absl::Status s = policies_->SetSharedPoolGrant(
          {FormatPoolUuid(*uuid), r.vm()}, !r.revoke());
      !s.ok()) {
    return absl::InternalError(absl::StrCat(
        "the grant is applied but was not saved, so a restart loses it: ",
        s.message()));
  }
  return absl::OkStatus();
}

absl::Status ControlPlane::NeedDomains() const {
  if (domains_ == nullptr) {
    return absl::FailedPreconditionError(
        "libvirt integration is not enabled: start tmemd with --libvirt-uri");
  }
  return absl::OkStatus();
}

namespace {
v1::DomainState DomainMessage(const DomainAttachState& s) {
  v1::DomainState m;
  m.set_domain(s.domain);
  m.set_vm(s.vm);
  m.set_attached(s.attached);
  m.set_persistent(s.persistent);
  m.set_detail(s.detail);
  return m;
}
}  // namespace

absl::StatusOr<v1::DomainState> ControlPlane::AttachDomain(
    const v1::DomainRequest& r) {
  if (absl::Status s = NeedDomains(); !s.ok()) return s;
  if (r.domain().empty()) {
    return absl::InvalidArgumentError("the request names no domain");
  }
  if (!r.swap() && r.swap_size_bytes() != 0) {
    return absl::InvalidArgumentError(
        "swap_size_bytes: set without swap (attach --swap SIZE)");
  }
  if (r.swap() && r.swap_size_bytes() == 0) {
    return absl::InvalidArgumentError("swap_size_bytes: 0 (want a size)");
  }
  absl::StatusOr<DomainAttachState> st =
      r.swap() ? domains_->AttachSwap(r.domain(), r.swap_size_bytes())
               : domains_->Attach(r.domain(), r.persistent());
  if (!st.ok()) return st.status();
  return DomainMessage(*st);
}

absl::StatusOr<v1::DomainState> ControlPlane::DetachDomain(
    const v1::DomainRequest& r) {
  if (absl::Status s = NeedDomains(); !s.ok()) return s;
  if (r.domain().empty()) {
    return absl::InvalidArgumentError("the request names no domain");
  }
  absl::StatusOr<DomainAttachState> st =
      r.swap() ? domains_->DetachSwap(r.domain())
               : domains_->Detach(r.domain(), r.persistent());
  if (!st.ok()) return st.status();
  return DomainMessage(*st);
}

absl::StatusOr<v1::DomainState> ControlPlane::LibvirtHook(
    const v1::LibvirtHookRequest& r) {
  if (absl::Status s = NeedDomains(); !s.ok()) return s;
  if (r.operation() != "prepare" && r.operation() != "release" &&
      r.operation() != "migrate") {
    return absl::InvalidArgumentError(
        absl::StrCat("operation: '", r.operation(),
                     "' is not a hook operation tmemd handles (prepare, "
                     "release, migrate)"));
  }
  if (r.domain_xml().empty()) {
    return absl::InvalidArgumentError("domain_xml: empty");
  }
  absl::StatusOr<DomainAttachState> st =
      r.operation() == "prepare"   ? domains_->PrepareFromHook(r.domain_xml())
      : r.operation() == "release" ? domains_->ReleaseFromHook(r.domain_xml())
                                   : domains_->MigrateFromHook(r.domain_xml());
  if (!st.ok()) return st.status();
  return DomainMessage(*st);
}

absl::StatusOr<v1::ListDomainsResponse> ControlPlane::ListDomains() {
  if (absl::Status s = NeedDomains(); !s.ok()) return s;
  v1::ListDomainsResponse out;
  for (const DomainAttachState& s : domains_->List()) {
    *out.add_domains() = DomainMessage(s);
  }
  return out;
}

}  // namespace tmem
