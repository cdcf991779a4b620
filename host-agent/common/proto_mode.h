// The valve mode in its three spellings, converted in one place:
//   ValveMode (backend/types.h)       what tmemd's valve runs on
//   v1::Mode  (proto tmem.v1)         what the control plane sends
//   text      "default", "off", ...   what people write (tmemctl, policy
//                                     files, fleet policy in etcd)
// v1::MODE_UNSPECIFIED means "leave unchanged" in a request; it is not a
// mode, so callers test for it before converting. A value that is not a
// mode -- an unknown enum number, a misspelling, or "default" where a host
// default is being set (the host default cannot itself defer) -- is
// INVALID_ARGUMENT naming `source` and the accepted values, never mapped to
// a nearby mode. Pure functions; thread-safe.
#ifndef TMEMD_HOST_AGENT_COMMON_PROTO_MODE_H_
#define TMEMD_HOST_AGENT_COMMON_PROTO_MODE_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "backend/types.h"
#include "proto/tmem/v1/control.pb.h"

namespace tmem {

// Whether ValveMode::kDefault ("follow the host") is a valid answer: yes for
// a VM's mode, no for the host's default mode.
enum class DefaultMode : bool { kRefused = false, kAllowed = true };

v1::Mode ProtoMode(ValveMode mode);

absl::StatusOr<ValveMode> ValveModeFromProto(v1::Mode mode,
                                             DefaultMode default_mode,
                                             std::string_view source);

// "off" -> MODE_OFF etc. (the names of ValveModeName, exact case).
absl::StatusOr<v1::Mode> ProtoModeFromText(std::string_view text,
                                           DefaultMode default_mode,
                                           std::string_view source);

// MODE_OFF -> "off" etc.; "-" for MODE_UNSPECIFIED and for a number that is
// not a mode (for display: a reader never gets a mode's name for them).
std::string ProtoModeText(v1::Mode mode);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_COMMON_PROTO_MODE_H_
