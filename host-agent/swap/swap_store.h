// SwapStore: what tmemd holds behind one VM's swap device -- the backing
// the device reads and writes, the page statistics the control plane
// shows, and the write-back a graceful stop runs -- and the factory that
// makes one. The agent knows only this interface, so which backing serves
// swap pages (in memory today; the store's persistent pool with a spill
// image beside it) is chosen in one place, tmemd's main, and tests may
// pass their own.
//
// Contract: backing() lives as long as the SwapStore; PageStats() and
// WriteBack() may be called from any thread while the device serves.
// WriteBack() returns once every page written so far would survive this
// process as far as the backing promises (a memory backing promises
// nothing, and returns OK at once).
#ifndef TMEMD_HOST_AGENT_SWAP_SWAP_STORE_H_
#define TMEMD_HOST_AGENT_SWAP_SWAP_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backend/put_advisor.h"
#include "backend/tmem_store.h"
#include "host-agent/swap/swap_backing.h"

namespace tmem::swap {

// Pages as the backing holds them now (gauges), and pages the guest
// discarded (a counter).
struct SwapPageStats {
  uint64_t stored = 0;      // written and not discarded: compressed + raw
  uint64_t compressed = 0;  // of those, held compressed in memory
  uint64_t raw = 0;         // of those, held uncompressed in memory
  uint64_t spilled = 0;     // of those, moved to the spill image on disk
};

class SwapStore {
 public:
  virtual ~SwapStore() = default;
  virtual SwapBacking& backing() = 0;
  virtual SwapPageStats PageStats() const = 0;
  virtual absl::Status WriteBack() = 0;
};

// What a factory is given for one VM's device.
struct SwapStoreRequest {
  std::string vm_name;
  VmId vm = 0;              // the VM's store registration (shared with its
                            // ivshmem channel, if any)
  uint64_t page_count = 0;  // device size / 4096
  TmemStore* store = nullptr;
  PutAdvisor* advisor = nullptr;  // the valve
  std::string state_dir;          // spill images live under STATE_DIR/swap/
};

using SwapStoreFactory =
    std::function<absl::StatusOr<std::unique_ptr<SwapStore>>(
        const SwapStoreRequest&)>;

// Pages in tmemd's own memory (MemorySwapBacking): nothing survives the
// process, nothing is compressed or spilled.
SwapStoreFactory MemorySwapStoreFactory();

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SWAP_STORE_H_
