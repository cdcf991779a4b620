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

}  // namespace tmem::test

#endif  // TMEMD_TESTS_TEST_PAGES_H_
