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
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/put_advisor.h"
#include "backend/tmem_store.h"
#include "host-agent/swap/spill_image.h"
#include "host-agent/swap/swap_backing.h"

namespace tmem::swap {

// Where the device's pages are now (gauges), how the store took them
// (counters), and the backing's own counters by name.
struct SwapPageStats {
  uint64_t stored = 0;           // pages holding data: in memory + spilled
  uint64_t in_memory = 0;        // in the store (the VM's persistent pool)
  uint64_t memory_bytes = 0;     // what those take there (compressed or not)
  uint64_t spilled = 0;          // in the spill image on disk
  uint64_t lost = 0;             // a failed write lost them: reads fail
  uint64_t compressed_puts = 0;  // pages the store took compressed
  uint64_t raw_puts = 0;         // pages the store took as written
  std::vector<std::pair<std::string, uint64_t>> counters;
};

class SwapStore {
 public:
  virtual ~SwapStore() = default;
  virtual SwapBacking& backing() = 0;
  virtual SwapPageStats PageStats() const = 0;
  virtual absl::Status WriteBack() = 0;
  // Host pressure (a lowered quota, swap quota or host cap): moves one
  // bounded batch of the pages memory may no longer hold into the spill
  // image, never dropping one; the agent calls it every valve period.
  // Returns the pages moved. A backing with nothing to move returns 0.
  virtual uint64_t RelieveMemory() { return 0; }
};

// What a factory is given for one VM's device.
struct SwapStoreRequest {
  std::string vm_name;
  VmId vm = 0;              // the VM's store registration (shared with its
                            // ivshmem channel, if any)
  uint64_t page_count = 0;  // device size / 4096
  TmemStore* store = nullptr;
  // The valve's swap view (SwapValveAdvisor: how to store, never a drop
  // for reuse).
  PutAdvisor* advisor = nullptr;
  std::string state_dir;  // spill images live under STATE_DIR/swap/
};

using SwapStoreFactory =
    std::function<absl::StatusOr<std::unique_ptr<SwapStore>>(
        const SwapStoreRequest&)>;

// Pages in tmemd's own memory (MemorySwapBacking): nothing survives the
// process, nothing is compressed or spilled. For tests.
SwapStoreFactory MemorySwapStoreFactory();

// tmemd's: TmemSwapBacking in a new persistent pool of the request's VM
// (never evicted; compressed as the valve advises), with the spill image
// STATE_DIR/swap/NAME.img (0600, in directories of mode 0700 it creates)
// for what the quota, the cap or the valve keeps out of memory. An image
// left by an earlier run is the device's content (a restart keeps the
// guest's swap). Destroying the store destroys the pool; the image stays.
//
// The image's in-use mark, STATE_DIR/swap/NAME.img.inuse (0600), exists
// while a tmemd may hold pages of the device in memory: the factory
// creates it (durably) when it opens the image, and WriteBack() removes it
// once every page is in the image. If the factory finds it, the tmemd that
// last served the device stopped without a complete write-back (a crash,
// SIGKILL or failed write-back): the pages it held in memory are gone and
// the image alone is not the device. The factory then refuses the device
// (FAILED_PRECONDITION naming the mark and what to do; counted in
// `refusals` as not_written_back) instead of serving zeros where the guest
// wrote data.
// `refusals` (optional) counts image files refused as hostile, across
// devices; it must outlive every store the factory makes. RelieveMemory
// moves up to kReliefBatchPages pages per call and logs each call that
// moved pages ("swap_relieved") or failed to (rate-limited).
inline constexpr uint64_t kReliefBatchPages = 1024;
SwapStoreFactory TmemSwapStoreFactory(SpillOpenRefusals* refusals = nullptr);

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SWAP_STORE_H_
