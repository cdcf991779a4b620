// MemorySample: how the store's memory use reaches the valve.
//
// The valve reads no store. Its caller (tmemd's valve ticker, a test, a
// benchmark) samples memory with SampleStoreMemory and hands the sample to
// Valve::Tick beside the CPU sample, so the valve is pure logic over its
// inputs and the store and the valve do not hold pointers to each other
// (the store still tells the valve about evictions: EvictionListener).
//
// A sample with cap_bytes == 0 says "memory not known": the valve then
// keeps its previous memory verdicts (headroom, each VM's reach).
#ifndef TMEMD_BACKEND_MEMORY_SAMPLE_H_
#define TMEMD_BACKEND_MEMORY_SAMPLE_H_

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "backend/types.h"

namespace tmem {

class TmemStore;

struct VmMemoryUse {
  uint64_t pages_held = 0;
  uint64_t charged_bytes = 0;  // what those pages cost the budget
};

struct MemorySample {
  uint64_t cap_bytes = 0;   // the host cap; 0: not known
  uint64_t used_bytes = 0;  // charged to the budget (blobs and metadata)
  // Per live VM; a VM absent here is taken to hold nothing.
  absl::flat_hash_map<VmId, VmMemoryUse> vms;
};

// The store's cap, use and every live VM's pages and charge. Takes the
// store's locks as GetHostStats/GetVmStats do; call it outside the valve.
MemorySample SampleStoreMemory(const TmemStore& store);

}  // namespace tmem

#endif  // TMEMD_BACKEND_MEMORY_SAMPLE_H_
