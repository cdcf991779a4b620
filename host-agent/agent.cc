#include "host-agent/agent.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "host-agent/config.h"
#include "host-agent/cpu_sampler.h"
#include "host-agent/log.h"

namespace tmem {

// How much sooner a reuse-throttled VM's pages are evicted than its weight
// alone says.
constexpr uint32_t kThrottledEvictionBias = 16;

namespace {

// Whether the cap's free share is below `headroom_fraction`: the one place
// the compactor learns about memory headroom (it then compresses at normal
// priority within the CPU budget).
bool MemoryHeadroomShort(const TmemStore& store, double headroom_fraction) {
  const HostStats hs = store.GetHostStats();
  if (hs.memory_cap_bytes == 0) return true;
  const double free_fraction =
      1.0 - static_cast<double>(hs.memory_used_bytes) /
                static_cast<double>(hs.memory_cap_bytes);
  return free_fraction < headroom_fraction;
}

}  // namespace

Agent::Agent(AgentOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(
    const AgentOptions& options) {
  if (absl::Status s = Valve::ValidateOptions(options.valve); !s.ok()) {
    return s;
  }
  if (absl::Status s = Compactor::ValidateOptions(options.compactor); !s.ok()) {
    return s;
  }
  if (options.compaction_queue_pages < 1 ||
      options.compaction_queue_pages > CompactionQueue::kMaxCapacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compaction queue must hold 1..", CompactionQueue::kMaxCapacity,
        " pages, got ", options.compaction_queue_pages));
  }
  std::unique_ptr<Agent> a(new Agent(options));
  // This process's identity in logs and the control plane; each region
  // gets its own random generation (SharedRegion::NewHostGeneration).
  a->host_generation_ = SharedRegion::NewHostGeneration();
  a->start_nanos_ = SteadyClock::Default()->NowNanos();
  // The store tells the valve about evictions: build the valve first. The
  // valve reads no store; TickValve hands it the store's memory sample.
  a->valve_ = std::make_unique<Valve>(options.valve);
  a->swap_advisor_ = std::make_unique<swap::SwapValveAdvisor>(a->valve_.get());
  StoreOptions store_options = options.store;
  store_options.eviction_listener = a->valve_.get();
  a->compaction_queue_ =
      std::make_unique<CompactionQueue>(options.compaction_queue_pages);
  store_options.compaction_queue = a->compaction_queue_.get();
  absl::StatusOr<std::unique_ptr<TmemStore>> store =
      TmemStore::Create(store_options);
  if (!store.ok()) return store.status();
  a->store_ = std::move(*store);

  CompactorOptions compactor = options.compactor;
  Agent* raw = a.get();
  compactor.memory_tight = [raw] {
    return raw->memory_short_.load(std::memory_order_relaxed);
  };
  compactor.cpu_budget_cores = [raw] {
    return raw->compaction_budget_cores_.load(std::memory_order_relaxed);
  };
  compactor.charge_cpu = [raw](VmId vm, int64_t ns) {
    raw->valve_->ChargeCpu(vm, ns);
  };
  compactor.expects_no_reuse = [raw](VmId vm) {
    return raw->valve_->ExpectsNoReuse(vm);
  };
  compactor.on_priority_error = [](const absl::Status& s) {
    Log(LogLevel::kWarn, "compactor_priority_failed", {{"error", s.message()}});
  };
  a->compactor_ = std::make_unique<Compactor>(
      a->store_.get(), a->compaction_queue_.get(), std::move(compactor));
  if (absl::Status s = a->compactor_->Start(); !s.ok()) return s;

  if (options.cpu_sampler != nullptr) {
    a->sampler_ = options.cpu_sampler;
  } else {
    a->owned_sampler_ = std::make_unique<ProcCpuSampler>();
    a->sampler_ = a->owned_sampler_.get();
  }
  int workers = options.workers;
  if (workers <= 0) workers = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  workers = std::clamp(workers, 1, 64);
  for (int i = 0; i < workers; ++i) {
    auto w = std::make_unique<Worker>(options.worker);
    if (absl::Status s = w->Start(); !s.ok()) return s;
    {
      // Uncontended (nothing else sees `a` yet); the lock is what load_'s
      // annotation asks for.
      MutexLock lock(&a->mu_);
      a->load_[w.get()] = 0;
    }
    a->workers_.push_back(std::move(w));
  }
  a->swap_store_factory_ = options.swap_store_factory
                               ? options.swap_store_factory
                               : swap::MemorySwapStoreFactory();
  if (options.run_valve_ticker) {
    a->ticker_ = std::thread([p = a.get()] { p->TickerLoop(); });
  }
  return a;
}

bool Agent::StopServing(std::chrono::milliseconds deadline) {
  const auto start = std::chrono::steady_clock::now();
  {
    MutexLock lock(&ticker_mu_);
    ticker_stop_ = true;
  }
  ticker_cv_.NotifyAll();
  if (ticker_.joinable()) ticker_.join();
  bool stopped = true;
  for (auto& w : workers_) {
    // What is left of the deadline. Every worker is asked even after one
    // missed it, so none keeps serving.
    std::chrono::milliseconds left = deadline;
    if (deadline.count() >= 0) {
      left = std::max(
          std::chrono::milliseconds(0),
          deadline - std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::steady_clock::now() - start));
    }
    stopped = w->Stop(left) && stopped;
  }
  if (!stopped) return false;
  if (compactor_ != nullptr) compactor_->Stop();
  StopSwapDevices();
  return true;
}

void Agent::StopSwapDevices() {
  if (swap_stopped_.exchange(true)) return;
  MutexLock lock(&mu_);
  for (auto& [name, e] : vms_) {
    if (e.swap == nullptr) continue;
    // No request runs once the device's loop has left: what the backing
    // holds now is everything the guest was told is written.
    e.swap->device->Stop();
    const absl::Status s = e.swap->store->WriteBack();
    const swap::SwapPageStats after = e.swap->store->PageStats();
    uint64_t written_back = 0;  // store pages moved into the image
    for (const auto& [counter, value] : after.counters) {
      if (counter == "written_back") written_back = value;
    }
    Log(s.ok() ? LogLevel::kInfo : LogLevel::kError, "swap_written_back",
        {{"vm", name},
         {"written_back", written_back},
         {"stored_pages", after.stored},
         {"spilled_pages", after.spilled},
         {"error", s.ok() ? std::string() : std::string(s.message())}});
  }
}

Agent::~Agent() {
  StopServing();
  MutexLock lock(&mu_);
  for (auto& [name, e] : vms_) {
    if (e.channel != nullptr) e.worker->RemoveChannel(e.channel.get());
    valve_->RemoveVm(e.vm);
  }
  for (auto& w : workers_) w->Stop();
  std::vector<VmId> ids;
  for (const auto& [name, e] : vms_) ids.push_back(e.vm);
  vms_.clear();  // unlinks sockets, drops the channels' pools
  for (VmId vm : ids) (void)store_->ForgetVm(vm);
}

void Agent::SetVmPolicyResolver(VmPolicyResolver resolver) {
  MutexLock lock(&mu_);
  resolver_ = std::move(resolver);
}

ChannelOptions Agent::ChannelOptionsFor(const std::string& name,
                                        const VmPolicy& policy,
                                        const std::string& socket_path) const {
  ChannelOptions opts;
  opts.vm_name = name;
  opts.policy = policy;
  opts.region_bytes = options_.region_bytes;
  opts.ring_entries = options_.ring_entries;
  opts.server.socket_path =
      socket_path.empty()
          ? absl::StrCat(options_.socket_dir, "/", name, ".sock")
          : socket_path;
  opts.server.vectors = options_.vectors;
  opts.server.socket_mode = options_.socket_mode;
  opts.server.socket_group = options_.socket_gid;
  opts.server.host_peer_id = options_.host_peer_id;
  opts.fd_store = options_.fd_store;
  return opts;
}

absl::StatusOr<Agent::VmEntry*> Agent::EntryForLocked(const std::string& name,
                                                      const VmPolicy& policy,
                                                      bool apply_policy,
                                                      bool* created) {
  *created = false;
  auto it = vms_.find(name);
  if (it != vms_.end()) {
    if (apply_policy) {
      if (absl::Status s = store_->SetVmPolicy(it->second.vm, policy);
          !s.ok()) {
        return s;
      }
      valve_->SetVmPolicy(it->second.vm, policy);
    }
    return &it->second;
  }
  absl::StatusOr<VmId> vm = store_->AddVm(name, policy);
  if (!vm.ok()) return vm.status();
  valve_->AddVm(*vm, policy);
  VmEntry& e = vms_[name];
  e.vm = *vm;
  *created = true;
  return &e;
}

void Agent::EraseLocked(const std::string& name) {
  auto it = vms_.find(name);
  if (it == vms_.end()) return;
  valve_->RemoveVm(it->second.vm);
  vms_.erase(it);
}

absl::StatusOr<VmInfo> Agent::AddVm(const std::string& name,
                                    const VmPolicy& requested,
                                    const std::string& socket_path) {
  if (absl::Status s = ValidateVmName(name); !s.ok()) return s;
  MutexLock lifecycle(&lifecycle_mu_);
  MutexLock lock(&mu_);
  const VmPolicy policy = resolver_ ? resolver_(name, requested) : requested;
  if (auto it = vms_.find(name); it != vms_.end() && it->second.channel) {
    return absl::AlreadyExistsError(
        absl::StrCat("VM '", name, "' already has a channel"));
  }
  bool created = false;
  absl::StatusOr<VmEntry*> e = EntryForLocked(name, policy, true, &created);
  if (!e.ok()) return e.status();
  const VmId vm = (*e)->vm;
  ChannelOptions opts = ChannelOptionsFor(name, policy, socket_path);
  opts.store_vm = vm;
  absl::StatusOr<std::unique_ptr<Channel>> ch = Channel::Create(
      opts, store_.get(), SharedRegion::NewHostGeneration(), valve_.get());
  if (!ch.ok()) {
    if (created) {
      EraseLocked(name);
      (void)store_->ForgetVm(vm);
    }
    return absl::Status(
        ch.status().code(),
        absl::StrCat("VM '", name, "': ", ch.status().message()));
  }
  return InstallLocked(**e, name, std::move(*ch), "channel_created");
}

absl::StatusOr<VmInfo> Agent::RestoreVm(const std::string& name,
                                        const VmPolicy& requested,
                                        IvshmemServerFds fds) {
  auto close_all = [&fds] {
    for (int fd : {fds.listen, fds.shm, fds.client}) {
      if (fd >= 0) close(fd);
    }
    for (int fd : fds.doorbells) close(fd);
    for (int fd : fds.interrupts) close(fd);
  };
  if (absl::Status s = ValidateVmName(name); !s.ok()) {
    close_all();
    return s;
  }
  MutexLock lifecycle(&lifecycle_mu_);
  MutexLock lock(&mu_);
  const VmPolicy policy = resolver_ ? resolver_(name, requested) : requested;
  if (auto it = vms_.find(name); it != vms_.end() && it->second.channel) {
    close_all();
    return absl::AlreadyExistsError(
        absl::StrCat("VM '", name, "' already has a channel"));
  }
  bool created = false;
  absl::StatusOr<VmEntry*> e = EntryForLocked(name, policy, true, &created);
  if (!e.ok()) {
    close_all();
    return e.status();
  }
  const VmId vm = (*e)->vm;
  // The listener was bound in a private directory and renamed into place,
  // so its bound name is not where it lives: the VM's path under the
  // socket directory is (the one path AddVm picks for a VM of this name).
  ChannelOptions opts = ChannelOptionsFor(name, policy, "");
  opts.store_vm = vm;
  // The generation tells the guest its pool ids and filters are void: this
  // process holds none of the pages the old one stored.
  absl::StatusOr<std::unique_ptr<Channel>> ch = Channel::Restore(
      opts, fds, store_.get(), SharedRegion::NewHostGeneration(), valve_.get());
  if (!ch.ok()) {
    if (created) {
      EraseLocked(name);
      (void)store_->ForgetVm(vm);
    }
    return absl::Status(
        ch.status().code(),
        absl::StrCat("VM '", name, "': ", ch.status().message()));
  }
  return InstallLocked(**e, name, std::move(*ch), "channel_restored");
}

std::vector<NamedFd> Agent::HandoffFds() const {
  MutexLock lock(&mu_);
  std::vector<NamedFd> out;
  for (const auto& [name, e] : vms_) {
    if (e.channel == nullptr) continue;
    for (NamedFd& f : e.channel->HandoffFds()) out.push_back(std::move(f));
  }
  return out;
}

void Agent::KeepChannelsForSuccessor() {
  MutexLock lock(&mu_);
  for (auto& [name, e] : vms_) {
    if (e.channel != nullptr) e.channel->KeepForSuccessor();
  }
}

VmInfo Agent::InstallLocked(VmEntry& e, const std::string& name,
                            std::unique_ptr<Channel> channel,
                            std::string_view event) {
  Channel* ch = channel.get();
  Worker* least = nullptr;
  for (auto& [w, n] : load_) {
    if (least == nullptr || n < load_[least]) least = w;
  }
  ++load_[least];
  e.channel = std::move(channel);
  e.worker = least;
  e.socket_path = ch->server().socket_path();
  least->AddChannel(e.channel.get());
  Log(LogLevel::kInfo, event,
      {{"vm", name},
       {"socket", e.socket_path},
       {"region_bytes", ch->region().layout().region_bytes},
       {"slots", ch->region().layout().slot_count},
       {"ring_entries", options_.ring_entries},
       {"guest_attached", ch->server().connected()},
       {"host_peer_id", ch->server().host_peer_id()}});
  return InfoLocked(name, e);
}

absl::Status Agent::RemoveVm(const std::string& name) {
  MutexLock lifecycle(&lifecycle_mu_);
  std::unique_ptr<Channel> doomed;
  VmInfo last;
  std::optional<VmId> forget;
  {
    MutexLock lock(&mu_);
    auto it = vms_.find(name);
    if (it == vms_.end() || it->second.channel == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("no VM named '", name, "' with a channel"));
    }
    VmEntry& e = it->second;
    e.worker->RemoveChannel(e.channel.get());
    --load_[e.worker];
    // The channel's last counters, read once no worker serves it: a guest
    // that worked and left between two stats lines shows up here.
    last = InfoLocked(name, e);
    doomed = std::move(e.channel);
    e.worker = nullptr;
    e.socket_path.clear();
    if (e.swap == nullptr) {
      forget = e.vm;
      EraseLocked(name);
    }
  }
  doomed.reset();  // unlinks the socket, drops the channel's pools
  if (forget) (void)store_->ForgetVm(*forget);  // the VM's last frontend
  Log(LogLevel::kInfo, "channel_removed",
      {{"vm", name},
       {"gets_hit", last.stats.counters[static_cast<int>(Counter::kGetsHit)]},
       {"gets_miss", last.stats.counters[static_cast<int>(Counter::kGetsMiss)]},
       {"valve_compressed",
        last.valve.counters[static_cast<int>(ValveCounter::kCompressed)]},
       {"valve_raw",
        last.valve.counters[static_cast<int>(ValveCounter::kRaw)]}});
  return absl::OkStatus();
}

bool Agent::HasVm(const std::string& name) const {
  MutexLock lock(&mu_);
  return vms_.contains(name);
}

std::vector<std::string> Agent::VmNames() const {
  MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [name, e] : vms_) out.push_back(name);
  return out;
}

VmInfo Agent::InfoLocked(const std::string& name, const VmEntry& e) const {
  VmInfo info;
  info.name = name;
  absl::StatusOr<VmStats> stats = store_->GetVmStats(e.vm);
  info.valve = valve_->VmStatus(e.vm);
  if (stats.ok()) {
    info.stats = *stats;
    info.policy = stats->policy;
    // The valve holds the modes.
    info.policy.mode = info.valve.mode;
    info.policy.swap_mode = info.valve.swap_mode;
  }
  info.has_channel = e.channel != nullptr;
  if (e.channel != nullptr) {
    info.socket_path = e.socket_path;
    info.connected = e.channel->server().connected();
    for (int i = 0; i < kNumChannelCounters; ++i) {
      info.channel[i] =
          e.channel->metrics().Get(static_cast<ChannelCounter>(i));
    }
    if (info.connected) info.guest = e.channel->guest_report();
  }
  if (e.swap != nullptr) info.swap = SwapInfo(*e.swap);
  return info;
}

SwapDeviceInfo Agent::SwapInfo(const SwapEntry& s) const {
  SwapDeviceInfo info;
  info.socket_path = s.device->socket_path();
  info.size_bytes = s.size_bytes;
  info.connected = s.device->connected();
  info.pages = s.store->PageStats();
  info.times = s.metered->Times();
  for (int i = 0; i < swap::kNumSwapCounters; ++i) {
    info.counters[i] =
        s.device->metrics().Get(static_cast<swap::SwapCounter>(i));
  }
  return info;
}

absl::StatusOr<SwapDeviceInfo> Agent::AddSwapDevice(const std::string& name,
                                                    uint64_t size_bytes,
                                                    const VmPolicy& requested) {
  if (absl::Status s = ValidateVmName(name); !s.ok()) return s;
  if (size_bytes == 0 || size_bytes % swap::kSwapPageSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("swap device '", name, "': size ", size_bytes,
                     " is not a positive multiple of ", swap::kSwapPageSize));
  }
  MutexLock lifecycle(&lifecycle_mu_);
  MutexLock lock(&mu_);
  if (auto it = vms_.find(name); it != vms_.end() && it->second.swap) {
    return absl::AlreadyExistsError(
        absl::StrCat("VM '", name, "' already has a swap device"));
  }
  if (swap_stopped_.load()) {
    return absl::FailedPreconditionError("tmemd is stopping");
  }
  const VmPolicy policy = resolver_ ? resolver_(name, requested) : requested;
  bool created = false;
  absl::StatusOr<VmEntry*> e = EntryForLocked(name, policy, false, &created);
  if (!e.ok()) return e.status();
  const VmId vm = (*e)->vm;
  // Called only with mu_ held (the lock above spans every use).
  auto undo = [&](const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (created) {
      EraseLocked(name);
      (void)store_->ForgetVm(vm);
    }
    return absl::Status(
        s.code(), absl::StrCat("swap device '", name, "': ", s.message()));
  };
  auto entry = std::make_unique<SwapEntry>();
  entry->size_bytes = size_bytes;
  swap::SwapStoreRequest request;
  request.vm_name = name;
  request.vm = vm;
  request.page_count = size_bytes / swap::kSwapPageSize;
  request.store = store_.get();
  // Swap pages always come back: the valve only says how to store them.
  request.advisor = swap_advisor_.get();
  request.state_dir = options_.state_dir;
  absl::StatusOr<std::unique_ptr<swap::SwapStore>> store =
      swap_store_factory_(request);
  if (!store.ok()) return undo(store.status());
  entry->store = std::move(*store);
  entry->metered =
      std::make_unique<swap::MeteredSwapBacking>(&entry->store->backing());
  swap::SwapDeviceOptions o;
  o.socket_path = absl::StrCat(options_.socket_dir, "/", name, ".swap.sock");
  // The ivshmem sockets' rules: QEMU's group, the configured mode.
  o.socket_mode.mode = options_.socket_mode;
  o.socket_mode.group = options_.socket_gid;
  o.blk.num_queues = static_cast<uint16_t>(options_.swap_queues);
  o.on_event = [name](std::string_view event, std::string_view reason) {
    Log(LogLevel::kWarn, event, {{"vm", name}, {"reason", reason}});
  };
  o.charge_cpu = [advisor = swap_advisor_.get(), vm](int64_t nanos) {
    advisor->ChargeCpu(vm, nanos);
  };
  absl::StatusOr<std::unique_ptr<swap::SwapDevice>> dev =
      swap::SwapDevice::Start(std::move(o), entry->metered.get());
  if (!dev.ok()) return undo(dev.status());
  entry->device = std::move(*dev);
  VmEntry& ve = **e;
  ve.swap = std::move(entry);
  SwapDeviceInfo info = SwapInfo(*ve.swap);
  Log(LogLevel::kInfo, "swap_device_created",
      {{"vm", name},
       {"socket", info.socket_path},
       {"size_bytes", size_bytes},
       {"queues", options_.swap_queues}});
  return info;
}

absl::Status Agent::RemoveSwapDevice(const std::string& name) {
  MutexLock lifecycle(&lifecycle_mu_);
  std::unique_ptr<SwapEntry> doomed;
  std::optional<VmId> forget;
  {
    MutexLock lock(&mu_);
    auto it = vms_.find(name);
    if (it == vms_.end() || it->second.swap == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("no VM named '", name, "' with a swap device"));
    }
    doomed = std::move(it->second.swap);
    // Stopped first: the device's thread charges its CPU to the VM's valve
    // entry, which EraseLocked removes. No request runs once it is stopped.
    doomed->device->Stop();
    if (it->second.channel == nullptr) {
      forget = it->second.vm;
      EraseLocked(name);
    }
  }
  // The image alone must be the whole device afterwards: a later
  // AddSwapDevice of this name adopts it, so pages only memory held would
  // otherwise come back as zeros.
  const absl::Status written = doomed->store->WriteBack();
  const uint64_t stored = doomed->store->PageStats().stored;
  if (!written.ok()) {
    Log(LogLevel::kError, "swap_write_back_failed",
        {{"vm", name}, {"error", std::string(written.message())}});
  }
  doomed.reset();  // unlinks its socket, frees its pages
  if (forget) (void)store_->ForgetVm(*forget);  // the VM's last frontend
  Log(LogLevel::kInfo, "swap_device_removed",
      {{"vm", name}, {"stored_pages", stored}});
  if (!written.ok()) {
    return absl::DataLossError(
        absl::StrCat("swap device '", name, "' removed, but ", stored,
                     " pages held in memory were not written to its image: ",
                     written.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<VmInfo> Agent::GetVm(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = vms_.find(name);
  if (it == vms_.end()) {
    return absl::NotFoundError(absl::StrCat("no VM named '", name, "'"));
  }
  return InfoLocked(name, it->second);
}

std::vector<VmInfo> Agent::ListVms() const {
  MutexLock lock(&mu_);
  std::vector<VmInfo> out;
  for (const auto& [name, e] : vms_) out.push_back(InfoLocked(name, e));
  return out;
}

absl::Status Agent::SetVmPolicy(const std::string& name,
                                const VmPolicy& policy) {
  MutexLock lock(&mu_);
  auto it = vms_.find(name);
  if (it == vms_.end()) {
    return absl::NotFoundError(absl::StrCat("no VM named '", name, "'"));
  }
  const VmId vm = it->second.vm;
  if (absl::Status s = store_->SetVmPolicy(vm, policy); !s.ok()) return s;
  valve_->SetVmPolicy(vm, policy);
  return absl::OkStatus();
}

absl::StatusOr<VmPolicy> Agent::GetVmPolicy(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = vms_.find(name);
  if (it == vms_.end()) {
    return absl::NotFoundError(absl::StrCat("no VM named '", name, "'"));
  }
  absl::StatusOr<VmPolicy> p = store_->GetVmPolicy(it->second.vm);
  if (p.ok()) {
    const ValveVmStatus valve = valve_->VmStatus(it->second.vm);
    p->mode = valve.mode;
    p->swap_mode = valve.swap_mode;
  }
  return p;
}

absl::Status Agent::SetMemoryCap(uint64_t cap_bytes) {
  return store_->SetMemoryCap(cap_bytes);
}

absl::Status Agent::SetValveOptions(const ValveOptions& options) {
  return valve_->SetOptions(options);
}

ValveOptions Agent::GetValveOptions() const { return valve_->options(); }

AgentStatus Agent::Status() const {
  AgentStatus s;
  s.store = store_->GetHostStats();
  s.valve = valve_->HostStatus();
  s.compactor = compactor_->Stats();
  s.workers = static_cast<int>(workers_.size());
  s.uptime_nanos = SteadyClock::Default()->NowNanos() - start_nanos_;
  return s;
}

absl::Status Agent::TickValve() {
  // Empty slabs kept since the last period go back to the OS here, on the
  // ticker, not on a worker's data path.
  store_->TrimIdleSlabs();
  RelieveSwapMemory();
  absl::StatusOr<CpuSample> sample = sampler_->Sample();
  if (!sample.ok()) return sample.status();
  valve_->Tick(*sample, SampleStoreMemory(*store_));
  {
    // A VM throttled for no reuse holds only its samples' pages, which are
    // unlikely to come back: evict those before a re-reading VM's.
    MutexLock lock(&mu_);
    for (const auto& [name, e] : vms_) {
      const VmId vm = e.vm;
      (void)store_->SetEvictionBias(
          vm, valve_->VmStatus(vm).throttled ? kThrottledEvictionBias : 1);
    }
  }
  // Polling burns CPU no VM is charged for (a worker spinning between the
  // gets of a busy re-reader is a whole core). Scale the window with the
  // share of the configured budget the host leaves tmemd (all of it on an
  // idle host, almost none on a saturated one, where guests ring doorbells),
  // and, as a feedback loop on tmemd's measured CPU, halve it each period
  // tmemd is over its budget and grow it back when well under.
  const ValveHostStatus host = valve_->HostStatus();
  // What the compactor compresses at normal priority with, when memory is
  // short: the valve's budget (tmemd's CPU share of the whole host).
  memory_short_.store(
      MemoryHeadroomShort(*store_, host.options.memory_headroom_fraction),
      std::memory_order_relaxed);
  compaction_budget_cores_.store(host.budget_fraction * host.num_cpus,
                                 std::memory_order_relaxed);
  const double configured = host.options.cpu_budget_percent / 100.0;
  const double share =
      configured > 0 ? std::clamp(host.budget_fraction / configured, 0.0, 1.0)
                     : 0.0;
  if (host.agent_busy_fraction > host.budget_fraction * 1.02) {
    poll_scale_ = poll_scale_ * 0.5;
  } else if (host.agent_busy_fraction < host.budget_fraction * 0.8) {
    poll_scale_ = std::min(1.0, poll_scale_ * 1.25 + 0.02);
  }
  const int poll_us =
      static_cast<int>(options_.worker.poll_us * std::min(share, poll_scale_));
  for (auto& w : workers_) w->SetPollMicros(poll_us);
  return absl::OkStatus();
}

void Agent::RelieveSwapMemory() {
  // lifecycle_mu_ keeps the devices alive (only removals destroy them, and
  // they hold it) without holding mu_, and the RPCs behind it, across the
  // batch's disk writes.
  MutexLock lifecycle(&lifecycle_mu_);
  std::vector<swap::SwapStore*> stores;
  {
    MutexLock lock(&mu_);
    for (const auto& [name, e] : vms_) {
      if (e.swap != nullptr) stores.push_back(e.swap->store.get());
    }
  }
  for (swap::SwapStore* s : stores) s->RelieveMemory();
}

void Agent::TickerLoop() {
  bool warned = false;
  for (;;) {
    const int period_ms = valve_->options().sample_period_ms;
    const auto tick_at =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(period_ms);
    {
      MutexLock lock(&ticker_mu_);
      while (!ticker_stop_ && ticker_cv_.WaitUntil(&ticker_mu_, tick_at)) {
      }
      if (ticker_stop_) return;
    }
    if (absl::Status s = TickValve(); !s.ok() && !warned) {
      // Without samples the budget stays where it was; say so once.
      Log(LogLevel::kWarn, "cpu_sample_failed", {{"error", s.message()}});
      warned = true;
    }
  }
}

}  // namespace tmem
