// ParseSize: a byte count written by a person, as tmemd's config, its flags,
// policy files and tmemctl accept it.
//
// "4096", "4KiB", "4 MiB", "1GiB", "1G" (binary units: K, M, G, T with an
// optional "iB" or "B"; case and surrounding spaces ignored). Anything else,
// and a value that does not fit in 64 bits, is INVALID_ARGUMENT naming the
// offending text. Pure function; thread-safe.
#ifndef TMEMD_HOST_AGENT_COMMON_SIZE_TEXT_H_
#define TMEMD_HOST_AGENT_COMMON_SIZE_TEXT_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace tmem {

absl::StatusOr<uint64_t> ParseSize(std::string_view text);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_COMMON_SIZE_TEXT_H_
