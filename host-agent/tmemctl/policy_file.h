// Declarative policy files for `tmemctl policy apply FILE`.
//
// TOML (or JSON with the same shape: {"host": {...}, "vm": [{...}]}):
//   [host]
//   generation = 7            # optional; 0 or absent: the next one
//   memory_cap = "2GiB"
//   cpu_budget_percent = 30
//   mode = "adaptive"         # off | always | adaptive
//   [[vm]]
//   name = "web1"
//   generation = 3
//   quota = "512MiB"          # or "unlimited"
//   weight = 200
//   mode = "default"          # default | off | always | adaptive
//   enabled = true
//   frozen = false
//   swap_quota = "256MiB"     # or "unlimited": swap pages' part of quota
//   swap_mode = "off"         # default (follows mode) | off | always |
//                             # adaptive; off: every swap page to the image
// Every key is optional except a VM's name; unknown keys are errors, like
// tmemd's own config. Values are checked here (types, sizes, modes, weight
// range) so a typo fails before anything is sent; tmemd checks again.
#ifndef TMEMD_HOST_AGENT_TMEMCTL_POLICY_FILE_H_
#define TMEMD_HOST_AGENT_TMEMCTL_POLICY_FILE_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/tmem/v1/control.pb.h"

namespace tmem {

struct PolicyFile {
  std::optional<v1::SetHostPolicyRequest> host;
  std::vector<v1::SetVmPolicyRequest> vms;
};

// `source_name` names the file in error messages; JSON when the text starts
// with '{', TOML otherwise.
absl::StatusOr<PolicyFile> ParsePolicyFile(std::string_view text,
                                           std::string_view source_name);
absl::StatusOr<PolicyFile> LoadPolicyFile(const std::string& path);

// "512MiB", "0", "unlimited" (0: unlimited).
absl::StatusOr<uint64_t> ParseQuota(std::string_view text);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_TMEMCTL_POLICY_FILE_H_
