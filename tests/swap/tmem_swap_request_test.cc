// virtio-blk requests, walked from a real split ring in test-owned guest
// memory, executed against a TmemSwapBacking (real TmemStore, real spill
// image): full pages read straight into guest memory, partial pages
// read-modify-written across store and image, DISCARD and WRITE_ZEROES
// freeing both, FLUSH syncing the image, and a write nothing can hold
// completing as VIRTIO_BLK_S_IOERR.
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
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
    if (!mounted_.empty()) ::umount(mounted_.c_str());
    tmp_.reset();
  }
  void OpenBacking(const std::string& image_dir) {
    backing_.reset();
    SpillImageOptions io;
    io.path = image_dir + "/vm1.swap.img";
    io.page_count = kPages;
    auto img = SpillImage::Open(io);
    ASSERT_TRUE(img.ok()) << img.status();
    auto b = TmemSwapBacking::Open({store_.get(), vm_, pool_, &advisor_},
                                   std::move(*img));
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
  const std::string small = dir_ + "/small";
  ASSERT_EQ(::mkdir(small.c_str(), 0700), 0);
  if (::mount("tmpfs", small.c_str(), "tmpfs", 0, "size=32768,mode=0700") !=
      0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root)";
  }
  mounted_ = small;
  OpenBacking(small);
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

}  // namespace
}  // namespace tmem::swap
