#include "host-agent/control/metrics_exposition.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/compactor.h"
#include "backend/tmem_store.h"
#include "host-agent/channel/guest_report.h"
#include "proto/tmem_abi.h"

namespace tmem {
namespace {

constexpr MetricType kCounter = MetricType::kCounter;
constexpr MetricType kGauge = MetricType::kGauge;
constexpr MetricFamily kNone{"", kCounter, ""};

// --- deferred compression (backend/compactor.h) -------------------------
constexpr MetricFamily kCompactorCompressed{
    "tmem_compactor_compressed_total", kCounter,
    "Pages stored raw and compressed later by the compactor."};
constexpr MetricFamily kCompactorKeptRaw{
    "tmem_compactor_kept_raw_total", kCounter,
    "Queued pages the compactor left raw (they did not compress)."};
constexpr MetricFamily kCompactorSkippedNoReuse{
    "tmem_compactor_skipped_no_reuse_total", kCounter,
    "Queued pages left raw unread: their VM showed no reuse (throttled by "
    "the valve, or its guest stands aside)."};
constexpr MetricFamily kCompactorStale{
    "tmem_compactor_stale_total", kCounter,
    "Queued pages gone before their turn (read, invalidated, evicted or "
    "replaced)."};
constexpr MetricFamily kCompactorSkipped{
    "tmem_compactor_skipped_total", kCounter,
    "Queued pages never compressed, by what happened to them first."};
constexpr MetricFamily kCompactorQueueLength{
    "tmem_compactor_queue_length", kGauge, "Pages waiting for the compactor."};
constexpr MetricFamily kCompactorQueueOverflows{
    "tmem_compactor_queue_overflows_total", kCounter,
    "Deferred puts that found the queue full and stayed raw."};
constexpr MetricFamily kCompactorCpu{
    "tmem_compactor_cpu_seconds_total", kCounter,
    "Compactor CPU time, by scheduling class (idle or normal)."};
constexpr MetricFamily kCompactorWithin{
    "tmem_compactor_compressed_within_total", kCounter,
    "Pages compressed by the compactor, by the time from their put (upper "
    "bound in seconds; not cumulative)."};

// --- store counters (backend/stats.h) -----------------------------------
constexpr MetricFamily kPuts{
    "tmem_puts_total", kCounter,
    "Pages the VM put that the store kept, by how they are stored "
    "(compressed: an LZ4 block; raw: verbatim; zero, same_filled: metadata "
    "only)."};
constexpr MetricFamily kHostPuts{
    "tmem_host_puts_total", kCounter,
    "Pages put that the store kept, by how they are stored, over every VM "
    "since tmemd started (removed VMs included)."};
constexpr MetricFamily kPutsRefused{
    "tmem_puts_refused_total", kCounter,
    "Puts of the VM the store refused, by reason (quota: the VM's quota; "
    "poor_compression: LZ4 missed the threshold and raw is not allowed; "
    "no_memory: the host cap left nothing to evict; policy: the valve, or "
    "the VM disabled or frozen)."};
constexpr MetricFamily kHostPutsRefused{
    "tmem_host_puts_refused_total", kCounter,
    "Puts the store refused, by reason, over every VM since tmemd started "
    "(removed VMs included)."};
constexpr MetricFamily kGets{
    "tmem_gets_total", kCounter,
    "Gets of the VM, by result (hit: the page was served; miss: not held)."};
constexpr MetricFamily kHostGets{
    "tmem_host_gets_total", kCounter,
    "Gets, by result, over every VM since tmemd started (removed VMs "
    "included)."};
constexpr MetricFamily kInvalidateCalls{
    "tmem_invalidate_calls_total", kCounter,
    "Invalidate calls of the VM (not pages removed), by scope."};
constexpr MetricFamily kHostInvalidateCalls{
    "tmem_host_invalidate_calls_total", kCounter,
    "Invalidate calls, by scope, over every VM since tmemd started (removed "
    "VMs included)."};
constexpr MetricFamily kPagesInvalidated{
    "tmem_invalidated_pages_total", kCounter,
    "Pages of the VM removed by invalidates (page, object, pool) and pool "
    "destruction."};
constexpr MetricFamily kHostPagesInvalidated{
    "tmem_host_invalidated_pages_total", kCounter,
    "Pages removed by invalidates and pool destruction, over every VM since "
    "tmemd started (removed VMs included)."};
constexpr MetricFamily kEvictions{
    "tmem_evicted_pages_total", kCounter,
    "Pages of the VM evicted, by cause (host_cap: to keep the host memory "
    "cap; quota: to keep the VM's own quota)."};
constexpr MetricFamily kHostEvictions{
    "tmem_host_evicted_pages_total", kCounter,
    "Pages evicted, by cause, over every VM since tmemd started (removed VMs "
    "included)."};
constexpr MetricFamily kVmHeldPages{"tmem_held_pages", kGauge,
                                    "Pages the store holds for the VM."};
constexpr MetricFamily kVmStoredBytes{
    "tmem_stored_bytes", kGauge,
    "Blob slot bytes held for the VM (0 for zero and same-filled pages)."};
constexpr MetricFamily kVmChargedBytes{
    "tmem_charged_bytes", kGauge,
    "Stored bytes plus the per-page metadata charge: what the VM's quota "
    "counts."};
constexpr MetricFamily kVmPersistentHeldPages{
    "tmem_persistent_held_pages", kGauge,
    "Of the held pages, those in the VM's persistent pools (swap): never "
    "evicted."};
constexpr MetricFamily kVmPersistentChargedBytes{
    "tmem_persistent_charged_bytes", kGauge,
    "Of the charged bytes, those of pages in the VM's persistent pools."};
constexpr MetricFamily kPersistentPutsRefused{
    "tmem_persistent_puts_refused_total", kCounter,
    "Puts to the VM's persistent pools refused, by reason (room: quota or "
    "host memory; swap_quota: the VM's swap quota): pages its swap device "
    "kept on disk instead."};
constexpr MetricFamily kHostPersistentPutsRefused{
    "tmem_host_persistent_puts_refused_total", kCounter,
    "Puts to persistent pools refused, by reason, over every VM since tmemd "
    "started (removed VMs included)."};

// --- valve counters (backend/valve.h) -----------------------------------
constexpr MetricFamily kValveAdmitted{
    "tmem_valve_admitted_puts_total", kCounter,
    "Puts the valve let through, by what it told the store (compress, or "
    "raw: store verbatim, out of CPU tokens)."};
constexpr MetricFamily kValveDropped{
    "tmem_valve_dropped_puts_total", kCounter,
    "Puts the valve dropped, by reason (cpu: deep in CPU debt; reuse: "
    "throttled for no reuse; memory: no tokens and no memory headroom; off: "
    "mode off; aside: the guest stands aside)."};
constexpr MetricFamily kValveGhostHits{
    "tmem_valve_ghost_hits_total", kCounter,
    "Gets that missed on a key the valve or store had let go, by reuse "
    "distance (within: inside the VM's reach, admitting would have paid; "
    "beyond: no admitted page survives that long)."};
constexpr MetricFamily kValveThrottles{
    "tmem_valve_throttle_events_total", kCounter,
    "Times the valve throttled the VM for no reuse."};
constexpr MetricFamily kValveRestores{
    "tmem_valve_restore_events_total", kCounter,
    "Times the valve restored the VM to full admission."};

// --- per-VM and host gauges -----------------------------------------------
constexpr MetricFamily kMemoryCap{"tmem_memory_cap_bytes", kGauge,
                                  "Host memory cap of the store."};
constexpr MetricFamily kMemoryUsed{
    "tmem_memory_used_bytes", kGauge,
    "Bytes charged to the host memory cap (slabs, entries, indexes)."};
constexpr MetricFamily kMemorySlabBytes{
    "tmem_memory_slab_bytes", kGauge,
    "Of the memory used, bytes in blob slabs (the gap to "
    "tmem_memory_blob_slot_bytes is fragmentation)."};
constexpr MetricFamily kMemoryBlobSlotBytes{
    "tmem_memory_blob_slot_bytes", kGauge, "Slot bytes of live blobs."};
constexpr MetricFamily kMemoryMetadataBytes{
    "tmem_memory_metadata_bytes", kGauge,
    "Of the memory used, bytes in entries, indexes and tables."};
constexpr MetricFamily kVms{"tmem_vms", kGauge, "VMs the store knows."};
constexpr MetricFamily kUnknownVmIds{
    "tmem_unknown_vm_ids_refused_total", kCounter,
    "Store calls refused because their VM id names no live VM."};
constexpr MetricFamily kSlabsEmptiedForRoom{
    "tmem_slabs_emptied_for_room_total", kCounter,
    "Slabs the store emptied whole because it needed budget bytes."};
constexpr MetricFamily kSlabChoicePagesWalked{
    "tmem_slab_choice_pages_walked_total", kCounter,
    "Pages walked to choose and empty those slabs."};
constexpr MetricFamily kMaxOpWork{
    "tmem_store_max_op_work", kGauge,
    "The most work one put or get did (entries, nodes and slab candidates "
    "visited, pages evicted, entries moved); bounded by the store."};
constexpr MetricFamily kMetadataChunksReleased{
    "tmem_metadata_chunks_released_total", kCounter,
    "Entry and object-node chunks given back after removals."};
constexpr MetricFamily kPutsRefusedAtWorkBound{
    "tmem_puts_refused_at_work_bound_total", kCounter,
    "Puts refused for memory because their bounded eviction found no room."};
constexpr MetricFamily kHostVmChargedBytes{
    "tmem_memory_vm_charged_bytes", kGauge,
    "What live VMs are charged against their quotas, in all."};
constexpr MetricFamily kHostOverheadBytes{
    "tmem_memory_host_overhead_bytes", kGauge,
    "Memory used that no VM is charged: slab slack plus per-shard tables."};
constexpr MetricFamily kCpuBudget{
    "tmem_cpu_budget_ratio", kGauge,
    "tmemd's current CPU budget, as a share of the whole host (0..1)."};
constexpr MetricFamily kAgentBusy{
    "tmem_agent_busy_ratio", kGauge,
    "tmemd's CPU use, smoothed, as a share of the whole host (0..1)."};
constexpr MetricFamily kHostBusy{
    "tmem_host_busy_ratio", kGauge,
    "Whole-host CPU use, smoothed, tmemd included (0..1)."};
constexpr MetricFamily kCpuPressure{
    "tmem_host_cpu_pressure_ratio", kGauge,
    "Host CPU pressure (PSI some avg10) as a fraction (0..1)."};
constexpr MetricFamily kUptime{"tmem_uptime_seconds", kGauge,
                               "Seconds since tmemd started."};
constexpr MetricFamily kVmConnected{
    "tmem_vm_connected", kGauge,
    "1 while a QEMU (or tmem-guestsim) is attached to the VM's channel."};
// Swap devices (vhost-user-blk, docs/swap-device.md), per VM.
constexpr MetricFamily kSwapSize{"tmem_swap_size_bytes", kGauge,
                                 "Size of the VM's swap device."};
constexpr MetricFamily kSwapConnected{
    "tmem_swap_connected", kGauge,
    "1 while a vhost-user front-end (QEMU) is attached to the swap device."};
constexpr MetricFamily kSwapStored{
    "tmem_swap_stored_pages", kGauge,
    "Swap pages the device holds (compressed + raw + spilled)."};
constexpr MetricFamily kSwapMemory{
    "tmem_swap_memory_pages", kGauge,
    "Swap pages held in tmemd's store (the VM's persistent pool)."};
constexpr MetricFamily kSwapMemoryBytes{
    "tmem_swap_memory_bytes", kGauge,
    "What the swap pages in the store take there, compressed or raw."};
constexpr MetricFamily kSwapLost{
    "tmem_swap_lost_pages", kGauge,
    "Swap pages a failed write lost (their reads fail, never silently)."};
constexpr MetricFamily kSwapPuts{
    "tmem_swap_store_puts_total", kCounter,
    "Swap pages the store took, by how (compressed or raw)."};
constexpr MetricFamily kSwapBackingEvents{
    "tmem_swap_backing_events_total", kCounter,
    "Swap backing counters (host-agent/swap/tmem_swap_backing.h): where "
    "writes went, spills by cause, write-back, failures."};
constexpr MetricFamily kSwapSpilled{
    "tmem_swap_spilled_pages", kGauge,
    "Swap pages moved to the VM's spill image on disk."};
constexpr MetricFamily kSwapDiscarded{
    "tmem_swap_discarded_pages_total", kCounter,
    "Swap pages the guest freed (DISCARD, WRITE_ZEROES)."};
constexpr MetricFamily kSwapReadSeconds{
    "tmem_swap_backing_read_seconds_total", kCounter,
    "Time the swap backing spent reading; divide by "
    "tmem_swap_backing_read_calls_total for the mean latency."};
constexpr MetricFamily kSwapReadCalls{"tmem_swap_backing_read_calls_total",
                                      kCounter, "Reads of the swap backing."};
constexpr MetricFamily kSwapWriteSeconds{
    "tmem_swap_backing_write_seconds_total", kCounter,
    "Time the swap backing spent writing; divide by "
    "tmem_swap_backing_write_calls_total for the mean latency."};
constexpr MetricFamily kSwapWriteCalls{"tmem_swap_backing_write_calls_total",
                                       kCounter, "Writes to the swap backing."};
constexpr MetricFamily kVmQuota{
    "tmem_vm_quota_bytes", kGauge,
    "The VM's quota (absent when unlimited); compare tmem_charged_bytes."};
constexpr MetricFamily kVmSwapQuota{
    "tmem_vm_swap_quota_bytes", kGauge,
    "The part of the VM's quota its swap pages may take (absent when "
    "unlimited); past it swap pages go to the spill image."};
constexpr MetricFamily kVmAdmission{
    "tmem_vm_admission_ratio", kGauge,
    "Share of the VM's puts the valve admits now (0..1)."};
constexpr MetricFamily kValveThrottled{
    "tmem_valve_throttled", kGauge,
    "1 while the valve throttles the VM for no reuse."};
constexpr MetricFamily kValveReuse{
    "tmem_valve_reuse_ratio", kGauge,
    "Smoothed (hits + ghost hits) / admitted puts of the VM."};
constexpr MetricFamily kValveCpu{
    "tmem_valve_cpu_seconds_total", kCounter,
    "CPU time tmemd spent on the VM's pages, as the valve charged it."};

// --- the guest's own report (ABI v2/v3; untrusted, shown as written) ------
constexpr MetricFamily kGuestAside{
    "tmem_guest_standing_aside", kGauge,
    "1 while the guest says tmem does not pay for it (guest-reported)."};
constexpr MetricFamily kGuestGet{
    "tmem_guest_get_seconds", kGauge,
    "The guest's time per page served by tmem (guest-reported)."};
constexpr MetricFamily kGuestMiss{
    "tmem_guest_miss_seconds", kGauge,
    "The guest's estimate of a disk read per page (guest-reported)."};
constexpr MetricFamily kGuestPrefetchUsed{
    "tmem_guest_prefetch_used_pages_total", kCounter,
    "Batched (prefetched) pages the guest served from its slots "
    "(guest-reported)."};
constexpr MetricFamily kGuestPrefetchUnused{
    "tmem_guest_prefetch_unused_pages_total", kCounter,
    "Batched (prefetched) pages the guest dropped unused (guest-reported)."};
constexpr MetricFamily kGuestRam{
    "tmem_guest_ram_bytes", kGauge,
    "The guest's RAM as the guest says (absent when unsaid; "
    "guest-reported)."};

// The channel counters keep one family each, named after the counter.
std::string_view ChannelFamilyName(ChannelCounter c) {
  static const auto* const names = [] {
    auto* n = new std::array<std::string, kNumChannelCounters>;
    for (int i = 0; i < kNumChannelCounters; ++i) {
      (*n)[i] =
          "tmem_channel_" +
          std::string(ChannelCounterName(static_cast<ChannelCounter>(i))) +
          "_total";
    }
    return n;
  }();
  return (*names)[static_cast<int>(c)];
}

// tmem_swap_<counter>_total, one family per device counter, named as in
// swap_metrics.cc.
MetricFamily SwapCounterFamily(swap::SwapCounter c) {
  struct Names {
    std::array<std::string, swap::kNumSwapCounters> name, help;
  };
  static const auto* const names = [] {
    auto* n = new Names;
    for (int i = 0; i < swap::kNumSwapCounters; ++i) {
      const std::string base(
          swap::SwapCounterName(static_cast<swap::SwapCounter>(i)));
      n->name[i] = "tmem_swap_" + base + "_total";
      n->help[i] = "Swap device counter '" + base +
                   "' (host-agent/swap/swap_metrics.h).";
    }
    return n;
  }();
  const int i = static_cast<int>(c);
  return {names->name[i], kCounter, names->help[i]};
}

std::string_view ChannelCounterHelp(ChannelCounter c) {
  switch (c) {
    case ChannelCounter::kClientsAccepted:
      return "ivshmem clients (QEMU) accepted on the VM's socket.";
    case ChannelCounter::kClientsRejectedBusy:
      return "ivshmem clients refused because one was already connected.";
    case ChannelCounter::kHandshakeFailures:
      return "ivshmem handshakes that failed (sendmsg failed or would block); "
             "the client was dropped.";
    case ChannelCounter::kClientDisconnects:
      return "ivshmem clients that disconnected.";
    case ChannelCounter::kClientGarbage:
      return "ivshmem clients that sent bytes (QEMU never does).";
    case ChannelCounter::kSqeProcessed:
      return "Ring entries the VM's consumer processed.";
    case ChannelCounter::kSqeBadOpcode:
      return "Ring entries refused: unknown opcode.";
    case ChannelCounter::kSqeBadPool:
      return "Ring entries refused: pool id out of range or not created.";
    case ChannelCounter::kSqeBadSlot:
      return "Ring entries refused: slot index beyond the slot count.";
    case ChannelCounter::kSqeBadFlags:
      return "Ring entries refused: unknown flag bits or nonzero reserved "
             "bytes.";
    case ChannelCounter::kSqeStoreErrors:
      return "Ring entries the store answered with an error status.";
    case ChannelCounter::kCqeWritten:
      return "Completions written to the VM's ring.";
    case ChannelCounter::kPutsDroppedByHost:
      return "Puts completed with TMEM_ERR_DROPPED (the host chose not to "
             "keep them).";
    case ChannelCounter::kGetBatches:
      return "GET_BATCH entries executed.";
    case ChannelCounter::kGetBatchPages:
      return "Pages GET_BATCH entries asked for.";
    case ChannelCounter::kGetBatchHits:
      return "Pages GET_BATCH entries found.";
    case ChannelCounter::kGetBatchBadCount:
      return "GET_BATCH entries refused: count 0, above TMEM_GET_BATCH_MAX, "
             "or indices that wrap.";
    case ChannelCounter::kGetBatchBadSlots:
      return "GET_BATCH entries refused: slot + count beyond the slot count.";
    case ChannelCounter::kGetBatchSharedPool:
      return "GET_BATCH entries refused: on a shared pool.";
    case ChannelCounter::kRingCorruptIndex:
      return "Ring faults: tail - head beyond the ring, or head moved "
             "backwards.";
    case ChannelCounter::kChannelResets:
      return "Channel resets by the host (any reason).";
    case ChannelCounter::kGuestRestarts:
      return "Guest restarts seen (guest_generation changed).";
    case ChannelCounter::kRegionForeign:
      return "Resets because the region's host_generation was not the one "
             "tmemd wrote (migrated in from another host).";
    case ChannelCounter::kFlushBarriers:
      return "Flush requests applied.";
    case ChannelCounter::kDoorbells:
      return "Doorbell (eventfd) wakeups from the guest.";
    case ChannelCounter::kInterruptsSent:
      return "Interrupts sent to the guest.";
    case ChannelCounter::kPollRounds:
      return "Ring drains that found work without a doorbell.";
    case ChannelCounter::kPutsCompressionDeferred:
      return "Puts stored raw with their compression queued for the "
             "compactor because other VMs were waiting on the worker.";
    case ChannelCounter::kRestoredAcrossRestart:
      return "Channels taken over from a previous tmemd (restart, upgrade).";
    case ChannelCounter::kForeignRegions:
      return "Regions that held another host's generation (migration).";
    case ChannelCounter::kAcceptBackoffs:
      return "Times the VM's socket could not accept for want of descriptors "
             "and was disarmed, to be retried after a back-off.";
    case ChannelCounter::kAcceptsFromReserve:
      return "Guests let in by closing tmemd's spare descriptors when it had "
             "run out.";
    case ChannelCounter::kNumCounters:
      break;
  }
  return "";
}

std::vector<MetricLabel> VmLabel(const VmInfo& vm) { return {{"vm", vm.name}}; }

std::vector<MetricLabel> WithLabel(std::vector<MetricLabel> labels,
                                   const CounterSeries& s) {
  if (!s.label.empty()) labels.push_back({s.label, std::string(s.label_value)});
  return labels;
}

}  // namespace

CounterSeries StoreCounterSeries(Counter c) {
  switch (c) {
    case Counter::kPutsCompressed:
      return {kPuts, "stored", "compressed", kHostPuts};
    case Counter::kPutsRaw:
      return {kPuts, "stored", "raw", kHostPuts};
    case Counter::kPutsZero:
      return {kPuts, "stored", "zero", kHostPuts};
    case Counter::kPutsSameFilled:
      return {kPuts, "stored", "same_filled", kHostPuts};
    case Counter::kPutsRefusedQuota:
      return {kPutsRefused, "reason", "quota", kHostPutsRefused};
    case Counter::kPutsRefusedPoorCompression:
      return {kPutsRefused, "reason", "poor_compression", kHostPutsRefused};
    case Counter::kPutsRefusedNoMemory:
      return {kPutsRefused, "reason", "no_memory", kHostPutsRefused};
    case Counter::kPutsRefusedPolicy:
      return {kPutsRefused, "reason", "policy", kHostPutsRefused};
    case Counter::kGetsHit:
      return {kGets, "result", "hit", kHostGets};
    case Counter::kGetsMiss:
      return {kGets, "result", "miss", kHostGets};
    case Counter::kInvalidatePage:
      return {kInvalidateCalls, "scope", "page", kHostInvalidateCalls};
    case Counter::kInvalidateObject:
      return {kInvalidateCalls, "scope", "object", kHostInvalidateCalls};
    case Counter::kInvalidatePool:
      return {kInvalidateCalls, "scope", "pool", kHostInvalidateCalls};
    case Counter::kPagesInvalidated:
      return {kPagesInvalidated, "", "", kHostPagesInvalidated};
    case Counter::kEvictionsHostCap:
      return {kEvictions, "cause", "host_cap", kHostEvictions};
    case Counter::kEvictionsQuota:
      return {kEvictions, "cause", "quota", kHostEvictions};
    // Gauges: the host-wide value is the sum of the live VMs' (a removed
    // VM holds nothing), so only the per-VM series are exported.
    case Counter::kPagesHeld:
      return {kVmHeldPages, "", "", kNone};
    case Counter::kStoredBytes:
      return {kVmStoredBytes, "", "", kNone};
    case Counter::kChargedBytes:
      return {kVmChargedBytes, "", "", kNone};
    case Counter::kPersistentPagesHeld:
      return {kVmPersistentHeldPages, "", "", kNone};
    case Counter::kPersistentChargedBytes:
      return {kVmPersistentChargedBytes, "", "", kNone};
    case Counter::kPersistentPutsRefusedForRoom:
      return {kPersistentPutsRefused, "reason", "room",
              kHostPersistentPutsRefused};
    case Counter::kPersistentPutsRefusedForSwapQuota:
      return {kPersistentPutsRefused, "reason", "swap_quota",
              kHostPersistentPutsRefused};
    case Counter::kNumCounters:
      break;
  }
  return {kNone, "", "", kNone};
}

CounterSeries ValveCounterSeries(ValveCounter c) {
  switch (c) {
    case ValveCounter::kCompressed:
      return {kValveAdmitted, "advice", "compress", kNone};
    case ValveCounter::kRaw:
      return {kValveAdmitted, "advice", "raw", kNone};
    case ValveCounter::kDroppedCpu:
      return {kValveDropped, "reason", "cpu", kNone};
    case ValveCounter::kDroppedReuse:
      return {kValveDropped, "reason", "reuse", kNone};
    case ValveCounter::kDroppedMemory:
      return {kValveDropped, "reason", "memory", kNone};
    case ValveCounter::kDroppedOff:
      return {kValveDropped, "reason", "off", kNone};
    case ValveCounter::kDroppedAside:
      return {kValveDropped, "reason", "aside", kNone};
    case ValveCounter::kGhostHits:
      return {kValveGhostHits, "distance", "within", kNone};
    case ValveCounter::kGhostHitsFar:
      return {kValveGhostHits, "distance", "beyond", kNone};
    case ValveCounter::kThrottleEvents:
      return {kValveThrottles, "", "", kNone};
    case ValveCounter::kRestoreEvents:
      return {kValveRestores, "", "", kNone};
    case ValveCounter::kNumCounters:
      break;
  }
  return {kNone, "", "", kNone};
}

CounterSeries ChannelCounterSeries(ChannelCounter c) {
  return {
      {ChannelFamilyName(c), kCounter, ChannelCounterHelp(c)}, "", "", kNone};
}

void AppendAgentMetrics(const Agent& agent, PrometheusText& out) {
  const AgentStatus st = agent.Status();
  out.Add(kMemoryCap, {}, st.store.memory_cap_bytes);
  out.Add(kMemoryUsed, {}, st.store.memory_used_bytes);
  out.Add(kMemorySlabBytes, {}, st.store.slab_bytes);
  out.Add(kMemoryBlobSlotBytes, {}, st.store.blob_slot_bytes);
  out.Add(kMemoryMetadataBytes, {}, st.store.metadata_bytes);
  out.Add(kVms, {}, st.store.vms);
  out.Add(kUnknownVmIds, {}, st.store.unknown_vm_ids_refused);
  out.Add(kSlabsEmptiedForRoom, {}, st.store.slabs_emptied_for_room);
  out.Add(kSlabChoicePagesWalked, {}, st.store.slab_choice_pages_walked);
  out.Add(kMaxOpWork, {}, st.store.max_op_work);
  out.Add(kMetadataChunksReleased, {}, st.store.metadata_chunks_released);
  out.Add(kPutsRefusedAtWorkBound, {}, st.store.puts_refused_at_work_bound);
  out.Add(kHostVmChargedBytes, {}, st.store.vm_charged_bytes);
  out.Add(kHostOverheadBytes, {}, st.store.host_overhead_bytes);
  out.Add(kCpuBudget, {}, st.valve.budget_fraction);
  out.Add(kAgentBusy, {}, st.valve.agent_busy_fraction);
  out.Add(kHostBusy, {}, st.valve.host_busy_fraction);
  out.Add(kCpuPressure, {}, st.valve.cpu_pressure / 100.0);
  out.Add(kUptime, {}, static_cast<double>(st.uptime_nanos) / 1e9);
  {
    const CompactorStats& k = st.compactor;
    out.Add(kCompactorCompressed, {}, k.compressed);
    out.Add(kCompactorKeptRaw, {}, k.kept_raw);
    out.Add(kCompactorSkippedNoReuse, {}, k.skipped_no_reuse);
    out.Add(kCompactorStale, {}, k.stale);
    out.Add(kCompactorQueueLength, {}, k.queue.length);
    out.Add(kCompactorQueueOverflows, {}, k.queue.overflows);
    for (int i = 0; i < kNumCompactionSkips; ++i) {
      out.Add(
          kCompactorSkipped,
          {{"cause",
            std::string(CompactionSkipName(static_cast<CompactionSkip>(i)))}},
          k.queue.skipped[i]);
    }
    out.Add(kCompactorCpu, {{"class", "idle"}},
            static_cast<double>(k.idle_cpu_ns) / 1e9);
    out.Add(kCompactorCpu, {{"class", "normal"}},
            static_cast<double>(k.normal_cpu_ns) / 1e9);
    for (size_t b = 0; b < k.latency.size(); ++b) {
      const std::string le =
          kCompactLatencyBoundsMs[b] == INT64_MAX
              ? std::string("+Inf")
              : absl::StrCat(static_cast<double>(kCompactLatencyBoundsMs[b]) /
                             1000.0);
      out.Add(kCompactorWithin, {{"within", le}}, k.latency[b]);
    }
  }
  for (int i = 0; i < kNumCounters; ++i) {
    const CounterSeries s = StoreCounterSeries(static_cast<Counter>(i));
    if (!s.host_family.name.empty()) {
      out.Add(s.host_family, WithLabel({}, s), st.store.counters[i]);
    }
  }

  for (const VmInfo& vm : agent.ListVms()) {
    const std::vector<MetricLabel> vm_label = VmLabel(vm);
    for (int i = 0; i < kNumCounters; ++i) {
      const CounterSeries s = StoreCounterSeries(static_cast<Counter>(i));
      out.Add(s.vm_family, WithLabel(vm_label, s), vm.stats.counters[i]);
    }
    for (int i = 0; i < kNumValveCounters; ++i) {
      const CounterSeries s = ValveCounterSeries(static_cast<ValveCounter>(i));
      out.Add(s.vm_family, WithLabel(vm_label, s), vm.valve.counters[i]);
    }
    for (int i = 0; vm.has_channel && i < kNumChannelCounters; ++i) {
      const CounterSeries s =
          ChannelCounterSeries(static_cast<ChannelCounter>(i));
      out.Add(s.vm_family, vm_label, vm.channel[i]);
    }
    if (vm.swap) {
      const SwapDeviceInfo& sw = *vm.swap;
      out.Add(kSwapSize, vm_label, sw.size_bytes);
      out.Add(kSwapConnected, vm_label, uint64_t{sw.connected ? 1u : 0u});
      out.Add(kSwapStored, vm_label, sw.pages.stored);
      out.Add(kSwapMemory, vm_label, sw.pages.in_memory);
      out.Add(kSwapMemoryBytes, vm_label, sw.pages.memory_bytes);
      out.Add(kSwapSpilled, vm_label, sw.pages.spilled);
      out.Add(kSwapLost, vm_label, sw.pages.lost);
      out.Add(kSwapPuts, {{"vm", vm.name}, {"how", "compressed"}},
              sw.pages.compressed_puts);
      out.Add(kSwapPuts, {{"vm", vm.name}, {"how", "raw"}}, sw.pages.raw_puts);
      for (const auto& [name, value] : sw.pages.counters) {
        out.Add(kSwapBackingEvents, {{"vm", vm.name}, {"event", name}}, value);
      }
      out.Add(kSwapDiscarded, vm_label, sw.times.discarded_pages);
      out.Add(kSwapReadSeconds, vm_label,
              static_cast<double>(sw.times.read_ns) / 1e9);
      out.Add(kSwapReadCalls, vm_label, sw.times.read_calls);
      out.Add(kSwapWriteSeconds, vm_label,
              static_cast<double>(sw.times.write_ns) / 1e9);
      out.Add(kSwapWriteCalls, vm_label, sw.times.write_calls);
      for (int i = 0; i < swap::kNumSwapCounters; ++i) {
        out.Add(SwapCounterFamily(static_cast<swap::SwapCounter>(i)), vm_label,
                sw.counters[i]);
      }
    }
    out.Add(kVmConnected, vm_label, uint64_t{vm.connected ? 1u : 0u});
    if (vm.policy.quota_bytes != kUnlimitedQuota) {
      out.Add(kVmQuota, vm_label, vm.policy.quota_bytes);
    }
    if (vm.policy.swap_quota_bytes != kUnlimitedQuota) {
      out.Add(kVmSwapQuota, vm_label, vm.policy.swap_quota_bytes);
    }
    out.Add(kVmAdmission, vm_label,
            static_cast<double>(vm.valve.admission) / 65536.0);
    out.Add(kValveThrottled, vm_label, uint64_t{vm.valve.throttled ? 1u : 0u});
    out.Add(kValveReuse, vm_label, vm.valve.reuse_ratio);
    out.Add(kValveCpu, vm_label,
            static_cast<double>(vm.valve.cpu_used_ns) / 1e9);

    const GuestReport& g = vm.guest;
    out.Add(kGuestAside, vm_label, uint64_t{g.standing_aside ? 1u : 0u});
    out.Add(kGuestGet, vm_label, static_cast<double>(g.get_ns) / 1e9);
    out.Add(kGuestMiss, vm_label, static_cast<double>(g.miss_ns) / 1e9);
    out.Add(kGuestPrefetchUsed, vm_label, g.prefetch_used);
    out.Add(kGuestPrefetchUnused, vm_label, g.prefetch_unused);
    // Untrusted: pages x 4096 in double never wraps around.
    if (g.ram_pages != 0) {
      out.Add(kGuestRam, vm_label,
              static_cast<double>(g.ram_pages) * TMEM_PAGE_SIZE);
    }
  }
}

std::string RenderPrometheus(const Agent& agent) {
  PrometheusText out;
  AppendAgentMetrics(agent, out);
  return out.Render();
}

}  // namespace tmem
