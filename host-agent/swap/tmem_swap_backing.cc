#include "host-agent/swap/tmem_swap_backing.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/clock.h"

namespace tmem::swap {

namespace {

static_assert(kSwapPageSize == kPageSize && kSpillPageSize == kPageSize);

// Pages per store object (see the header).
constexpr int kObjectShift = 6;

ObjectId ObjectOf(uint64_t page) {
  return ObjectId::FromInode(page >> kObjectShift);
}
PageIndex IndexOf(uint64_t page) {
  return page & ((uint64_t{1} << kObjectShift) - 1);
}

struct alignas(kPageSize) PageBuf {
  std::array<uint8_t, kPageSize> bytes;
};

bool AllZero(const uint8_t* p) {
  // A word at a time; the buffer is page-aligned.
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t acc = 0;
  for (size_t i = 0; i < kPageSize / 8; ++i) acc |= w[i];
  return acc == 0;
}

// Walks a request's spans one page at a time.
class PageCursor {
 public:
  explicit PageCursor(std::span<const GuestSpan> spans) : spans_(spans) {}

  // The next page's bytes if they are one contiguous span (then consumed),
  // else nullptr (nothing consumed).
  uint8_t* Contiguous() {
    SkipEmpty();
    if (i_ < spans_.size() && spans_[i_].len - off_ >= kPageSize) {
      uint8_t* p = spans_[i_].data + off_;
      Advance(kPageSize);
      return p;
    }
    return nullptr;
  }
  // Copies the next page out of (to_spans=false) or into the spans.
  void Move(uint8_t* buf, bool to_spans) {
    size_t n = kPageSize;
    while (n > 0) {
      SkipEmpty();
      const GuestSpan& s = spans_[i_];
      const size_t take = std::min(n, s.len - off_);
      if (to_spans) {
        std::memcpy(s.data + off_, buf, take);
      } else {
        std::memcpy(buf, s.data + off_, take);
      }
      buf += take;
      n -= take;
      Advance(take);
    }
  }
  void Zero() {
    static const PageBuf kZero{};
    Move(const_cast<uint8_t*>(kZero.bytes.data()), /*to_spans=*/true);
  }

 private:
  void SkipEmpty() {
    while (i_ < spans_.size() && off_ == spans_[i_].len) {
      ++i_;
      off_ = 0;
    }
  }
  void Advance(size_t n) {
    off_ += n;
    SkipEmpty();
  }
  std::span<const GuestSpan> spans_;
  size_t i_ = 0;
  size_t off_ = 0;
};

absl::Status CheckSpans(uint64_t count, std::span<const GuestSpan> spans) {
  uint64_t total = 0;
  for (const GuestSpan& s : spans) total += s.len;
  if (total != count * kPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("spans hold ", total, " bytes for ", count, " pages"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view TmemSwapCounterName(TmemSwapCounter c) {
  switch (c) {
    case TmemSwapCounter::kPageReads:
      return "page_reads";
    case TmemSwapCounter::kPageWrites:
      return "page_writes";
    case TmemSwapCounter::kReadsZero:
      return "reads_zero";
    case TmemSwapCounter::kReadsStore:
      return "reads_store";
    case TmemSwapCounter::kReadsStoreDirect:
      return "reads_store_direct";
    case TmemSwapCounter::kReadsImage:
      return "reads_image";
    case TmemSwapCounter::kWritesZero:
      return "writes_zero";
    case TmemSwapCounter::kWritesStored:
      return "writes_stored";
    case TmemSwapCounter::kSpilledValve:
      return "spilled_valve";
    case TmemSwapCounter::kSpilledQuota:
      return "spilled_quota";
    case TmemSwapCounter::kSpilledNoMemory:
      return "spilled_no_memory";
    case TmemSwapCounter::kSpilledOther:
      return "spilled_other";
    case TmemSwapCounter::kDiscarded:
      return "discarded";
    case TmemSwapCounter::kZeroed:
      return "zeroed";
    case TmemSwapCounter::kWrittenBack:
      return "written_back";
    case TmemSwapCounter::kStoreErrors:
      return "store_errors";
    case TmemSwapCounter::kStoreMisses:
      return "store_misses";
    case TmemSwapCounter::kImageWriteErrors:
      return "image_write_errors";
    case TmemSwapCounter::kImageReadErrors:
      return "image_read_errors";
    case TmemSwapCounter::kImagePunchErrors:
      return "image_punch_errors";
    case TmemSwapCounter::kImageSyncErrors:
      return "image_sync_errors";
    case TmemSwapCounter::kPagesLost:
      return "pages_lost";
    case TmemSwapCounter::kReadsLost:
      return "reads_lost";
    case TmemSwapCounter::kWritesFailed:
      return "writes_failed";
    case TmemSwapCounter::kRelievedToImage:
      return "relieved_to_image";
    case TmemSwapCounter::kReliefSteps:
      return "relief_steps";
    case TmemSwapCounter::kReliefImageWriteErrors:
      return "relief_image_write_errors";
    case TmemSwapCounter::kReliefStoreErrors:
      return "relief_store_errors";
    case TmemSwapCounter::kReliefQueryErrors:
      return "relief_query_errors";
    case TmemSwapCounter::kNumCounters:
      break;
  }
  return "unknown";
}

TmemSwapBacking::TmemSwapBacking(const TmemSwapBackingOptions& options,
                                 std::unique_ptr<SpillImage> image)
    : store_(options.store),
      vm_(options.vm),
      pool_(options.pool),
      advisor_(options.advisor),
      on_event_(options.on_event),
      image_(std::move(image)),
      page_count_(image_->page_count()),
      loc_(page_count_, static_cast<uint8_t>(Loc::kNone)) {}

absl::StatusOr<std::unique_ptr<TmemSwapBacking>> TmemSwapBacking::Open(
    const TmemSwapBackingOptions& options, std::unique_ptr<SpillImage> image) {
  if (options.store == nullptr || image == nullptr) {
    return absl::InvalidArgumentError("swap backing needs a store and image");
  }
  // Pages the pool held before are no page of this device: drop them, so
  // they neither shadow the image nor hold the VM's quota.
  if (absl::Status s = options.store->InvalidatePool(options.vm, options.pool);
      !s.ok()) {
    return s;
  }
  std::unique_ptr<TmemSwapBacking> b(
      new TmemSwapBacking(options, std::move(image)));
  uint64_t present = 0;
  absl::Status s =
      b->image_->ForEachPresentRun([&](uint64_t first, uint64_t count) {
        for (uint64_t p = first; p < first + count; ++p) {
          b->loc_[p] = static_cast<uint8_t>(Loc::kImage);
        }
        present += count;
      });
  if (!s.ok()) return s;
  b->in_image_.store(present, std::memory_order_relaxed);
  return b;
}

void TmemSwapBacking::SetLoc(uint64_t page, Loc loc) {
  auto gauge = [this](Loc l) -> std::atomic<uint64_t>* {
    switch (l) {
      case Loc::kStore:
        return &in_store_;
      case Loc::kImage:
        return &in_image_;
      case Loc::kLost:
        return &lost_;
      case Loc::kNone:
        break;
    }
    return nullptr;
  };
  const auto old = static_cast<Loc>(loc_[page]);
  if (old == loc) return;
  if (auto* g = gauge(old)) g->fetch_sub(1, std::memory_order_relaxed);
  if (auto* g = gauge(loc)) g->fetch_add(1, std::memory_order_relaxed);
  loc_[page] = static_cast<uint8_t>(loc);
}

absl::Status TmemSwapBacking::CheckRange(uint64_t first_page,
                                         uint64_t count) const {
  if (first_page > page_count_ || count > page_count_ - first_page) {
    return absl::OutOfRangeError(absl::StrCat("pages [", first_page, ", +",
                                              count, ") beyond ", page_count_));
  }
  return absl::OkStatus();
}

absl::Status TmemSwapBacking::WritePages(uint64_t first_page, uint64_t count,
                                         std::span<const GuestSpan> src) {
  if (absl::Status s = CheckRange(first_page, count); !s.ok()) return s;
  if (absl::Status s = CheckSpans(count, src); !s.ok()) return s;
  PageCursor cur(src);
  PageBuf buf;  // NOLINT(*-member-init): filled before use
  for (uint64_t i = 0; i < count; ++i) {
    // The one copy out of guest memory: everything below reads `buf`.
    cur.Move(buf.bytes.data(), /*to_spans=*/false);
    const uint64_t page = first_page + i;
    absl::Status s;
    {
      MutexLock lock(&StripeOf(page));
      s = WriteOne(page, buf.bytes.data());
    }
    if (!s.ok()) {
      OnWriteFailed(page, s);
      return s;
    }
  }
  return absl::OkStatus();
}

void TmemSwapBacking::OnWriteFailed(uint64_t page, const absl::Status& s) {
  Inc(TmemSwapCounter::kWritesFailed);
  const int64_t now = SteadyClock::Default()->NowNanos();
  int64_t last = last_failure_log_nanos_.load(std::memory_order_relaxed);
  // One thread wins the line; the others count themselves into the next.
  if ((last != INT64_MIN && now - last < kWriteFailureLogNanos) ||
      !last_failure_log_nanos_.compare_exchange_strong(
          last, now, std::memory_order_relaxed)) {
    failures_unlogged_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const uint64_t held_back =
      failures_unlogged_.exchange(0, std::memory_order_relaxed);
  if (on_event_) {
    on_event_("swap_write_failed",
              absl::StrCat("page ", page, ": ", s.message(), " (", held_back,
                           " more failed writes since the last "
                           "such line; the guest sees an I/O error)"));
  }
}

absl::Status TmemSwapBacking::WriteOne(uint64_t page, const uint8_t* buf) {
  Inc(TmemSwapCounter::kPageWrites);
  const auto old = static_cast<Loc>(loc_[page]);
  const ObjectId oid = ObjectOf(page);
  const PageIndex index = IndexOf(page);

  if (AllZero(buf)) {
    Inc(TmemSwapCounter::kWritesZero);
    if (old == Loc::kStore) {
      if (absl::Status s = store_->InvalidatePage(vm_, pool_, oid, index);
          !s.ok()) {
        // The store still holds the old bytes: keep pointing at them and
        // fail the write (previous content kept).
        Inc(TmemSwapCounter::kStoreErrors);
        return s;
      }
    } else if (old == Loc::kImage) {
      if (!image_->PunchPages(page, 1).ok()) {
        // The hole is not there: write the zeros instead, so the image
        // never holds a stale page.
        Inc(TmemSwapCounter::kImagePunchErrors);
        if (absl::Status s = image_->WritePage(page, buf); !s.ok()) {
          Inc(TmemSwapCounter::kImageWriteErrors);
          return s;
        }
        return absl::OkStatus();  // stays kImage, holding zeros
      }
    }
    SetLoc(page, Loc::kNone);
    return absl::OkStatus();
  }

  const PutMode mode = advisor_ != nullptr
                           ? advisor_->Advise(vm_, KeyHash(oid, index),
                                              /*guest_applies_hint=*/false)
                           : PutMode::kDefer;
  // Whether the store may still hold the page's previous bytes.
  bool store_has_old = old == Loc::kStore;
  if (mode == PutMode::kDrop) {
    Inc(TmemSwapCounter::kSpilledValve);
  } else {
    absl::StatusOr<PutResult> r =
        store_->Put(vm_, pool_, oid, index, ConstPage(buf, kPageSize), mode);
    if (r.ok() && r->stored) {
      if (old == Loc::kImage && !image_->PunchPages(page, 1).ok()) {
        // The stale copy stays in the image but nothing reads it: the page
        // is located in the store, and WriteBackAll overwrites it.
        Inc(TmemSwapCounter::kImagePunchErrors);
      }
      Inc(TmemSwapCounter::kWritesStored);
      SetLoc(page, Loc::kStore);
      return absl::OkStatus();
    }
    if (!r.ok()) {
      // The pool or VM is gone (an operator forgot it): the image still
      // serves the guest.
      Inc(TmemSwapCounter::kStoreErrors);
      Inc(TmemSwapCounter::kSpilledOther);
    } else {
      store_has_old = false;  // a refused put removes the earlier page
      switch (r->reason) {
        case RefuseReason::kQuota:
          Inc(TmemSwapCounter::kSpilledQuota);
          break;
        case RefuseReason::kNoMemory:
          Inc(TmemSwapCounter::kSpilledNoMemory);
          break;
        default:
          Inc(TmemSwapCounter::kSpilledOther);
          break;
      }
    }
  }

  if (absl::Status s = image_->WritePage(page, buf); !s.ok()) {
    Inc(TmemSwapCounter::kImageWriteErrors);
    // The page is not located in the image: whatever the failed write left
    // there must not come back after a restart (Open takes present pages).
    if (old != Loc::kImage && !image_->PunchPages(page, 1).ok()) {
      Inc(TmemSwapCounter::kImagePunchErrors);
    }
    if (old == Loc::kStore && !store_has_old) {
      Inc(TmemSwapCounter::kPagesLost);
      SetLoc(page, Loc::kLost);
    }
    return s;
  }
  if (store_has_old) {
    // The image holds the new bytes; the store's older copy must go.
    if (!store_->InvalidatePage(vm_, pool_, oid, index).ok()) {
      Inc(TmemSwapCounter::kStoreErrors);
    }
  }
  SetLoc(page, Loc::kImage);
  return absl::OkStatus();
}

absl::Status TmemSwapBacking::ReadPages(uint64_t first_page, uint64_t count,
                                        std::span<const GuestSpan> dst) {
  if (absl::Status s = CheckRange(first_page, count); !s.ok()) return s;
  if (absl::Status s = CheckSpans(count, dst); !s.ok()) return s;
  PageCursor cur(dst);
  PageBuf bounce;  // NOLINT(*-member-init): filled before use
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t page = first_page + i;
    uint8_t* direct = cur.Contiguous();
    {
      MutexLock lock(&StripeOf(page));
      absl::Status s =
          ReadOne(page, direct != nullptr ? direct : bounce.bytes.data(),
                  direct != nullptr);
      if (!s.ok()) return s;
    }
    if (direct == nullptr) cur.Move(bounce.bytes.data(), /*to_spans=*/true);
  }
  return absl::OkStatus();
}

absl::Status TmemSwapBacking::ReadOne(uint64_t page, uint8_t* dst,
                                      bool direct) {
  Inc(TmemSwapCounter::kPageReads);
  const ObjectId oid = ObjectOf(page);
  const PageIndex index = IndexOf(page);
  switch (static_cast<Loc>(loc_[page])) {
    case Loc::kNone:
      Inc(TmemSwapCounter::kReadsZero);
      std::memset(dst, 0, kPageSize);
      return absl::OkStatus();
    case Loc::kLost:
      Inc(TmemSwapCounter::kReadsLost);
      return absl::DataLossError(absl::StrCat("swap page ", page,
                                              " was lost by a failed write (",
                                              image_->path(), ")"));
    case Loc::kStore: {
      // A persistent pool's get is not exclusive, and decoding writes each
      // output byte without deciding anything from what it wrote (LZ4's
      // bounds come from the block), so it may decode into guest memory.
      absl::StatusOr<bool> hit =
          store_->Get(vm_, pool_, oid, index, MutablePage(dst, kPageSize));
      if (advisor_ != nullptr) {
        advisor_->OnGet(vm_, KeyHash(oid, index), hit.ok() && *hit);
      }
      if (!hit.ok()) {
        Inc(TmemSwapCounter::kStoreErrors);
        return absl::DataLossError(absl::StrCat(
            "swap page ", page, ": store: ", hit.status().message()));
      }
      if (!*hit) {
        Inc(TmemSwapCounter::kStoreMisses);
        return absl::DataLossError(
            absl::StrCat("swap page ", page, " missing from its pool"));
      }
      Inc(TmemSwapCounter::kReadsStore);
      if (direct) Inc(TmemSwapCounter::kReadsStoreDirect);
      return absl::OkStatus();
    }
    case Loc::kImage: {
      if (advisor_ != nullptr) {
        advisor_->OnGet(vm_, KeyHash(oid, index), /*hit=*/false);
      }
      // O_DIRECT straight into guest memory when it is page-aligned (it is
      // for Linux's swap I/O); SpillImage bounces otherwise.
      if (absl::Status s = image_->ReadPage(page, dst); !s.ok()) {
        Inc(TmemSwapCounter::kImageReadErrors);
        return s;
      }
      Inc(TmemSwapCounter::kReadsImage);
      return absl::OkStatus();
    }
  }
  return absl::InternalError("bad page location");
}

absl::Status TmemSwapBacking::FreePages(uint64_t first_page, uint64_t count,
                                        TmemSwapCounter why) {
  if (absl::Status s = CheckRange(first_page, count); !s.ok()) return s;
  // Image pages are marked free first and their runs punched after, one
  // call per run (a guest discards whole clusters): no request for these
  // pages runs concurrently, so no one writes them in between.
  struct Run {
    uint64_t first;
    uint64_t end;
  };
  std::vector<Run> runs;
  absl::Status first_error;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t page = first_page + i;
    MutexLock lock(&StripeOf(page));
    const auto loc = static_cast<Loc>(loc_[page]);
    if (loc == Loc::kNone) continue;
    if (loc == Loc::kStore) {
      if (absl::Status s =
              store_->InvalidatePage(vm_, pool_, ObjectOf(page), IndexOf(page));
          !s.ok()) {
        Inc(TmemSwapCounter::kStoreErrors);
        if (first_error.ok()) first_error = s;
        continue;  // still there: keep pointing at it
      }
    } else if (loc == Loc::kImage) {
      if (!runs.empty() && runs.back().end == page) {
        runs.back().end = page + 1;
      } else {
        runs.push_back({page, page + 1});
      }
    }
    Inc(why);
    SetLoc(page, Loc::kNone);
  }
  static const PageBuf kZero{};
  for (const Run& r : runs) {
    if (image_->PunchPages(r.first, r.end - r.first).ok()) continue;
    // No hole: write zeros instead, so that the image never holds a page
    // the device no longer has (it would come back after a restart).
    Inc(TmemSwapCounter::kImagePunchErrors);
    for (uint64_t p = r.first; p < r.end; ++p) {
      if (absl::Status s = image_->WritePage(p, kZero.bytes.data()); !s.ok()) {
        Inc(TmemSwapCounter::kImageWriteErrors);
        if (first_error.ok()) first_error = s;
      }
    }
  }
  return first_error;
}

absl::Status TmemSwapBacking::DiscardPages(uint64_t first_page,
                                           uint64_t count) {
  return FreePages(first_page, count, TmemSwapCounter::kDiscarded);
}

absl::Status TmemSwapBacking::WriteZeroPages(uint64_t first_page,
                                             uint64_t count,
                                             bool /*may_unmap*/) {
  // A page located nowhere reads as zeros: freeing is writing zeros.
  return FreePages(first_page, count, TmemSwapCounter::kZeroed);
}

absl::Status TmemSwapBacking::Flush() {
  if (absl::Status s = image_->Sync(); !s.ok()) {
    Inc(TmemSwapCounter::kImageSyncErrors);
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TmemSwapBacking::WriteBackAll(
    std::atomic<uint64_t>* progress) {
  PageBuf buf;  // NOLINT(*-member-init): filled before use
  uint64_t written = 0;
  uint64_t failed = 0;
  absl::Status first_error;
  for (uint64_t page = 0; page < page_count_; ++page) {
    MutexLock lock(&StripeOf(page));
    if (static_cast<Loc>(loc_[page]) != Loc::kStore) continue;
    const ObjectId oid = ObjectOf(page);
    const PageIndex index = IndexOf(page);
    absl::StatusOr<bool> hit = store_->Get(
        vm_, pool_, oid, index, MutablePage(buf.bytes.data(), kPageSize));
    absl::Status s;
    if (!hit.ok()) {
      Inc(TmemSwapCounter::kStoreErrors);
      s = hit.status();
    } else if (!*hit) {
      Inc(TmemSwapCounter::kStoreMisses);
      s = absl::DataLossError(
          absl::StrCat("swap page ", page, " missing from its pool"));
    } else if (s = image_->WritePage(page, buf.bytes.data()); !s.ok()) {
      Inc(TmemSwapCounter::kImageWriteErrors);
    }
    if (!s.ok()) {
      ++failed;
      if (first_error.ok()) first_error = s;
      continue;
    }
    // The image holds it now; the store's copy would only hold quota.
    if (!store_->InvalidatePage(vm_, pool_, oid, index).ok()) {
      Inc(TmemSwapCounter::kStoreErrors);
    }
    SetLoc(page, Loc::kImage);
    Inc(TmemSwapCounter::kWrittenBack);
    ++written;
    if (progress != nullptr) progress->fetch_add(1, std::memory_order_relaxed);
  }
  if (absl::Status s = Flush(); !s.ok()) return s;
  if (!first_error.ok()) {
    return absl::Status(
        first_error.code(),
        absl::StrCat(failed, " store pages not written back to ",
                     image_->path(), " (", written,
                     " were); first: ", first_error.message()));
  }
  return written;
}

TmemSwapBacking::ReliefOutcome TmemSwapBacking::RelieveOneLocked(
    uint64_t page, uint8_t* buf, absl::Status* error) {
  const ObjectId oid = ObjectOf(page);
  const PageIndex index = IndexOf(page);
  absl::StatusOr<bool> hit =
      store_->Get(vm_, pool_, oid, index, MutablePage(buf, kPageSize));
  if (!hit.ok() || !*hit) {
    Inc(hit.ok() ? TmemSwapCounter::kStoreMisses
                 : TmemSwapCounter::kStoreErrors);
    Inc(TmemSwapCounter::kReliefStoreErrors);
    *error = hit.ok() ? absl::DataLossError(absl::StrCat(
                            "swap page ", page, " missing from its pool"))
                      : hit.status();
    return ReliefOutcome::kStoreFailed;
  }
  if (absl::Status s = image_->WritePage(page, buf); !s.ok()) {
    // Still in the store, still located there: nothing lost. What the
    // failed write left in the image goes, as for any page not there.
    Inc(TmemSwapCounter::kImageWriteErrors);
    Inc(TmemSwapCounter::kReliefImageWriteErrors);
    if (!image_->PunchPages(page, 1).ok()) {
      Inc(TmemSwapCounter::kImagePunchErrors);
    }
    *error = s;
    return ReliefOutcome::kImageFailed;
  }
  SetLoc(page, Loc::kImage);
  if (absl::Status s = store_->InvalidatePage(vm_, pool_, oid, index);
      !s.ok()) {
    // The image serves the page; the store's copy holds charge until the
    // key is written again (a put replaces it) or the pool goes.
    Inc(TmemSwapCounter::kStoreErrors);
    Inc(TmemSwapCounter::kReliefStoreErrors);
    *error = s;
  }
  Inc(TmemSwapCounter::kRelievedToImage);
  return ReliefOutcome::kMoved;
}

ReliefStep TmemSwapBacking::RelieveStep(uint64_t max_pages) {
  ReliefStep step;
  absl::StatusOr<PersistentExcess> excess = store_->PersistentExcessBytes(vm_);
  if (!excess.ok()) {
    Inc(TmemSwapCounter::kReliefQueryErrors);
    step.error = excess.status();
    return step;
  }
  step.before = *excess;
  step.excess_after = excess->bytes;
  // An excess this device holds no store page of is not its to relieve
  // (nothing to scan for).
  if (excess->bytes == 0 || in_store_.load(std::memory_order_relaxed) == 0) {
    return step;
  }
  MutexLock relief(&relief_mu_);
  PageBuf buf;  // NOLINT(*-member-init): filled before use
  const uint64_t scan_limit = std::min(page_count_, kReliefScanPages);
  while (step.moved < max_pages && step.scanned < scan_limit &&
         step.excess_after > 0) {
    const uint64_t page = relief_cursor_;
    relief_cursor_ = (relief_cursor_ + 1) % page_count_;
    ++step.scanned;
    ReliefOutcome outcome = ReliefOutcome::kMoved;
    {
      MutexLock lock(&StripeOf(page));
      if (static_cast<Loc>(loc_[page]) != Loc::kStore) continue;
      absl::Status error;
      outcome = RelieveOneLocked(page, buf.bytes.data(), &error);
      if (!error.ok() && step.error.ok()) step.error = error;
    }
    if (outcome == ReliefOutcome::kImageFailed) {
      // A full or failing disk: stop here; the next step tries this page
      // again first.
      ++step.failed;
      relief_cursor_ = page;
      break;
    }
    if (outcome == ReliefOutcome::kStoreFailed) {
      ++step.failed;  // this page's own trouble: go on with the next
      continue;
    }
    ++step.moved;
    excess = store_->PersistentExcessBytes(vm_);
    if (!excess.ok()) {
      Inc(TmemSwapCounter::kReliefQueryErrors);
      if (step.error.ok()) step.error = excess.status();
      break;
    }
    step.excess_after = excess->bytes;
  }
  if (step.moved > 0) Inc(TmemSwapCounter::kReliefSteps);
  return step;
}

TmemSwapStats TmemSwapBacking::Stats() const {
  TmemSwapStats out;
  out.page_count = page_count_;
  out.pages_in_store = in_store_.load(std::memory_order_relaxed);
  out.pages_in_image = in_image_.load(std::memory_order_relaxed);
  out.pages_lost = lost_.load(std::memory_order_relaxed);
  if (absl::StatusOr<uint64_t> a = image_->AllocatedBytes(); a.ok()) {
    out.image_allocated_bytes = *a;
  }
  out.image_direct_io = image_->direct_io();
  const SpillImageCounters& ic = image_->counters();
  out.image_page_writes = ic.page_writes.load(std::memory_order_relaxed);
  out.image_page_reads = ic.page_reads.load(std::memory_order_relaxed);
  out.image_punches = ic.punches.load(std::memory_order_relaxed);
  out.image_syncs = ic.syncs.load(std::memory_order_relaxed);
  out.image_io_errors = ic.write_errors.load(std::memory_order_relaxed) +
                        ic.read_errors.load(std::memory_order_relaxed) +
                        ic.punch_errors.load(std::memory_order_relaxed) +
                        ic.sync_errors.load(std::memory_order_relaxed) +
                        ic.seek_errors.load(std::memory_order_relaxed);
  for (int i = 0; i < kNumTmemSwapCounters; ++i) {
    out.counters[i] = counters_[i].load(std::memory_order_relaxed);
  }
  if (absl::StatusOr<VmStats> vs = store_->GetVmStats(vm_); vs.ok()) {
    for (const PoolStats& p : vs->pools) {
      if (p.id == pool_) out.pool = p.counters;
    }
  }
  return out;
}

}  // namespace tmem::swap
