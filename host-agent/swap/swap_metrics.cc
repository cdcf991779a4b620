#include "host-agent/swap/swap_metrics.h"

namespace tmem::swap {

std::string_view SwapCounterName(SwapCounter c) {
  switch (c) {
    case SwapCounter::kClientsAccepted:
      return "clients_accepted";
    case SwapCounter::kClientsRejectedBusy:
      return "clients_rejected_busy";
    case SwapCounter::kClientDisconnects:
      return "client_disconnects";
    case SwapCounter::kSessionResets:
      return "session_resets";
    case SwapCounter::kMessages:
      return "messages";
    case SwapCounter::kMessagesMalformed:
      return "messages_malformed";
    case SwapCounter::kMessagesUnsupported:
      return "messages_unsupported";
    case SwapCounter::kMessagesRefused:
      return "messages_refused";
    case SwapCounter::kFeaturesRefused:
      return "features_refused";
    case SwapCounter::kMemTablesMapped:
      return "mem_tables_mapped";
    case SwapCounter::kMemTablesRefused:
      return "mem_tables_refused";
    case SwapCounter::kVringSetupRefused:
      return "vring_setup_refused";
    case SwapCounter::kConfigReads:
      return "config_reads";
    case SwapCounter::kConfigWritesRefused:
      return "config_writes_refused";
    case SwapCounter::kKicks:
      return "kicks";
    case SwapCounter::kCalls:
      return "calls";
    case SwapCounter::kCallsSuppressed:
      return "calls_suppressed";
    case SwapCounter::kQueueCorruptIndex:
      return "queue_corrupt_index";
    case SwapCounter::kChainHeadOutOfRange:
      return "chain_head_out_of_range";
    case SwapCounter::kChainNextOutOfRange:
      return "chain_next_out_of_range";
    case SwapCounter::kChainTooLong:
      return "chain_too_long";
    case SwapCounter::kChainIndirectRefused:
      return "chain_indirect_refused";
    case SwapCounter::kChainOutOfMemory:
      return "chain_out_of_memory";
    case SwapCounter::kChainBadOrder:
      return "chain_bad_order";
    case SwapCounter::kChainTooLarge:
      return "chain_too_large";
    case SwapCounter::kQueuesBroken:
      return "queues_broken";
    case SwapCounter::kRequests:
      return "requests";
    case SwapCounter::kReads:
      return "reads";
    case SwapCounter::kWrites:
      return "writes";
    case SwapCounter::kFlushes:
      return "flushes";
    case SwapCounter::kGetIds:
      return "get_ids";
    case SwapCounter::kDiscards:
      return "discards";
    case SwapCounter::kWriteZeroes:
      return "write_zeroes";
    case SwapCounter::kBytesRead:
      return "bytes_read";
    case SwapCounter::kBytesWritten:
      return "bytes_written";
    case SwapCounter::kRequestsUnsupported:
      return "requests_unsupported";
    case SwapCounter::kRequestsBadLayout:
      return "requests_bad_layout";
    case SwapCounter::kRequestsOutOfRange:
      return "requests_out_of_range";
    case SwapCounter::kRequestsUnaligned:
      return "requests_unaligned";
    case SwapCounter::kRequestsNoStatus:
      return "requests_no_status";
    case SwapCounter::kPartialPageRmw:
      return "partial_page_rmw";
    case SwapCounter::kBackingErrors:
      return "backing_errors";
    case SwapCounter::kNumCounters:
      break;
  }
  return "unknown";
}

}  // namespace tmem::swap
