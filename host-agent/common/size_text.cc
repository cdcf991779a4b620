#include "host-agent/common/size_text.h"

#include <cctype>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tmem {

absl::StatusOr<uint64_t> ParseSize(std::string_view text_view) {
  // Debian's abseil has its own string_view type; work in absl's.
  const absl::string_view text(text_view.data(), text_view.size());
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < s.size() &&
         std::isdigit(static_cast<unsigned char>(s[digits]))) {
    ++digits;
  }
  uint64_t value = 0;
  if (digits == 0 || !absl::SimpleAtoi(s.substr(0, digits), &value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a size (examples: 4096, 64MiB, 2GiB)"));
  }
  std::string unit =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(digits)));
  int shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    shift = 10;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    shift = 20;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    shift = 30;
  } else if (unit == "t" || unit == "tib" || unit == "tb") {
    shift = 40;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "': unknown size unit '", unit,
                     "' (use KiB, MiB, GiB, TiB)"));
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is too large"));
  }
  return value << shift;
}

}  // namespace tmem
