// TmemSwapBacking: a VM's swap device held in tmemd's store, with its spill
// image on host disk for what the store cannot or should not hold. The
// SwapBacking that tmemd serves to a stock guest's swap device.
//
// Where a page lives (one byte per page, kept by this class):
//  * none: never written, discarded, zeroed, or written as all zeros (an
//    all-zero page costs neither store charge nor disk); reads zeros.
//  * store: in the VM's persistent pool of the TmemStore (never evicted;
//    zero and same-filled pages cost metadata only there). Key: object
//    page >> 6 (64 pages, one GetRun's worth, per object, so a device
//    spreads over the store's shards), index page & 63.
//  * image: in the SpillImage at page * 4096.
//  * lost: a write failed after the store had already dropped the page's
//    previous content (see "Writes"); reads fail with DATA_LOSS until the
//    page is written, discarded or zeroed again. Counted; never silent.
//  The image holds data only for pages located there (a page that moves
//  into the store or becomes zero has its hole punched), so the image plus
//  the store is always exactly the device.
//
// Writes: each page is copied once out of guest memory into a page buffer;
// everything else reads that copy. The PutAdvisor (the valve; null means
// PutMode::kDefer) picks how the store takes it: kDefer/kDeferIdle store it
// raw at once and compress later with spare CPU, kRaw keeps it raw, kDrop
// means "spill": the page goes to the image, never dropped. A put the store
// refuses (VM at quota, host at cap) spills to the image too, so a write
// never waits for compression and never fails for want of memory; it fails
// only if the image write fails (ENOSPC: RESOURCE_EXHAUSTED, I/O:
// DATA_LOSS). Then the page keeps its previous content, except when the
// store had already dropped it (a refused put removes the earlier page of
// its key): the page is then "lost".
//
// Reads: a store page is decoded straight into guest memory when the page's
// destination is one contiguous span (no bounce copy), else through a page
// buffer; an image page is read with O_DIRECT, straight into guest memory
// when that span is also 4 KiB-aligned.
//
// Stop and start: WriteBackAll moves every store page into the image and
// fdatasyncs it (graceful stop); Open makes the image's present pages
// (SEEK_DATA) the device's content and empties the pool first. A crash
// loses the store's pages (the store is memory), never the image's.
//
// Flush: fdatasync of the image (store pages survive what the process
// survives).
//
// Relief (RelieveStep): the store never evicts a persistent page, so when
// the VM holds more there than it may now (a lowered quota, swap quota or
// host cap: TmemStore::PersistentExcessBytes), this class moves pages out
// itself, from the store into the image, never dropping one. Per page,
// under its stripe lock (so a concurrent guest read or write of that page
// sees it in one place or the other, whole): a non-exclusive get, the
// image write, the location set to the image, then the store key
// invalidated. An image write that fails leaves the page in the store
// (nothing lost; counted) and ends the step: the disk is full or failing,
// and the next step tries again. Bounded: at most `max_pages` pages moved
// and kReliefScanPages locations looked at per step, resuming where the
// last step stopped; the excess is read again after every page, so a step
// stops as soon as the VM is back within. Off the guest's request path:
// the agent calls it from its periodic tick.
//
// Failed writes (the image write of a page nothing else could take): the
// request fails (the guest sees VIRTIO_BLK_S_IOERR), the page's hole is
// punched again so the image never holds a page not located there, and
// `on_event` gets a line, rate-limited to one per kWriteFailureLogNanos
// with the count of those it held back.
//
// Thread safety: every method may be called from any thread. Page
// operations lock a stripe of pages (page % kStripes) per page, so several
// virtqueues run in parallel and WriteBackAll and RelieveStep may run
// while the device serves. Lock order: relief_mu_ (RelieveStep only), then
// a stripe lock, then the store's and the image's own.
#ifndef TMEMD_HOST_AGENT_SWAP_TMEM_SWAP_BACKING_H_
#define TMEMD_HOST_AGENT_SWAP_TMEM_SWAP_BACKING_H_

#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/mutex.h"
#include "backend/put_advisor.h"
#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "backend/types.h"
#include "host-agent/swap/spill_image.h"
#include "host-agent/swap/swap_backing.h"

namespace tmem::swap {

// Counters of a TmemSwapBacking (pages unless said). Names are stable:
// they become gRPC/Prometheus fields.
enum class TmemSwapCounter : int {
  kPageReads = 0,
  kPageWrites,
  kReadsZero,         // served as zeros (nothing stored)
  kReadsStore,        // served from the store
  kReadsStoreDirect,  // of which decoded straight into guest memory
  kReadsImage,        // served from the spill image
  kWritesZero,        // all-zero pages: kept as nothing
  kWritesStored,      // taken by the store
  kSpilledValve,      // the advisor said kDrop: straight to the image
  kSpilledQuota,      // the store refused: VM at its quota
  kSpilledNoMemory,   // the store refused: host at its cap
  kSpilledOther,      // the store refused for another reason, or failed
  kDiscarded,         // pages freed by DISCARD
  kZeroed,            // pages freed by WRITE_ZEROES
  kWrittenBack,       // store pages moved into the image by WriteBackAll
  // Failure paths.
  kStoreErrors,  // a store call returned an error
  kStoreMisses,  // a page located in the store was not there
  kImageWriteErrors,
  kImageReadErrors,
  kImagePunchErrors,  // the hole stays; handled (see .cc)
  kImageSyncErrors,
  kPagesLost,     // pages whose content a failed write lost (see above)
  kReadsLost,     // reads of such pages (DATA_LOSS)
  kWritesFailed,  // page writes that failed (the guest saw an I/O error)
  // Relief (see above).
  kRelievedToImage,         // pages moved from the store into the image
  kReliefSteps,             // steps that moved at least one page
  kReliefImageWriteErrors,  // the page stayed in the store
  kReliefStoreErrors,       // a get or invalidate failed, or a miss
  kReliefQueryErrors,       // PersistentExcessBytes failed
  kNumCounters,
};
inline constexpr int kNumTmemSwapCounters =
    static_cast<int>(TmemSwapCounter::kNumCounters);
std::string_view TmemSwapCounterName(TmemSwapCounter c);

// A snapshot for the agent to show.
struct TmemSwapStats {
  uint64_t page_count = 0;
  // Where the device's pages are now.
  uint64_t pages_in_store = 0;
  uint64_t pages_in_image = 0;
  uint64_t pages_lost = 0;
  // Disk the image holds (st_blocks).
  uint64_t image_allocated_bytes = 0;
  bool image_direct_io = false;
  // The image's own I/O (writes include write-back and zeros written where
  // a hole could not be punched) and its failures.
  uint64_t image_page_writes = 0;
  uint64_t image_page_reads = 0;
  uint64_t image_punches = 0;
  uint64_t image_syncs = 0;
  uint64_t image_io_errors = 0;  // write, read, punch, sync, seek
  std::array<uint64_t, kNumTmemSwapCounters> counters{};
  // The persistent pool's own counters (compressed vs raw vs zero puts,
  // bytes stored and charged).
  CounterValues pool{};

  uint64_t Get(TmemSwapCounter c) const {
    return counters[static_cast<int>(c)];
  }
};

struct TmemSwapBackingOptions {
  TmemStore* store = nullptr;  // must outlive the backing
  VmId vm = 0;
  PoolId pool = -1;  // a persistent pool of `vm`, used by nothing else
  PutAdvisor* advisor = nullptr;  // optional; must outlive the backing
  // Events worth a log line (failed writes, rate-limited). May be empty;
  // called with no lock held.
  std::function<void(std::string_view event, std::string_view detail)> on_event;
};

// What one RelieveStep did.
struct ReliefStep {
  PersistentExcess before;  // the excess the step started from
  uint64_t excess_after = 0;
  uint64_t moved = 0;    // pages now in the image instead of the store
  uint64_t failed = 0;   // pages that stayed in the store (errors)
  uint64_t scanned = 0;  // locations looked at
  absl::Status error;    // the first failure, if any
};

class TmemSwapBacking final : public SwapBacking {
 public:
  static constexpr int kStripes = 64;
  // Locations one RelieveStep looks at, at most (bounded work on a device
  // whose store pages are sparse).
  static constexpr uint64_t kReliefScanPages = 65536;
  static constexpr int64_t kWriteFailureLogNanos = 10'000'000'000;

  // The device's size is the image's. Empties the pool, then takes the
  // image's present pages as the device's content.
  static absl::StatusOr<std::unique_ptr<TmemSwapBacking>> Open(
      const TmemSwapBackingOptions& options, std::unique_ptr<SpillImage> image);
  TmemSwapBacking(const TmemSwapBacking&) = delete;
  TmemSwapBacking& operator=(const TmemSwapBacking&) = delete;

  uint64_t page_count() const override { return page_count_; }
  absl::Status ReadPages(uint64_t first_page, uint64_t count,
                         std::span<const GuestSpan> dst) override;
  absl::Status WritePages(uint64_t first_page, uint64_t count,
                          std::span<const GuestSpan> src) override;
  absl::Status DiscardPages(uint64_t first_page, uint64_t count) override;
  absl::Status WriteZeroPages(uint64_t first_page, uint64_t count,
                              bool may_unmap) override;
  absl::Status Flush() override;

  // Graceful stop: every store page into the image (and out of the store),
  // then fdatasync. `progress`, if given, counts pages written back as it
  // goes. Returns how many pages it wrote back; an error if any page could
  // not be (that page stays in the store) or the sync failed.
  absl::StatusOr<uint64_t> WriteBackAll(
      std::atomic<uint64_t>* progress = nullptr);

  // One bounded step of relief (see the header comment): moves at most
  // `max_pages` store pages into the image while the store reports an
  // excess. Steps are serialized; any thread.
  ReliefStep RelieveStep(uint64_t max_pages);

  TmemSwapStats Stats() const;
  const SpillImage& image() const { return *image_; }

 private:
  enum class Loc : uint8_t { kNone = 0, kStore = 1, kImage = 2, kLost = 3 };

  TmemSwapBacking(const TmemSwapBackingOptions& options,
                  std::unique_ptr<SpillImage> image);
  Mutex& StripeOf(uint64_t page) { return stripes_[page % kStripes]; }
  void SetLoc(uint64_t page, Loc loc);
  void Inc(TmemSwapCounter c, uint64_t n = 1) {
    counters_[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
  }
  absl::Status CheckRange(uint64_t first_page, uint64_t count) const;
  // One page, its stripe held.
  absl::Status WriteOne(uint64_t page, const uint8_t* buf);
  // `dst` holds the page; `direct`: it is guest memory.
  absl::Status ReadOne(uint64_t page, uint8_t* dst, bool direct);
  // Frees pages (discard, write-zeroes): they read as zeros.
  absl::Status FreePages(uint64_t first_page, uint64_t count,
                         TmemSwapCounter why);
  // A page write failed with `s` (the guest sees an I/O error): counted,
  // logged at most once per kWriteFailureLogNanos.
  void OnWriteFailed(uint64_t page, const absl::Status& s);
  // One page of relief, its stripe held.
  enum class ReliefOutcome : uint8_t {
    kMoved,        // in the image now
    kImageFailed,  // the image write failed: still in the store
    kStoreFailed,  // the get failed or missed: location unchanged
  };
  ReliefOutcome RelieveOneLocked(uint64_t page, uint8_t* buf,
                                 absl::Status* error);

  TmemStore* const store_;
  const VmId vm_;
  const PoolId pool_;
  PutAdvisor* const advisor_;
  const std::function<void(std::string_view, std::string_view)> on_event_;
  const std::unique_ptr<SpillImage> image_;
  const uint64_t page_count_;
  std::array<Mutex, kStripes> stripes_;  // order: host-agent/lock_order.h
  // loc_[p] is read and written only under StripeOf(p) (per-element
  // guarding that the annotations cannot express). One byte per page so
  // pages of different stripes never share a memory location.
  std::vector<uint8_t> loc_;
  std::atomic<uint64_t> in_store_{0};
  std::atomic<uint64_t> in_image_{0};
  std::atomic<uint64_t> lost_{0};
  std::array<std::atomic<uint64_t>, kNumTmemSwapCounters> counters_{};
  // Serializes relief steps; the next page a step looks at. Lock order:
  // host-agent/lock_order.h.
  Mutex relief_mu_;
  uint64_t relief_cursor_ ABSL_GUARDED_BY(relief_mu_) = 0;
  // Write-failure log rate limit: when the last line went out, and the
  // failures since that no line named.
  std::atomic<int64_t> last_failure_log_nanos_{INT64_MIN};
  std::atomic<uint64_t> failures_unlogged_{0};
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_TMEM_SWAP_BACKING_H_
