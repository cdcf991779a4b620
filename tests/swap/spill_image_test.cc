// SpillImage on a real file in a private temp directory: sparse creation
// (0600, no blocks), page I/O with aligned and unaligned buffers, hole
// punching freeing blocks, present-page runs surviving a reopen, and every
// refusal of a hostile or invalid image file with its counter and message.
#include "host-agent/swap/spill_image.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPages = 256;  // 1 MiB

std::vector<uint8_t> Pattern(uint64_t page, uint8_t salt = 0) {
  std::vector<uint8_t> p(kSpillPageSize);
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = static_cast<uint8_t>((page * 131 + i * 7 + salt) | 1);
  }
  return p;
}

class SpillImageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<tmem::testing::TempDir>("spill-image-test");
    ASSERT_FALSE(tmp_->path().empty());
    dir_ = tmp_->path();
    path_ = dir_ + "/vm.swap.img";
  }
  void TearDown() override { tmp_.reset(); }

  absl::StatusOr<std::unique_ptr<SpillImage>> Open(
      uint64_t pages = kPages, SpillIoMode mode = SpillIoMode::kDirect) {
    SpillImageOptions o;
    o.path = path_;
    o.page_count = pages;
    o.io_mode = mode;
    o.refusals = &refusals_;
    o.on_event = [this](std::string_view e, std::string_view d) {
      events_.push_back(std::string(e) + ": " + std::string(d));
    };
    return SpillImage::Open(o);
  }

  // A file with the image's size and a page of data, made the way an
  // attacker (or a mistake) would leave it at the image's path.
  void MakeFile(const std::string& p, mode_t mode, uint64_t size) {
    const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fchmod(fd, mode), 0);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
    std::vector<uint8_t> page = Pattern(0);
    ASSERT_EQ(::pwrite(fd, page.data(), page.size(), 0),
              static_cast<ssize_t>(page.size()));
    ::close(fd);
  }

  std::unique_ptr<tmem::testing::TempDir> tmp_;
  std::string dir_;  // tmp_'s path
  std::string path_;
  SpillOpenRefusals refusals_;
  std::vector<std::string> events_;
};

TEST_F(SpillImageTest, CreatesSparsePrivateFileOfTheDeviceSize) {
  auto img = Open();
  ASSERT_TRUE(img.ok()) << img.status();
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kPages * kSpillPageSize);
  EXPECT_EQ(st.st_blocks, 0) << "the image must start sparse";
  // ext4, xfs and btrfs take O_DIRECT; only then must the image use it.
  struct statfs fs {};
  ASSERT_EQ(::statfs(dir_.c_str(), &fs), 0);
  if (fs.f_type == EXT4_SUPER_MAGIC || fs.f_type == XFS_SUPER_MAGIC ||
      fs.f_type == BTRFS_SUPER_MAGIC) {
    EXPECT_TRUE((*img)->direct_io()) << ::testing::PrintToString(events_);
  }
}

TEST_F(SpillImageTest, NeverWrittenPagesReadZerosAndPagesRoundTrip) {
  auto img = Open();
  ASSERT_TRUE(img.ok()) << img.status();
  std::vector<uint8_t> buf(kSpillPageSize + 1, 0xee);
  // Unaligned destination (offset 1) goes through the bounce buffer.
  ASSERT_TRUE((*img)->ReadPage(7, buf.data() + 1).ok());
  EXPECT_TRUE(std::all_of(buf.begin() + 1, buf.end(),
                          [](uint8_t b) { return b == 0; }));
  for (uint64_t p : {0ul, 1ul, 77ul, kPages - 1}) {
    std::vector<uint8_t> src = Pattern(p);
    // Unaligned source too.
    std::vector<uint8_t> shifted(kSpillPageSize + 3);
    std::memcpy(shifted.data() + 3, src.data(), src.size());
    ASSERT_TRUE((*img)->WritePage(p, shifted.data() + 3).ok());
  }
  for (uint64_t p : {0ul, 1ul, 77ul, kPages - 1}) {
    std::vector<uint8_t> out(kSpillPageSize);
    ASSERT_TRUE((*img)->ReadPage(p, out.data()).ok());
    EXPECT_EQ(out, Pattern(p)) << "page " << p;
  }
  EXPECT_EQ((*img)->counters().page_writes.load(), 4u);
  EXPECT_EQ((*img)->counters().page_reads.load(), 5u);
}

TEST_F(SpillImageTest, PagesOutsideTheDeviceAreRefused) {
  auto img = Open();
  ASSERT_TRUE(img.ok()) << img.status();
  std::vector<uint8_t> page(kSpillPageSize);
  EXPECT_EQ((*img)->WritePage(kPages, page.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*img)->ReadPage(kPages, page.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*img)->PunchPages(kPages - 1, 2).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*img)->PunchPages(UINT64_MAX, 2).code(),
            absl::StatusCode::kOutOfRange);
}

TEST_F(SpillImageTest, PunchFreesBlocksAndPagesReadZeros) {
  auto img = Open();
  ASSERT_TRUE(img.ok()) << img.status();
  for (uint64_t p = 0; p < 32; ++p) {
    ASSERT_TRUE((*img)->WritePage(p, Pattern(p).data()).ok());
  }
  ASSERT_TRUE((*img)->Sync().ok());
  auto before = (*img)->AllocatedBytes();
  ASSERT_TRUE(before.ok());
  EXPECT_GE(*before, 32 * kSpillPageSize);
  ASSERT_TRUE((*img)->PunchPages(8, 16).ok());
  auto after = (*img)->AllocatedBytes();
  ASSERT_TRUE(after.ok());
  EXPECT_LE(*after, *before - 16 * kSpillPageSize);
  std::vector<uint8_t> out(kSpillPageSize);
  ASSERT_TRUE((*img)->ReadPage(10, out.data()).ok());
  EXPECT_TRUE(
      std::all_of(out.begin(), out.end(), [](uint8_t b) { return b == 0; }));
  ASSERT_TRUE((*img)->ReadPage(24, out.data()).ok());
  EXPECT_EQ(out, Pattern(24));
  EXPECT_EQ((*img)->counters().punches.load(), 1u);
  EXPECT_EQ((*img)->counters().syncs.load(), 1u);
}

TEST_F(SpillImageTest, PresentRunsSurviveAReopen) {
  {
    auto img = Open();
    ASSERT_TRUE(img.ok()) << img.status();
    for (uint64_t p : {3ul, 4ul, 5ul, 10ul, 100ul, kPages - 1}) {
      ASSERT_TRUE((*img)->WritePage(p, Pattern(p, 9).data()).ok());
    }
    ASSERT_TRUE((*img)->PunchPages(4, 1).ok());
    ASSERT_TRUE((*img)->Sync().ok());
  }
  auto img = Open();
  ASSERT_TRUE(img.ok()) << img.status();
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  ASSERT_TRUE((*img)
                  ->ForEachPresentRun(
                      [&](uint64_t f, uint64_t n) { runs.emplace_back(f, n); })
                  .ok());
  const std::vector<std::pair<uint64_t, uint64_t>> want = {
      {3, 1}, {5, 1}, {10, 1}, {100, 1}, {kPages - 1, 1}};
  EXPECT_EQ(runs, want);
  std::vector<uint8_t> out(kSpillPageSize);
  ASSERT_TRUE((*img)->ReadPage(100, out.data()).ok());
  EXPECT_EQ(out, Pattern(100, 9));
}

TEST_F(SpillImageTest, BufferedModeServesTheSamePages) {
  auto img = Open(kPages, SpillIoMode::kBuffered);
  ASSERT_TRUE(img.ok()) << img.status();
  EXPECT_FALSE((*img)->direct_io());
  ASSERT_TRUE((*img)->WritePage(5, Pattern(5).data()).ok());
  std::vector<uint8_t> out(kSpillPageSize);
  ASSERT_TRUE((*img)->ReadPage(5, out.data()).ok());
  EXPECT_EQ(out, Pattern(5));
}

TEST_F(SpillImageTest, EmptyExistingFileIsSizedNotRefused) {
  MakeFile(path_, 0600, 0);
  ASSERT_EQ(::truncate(path_.c_str(), 0), 0);
  auto img = Open();
  ASSERT_TRUE(img.ok()) << img.status();
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kPages * kSpillPageSize);
  ASSERT_EQ(events_.size(), 1u);
  EXPECT_THAT(events_[0], HasSubstr("spill_image_sized"));
}

// Hostile files: refused with FAILED_PRECONDITION, the path and the reason
// in the message, their own counter bumped, and the file left as it was.

TEST_F(SpillImageTest, SymlinkToAValidImageIsRefused) {
  const std::string target = dir_ + "/real.img";
  MakeFile(target, 0600, kPages * kSpillPageSize);
  ASSERT_EQ(::symlink(target.c_str(), path_.c_str()), 0);
  auto img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_EQ(img.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(img.status().message(), HasSubstr(path_));
  EXPECT_THAT(img.status().message(), HasSubstr("symbolic link"));
  EXPECT_EQ(refusals_.symlink.load(), 1u);
}

TEST_F(SpillImageTest, DanglingSymlinkIsRefusedAndNothingCreated) {
  const std::string target = dir_ + "/elsewhere.img";
  ASSERT_EQ(::symlink(target.c_str(), path_.c_str()), 0);
  auto img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr("symbolic link"));
  EXPECT_EQ(refusals_.symlink.load(), 1u);
  EXPECT_FALSE(std::filesystem::exists(target));
}

TEST_F(SpillImageTest, FifoAndDirectoryAreRefused) {
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  auto img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr("not a regular file"));
  ASSERT_EQ(::unlink(path_.c_str()), 0);
  ASSERT_EQ(::mkdir(path_.c_str(), 0700), 0);
  img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr(path_));
  EXPECT_THAT(img.status().message(), HasSubstr("not a regular file"));
  EXPECT_EQ(refusals_.not_regular.load(), 2u);
}

TEST_F(SpillImageTest, HardLinkedFileIsRefused) {
  const std::string other = dir_ + "/other";
  MakeFile(other, 0600, kPages * kSpillPageSize);
  ASSERT_EQ(::link(other.c_str(), path_.c_str()), 0);
  auto img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr("2 links"));
  EXPECT_EQ(refusals_.extra_links.load(), 1u);
}

TEST_F(SpillImageTest, GroupOrOtherAccessibleFileIsRefused) {
  for (mode_t mode : {0640, 0604, 0660}) {
    MakeFile(path_, mode, kPages * kSpillPageSize);
    auto img = Open();
    ASSERT_FALSE(img.ok()) << std::oct << mode;
    EXPECT_THAT(img.status().message(), HasSubstr("must be 0600"));
    struct stat st {};
    ASSERT_EQ(::stat(path_.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, mode) << "a refused file is left as it was";
    ASSERT_EQ(::unlink(path_.c_str()), 0);
  }
  EXPECT_EQ(refusals_.too_permissive.load(), 3u);
}

TEST_F(SpillImageTest, FileOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  MakeFile(path_, 0600, kPages * kSpillPageSize);
  ASSERT_EQ(::chown(path_.c_str(), 65534, 65534), 0);
  auto img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr("owned by uid 65534"));
  EXPECT_EQ(refusals_.wrong_owner.load(), 1u);
}

TEST_F(SpillImageTest, ImageOfAnotherSizeIsNeverResized) {
  for (uint64_t size :
       {kPages * kSpillPageSize / 2, kPages * kSpillPageSize * 2,
        kPages * kSpillPageSize + 1}) {
    MakeFile(path_, 0600, size);
    auto img = Open();
    ASSERT_FALSE(img.ok());
    EXPECT_THAT(img.status().message(), HasSubstr(path_));
    EXPECT_THAT(img.status().message(), HasSubstr("refusing to resize"));
    struct stat st {};
    ASSERT_EQ(::stat(path_.c_str(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), size);
    ASSERT_EQ(::unlink(path_.c_str()), 0);
  }
  EXPECT_EQ(refusals_.wrong_size.load(), 3u);
}

TEST_F(SpillImageTest, DirectoryWritableByOthersIsRefused) {
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);
  auto img = Open();
  ASSERT_FALSE(img.ok());
  EXPECT_THAT(img.status().message(), HasSubstr("writable by no one else"));
  EXPECT_EQ(refusals_.bad_directory.load(), 1u);
  EXPECT_FALSE(std::filesystem::exists(path_));
}

TEST_F(SpillImageTest, InvalidSizesAreRefused) {
  EXPECT_EQ(Open(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(UINT64_MAX / 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tmem::swap
