// Tests for the page codecs (backend/page_codec.h): same-filled detection,
// FillPage, and LZ4 round trips, including hostile blocks that must be
// rejected without reading or writing out of bounds (run under ASan).
#include "backend/page_codec.h"

#include <lz4.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::FilledWith;
using test::Page;
using test::RandomPage;
using test::TextPage;

// Looks like an executable: small integers, pointers with a common prefix,
// runs of zeros and some noise.
Page BinaryLikePage(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Page page{};
  for (size_t off = 0; off < kPageSize; off += 8) {
    uint64_t v;
    switch (rng() % 4) {
      case 0:
        v = 0;
        break;
      case 1:
        v = rng() % 256;
        break;
      case 2:
        v = 0x00007f0000000000ull | (rng() & 0xffffff);
        break;
      default:
        v = rng();
        break;
    }
    std::memcpy(page.data() + off, &v, 8);
  }
  return page;
}

std::vector<uint8_t> Compress(const Page& page) {
  std::vector<uint8_t> block(kMaxCompressedPage);
  const size_t n = CompressPage(page, block);
  EXPECT_GT(n, 0u);
  EXPECT_LE(n, kMaxCompressedPage);
  block.resize(n);
  return block;
}

// --- Same-filled detection ------------------------------------------------

TEST(DetectSameFilledTest, ZeroPageIsSameFilledWithWordZero) {
  Page page{};
  uint64_t word = 12345;
  ASSERT_TRUE(DetectSameFilled(page, &word));
  EXPECT_EQ(word, 0u);
}

TEST(DetectSameFilledTest, RepeatedWordIsDetected) {
  for (uint64_t w :
       {uint64_t{1}, uint64_t{0xffffffffffffffff}, uint64_t{0x0123456789abcdef},
        uint64_t{0x8000000000000000}}) {
    const Page page = FilledWith(w);
    uint64_t word = 0;
    ASSERT_TRUE(DetectSameFilled(page, &word)) << std::hex << w;
    EXPECT_EQ(word, w);
  }
}

TEST(DetectSameFilledTest, RepeatedByteIsDetectedAsItsWord) {
  Page page;
  page.fill(0xab);
  uint64_t word = 0;
  ASSERT_TRUE(DetectSameFilled(page, &word));
  EXPECT_EQ(word, 0xababababababababull);
}

TEST(DetectSameFilledTest, PageDifferingOnlyInLastByteIsNot) {
  for (uint64_t w : {uint64_t{0}, uint64_t{0x0123456789abcdef}}) {
    Page page = FilledWith(w);
    page[kPageSize - 1] ^= 0x01;
    uint64_t word = 77;
    EXPECT_FALSE(DetectSameFilled(page, &word)) << std::hex << w;
  }
}

TEST(DetectSameFilledTest, PageWhoseFirstWordDiffersIsNot) {
  Page page = FilledWith(0x1111111111111111);
  const uint64_t first = 0x2222222222222222;
  std::memcpy(page.data(), &first, sizeof(first));
  uint64_t word = 0;
  EXPECT_FALSE(DetectSameFilled(page, &word));

  // Zero page with one non-zero byte in the first word.
  Page almost_zero{};
  almost_zero[3] = 1;
  EXPECT_FALSE(DetectSameFilled(almost_zero, &word));
}

TEST(DetectSameFilledTest, EveryWordPositionMatters) {
  // A single differing byte anywhere must be seen, whichever word it is in.
  const Page base = FilledWith(0x5a5a5a5a5a5a5a5a);
  for (size_t pos = 0; pos < kPageSize; pos += 61) {
    Page page = base;
    page[pos] ^= 0x80;
    uint64_t word = 0;
    EXPECT_FALSE(DetectSameFilled(page, &word)) << "byte " << pos;
  }
}

TEST(DetectSameFilledTest, DataPagesAreNot) {
  uint64_t word = 0;
  EXPECT_FALSE(DetectSameFilled(TextPage(1), &word));
  EXPECT_FALSE(DetectSameFilled(RandomPage(2), &word));
  EXPECT_FALSE(DetectSameFilled(BinaryLikePage(3), &word));
}

// --- FillPage ---------------------------------------------------------------

TEST(FillPageTest, RoundTripsThroughDetection) {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 100; ++i) {
    const uint64_t w = i == 0 ? 0 : rng();
    Page out;
    out.fill(0xcc);  // garbage that FillPage must overwrite
    FillPage(w, out);
    EXPECT_EQ(out, FilledWith(w));
    uint64_t detected = ~w;
    ASSERT_TRUE(DetectSameFilled(out, &detected));
    EXPECT_EQ(detected, w);
  }
}

TEST(FillPageTest, ZeroWordClearsThePage) {
  Page out;
  out.fill(0xff);
  FillPage(0, out);
  EXPECT_TRUE(
      std::all_of(out.begin(), out.end(), [](uint8_t b) { return b == 0; }));
}

// --- LZ4 --------------------------------------------------------------------

TEST(Lz4Test, TextPagesRoundTripAndShrink) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const Page page = TextPage(seed);
    const std::vector<uint8_t> block = Compress(page);
    EXPECT_LT(block.size(), kPageSize * 3 / 5) << "text should compress well";
    Page out{};
    ASSERT_TRUE(DecompressPage(block, out));
    EXPECT_EQ(out, page);
  }
}

TEST(Lz4Test, RandomPagesRoundTripAndDoNotShrink) {
  for (uint64_t seed = 100; seed < 120; ++seed) {
    const Page page = RandomPage(seed);
    const std::vector<uint8_t> block = Compress(page);
    // Incompressible data grows slightly; it must still fit the bound.
    EXPECT_GE(block.size(), kPageSize);
    Page out{};
    ASSERT_TRUE(DecompressPage(block, out));
    EXPECT_EQ(out, page);
  }
}

TEST(Lz4Test, BinaryLikePagesRoundTrip) {
  for (uint64_t seed = 200; seed < 220; ++seed) {
    const Page page = BinaryLikePage(seed);
    const std::vector<uint8_t> block = Compress(page);
    EXPECT_LT(block.size(), kPageSize);
    Page out{};
    ASSERT_TRUE(DecompressPage(block, out));
    EXPECT_EQ(out, page);
  }
}

TEST(Lz4Test, SameFilledPagesRoundTripThroughLz4Too) {
  // The store never sends these to LZ4, but the codec must not care.
  const Page page = FilledWith(0xdeadbeefcafef00d);
  const std::vector<uint8_t> block = Compress(page);
  EXPECT_LT(block.size(), 64u);
  Page out{};
  ASSERT_TRUE(DecompressPage(block, out));
  EXPECT_EQ(out, page);
}

TEST(Lz4Test, OutputBufferOfExactlyTheBoundSuffices) {
  const Page page = RandomPage(7);
  std::vector<uint8_t> block(kMaxCompressedPage);
  const size_t n = CompressPage(page, block);
  ASSERT_GT(n, 0u);
  EXPECT_LE(n, static_cast<size_t>(LZ4_COMPRESSBOUND(kPageSize)));
}

// --- Hostile blocks: must fail cleanly, never crash or overrun. -----------

TEST(DecompressPageTest, RejectsTruncatedBlocks) {
  for (const Page& page : {TextPage(5), RandomPage(6), BinaryLikePage(7)}) {
    const std::vector<uint8_t> block = Compress(page);
    for (size_t len : {size_t{0}, size_t{1}, size_t{2}, block.size() / 2,
                       block.size() - 1}) {
      // A heap copy of exactly `len` bytes, so ASan sees any overread.
      auto heap = std::make_unique<uint8_t[]>(std::max<size_t>(len, 1));
      std::copy_n(block.begin(), len, heap.get());
      auto out = std::make_unique<Page>();
      EXPECT_FALSE(
          DecompressPage(std::span<const uint8_t>(heap.get(), len), *out))
          << "truncated to " << len << " of " << block.size();
    }
  }
}

TEST(DecompressPageTest, RejectsGarbageAndNeverCrashes) {
  // Random garbage and single-byte corruptions: the result may be either
  // (a corrupted literal still decodes), but a successful decode must have
  // produced a full page and nothing may be touched out of bounds.
  std::mt19937_64 rng(99);
  int rejected = 0;
  for (int i = 0; i < 2000; ++i) {
    const size_t len = 1 + rng() % kMaxCompressedPage;
    auto garbage = std::make_unique<uint8_t[]>(len);
    for (size_t j = 0; j < len; ++j) garbage[j] = static_cast<uint8_t>(rng());
    auto out = std::make_unique<Page>();
    if (!DecompressPage(std::span<const uint8_t>(garbage.get(), len), *out)) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1900) << "random bytes are almost never a valid page";

  const std::vector<uint8_t> block = Compress(TextPage(8));
  for (size_t pos = 0; pos < block.size(); ++pos) {
    auto corrupt = std::make_unique<uint8_t[]>(block.size());
    std::memcpy(corrupt.get(), block.data(), block.size());
    corrupt[pos] ^= static_cast<uint8_t>(1 + rng() % 255);
    auto out = std::make_unique<Page>();
    (void)DecompressPage(std::span<const uint8_t>(corrupt.get(), block.size()),
                         *out);
  }
}

TEST(DecompressPageTest, RejectsBlockDecodingToFewerThanAPage) {
  // A valid LZ4 block of 1000 bytes of text.
  const Page text = TextPage(9);
  std::vector<char> small(LZ4_COMPRESSBOUND(1000));
  const int n =
      LZ4_compress_default(reinterpret_cast<const char*>(text.data()),
                           small.data(), 1000, static_cast<int>(small.size()));
  ASSERT_GT(n, 0);
  auto out = std::make_unique<Page>();
  EXPECT_FALSE(DecompressPage(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(small.data()),
                               static_cast<size_t>(n)),
      *out));

  // A hand-made block: one literals-only sequence of 100 bytes
  // (token 0xF0, then 100 - 15 = 85 as the length extension).
  std::vector<uint8_t> literals = {0xF0, 85};
  literals.resize(2 + 100, 'x');
  EXPECT_FALSE(DecompressPage(literals, *out));

  // One byte short of a page.
  std::vector<char> short_by_one(LZ4_COMPRESSBOUND(kPageSize));
  const int m = LZ4_compress_default(
      reinterpret_cast<const char*>(text.data()), short_by_one.data(),
      static_cast<int>(kPageSize - 1), static_cast<int>(short_by_one.size()));
  ASSERT_GT(m, 0);
  EXPECT_FALSE(
      DecompressPage(std::span<const uint8_t>(
                         reinterpret_cast<const uint8_t*>(short_by_one.data()),
                         static_cast<size_t>(m)),
                     *out));
}

TEST(DecompressPageTest, RejectsBlockDecodingToMoreThanAPage) {
  // Two pages of text compressed as one block: decoding would overrun a
  // 4096-byte page; it must stop at the bound and report failure.
  std::vector<uint8_t> two_pages(2 * kPageSize);
  const Page a = TextPage(10);
  const Page b = TextPage(11);
  std::memcpy(two_pages.data(), a.data(), kPageSize);
  std::memcpy(two_pages.data() + kPageSize, b.data(), kPageSize);
  std::vector<char> block(LZ4_COMPRESSBOUND(2 * kPageSize));
  const int n = LZ4_compress_default(
      reinterpret_cast<const char*>(two_pages.data()), block.data(),
      static_cast<int>(two_pages.size()), static_cast<int>(block.size()));
  ASSERT_GT(n, 0);
  auto out = std::make_unique<Page>();
  EXPECT_FALSE(DecompressPage(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(block.data()),
                               static_cast<size_t>(n)),
      *out));
}

}  // namespace
}  // namespace tmem
