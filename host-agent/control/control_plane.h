// ControlPlane: the logic behind tmem.v1, with no gRPC in it.
//
// Translates between tmem.v1 messages and the Agent, validates requests
// (unknown VM, weight range, quota above the host cap, bad UUIDs), enforces
// policy generations through the PolicyStore and persists what it applied.
// The gRPC service classes (grpc_service.h) only check access and forward
// here, so every rule is tested without a server.
//
// Errors are absl::Status values whose codes map one to one onto gRPC's.
//
// Thread-safe: reads go straight to the Agent (itself thread-safe); writes
// serialize on one mutex so a generation check, the apply and the commit
// happen as one step.
#ifndef TMEMD_HOST_AGENT_CONTROL_CONTROL_PLANE_H_
#define TMEMD_HOST_AGENT_CONTROL_CONTROL_PLANE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "host-agent/agent.h"
#include "host-agent/control/policy_set.h"
#include "host-agent/control/policy_store.h"
#include "host-agent/domain_control.h"
#include "proto/tmem/v1/control.pb.h"

namespace tmem {

inline constexpr uint32_t kMaxWeight = 1000000;

// tmemd's version as reported by Status.
std::string TmemdVersion();

// "compress", "raw", "drop", "off", "throttled", "frozen", "disabled".
std::string ValveDecision(const VmPolicy& policy, const ValveVmStatus& valve);

// Parses an 8-4-4-4-12 hex UUID.
absl::StatusOr<PoolUuid> ParsePoolUuid(const std::string& text);
std::string FormatPoolUuid(const PoolUuid& uuid);

class ControlPlane {
 public:
  // `domains` may be null (no libvirt): domain RPCs then answer
  // FAILED_PRECONDITION. Agent, store and domains must outlive this.
  ControlPlane(Agent* agent, PolicyStore* policies, DomainControl* domains);

  // Applies what the state file holds to the host and to every VM present
  // (tmemd calls it at startup, after the configured VMs were added).
  absl::Status ApplyStoredPolicies();
  // The policy a VM gets when it is added: the saved one, if any.
  VmPolicy ResolveVmPolicy(const std::string& vm,
                           const VmPolicy& configured) const;

  // Reads.
  v1::HostStatus Status() const;
  // Counters from outside the agent (the fleet watcher's), appended to
  // Status()'s host counters. `source` must be thread-safe; it is called
  // with no other ControlPlane lock held. nullptr removes it, waiting for a
  // call in progress (so its owner may go right after).
  using ExtraCounters =
      std::function<std::vector<std::pair<std::string, uint64_t>>()>;
  void SetExtraCounters(ExtraCounters source);
  // The control listeners' connection counters (grpc_service.h), appended
  // after those; same rules as SetExtraCounters.
  using ListenerCounters = std::function<std::vector<v1::Counter>()>;
  void SetListenerCounters(ListenerCounters source);
  v1::ListVmsResponse ListVms() const;
  absl::StatusOr<v1::VmDetail> GetVm(const std::string& vm) const;
  v1::StatsSample Sample(const v1::WatchStatsRequest& request) const;

  // Writes.
  absl::StatusOr<v1::SetVmPolicyResponse> SetVmPolicy(
      const v1::SetVmPolicyRequest& request);
  absl::StatusOr<v1::SetHostPolicyResponse> SetHostPolicy(
      const v1::SetHostPolicyRequest& request);
  absl::StatusOr<v1::SetVmPolicyResponse> SetFrozen(const std::string& vm,
                                                    bool frozen);
  absl::StatusOr<v1::FlushVmResponse> FlushVm(const std::string& vm);
  absl::StatusOr<v1::SwapDevice> AddSwapDevice(const std::string& vm,
                                               uint64_t size_bytes);
  absl::Status RemoveSwapDevice(const std::string& vm);
  absl::Status AuthorizeSharedPool(
      const v1::AuthorizeSharedPoolRequest& request);
  // Fleet policy (docs/fleet.md): the host part and every present VM's part of
  // one etcd revision, checked by the same rules as SetHostPolicy and
  // SetVmPolicy, then applied all together or not at all (a failed step
  // puts back what was changed before it). VMs added later get it through
  // ResolveVmPolicy. With dry_run, only checks.
  absl::Status ApplyPolicySet(const PolicySet& policy, bool dry_run = false);

  // Domains (forwarded to DomainControl).
  absl::StatusOr<v1::DomainState> AttachDomain(const v1::DomainRequest& r);
  absl::StatusOr<v1::DomainState> DetachDomain(const v1::DomainRequest& r);
  absl::StatusOr<v1::ListDomainsResponse> ListDomains();
  // libvirt's qemu hook: operation "prepare" or "release" (anything else
  // is INVALID_ARGUMENT naming the field), the domain's XML.
  absl::StatusOr<v1::DomainState> LibvirtHook(const v1::LibvirtHookRequest& r);

 private:
  // What a host push would do, checked, with nothing applied yet.
  struct HostPlan {
    StoredHostPolicy stored;
    ValveOptions valve;
    bool valve_changed = false;
    std::optional<uint64_t> memory_cap;
  };
  absl::StatusOr<HostPlan> PlanHostPolicy(
      const v1::SetHostPolicyRequest& r) const;
  absl::Status ApplyHostPlan(const HostPlan& plan);
  // `current` with the request's fields applied, checked against `cap`.
  absl::StatusOr<VmPolicy> PlanVmPolicy(const v1::SetVmPolicyRequest& r,
                                        const VmPolicy& current,
                                        uint64_t cap) const;
  v1::VmDetail Detail(const VmInfo& info) const;
  v1::VmPolicy PolicyMessage(const std::string& vm,
                             const VmPolicy& policy) const;
  v1::HostPolicy HostPolicyMessage() const;
  absl::Status NeedDomains() const;

  Agent* const agent_;
  PolicyStore* const policies_;
  DomainControl* const domains_;
  // Lock order: host-agent/lock_order.h.
  Mutex write_mu_;  // one write at a time: check, apply, commit
  // Taken inside the Agent's mutex (ResolveVmPolicy runs there): nothing
  // is called while holding it.
  mutable Mutex fleet_mu_ ABSL_ACQUIRED_AFTER(write_mu_);
  std::optional<PolicySet> fleet_ ABSL_GUARDED_BY(fleet_mu_);
  // Held across the source's call (the fleet watcher's counters), never
  // with another of ours.
  mutable Mutex extra_mu_;
  ExtraCounters extra_counters_ ABSL_GUARDED_BY(extra_mu_);
  // Like extra_mu_, for the listener counters.
  mutable Mutex listener_mu_;
  ListenerCounters listener_counters_ ABSL_GUARDED_BY(listener_mu_);
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_CONTROL_PLANE_H_
