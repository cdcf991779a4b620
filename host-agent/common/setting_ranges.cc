#include "host-agent/common/setting_ranges.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

template <typename T>
absl::Status OutOfRange(std::string_view name, T lo, T hi,
                        const std::string& got, std::string_view source) {
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(source), ": ", std::string(name),
                   " must be in [", lo, ", ", hi, "], got ", got));
}

}  // namespace

absl::Status CheckRange(const IntRange& range, int64_t value,
                        std::string_view source) {
  if (value < range.lo || value > range.hi) {
    return OutOfRange(range.name, range.lo, range.hi, absl::StrCat(value),
                      source);
  }
  return absl::OkStatus();
}

absl::Status CheckRange(const IntRange& range, uint64_t value,
                        std::string_view source) {
  if (value > static_cast<uint64_t>(INT64_MAX)) {
    return OutOfRange(range.name, range.lo, range.hi, absl::StrCat(value),
                      source);
  }
  return CheckRange(range, static_cast<int64_t>(value), source);
}

absl::Status CheckRange(const DoubleRange& range, double value,
                        std::string_view source) {
  if (!std::isfinite(value) || !(value >= range.lo && value <= range.hi)) {
    return OutOfRange(range.name, range.lo, range.hi, absl::StrCat(value),
                      source);
  }
  return absl::OkStatus();
}

}  // namespace tmem
