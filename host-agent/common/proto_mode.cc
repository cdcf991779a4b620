#include "host-agent/common/proto_mode.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

absl::Status NotAMode(std::string_view source, std::string_view what,
                      DefaultMode default_mode) {
  return absl::InvalidArgumentError(absl::StrCat(
      std::string(source), ": ", std::string(what), " is not a mode: use ",
      default_mode == DefaultMode::kAllowed ? "default, " : "",
      "off, always or adaptive"));
}

}  // namespace

v1::Mode ProtoMode(ValveMode mode) {
  switch (mode) {
    case ValveMode::kDefault:
      return v1::MODE_DEFAULT;
    case ValveMode::kOff:
      return v1::MODE_OFF;
    case ValveMode::kAlways:
      return v1::MODE_ALWAYS;
    case ValveMode::kAdaptive:
      return v1::MODE_ADAPTIVE;
  }
  // Only a corrupted ValveMode gets here; UNSPECIFIED changes nothing.
  return v1::MODE_UNSPECIFIED;
}

absl::StatusOr<ValveMode> ValveModeFromProto(v1::Mode mode,
                                             DefaultMode default_mode,
                                             std::string_view source) {
  switch (mode) {
    case v1::MODE_DEFAULT:
      if (default_mode == DefaultMode::kAllowed) return ValveMode::kDefault;
      break;
    case v1::MODE_OFF:
      return ValveMode::kOff;
    case v1::MODE_ALWAYS:
      return ValveMode::kAlways;
    case v1::MODE_ADAPTIVE:
      return ValveMode::kAdaptive;
    default:
      break;
  }
  const std::string name = ProtoModeText(mode);
  return NotAMode(
      source,
      absl::StrCat("mode value ", static_cast<int>(mode),
                   name == "-" ? "" : absl::StrCat(" (", name, ")")),
      default_mode);
}

absl::StatusOr<v1::Mode> ProtoModeFromText(std::string_view text,
                                           DefaultMode default_mode,
                                           std::string_view source) {
  ValveMode mode = ValveMode::kDefault;
  if (ParseValveMode(text, &mode) &&
      (mode != ValveMode::kDefault || default_mode == DefaultMode::kAllowed)) {
    return ProtoMode(mode);
  }
  return NotAMode(source, absl::StrCat("'", std::string(text), "'"),
                  default_mode);
}

std::string ProtoModeText(v1::Mode mode) {
  switch (mode) {
    case v1::MODE_DEFAULT:
      return std::string(ValveModeName(ValveMode::kDefault));
    case v1::MODE_OFF:
      return std::string(ValveModeName(ValveMode::kOff));
    case v1::MODE_ALWAYS:
      return std::string(ValveModeName(ValveMode::kAlways));
    case v1::MODE_ADAPTIVE:
      return std::string(ValveModeName(ValveMode::kAdaptive));
    default:
      return "-";
  }
}

}  // namespace tmem
