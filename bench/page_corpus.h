// PageCorpus: realistic 4 KiB pages for the backend micro-benchmarks.
//
// A page cache holds file pages, so the corpus is cut from files on this
// machine rather than synthesized: text (docs, headers, licences), binaries
// (ELF executables and shared libraries), already-compressed data (gzip, xz,
// png, .deb: pages LZ4 cannot shrink), plus zero and same-filled pages, which
// zswap finds to be 10-20% of what it stores.
//
// Deterministic: directory walks are sorted, file order is shuffled with a
// fixed seed by a portable generator (std::shuffle and the std distributions
// are implementation-defined), and pages are taken at fixed offsets. Bounded:
// at most `pages_per_category` pages per file category and a capped number of
// directory entries per root. Robust: a missing or unreadable directory is
// skipped and the next source is tried; a category that cannot be filled is
// reported on stderr and the mix is built from what exists. Nothing here
// aborts.
//
// Each file category is filtered to the codec path it is meant to exercise:
// text and binary pages are kept only if LZ4 brings them to at most the
// store's poor-compression threshold (the LZ4 path), compressed-file pages
// only if it does not (the raw path), and no file page may be same-filled
// (those are the zero/same-filled categories' job). The counts dropped by
// each filter are printed, so the filtering is visible.
//
// Not thread-safe to build; a built corpus is immutable and may be read from
// any number of threads.
#ifndef TMEMD_BENCH_PAGE_CORPUS_H_
#define TMEMD_BENCH_PAGE_CORPUS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "backend/page_codec.h"
#include "backend/types.h"

namespace tmem::bench {

// Page-aligned like a guest page, so alignment-sensitive code paths (vector
// loads in LZ4 and same-fill detection) see what they see in production.
struct alignas(kPageSize) Page {
  std::array<uint8_t, kPageSize> bytes{};

  ConstPage view() const { return {bytes}; }
  MutablePage mutable_view() { return {bytes}; }
};

using PageSet = std::vector<Page>;

enum class PageCategory : int {
  kText = 0,
  kBinary,
  kCompressed,
  kZero,
  kSameFilled,
  kMix,
};
inline constexpr int kNumPageCategories = 6;
std::string_view PageCategoryName(PageCategory c);

struct CorpusOptions {
  // Pages per file category (text, binary, compressed) and in the mix.
  size_t pages_per_category = 2048;
  // Zero and same-filled pages are all alike, so a small set suffices; it is
  // kept small so that it stays cache-resident like the "hot" memcpy it is
  // compared with.
  size_t fill_pages = 256;
  // Pages taken from one file, spread evenly over it, so a few big files
  // cannot dominate a category.
  size_t max_pages_per_file = 8;
  // Directory entries visited per root, bounding the walk on big trees.
  size_t max_entries_per_root = 200000;
  // LZ4 block size above which a page is "poorly compressible"; must match
  // StoreOptions::poor_compression_threshold_bytes of the stores under test.
  size_t poor_compression_threshold = 3584;
  // Mix proportions in percent of the mix; zero+same-filled is split 2:1
  // between zero and other fill words (zero pages dominate in practice).
  int mix_text_percent = 40;
  int mix_binary_percent = 30;
  int mix_compressed_percent = 15;
  int mix_fill_percent = 15;
  uint64_t seed = 0x746d656d62656e63;  // "tmembenc"
  bool verbose = true;                 // progress and shortfalls on stderr
};

class PageCorpus {
 public:
  // Never fails: missing sources leave a category short or empty (and say
  // so on stderr).
  static PageCorpus Build(const CorpusOptions& options);

  const PageSet& pages(PageCategory c) const {
    return sets_[static_cast<int>(c)];
  }
  // Text and binary pages interleaved: the LZ4-path page set.
  const PageSet& text_and_binary() const { return text_and_binary_; }
  // LZ4 block size of each page of a set (as LZ4_compress_default makes it).
  static std::vector<size_t> Lz4Sizes(const PageSet& set);

  // One line per category: pages, mean LZ4 size.
  std::string Describe() const;

 private:
  std::array<PageSet, kNumPageCategories> sets_;
  PageSet text_and_binary_;
};

// A small portable PRNG (splitmix64), so corpora and key orders are the same
// on every machine and standard library.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n); the modulo bias is irrelevant for n << 2^64.
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : Next() % n; }

 private:
  uint64_t state_;
};

}  // namespace tmem::bench

#endif  // TMEMD_BENCH_PAGE_CORPUS_H_
