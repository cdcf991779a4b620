#include "backend/memory_sample.h"

#include "backend/stats.h"
#include "backend/tmem_store.h"

namespace tmem {

MemorySample SampleStoreMemory(const TmemStore& store) {
  MemorySample sample;
  const HostStats host = store.GetHostStats();
  sample.cap_bytes = host.memory_cap_bytes;
  sample.used_bytes = host.memory_used_bytes;
  for (const VmId vm : store.ListVms()) {
    // A VM forgotten since ListVms is simply left out.
    absl::StatusOr<VmStats> stats = store.GetVmStats(vm);
    if (!stats.ok()) continue;
    sample.vms[vm] = VmMemoryUse{
        .pages_held = stats->counters[static_cast<int>(Counter::kPagesHeld)],
        .charged_bytes =
            stats->counters[static_cast<int>(Counter::kChargedBytes)]};
  }
  return sample;
}

}  // namespace tmem
