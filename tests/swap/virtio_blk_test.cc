// virtio-blk requests through the descriptor walker into a
// MemorySwapBacking: data integrity (direct and indirect, aligned and
// partial pages), and every refusal path with its status and counter.
#include "host-agent/swap/virtio_blk.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "host-agent/swap/descriptor_chain.h"
#include "host-agent/swap/memory_swap_backing.h"
#include "tests/swap/virtq_driver.h"

namespace tmem::swap {
namespace {

using testing::VirtqDriver;

constexpr uint64_t kGpa = 0x40000000;
constexpr uint64_t kUva = 0x7f0000000000;
constexpr uint64_t kSize = 4 << 20;
constexpr uint16_t kQ = 64;
constexpr uint64_t kPages = 256;  // 1 MiB device

class BlkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, kSize)));
    std::vector<MemoryRegionDesc> t{{kGpa, kSize, kUva, 0}};
    uint8_t* bases[] = {buf_.get()};
    auto m = GuestMemory::FromBuffers(t, bases);
    ASSERT_TRUE(m.ok());
    mem_ = *std::move(m);
    drv_ = std::make_unique<VirtqDriver>(buf_.get(), kGpa, kUva, kSize, kQ);
    config_.capacity_sectors = kPages * kSectorsPerPage;
  }

  // Runs the chain at `head`; returns the status byte.
  uint8_t Run(uint16_t head, uint64_t status_gpa, uint32_t* used = nullptr) {
    const ChainError e =
        WalkDescriptorChain(mem_, drv_->desc_host(), kQ, head, true, &chain_);
    EXPECT_EQ(e, ChainError::kNone);
    const uint32_t len =
        ExecuteBlkRequest(chain_, config_, &backing_, &metrics_);
    if (used != nullptr) *used = len;
    return *drv_->Host(status_gpa);
  }
  uint8_t Rw(uint32_t type, uint64_t sector, uint32_t len, uint8_t fill,
             std::vector<uint8_t>* read_back = nullptr, bool indirect = false) {
    uint64_t data = 0;
    uint64_t status = 0;
    const uint16_t head =
        drv_->BlkRequest(type, sector, len, indirect, &data, &status);
    if (type == kVirtioBlkTOut) std::memset(drv_->Host(data), fill, len);
    const uint8_t s = Run(head, status);
    if (read_back != nullptr) {
      read_back->assign(drv_->Host(data), drv_->Host(data) + len);
    }
    return s;
  }
  uint8_t Zeroing(uint32_t type, std::vector<std::array<uint64_t, 3>> segs) {
    const uint64_t hdr = drv_->Alloc(16);
    uint8_t* h = drv_->Host(hdr);
    std::memset(h, 0, 16);
    std::memcpy(h, &type, 4);
    const uint64_t seg = drv_->Alloc(16 * segs.size());
    for (size_t i = 0; i < segs.size(); ++i) {
      uint8_t* p = drv_->Host(seg) + 16 * i;
      const uint64_t sector = segs[i][0];
      const auto num = static_cast<uint32_t>(segs[i][1]);
      const auto flags = static_cast<uint32_t>(segs[i][2]);
      std::memcpy(p, &sector, 8);
      std::memcpy(p + 8, &num, 4);
      std::memcpy(p + 12, &flags, 4);
    }
    const uint64_t status = drv_->Alloc(1);
    const uint16_t head =
        drv_->Chain({{hdr, 16, false},
                     {seg, static_cast<uint32_t>(16 * segs.size()), false},
                     {status, 1, true}});
    return Run(head, status);
  }

  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> buf_;
  GuestMemory mem_;
  std::unique_ptr<VirtqDriver> drv_;
  DescriptorChain chain_;
  BlkDeviceConfig config_;
  MemorySwapBacking backing_{kPages};
  SwapMetrics metrics_;
};

TEST_F(BlkTest, WriteThenReadPagesDirectAndIndirect) {
  EXPECT_EQ(Rw(kVirtioBlkTOut, 8, 8192, 0xab), kVirtioBlkSOk);
  EXPECT_EQ(Rw(kVirtioBlkTOut, 24, 4096, 0xcd, nullptr, true), kVirtioBlkSOk);
  std::vector<uint8_t> got;
  EXPECT_EQ(Rw(kVirtioBlkTIn, 8, 12288, 0, &got, true), kVirtioBlkSOk);
  for (size_t i = 0; i < 8192; ++i) ASSERT_EQ(got[i], 0xab) << i;
  for (size_t i = 8192; i < 12288; ++i) ASSERT_EQ(got[i], 0xcd) << i;
  EXPECT_EQ(backing_.stored_pages(), 3u);
  EXPECT_EQ(metrics_.Get(SwapCounter::kBytesRead), 12288u);
  EXPECT_EQ(metrics_.Get(SwapCounter::kPartialPageRmw), 0u);
}

TEST_F(BlkTest, NeverWrittenReadsZerosAndUsedLengthCountsData) {
  uint64_t data, status;
  const uint16_t head =
      drv_->BlkRequest(kVirtioBlkTIn, 0, 4096, false, &data, &status);
  std::memset(drv_->Host(data), 0x77, 4096);
  uint32_t used = 0;
  EXPECT_EQ(Run(head, status, &used), kVirtioBlkSOk);
  EXPECT_EQ(used, 4097u);
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(drv_->Host(data)[i], 0);
}

TEST_F(BlkTest, PartialPagesAreReadModifyWritten) {
  EXPECT_EQ(Rw(kVirtioBlkTOut, 0, 4096, 0x11), kVirtioBlkSOk);
  // Sectors 3..4 of page 0 and 0..5 of page 1 (unaligned on both ends).
  EXPECT_EQ(Rw(kVirtioBlkTOut, 3, 512 * 8, 0x22), kVirtioBlkSOk);
  std::vector<uint8_t> got;
  EXPECT_EQ(Rw(kVirtioBlkTIn, 0, 8192, 0, &got), kVirtioBlkSOk);
  for (size_t i = 0; i < 8192; ++i) {
    const uint8_t want =
        i < size_t{3} * 512 ? 0x11 : (i < size_t{11} * 512 ? 0x22 : 0x00);
    ASSERT_EQ(got[i], want) << i;
  }
  // A read of a single sector in the middle.
  EXPECT_EQ(Rw(kVirtioBlkTIn, 2, 512, 0, &got), kVirtioBlkSOk);
  EXPECT_EQ(got[0], 0x11);
  EXPECT_GT(metrics_.Get(SwapCounter::kPartialPageRmw), 0u);
}

TEST_F(BlkTest, RefusesSectorsBeyondCapacityWithoutOverflow) {
  const uint64_t cap = kPages * kSectorsPerPage;
  EXPECT_EQ(Rw(kVirtioBlkTIn, cap, 512, 0), kVirtioBlkSIoErr);
  EXPECT_EQ(Rw(kVirtioBlkTOut, cap - 7, 4096, 1), kVirtioBlkSIoErr);
  EXPECT_EQ(Rw(kVirtioBlkTOut, std::numeric_limits<uint64_t>::max(), 512, 1),
            kVirtioBlkSIoErr);
  EXPECT_EQ(Rw(kVirtioBlkTIn, (1ull << 55), 4096, 1), kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kRequestsOutOfRange), 4u);
  EXPECT_EQ(Rw(kVirtioBlkTIn, cap - 8, 4096, 0), kVirtioBlkSOk);
  EXPECT_EQ(backing_.stored_pages(), 0u);
}

TEST_F(BlkTest, RefusesDataThatIsNotWholeSectors) {
  EXPECT_EQ(Rw(kVirtioBlkTOut, 0, 100, 1), kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kRequestsUnaligned), 1u);
  EXPECT_EQ(backing_.stored_pages(), 0u);
}

TEST_F(BlkTest, RefusesWrongDirection) {
  // A read whose data buffer the device may not write.
  const uint64_t hdr = drv_->Alloc(16);
  const uint32_t in = kVirtioBlkTIn;
  std::memset(drv_->Host(hdr), 0, 16);
  std::memcpy(drv_->Host(hdr), &in, 4);
  const uint64_t data = drv_->Alloc(4096);
  const uint64_t status = drv_->Alloc(1);
  uint16_t head =
      drv_->Chain({{hdr, 16, false}, {data, 4096, false}, {status, 1, true}});
  EXPECT_EQ(Run(head, status), kVirtioBlkSIoErr);
  // A write whose data the device would have to write.
  const uint32_t out = kVirtioBlkTOut;
  std::memcpy(drv_->Host(hdr), &out, 4);
  head = drv_->Chain({{hdr, 16, false}, {data, 4096, true}, {status, 1, true}});
  EXPECT_EQ(Run(head, status), kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kRequestsBadLayout), 2u);
  EXPECT_EQ(backing_.stored_pages(), 0u);
}

TEST_F(BlkTest, HeaderSplitAcrossBuffersAndShortHeader) {
  const uint64_t hdr = drv_->Alloc(16);
  const uint32_t out = kVirtioBlkTOut;
  const uint64_t sector = 16;
  std::memset(drv_->Host(hdr), 0, 16);
  std::memcpy(drv_->Host(hdr), &out, 4);
  std::memcpy(drv_->Host(hdr) + 8, &sector, 8);
  const uint64_t data = drv_->Alloc(4096);
  std::memset(drv_->Host(data), 0x5c, 4096);
  const uint64_t status = drv_->Alloc(1);
  uint16_t head = drv_->Chain({{hdr, 5, false},
                               {hdr + 5, 11, false},
                               {data, 4096, false},
                               {status, 1, true}});
  EXPECT_EQ(Run(head, status), kVirtioBlkSOk);
  std::vector<uint8_t> got;
  EXPECT_EQ(Rw(kVirtioBlkTIn, 16, 4096, 0, &got), kVirtioBlkSOk);
  EXPECT_EQ(got[4095], 0x5c);
  head = drv_->Chain({{hdr, 15, false}, {status, 1, true}});
  EXPECT_EQ(Run(head, status), kVirtioBlkSIoErr);
}

TEST_F(BlkTest, NoStatusByteCompletesWithLengthZero) {
  const uint64_t hdr = drv_->Alloc(16);
  std::memset(drv_->Host(hdr), 0, 16);
  const uint16_t head = drv_->Chain({{hdr, 16, false}});
  ASSERT_EQ(
      WalkDescriptorChain(mem_, drv_->desc_host(), kQ, head, true, &chain_),
      ChainError::kNone);
  EXPECT_EQ(ExecuteBlkRequest(chain_, config_, &backing_, &metrics_), 0u);
  EXPECT_EQ(metrics_.Get(SwapCounter::kRequestsNoStatus), 1u);
}

TEST_F(BlkTest, FlushGetIdAndUnsupported) {
  EXPECT_EQ(Rw(kVirtioBlkTFlush, 0, 0, 0), kVirtioBlkSOk);
  std::vector<uint8_t> id;
  EXPECT_EQ(Rw(kVirtioBlkTGetId, 0, kVirtioBlkIdBytes, 0, &id), kVirtioBlkSOk);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(id.data())), "tmemd-swap");
  EXPECT_EQ(Rw(99, 0, 0, 0), kVirtioBlkSUnsupp);
  EXPECT_EQ(Rw(kVirtioBlkTFlush, 0, 512, 0), kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kRequestsUnsupported), 1u);
}

TEST_F(BlkTest, DiscardFreesAndWriteZeroesZeroes) {
  EXPECT_EQ(Rw(kVirtioBlkTOut, 0, 4096 * 4, 0x99), kVirtioBlkSOk);
  EXPECT_EQ(backing_.stored_pages(), 4u);
  EXPECT_EQ(Zeroing(kVirtioBlkTDiscard, {{0, 16, 0}}), kVirtioBlkSOk);
  EXPECT_EQ(backing_.stored_pages(), 2u);
  EXPECT_EQ(
      Zeroing(kVirtioBlkTWriteZeroes, {{17, 7, kVirtioBlkWriteZeroesUnmap}}),
      kVirtioBlkSOk);  // sectors 17..23: partial page 2
  std::vector<uint8_t> got;
  EXPECT_EQ(Rw(kVirtioBlkTIn, 0, 4096 * 4, 0, &got), kVirtioBlkSOk);
  for (size_t i = 0; i < size_t{4096} * 4; ++i) {
    const uint8_t want =
        i < 8192 + 512 ? (i < 8192 ? 0 : 0x99) : (i < 12288 ? 0 : 0x99);
    ASSERT_EQ(got[i], want) << i;
  }
  // Unmap flag on a discard, unknown flags: UNSUPP.
  EXPECT_EQ(Zeroing(kVirtioBlkTDiscard, {{0, 8, 1}}), kVirtioBlkSUnsupp);
  EXPECT_EQ(Zeroing(kVirtioBlkTWriteZeroes, {{0, 8, 2}}), kVirtioBlkSUnsupp);
  // Beyond capacity, too many segments, more sectors than the limit.
  EXPECT_EQ(Zeroing(kVirtioBlkTDiscard, {{kPages * 8 - 8, 16, 0}}),
            kVirtioBlkSIoErr);
  EXPECT_EQ(Zeroing(kVirtioBlkTDiscard, {{0, 8, 0}, {8, 8, 0}}),
            kVirtioBlkSIoErr);
  EXPECT_EQ(Zeroing(kVirtioBlkTDiscard,
                    {{std::numeric_limits<uint64_t>::max() - 3, 8, 0}}),
            kVirtioBlkSIoErr);
  EXPECT_EQ(backing_.stored_pages(), 2u);
}

TEST_F(BlkTest, AWriteTheStoreCannotHoldIsAnIoError) {
  MemorySwapBacking small(kPages, /*max_stored=*/1);
  const ChainError ok = ChainError::kNone;
  uint64_t data, status;
  uint16_t head =
      drv_->BlkRequest(kVirtioBlkTOut, 0, 8192, false, &data, &status);
  ASSERT_EQ(
      WalkDescriptorChain(mem_, drv_->desc_host(), kQ, head, true, &chain_),
      ok);
  ExecuteBlkRequest(chain_, config_, &small, &metrics_);
  EXPECT_EQ(*drv_->Host(status), kVirtioBlkSIoErr);
  EXPECT_EQ(metrics_.Get(SwapCounter::kBackingErrors), 1u);
}

TEST(BlkConfigSpace, Layout) {
  BlkDeviceConfig c;
  c.capacity_sectors = 0x123456;
  c.num_queues = 2;
  const std::vector<uint8_t> b = EncodeBlkConfigSpace(c);
  ASSERT_EQ(b.size(), 60u);
  uint64_t cap;
  uint32_t blk;
  uint16_t nq;
  std::memcpy(&cap, b.data(), 8);
  std::memcpy(&blk, b.data() + 20, 4);
  std::memcpy(&nq, b.data() + 34, 2);
  EXPECT_EQ(cap, 0x123456u);
  EXPECT_EQ(blk, 4096u);
  EXPECT_EQ(nq, 2);
  EXPECT_NE(BlkDeviceFeatures(c) & (1ull << kVirtioBlkFMq), 0u);
  c.num_queues = 1;
  EXPECT_EQ(BlkDeviceFeatures(c) & (1ull << kVirtioBlkFMq), 0u);
}

}  // namespace
}  // namespace tmem::swap
