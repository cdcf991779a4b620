// The vhost-user message parser against well-formed and hostile frames.
#include "host-agent/swap/vhost_user_message.h"

#include <cstring>
#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace tmem::swap {
namespace {

class Frame {
 public:
  Frame(uint32_t request, uint32_t flags = kVhostUserVersion) {
    Put32(request);
    Put32(flags);
    Put32(0);  // size, fixed up by bytes()
  }
  Frame& Put32(uint32_t v) {
    Append(&v, 4);
    return *this;
  }
  Frame& Put64(uint64_t v) {
    Append(&v, 8);
    return *this;
  }
  Frame& PutBytes(size_t n, uint8_t v = 0) {
    b_.insert(b_.end(), n, v);
    return *this;
  }
  std::vector<uint8_t> bytes(std::optional<uint32_t> size = {}) const {
    std::vector<uint8_t> out = b_;
    const uint32_t s = size.value_or(static_cast<uint32_t>(b_.size() - 12));
    std::memcpy(out.data() + 8, &s, 4);
    return out;
  }

 private:
  void Append(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b_.insert(b_.end(), c, c + n);
  }
  std::vector<uint8_t> b_;
};

Frame MemTable(uint32_t n) {
  Frame f(5);
  f.Put32(n).Put32(0);
  for (uint32_t i = 0; i < n; ++i) {
    f.Put64(0x100000ULL * i)
        .Put64(0x1000)
        .Put64(0x7f0000000000ULL + uint64_t{i} * 0x100000)
        .Put64(0);
  }
  return f;
}

TEST(VhostUserMessage, ParsesGetFeatures) {
  auto m = ParseVhostUserMessage(Frame(1).bytes(), 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->request, VhostUserRequest::kGetFeatures);
  EXPECT_FALSE(m->need_reply);
}

TEST(VhostUserMessage, ParsesSetFeaturesWithNeedReply) {
  auto m = ParseVhostUserMessage(
      Frame(2, kVhostUserVersion | kVhostUserFlagNeedReply)
          .Put64(0x1234)
          .bytes(),
      0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->u64, 0x1234u);
  EXPECT_TRUE(m->need_reply);
}

TEST(VhostUserMessage, RefusesBadVersionReplyBitAndUnknownFlags) {
  EXPECT_FALSE(ParseVhostUserMessage(Frame(1, 0).bytes(), 0).ok());
  EXPECT_FALSE(ParseVhostUserMessage(Frame(1, 2).bytes(), 0).ok());
  EXPECT_FALSE(ParseVhostUserMessage(
                   Frame(1, kVhostUserVersion | kVhostUserFlagReply).bytes(), 0)
                   .ok());
  EXPECT_FALSE(
      ParseVhostUserMessage(Frame(1, kVhostUserVersion | 0x100).bytes(), 0)
          .ok());
}

TEST(VhostUserMessage, RefusesSizeMismatchAndOversize) {
  // Header says 8 bytes, none arrived.
  EXPECT_FALSE(ParseVhostUserMessage(Frame(2).bytes(8), 0).ok());
  // Header says 0, 8 arrived.
  EXPECT_FALSE(ParseVhostUserMessage(Frame(2).Put64(1).bytes(0), 0).ok());
  // SET_FEATURES with 4 bytes.
  EXPECT_FALSE(ParseVhostUserMessage(Frame(2).Put32(1).bytes(), 0).ok());
  // GET_FEATURES with a payload.
  EXPECT_FALSE(ParseVhostUserMessage(Frame(1).Put64(1).bytes(), 0).ok());
  // Over the limit, even for an unknown request.
  Frame big(99);
  big.PutBytes(kVhostUserMaxPayload + 1);
  EXPECT_FALSE(ParseVhostUserMessage(big.bytes(), 0).ok());
  EXPECT_FALSE(
      ParseVhostUserHeaderSize(Frame(1).bytes(kVhostUserMaxPayload + 1)).ok());
  EXPECT_FALSE(ParseVhostUserHeaderSize(Frame(1).bytes(0xffffffffu)).ok());
  // A truncated header.
  std::vector<uint8_t> shortb = Frame(1).bytes();
  shortb.resize(11);
  EXPECT_FALSE(ParseVhostUserMessage(shortb, 0).ok());
}

TEST(VhostUserMessage, MemTableCountsAndFds) {
  auto m = ParseVhostUserMessage(MemTable(2).bytes(), 2);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->regions.size(), 2u);
  EXPECT_EQ(m->regions[1].guest_phys_addr, 0x100000u);
  EXPECT_EQ(m->regions[1].userspace_addr, 0x7f0000100000u);
  // fd count must equal the region count.
  EXPECT_FALSE(ParseVhostUserMessage(MemTable(2).bytes(), 1).ok());
  EXPECT_FALSE(ParseVhostUserMessage(MemTable(2).bytes(), 3).ok());
  // 0 regions, and more than the limit (even with matching fds).
  EXPECT_FALSE(ParseVhostUserMessage(MemTable(0).bytes(), 0).ok());
  EXPECT_FALSE(ParseVhostUserMessage(MemTable(9).bytes(), 9).ok());
  // Count says 2, only one region's bytes.
  Frame lying(5);
  lying.Put32(2).Put32(0).Put64(0).Put64(0x1000).Put64(0).Put64(0);
  EXPECT_FALSE(ParseVhostUserMessage(lying.bytes(), 2).ok());
  // Count says 0x80000001: must not overflow into a small size.
  Frame huge(5);
  huge.Put32(0x80000001u).Put32(0);
  EXPECT_FALSE(ParseVhostUserMessage(huge.bytes(), 0).ok());
}

TEST(VhostUserMessage, VringFdWords) {
  auto with_fd = ParseVhostUserMessage(Frame(12).Put64(1).bytes(), 1);
  ASSERT_TRUE(with_fd.ok()) << with_fd.status();
  EXPECT_EQ(with_fd->vring_index, 1u);
  auto no_fd =
      ParseVhostUserMessage(Frame(13).Put64(kVringNoFdFlag | 2).bytes(), 0);
  ASSERT_TRUE(no_fd.ok()) << no_fd.status();
  EXPECT_EQ(no_fd->vring_index, 2u);
  // The flag says no fd, one came; no flag, none came; reserved bits.
  EXPECT_FALSE(
      ParseVhostUserMessage(Frame(13).Put64(kVringNoFdFlag).bytes(), 1).ok());
  EXPECT_FALSE(ParseVhostUserMessage(Frame(12).Put64(0).bytes(), 0).ok());
  EXPECT_FALSE(
      ParseVhostUserMessage(Frame(12).Put64(1ull << 40).bytes(), 1).ok());
  // Descriptors on a message that takes none.
  EXPECT_FALSE(ParseVhostUserMessage(Frame(1).bytes(), 1).ok());
  EXPECT_FALSE(ParseVhostUserMessage(Frame(2).Put64(0).bytes(), 1).ok());
  EXPECT_FALSE(ParseVhostUserMessage(Frame(1).bytes(), 9).ok());
}

TEST(VhostUserMessage, VringAddrAndState) {
  auto a = ParseVhostUserMessage(Frame(9)
                                     .Put32(0)
                                     .Put32(0)
                                     .Put64(0x1000)
                                     .Put64(0x3000)
                                     .Put64(0x2000)
                                     .Put64(0)
                                     .bytes(),
                                 0);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->vring_addr.desc_user_addr, 0x1000u);
  EXPECT_EQ(a->vring_addr.used_user_addr, 0x3000u);
  EXPECT_EQ(a->vring_addr.avail_user_addr, 0x2000u);
  EXPECT_FALSE(ParseVhostUserMessage(Frame(9).Put64(0).bytes(), 0).ok());
  auto s = ParseVhostUserMessage(Frame(8).Put32(0).Put32(128).bytes(), 0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->vring_num, 128u);
}

TEST(VhostUserMessage, ConfigSizes) {
  auto g = ParseVhostUserMessage(
      Frame(24).Put32(0).Put32(60).Put32(0).PutBytes(60).bytes(), 0);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->config.size, 60u);
  // size field and payload disagree; size over 256.
  EXPECT_FALSE(
      ParseVhostUserMessage(
          Frame(24).Put32(0).Put32(61).Put32(0).PutBytes(60).bytes(), 0)
          .ok());
  EXPECT_FALSE(
      ParseVhostUserMessage(
          Frame(24).Put32(0).Put32(300).Put32(0).PutBytes(300).bytes(), 0)
          .ok());
  EXPECT_FALSE(ParseVhostUserMessage(Frame(24).Put32(0).bytes(), 0).ok());
}

TEST(VhostUserMessage, UnknownRequestParsesAsUnknown) {
  auto m = ParseVhostUserMessage(Frame(77).Put64(5).bytes(), 0);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->request, VhostUserRequest::kUnknown);
  EXPECT_EQ(m->raw_request, 77u);
}

TEST(VhostUserMessage, RepliesCarryReplyBit) {
  std::vector<uint8_t> r = EncodeVhostUserReplyU64(1, 0xabc);
  ASSERT_EQ(r.size(), 20u);
  uint32_t flags;
  std::memcpy(&flags, r.data() + 4, 4);
  EXPECT_EQ(flags, kVhostUserVersion | kVhostUserFlagReply);
  uint64_t v;
  std::memcpy(&v, r.data() + 12, 8);
  EXPECT_EQ(v, 0xabcu);
}

}  // namespace
}  // namespace tmem::swap
