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

}  // namespace tmem
