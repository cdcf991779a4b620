#include "host-agent/common/vm_name.h"

#include <cctype>
#include <string>

#include "absl/strings/str_cat.h"

namespace tmem {

absl::Status ValidateVmName(std::string_view name) {
  if (name.empty() || name.size() > 64 ||
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQR"
                             "STUVWXYZ0123456789._-") != std::string::npos ||
      !std::isalnum(static_cast<unsigned char>(name[0]))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "VM name '", std::string(name),
        "' must be 1-64 characters of letters, digits, '.', '_' or '-' "
        "(it names the socket file) and start with a letter or digit (not "
        "'.', nor '-' which reads as a flag)"));
  }
  return absl::OkStatus();
}

}  // namespace tmem
