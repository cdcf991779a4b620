// RingConsumer: executes one VM's submission ring against the store.
//
// Everything in the shared region is hostile input (invariant 3): every
// field tmemd reads from shared memory is read exactly once (a volatile or
// atomic load into a local) and validated before use; nothing read from it
// is ever used as a pointer, a size or an index without a bounds check
// against the RegionLayout tmemd chose (never against header values, which
// the guest can overwrite).
//
// Drain() processes entries in ring order (ops take effect in ring order),
// writes one CQE per SQE, and advances sq_head/cq_tail with release stores
// (see proto/tmem_abi.h for the ordering contract). It consumes an SQE only
// if the CQ has room, so it never waits on the guest. Bad entries get an
// error CQE and their own counter. A ring whose indices are impossible
// (tail - head > entries, or sq_head/cq_tail not what tmemd last wrote), or
// a header whose host_generation is not the one tmemd wrote (a region that
// came with a live-migrated VM from another host), resets the channel: the VM's
// pools and pages are dropped (nothing stale can survive a lost invalidate) and
// the region is re-initialized with a new host generation. A changed
// guest_generation (guest restart) drops the VM's pools and pages likewise.
//
// Flush barrier: when flush_request_seq is ahead of flush_done_seq and
// sq_head has reached flush_request_seq, every pool in flush_request is
// invalidated, then flush_done_seq = flush_request_seq (release).
//
// Pools: the guest's pool id on the wire is the store's PoolId for this VM;
// ids >= TMEM_MAX_POOLS are refused. The consumer remembers which pools it
// created so a reset or restart can destroy exactly those.
//
// GET_BATCH (ABI v2): count 1..TMEM_GET_BATCH_MAX, slots slot..slot+count-1
// inside tmemd's layout, private pools only (as tmemd recorded them at
// NEW_POOL); each hit is exclusive like a single GET; the CQE's result is
// the hit bitmap. One store call per batch (TmemStore::GetRun). Each
// refusal has its own counter.
//
// Not thread-safe: one worker thread owns a consumer.
#ifndef TMEMD_HOST_AGENT_CHANNEL_RING_CONSUMER_H_
#define TMEMD_HOST_AGENT_CHANNEL_RING_CONSUMER_H_

#include <array>
#include <bitset>
#include <cstdint>
#include <memory>

#include "backend/put_advisor.h"
#include "backend/tmem_store.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/shared_region.h"
#include "proto/tmem_abi.h"

namespace tmem {

class RingConsumer {
 public:
  // All pointers must outlive the consumer. `advisor` may be null
  // (PutMode::kCompress for every put).
  RingConsumer(SharedRegion* region, TmemStore* store, VmId vm,
               ChannelMetrics* metrics, PutAdvisor* advisor = nullptr);

  struct DrainResult {
    uint32_t consumed = 0;   // SQEs completed
    bool interrupt = false;  // some completed SQE carried TMEM_SQE_F_IRQ
    bool reset = false;      // the channel was reset during this drain
    bool more = false;       // stopped with entries left: at max_entries,
                             // or right after an entry the guest waits on
                             // (TMEM_SQE_F_IRQ), so its interrupt is sent
                             // before the rest of the batch runs
  };
  // Processes up to `max_entries` SQEs. compress_later: a put the advisor
  // would compress (now or deferred) is stored raw and queued for the
  // compactor at idle priority instead (PutMode::kDeferIdle, counted in
  // kPutsCompressionDeferred); the worker asks
  // for it while other VMs wait behind this ring (TurnScheduler).
  DrainResult Drain(uint32_t max_entries, bool compress_later = false);

  // Drops every pool this consumer created (their pages go with them).
  void DropPools();

  // Number of SQEs visible to the host right now (0 if indices are bad).
  uint32_t Pending() const;

 private:
  SharedRegion* region_;
  TmemStore* store_;
  VmId vm_;
  ChannelMetrics* metrics_;
  PutAdvisor* advisor_;
  uint32_t sq_head_ = 0;  // what tmemd last published
  uint32_t cq_tail_ = 0;
  uint64_t guest_generation_ = 0;
  std::bitset<TMEM_MAX_POOLS> pools_;
  std::bitset<TMEM_MAX_POOLS> shared_pools_;  // of pools_, the shared ones
  // What tmemd last published as flush_done_seq (the header copy is
  // guest-writable, so it is never read back).
  uint64_t flush_done_seq_ = 0;
  // region_->host_generation() the indices above belong to: a Reset() by
  // the region's owner is noticed here and re-syncs them.
  uint64_t region_generation_ = 0;
  // Where a GET_BATCH decodes its pages before copying them to the guest
  // (128 KiB: on the heap, not the worker's stack).
  using BatchPages =
      std::array<uint8_t, size_t{TMEM_GET_BATCH_MAX} * TMEM_PAGE_SIZE>;
  std::unique_ptr<BatchPages> batch_pages_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_RING_CONSUMER_H_
