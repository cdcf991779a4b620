// FleetPolicy: the layout and value format of fleet policy in etcd
// (docs/fleet.md), and how one host resolves it.
//
// Keys (PREFIX = /tmemd/v1/policy/):
//   PREFIX fleet            every host
//   PREFIX groups/<group>   hosts that list <group> in [fleet] groups
//   PREFIX hosts/<host>     one host
//   PREFIX vms/<vm>         one VM, on whichever host runs it
// Values are JSON objects {"version": 1, "host": {...}, "vm": {...}}:
//   host: memory_cap_bytes (int), cpu_budget_percent (number),
//         mode ("off" | "always" | "adaptive")
//   vm:   quota_bytes (int, 0: unlimited), weight (int),
//         mode ("default" | "off" | "always" | "adaptive"),
//         enabled (bool), frozen (bool),
//         swap_quota_bytes (int, 0: unlimited; the part of the quota swap
//         pages may take, past it they go to the spill image),
//         swap_mode ("default" | "off" | "always" | "adaptive"; default
//         follows mode, off sends every swap page to the spill image)
// A vms/<vm> value has no "host" section. Every field is optional; unknown
// fields, wrong types and out-of-range values are refused with the key and
// field named, using tmemd's own ranges (setting_ranges.h). Most specific
// wins, field by field: fleet < groups (in the host's configured order) <
// hosts/<host> < vms/<vm>. A field no layer sets leaves the host's own
// value alone.
//
// Pure logic: no I/O, no etcd. Thread-compatible.
#ifndef TMEMD_HOST_AGENT_FLEET_FLEET_POLICY_H_
#define TMEMD_HOST_AGENT_FLEET_FLEET_POLICY_H_

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "host-agent/control/policy_set.h"
#include "proto/tmem/v1/control.pb.h"

namespace tmem {

inline constexpr char kFleetPolicyPrefix[] = "/tmemd/v1/policy/";
inline constexpr char kFleetStatusPrefix[] = "/tmemd/v1/status/hosts/";
// Written by `tmemctl fleet apply/rollback` in the same transaction as the
// policy keys: its mod_revision is the fleet's desired revision, and its
// older versions (etcd MVCC) are the history. It lies under the prefix, so
// every watcher sees each apply, even one that changes nothing it reads;
// it is not a policy layer.
inline constexpr char kFleetAppliedKey[] = "/tmemd/v1/policy/applied";
// Written once by each tmemd, without a lease: the hosts `fleet status`
// expects (one registered but without a status key is gone).
inline constexpr char kFleetMembersPrefix[] = "/tmemd/v1/members/";
inline constexpr int kFleetFormatVersion = 1;

// One parsed key: what it says for the host and for VMs.
struct FleetLayer {
  v1::SetHostPolicyRequest host;  // unset fields: not said by this layer
  v1::SetVmPolicyRequest vm;      // vm name unused
  friend bool operator==(const FleetLayer& a, const FleetLayer& b);
};

// Keys and values in etcd are bytes. The offset of the first byte of `s`
// that is not (shortest-form, non-surrogate) UTF-8, if any.
std::optional<size_t> InvalidUtf8Offset(std::string_view s);
// A key as messages show it: printable ASCII kept, every other byte
// escaped (\xff), so a reason is always printable text and valid JSON.
std::string FleetKeyText(std::string_view key);

// "fleet", "groups/<g>", "hosts/<h>" or "vms/<vm>" after the prefix;
// INVALID_ARGUMENT for anything else (names follow ValidateVmName's rule),
// the key shown escaped (FleetKeyText).
absl::Status CheckFleetKey(const std::string& key);

// Parses one value; errors name the key.
absl::StatusOr<FleetLayer> ParseFleetLayer(const std::string& key,
                                           const std::string& value);
// The JSON text of a layer (what tmemctl writes).
std::string FormatFleetLayer(const FleetLayer& layer);

// Resolves the keys relevant to `host` (in `groups`) from all keys under
// the prefix (full key -> value) into what this host applies: the merged
// host fields, the merged defaults for its VMs, and each VM's override (all
// vms/<vm> keys: a VM may arrive here later). The first invalid relevant
// key makes it fail with its reason; keys meant for other hosts and groups
// are not read.
absl::StatusOr<PolicySet> ResolveFleetPolicy(
    const std::map<std::string, std::string>& keys, const std::string& host,
    const std::vector<std::string>& groups);

// Whether `host` keeps a key under the prefix in its view: the keys that
// concern it, and every key outside the layout (kFleetAppliedKey aside),
// which it refuses for as long as the key exists rather than ignoring it.
bool FleetKeyKept(const std::string& key, const std::string& host,
                  const std::vector<std::string>& groups);

// Whether a key (full) can change what `host` resolves.
bool FleetKeyConcernsHost(const std::string& key, const std::string& host,
                          const std::vector<std::string>& groups);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_FLEET_FLEET_POLICY_H_
