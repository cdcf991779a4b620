#include "host-agent/channel/channel_metrics.h"

namespace tmem {

std::string_view ChannelCounterName(ChannelCounter c) {
  switch (c) {
    case ChannelCounter::kClientsAccepted:
      return "clients_accepted";
    case ChannelCounter::kClientsRejectedBusy:
      return "clients_rejected_busy";
    case ChannelCounter::kHandshakeFailures:
      return "handshake_failures";
    case ChannelCounter::kClientDisconnects:
      return "client_disconnects";
    case ChannelCounter::kClientGarbage:
      return "client_garbage";
    case ChannelCounter::kSqeProcessed:
      return "sqe_processed";
    case ChannelCounter::kSqeBadOpcode:
      return "sqe_bad_opcode";
    case ChannelCounter::kSqeBadPool:
      return "sqe_bad_pool";
    case ChannelCounter::kSqeBadSlot:
      return "sqe_bad_slot";
    case ChannelCounter::kSqeBadFlags:
      return "sqe_bad_flags";
    case ChannelCounter::kSqeStoreErrors:
      return "sqe_store_errors";
    case ChannelCounter::kCqeWritten:
      return "cqe_written";
    case ChannelCounter::kPutsDroppedByHost:
      return "puts_dropped_by_host";
    case ChannelCounter::kGetBatches:
      return "get_batches";
    case ChannelCounter::kGetBatchPages:
      return "get_batch_pages";
    case ChannelCounter::kGetBatchHits:
      return "get_batch_hits";
    case ChannelCounter::kGetBatchBadCount:
      return "get_batch_bad_count";
    case ChannelCounter::kGetBatchBadSlots:
      return "get_batch_bad_slots";
    case ChannelCounter::kGetBatchSharedPool:
      return "get_batch_shared_pool";
    case ChannelCounter::kRingCorruptIndex:
      return "ring_corrupt_index";
    case ChannelCounter::kChannelResets:
      return "channel_resets";
    case ChannelCounter::kGuestRestarts:
      return "guest_restarts";
    case ChannelCounter::kRegionForeign:
      return "region_foreign";
    case ChannelCounter::kFlushBarriers:
      return "flush_barriers";
    case ChannelCounter::kDoorbells:
      return "doorbells";
    case ChannelCounter::kInterruptsSent:
      return "interrupts_sent";
    case ChannelCounter::kPollRounds:
      return "poll_rounds";
    case ChannelCounter::kPutsCompressionDeferred:
      return "puts_compression_deferred";
    case ChannelCounter::kRestoredAcrossRestart:
      return "restored_across_restart";
    case ChannelCounter::kForeignRegions:
      return "foreign_regions";
    case ChannelCounter::kAcceptBackoffs:
      return "accept_backoffs";
    case ChannelCounter::kAcceptsFromReserve:
      return "accepts_from_reserve";
    case ChannelCounter::kNumCounters:
      break;
  }
  return "unknown";
}

}  // namespace tmem
