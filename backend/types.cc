#include "backend/types.h"

namespace tmem {

std::string_view StorageKindName(StorageKind kind) {
  switch (kind) {
    case StorageKind::kZero:
      return "zero";
    case StorageKind::kSameFilled:
      return "same_filled";
    case StorageKind::kLz4:
      return "lz4";
    case StorageKind::kRaw:
      return "raw";
  }
  return "unknown";
}

std::string_view RefuseReasonName(RefuseReason reason) {
  switch (reason) {
    case RefuseReason::kQuota:
      return "quota";
    case RefuseReason::kPoorCompression:
      return "poor_compression";
    case RefuseReason::kNoMemory:
      return "no_memory";
    case RefuseReason::kPolicy:
      return "policy";
  }
  return "unknown";
}

std::string_view PoolKindName(PoolKind kind) {
  switch (kind) {
    case PoolKind::kEphemeral:
      return "ephemeral";
    case PoolKind::kPersistent:
      return "persistent";
  }
  return "unknown";
}

std::string_view ValveModeName(ValveMode mode) {
  switch (mode) {
    case ValveMode::kDefault:
      return "default";
    case ValveMode::kOff:
      return "off";
    case ValveMode::kAlways:
      return "always";
    case ValveMode::kAdaptive:
      return "adaptive";
  }
  return "unknown";
}

bool ParseValveMode(std::string_view text, ValveMode* mode) {
  for (ValveMode m : {ValveMode::kDefault, ValveMode::kOff, ValveMode::kAlways,
                      ValveMode::kAdaptive}) {
    if (text == ValveModeName(m)) {
      *mode = m;
      return true;
    }
  }
  return false;
}

}  // namespace tmem
