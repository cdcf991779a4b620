// ValidateVmName: the one rule for a VM's name, which names its socket file
// (SOCKET_DIR/NAME.sock) and is typed on tmemctl's command line.
//
// 1-64 of [A-Za-z0-9._-], starting with a letter or digit (not '.', which
// hides the file, nor '-', which reads as a flag). INVALID_ARGUMENT stating
// the rule otherwise. Pure function; thread-safe.
#ifndef TMEMD_HOST_AGENT_COMMON_VM_NAME_H_
#define TMEMD_HOST_AGENT_COMMON_VM_NAME_H_

#include <string_view>

#include "absl/status/status.h"

namespace tmem {

absl::Status ValidateVmName(std::string_view name);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_COMMON_VM_NAME_H_
