#include "host-agent/swap/spill_image.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem::swap {

namespace {

// O_DIRECT wants buffers aligned to the logical block size; a page is
// aligned for every device and filesystem we meet.
struct alignas(kSpillPageSize) AlignedPage {
  std::array<uint8_t, kSpillPageSize> bytes;
};

bool IsAligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kSpillPageSize == 0;
}

// An errno message with the code the caller chose.
absl::Status OsError(absl::StatusCode code, int err, const std::string& what) {
  const absl::Status s = absl::ErrnoToStatus(err, what);
  return {code, s.message()};
}

absl::StatusCode IoCode(int err) {
  return err == ENOSPC || err == EDQUOT ? absl::StatusCode::kResourceExhausted
                                        : absl::StatusCode::kDataLoss;
}

void Bump(std::atomic<uint64_t>* c) {
  if (c != nullptr) c->fetch_add(1, std::memory_order_relaxed);
}

std::string ParentOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void CloseFd(int fd) {
  if (fd >= 0) ::close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SpillImage>> SpillImage::Open(
    const SpillImageOptions& options) {
  SpillOpenRefusals* const r = options.refusals;
  const std::string& path = options.path;
  auto refuse = [&](std::atomic<uint64_t>* counter, const std::string& what) {
    Bump(counter);
    return absl::FailedPreconditionError(
        absl::StrCat("spill image ", path, ": ", what));
  };
  if (path.empty() || options.page_count == 0 ||
      options.page_count > (UINT64_MAX >> 13)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spill image '", path, "': needs a path and 1 to ",
                     UINT64_MAX >> 13, " pages, got ", options.page_count));
  }
  const uint64_t size = options.page_count * kSpillPageSize;
  const uid_t me = ::geteuid();

  // The directory decides who can replace the file under us: it must be
  // ours and writable by no one else (it may be a symlink, as systemd's
  // StateDirectory is under DynamicUser).
  const std::string dir = ParentOf(path);
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0) {
    Bump(r != nullptr ? &r->os_errors : nullptr);
    return OsError(absl::StatusCode::kFailedPrecondition, errno,
                   absl::StrCat("spill image ", path, ": directory ", dir));
  }
  if (!S_ISDIR(ds.st_mode) || ds.st_uid != me ||
      (ds.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return refuse(
        r != nullptr ? &r->bad_directory : nullptr,
        absl::StrCat("directory ", dir, " must be a directory owned by uid ",
                     me, " and writable by no one else (uid ", ds.st_uid,
                     ", mode ", absl::Hex(ds.st_mode & 07777), ")"));
  }

  bool created = false;
  int fd = ::open(path.c_str(),
                  O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) {
    created = true;
  } else if (errno != EEXIST) {
    Bump(r != nullptr ? &r->os_errors : nullptr);
    return OsError(absl::StatusCode::kFailedPrecondition, errno,
                   absl::StrCat("spill image ", path, ": create"));
  } else {
    // Look before opening: opening a FIFO or a device node can block or
    // have side effects.
    struct stat ls {};
    if (::lstat(path.c_str(), &ls) != 0) {
      Bump(r != nullptr ? &r->os_errors : nullptr);
      return OsError(absl::StatusCode::kFailedPrecondition, errno,
                     absl::StrCat("spill image ", path, ": lstat"));
    }
    if (S_ISLNK(ls.st_mode)) {
      return refuse(r != nullptr ? &r->symlink : nullptr,
                    "is a symbolic link (refused: it could point anywhere)");
    }
    if (!S_ISREG(ls.st_mode)) {
      return refuse(r != nullptr ? &r->not_regular : nullptr,
                    "is not a regular file");
    }
    fd = ::open(path.c_str(),
                O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
      if (errno == ELOOP) {
        return refuse(r != nullptr ? &r->symlink : nullptr,
                      "is a symbolic link (refused: it could point anywhere)");
      }
      Bump(r != nullptr ? &r->os_errors : nullptr);
      return OsError(absl::StatusCode::kFailedPrecondition, errno,
                     absl::StrCat("spill image ", path, ": open"));
    }
  }

  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    CloseFd(fd);
    Bump(r != nullptr ? &r->os_errors : nullptr);
    return OsError(absl::StatusCode::kFailedPrecondition, err,
                   absl::StrCat("spill image ", path, ": fstat"));
  }
  auto refuse_fd = [&](std::atomic<uint64_t>* counter,
                       const std::string& what) {
    CloseFd(fd);
    return refuse(counter, what);
  };
  if (!S_ISREG(st.st_mode)) {
    return refuse_fd(r != nullptr ? &r->not_regular : nullptr,
                     "is not a regular file");
  }
  if (st.st_nlink != 1) {
    return refuse_fd(r != nullptr ? &r->extra_links : nullptr,
                     absl::StrCat("has ", st.st_nlink,
                                  " links (a hard link could expose or "
                                  "clobber another file)"));
  }
  if (st.st_uid != me) {
    return refuse_fd(r != nullptr ? &r->wrong_owner : nullptr,
                     absl::StrCat("is owned by uid ", st.st_uid,
                                  ", not by this process (uid ", me, ")"));
  }
  if (created) {
    // The umask can only narrow 0600; make it exact anyway.
    if (::fchmod(fd, 0600) != 0) {
      const int err = errno;
      CloseFd(fd);
      ::unlink(path.c_str());
      Bump(r != nullptr ? &r->os_errors : nullptr);
      return OsError(absl::StatusCode::kFailedPrecondition, err,
                     absl::StrCat("spill image ", path, ": fchmod"));
    }
  } else if ((st.st_mode & 077) != 0) {
    return refuse_fd(
        r != nullptr ? &r->too_permissive : nullptr,
        absl::StrCat("has mode ", absl::Hex(st.st_mode & 07777),
                     ": group or other may access it (swap pages are guest "
                     "memory; it must be 0600)"));
  }
  const auto have = static_cast<uint64_t>(st.st_size);
  if (have != size) {
    if (!created && have != 0) {
      // Never resize an image that holds pages: its size is the device's,
      // and a shrink would drop pages, a grow would hide a config mistake.
      return refuse_fd(
          r != nullptr ? &r->wrong_size : nullptr,
          absl::StrCat("is ", have, " bytes but the device is ", size,
                       " bytes (", options.page_count,
                       " pages); refusing to resize an image that may hold "
                       "pages (move it away to start empty)"));
    }
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const int err = errno;
      CloseFd(fd);
      if (created) ::unlink(path.c_str());
      Bump(r != nullptr ? &r->os_errors : nullptr);
      return OsError(
          absl::StatusCode::kFailedPrecondition, err,
          absl::StrCat("spill image ", path, ": ftruncate to ", size));
    }
    if (!created && options.on_event) {
      options.on_event("spill_image_sized",
                       absl::StrCat(path, ": empty image sized to ", size));
    }
  }

  // Drop O_NONBLOCK (used only to open safely) and ask for O_DIRECT.
  bool direct = false;
  const int fl = ::fcntl(fd, F_GETFL);
  int want = fl & ~O_NONBLOCK;
  if (options.io_mode == SpillIoMode::kDirect) want |= O_DIRECT;
  if (fl < 0 || ::fcntl(fd, F_SETFL, want) != 0) {
    const int err = errno;
    if (options.io_mode == SpillIoMode::kDirect && fl >= 0 &&
        ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == 0) {
      if (options.on_event) {
        options.on_event(
            "spill_image_buffered_io",
            absl::StrCat(path, ": the filesystem refuses O_DIRECT (",
                         absl::ErrnoToStatus(err, "").message(),
                         "); using buffered I/O"));
      }
    } else {
      CloseFd(fd);
      Bump(r != nullptr ? &r->os_errors : nullptr);
      return OsError(absl::StatusCode::kFailedPrecondition, err,
                     absl::StrCat("spill image ", path, ": fcntl"));
    }
  } else {
    direct = options.io_mode == SpillIoMode::kDirect;
  }
  if (direct) {
    // Some filesystems take the flag and refuse the I/O: probe one read.
    AlignedPage probe;  // NOLINT(*-member-init): filled by the read
    if (::pread(fd, probe.bytes.data(), kSpillPageSize, 0) < 0) {
      const int err = errno;
      if (err != EINVAL ||
          ::fcntl(fd, F_SETFL, fl & ~(O_NONBLOCK | O_DIRECT)) != 0) {
        CloseFd(fd);
        Bump(r != nullptr ? &r->os_errors : nullptr);
        return OsError(absl::StatusCode::kFailedPrecondition, err,
                       absl::StrCat("spill image ", path, ": probe read"));
      }
      direct = false;
      if (options.on_event) {
        options.on_event(
            "spill_image_buffered_io",
            absl::StrCat(path,
                         ": the filesystem refuses O_DIRECT reads (EINVAL); "
                         "using buffered I/O"));
      }
    }
  }
  return std::unique_ptr<SpillImage>(
      new SpillImage(fd, path, options.page_count, direct));
}

SpillImage::~SpillImage() { CloseFd(fd_); }

absl::Status SpillImage::CheckPages(uint64_t first, uint64_t count) const {
  if (first > page_count_ || count > page_count_ - first) {
    return absl::OutOfRangeError(absl::StrCat("spill image ", path_,
                                              ": pages [", first, ", +", count,
                                              ") beyond ", page_count_));
  }
  return absl::OkStatus();
}

absl::Status SpillImage::WritePage(uint64_t page, const uint8_t* data) {
  if (absl::Status s = CheckPages(page, 1); !s.ok()) return s;
  AlignedPage bounce;  // NOLINT(*-member-init): filled before use
  const uint8_t* src = data;
  if (direct_ && !IsAligned(data)) {
    std::memcpy(bounce.bytes.data(), data, kSpillPageSize);
    src = bounce.bytes.data();
  }
  size_t done = 0;
  while (done < kSpillPageSize) {
    const ssize_t n =
        ::pwrite(fd_, src + done, kSpillPageSize - done,
                 static_cast<off_t>(page * kSpillPageSize + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      counters_.write_errors.fetch_add(1, std::memory_order_relaxed);
      return OsError(
          IoCode(err), err,
          absl::StrCat("spill image ", path_, ": write of page ", page));
    }
    done += static_cast<size_t>(n);
  }
  counters_.page_writes.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status SpillImage::ReadPage(uint64_t page, uint8_t* out) {
  if (absl::Status s = CheckPages(page, 1); !s.ok()) return s;
  AlignedPage bounce;  // NOLINT(*-member-init): filled before use
  const bool use_bounce = direct_ && !IsAligned(out);
  uint8_t* dst = use_bounce ? bounce.bytes.data() : out;
  size_t done = 0;
  while (done < kSpillPageSize) {
    const ssize_t n = ::pread(fd_, dst + done, kSpillPageSize - done,
                              static_cast<off_t>(page * kSpillPageSize + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // 0: end of file inside the device: someone truncated the image.
      const int err = n < 0 ? errno : EIO;
      counters_.read_errors.fetch_add(1, std::memory_order_relaxed);
      return OsError(
          absl::StatusCode::kDataLoss, err,
          absl::StrCat("spill image ", path_, ": read of page ", page));
    }
    done += static_cast<size_t>(n);
  }
  if (use_bounce) std::memcpy(out, bounce.bytes.data(), kSpillPageSize);
  counters_.page_reads.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status SpillImage::PunchPages(uint64_t first, uint64_t count) {
  if (absl::Status s = CheckPages(first, count); !s.ok()) return s;
  if (count == 0) return absl::OkStatus();
  int rc = 0;
  do {
    rc = ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                     static_cast<off_t>(first * kSpillPageSize),
                     static_cast<off_t>(count * kSpillPageSize));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    counters_.punch_errors.fetch_add(1, std::memory_order_relaxed);
    return OsError(absl::StatusCode::kInternal, err,
                   absl::StrCat("spill image ", path_, ": punch of pages [",
                                first, ", +", count, ")"));
  }
  counters_.punches.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status SpillImage::Sync() {
  if (::fdatasync(fd_) != 0) {
    const int err = errno;
    counters_.sync_errors.fetch_add(1, std::memory_order_relaxed);
    return OsError(absl::StatusCode::kDataLoss, err,
                   absl::StrCat("spill image ", path_, ": fdatasync"));
  }
  counters_.syncs.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status SpillImage::ForEachPresentRun(
    const std::function<void(uint64_t first, uint64_t count)>& fn) const {
  const auto size = static_cast<off_t>(page_count_ * kSpillPageSize);
  off_t off = 0;
  uint64_t run_first = 0;
  uint64_t run_end = 0;  // run_first == run_end: no pending run
  while (off < size) {
    const off_t data = ::lseek(fd_, off, SEEK_DATA);
    if (data < 0) {
      if (errno == ENXIO) break;  // no data at or after `off`
      const int err = errno;
      counters_.seek_errors.fetch_add(1, std::memory_order_relaxed);
      return OsError(absl::StatusCode::kInternal, err,
                     absl::StrCat("spill image ", path_, ": SEEK_DATA"));
    }
    off_t hole = ::lseek(fd_, data, SEEK_HOLE);
    if (hole < 0) {
      const int err = errno;
      counters_.seek_errors.fetch_add(1, std::memory_order_relaxed);
      return OsError(absl::StatusCode::kInternal, err,
                     absl::StrCat("spill image ", path_, ": SEEK_HOLE"));
    }
    if (hole > size) hole = size;
    // A filesystem block smaller than a page: a page with any data counts.
    const uint64_t first = static_cast<uint64_t>(data) / kSpillPageSize;
    const uint64_t end =
        (static_cast<uint64_t>(hole) + kSpillPageSize - 1) / kSpillPageSize;
    if (run_first != run_end && first <= run_end) {
      run_end = std::max(run_end, end);
    } else {
      if (run_first != run_end) fn(run_first, run_end - run_first);
      run_first = first;
      run_end = end;
    }
    if (hole <= off) break;  // no progress: never loop forever
    off = hole;
  }
  if (run_first != run_end) fn(run_first, run_end - run_first);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SpillImage::AllocatedBytes() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    return OsError(absl::StatusCode::kInternal, errno,
                   absl::StrCat("spill image ", path_, ": fstat"));
  }
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

}  // namespace tmem::swap
