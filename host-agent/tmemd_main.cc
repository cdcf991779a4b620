// tmemd: the host agent. Serves each configured VM's ivshmem channel from
// one TmemStore until SIGTERM/SIGINT, then shuts down cleanly: the worker
// stops, sockets are unlinked, every VM's pages are released, and the final
// statistics are logged.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backend/mutex.h"
#include "backend/tmem_store.h"
#include "host-agent/agent.h"
#include "host-agent/channel/fd_handoff.h"
#include "host-agent/channel/socket_file.h"
#include "host-agent/channel/socket_group.h"
#include "host-agent/common/setting_ranges.h"
#include "host-agent/config.h"
#include "host-agent/control/control_plane.h"
#include "host-agent/control/descriptor_budget.h"
#include "host-agent/control/grpc_service.h"
#include "host-agent/control/metrics_http.h"
#include "host-agent/control/policy_store.h"
#include "host-agent/domain_control.h"
#include "host-agent/fleet/fleet_watcher.h"
#include "host-agent/libvirt/domain_manager.h"
#include "host-agent/libvirt/libvirt_hypervisor.h"
#include "host-agent/log.h"

namespace tmem {
namespace {

// How long a stop waits for the workers to leave their loops. A store
// operation does bounded work, so a healthy worker leaves in microseconds;
// one that does not is exited on, well inside systemd's stop timeout.
constexpr std::chrono::milliseconds kShutdownDeadline{5000};
constexpr int kExitShutdownDeadline = 3;

// A stop writes every swap page tmemd holds into its VM's spill image
// (Agent::StopServing); with gigabytes held that can outlast systemd's
// TimeoutStopSec= (90 s by default) and WatchdogSec=, and a SIGKILL then
// would lose the pages not yet written. So while a stop runs, tmemd tells
// systemd every kStopKeepalivePeriod that it is still at work, each time
// extending the stop by kStopKeepaliveExtension. (As long as the stop
// runs: one stuck on a hung disk is not cut short either.)
constexpr std::chrono::seconds kStopKeepalivePeriod{5};
constexpr std::chrono::seconds kStopKeepaliveExtension{30};

class StopKeepalive {
 public:
  explicit StopKeepalive(std::string what)
      : what_(std::move(what)),
        start_(std::chrono::steady_clock::now()),
        thread_([this] { Run(); }) {}
  ~StopKeepalive() {
    {
      MutexLock lock(&mu_);
      done_ = true;
    }
    cv_.NotifyAll();
    thread_.join();
  }
  StopKeepalive(const StopKeepalive&) = delete;
  StopKeepalive& operator=(const StopKeepalive&) = delete;

 private:
  void Run() {
    MutexLock lock(&mu_);
    while (!done_) {
      const auto elapsed = std::chrono::duration_cast<std::chrono::seconds>(
          std::chrono::steady_clock::now() - start_);
      NotifyStopProgress(
          absl::StrCat(what_, " for ", elapsed.count(),
                       " s: stopping the data plane, writing swap pages "
                       "back to their spill images"),
          kStopKeepaliveExtension);
      const auto next = std::chrono::steady_clock::now() + kStopKeepalivePeriod;
      while (!done_ && cv_.WaitUntil(&mu_, next)) {
      }
    }
  }

  const std::string what_;
  const std::chrono::steady_clock::time_point start_;
  Mutex mu_;
  CondVar cv_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the fields above exist
};

void LogStats(const Agent& agent, std::string_view event) {
  const AgentStatus st = agent.Status();
  const HostStats& h = st.store;
  Log(LogLevel::kInfo, event,
      {{"memory_used", h.memory_used_bytes},
       {"memory_cap", h.memory_cap_bytes},
       {"pages", CounterValueOf(h.counters, Counter::kPagesHeld)},
       {"puts_compressed",
        CounterValueOf(h.counters, Counter::kPutsCompressed)},
       {"puts_raw", CounterValueOf(h.counters, Counter::kPutsRaw)},
       {"puts_zero_same",
        CounterValueOf(h.counters, Counter::kPutsZero) +
            CounterValueOf(h.counters, Counter::kPutsSameFilled)},
       {"puts_refused",
        CounterValueOf(h.counters, Counter::kPutsRefusedQuota) +
            CounterValueOf(h.counters, Counter::kPutsRefusedPoorCompression) +
            CounterValueOf(h.counters, Counter::kPutsRefusedNoMemory) +
            CounterValueOf(h.counters, Counter::kPutsRefusedPolicy)},
       {"gets_hit", CounterValueOf(h.counters, Counter::kGetsHit)},
       {"gets_miss", CounterValueOf(h.counters, Counter::kGetsMiss)},
       {"evictions", CounterValueOf(h.counters, Counter::kEvictionsHostCap) +
                         CounterValueOf(h.counters, Counter::kEvictionsQuota)},
       {"slabs_emptied_for_room", h.slabs_emptied_for_room},
       {"slab_choice_pages_walked", h.slab_choice_pages_walked},
       {"max_op_work", h.max_op_work},
       {"host_overhead_bytes", h.host_overhead_bytes},
       {"compression_ratio", CompressionRatio(h.counters)},
       {"host_busy", st.valve.host_busy_fraction},
       {"agent_busy", st.valve.agent_busy_fraction},
       {"cpu_budget", st.valve.budget_fraction},
       {"cpu_overhead", st.valve.overhead_fraction},
       {"cpu_tokens", st.valve.token_fraction}});
  const CompactorStats& k = st.compactor;
  auto skipped = [&k](CompactionSkip why) {
    return k.queue.skipped[static_cast<int>(why)];
  };
  Log(LogLevel::kInfo, "compactor_stats",
      {{"deferred", st.valve.options.deferred_compression},
       {"compressed", k.compressed},
       {"kept_raw", k.kept_raw},
       {"skipped_no_reuse", k.skipped_no_reuse},
       {"stale", k.stale},
       {"no_room", k.no_room},
       {"queue_length", k.queue.length},
       {"queue_capacity", k.queue.capacity},
       {"queue_overflows", k.queue.overflows},
       {"pushed", k.queue.pushed},
       {"skipped_read", skipped(CompactionSkip::kRead)},
       {"skipped_invalidated", skipped(CompactionSkip::kInvalidated)},
       {"skipped_evicted", skipped(CompactionSkip::kEvicted)},
       {"skipped_replaced", skipped(CompactionSkip::kReplaced)},
       {"idle_cpu_ns", k.idle_cpu_ns},
       {"normal_cpu_ns", k.normal_cpu_ns},
       {"pressure_batches", k.pressure_batches},
       {"idle_only_batches", k.idle_only_batches},
       {"priority_failures", k.priority_failures},
       {"within_1s", k.latency[0] + k.latency[1] + k.latency[2] + k.latency[3]},
       {"within_2s", k.latency[0] + k.latency[1] + k.latency[2] + k.latency[3] +
                         k.latency[4]}});
  for (const VmInfo& vm : agent.ListVms()) {
    auto ch = [&vm](ChannelCounter c) {
      return vm.channel[static_cast<int>(c)];
    };
    auto vc = [&vm](ValveCounter c) {
      return vm.valve.counters[static_cast<int>(c)];
    };
    Log(LogLevel::kInfo, "vm_stats",
        {{"vm", vm.name},
         {"connected", vm.connected},
         {"mode", ValveModeName(vm.valve.effective_mode)},
         {"swap_mode", ValveModeName(vm.valve.effective_swap_mode)},
         {"pages", CounterValueOf(vm.stats.counters, Counter::kPagesHeld)},
         {"persistent_charged_bytes",
          CounterValueOf(vm.stats.counters, Counter::kPersistentChargedBytes)},
         {"persistent_puts_refused_for_swap_quota",
          CounterValueOf(vm.stats.counters,
                         Counter::kPersistentPutsRefusedForSwapQuota)},
         {"gets_hit", CounterValueOf(vm.stats.counters, Counter::kGetsHit)},
         {"gets_miss", CounterValueOf(vm.stats.counters, Counter::kGetsMiss)},
         {"admission", vm.valve.admission},
         {"reuse", vm.valve.reuse_ratio},
         {"valve_compressed", vc(ValveCounter::kCompressed)},
         {"valve_raw", vc(ValveCounter::kRaw)},
         {"valve_dropped_cpu", vc(ValveCounter::kDroppedCpu)},
         {"valve_dropped_reuse", vc(ValveCounter::kDroppedReuse)},
         {"valve_dropped_memory", vc(ValveCounter::kDroppedMemory)},
         {"valve_dropped_off", vc(ValveCounter::kDroppedOff)},
         {"valve_dropped_aside", vc(ValveCounter::kDroppedAside)},
         {"valve_ghost_hits", vc(ValveCounter::kGhostHits)},
         {"valve_ghost_hits_far", vc(ValveCounter::kGhostHitsFar)},
         {"valve_reach_pages", vm.valve.reach_pages},
         {"valve_evictions_in_state", vm.valve.evictions_in_state},
         {"valve_judge_after_evictions", vm.valve.judge_after_evictions},
         {"valve_throttle_events", vc(ValveCounter::kThrottleEvents)},
         {"valve_restore_events", vc(ValveCounter::kRestoreEvents)},
         {"valve_cpu_ns", vm.valve.cpu_used_ns},
         {"sqe_processed", ch(ChannelCounter::kSqeProcessed)},
         {"doorbells", ch(ChannelCounter::kDoorbells)},
         {"poll_rounds", ch(ChannelCounter::kPollRounds)},
         {"puts_compression_deferred",
          ch(ChannelCounter::kPutsCompressionDeferred)},
         {"interrupts", ch(ChannelCounter::kInterruptsSent)},
         {"bad_entries", ch(ChannelCounter::kSqeBadOpcode) +
                             ch(ChannelCounter::kSqeBadPool) +
                             ch(ChannelCounter::kSqeBadSlot) +
                             ch(ChannelCounter::kSqeBadFlags)},
         {"resets", ch(ChannelCounter::kChannelResets)},
         {"corrupt_rings", ch(ChannelCounter::kRingCorruptIndex)},
         {"guest_restarts", ch(ChannelCounter::kGuestRestarts)},
         {"handshake_failures", ch(ChannelCounter::kHandshakeFailures)},
         {"get_batches", ch(ChannelCounter::kGetBatches)},
         {"get_batch_pages", ch(ChannelCounter::kGetBatchPages)},
         {"get_batch_hits", ch(ChannelCounter::kGetBatchHits)},
         {"get_batch_refused", ch(ChannelCounter::kGetBatchBadCount) +
                                   ch(ChannelCounter::kGetBatchBadSlots) +
                                   ch(ChannelCounter::kGetBatchSharedPool)},
         // The guest's own report (untrusted, shown as it wrote it).
         {"guest_standing_aside", vm.guest.standing_aside},
         {"guest_get_ns", vm.guest.get_ns},
         {"guest_miss_ns", vm.guest.miss_ns},
         {"guest_prefetch_used", vm.guest.prefetch_used},
         {"guest_prefetch_unused", vm.guest.prefetch_unused},
         {"guest_ram_pages", vm.guest.ram_pages},
         {"restored", ch(ChannelCounter::kRestoredAcrossRestart)},
         {"foreign_regions", ch(ChannelCounter::kForeignRegions)}});
  }
}

// systemd's STATUS= line: what `systemctl status tmemd` shows. Only what
// changes seldom (memory is in /metrics and tmemctl), so the main loop
// sends it on a change, not every tick.
std::string ServiceStatus(Agent& agent) {
  const std::vector<VmInfo> vms = agent.ListVms();
  uint64_t connected = 0;
  for (const VmInfo& vm : vms) connected += vm.connected ? 1 : 0;
  return absl::StrCat(
      vms.size(), " VMs (", connected, " connected), mode ",
      std::string(ValveModeName(agent.valve().options().default_mode)));
}

// The binary to exec on an upgrade: the path this process was started
// from, so a package that replaced the file (rename over it) runs the new
// one. /proc/self/exe would name the old, deleted inode.
std::string OwnExecutable() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, static_cast<size_t>(n));
  constexpr std::string_view kDeleted = " (deleted)";
  if (path.size() > kDeleted.size() &&
      path.compare(path.size() - kDeleted.size(), kDeleted.size(), kDeleted) ==
          0) {
    path.resize(path.size() - kDeleted.size());
  }
  return path;
}

// Raises the soft descriptor limit to the hard one and fits the control
// listeners' connection caps into what guest channels and tmemd itself do
// not need (descriptor_budget.h has the formula); logs the result.
absl::StatusOr<DescriptorBudget> SetUpDescriptorBudget(
    const TmemdConfig& config) {
  absl::StatusOr<DescriptorLimit> limit = RaiseDescriptorLimit();
  if (!limit.ok()) return limit.status();
  const ControlConfig& c = config.control;
  const bool admin = !c.socket.has_value() || !c.socket->empty();
  DescriptorBudgetInput in;
  in.limit = limit->soft;
  in.reserved_vm_channels = c.reserved_vm_channels;
  in.vectors = config.vectors;
  in.metrics_clients = c.metrics_port >= 0 ? MetricsServer::kDescriptors : 0;
  in.admin = admin ? c.max_admin_connections : 0;
  in.readonly = c.readonly_socket.empty() ? 0 : c.max_readonly_connections;
  in.tcp = c.tcp_address.empty() ? 0 : c.max_tcp_connections;
  absl::StatusOr<DescriptorBudget> b = PlanDescriptorBudget(in);
  if (!b.ok()) return b.status();
  Log(b->lowered ? LogLevel::kWarn : LogLevel::kInfo, "descriptor_budget",
      {{"nofile", limit->soft},
       {"raised", limit->raised},
       {"fixed", kFixedDescriptors},
       {"reserved_vm_channels", in.reserved_vm_channels},
       {"guest_reserve", b->guest_reserve},
       {"metrics", in.metrics_clients},
       {"control", b->control_descriptors},
       {"max_admin_connections", b->admin},
       {"max_readonly_connections", b->readonly},
       {"max_tcp_connections", b->tcp},
       {"lowered", b->lowered}});
  return b;
}

// What the command line says, before it is merged over the config file.
// `given` names every flag that appeared, so an explicit value equal to
// the default still overrides the file.
struct Flags {
  std::vector<std::string> argv;  // as started: an upgrade execs it again
  std::set<std::string, std::less<>> given;
  std::string config_path;
  std::string check_config_path;
  std::vector<std::string> vm_names;
  std::vector<std::string> swap_devices;  // NAME=SIZE
  std::string state_dir;
  std::string socket_dir, memory_cap, log_level, log_format, mode;
  std::string libvirt_uri;
  std::string deferred_compression;
  int64_t stats_interval = 0;
  int64_t workers = 0;
  double cpu_budget = 0;
  std::optional<std::string> control_socket;
  std::string control_ro_socket, control_tcp, tls_cert, tls_key, tls_ca,
      state_file;
  std::vector<std::string> control_admins;
  int64_t metrics_port = -1;
  int64_t max_admin_conns = 0, max_ro_conns = 0, max_tcp_conns = 0,
          reserved_vm_channels = 0;
  int host_peer_id = 1;
  bool no_fd_store = false;

  bool Given(std::string_view flag) const { return given.contains(flag); }
};

// Everything tmemd runs, in the order the start-up steps build it. Members
// are destroyed in reverse order, so what calls into the agent goes before
// the agent.
struct Daemon {
  std::string own_executable;
  TmemdConfig config;
  InheritedChannels inherited;
  std::unique_ptr<SystemdFdStore> fd_store;
  SocketGroupChoice group;
  sigset_t signals{};
  DescriptorBudget budget;
  std::unique_ptr<Agent> agent;
  std::unique_ptr<PolicyStore> policies;
  std::unique_ptr<LibvirtHypervisor> hypervisor;
  std::unique_ptr<DomainManager> domain_manager;
  std::unique_ptr<ControlPlane> control;
  std::unique_ptr<ControlServer> control_server;
  std::unique_ptr<MetricsServer> metrics;
  std::unique_ptr<FleetWatcher> fleet;
};

// Every start-up step below returns the exit code tmemd ends with when it
// must stop there (it has logged why), or nothing to go on.
using StepExit = std::optional<int>;

StepExit ParseFlags(int argc, char** argv, Flags* f) {
  f->argv.assign(argv, argv + argc);
  CLI::App app{
      "tmemd: transcendent-memory host agent. Serves guests' evicted clean "
      "pages over ivshmem-doorbell channels, one per VM."};
  app.add_option("-c,--config", f->config_path, "TOML config file");
  app.add_option("--check-config", f->check_config_path,
                 "validate FILE (with the other flags given) and exit: 0 "
                 "if tmemd would start with it, else 2 with the error "
                 "(FILE:LINE where the file has the key)");
  app.add_option("--vm", f->vm_names,
                 "create a channel for VM NAME (repeatable; adds to the "
                 "config's [[vm]] list), socket SOCKET_DIR/NAME.sock");
  app.add_option("--swap", f->swap_devices,
                 "serve a vhost-user-blk swap device for VM NAME, NAME=SIZE "
                 "(repeatable; SIZE a multiple of 4096, e.g. 4G; adds to the "
                 "config's [swap.NAME]), socket SOCKET_DIR/NAME.swap.sock");
  app.add_option("--state-dir", f->state_dir,
                 "directory for files kept across restarts (swap spill "
                 "images in STATE_DIR/swap/; /var/lib/tmemd)");
  app.add_option("--socket-dir", f->socket_dir,
                 "directory for channel sockets");
  app.add_option("--memory-cap", f->memory_cap, "host memory cap, e.g. 2GiB");
  app.add_option("--mode", f->mode,
                 "host default valve mode: off|always|adaptive (adaptive)");
  app.add_option("--cpu-budget", f->cpu_budget,
                 "tmemd's CPU budget, percent of the whole host (25)");
  app.add_option("--deferred-compression", f->deferred_compression,
                 "adaptive mode stores raw and compresses with idle cycles: "
                 "true|false (true)");
  app.add_option("--workers", f->workers,
                 "worker threads (0: one per CPU, the default)");
  app.add_option("--libvirt-uri", f->libvirt_uri,
                 "follow libvirt domains at URI (e.g. qemu:///system): "
                 "attach/detach, lifecycle, quotas from metadata");
  app.add_option("--log-level", f->log_level, "debug|info|warn|error");
  app.add_option("--log-format", f->log_format, "text|json");
  app.add_option("--stats-interval", f->stats_interval,
                 "log statistics every N seconds (0: only at exit)");
  // Control plane (docs/control-plane.md).
  app.add_option("--host-peer-id", f->host_peer_id,
                 "ivshmem peer id of tmemd, 0 or 1 (the VM is the other); 1, "
                 "the default, makes the device migratable (QEMU master=on "
                 "needs the VM to be peer 0); 0 only for guest drivers older "
                 "than ABI v2, which always ring peer 0")
      ->check(CLI::Range(0, 1));
  app.add_flag("--no-fd-store", f->no_fd_store,
               "do not keep channel descriptors in systemd's fd store "
               "(NOTIFY_SOCKET); a restart then loses running guests' "
               "devices");
  app.add_option("--control-socket", f->control_socket,
                 "admin gRPC socket, mode 0600 (SOCKET_DIR/control.sock; "
                 "'' for none)");
  app.add_option("--control-readonly-socket", f->control_ro_socket,
                 "read-only gRPC socket, mode 0666 (none)");
  app.add_option("--control-tcp", f->control_tcp,
                 "gRPC over TCP with mutual TLS, HOST:PORT (none)");
  app.add_option("--control-tls-cert", f->tls_cert, "server certificate (PEM)");
  app.add_option("--control-tls-key", f->tls_key, "server key (PEM)");
  app.add_option("--control-tls-ca", f->tls_ca, "CA for client certificates");
  app.add_option("--control-admin", f->control_admins,
                 "client certificate CN/SAN allowed to change policy "
                 "(repeatable)");
  app.add_option("--state-file", f->state_file,
                 "policy state file (e.g. /var/lib/tmemd/state.json)");
  app.add_option("--control-max-admin-connections", f->max_admin_conns,
                 "open connections on the admin socket at most (64)");
  app.add_option("--control-max-readonly-connections", f->max_ro_conns,
                 "open connections on the read-only socket at most (8)");
  app.add_option("--control-max-tcp-connections", f->max_tcp_conns,
                 "open connections on the mTLS port at most (32)");
  app.add_option("--reserved-vm-channels", f->reserved_vm_channels,
                 "guest channels whose descriptors no control connection "
                 "may take (64)");
  app.add_option("--metrics-port", f->metrics_port,
                 "serve Prometheus /metrics on this port (-1: off; 0: any)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (const CLI::Option* o : app.get_options()) {
    if (o->count() == 0) continue;
    for (const std::string& name : o->get_lnames()) {
      f->given.insert(absl::StrCat("--", name));
    }
  }
  return std::nullopt;
}

// A flag given is range-checked by the same table as the config file
// (setting_ranges.h); out of range or NaN is refused with the flag named.
int RefuseFlag(const char* flag, const absl::Status& s) {
  Log(LogLevel::kError, "config_error",
      {{"flag", flag}, {"error", s.message()}});
  return 2;
}

StepExit CheckFlagRanges(const Flags& f) {
  if (f.Given("--stats-interval")) {
    if (absl::Status s = CheckRange(ranges::kStatsIntervalSeconds,
                                    f.stats_interval, "--stats-interval");
        !s.ok()) {
      return RefuseFlag("--stats-interval", s);
    }
  }
  if (f.Given("--workers")) {
    if (absl::Status s = CheckRange(ranges::kWorkers, f.workers, "--workers");
        !s.ok()) {
      return RefuseFlag("--workers", s);
    }
  }
  if (f.Given("--cpu-budget")) {
    if (absl::Status s =
            CheckRange(ranges::kCpuBudgetPercent, f.cpu_budget, "--cpu-budget");
        !s.ok()) {
      return RefuseFlag("--cpu-budget", s);
    }
  }
  if (f.Given("--metrics-port")) {
    if (absl::Status s =
            CheckRange(ranges::kMetricsPort, f.metrics_port, "--metrics-port");
        !s.ok()) {
      return RefuseFlag("--metrics-port", s);
    }
  }
  for (auto [flag, value, range] :
       {std::tuple{"--control-max-admin-connections", f.max_admin_conns,
                   &ranges::kMaxAdminConnections},
        std::tuple{"--control-max-readonly-connections", f.max_ro_conns,
                   &ranges::kMaxReadonlyConnections},
        std::tuple{"--control-max-tcp-connections", f.max_tcp_conns,
                   &ranges::kMaxTcpConnections},
        std::tuple{"--reserved-vm-channels", f.reserved_vm_channels,
                   &ranges::kReservedVmChannels}}) {
    if (!f.Given(flag)) continue;
    if (absl::Status s = CheckRange(*range, value, flag); !s.ok()) {
      return RefuseFlag(flag, s);
    }
  }
  for (const std::string& name : f.vm_names) {
    if (absl::Status s = ValidateVmName(name); !s.ok()) {
      return RefuseFlag("--vm", s);
    }
  }
  if (f.Given("--config") && f.config_path.empty()) {
    return RefuseFlag("--config", absl::InvalidArgumentError("empty path"));
  }
  return std::nullopt;
}

// Flags override the file: lays every flag given over `config`.
StepExit MergeFlags(const Flags& f, TmemdConfig& config) {
  for (const std::string& name : f.vm_names)
    config.vms.push_back({name, {}, {}});
  for (const std::string& text : f.swap_devices) {
    absl::StatusOr<SwapConfig> sc = ParseSwapFlag(text);
    if (!sc.ok()) return RefuseFlag("--swap", sc.status());
    config.swap_devices.push_back(*sc);
  }
  if (f.Given("--state-dir")) config.state_dir = f.state_dir;
  if (!f.socket_dir.empty()) config.socket_dir = f.socket_dir;
  if (!f.memory_cap.empty()) {
    absl::StatusOr<uint64_t> cap = ParseSize(f.memory_cap);
    if (!cap.ok()) return RefuseFlag("--memory-cap", cap.status());
    if (absl::Status s = CheckRange(ranges::kMemoryCap, *cap, "--memory-cap");
        !s.ok()) {
      return RefuseFlag("--memory-cap", s);
    }
    config.store.memory_cap_bytes = *cap;
  }
  if (!f.log_level.empty() && !ParseLogLevel(f.log_level, &config.log_level)) {
    Log(LogLevel::kError, "config_error",
        {{"flag", "--log-level"}, {"error", "use debug, info, warn or error"}});
    return 2;
  }
  if (f.log_format == "json") config.log_format = LogFormat::kJson;
  if (f.log_format == "text") config.log_format = LogFormat::kText;
  if (!f.log_format.empty() && f.log_format != "json" &&
      f.log_format != "text") {
    Log(LogLevel::kError, "config_error",
        {{"flag", "--log-format"}, {"error", "use text or json"}});
    return 2;
  }
  if (!f.libvirt_uri.empty()) {
    config.libvirt.enabled = true;
    config.libvirt.uri = f.libvirt_uri;
  }
  if (f.Given("--stats-interval")) {
    config.stats_interval_seconds = static_cast<int>(f.stats_interval);
  }
  if (f.Given("--workers")) config.workers = static_cast<int>(f.workers);
  if (f.Given("--cpu-budget")) config.valve.cpu_budget_percent = f.cpu_budget;
  if (f.Given("--deferred-compression")) {
    if (f.deferred_compression != "true" && f.deferred_compression != "false") {
      Log(LogLevel::kError, "config_error",
          {{"flag", "--deferred-compression"},
           {"error", absl::StrCat("use true or false, not '",
                                  f.deferred_compression, "'")}});
      return 2;
    }
    config.valve.deferred_compression = f.deferred_compression == "true";
  }
  if (!f.mode.empty() && (!ParseValveMode(f.mode, &config.valve.default_mode) ||
                          config.valve.default_mode == ValveMode::kDefault)) {
    Log(LogLevel::kError, "config_error",
        {{"flag", "--mode"}, {"error", "use off, always or adaptive"}});
    return 2;
  }
  ControlConfig& c = config.control;
  if (f.control_socket) c.socket = *f.control_socket;
  if (!f.control_ro_socket.empty()) c.readonly_socket = f.control_ro_socket;
  if (!f.control_tcp.empty()) c.tcp_address = f.control_tcp;
  if (!f.tls_cert.empty()) c.tls_cert = f.tls_cert;
  if (!f.tls_key.empty()) c.tls_key = f.tls_key;
  if (!f.tls_ca.empty()) c.tls_ca = f.tls_ca;
  if (!f.control_admins.empty()) c.admin = f.control_admins;
  if (!f.state_file.empty()) c.state_file = f.state_file;
  if (f.Given("--metrics-port")) {
    c.metrics_port = static_cast<int>(f.metrics_port);
  }
  for (auto [flag, value, field] :
       {std::tuple{"--control-max-admin-connections", f.max_admin_conns,
                   &c.max_admin_connections},
        std::tuple{"--control-max-readonly-connections", f.max_ro_conns,
                   &c.max_readonly_connections},
        std::tuple{"--control-max-tcp-connections", f.max_tcp_conns,
                   &c.max_tcp_connections},
        std::tuple{"--reserved-vm-channels", f.reserved_vm_channels,
                   &c.reserved_vm_channels}}) {
    if (f.Given(flag)) *field = static_cast<int>(value);
  }
  return std::nullopt;
}

// The file, then the flags over it, then the cross-field checks. With
// --check-config this is the whole run: it prints the verdict and exits.
StepExit BuildConfig(Flags& f, TmemdConfig& config) {
  const bool check_only = f.Given("--check-config");
  if (check_only) {
    if (f.check_config_path.empty() ||
        (!f.config_path.empty() && f.config_path != f.check_config_path)) {
      std::fprintf(stderr,
                   "tmemd: --check-config needs a FILE (and no other "
                   "--config)\n");
      return 2;
    }
    f.config_path = f.check_config_path;
  }
  const std::string& config_path = f.config_path;
  // --check-config prints errors as plain lines for a terminal or a
  // maintainer script: FILE:LINE when the message has it, else FILE first.
  auto check_failed = [&config_path](absl::string_view message) {
    const std::string text(message);
    if (text.find(config_path) != std::string::npos) {
      std::fprintf(stderr, "tmemd: %s\n", text.c_str());
    } else {
      std::fprintf(stderr, "tmemd: %s: %s\n", config_path.c_str(),
                   text.c_str());
    }
    return 2;
  };
  if (StepExit exit = CheckFlagRanges(f)) return exit;
  if (!config_path.empty()) {
    absl::StatusOr<TmemdConfig> loaded = LoadConfigFile(config_path, config);
    if (!loaded.ok() && check_only) {
      return check_failed(loaded.status().message());
    }
    if (!loaded.ok()) {
      Log(LogLevel::kError, "config_error",
          {{"error", loaded.status().message()}});
      return 2;
    }
    config = *loaded;
  }
  if (StepExit exit = MergeFlags(f, config)) return exit;
  SetLogLevel(config.log_level);
  SetLogFormat(config.log_format);
  if (absl::Status s = ValidateConfig(config); !s.ok()) {
    if (check_only) return check_failed(s.message());
    Log(LogLevel::kError, "config_error", {{"error", s.message()}});
    return 2;
  }
  if (check_only) {
    // What else a start would refuse before serving: a socket group that
    // does not exist here.
    absl::StatusOr<SocketGroupChoice> group =
        ChooseSocketGroup(config.socket_group);
    if (!group.ok()) return check_failed(group.status().message());
    std::printf("tmemd: %s: configuration OK\n", config_path.c_str());
    return 0;
  }
  if (config.vms.empty() && config.swap_devices.empty() &&
      !config.libvirt.enabled) {
    Log(LogLevel::kWarn, "no_vms",
        {{"hint",
          "no [[vm]] or [swap.NAME] in the config and no --vm or --swap "
          "flag: serving nothing"}});
  }
  return std::nullopt;
}

// Before anything else opens descriptors or starts threads: they are fds
// 3.. (systemd) or named in the environment (exec handoff).
void TakeHandedOverDescriptors(const Flags& f, Daemon& d) {
  d.inherited = TakeInheritedChannels();
  for (const std::string& e : d.inherited.errors) {
    Log(LogLevel::kWarn, "handoff_rejected", {{"error", e}});
  }
  d.fd_store = f.no_fd_store ? nullptr : SystemdFdStore::FromEnvironment();
}

// The group QEMU runs in gets the VM sockets (mode 0660): configured, or
// Debian's libvirt-qemu when tmemd may use it (socket_group.h). The socket
// directory is created for it, or checked when it exists.
StepExit PrepareSocketDirectory(Daemon& d) {
  const TmemdConfig& config = d.config;
  absl::StatusOr<SocketGroupChoice> group =
      ChooseSocketGroup(config.socket_group);
  if (!group.ok()) {
    Log(LogLevel::kError, "config_error",
        {{"error", group.status().message()}});
    return 2;
  }
  d.group = *group;
  if (!group->note.empty()) {
    Log(LogLevel::kWarn, "socket_group_default", {{"note", group->note}});
  }
  if (mkdir(config.socket_dir.c_str(), 0750) == 0) {
    // Ours: searchable by QEMU's group and nobody else (the umask, 0077
    // under the unit, would leave it 0700).
    if (group->gid) (void)chown(config.socket_dir.c_str(), -1, *group->gid);
    (void)chmod(config.socket_dir.c_str(), 0750);
  } else if (errno != EEXIST) {
    Log(LogLevel::kError, "socket_dir_error",
        {{"dir", config.socket_dir},
         {"error", std::generic_category().message(errno)}});
    return 1;
  }
  // Every socket is created in this directory: refuse one that someone else
  // could write to (they could swap sockets for symlinks).
  if (absl::Status s = CheckSocketDirectory(config.socket_dir); !s.ok()) {
    Log(LogLevel::kError, "socket_dir_error",
        {{"dir", config.socket_dir}, {"error", s.message()}});
    return 1;
  }
  // QEMU must be able to reach it: refused for a configured group, a
  // warning for the default one.
  if (group->gid) {
    if (absl::Status s = CheckGroupCanReach(config.socket_dir, *group->gid);
        !s.ok()) {
      Log(group->configured ? LogLevel::kError : LogLevel::kWarn,
          "socket_dir_unreachable",
          {{"dir", config.socket_dir}, {"error", s.message()}});
      if (group->configured) return 1;
    }
  }
  Log(LogLevel::kInfo, "socket_group",
      {{"group", group->gid ? group->name : std::string("(tmemd's own)")},
       {"configured", group->configured},
       {"mode", absl::StrFormat("%04o", config.socket_mode)}});
  return std::nullopt;
}

// Signals are taken synchronously by the main thread; block them before
// any other thread exists so none of them is picked to run a handler.
void BlockSignals(Daemon& d) {
  sigemptyset(&d.signals);
  sigaddset(&d.signals, SIGTERM);
  sigaddset(&d.signals, SIGINT);
  sigaddset(&d.signals, SIGHUP);  // upgrade: exec in place
  pthread_sigmask(SIG_BLOCK, &d.signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a vanished client must not kill us
}

StepExit PlanDescriptors(Daemon& d) {
  absl::StatusOr<DescriptorBudget> budget = SetUpDescriptorBudget(d.config);
  if (!budget.ok()) {
    Log(LogLevel::kError, "descriptor_budget_error",
        {{"error", budget.status().message()}});
    return 1;
  }
  d.budget = *budget;
  return std::nullopt;
}

// What backs swap devices' pages: the one place a backing is chosen. The
// store's persistent pool, with a spill image per device under
// STATE_DIR/swap/ (swap_store.h).
swap::SwapStoreFactory SwapStoreFactoryFor(const TmemdConfig& /*config*/) {
  static swap::SpillOpenRefusals refusals;  // outlives every device
  return swap::TmemSwapStoreFactory(&refusals);
}

AgentOptions AgentOptionsFor(const TmemdConfig& config, const Flags& f,
                             const Daemon& d) {
  AgentOptions options;
  options.store = config.store;
  options.valve = config.valve;
  options.socket_dir = config.socket_dir;
  options.region_bytes = config.region_bytes;
  options.ring_entries = config.ring_entries;
  options.vectors = config.vectors;
  options.socket_mode = config.socket_mode;
  options.socket_gid = d.group.gid;
  options.workers = config.workers;
  options.worker = config.worker;
  options.host_peer_id = f.host_peer_id;
  options.fd_store = d.fd_store.get();
  options.state_dir = config.state_dir;
  options.swap_store_factory = SwapStoreFactoryFor(config);
  return options;
}

StepExit CreateAgent(const Flags& f, Daemon& d) {
  absl::StatusOr<std::unique_ptr<Agent>> agent =
      Agent::Create(AgentOptionsFor(d.config, f, d));
  if (!agent.ok()) {
    Log(LogLevel::kError, "agent_error", {{"error", agent.status().message()}});
    return 1;
  }
  d.agent = std::move(*agent);
  absl::StatusOr<std::unique_ptr<PolicyStore>> policies =
      PolicyStore::Open(d.config.control.state_file);
  if (!policies.ok()) {
    Log(LogLevel::kError, "state_file_error",
        {{"error", policies.status().message()}});
    return 1;
  }
  d.policies = std::move(*policies);
  return std::nullopt;
}

// The libvirt glue is built before the control plane, which takes it as its
// DomainControl (gRPC AttachDomain/DetachDomain); it is started later
// (StartLibvirt), after the control plane has installed its policy
// resolver, so the VMs libvirt adds get their pushed policies.
StepExit BuildLibvirt(Daemon& d) {
  const TmemdConfig& config = d.config;
  if (!config.libvirt.enabled) return std::nullopt;
  LibvirtOptions lo;
  lo.uri = config.libvirt.uri;
  // Never wait for libvirtd before READY=1: the unit is ordered before
  // libvirtd.service (its qemu hook calls tmemd), so a socket-activated
  // libvirtd would wait for tmemd while tmemd waited for it; and a host
  // whose libvirtd is down must still serve --vm channels and gRPC.
  lo.connect_in_background = true;
  absl::StatusOr<std::unique_ptr<LibvirtHypervisor>> hv =
      LibvirtHypervisor::Connect(lo);
  if (!hv.ok()) {
    Log(LogLevel::kError, "libvirt_error",
        {{"uri", lo.uri}, {"error", hv.status().message()}});
    return 1;
  }
  d.hypervisor = std::move(*hv);
  DomainManagerOptions mo;
  mo.vectors = config.vectors;
  mo.detach_timeout =
      std::chrono::seconds(config.libvirt.detach_timeout_seconds);
  // tmemctl attach --swap: the agent's swap devices.
  Agent* agent = d.agent.get();
  mo.add_swap_device = [agent](const std::string& vm, uint64_t size) {
    return agent->AddSwapDevice(vm, size).status();
  };
  mo.remove_swap_device = [agent](const std::string& vm) {
    return agent->RemoveSwapDevice(vm);
  };
  d.domain_manager =
      std::make_unique<DomainManager>(d.agent.get(), d.hypervisor.get(), mo);
  return std::nullopt;
}

void BuildControlPlane(Daemon& d) {
  d.control = std::make_unique<ControlPlane>(d.agent.get(), d.policies.get(),
                                             d.domain_manager.get());
  // A VM added again (here, or later by the libvirt glue) gets the policy
  // pushed for it before, not the configured one.
  d.agent->SetVmPolicyResolver(
      [control = d.control.get()](const std::string& name,
                                  const VmPolicy& requested) {
        return control->ResolveVmPolicy(name, requested);
      });
}

// Channels a previous tmemd handed over: VMs in the config (or still
// served by a QEMU) are restored with a new host generation; the others,
// whose QEMU went away meanwhile, are cleaned up.
void RestoreHandedOverVms(Daemon& d) {
  struct {
    uint64_t restored = 0;     // channels taken over
    uint64_t guests_kept = 0;  // ... with QEMU still connected
    uint64_t vms_gone = 0;     // not configured and QEMU gone: removed
    uint64_t failed = 0;       // could not be taken over (logged)
  } restart;
  for (auto& [name, fds] : d.inherited.vms) {
    const VmConfig* configured = nullptr;
    for (const VmConfig& vm : d.config.vms) {
      if (vm.name == name) configured = &vm;
    }
    absl::StatusOr<VmInfo> restored = d.agent->RestoreVm(
        name, ConfiguredVmPolicy(d.config, name), std::move(fds));
    if (!restored.ok()) {
      ++restart.failed;
      Log(LogLevel::kError, "channel_restore_failed",
          {{"vm", name}, {"error", restored.status().message()}});
      continue;
    }
    ++restart.restored;
    if (restored->connected) {
      ++restart.guests_kept;
    } else if (configured == nullptr) {
      // Added at run time (gRPC, libvirt) and its QEMU is gone: nothing
      // will connect to it again; libvirt re-adds it if the domain returns.
      ++restart.vms_gone;
      (void)d.agent->RemoveVm(name);
    }
  }
  const InheritedChannels& in = d.inherited;
  if (!in.source.empty() || in.rejected > 0 || !in.errors.empty()) {
    Log(LogLevel::kInfo, "restart_recovered",
        {{"source", in.source},
         {"restored", restart.restored},
         {"guests_kept", restart.guests_kept},
         {"vms_gone", restart.vms_gone},
         {"failed", restart.failed},
         {"fds_rejected", in.rejected},
         {"host_generation", d.agent->host_generation()}});
  }
}

StepExit AddConfiguredVms(Daemon& d) {
  for (const VmConfig& vm : d.config.vms) {
    if (d.agent->HasVm(vm.name)) continue;  // restored
    absl::StatusOr<VmInfo> added =
        d.agent->AddVm(vm.name, ConfiguredVmPolicy(d.config, vm.name));
    if (!added.ok()) {
      Log(LogLevel::kError, "channel_error",
          {{"vm", vm.name}, {"error", added.status().message()}});
      return 1;
    }
  }
  return std::nullopt;
}

// A swap device per [swap.NAME] / --swap, after the channels, so a VM with
// both is registered once, with the policy its [[vm]] and [swap.NAME] set
// together; a VM with only a swap device gets what its [swap.NAME] sets.
StepExit AddSwapDevices(Daemon& d) {
  for (const SwapConfig& sc : d.config.swap_devices) {
    absl::StatusOr<SwapDeviceInfo> added = d.agent->AddSwapDevice(
        sc.name, sc.size_bytes, ConfiguredVmPolicy(d.config, sc.name));
    if (!added.ok()) {
      // A device refused for what is on disk (an image file that is not
      // ours to trust, one a crashed tmemd left without its pages) stays
      // down, said here, while tmemd serves every other VM; anything else
      // (out of memory, a bad size) stops the start.
      const bool refused = absl::IsFailedPrecondition(added.status());
      Log(LogLevel::kError,
          refused ? "swap_device_refused" : "swap_device_error",
          {{"vm", sc.name},
           {"source", sc.source},
           {"error", added.status().message()}});
      if (!refused) return 1;
    }
  }
  return std::nullopt;
}

// The state file's policies, over the configured ones: after every
// configured VM exists.
StepExit ApplyStoredPolicies(Daemon& d) {
  if (absl::Status s = d.control->ApplyStoredPolicies(); !s.ok()) {
    Log(LogLevel::kError, "state_file_error",
        {{"file", d.config.control.state_file}, {"error", s.message()}});
    return 1;
  }
  return std::nullopt;
}

// gRPC listeners and the /metrics endpoint.
StepExit StartControlServers(Daemon& d) {
  const TmemdConfig& config = d.config;
  ControlServerOptions options;
  options.unix_socket =
      config.control.socket.value_or(config.socket_dir + "/control.sock");
  options.readonly_unix_socket = config.control.readonly_socket;
  options.tcp_address = config.control.tcp_address;
  options.tls_cert = config.control.tls_cert;
  options.tls_key = config.control.tls_key;
  options.tls_ca = config.control.tls_ca;
  options.admin_identities = config.control.admin;
  options.max_admin_connections = d.budget.admin;
  options.max_readonly_connections = d.budget.readonly;
  options.max_tcp_connections = d.budget.tcp;
  absl::StatusOr<std::unique_ptr<ControlServer>> server =
      ControlServer::Start(options, d.control.get());
  if (!server.ok()) {
    Log(LogLevel::kError, "control_error",
        {{"error", server.status().message()}});
    return 1;
  }
  d.control_server = std::move(*server);
  if (config.control.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(
        d.agent.get(), config.control.metrics_address,
        config.control.metrics_port,
        [server = d.control_server.get()](PrometheusText& out) {
          server->AppendConnectionMetrics(out);
        });
    if (!m.ok()) {
      Log(LogLevel::kError, "metrics_error", {{"error", m.status().message()}});
      return 1;
    }
    d.metrics = std::move(*m);
  }
  Log(LogLevel::kInfo, "control_ready",
      {{"socket", options.unix_socket},
       {"readonly_socket", options.readonly_unix_socket},
       {"tcp_port", d.control_server->tcp_port()},
       {"metrics_port", d.metrics ? d.metrics->port() : -1},
       {"state_file", config.control.state_file}});
  return std::nullopt;
}

// Fleet policy: after the local state is applied, so etcd's view lands on
// top of it.
StepExit StartFleet(Daemon& d) {
  const TmemdConfig& config = d.config;
  if (!config.fleet.enabled()) return std::nullopt;
  FleetConfig fc = config.fleet;
  if (fc.host.empty()) {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) fc.host = name;
  }
  if (fc.state_dir.empty() && !config.control.state_file.empty()) {
    fc.state_dir =
        std::filesystem::path(config.control.state_file).parent_path();
  }
  absl::StatusOr<std::unique_ptr<FleetWatcher>> w =
      FleetWatcher::Start(fc, d.control.get(), d.agent.get());
  if (!w.ok()) {
    Log(LogLevel::kError, "fleet_error", {{"error", w.status().message()}});
    return 1;
  }
  d.fleet = std::move(*w);
  Log(LogLevel::kInfo, "fleet_ready",
      {{"host", fc.host}, {"state_dir", fc.state_dir}});
  return std::nullopt;
}

StepExit StartLibvirt(Daemon& d) {
  if (d.domain_manager == nullptr) return std::nullopt;
  if (absl::Status s = d.domain_manager->Start(); !s.ok()) {
    Log(LogLevel::kError, "libvirt_error",
        {{"uri", d.config.libvirt.uri}, {"error", s.message()}});
    return 1;
  }
  Log(LogLevel::kInfo, "libvirt_ready",
      {{"uri", d.config.libvirt.uri},
       {"domains", static_cast<uint64_t>(d.domain_manager->List().size())}});
  return std::nullopt;
}

void AnnounceReady(const Flags& f, const Daemon& d) {
  const TmemdConfig& config = d.config;
  const AgentStatus status = d.agent->Status();
  Log(LogLevel::kInfo, "tmemd_ready",
      {{"vms", static_cast<uint64_t>(config.vms.size())},
       {"swap_devices", static_cast<uint64_t>(config.swap_devices.size())},
       {"memory_cap", config.store.memory_cap_bytes},
       {"mode", ValveModeName(config.valve.default_mode)},
       {"cpu_budget_percent", config.valve.cpu_budget_percent},
       {"deferred_compression", config.valve.deferred_compression},
       {"compactor_idle_priority", status.compactor.idle_class_available},
       {"workers", status.workers},
       {"pid", static_cast<int64_t>(getpid())},
       {"fd_store", d.fd_store != nullptr},
       {"host_peer_id", f.host_peer_id}});
  NotifyReady(ServiceStatus(*d.agent));
}

enum class StopReason { kSignal, kUpgrade };

// The main loop wakes for signals, for the statistics log, and to tell
// systemd it is alive: WATCHDOG=1 at half of WatchdogSec= (systemd kills a
// service that misses it), with a fresh STATUS= line; without a watchdog,
// STATUS= is refreshed every 5 s when it changed. The status reads the
// agent under its locks, so a wedged agent stops the pings.
StopReason ServeUntilSignal(Daemon& d) {
  using Clock = std::chrono::steady_clock;
  const TmemdConfig& config = d.config;
  const std::optional<std::chrono::microseconds> watchdog = WatchdogInterval();
  const Clock::duration wake_every =
      watchdog ? Clock::duration(*watchdog / 2)
               : Clock::duration(std::chrono::seconds(5));
  const Clock::duration stats_every =
      std::chrono::seconds(config.stats_interval_seconds);
  Clock::time_point next_stats = Clock::now() + stats_every;
  std::string last_status = ServiceStatus(*d.agent);  // READY=1 sent it
  for (;;) {
    Clock::duration wait = wake_every;
    if (config.stats_interval_seconds > 0) {
      wait = std::min(
          wait, std::max(Clock::duration::zero(), next_stats - Clock::now()));
    }
    const auto wait_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
    const timespec ts{static_cast<time_t>(wait_ns / 1000000000),
                      static_cast<long>(wait_ns % 1000000000)};
    const int sig = sigtimedwait(&d.signals, nullptr, &ts);
    if (sig < 0) {
      if (config.stats_interval_seconds > 0 && Clock::now() >= next_stats) {
        LogStats(*d.agent, "stats");
        next_stats += stats_every;
      }
      std::string status = ServiceStatus(*d.agent);
      if (watchdog) {
        NotifyWatchdog(status);
      } else if (status != last_status) {
        NotifyStatus(status);
      }
      last_status = std::move(status);
      continue;
    }
    if (sig == SIGHUP) {
      // Refuse before stopping anything: an exec that cannot happen would
      // leave a tmemd that serves nothing.
      if (d.own_executable.empty() ||
          access(d.own_executable.c_str(), X_OK) != 0) {
        Log(LogLevel::kError, "upgrade_refused",
            {{"executable", d.own_executable},
             {"error", "not executable; still serving"}});
        continue;
      }
      Log(LogLevel::kInfo, "upgrade", {{"executable", d.own_executable}});
      return StopReason::kUpgrade;
    }
    Log(LogLevel::kInfo, "shutdown", {{"signal", sig}});
    return StopReason::kSignal;
  }
}

// Stops outside callers first (gRPC, then libvirt events), so nothing
// touches a stopping agent; then the data plane; then either execs the new
// image with the channels' descriptors or tears the agent down.
int Shutdown(const Flags& f, Daemon& d, StopReason why) {
  const bool upgrade = why == StopReason::kUpgrade;
  if (upgrade) {
    NotifyReloading();
  } else {
    NotifyStopping();
  }
  std::optional<StopKeepalive> keepalive;
  keepalive.emplace(upgrade ? "upgrading" : "stopping");
  d.fleet.reset();
  d.control_server->Shutdown();
  d.metrics.reset();
  d.domain_manager.reset();
  d.hypervisor.reset();
  if (!d.agent->StopServing(kShutdownDeadline)) {
    // A worker is still inside an operation: tearing the agent down would
    // free what it touches. Exit now; the guests' regions and sockets are
    // the kernel's to clean up, and a successor recovers as after a crash.
    Log(LogLevel::kError, "shutdown_deadline_exceeded",
        {{"deadline_ms", static_cast<int64_t>(kShutdownDeadline.count())}});
    std::_Exit(kExitShutdownDeadline);
  }
  LogStats(*d.agent, "final_stats");
  if (upgrade) {
    // Workers are stopped and nothing else touches the channels: hand their
    // descriptors to the new image. Returns only if the exec failed.
    const std::vector<NamedFd> fds = d.agent->HandoffFds();
    keepalive.reset();  // the new image sends READY=1 in its place
    absl::Status s = ExecWithFds(d.own_executable, f.argv, fds);
    Log(LogLevel::kError, "upgrade_failed", {{"error", s.message()}});
    // With an fd store, systemd restarts tmemd and it recovers from there.
    if (d.fd_store != nullptr) d.agent->KeepChannelsForSuccessor();
    d.agent.reset();
    return 1;
  }
  // Under systemd with an fd store a SIGTERM may be a restart: leave the
  // socket paths and the stored descriptors for the successor (a stop
  // closes the store; the next start replaces the stale socket files).
  if (d.fd_store != nullptr) d.agent->KeepChannelsForSuccessor();
  d.agent.reset();  // stops workers, unlinks sockets, forgets VMs
  Log(LogLevel::kInfo, "tmemd_stopped");
  return 0;
}

// tmemd's life, in order. Each step logs its own failure.
int Run(int argc, char** argv) {
  Flags flags;
  if (StepExit exit = ParseFlags(argc, argv, &flags)) return *exit;
  Daemon d;
  d.own_executable = OwnExecutable();
  if (StepExit exit = BuildConfig(flags, d.config)) return *exit;
  TakeHandedOverDescriptors(flags, d);
  if (StepExit exit = PrepareSocketDirectory(d)) return *exit;
  BlockSignals(d);
  if (StepExit exit = PlanDescriptors(d)) return *exit;
  if (StepExit exit = CreateAgent(flags, d)) return *exit;
  if (StepExit exit = BuildLibvirt(d)) return *exit;
  BuildControlPlane(d);
  RestoreHandedOverVms(d);
  if (StepExit exit = AddConfiguredVms(d)) return *exit;
  if (StepExit exit = AddSwapDevices(d)) return *exit;
  if (StepExit exit = ApplyStoredPolicies(d)) return *exit;
  if (StepExit exit = StartControlServers(d)) return *exit;
  if (StepExit exit = StartFleet(d)) return *exit;
  if (StepExit exit = StartLibvirt(d)) return *exit;
  AnnounceReady(flags, d);
  const StopReason why = ServeUntilSignal(d);
  return Shutdown(flags, d, why);
}

}  // namespace
}  // namespace tmem

int main(int argc, char** argv) {
  try {
    return tmem::Run(argc, argv);
  } catch (const std::exception& e) {
    // Nothing in tmemd throws on purpose; a library might (std::bad_alloc).
    tmem::Log(tmem::LogLevel::kError, "fatal", {{"error", e.what()}});
    return 1;
  }
}
