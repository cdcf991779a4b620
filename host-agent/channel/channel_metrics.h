// ChannelMetrics: one counter per failure path (and per op) of a VM's
// channel: handshake, ring consumer, doorbells. Relaxed atomics; any thread
// may bump or read. Names are stable: they become gRPC/Prometheus fields.
#ifndef TMEMD_HOST_AGENT_CHANNEL_CHANNEL_METRICS_H_
#define TMEMD_HOST_AGENT_CHANNEL_CHANNEL_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace tmem {

enum class ChannelCounter : int {
  // Connection / handshake (IvshmemServer).
  kClientsAccepted = 0,
  kClientsRejectedBusy,  // a second client while one is connected
  kHandshakeFailures,    // sendmsg failed or would block: client dropped
  kClientDisconnects,
  kClientGarbage,  // the client sent bytes (QEMU never does)
  // Ring consumer: entries.
  kSqeProcessed,
  kSqeBadOpcode,
  kSqeBadPool,      // pool id out of range or not created
  kSqeBadSlot,      // slot index >= slot_count
  kSqeBadFlags,     // unknown flag bits or nonzero reserved bytes
  kSqeStoreErrors,  // the store returned an error status
  kCqeWritten,
  kPutsDroppedByHost,        // completed with TMEM_ERR_DROPPED
  kPutsCompressionDeferred,  // stored raw, compression queued: other VMs
                             // were waiting on the worker (TurnScheduler)
  // GET_BATCH (ABI v2): work done, and one counter per refusal.
  kGetBatches,          // GET_BATCH entries executed
  kGetBatchPages,       // pages they asked for
  kGetBatchHits,        // of which hits
  kGetBatchBadCount,    // count 0 or > TMEM_GET_BATCH_MAX, or indices wrap
  kGetBatchBadSlots,    // slot + count > slot_count
  kGetBatchSharedPool,  // on a shared pool (hits there are not exclusive)
  // Ring consumer: whole-ring faults.
  kRingCorruptIndex,  // tail - head > entries, or head moved backwards
  kChannelResets,     // host reset the channel (any reason)
  kGuestRestarts,     // guest_generation changed
  kRegionForeign,     // header's host_generation not the one tmemd wrote
                      // (a region migrated in from another host): reset
  kFlushBarriers,     // flush_request applied
  // Doorbells and interrupts.
  kDoorbells,  // eventfd wakeups from the guest
  kInterruptsSent,
  kPollRounds,  // drains found work without a doorbell
  // Operations (restart, upgrade, migration).
  kRestoredAcrossRestart,  // channel taken over from a previous tmemd
  kForeignRegions,         // header held another host's generation (migration)
  // Descriptors.
  kAcceptBackoffs,      // accept failed (out of descriptors): socket disarmed
  kAcceptsFromReserve,  // a queued guest let in by the spare descriptors
  kNumCounters,
};
inline constexpr int kNumChannelCounters =
    static_cast<int>(ChannelCounter::kNumCounters);

std::string_view ChannelCounterName(ChannelCounter c);

class ChannelMetrics {
 public:
  void Inc(ChannelCounter c, uint64_t n = 1) {
    values_[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t Get(ChannelCounter c) const {
    return values_[static_cast<int>(c)].load(std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<uint64_t>, kNumChannelCounters> values_{};
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_CHANNEL_METRICS_H_
