// DomainManager: tmemd's libvirt glue. Implements DomainControl (attach /
// detach / list for the gRPC service) over a Hypervisor, and keeps the
// Agent's channels in step with the domains' lifecycle and metadata.
//
// One channel per domain that has the tmem device (live or persistent
// config), named after the domain (its UUID when the name is not a safe
// file name), with its socket at the device's <server path>, or
// SOCKET_DIR/<uuid>.sock for a new device. The socket listens before QEMU
// can connect: the channel is created at startup (and on DEFINED) for every
// domain whose config has the device, and before every live attach.
//
// Lifecycle:
//  - STOPPED (shutdown, destroy, crash, save, migrated away): QEMU is gone,
//    so the VM's pages and channel are released. When the persistent config
//    still has the device, an empty channel is created again at once so the
//    next start finds its socket listening.
//  - UNDEFINED: a stopped domain's channel is released.
//  - DEVICE_REMOVED for the tmem device (the guest acked a detach): the
//    channel is released (recreated empty if the config keeps the device).
//  - A detach the guest never acks stays pending; after detach_timeout the
//    state says so (List()), the channel stays (QEMU still holds it) and a
//    later DEVICE_REMOVED or STOPPED still completes it.
//  - Reconnect after libvirtd restarts: every domain is reconciled again.
//  - libvirtd not there yet at Start (the hypervisor connects in the
//    background): the first connection makes the first sync.
//
// Policy: the tmem metadata element (domain_xml.h) is the source of truth
// for libvirt-managed VMs, because it travels with the domain (migration)
// while tmemd's state file stays on its host. It is applied when the
// channel is created (over the state file's policy when the domain has the
// element) and whenever the element changes (METADATA_CHANGE). A policy set
// through gRPC is written back into the element (PolicyChanged: live, and
// the persistent config), so the next host applies it on arrival. A domain
// whose only tmemd device is a swap device (the Agent has its VM, with no
// channel) gets the element's policy too, swap_quota and swap_mode
// included, when it is reconciled and whenever the element changes; the
// state file's policy stays while it has no element.
// `autoattach` domains get the device live on start, at tmemd startup and
// when autoattach is switched on.
//
// Threads: events are queued by the Hypervisor's thread and handled by the
// manager's own thread; Attach/Detach/List run on the caller's thread. All
// of them serialize on one mutex (libvirt calls included), so a domain's
// state changes in one order.
#ifndef TMEMD_HOST_AGENT_LIBVIRT_DOMAIN_MANAGER_H_
#define TMEMD_HOST_AGENT_LIBVIRT_DOMAIN_MANAGER_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/mutex.h"
#include "host-agent/agent.h"
#include "host-agent/domain_control.h"
#include "host-agent/libvirt/domain_xml.h"
#include "host-agent/libvirt/hypervisor.h"

namespace tmem {

struct DomainManagerOptions {
  // MSI vectors of the device (must match the Agent's channels).
  int vectors = 1;
  // How long a live detach may wait for the guest's ack before List()
  // reports it as timed out.
  std::chrono::milliseconds detach_timeout{30000};
  // How long Attach and Detach wait for a libvirt connection being made
  // (tmemd just started, libvirtd restarting) before failing UNAVAILABLE.
  std::chrono::milliseconds connect_wait{10000};
  // The swap devices' backend (tmemd: Agent::AddSwapDevice and
  // RemoveSwapDevice, which serve SOCKET_DIR/VM.swap.sock). Adding one that
  // exists answers ALREADY_EXISTS, removing one that does not NOT_FOUND.
  // Unset: AttachSwap and DetachSwap answer FAILED_PRECONDITION.
  std::function<absl::Status(const std::string& vm, uint64_t size_bytes)>
      add_swap_device;
  std::function<absl::Status(const std::string& vm)> remove_swap_device;
};

class DomainManager final : public DomainControl {
 public:
  // `agent` and `hypervisor` must outlive the manager.
  DomainManager(Agent* agent, Hypervisor* hypervisor,
                DomainManagerOptions options);
  ~DomainManager() override;  // Stop()
  DomainManager(const DomainManager&) = delete;
  DomainManager& operator=(const DomainManager&) = delete;

  // Subscribes to events, reconciles every domain (creating channels for
  // those whose config has the device, autoattaching), starts the event
  // thread. An error only if the domains cannot be listed.
  absl::Status Start() ABSL_LOCKS_EXCLUDED(op_mu_, mu_);
  // Stops the event thread. Channels stay with the Agent (its destructor
  // drops them).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<DomainAttachState> Attach(const std::string& domain,
                                           bool persistent) override
      ABSL_LOCKS_EXCLUDED(op_mu_);
  absl::StatusOr<DomainAttachState> Detach(const std::string& domain,
                                           bool persistent) override
      ABSL_LOCKS_EXCLUDED(op_mu_);
  std::vector<DomainAttachState> List() override ABSL_LOCKS_EXCLUDED(op_mu_);
  // Without the manager's mutex and without libvirt calls (the hook runs
  // while libvirtd holds the domain); the STARTED event's reconcile later
  // adopts the channel (same VM name and socket).
  // The channel is remembered as the hook's until then: one whose domain
  // is not running when libvirt is next synced (its STARTED event was lost
  // with the connection, or its start failed after the hook) is released.
  absl::StatusOr<DomainAttachState> PrepareFromHook(
      const std::string& domain_xml) override ABSL_LOCKS_EXCLUDED(hook_mu_);
  // A domain the manager follows is left to its STOPPED event; a hook
  // channel is released at once, or by the manager's thread when an
  // operation holds the manager (the hook cannot wait for it).
  absl::StatusOr<DomainAttachState> ReleaseFromHook(
      const std::string& domain_xml) override
      ABSL_LOCKS_EXCLUDED(op_mu_, hook_mu_, mu_);
  absl::Status PolicyChanged(const std::string& vm,
                             const VmPolicy& policy) override
      ABSL_LOCKS_EXCLUDED(op_mu_);
  // The swap device goes into the persistent definition only (libvirt
  // cannot hot-plug shared memory into a running QEMU), so the domain must
  // have one; the device is created before the definition names it, and
  // removed again when libvirt refuses the new definition.
  absl::StatusOr<DomainAttachState> AttachSwap(const std::string& domain,
                                               uint64_t size_bytes) override
      ABSL_LOCKS_EXCLUDED(op_mu_);
  absl::StatusOr<DomainAttachState> DetachSwap(
      const std::string& domain) override ABSL_LOCKS_EXCLUDED(op_mu_);
  // Pure: the XML against the Agent's socket directory.
  absl::StatusOr<DomainAttachState> MigrateFromHook(
      const std::string& domain_xml) override;

  // Waits until every event queued so far has been handled (tests).
  void Flush() ABSL_LOCKS_EXCLUDED(mu_);
  // Events handled since Start (tests, logs).
  uint64_t events_handled() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct DomainState {
    std::string name;
    std::string uuid;
    std::string vm;           // Agent VM name, when channel or swap_device
    std::string socket_path;  // the channel's socket
    bool channel = false;     // the Agent has a VM for it (ours)
    // The Agent serves the domain's swap device (its VM, named like the
    // channel's): the metadata's policy applies to it even without a
    // channel.
    bool swap_device = false;
    bool live_device = false;
    bool config_device = false;
    std::string alias;                    // live device alias
    std::optional<TmemMetadata> applied;  // metadata applied to the channel
    TmemMetadata metadata;                // last good metadata
    bool detach_pending = false;
    bool detach_timed_out = false;
    std::chrono::steady_clock::time_point detach_deadline;
    std::string detail;
  };

  // A channel PrepareFromHook made, until a reconcile adopts it into
  // domains_ or its domain is found stopped. `generation` tells a prepare
  // for the domain's next start from the one a queued release was for.
  struct HookChannel {
    std::string vm;
    std::string socket_path;
    uint64_t generation = 0;
  };
  struct HookRelease {
    std::string domain;
    uint64_t generation = 0;
  };

  // Hypervisor thread: queue it.
  void OnEvent(const DomainEvent& event) ABSL_LOCKS_EXCLUDED(mu_);
  void Loop() ABSL_LOCKS_EXCLUDED(op_mu_, mu_);
  void HandleLocked(const DomainEvent& event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  void CheckDeadlinesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  void SyncAllLocked(bool autoattach) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // Releases the hook channel of `domain` made by prepare `generation`
  // (0: any) unless a reconcile adopted it; forgets adopted ones.
  void ReleaseHookChannelLocked(const std::string& domain, uint64_t generation,
                                const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_) ABSL_LOCKS_EXCLUDED(hook_mu_);
  // Removes `vm` if its channel listens on `socket_path`; false if there is
  // no such VM or it listens elsewhere. No libvirt, no domains_.
  absl::StatusOr<bool> RemoveVmOnSocket(const std::string& vm,
                                        const std::string& socket_path);
  // Adds (on) or removes tmemd's <qemu:override> making the device
  // master=on in the persistent definition (domain_xml.h: libvirt 9.0
  // drops role='master').
  absl::Status SetMasterOverrideLocked(const std::string& name, bool on)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // Up to options_.connect_wait for the hypervisor to be connected.
  void WaitForConnection() const ABSL_LOCKS_EXCLUDED(op_mu_);
  // The first sync with libvirt (at Start, or at the first connection made
  // in the background): also flags devices an earlier tmemd attached.
  void FirstSyncLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // Reads the domain from the hypervisor and makes channel, policy and
  // device agree with it.
  void ReconcileLocked(const std::string& name, bool autoattach)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  absl::StatusOr<DomainAttachState> AttachLocked(const std::string& name,
                                                 bool persistent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // Touches only `st` and the agent (no libvirt, no domains_): the hook
  // calls it without op_mu_.
  absl::Status EnsureChannel(DomainState& st, const std::string& path);
  void ReleaseChannelLocked(DomainState& st, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  void ApplyPolicyLocked(DomainState& st, bool force)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  absl::StatusOr<TmemMetadata> ReadMetadataLocked(const std::string& name,
                                                  bool active)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  std::string VmNameFor(const std::string& name, const std::string& uuid) const;
  std::string DefaultSocketPath(const std::string& uuid) const;
  // Devices are role='master' (migratable) exactly when tmemd is ivshmem
  // peer 1 (AgentOptions::host_peer_id, the default): QEMU refuses
  // master=on for a VM that is not peer 0.
  bool Master() const { return agent_->options().host_peer_id == 1; }
  // Writes `policy` into the element of one side (live or config),
  // keeping that side's autoattach.
  absl::Status WritePolicyLocked(const std::string& name, bool live,
                                 const VmPolicy& policy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  static DomainAttachState ToState(const DomainState& st);

  Agent* const agent_;
  Hypervisor* const hv_;
  const DomainManagerOptions options_;

  // Serializes operations, libvirt calls included; taken after
  // ControlPlane::write_mu_ (PolicyChanged) and before the Agent's and the
  // hypervisor's locks. Lock order: host-agent/lock_order.h.
  Mutex op_mu_;
  std::map<std::string, DomainState> domains_
      ABSL_GUARDED_BY(op_mu_);                   // by domain name
  bool synced_ ABSL_GUARDED_BY(op_mu_) = false;  // FirstSyncLocked ran

  // Hook channels not yet adopted. A leaf: taken alone or under op_mu_.
  Mutex hook_mu_;
  std::map<std::string, HookChannel> hook_channels_
      ABSL_GUARDED_BY(hook_mu_);  // by domain name
  uint64_t hook_generation_ ABSL_GUARDED_BY(hook_mu_) = 0;

  // The event queue. A leaf: never held across op_mu_ or anything else.
  mutable Mutex mu_;
  CondVar cv_;  // queue_, busy_ or started_/stop_ changed
  std::deque<DomainEvent> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<HookRelease> hook_releases_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t handled_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_LIBVIRT_DOMAIN_MANAGER_H_
