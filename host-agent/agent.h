// Agent: tmemd's domain object. Owns the store, the valve, the VMs'
// channels and the workers that drive them, and the valve's ticker.
//
// Everything that steers tmemd -- the command line, the gRPC service, the
// libvirt glue -- goes through this class, so the logic is tested without
// any of them. Names are VM names (unique per host); VmIds stay inside.
//
// VMs: a VM is one store registration (one quota, weight and fair share)
// served by an ivshmem channel, a swap device, or both. The agent
// registers the VM in the store and the valve when its first frontend
// arrives and forgets it (every page) when its last one goes; the channel
// and the swap device each get the VM's id and know nothing of each other.
// AddVm creates the VM's channel (sealed memfd region, listening ivshmem
// socket, in that order) and hands it to the least loaded worker; RemoveVm
// takes it back (returns once no worker touches it) and destroys it, which
// unlinks the socket and drops the channel's pools. AddSwapDevice starts a
// vhost-user-blk device on SOCKET_DIR/NAME.swap.sock over a backing the
// swap-store factory makes; RemoveSwapDevice stops it, writes its pages
// into its spill image and unlinks the socket. StopServing writes every swap
// backing back (a spill image, where the backing has one) before it returns.
//
// Threads: every public method is thread-safe. Methods that change the set
// of VMs or policies serialize on one mutex; statistics readers take it too
// (they are cheap).
#ifndef TMEMD_HOST_AGENT_AGENT_H_
#define TMEMD_HOST_AGENT_AGENT_H_

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/compaction_queue.h"
#include "backend/compactor.h"
#include "backend/cpu_sample.h"
#include "backend/mutex.h"
#include "backend/tmem_store.h"
#include "backend/valve.h"
#include "host-agent/channel/channel.h"
#include "host-agent/swap/metered_swap_backing.h"
#include "host-agent/swap/swap_device.h"
#include "host-agent/swap/swap_store.h"
#include "host-agent/swap/swap_valve_advisor.h"
#include "host-agent/worker.h"

namespace tmem {

struct AgentOptions {
  StoreOptions store;
  ValveOptions valve;
  // Channels.
  std::string socket_dir = "/run/tmemd";
  uint64_t region_bytes = uint64_t{4} << 20;
  uint32_t ring_entries = 256;
  int vectors = 1;
  // ivshmem peer id of tmemd; the VM is the other of {0, 1}. 1 (the
  // default) makes the VM peer 0, which QEMU needs to migrate the device
  // (master=on); 0 is for guests whose driver predates ABI v2 (it always
  // rings peer 0).
  int host_peer_id = 1;
  // Where descriptors are kept for a successor (systemd's fd store); must
  // outlive the agent. nullptr: none.
  FdStore* fd_store = nullptr;
  mode_t socket_mode = 0660;
  std::optional<gid_t> socket_gid;
  // Workers: 0 means one per online CPU.
  int workers = 0;
  WorkerOptions worker;
  // nullptr: ProcCpuSampler on /proc. Tests inject their own (must outlive
  // the agent).
  CpuSampler* cpu_sampler = nullptr;
  // false: no ticker thread; tests call TickValve() by hand.
  bool run_valve_ticker = true;
  // Deferred compression (valve.deferred_compression): pages the queue
  // holds at most (1 .. CompactionQueue::kMaxCapacity) and the compactor's
  // threads. The compactor runs whatever the valve option says (it may be
  // switched at run time); with nothing queued it sleeps.
  size_t compaction_queue_pages = 16384;
  CompactorOptions compactor;
  // Swap devices: what backs their pages (nullptr: in memory,
  // swap::MemorySwapStoreFactory), and the directory a backing keeps its
  // files under (spill images in STATE_DIR/swap/).
  swap::SwapStoreFactory swap_store_factory;
  std::string state_dir = "/var/lib/tmemd";
  // Queues a swap device offers (QEMU uses up to its num-queues of them).
  int swap_queues = 4;
};

// A VM's swap device as the agent sees it.
struct SwapDeviceInfo {
  std::string socket_path;
  uint64_t size_bytes = 0;
  bool connected = false;        // a vhost-user front-end (QEMU) is attached
  swap::SwapPageStats pages;     // stored / compressed / raw / spilled
  swap::SwapBackingTimes times;  // discarded pages, read/write time
  std::array<uint64_t, swap::kNumSwapCounters> counters{};  // the device's
};

// One VM as the agent sees it.
struct VmInfo {
  std::string name;
  // The ivshmem channel: absent for a VM served only by a swap device
  // (then socket_path is empty and connected false).
  bool has_channel = true;
  std::string socket_path;
  bool connected = false;  // a QEMU (or guestsim) is attached
  VmPolicy policy;
  VmStats stats;  // store counters, per-pool stats
  std::array<uint64_t, kNumChannelCounters> channel{};  // data-plane counters
  ValveVmStatus valve;
  // What the guest says about itself (untrusted; shown, never relied on).
  GuestReport guest;
  std::optional<SwapDeviceInfo> swap;
};

struct AgentStatus {
  HostStats store;
  ValveHostStatus valve;
  CompactorStats compactor;
  int workers = 0;
  int64_t uptime_nanos = 0;
};

class Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> Create(
      const AgentOptions& options);
  ~Agent();  // stops workers and the ticker, removes every VM
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // The VM's ivshmem channel. ALREADY_EXISTS if the VM has one;
  // INVALID_ARGUMENT for a name that is not safe as a file name.
  // `socket_path` empty: SOCKET_DIR/NAME.sock. `policy` becomes the VM's
  // (also when its swap device registered it first).
  absl::StatusOr<VmInfo> AddVm(const std::string& name, const VmPolicy& policy,
                               const std::string& socket_path = "");
  // Removes the channel; NOT_FOUND if the VM has none. The VM stays
  // registered while its swap device serves.
  absl::Status RemoveVm(const std::string& name);
  // The VM's swap device of `size_bytes` (a multiple of 4096, > 0) at
  // SOCKET_DIR/NAME.swap.sock, listening when this returns. ALREADY_EXISTS
  // if the VM has one; INVALID_ARGUMENT for a bad name or size. A VM not
  // yet known is registered with the policy the resolver gives it for
  // `requested` (the configured one); a known VM keeps its policy.
  absl::StatusOr<SwapDeviceInfo> AddSwapDevice(
      const std::string& name, uint64_t size_bytes,
      const VmPolicy& requested = VmPolicy{});
  // Stops the device (a connected front-end is cut off), writes every page
  // it holds in memory into its spill image (so adding the device again
  // finds the same disk), unlinks its socket and frees its memory;
  // NOT_FOUND if the VM has no swap device. If the write-back fails the
  // device is removed all the same and the error says what was lost.
  absl::Status RemoveSwapDevice(const std::string& name);
  // A VM whose channel a previous tmemd handed over (fd_handoff.h): the
  // socket path is the one the handed-over socket is bound to. `fds` are
  // taken (closed on failure).
  absl::StatusOr<VmInfo> RestoreVm(const std::string& name,
                                   const VmPolicy& policy,
                                   IvshmemServerFds fds);
  // Every VM's descriptors, for an exec handoff (the agent must be stopped
  // serving and must not be destroyed before the exec).
  std::vector<NamedFd> HandoffFds() const;
  // A successor takes the channels over through the fd store: destroying
  // the agent then leaves the socket paths and the store alone.
  void KeepChannelsForSuccessor();
  // Optional hook AddVm consults for the policy a VM starts with: the
  // control plane returns the policy pushed for that name earlier, so a VM
  // added again (restart, libvirt re-attach) gets it back. Called under the
  // agent's mutex: it must not call back into the Agent.
  using VmPolicyResolver = std::function<VmPolicy(const std::string& name,
                                                  const VmPolicy& requested)>;
  void SetVmPolicyResolver(VmPolicyResolver resolver);
  // A VM with a channel, a swap device, or both.
  bool HasVm(const std::string& name) const;
  std::vector<std::string> VmNames() const;  // sorted
  absl::StatusOr<VmInfo> GetVm(const std::string& name) const;
  std::vector<VmInfo> ListVms() const;

  // Quota, swap quota, weight, enabled and frozen (store) and mode and swap
  // mode (valve) at once; GetVmPolicy and VmInfo::policy give all back.
  absl::Status SetVmPolicy(const std::string& name, const VmPolicy& policy);
  absl::StatusOr<VmPolicy> GetVmPolicy(const std::string& name) const;

  // Host-wide: memory cap (evicts down to it) and valve options.
  absl::Status SetMemoryCap(uint64_t cap_bytes);
  absl::Status SetValveOptions(const ValveOptions& options);
  ValveOptions GetValveOptions() const;

  AgentStatus Status() const;

  // Stops the valve ticker, the workers and the swap devices, and writes
  // every swap backing back (idempotent): the data plane is quiet
  // afterwards, so statistics read next are final. The VMs stay until
  // the agent is destroyed. With a deadline (not negative), false if a
  // worker was still busy when it passed: the data plane is then NOT quiet
  // and the agent must not be torn down (tmemd exits at once instead).
  bool StopServing(
      std::chrono::milliseconds deadline = std::chrono::milliseconds(-1));

  // One valve period by hand (tests; the ticker does this otherwise). One
  // caller at a time.
  absl::Status TickValve();

  TmemStore& store() { return *store_; }
  Compactor& compactor() { return *compactor_; }
  Valve& valve() { return *valve_; }
  const AgentOptions& options() const { return options_; }
  // Distinct across restarts, so guests notice a new tmemd.
  uint64_t host_generation() const { return host_generation_; }

 private:
  // Members in build order: the device reads and writes the backing, so
  // it is destroyed (stopped) first.
  struct SwapEntry {
    uint64_t size_bytes = 0;
    std::unique_ptr<swap::SwapStore> store;
    std::unique_ptr<swap::MeteredSwapBacking> metered;
    std::unique_ptr<swap::SwapDevice> device;
  };
  struct VmEntry {
    VmId vm = 0;
    std::unique_ptr<Channel> channel;  // null: no ivshmem channel
    Worker* worker = nullptr;
    std::string socket_path;
    std::unique_ptr<SwapEntry> swap;  // null: no swap device
  };

  explicit Agent(AgentOptions options);
  VmInfo InfoLocked(const std::string& name, const VmEntry& e) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers a built channel with the valve and the least loaded worker.
  // A channel's options from tmemd's; an empty `socket_path` is the VM's
  // default, SOCKET_DIR/NAME.sock (AddVm and RestoreVm alike).
  ChannelOptions ChannelOptionsFor(const std::string& name,
                                   const VmPolicy& policy,
                                   const std::string& socket_path) const;
  VmInfo InstallLocked(VmEntry& e, const std::string& name,
                       std::unique_ptr<Channel> channel, std::string_view event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The VM's entry, registering it in the store and the valve with
  // `policy` when it is new (a known VM gets `policy` only if
  // `apply_policy`). *created tells the caller to undo with ForgetLocked if
  // its frontend then fails.
  absl::StatusOr<VmEntry*> EntryForLocked(const std::string& name,
                                          const VmPolicy& policy,
                                          bool apply_policy, bool* created)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unregisters a VM left with no frontend (valve now; the store's pages
  // go in ForgetVm, which the caller runs once nothing uses the id).
  void EraseLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SwapDeviceInfo SwapInfo(const SwapEntry& s) const;
  void StopSwapDevices() ABSL_LOCKS_EXCLUDED(mu_);
  void TickerLoop() ABSL_LOCKS_EXCLUDED(ticker_mu_);
  // One bounded batch per swap device of pages memory may no longer hold
  // (a lowered quota, swap quota or cap) into its spill image
  // (SwapStore::RelieveMemory): the valve tick drives it, off the guests'
  // request path.
  void RelieveSwapMemory() ABSL_LOCKS_EXCLUDED(lifecycle_mu_, mu_);

  AgentOptions options_;
  uint64_t host_generation_ = 0;
  int64_t start_nanos_ = 0;
  std::unique_ptr<Valve> valve_;  // before store_: the store calls it
  // The valve's view for swap devices' puts (never a drop for reuse).
  std::unique_ptr<swap::SwapValveAdvisor> swap_advisor_;
  // Before store_ (the store pushes into it), compactor_ after (it reads
  // the store, so it stops first).
  std::unique_ptr<CompactionQueue> compaction_queue_;
  std::unique_ptr<TmemStore> store_;
  std::unique_ptr<Compactor> compactor_;
  // Set by TickValve, read by the compactor's threads.
  std::atomic<bool> memory_short_{false};
  std::atomic<double> compaction_budget_cores_{1.0};
  std::unique_ptr<CpuSampler> owned_sampler_;
  CpuSampler* sampler_ = nullptr;
  std::vector<std::unique_ptr<Worker>> workers_;
  double poll_scale_ = 1.0;  // TickValve only: the polling feedback loop
  swap::SwapStoreFactory swap_store_factory_;
  std::atomic<bool> swap_stopped_{false};

  // Held across a whole AddVm/RemoveVm (before mu_): a removed VM leaves
  // vms_ before its channel is destroyed outside mu_ (dropping its store VM
  // and unlinking its socket), and a VM of the same name added in that
  // window must wait for it rather than be refused by the store.
  // Lock order: host-agent/lock_order.h.
  Mutex lifecycle_mu_;
  mutable Mutex mu_ ABSL_ACQUIRED_AFTER(lifecycle_mu_);
  std::map<std::string, VmEntry> vms_ ABSL_GUARDED_BY(mu_);
  std::map<Worker*, int> load_ ABSL_GUARDED_BY(mu_);
  VmPolicyResolver resolver_ ABSL_GUARDED_BY(mu_);

  // A leaf: the ticker drops it before it ticks the valve.
  Mutex ticker_mu_;
  CondVar ticker_cv_;  // ticker_stop_ set
  bool ticker_stop_ ABSL_GUARDED_BY(ticker_mu_) = false;
  std::thread ticker_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_AGENT_H_
