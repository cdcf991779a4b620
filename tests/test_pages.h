// Page generators shared by the tests: text-like (LZ4 compresses it about
// 2-3x), random (incompressible) and same-filled pages. Deterministic in the
// seed; every text and random page starts with its seed, so distinct seeds
// give distinct pages.
#ifndef TMEMD_TESTS_TEST_PAGES_H_
#define TMEMD_TESTS_TEST_PAGES_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string_view>

#include "backend/types.h"

namespace tmem::test {

using Page = std::array<uint8_t, kPageSize>;

inline Page FilledWith(uint64_t word) {
  Page page;
  for (size_t off = 0; off < kPageSize; off += sizeof(word)) {
    std::memcpy(page.data() + off, &word, sizeof(word));
  }
  return page;
}

inline Page TextPage(uint64_t seed) {
  static constexpr std::string_view kWords[] = {
      "the ",   "quick ",  "brown ", "fox ",    "jumps ",  "over ",
      "lazy ",  "dog ",    "page ",  "cache ",  "memory ", "host ",
      "guest ", "kernel ", "file ",  "server ", "read ",   "write ",
      "block ", "inode ",  "\n",     "tmem ",   "pool ",   "object "};
  std::mt19937_64 rng(seed);
  Page page{};
  std::memcpy(page.data(), &seed, sizeof(seed));
  size_t off = sizeof(seed);
  while (off < kPageSize) {
    const std::string_view w = kWords[rng() % std::size(kWords)];
    const size_t n = std::min(w.size(), kPageSize - off);
    std::memcpy(page.data() + off, w.data(), n);
    off += n;
  }
  return page;
}

inline Page RandomPage(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Page page;
  std::memcpy(page.data(), &seed, sizeof(seed));
  for (size_t off = sizeof(seed); off < kPageSize; off += sizeof(uint64_t)) {
    const uint64_t v = rng();
    std::memcpy(page.data() + off, &v, sizeof(v));
  }
  return page;
}

// SplitMix64's finalizer: a well-mixed hash of x, for deriving page seeds.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The kinds of page the store treats differently: compressible text,
// incompressible random bytes, a repeated word, all zeros.
enum class PageStyle : uint8_t { kText, kRandom, kSameFilled, kZero };

// A page of `style`: text and random bytes follow from `seed` (Mix64
// chains), a same-filled page repeats `fill_word` (which must not be 0 to
// differ from the zero page), the zero page is all zeros. Callers that
// need pages to name their key write a header over the first bytes of
// text and random pages.
inline Page StyledPage(PageStyle style, uint64_t seed, uint64_t fill_word) {
  Page page{};
  switch (style) {
    case PageStyle::kZero:
      break;
    case PageStyle::kSameFilled:
      page = FilledWith(fill_word);
      break;
    case PageStyle::kText: {
      static constexpr std::string_view kWords[] = {
          "the ", "quick ", "brown ", "fox ", "jumps ", "over ",  "lazy ",
          "dog ", "page ",  "cache ", "\n",   "file ",  "inode ", "pool "};
      uint64_t x = seed;
      size_t off = 0;
      while (off < kPageSize) {
        x = Mix64(x);
        const std::string_view w = kWords[x % std::size(kWords)];
        const size_t n = std::min(w.size(), kPageSize - off);
        std::memcpy(page.data() + off, w.data(), n);
        off += n;
      }
      break;
    }
    case PageStyle::kRandom: {
      uint64_t x = seed;
      for (size_t off = 0; off < kPageSize; off += sizeof(x)) {
        x = Mix64(x);
        std::memcpy(page.data() + off, &x, sizeof(x));
      }
      break;
    }
  }
  return page;
}

}  // namespace tmem::test

#endif  // TMEMD_TESTS_TEST_PAGES_H_
