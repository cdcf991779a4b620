// tmemd: the host agent. Serves each configured VM's ivshmem channel from
// one TmemStore until SIGTERM/SIGINT, then shuts down cleanly: the worker
// stops, sockets are unlinked, every VM's pages are released, and the final
// statistics are logged.
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "backend/tmem_store.h"
#include "host-agent/channel/channel.h"
#include "host-agent/config.h"
#include "host-agent/log.h"
#include "host-agent/worker.h"

namespace tmem {
namespace {

uint64_t C(const CounterValues& v, Counter c) { return v[static_cast<int>(c)]; }

void LogStats(const TmemStore& store,
              const std::vector<std::unique_ptr<Channel>>& channels,
              std::string_view event) {
  const HostStats h = store.GetHostStats();
  Log(LogLevel::kInfo, event,
      {{"memory_used", h.memory_used_bytes},
       {"memory_cap", h.memory_cap_bytes},
       {"pages", C(h.counters, Counter::kPagesHeld)},
       {"puts_compressed", C(h.counters, Counter::kPutsCompressed)},
       {"puts_raw", C(h.counters, Counter::kPutsRaw)},
       {"puts_zero_same", C(h.counters, Counter::kPutsZero) +
                              C(h.counters, Counter::kPutsSameFilled)},
       {"gets_hit", C(h.counters, Counter::kGetsHit)},
       {"gets_miss", C(h.counters, Counter::kGetsMiss)},
       {"evictions", C(h.counters, Counter::kEvictionsHostCap) +
                         C(h.counters, Counter::kEvictionsQuota)},
       {"compression_ratio", CompressionRatio(h.counters)}});
  for (const auto& ch : channels) {
    const ChannelMetrics& m = ch->metrics();
    Log(LogLevel::kInfo, "vm_channel_stats",
        {{"vm", ch->name()},
         {"connected", ch->server().connected()},
         {"sqe_processed", m.Get(ChannelCounter::kSqeProcessed)},
         {"doorbells", m.Get(ChannelCounter::kDoorbells)},
         {"poll_rounds", m.Get(ChannelCounter::kPollRounds)},
         {"interrupts", m.Get(ChannelCounter::kInterruptsSent)},
         {"bad_entries", m.Get(ChannelCounter::kSqeBadOpcode) +
                             m.Get(ChannelCounter::kSqeBadPool) +
                             m.Get(ChannelCounter::kSqeBadSlot) +
                             m.Get(ChannelCounter::kSqeBadFlags)},
         {"resets", m.Get(ChannelCounter::kChannelResets)},
         {"corrupt_rings", m.Get(ChannelCounter::kRingCorruptIndex)},
         {"guest_restarts", m.Get(ChannelCounter::kGuestRestarts)},
         {"handshake_failures", m.Get(ChannelCounter::kHandshakeFailures)}});
  }
}

absl::StatusOr<gid_t> ResolveGroup(const std::string& group) {
  gid_t gid;
  if (absl::SimpleAtoi(group, &gid)) return gid;
  // getgrnam_r: tmemd has threads (not yet here, but keep it reentrant).
  struct group entry {};
  struct group* g = nullptr;
  std::vector<char> buf(16384);
  if (getgrnam_r(group.c_str(), &entry, buf.data(), buf.size(), &g) != 0 ||
      g == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("socket group '", group, "' does not exist on this host"));
  }
  return g->gr_gid;
}

int Run(int argc, char** argv) {
  CLI::App app{
      "tmemd: transcendent-memory host agent. Serves guests' evicted clean "
      "pages over ivshmem-doorbell channels, one per VM."};
  std::string config_path;
  std::vector<std::string> vm_names;
  std::string socket_dir, memory_cap, log_level, log_format;
  int stats_interval = -1;
  app.add_option("-c,--config", config_path, "TOML config file");
  app.add_option("--vm", vm_names,
                 "create a channel for VM NAME (repeatable; adds to the "
                 "config's [[vm]] list), socket SOCKET_DIR/NAME.sock");
  app.add_option("--socket-dir", socket_dir, "directory for channel sockets");
  app.add_option("--memory-cap", memory_cap, "host memory cap, e.g. 2GiB");
  app.add_option("--log-level", log_level, "debug|info|warn|error");
  app.add_option("--log-format", log_format, "text|json");
  app.add_option("--stats-interval", stats_interval,
                 "log statistics every N seconds (0: only at exit)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  TmemdConfig config;
  if (!config_path.empty()) {
    absl::StatusOr<TmemdConfig> loaded = LoadConfigFile(config_path, config);
    if (!loaded.ok()) {
      Log(LogLevel::kError, "config_error",
          {{"error", loaded.status().message()}});
      return 2;
    }
    config = *loaded;
  }
  for (const std::string& name : vm_names) config.vms.push_back({name, {}});
  if (!socket_dir.empty()) config.socket_dir = socket_dir;
  if (!memory_cap.empty()) {
    absl::StatusOr<uint64_t> cap = ParseSize(memory_cap);
    if (!cap.ok()) {
      Log(LogLevel::kError, "config_error",
          {{"flag", "--memory-cap"}, {"error", cap.status().message()}});
      return 2;
    }
    config.store.memory_cap_bytes = *cap;
  }
  if (!log_level.empty() && !ParseLogLevel(log_level, &config.log_level)) {
    Log(LogLevel::kError, "config_error",
        {{"flag", "--log-level"}, {"error", "use debug, info, warn or error"}});
    return 2;
  }
  if (log_format == "json") config.log_format = LogFormat::kJson;
  if (log_format == "text") config.log_format = LogFormat::kText;
  if (!log_format.empty() && log_format != "json" && log_format != "text") {
    Log(LogLevel::kError, "config_error",
        {{"flag", "--log-format"}, {"error", "use text or json"}});
    return 2;
  }
  if (stats_interval >= 0) config.stats_interval_seconds = stats_interval;
  SetLogLevel(config.log_level);
  SetLogFormat(config.log_format);
  if (absl::Status s = ValidateConfig(config); !s.ok()) {
    Log(LogLevel::kError, "config_error", {{"error", s.message()}});
    return 2;
  }
  if (config.vms.empty()) {
    Log(LogLevel::kWarn, "no_vms",
        {{"hint",
          "no [[vm]] in the config and no --vm flag: serving nothing"}});
  }

  std::optional<gid_t> group;
  if (config.socket_group) {
    absl::StatusOr<gid_t> gid = ResolveGroup(*config.socket_group);
    if (!gid.ok()) {
      Log(LogLevel::kError, "config_error",
          {{"error", gid.status().message()}});
      return 2;
    }
    group = *gid;
  }
  if (mkdir(config.socket_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    Log(LogLevel::kError, "socket_dir_error",
        {{"dir", config.socket_dir},
         {"error", std::generic_category().message(errno)}});
    return 1;
  }

  // Signals are taken synchronously by this thread; block them before any
  // other thread exists so none of them is picked to run a handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a vanished client must not kill us

  absl::StatusOr<std::unique_ptr<TmemStore>> store =
      TmemStore::Create(config.store);
  if (!store.ok()) {
    Log(LogLevel::kError, "store_error", {{"error", store.status().message()}});
    return 1;
  }
  // Distinct across restarts, so guests notice a new tmemd.
  const auto host_generation = static_cast<uint64_t>(
      std::chrono::system_clock::now().time_since_epoch().count());

  std::vector<std::unique_ptr<Channel>> channels;
  for (const VmConfig& vm : config.vms) {
    ChannelOptions opts;
    opts.vm_name = vm.name;
    opts.policy = vm.policy;
    opts.region_bytes = config.region_bytes;
    opts.ring_entries = config.ring_entries;
    opts.server.socket_path =
        absl::StrCat(config.socket_dir, "/", vm.name, ".sock");
    opts.server.vectors = config.vectors;
    opts.server.socket_mode = config.socket_mode;
    opts.server.socket_group = group;
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        Channel::Create(opts, store->get(), host_generation);
    if (!ch.ok()) {
      Log(LogLevel::kError, "channel_error",
          {{"vm", vm.name}, {"error", ch.status().message()}});
      return 1;
    }
    Log(LogLevel::kInfo, "channel_created",
        {{"vm", vm.name},
         {"socket", opts.server.socket_path},
         {"region_bytes", opts.region_bytes},
         {"slots", (*ch)->region().layout().slot_count},
         {"ring_entries", opts.ring_entries}});
    channels.push_back(std::move(*ch));
  }

  Worker worker(config.worker);
  if (absl::Status s = worker.Start(); !s.ok()) {
    Log(LogLevel::kError, "worker_error", {{"error", s.message()}});
    return 1;
  }
  for (auto& ch : channels) worker.AddChannel(ch.get());
  Log(LogLevel::kInfo, "tmemd_ready",
      {{"vms", static_cast<uint64_t>(channels.size())},
       {"memory_cap", config.store.memory_cap_bytes},
       {"pid", static_cast<int64_t>(getpid())}});

  for (;;) {
    int sig = 0;
    if (config.stats_interval_seconds > 0) {
      timespec ts{config.stats_interval_seconds, 0};
      sig = sigtimedwait(&signals, nullptr, &ts);
      if (sig < 0) {
        if (errno == EAGAIN) LogStats(**store, channels, "stats");
        continue;
      }
    } else if (sigwait(&signals, &sig) != 0) {
      continue;
    }
    Log(LogLevel::kInfo, "shutdown", {{"signal", sig}});
    break;
  }
  worker.Stop();
  LogStats(**store, channels, "final_stats");
  channels.clear();  // unlinks sockets, forgets VMs
  Log(LogLevel::kInfo, "tmemd_stopped");
  return 0;
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
