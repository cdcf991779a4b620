#include "backend/stats.h"

namespace tmem {

std::string_view CounterName(Counter c) {
  switch (c) {
    case Counter::kPutsCompressed:
      return "puts_compressed";
    case Counter::kPutsRaw:
      return "puts_raw";
    case Counter::kPutsZero:
      return "puts_zero";
    case Counter::kPutsSameFilled:
      return "puts_same_filled";
    case Counter::kPutsRefusedQuota:
      return "puts_refused_quota";
    case Counter::kPutsRefusedPoorCompression:
      return "puts_refused_poor_compression";
    case Counter::kPutsRefusedNoMemory:
      return "puts_refused_no_memory";
    case Counter::kPutsRefusedPolicy:
      return "puts_refused_policy";
    case Counter::kGetsHit:
      return "gets_hit";
    case Counter::kGetsMiss:
      return "gets_miss";
    case Counter::kInvalidatePage:
      return "invalidate_page_calls";
    case Counter::kInvalidateObject:
      return "invalidate_object_calls";
    case Counter::kInvalidatePool:
      return "invalidate_pool_calls";
    case Counter::kPagesInvalidated:
      return "pages_invalidated";
    case Counter::kEvictionsHostCap:
      return "evictions_host_cap";
    case Counter::kEvictionsQuota:
      return "evictions_quota";
    case Counter::kPagesHeld:
      return "pages_held";
    case Counter::kStoredBytes:
      return "stored_bytes";
    case Counter::kChargedBytes:
      return "charged_bytes";
    case Counter::kPersistentPagesHeld:
      return "persistent_pages_held";
    case Counter::kPersistentChargedBytes:
      return "persistent_charged_bytes";
    case Counter::kPersistentPutsRefusedForRoom:
      return "persistent_puts_refused_for_room";
    case Counter::kPersistentPutsRefusedForSwapQuota:
      return "persistent_puts_refused_for_swap_quota";
    case Counter::kNumCounters:
      break;
  }
  return "unknown";
}

bool CounterIsGauge(Counter c) {
  return c == Counter::kPagesHeld || c == Counter::kStoredBytes ||
         c == Counter::kChargedBytes || c == Counter::kPersistentPagesHeld ||
         c == Counter::kPersistentChargedBytes;
}

Counter RefusedCounter(RefuseReason reason) {
  return static_cast<Counter>(static_cast<int>(Counter::kPutsRefusedQuota) +
                              static_cast<int>(reason));
}

double CompressionRatio(const CounterValues& v) {
  const uint64_t pages = v[static_cast<int>(Counter::kPagesHeld)];
  // Charged bytes include the per-page metadata charge, so metadata-only
  // (zero, same-filled) pages count what they really cost.
  const uint64_t charged = v[static_cast<int>(Counter::kChargedBytes)];
  if (pages == 0 || charged == 0) return 0.0;
  return static_cast<double>(pages) * 4096.0 / static_cast<double>(charged);
}

}  // namespace tmem
