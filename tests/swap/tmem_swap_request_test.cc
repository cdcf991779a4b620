// virtio-blk requests, walked from a real split ring in test-owned guest
// memory, executed against a TmemSwapBacking (real TmemStore, real spill
// image): full pages read straight into guest memory, partial pages
// read-modify-written across store and image, DISCARD and WRITE_ZEROES
// freeing both, FLUSH syncing the image, and a write nothing can hold
// completing as VIRTIO_BLK_S_IOERR (a full state dir fails exactly those
// writes).
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "host-agent/swap/descriptor_chain.h"
#include "host-agent/swap/tmem_swap_backing.h"
#include "host-agent/swap/virtio_blk.h"
#include "tests/swap/virtq_driver.h"
#include "tests/temp_dir.h"

namespace tmem::swap {
namespace {

using testing::VirtqDriver;

constexpr uint64_t kGpa = 0x40000000;
constexpr uint64_t kUva = 0x7f0000000000;
constexpr uint64_t kSize = 4 << 20;
constexpr uint16_t kQ = 64;
constexpr uint64_t kPages = 256;  // 1 MiB device

class FixedAdvisor final : public PutAdvisor {
 public:
  PutMode Advise(uint32_t, uint64_t, bool) override { return mode; }
  PutMode mode = PutMode::kCompress;
};

class TmemRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<tmem::testing::TempDir>("tmem-swap-request-test");
    ASSERT_FALSE(tmp_->path().empty());
    dir_ = tmp_->path();
    buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, kSize)));
    std::vector<MemoryRegionDesc> t{{kGpa, kSize, kUva, 0}};
    uint8_t* bases[] = {buf_.get()};
    auto m = GuestMemory::FromBuffers(t, bases);
    ASSERT_TRUE(m.ok());
    mem_ = *std::move(m);
    drv_ = std::make_unique<VirtqDriver>(buf_.get(), kGpa, kUva, kSize, kQ);
    config_.capacity_sectors = kPages * kSectorsPerPage;

    StoreOptions so;
    so.memory_cap_bytes = 32ull << 20;
    so.num_shards = 4;
    auto store = TmemStore::Create(so);
    ASSERT_TRUE(store.ok());
    store_ = std::move(*store);
    auto vm = store_->AddVm("vm1", VmPolicy{});
    ASSERT_TRUE(vm.ok());
    vm_ = *vm;
    auto pool = store_->NewPool(vm_, nullptr, PoolKind::kPersistent);
    ASSERT_TRUE(pool.ok());
    pool_ = *pool;
    OpenBacking(dir_);
  }
  void TearDown() override {
    backing_.reset();
    // Lazy: a test that failed half-way may still hold a file open there.
    if (!mounted_.empty()) ::umount2(mounted_.c_str(), MNT_DETACH);
    tmp_.reset();
  }
  // A tmpfs of `bytes` at dir_/small as the state dir of the image
  // (callers skip first unless root); unmounted by TearDown whatever the
  // test did.
  void MountSmallStateDir(uint64_t bytes) {
    const std::string small = dir_ + "/small";
    ASSERT_EQ(::mkdir(small.c_str(), 0700), 0);
    const std::string opts = "size=" + std::to_string(bytes) + ",mode=0700";
    ASSERT_EQ(::mount("tmpfs", small.c_str(), "tmpfs", 0, opts.c_str()), 0)
        << "mount tmpfs at " << small << ": "
        << std::strerror(errno);  // NOLINT(concurrency-mt-unsafe)
    mounted_ = small;
    OpenBacking(small);
  }
  // Page `page` holds seed's bytes (Write's pattern).
  void ExpectPage(uint64_t page, uint8_t seed) {
    std::vector<uint8_t> got;
    ASSERT_EQ(Read(page * kSectorsPerPage, 4096, &got), kVirtioBlkSOk)
        << "page " << page;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], Byte(seed, i)) << "page " << page << " byte " << i;
    }
  }
  void OpenBacking(const std::string& image_dir) {
    backing_.reset();
    SpillImageOptions io;
    io.path = image_dir + "/vm1.swap.img";
    io.page_count = kPages;
    io.io_mode = io_mode_;
    auto img = SpillImage::Open(io);
    ASSERT_TRUE(img.ok()) << img.status();
    TmemSwapBackingOptions o;
    o.store = store_.get();
    o.vm = vm_;
    o.pool = pool_;
    o.advisor = &advisor_;
    o.on_event = [this](std::string_view event, std::string_view detail) {
      events_.emplace_back(std::string(event) + ": " + std::string(detail));
    };
    auto b = TmemSwapBacking::Open(o, std::move(*img));
    ASSERT_TRUE(b.ok()) << b.status();
    backing_ = std::move(*b);
  }

  uint8_t Run(uint16_t head, uint64_t status_gpa) {
    const ChainError e =
        WalkDescriptorChain(mem_, drv_->desc_host(), kQ, head, true, &chain_);
    EXPECT_EQ(e, ChainError::kNone);
    ExecuteBlkRequest(chain_, config_, backing_.get(), &metrics_);
    return *drv_->Host(status_gpa);
  }
  // Writes `len` bytes at `sector`, byte i = seed + i * 7 (not same-filled,
  // so the store really compresses or stores it raw).
  uint8_t Write(uint64_t sector, uint32_t len, uint8_t seed,
                bool indirect = false) {
    uint64_t data = 0;
    uint64_t status = 0;
    const uint16_t head =
        drv_->BlkRequest(kVirtioBlkTOut, sector, len, indirect, &data, &status);
    for (uint32_t i = 0; i < len; ++i) {
      drv_->Host(data)[i] = static_cast<uint8_t>(seed + i * 7);
    }
    return Run(head, status);
  }
  uint8_t Read(uint64_t sector, uint32_t len, std::vector<uint8_t>* got,
               bool indirect = false) {
    uint64_t data = 0;
    uint64_t status = 0;
    const uint16_t head =
        drv_->BlkRequest(kVirtioBlkTIn, sector, len, indirect, &data, &status);
    std::memset(drv_->Host(data), 0xee, len);
    const uint8_t s = Run(head, status);
    got->assign(drv_->Host(data), drv_->Host(data) + len);
    return s;
  }
  uint8_t Zeroing(uint32_t type, uint64_t sector, uint32_t num,
                  uint32_t flags) {
    const uint64_t hdr = drv_->Alloc(16);
    std::memset(drv_->Host(hdr), 0, 16);
    std::memcpy(drv_->Host(hdr), &type, 4);
    const uint64_t seg = drv_->Alloc(16);
    std::memcpy(drv_->Host(seg), &sector, 8);
    std::memcpy(drv_->Host(seg) + 8, &num, 4);
    std::memcpy(drv_->Host(seg) + 12, &flags, 4);
    const uint64_t status = drv_->Alloc(1);
    const uint16_t head =
        drv_->Chain({{hdr, 16, false}, {seg, 16, false}, {status, 1, true}});
    return Run(head, status);
  }
  static uint8_t Byte(uint8_t seed, uint64_t i) {
    return static_cast<uint8_t>(seed + i * 7);
  }

  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<tmem::testing::TempDir> tmp_;
  std::string dir_;  // tmp_'s path
  std::string mounted_;
  std::unique_ptr<uint8_t, Free> buf_;
  GuestMemory mem_;
  std::unique_ptr<VirtqDriver> drv_;
  DescriptorChain chain_;
  BlkDeviceConfig config_;
  SwapMetrics metrics_;
  std::unique_ptr<TmemStore> store_;
  VmId vm_ = 0;
  PoolId pool_ = -1;
  FixedAdvisor advisor_;
  std::unique_ptr<TmemSwapBacking> backing_;
  std::vector<std::string> events_;             // the backing's log lines
  SpillIoMode io_mode_ = SpillIoMode::kDirect;  // for the next OpenBacking
  void FullStateDirFailsExactlyTheWritesItCannotHold();
};

TEST_F(TmemRequestTest, FullPagesRoundTripStraightThroughGuestMemory) {
  ASSERT_EQ(Write(8, 4096 * 3, 1), kVirtioBlkSOk);
  advisor_.mode = PutMode::kDrop;  // the next page goes to the image
  ASSERT_EQ(Write(32, 4096, 2, /*indirect=*/true), kVirtioBlkSOk);
  std::vector<uint8_t> got;
  ASSERT_EQ(Read(8, 4096 * 3, &got), kVirtioBlkSOk);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], Byte(1, i)) << i;
  ASSERT_EQ(Read(32, 4096, &got, /*indirect=*/true), kVirtioBlkSOk);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], Byte(2, i)) << i;
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_in_store, 3u);
  EXPECT_EQ(st.pages_in_image, 1u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kReadsStoreDirect), 3u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kReadsImage), 1u);
  EXPECT_EQ(metrics_.Get(SwapCounter::kBackingErrors), 0u);
}

TEST_F(TmemRequestTest, PartialPagesAreReadModifyWrittenAcrossStoreAndImage) {
  ASSERT_EQ(Write(0, 4096, 0x10), kVirtioBlkSOk);  // page 0: store
  advisor_.mode = PutMode::kDrop;
  ASSERT_EQ(Write(8, 4096, 0x20), kVirtioBlkSOk);  // page 1: image
  advisor_.mode = PutMode::kCompress;
  // Sectors 5..10: the tail of page 0 and the head of page 1.
  ASSERT_EQ(Write(5, 512 * 6, 0x30), kVirtioBlkSOk);
  std::vector<uint8_t> got;
  ASSERT_EQ(Read(0, 8192, &got), kVirtioBlkSOk);
  for (size_t i = 0; i < 8192; ++i) {
    uint8_t want = 0;
    if (i < size_t{5} * 512) {
      want = Byte(0x10, i);
    } else if (i < size_t{11} * 512) {
      want = Byte(0x30, i - size_t{5} * 512);
    } else {
      want = Byte(0x20, i - 4096);
    }
    ASSERT_EQ(got[i], want) << i;
  }
  EXPECT_GT(metrics_.Get(SwapCounter::kPartialPageRmw), 0u);
  // The rewritten page 1 went to the store: the image holds nothing now.
  EXPECT_EQ(backing_->Stats().pages_in_image, 0u);
  auto bytes = backing_->image().AllocatedBytes();
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, 0u);
}

TEST_F(TmemRequestTest, DiscardAndWriteZeroesFreeStoreAndImage) {
  ASSERT_EQ(Write(0, 4096 * 4, 1), kVirtioBlkSOk);
  advisor_.mode = PutMode::kDrop;
  ASSERT_EQ(Write(64, 4096 * 4, 2), kVirtioBlkSOk);
  ASSERT_EQ(Zeroing(kVirtioBlkTDiscard, 0, 16, 0), kVirtioBlkSOk);
  ASSERT_EQ(Zeroing(kVirtioBlkTWriteZeroes, 64, 32, kVirtioBlkWriteZeroesUnmap),
            kVirtioBlkSOk);
  std::vector<uint8_t> got;
  ASSERT_EQ(Read(0, 4096 * 4, &got), kVirtioBlkSOk);
  for (size_t i = 0; i < 8192; ++i) ASSERT_EQ(got[i], 0) << i;
  for (size_t i = 8192; i < got.size(); ++i) {
    ASSERT_EQ(got[i], Byte(1, i)) << i;
  }
  ASSERT_EQ(Read(64, 4096 * 4, &got), kVirtioBlkSOk);
  for (uint8_t b : got) ASSERT_EQ(b, 0);
  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.pages_in_store, 2u);
  EXPECT_EQ(st.pages_in_image, 0u);
  EXPECT_EQ(st.image_allocated_bytes, 0u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kDiscarded), 2u);
  EXPECT_EQ(st.Get(TmemSwapCounter::kZeroed), 4u);
}

TEST_F(TmemRequestTest, FlushSyncsTheImage) {
  advisor_.mode = PutMode::kDrop;
  ASSERT_EQ(Write(0, 4096, 1), kVirtioBlkSOk);
  uint64_t data = 0;
  uint64_t status = 0;
  const uint16_t head =
      drv_->BlkRequest(kVirtioBlkTFlush, 0, 0, false, &data, &status);
  ASSERT_EQ(Run(head, status), kVirtioBlkSOk);
  EXPECT_EQ(backing_->Stats().image_syncs, 1u);
}

// A 32 KiB tmpfs under the image and a store with no room for the VM: the
// write that fits nowhere is an I/O error the guest sees, never a silent
// loss, and the device keeps serving.
TEST_F(TmemRequestTest, AWriteNothingCanHoldIsAnIoError) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  ASSERT_NO_FATAL_FAILURE(MountSmallStateDir(32768));
  advisor_.mode = PutMode::kDrop;
  uint8_t s = kVirtioBlkSOk;
  uint64_t page = 0;
  for (; page < 64 && s == kVirtioBlkSOk; ++page) {
    s = Write(page * kSectorsPerPage, 4096, 3);
  }
  EXPECT_EQ(s, kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kBackingErrors), 1u);
  // The failed page reads as it was (never written: zeros); earlier pages
  // are intact, and the store still takes new pages.
  std::vector<uint8_t> got;
  ASSERT_EQ(Read((page - 1) * kSectorsPerPage, 4096, &got), kVirtioBlkSOk);
  for (uint8_t b : got) ASSERT_EQ(b, 0);
  ASSERT_EQ(Read(0, 4096, &got), kVirtioBlkSOk);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], Byte(3, i));
  advisor_.mode = PutMode::kCompress;
  EXPECT_EQ(Write((page - 1) * kSectorsPerPage, 4096, 4), kVirtioBlkSOk);
}

// The store refuses every put (the VM's quota is below one page) and the
// state dir fills up: exactly the writes that needed a new image block
// complete as VIRTIO_BLK_S_IOERR (counted once each, logged), the failed
// pages read as they were (never written: zeros; a page whose store copy
// the refused put removed: an I/O error, never stale or torn bytes), every
// other page reads back, and overwrites of pages the image already holds,
// reads, discards and flushes keep working.
TEST_F(TmemRequestTest, AFullStateDirFailsExactlyTheWritesItCannotHold) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  FullStateDirFailsExactlyTheWritesItCannotHold();
}

// The same through the page cache (the image's fallback where the
// filesystem refuses O_DIRECT): ENOSPC still reaches the write that needs
// the block.
TEST_F(TmemRequestTest,
       AFullStateDirFailsExactlyTheWritesItCannotHoldBuffered) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  io_mode_ = SpillIoMode::kBuffered;
  FullStateDirFailsExactlyTheWritesItCannotHold();
  EXPECT_FALSE(backing_->image().direct_io());
}

void TmemRequestTest::FullStateDirFailsExactlyTheWritesItCannotHold() {
  ASSERT_NO_FATAL_FAILURE(MountSmallStateDir(65536));
  // Two pages in the store while it still takes them.
  ASSERT_EQ(Write(200 * kSectorsPerPage, 2 * 4096, 50), kVirtioBlkSOk);
  ASSERT_EQ(backing_->Stats().pages_in_store, 2u);
  VmPolicy policy;
  policy.quota_bytes = 1;
  ASSERT_TRUE(store_->SetVmPolicy(vm_, policy).ok());

  // Fill the image one page at a time: the first failure is where it is
  // full (the filesystem's, not the test's, idea of 64 KiB).
  uint64_t full_at = 0;
  for (; full_at < 64; ++full_at) {
    const uint8_t s = Write(full_at * kSectorsPerPage, 4096, 1);
    if (s != kVirtioBlkSOk) {
      ASSERT_EQ(s, kVirtioBlkSIoErr);
      break;
    }
  }
  ASSERT_GT(full_at, 0u);
  ASSERT_LT(full_at, 64u) << "a 64 KiB tmpfs took 64 pages";
  uint64_t failed = 1;
  EXPECT_EQ(metrics_.Get(SwapCounter::kBackingErrors), failed);
  EXPECT_EQ(backing_->Stats().Get(TmemSwapCounter::kSpilledQuota), full_at + 1);

  // More new pages: each fails, each counted once.
  for (uint64_t p = full_at + 1; p < full_at + 4; ++p) {
    EXPECT_EQ(Write(p * kSectorsPerPage, 4096, 1), kVirtioBlkSIoErr);
    ++failed;
  }
  // The store's page is overwritten, refused (its copy goes) and cannot go
  // to the image: the guest is told, and a read of it fails too.
  EXPECT_EQ(Write(200 * kSectorsPerPage, 4096, 51), kVirtioBlkSIoErr);
  ++failed;
  std::vector<uint8_t> got;
  EXPECT_EQ(Read(200 * kSectorsPerPage, 4096, &got), kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kBackingErrors), failed + 1);
  // A request over a page the image holds and one it lacks: the held one
  // is written (a prefix), the request fails.
  EXPECT_EQ(Write((full_at - 1) * kSectorsPerPage, 2 * 4096, 9),
            kVirtioBlkSIoErr);
  ++failed;
  EXPECT_EQ(metrics_.Get(SwapCounter::kBackingErrors), failed + 1);

  // Overwriting pages the image holds needs no new block: it works.
  ASSERT_EQ(Write(0, 2 * 4096, 2), kVirtioBlkSOk);

  // Every other page reads back; the failed ones read as they were.
  ExpectPage(0, 2);
  ExpectPage(1, 2);
  for (uint64_t p = 2; p + 1 < full_at; ++p) ExpectPage(p, 1);
  // The prefix of the failed two-page request is the guest's new bytes.
  std::vector<uint8_t> prefix;
  ASSERT_EQ(Read((full_at - 1) * kSectorsPerPage, 4096, &prefix),
            kVirtioBlkSOk);
  for (size_t i = 0; i < prefix.size(); ++i) ASSERT_EQ(prefix[i], Byte(9, i));
  for (uint64_t p = full_at; p < full_at + 4; ++p) {
    ASSERT_EQ(Read(p * kSectorsPerPage, 4096, &got), kVirtioBlkSOk);
    for (uint8_t b : got) ASSERT_EQ(b, 0) << "page " << p;
  }
  ExpectPage(201, 50);  // the store's other page, untouched
  {
    uint64_t data = 0;
    uint64_t status = 0;
    const uint16_t head =
        drv_->BlkRequest(kVirtioBlkTFlush, 0, 0, false, &data, &status);
    EXPECT_EQ(Run(head, status), kVirtioBlkSOk);
  }

  const TmemSwapStats st = backing_->Stats();
  EXPECT_EQ(st.Get(TmemSwapCounter::kWritesFailed), failed);
  EXPECT_EQ(st.Get(TmemSwapCounter::kImageWriteErrors), failed);
  EXPECT_EQ(st.pages_lost, 1u);  // page 200
  // No page the device does not hold is in the image.
  std::vector<uint64_t> present;
  ASSERT_TRUE(backing_->image()
                  .ForEachPresentRun([&](uint64_t f, uint64_t n) {
                    for (uint64_t p = f; p < f + n; ++p) present.push_back(p);
                  })
                  .ok());
  EXPECT_EQ(present.size(), full_at);
  EXPECT_EQ(st.pages_in_image, full_at);
  // The failures were logged (rate-limited: at least the first).
  ASSERT_FALSE(events_.empty());
  EXPECT_NE(events_.front().find("swap_write_failed"), std::string::npos)
      << events_.front();
  EXPECT_LE(events_.size(), failed);

  // Discarding frees blocks: the page that failed is writable again.
  EXPECT_EQ(
      Zeroing(kVirtioBlkTDiscard, 2 * kSectorsPerPage, 2 * kSectorsPerPage, 0),
      kVirtioBlkSOk);
  ASSERT_EQ(Write(200 * kSectorsPerPage, 4096, 52), kVirtioBlkSOk);
  ExpectPage(200, 52);
}

}  // namespace
}  // namespace tmem::swap
