#include "host-agent/swap/swap_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "backend/clock.h"
#include "host-agent/log.h"
#include "host-agent/swap/memory_swap_backing.h"
#include "host-agent/swap/tmem_swap_backing.h"

namespace tmem::swap {
namespace {

class MemorySwapStore final : public SwapStore {
 public:
  explicit MemorySwapStore(uint64_t page_count) : backing_(page_count) {}
  SwapBacking& backing() override { return backing_; }
  SwapPageStats PageStats() const override {
    const uint64_t stored = backing_.stored_pages();
    SwapPageStats s;
    s.stored = stored;
    s.in_memory = stored;
    s.memory_bytes = stored * kSwapPageSize;
    return s;
  }
  absl::Status WriteBack() override { return absl::OkStatus(); }

 private:
  MemorySwapBacking backing_;
};

// fsync of a directory: a file created or removed in it survives a crash.
absl::Status SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    return absl::InternalError(
        absl::StrCat("cannot sync directory '", dir,
                     "': ", std::generic_category().message(err)));
  }
  close(fd);
  return absl::OkStatus();
}

// The image's in-use mark (swap_store.h): created only if absent.
absl::Status TakeInUseMark(const std::string& mark, const std::string& image,
                           const std::string& dir,
                           SpillOpenRefusals* refusals) {
  const int fd = open(
      mark.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EEXIST) {
    if (refusals != nullptr) refusals->not_written_back.fetch_add(1);
    return absl::FailedPreconditionError(absl::StrCat(
        "'", mark,
        "' exists: the tmemd that last served this swap device stopped "
        "without writing its pages back (a crash, SIGKILL or failed "
        "write-back), so '",
        image,
        "' lacks the pages it held in memory and is not the device's "
        "content; refusing to serve it rather than read zeros where the "
        "guest wrote. The guest's swapped-out memory is lost: stop the "
        "guest, remove both files, then start it again"));
  }
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create '", mark,
                     "': ", std::generic_category().message(errno)));
  }
  const int synced = fsync(fd);
  const int err = errno;
  close(fd);
  if (synced != 0) {
    (void)unlink(mark.c_str());
    return absl::InternalError(absl::StrCat(
        "cannot sync '", mark, "': ", std::generic_category().message(err)));
  }
  return SyncDirectory(dir);
}

class TmemSwapStore final : public SwapStore {
 public:
  TmemSwapStore(std::string vm_name, std::string in_use_mark, TmemStore* store,
                VmId vm, PoolId pool, std::unique_ptr<TmemSwapBacking> backing)
      : vm_name_(std::move(vm_name)),
        in_use_mark_(std::move(in_use_mark)),
        store_(store),
        vm_(vm),
        pool_(pool),
        backing_(std::move(backing)) {}
  ~TmemSwapStore() override {
    backing_.reset();
    // NOT_FOUND: the VM went first; its pools went with it.
    (void)store_->DestroyPool(vm_, pool_);
  }
  TmemSwapStore(const TmemSwapStore&) = delete;
  TmemSwapStore& operator=(const TmemSwapStore&) = delete;

  SwapBacking& backing() override { return *backing_; }
  SwapPageStats PageStats() const override {
    const TmemSwapStats t = backing_->Stats();
    SwapPageStats s;
    s.in_memory = t.pages_in_store;
    s.spilled = t.pages_in_image;
    s.lost = t.pages_lost;
    s.stored = t.pages_in_store + t.pages_in_image;
    s.memory_bytes = CounterValueOf(t.pool, Counter::kStoredBytes);
    s.compressed_puts = CounterValueOf(t.pool, Counter::kPutsCompressed);
    s.raw_puts = CounterValueOf(t.pool, Counter::kPutsRaw);
    for (int i = 0; i < kNumTmemSwapCounters; ++i) {
      const auto c = static_cast<TmemSwapCounter>(i);
      s.counters.emplace_back(std::string(TmemSwapCounterName(c)), t.Get(c));
    }
    s.counters.emplace_back("image_io_errors", t.image_io_errors);
    return s;
  }
  absl::Status WriteBack() override {
    absl::StatusOr<uint64_t> n = backing_->WriteBackAll();
    if (!n.ok()) return n.status();  // the mark stays: pages may be missing
    // Every page is in the image (synced): it is the whole device now.
    if (unlink(in_use_mark_.c_str()) != 0 && errno != ENOENT) {
      return absl::InternalError(
          absl::StrCat("cannot remove '", in_use_mark_,
                       "': ", std::generic_category().message(errno)));
    }
    return SyncDirectory(
        std::filesystem::path(in_use_mark_).parent_path().string());
  }
  uint64_t RelieveMemory() override {
    const ReliefStep step = backing_->RelieveStep(kReliefBatchPages);
    if (step.moved == 0 && step.error.ok()) return 0;
    unlogged_moved_ += step.moved;
    unlogged_failed_ += step.failed;
    // Catching up on a large device takes many steps (one per tick), and a
    // full disk fails one every tick: a line per kReliefLogNanos says what
    // the steps since the last line did, and one says when the VM is back
    // within its limits.
    const int64_t now = SteadyClock::Default()->NowNanos();
    const bool within = step.error.ok() && step.excess_after == 0;
    if (!within && now - last_log_nanos_ < kReliefLogNanos) return step.moved;
    last_log_nanos_ = now;
    Log(step.error.ok() ? LogLevel::kInfo : LogLevel::kWarn, "swap_relieved",
        {{"vm", vm_name_},
         {"moved_pages", unlogged_moved_},
         {"failed_pages", unlogged_failed_},
         {"excess_bytes", step.before.bytes},
         {"over_quota_bytes", step.before.over_quota},
         {"over_swap_quota_bytes", step.before.over_swap_quota},
         {"host_cap_share_bytes", step.before.host_cap_share},
         {"excess_after_bytes", step.excess_after},
         {"error", step.error.ok() ? std::string()
                                   : std::string(step.error.message())}});
    unlogged_moved_ = 0;
    unlogged_failed_ = 0;
    return step.moved;
  }

 private:
  static constexpr int64_t kReliefLogNanos = 10'000'000'000;
  const std::string vm_name_;
  const std::string in_use_mark_;
  // The agent's ticker only.
  int64_t last_log_nanos_ = INT64_MIN / 2;
  uint64_t unlogged_moved_ = 0;   // pages moved since the last line
  uint64_t unlogged_failed_ = 0;  // pages that failed to move since then
  TmemStore* const store_;
  const VmId vm_;
  const PoolId pool_;
  std::unique_ptr<TmemSwapBacking> backing_;
};

// A directory only this user may write (SpillImage refuses others).
absl::Status MakePrivateDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create '", dir, "': ", std::generic_category().message(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

SwapStoreFactory MemorySwapStoreFactory() {
  return [](const SwapStoreRequest& r)
             -> absl::StatusOr<std::unique_ptr<SwapStore>> {
    return std::make_unique<MemorySwapStore>(r.page_count);
  };
}

SwapStoreFactory TmemSwapStoreFactory(SpillOpenRefusals* refusals) {
  return [refusals](const SwapStoreRequest& r)
             -> absl::StatusOr<std::unique_ptr<SwapStore>> {
    const std::string dir = r.state_dir + "/swap";
    for (const std::string& d : {r.state_dir, dir}) {
      if (absl::Status s = MakePrivateDir(d); !s.ok()) return s;
    }
    SpillImageOptions io;
    io.path = absl::StrCat(dir, "/", r.vm_name, ".img");
    io.page_count = r.page_count;
    io.refusals = refusals;
    io.on_event = [vm = r.vm_name](std::string_view event,
                                   std::string_view detail) {
      Log(LogLevel::kInfo, event, {{"vm", vm}, {"detail", detail}});
    };
    const std::string mark = io.path + ".inuse";
    absl::StatusOr<std::unique_ptr<SpillImage>> image = SpillImage::Open(io);
    if (!image.ok()) return image.status();
    absl::StatusOr<PoolId> pool =
        r.store->NewPool(r.vm, nullptr, PoolKind::kPersistent);
    if (!pool.ok()) return pool.status();
    TmemSwapBackingOptions o;
    o.store = r.store;
    o.vm = r.vm;
    o.pool = *pool;
    o.advisor = r.advisor;
    o.on_event = [vm = r.vm_name](std::string_view event,
                                  std::string_view detail) {
      Log(LogLevel::kWarn, event, {{"vm", vm}, {"detail", detail}});
    };
    absl::StatusOr<std::unique_ptr<TmemSwapBacking>> b =
        TmemSwapBacking::Open(o, std::move(*image));
    // Last: until the device serves, nothing of it is held in memory.
    absl::Status marked =
        b.ok() ? TakeInUseMark(mark, io.path, dir, refusals) : b.status();
    if (!marked.ok()) {
      b = absl::CancelledError();  // the backing goes before its pool
      (void)r.store->DestroyPool(r.vm, *pool);
      return marked;
    }
    return std::make_unique<TmemSwapStore>(r.vm_name, mark, r.store, r.vm,
                                           *pool, std::move(*b));
  };
}

}  // namespace tmem::swap
