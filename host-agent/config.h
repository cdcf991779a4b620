// TmemdConfig: tmemd's settings, from a TOML file and command-line flags.
//
// Every setting has a default that works on a developer machine; the file
// overrides the defaults and flags override the file. Unknown keys in the
// file are errors (a typo must not silently fall back to a default). Sizes
// accept plain bytes or a suffix: 4096, "512KiB", "4MiB", "2GiB".
// Values are read by their exact TOML type (`true` is not 1, 8.0 is not 8)
// and checked against the one table of ranges (setting_ranges.h) that flags,
// the state file and RPCs use too; errors name the key and FILE:LINE. A
// quota of 0 means unlimited.
//
// Example (host-agent/tmemd.example.toml has every key):
//   [store]
//   memory_cap = "2GiB"
//   [channels]
//   socket_dir = "/run/tmemd"
//   socket_group = "kvm"
//   [valve]
//   mode = "adaptive"          # off | always | adaptive
//   cpu_budget_percent = 25
//   deferred_compression = false # true: adaptive stores raw, compresses idle
//   [libvirt]
//   uri = "qemu:///system"     # enables the libvirt glue
//   [[vm]]
//   name = "web1"
//   quota = "512MiB"
//   weight = 200
//   swap_quota = "256MiB"      # of the quota, at most this in swap pages
//   swap_mode = "default"      # default (= mode)|off|always|adaptive
//   [swap.web1]                # a vhost-user-blk swap device for web1
//   size = "4GiB"              # SOCKET_DIR/web1.swap.sock
//   [swap.db1]                 # a VM with a swap device only: its policy
//   size = "8GiB"              # may be set here (quota, weight, mode,
//   quota = "1GiB"             # swap_quota, swap_mode); a field set in
//   swap_quota = "512MiB"      # both [[vm]] and [swap.NAME] is an error
#ifndef TMEMD_HOST_AGENT_CONFIG_H_
#define TMEMD_HOST_AGENT_CONFIG_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/tmem_store.h"
#include "backend/valve.h"
#include "host-agent/common/size_text.h"  // ParseSize, for config readers
#include "host-agent/common/vm_name.h"    // ValidateVmName
#include "host-agent/log.h"
#include "host-agent/worker.h"

namespace tmem {

// Where a [[vm]] or [swap.NAME] table set each policy field: "'KEY'
// (FILE:LINE)", empty when it did not. A field is set in one place only.
struct PolicySources {
  std::string quota;
  std::string weight;
  std::string enabled;
  std::string mode;
  std::string swap_quota;
  std::string swap_mode;
};

struct VmConfig {
  std::string name;
  VmPolicy policy;
  PolicySources set;  // empty for --vm
};

// [swap.NAME] or --swap NAME=SIZE: VM NAME's swap device (a vhost-user-blk
// back-end, docs/swap-device.md). The VM may have an ivshmem channel too
// ([[vm]] / --vm): both serve the one VM, with one quota.
struct SwapConfig {
  std::string name;
  uint64_t size_bytes = 0;  // > 0, a multiple of 4096
  std::string source;       // "FILE:LINE" or "--swap", for errors
  // Policy fields [swap.NAME] may set (quota, weight, mode, swap_quota,
  // swap_mode), for a VM with no [[vm]]; fields `set` does not name keep
  // their defaults. ConfiguredVmPolicy combines them with a [[vm]]'s.
  VmPolicy policy;
  PolicySources set;  // empty for --swap
};

// Parses --swap's NAME=SIZE; errors name the flag and the text.
absl::StatusOr<SwapConfig> ParseSwapFlag(std::string_view text);

// [control]: the gRPC control plane and the metrics endpoint.
struct ControlConfig {
  // Admin UNIX socket (mode 0600). Unset: SOCKET_DIR/control.sock; "" turns
  // the socket off.
  std::optional<std::string> socket;
  std::string readonly_socket;  // mode 0666, read-only RPCs; "" for none
  std::string tcp_address;      // "host:port" with mTLS; "" for none
  std::string tls_cert;         // PEM paths, required with tcp_address
  std::string tls_key;
  std::string tls_ca;              // CA that signs client certificates
  std::vector<std::string> admin;  // client certificate CNs/SANs with admin
  std::string state_file;          // policies survive restarts; "": memory
  int metrics_port = -1;           // Prometheus /metrics; -1: off, 0: any
  std::string metrics_address = "127.0.0.1";
  // Open connections per gRPC listener: the world-accessible read-only
  // socket far below the admin one (control_acceptor.h); the descriptor
  // budget may lower them (descriptor_budget.h).
  int max_admin_connections = 64;
  int max_readonly_connections = 8;
  int max_tcp_connections = 32;
  // Guest channels whose descriptors no control connection may take.
  int reserved_vm_channels = 64;
};

// [libvirt]: off unless asked (a `uri`, `enabled = true`, or the
// --libvirt-uri flag).
struct LibvirtConfig {
  bool enabled = false;
  std::string uri = "qemu:///system";
  int detach_timeout_seconds = 30;  // a guest that never acks an unplug
};

// [fleet]: policy from etcd (docs/fleet.md); off unless
// `endpoints` is set.
struct FleetConfig {
  std::vector<std::string> endpoints;  // "host:port"
  std::string host;                    // "": the machine's hostname
  std::vector<std::string> groups;     // later ones win
  std::string state_dir;               // fleet-state.json; "": memory only
  std::string tls_cert;                // PEM paths: none, the CA, or all
  std::string tls_key;
  std::string tls_ca;
  int lease_ttl_seconds = 10;  // the status key outlives a dead tmemd by this
  bool enabled() const { return !endpoints.empty(); }
};

struct TmemdConfig {
  StoreOptions store;
  // Channels.
  std::string socket_dir = "/run/tmemd";
  uint64_t region_bytes = uint64_t{4} << 20;
  uint32_t ring_entries = 256;
  int vectors = 1;
  mode_t socket_mode = 0660;
  std::optional<std::string> socket_group;  // group name or numeric gid
  WorkerOptions worker;
  int workers = 0;  // worker threads; 0: one per online CPU
  // Deferred compression is opt-in ([valve] deferred_compression = true, or
  // --deferred-compression=true): it pays a second copy of every page and
  // compaction beside the VMs, and wins only where the cap, not the CPU,
  // limits what is kept (docs/valve.md, "When each mode wins").
  ValveOptions valve{.deferred_compression = false};
  std::vector<VmConfig> vms;
  std::vector<SwapConfig> swap_devices;
  // Files tmemd keeps across restarts: swap spill images under
  // STATE_DIR/swap/ ([store] state_dir, --state-dir).
  std::string state_dir = "/var/lib/tmemd";
  ControlConfig control;
  LibvirtConfig libvirt;
  FleetConfig fleet;
  // Process.
  LogLevel log_level = LogLevel::kInfo;
  LogFormat log_format = LogFormat::kText;
  int stats_interval_seconds = 0;  // 0: stats only at exit
};

// Reads a TOML file over `base` (which holds defaults or earlier settings).
absl::StatusOr<TmemdConfig> LoadConfigFile(const std::string& path,
                                           TmemdConfig base);

// Parses TOML text (for tests and for LoadConfigFile).
absl::StatusOr<TmemdConfig> ParseConfig(std::string_view toml,
                                        std::string_view source_name,
                                        TmemdConfig base);

// Cross-field checks (region size, vectors, VM names unique and safe as
// file names, quota/weight ranges, one swap device per VM, no policy field
// set by both [[vm]] NAME and [swap.NAME]).
absl::Status ValidateConfig(const TmemdConfig& config);

// The policy VM `name` starts with from the configuration: its [[vm]]'s (or
// the defaults if it has none), with the fields its [swap.NAME] sets laid
// over (ValidateConfig made sure no field is set by both).
VmPolicy ConfiguredVmPolicy(const TmemdConfig& config, std::string_view name);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONFIG_H_
