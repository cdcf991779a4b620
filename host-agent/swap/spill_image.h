// SpillImage: one swap device's pages on host disk, a sparse file of exactly
// page_count * 4096 bytes where page p lives at offset p * 4096. It is where
// a tmemd swap device puts pages the store cannot or should not hold, and,
// after a graceful stop, the device's whole content.
//
// Contract:
//  * Open creates the file (mode 0600, O_EXCL|O_NOFOLLOW|O_CLOEXEC) inside a
//    directory owned by this user and writable by no one else, and sizes it
//    with ftruncate (sparse: no block is allocated). An existing file is
//    reused only if it is a regular file (not a symlink, FIFO, device or
//    directory) with one link, owned by this user, not accessible to group
//    or other, and exactly the device's size; anything else is refused with
//    FAILED_PRECONDITION naming the path and what is wrong, and counted
//    (SpillOpenRefusals). An existing image is never resized or truncated,
//    except an empty one (0 bytes: it holds no page), which is sized.
//  * Page I/O uses O_DIRECT (no page-cache copy of swap pages) through
//    4 KiB-aligned buffers; a caller buffer that is already aligned is used
//    as is. If the filesystem refuses O_DIRECT, the image falls back to
//    buffered I/O and says why through `on_event` (direct_io() tells).
//  * PunchPages frees pages' blocks at once (fallocate PUNCH_HOLE|KEEP_SIZE):
//    they read as zeros and cost no disk.
//  * ForEachPresentRun walks the runs of pages that hold data
//    (SEEK_DATA/SEEK_HOLE): at open after a graceful stop, the device's
//    content.
//  * Sync is fdatasync: every completed page write then survives a crash.
//  * Every failure is an absl::Status naming the path, page and errno, and
//    bumps its own counter (SpillImageCounters).
// Thread safety: every method may be called from several threads at once
// (pread/pwrite/fallocate at explicit offsets); callers must not write and
// read or punch the same page concurrently.
#ifndef TMEMD_HOST_AGENT_SWAP_SPILL_IMAGE_H_
#define TMEMD_HOST_AGENT_SWAP_SPILL_IMAGE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tmem::swap {

inline constexpr size_t kSpillPageSize = 4096;

// Why Open refused an image file. One counter each (the owner keeps them
// across devices and shows them).
struct SpillOpenRefusals {
  std::atomic<uint64_t> bad_directory{
      0};  // parent not ours / writable by others
  std::atomic<uint64_t> symlink{0};
  std::atomic<uint64_t> not_regular{0};
  std::atomic<uint64_t> extra_links{0};  // st_nlink != 1
  std::atomic<uint64_t> wrong_owner{0};
  std::atomic<uint64_t> too_permissive{0};  // group or other may access
  std::atomic<uint64_t> wrong_size{0};
  std::atomic<uint64_t> os_errors{0};  // open, fstat, ftruncate failed
  // The image's in-use mark was there (swap_store.h): the last tmemd did
  // not write its pages back.
  std::atomic<uint64_t> not_written_back{0};
};

enum class SpillIoMode : uint8_t {
  kDirect,    // O_DIRECT, buffered only if the filesystem refuses it
  kBuffered,  // page cache (tests of the fallback path)
};

struct SpillImageOptions {
  std::string path;
  uint64_t page_count = 0;
  SpillIoMode io_mode = SpillIoMode::kDirect;
  // Events worth a log line (the O_DIRECT fallback, a sized empty image).
  // May be empty.
  std::function<void(std::string_view event, std::string_view detail)> on_event;
  SpillOpenRefusals* refusals = nullptr;  // optional; must outlive Open
};

// Relaxed atomics; any thread may read.
struct SpillImageCounters {
  std::atomic<uint64_t> page_writes{0};
  std::atomic<uint64_t> page_reads{0};
  std::atomic<uint64_t> punches{0};  // PunchPages calls
  std::atomic<uint64_t> syncs{0};
  std::atomic<uint64_t> write_errors{0};  // pwrite failed or was short
  std::atomic<uint64_t> read_errors{0};   // pread failed or was short
  std::atomic<uint64_t> punch_errors{0};
  std::atomic<uint64_t> sync_errors{0};
  std::atomic<uint64_t> seek_errors{0};  // SEEK_DATA/SEEK_HOLE failed
};

class SpillImage {
 public:
  static absl::StatusOr<std::unique_ptr<SpillImage>> Open(
      const SpillImageOptions& options);
  ~SpillImage();
  SpillImage(const SpillImage&) = delete;
  SpillImage& operator=(const SpillImage&) = delete;

  uint64_t page_count() const { return page_count_; }
  const std::string& path() const { return path_; }
  bool direct_io() const { return direct_; }

  // `data` / `out` hold 4096 bytes, any alignment. OUT_OF_RANGE past the
  // device; DATA_LOSS for an I/O error (the page may then be torn).
  absl::Status WritePage(uint64_t page, const uint8_t* data);
  absl::Status ReadPage(uint64_t page, uint8_t* out);
  // Pages [first, first + count) read as zeros and hold no blocks.
  absl::Status PunchPages(uint64_t first, uint64_t count);
  absl::Status Sync();
  // Calls fn(first, count) for each run of pages holding data, in order.
  absl::Status ForEachPresentRun(
      const std::function<void(uint64_t first, uint64_t count)>& fn) const;
  // Disk bytes the image holds (st_blocks * 512).
  absl::StatusOr<uint64_t> AllocatedBytes() const;

  const SpillImageCounters& counters() const { return counters_; }

 private:
  SpillImage(int fd, std::string path, uint64_t page_count, bool direct)
      : fd_(fd),
        path_(std::move(path)),
        page_count_(page_count),
        direct_(direct) {}
  absl::Status CheckPages(uint64_t first, uint64_t count) const;

  const int fd_;
  const std::string path_;
  const uint64_t page_count_;
  const bool direct_;
  mutable SpillImageCounters counters_;
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SPILL_IMAGE_H_
