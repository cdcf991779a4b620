// SwapMetrics: one counter per operation and per failure path of a VM's
// swap device (vhost-user connection, virtqueues, virtio-blk requests,
// backing store). Relaxed atomics; any thread may bump or read. Names are
// stable: they become gRPC/Prometheus fields.
#ifndef TMEMD_HOST_AGENT_SWAP_SWAP_METRICS_H_
#define TMEMD_HOST_AGENT_SWAP_SWAP_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace tmem::swap {

enum class SwapCounter : int {
  // Connection.
  kClientsAccepted = 0,
  kClientsRejectedBusy,  // a second front-end while one is connected
  kClientDisconnects,
  kSessionResets,  // connection dropped by us after a protocol error
  // vhost-user messages.
  kMessages,
  kMessagesMalformed,    // framing, size or fd count wrong
  kMessagesUnsupported,  // a request code we do not serve
  kMessagesRefused,      // well formed, but the values are not acceptable
  kFeaturesRefused,      // SET_FEATURES / SET_PROTOCOL_FEATURES outside offer
  kMemTablesMapped,
  kMemTablesRefused,   // validation, fstat or mmap failed
  kVringSetupRefused,  // bad index, size, or ring addresses
  kConfigReads,
  kConfigWritesRefused,  // SET_CONFIG (the config space is read-only)
  // Virtqueues.
  kKicks,
  kCalls,
  kCallsSuppressed,    // the driver asked for no interrupt (EVENT_IDX)
  kQueueCorruptIndex,  // avail->idx ran more than a queue ahead
  kChainHeadOutOfRange,
  kChainNextOutOfRange,
  kChainTooLong,          // a loop, or longer than the table
  kChainIndirectRefused,  // not negotiated, with NEXT, nested, bad length
  kChainOutOfMemory,      // a buffer or table outside guest memory
  kChainBadOrder,         // device-readable after device-writable
  kChainTooLarge,
  kQueuesBroken,  // a queue stopped after one of the faults above
  // virtio-blk requests.
  kRequests,
  kReads,
  kWrites,
  kFlushes,
  kGetIds,
  kDiscards,
  kWriteZeroes,
  kBytesRead,
  kBytesWritten,
  kRequestsUnsupported,  // unknown type: VIRTIO_BLK_S_UNSUPP
  kRequestsBadLayout,    // header short, no status byte, wrong direction
  kRequestsOutOfRange,   // sectors beyond the capacity
  kRequestsUnaligned,    // data not a whole number of sectors
  kRequestsNoStatus,     // no writable byte: completed with length 0
  kPartialPageRmw,       // partial pages read-modify-written
  kBackingErrors,        // the store failed a request: VIRTIO_BLK_S_IOERR
  kNumCounters,
};
inline constexpr int kNumSwapCounters =
    static_cast<int>(SwapCounter::kNumCounters);

std::string_view SwapCounterName(SwapCounter c);

class SwapMetrics {
 public:
  void Inc(SwapCounter c, uint64_t n = 1) {
    values_[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t Get(SwapCounter c) const {
    return values_[static_cast<int>(c)].load(std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<uint64_t>, kNumSwapCounters> values_{};
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SWAP_METRICS_H_
