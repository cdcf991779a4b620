// The descriptor walker and the split virtqueue against hostile rings:
// loops, chains longer than the queue, nested and malformed indirect
// tables, buffers outside guest memory, wrong direction order, avail index
// jumps; and EVENT_IDX notification rules.
#include "host-agent/swap/descriptor_chain.h"

#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "host-agent/swap/guest_memory.h"
#include "host-agent/swap/split_virtqueue.h"
#include "tests/swap/virtq_driver.h"

namespace tmem::swap {
namespace {

using testing::VirtqDriver;

constexpr uint64_t kGpa = 0x100000;
constexpr uint64_t kUva = 0x7f0000000000;
constexpr uint64_t kSize = 1 << 20;
constexpr uint16_t kQ = 16;

class WalkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, kSize)));
    std::vector<MemoryRegionDesc> t{{kGpa, kSize, kUva, 0}};
    uint8_t* bases[] = {buf_.get()};
    auto m = GuestMemory::FromBuffers(t, bases);
    ASSERT_TRUE(m.ok());
    mem_ = *std::move(m);
    drv_ = std::make_unique<VirtqDriver>(buf_.get(), kGpa, kUva, kSize, kQ);
  }
  ChainError Walk(uint16_t head, bool indirect = true) {
    return WalkDescriptorChain(mem_, drv_->desc_host(), kQ, head, indirect,
                               &chain_);
  }

  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> buf_;
  GuestMemory mem_;
  std::unique_ptr<VirtqDriver> drv_;
  DescriptorChain chain_;
};

TEST_F(WalkerTest, DirectChainSplitsReadableAndWritable) {
  const uint64_t a = drv_->Alloc(16), b = drv_->Alloc(4096), c = drv_->Alloc(1);
  const uint16_t head =
      drv_->Chain({{a, 16, false}, {b, 4096, true}, {c, 1, true}});
  ASSERT_EQ(Walk(head), ChainError::kNone);
  EXPECT_EQ(chain_.readable_len, 16u);
  EXPECT_EQ(chain_.writable_len, 4097u);
  ASSERT_EQ(chain_.writable.size(), 2u);
  EXPECT_EQ(chain_.writable[0].data, drv_->Host(b));
}

TEST_F(WalkerTest, IndirectChain) {
  const uint64_t a = drv_->Alloc(16), c = drv_->Alloc(1);
  const uint16_t head = drv_->ChainIndirect({{a, 16, false}, {c, 1, true}});
  ASSERT_EQ(Walk(head), ChainError::kNone);
  EXPECT_EQ(chain_.readable_len, 16u);
  EXPECT_EQ(chain_.writable_len, 1u);
  EXPECT_EQ(Walk(head, /*indirect=*/false), ChainError::kIndirectNotNegotiated);
}

TEST_F(WalkerTest, RefusesHeadAndNextOutOfRange) {
  EXPECT_EQ(Walk(kQ), ChainError::kHeadOutOfRange);
  EXPECT_EQ(Walk(0xffff), ChainError::kHeadOutOfRange);
  drv_->WriteDesc(0, drv_->Alloc(16), 16, kVirtqDescFNext, kQ);
  EXPECT_EQ(Walk(0), ChainError::kNextOutOfRange);
}

TEST_F(WalkerTest, RefusesLoops) {
  const uint64_t a = drv_->Alloc(16);
  drv_->WriteDesc(0, a, 16, kVirtqDescFNext, 0);  // self loop
  EXPECT_EQ(Walk(0), ChainError::kTooLong);
  drv_->WriteDesc(1, a, 16, kVirtqDescFNext, 2);
  drv_->WriteDesc(2, a, 16, kVirtqDescFNext, 3);
  drv_->WriteDesc(3, a, 16, kVirtqDescFNext, 1);  // 1 -> 2 -> 3 -> 1
  EXPECT_EQ(Walk(1), ChainError::kTooLong);
}

TEST_F(WalkerTest, AcceptsAChainAsLongAsTheQueueButNotLonger) {
  const uint64_t a = drv_->Alloc(16);
  for (uint16_t i = 0; i < kQ; ++i) {
    drv_->WriteDesc(i, a, 16, i + 1 < kQ ? kVirtqDescFNext : 0, i + 1);
  }
  EXPECT_EQ(Walk(0), ChainError::kNone);
  EXPECT_EQ(chain_.readable_len, 16u * kQ);
}

TEST_F(WalkerTest, RefusesIndirectLoopAndNesting) {
  const uint64_t a = drv_->Alloc(16);
  // An indirect table that loops on itself.
  const uint64_t t = drv_->Alloc(32);
  drv_->WriteDesc(drv_->Host(t), 0, a, 16, kVirtqDescFNext, 1);
  drv_->WriteDesc(drv_->Host(t), 1, a, 16, kVirtqDescFNext, 0);
  drv_->WriteDesc(0, t, 32, kVirtqDescFIndirect, 0);
  EXPECT_EQ(Walk(0), ChainError::kTooLong);
  // An indirect descriptor inside an indirect table.
  drv_->WriteDesc(drv_->Host(t), 0, t, 32, kVirtqDescFIndirect, 0);
  EXPECT_EQ(Walk(0), ChainError::kNestedIndirect);
  // INDIRECT together with NEXT.
  drv_->WriteDesc(0, t, 32, kVirtqDescFIndirect | kVirtqDescFNext, 1);
  EXPECT_EQ(Walk(0), ChainError::kIndirectWithNext);
}

TEST_F(WalkerTest, RefusesBadIndirectLengths) {
  const uint64_t t = drv_->Alloc(64);
  drv_->WriteDesc(0, t, 0, kVirtqDescFIndirect, 0);
  EXPECT_EQ(Walk(0), ChainError::kIndirectBadLength);
  drv_->WriteDesc(0, t, 17, kVirtqDescFIndirect, 0);
  EXPECT_EQ(Walk(0), ChainError::kIndirectBadLength);
  drv_->WriteDesc(0, t, 16 * (kMaxIndirectDescriptors + 1), kVirtqDescFIndirect,
                  0);
  EXPECT_EQ(Walk(0), ChainError::kIndirectBadLength);
  drv_->WriteDesc(0, kGpa + kSize - 16, 32, kVirtqDescFIndirect, 0);
  EXPECT_EQ(Walk(0), ChainError::kIndirectOutOfMemory);
}

TEST_F(WalkerTest, RefusesBuffersOutsideGuestMemory) {
  drv_->WriteDesc(0, kGpa + kSize - 8, 16, 0, 0);  // straddles the end
  EXPECT_EQ(Walk(0), ChainError::kBufferOutOfMemory);
  drv_->WriteDesc(0, kGpa - 1, 1, 0, 0);
  EXPECT_EQ(Walk(0), ChainError::kBufferOutOfMemory);
  drv_->WriteDesc(0, std::numeric_limits<uint64_t>::max(), 2, 0, 0);
  EXPECT_EQ(Walk(0), ChainError::kBufferOutOfMemory);
  drv_->WriteDesc(0, 0, 0xffffffffu, 0, 0);
  EXPECT_EQ(Walk(0), ChainError::kBufferOutOfMemory);
}

TEST_F(WalkerTest, RefusesReadableAfterWritable) {
  const uint64_t a = drv_->Alloc(16);
  const uint16_t head = drv_->Chain({{a, 1, true}, {a, 16, false}});
  EXPECT_EQ(Walk(head), ChainError::kReadableAfterWritable);
}

TEST_F(WalkerTest, RefusesMoreThanFourGiB) {
  // Many descriptors each near 4 GiB cannot be in 1 MiB of memory; the
  // total check comes first for a chain of large lengths.
  const uint64_t a = drv_->Alloc(16);
  drv_->WriteDesc(0, a, 16, kVirtqDescFNext, 1);
  drv_->WriteDesc(1, kGpa, 0xffffffffu, 0, 0);
  EXPECT_NE(Walk(0), ChainError::kNone);
}

class VirtqueueTest : public WalkerTest {
 protected:
  void Configure(bool event_idx) {
    ASSERT_TRUE(vq_.Configure(mem_, kQ, drv_->desc_uva(), drv_->avail_uva(),
                              drv_->used_uva(), event_idx)
                    .ok());
  }
  SplitVirtqueue vq_;
};

TEST_F(VirtqueueTest, RefusesBadSizesAndRingsOutsideMemory) {
  EXPECT_FALSE(
      vq_.Configure(mem_, 0, kUva, kUva + 0x1000, kUva + 0x2000, false).ok());
  EXPECT_FALSE(
      vq_.Configure(mem_, 24, kUva, kUva + 0x1000, kUva + 0x2000, false).ok());
  EXPECT_FALSE(
      vq_.Configure(mem_, 65536, kUva, kUva + 0x1000, kUva + 0x2000, false)
          .ok());
  EXPECT_FALSE(vq_.Configure(mem_, kQ, kUva + kSize - 16, kUva + 0x1000,
                             kUva + 0x2000, false)
                   .ok());
  EXPECT_FALSE(vq_.Configure(mem_, kQ, kUva, kUva + 0x1000, kGpa, false)
                   .ok());  // a guest-physical address, not QEMU's
  EXPECT_FALSE(
      vq_.Configure(mem_, kQ, kUva + 8, kUva + 0x1000, kUva + 0x2000, false)
          .ok());  // misaligned descriptor table
  EXPECT_FALSE(vq_.configured());
}

TEST_F(VirtqueueTest, PopsInOrderAndFlagsAnIndexJump) {
  Configure(false);
  uint16_t head;
  EXPECT_EQ(vq_.Pop(&head), SplitVirtqueue::PopResult::kEmpty);
  drv_->Publish(3);
  drv_->Publish(5);
  ASSERT_EQ(vq_.Pop(&head), SplitVirtqueue::PopResult::kHead);
  EXPECT_EQ(head, 3);
  ASSERT_EQ(vq_.Pop(&head), SplitVirtqueue::PopResult::kHead);
  EXPECT_EQ(head, 5);
  vq_.PushUsed(3, 17);
  EXPECT_EQ(drv_->UsedIdx(), 1);
  EXPECT_EQ(drv_->Used(0), std::make_pair(3u, 17u));
  // avail->idx more than a queue ahead of what was consumed.
  drv_->SetAvailIdx(2 + kQ + 1);
  EXPECT_EQ(vq_.Pop(&head), SplitVirtqueue::PopResult::kCorrupt);
  EXPECT_TRUE(vq_.corrupt());
  EXPECT_EQ(vq_.Pop(&head), SplitVirtqueue::PopResult::kEmpty);
}

TEST_F(VirtqueueTest, NoInterruptFlagWithoutEventIdx) {
  Configure(false);
  vq_.PushUsed(0, 1);
  EXPECT_TRUE(vq_.NeedsCall());
  drv_->SetAvailFlags(kVirtqAvailFNoInterrupt);
  vq_.PushUsed(0, 1);
  EXPECT_FALSE(vq_.NeedsCall());
}

TEST_F(VirtqueueTest, EventIdxCallsOnlyWhenUsedEventIsPassed) {
  Configure(true);
  vq_.PushUsed(0, 1);            // used idx 1
  EXPECT_TRUE(vq_.NeedsCall());  // first call always
  drv_->SetUsedEvent(3);         // "call me when used idx passes 3"
  vq_.PushUsed(0, 1);            // 2
  EXPECT_FALSE(vq_.NeedsCall());
  vq_.PushUsed(0, 1);  // 3
  EXPECT_FALSE(vq_.NeedsCall());
  vq_.PushUsed(0, 1);  // 4: passed 3
  EXPECT_TRUE(vq_.NeedsCall());
  // Wrap-around of the 16-bit indices.
  drv_->SetUsedEvent(0xffff);
  for (int i = 0; i < 0xfffb; ++i) vq_.PushUsed(0, 1);  // 0xffff
  EXPECT_FALSE(vq_.NeedsCall());
  vq_.PushUsed(0, 1);  // 0x0000: passed 0xffff
  EXPECT_TRUE(vq_.NeedsCall());
}

TEST_F(VirtqueueTest, EnableKicksPublishesAvailEventAndSeesLateBuffers) {
  Configure(true);
  uint16_t head;
  drv_->Publish(1);
  ASSERT_EQ(vq_.Pop(&head), SplitVirtqueue::PopResult::kHead);
  EXPECT_FALSE(vq_.EnableKicks());
  EXPECT_EQ(drv_->AvailEvent(), 1);
  drv_->Publish(2);  // arrives before the device sleeps
  EXPECT_TRUE(vq_.EnableKicks());
}

}  // namespace
}  // namespace tmem::swap
