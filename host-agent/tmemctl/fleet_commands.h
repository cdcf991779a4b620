// `tmemctl fleet ...`: fleet policy in etcd (docs/fleet.md).
//
//   apply FILE [--dry-run]  the whole desired policy, validated with
//                           tmemd's rules, written in one etcd Txn (guarded
//                           by the previous apply's revision) that also
//                           deletes keys FILE no longer has
//   status                  each host: converged / lagging / rejected / gone
//   history                 past applies (versions of the applied key)
//   rollback REV            apply the policy as it was at revision REV
//
// Exit codes: 0 success (status: every host converged), 1 error, 3 status
// found a host that is not converged (or no host at all).
#ifndef TMEMD_HOST_AGENT_TMEMCTL_FLEET_COMMANDS_H_
#define TMEMD_HOST_AGENT_TMEMCTL_FLEET_COMMANDS_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tmem {

inline constexpr int kFleetNotConverged = 3;

struct FleetCliOptions {
  std::vector<std::string> endpoints;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  std::string command;  // apply, status, history, rollback
  std::string file;
  bool dry_run = false;
  int64_t revision = 0;
  bool json = false;
};

// FILE: {"fleet": {...}, "groups": {"g": {...}}, "hosts": {"h": {...}},
// "vms": {"v": {...}}} -> full key -> value text, each value checked by
// ParseFleetLayer ("version" may be left out). Errors name the file.
absl::StatusOr<std::map<std::string, std::string>> ParseFleetFile(
    const std::string& text, const std::string& source);

int RunFleetCommand(const FleetCliOptions& options, std::ostream& out,
                    std::ostream& err);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_TMEMCTL_FLEET_COMMANDS_H_
