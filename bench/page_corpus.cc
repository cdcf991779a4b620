#include "bench/page_corpus.h"

#include <fcntl.h>
#include <lz4.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace tmem::bench {
namespace {

namespace fs = std::filesystem;

using PathFilter = std::function<bool(const fs::path&)>;

bool HasExtension(const fs::path& p,
                  std::initializer_list<std::string_view> exts) {
  const std::string name = p.filename().string();
  for (std::string_view ext : exts) {
    if (name.size() > ext.size() &&
        name.compare(name.size() - ext.size(), ext.size(), ext) == 0) {
      return true;
    }
  }
  return false;
}

bool IsCompressedName(const fs::path& p) {
  return HasExtension(p, {".gz", ".xz", ".bz2", ".zst", ".lz4", ".lzma", ".png",
                          ".jpg", ".jpeg", ".gif", ".webp", ".zip", ".jar",
                          ".deb", ".woff", ".woff2", ".7z", ".tgz", ".svgz"});
}

bool LooksLikeSharedObject(const fs::path& p) {
  const std::string name = p.filename().string();
  return name.find(".so") != std::string::npos;
}

// Collects regular files (not symlinks: a library and its .so links would
// otherwise count three times) under `root` that pass `filter`. Sorted, so
// the result does not depend on the directory iteration order. A missing or
// unreadable root yields an empty list; unreadable subtrees are skipped.
std::vector<fs::path> ListFiles(const fs::path& root, const PathFilter& filter,
                                size_t max_entries) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return files;
  fs::recursive_directory_iterator it(
      root, fs::directory_options::skip_permission_denied, ec);
  if (ec) return files;
  size_t visited = 0;
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) {
      // A vanished or unreadable entry: skip it and keep walking.
      ec.clear();
      continue;
    }
    if (++visited > max_entries) break;
    const fs::directory_entry& e = *it;
    std::error_code ec2;
    if (e.is_symlink(ec2) || !e.is_regular_file(ec2)) continue;
    if (e.file_size(ec2) < kPageSize || ec2) continue;
    if (filter(e.path())) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

template <typename T>
void DeterministicShuffle(std::vector<T>& v, SplitMix64& rng) {
  for (size_t i = v.size(); i > 1; --i) {
    std::swap(v[i - 1], v[rng.Below(i)]);
  }
}

bool IsSameFilled(const uint8_t* p) {
  uint64_t first;
  std::memcpy(&first, p, sizeof(first));
  for (size_t off = sizeof(first); off < kPageSize; off += sizeof(first)) {
    uint64_t w;
    std::memcpy(&w, p + off, sizeof(w));
    if (w != first) return false;
  }
  return true;
}

bool IsTextPage(const uint8_t* p) {
  size_t odd = 0;
  for (size_t i = 0; i < kPageSize; ++i) {
    const uint8_t c = p[i];
    if (c == 0) return false;
    // Printable ASCII, common whitespace, or UTF-8 bytes count as text.
    const bool texty = (c >= 0x20 && c < 0x7f) || c == '\n' || c == '\t' ||
                       c == '\r' || c == '\f' || c >= 0x80;
    if (!texty) ++odd;
  }
  return odd * 50 < kPageSize;  // < 2% control bytes
}

size_t Lz4Size(const uint8_t* p) {
  char out[LZ4_COMPRESSBOUND(kPageSize)];
  const int n = LZ4_compress_default(reinterpret_cast<const char*>(p), out,
                                     static_cast<int>(kPageSize), sizeof(out));
  return n > 0 ? static_cast<size_t>(n) : kPageSize + 1;
}

bool FileStartsWith(const fs::path& p, std::string_view magic) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[16];
  const ssize_t n = ::pread(fd, buf, magic.size(), 0);
  ::close(fd);
  return n == static_cast<ssize_t>(magic.size()) &&
         std::memcmp(buf, magic.data(), magic.size()) == 0;
}

enum class PageKind { kText, kBinary, kCompressed };

struct FillStats {
  size_t files_listed = 0;
  size_t files_read = 0;
  size_t dropped_same_filled = 0;
  size_t dropped_not_text = 0;
  size_t dropped_codec_path = 0;  // wrong side of the LZ4 threshold
};

// Appends pages from `files` (already in the order to use) to `out` until it
// holds `want` pages.
void TakePages(const std::vector<fs::path>& files, PageKind kind, size_t want,
               const CorpusOptions& options, PageSet& out, FillStats& stats) {
  std::vector<uint8_t> buf(kPageSize);
  for (const fs::path& path : files) {
    if (out.size() >= want) return;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kPageSize)) {
      ::close(fd);
      continue;
    }
    ++stats.files_read;
    // Only whole pages: a page-cache tail page would be zero-padded, which
    // belongs to no clean category.
    const size_t file_pages = static_cast<size_t>(st.st_size) / kPageSize;
    const size_t take = std::min(file_pages, options.max_pages_per_file);
    for (size_t j = 0; j < take && out.size() < want; ++j) {
      const size_t page_index = j * file_pages / take;
      const ssize_t n = ::pread(fd, buf.data(), kPageSize,
                                static_cast<off_t>(page_index * kPageSize));
      if (n != static_cast<ssize_t>(kPageSize)) break;
      if (IsSameFilled(buf.data())) {
        ++stats.dropped_same_filled;
        continue;
      }
      if (kind == PageKind::kText && !IsTextPage(buf.data())) {
        ++stats.dropped_not_text;
        continue;
      }
      const bool poor =
          Lz4Size(buf.data()) > options.poor_compression_threshold;
      if (poor != (kind == PageKind::kCompressed)) {
        ++stats.dropped_codec_path;
        continue;
      }
      Page& page = out.emplace_back();
      std::memcpy(page.bytes.data(), buf.data(), kPageSize);
    }
    ::close(fd);
  }
}

struct Source {
  const char* root;
  PathFilter filter;
};

// Fills one file category: first from the primary roots pooled together (so a
// category is not dominated by whichever root sorts first), then, if short,
// from the fallback roots.
PageSet FillCategory(const char* name, PageKind kind,
                     const std::vector<Source>& primary,
                     const std::vector<Source>& fallback,
                     const CorpusOptions& options, SplitMix64& rng) {
  PageSet out;
  out.reserve(options.pages_per_category);
  FillStats stats;
  for (const std::vector<Source>* tier : {&primary, &fallback}) {
    if (out.size() >= options.pages_per_category) break;
    std::vector<fs::path> files;
    for (const Source& s : *tier) {
      std::vector<fs::path> listed =
          ListFiles(s.root, s.filter, options.max_entries_per_root);
      files.insert(files.end(), listed.begin(), listed.end());
    }
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
    stats.files_listed += files.size();
    DeterministicShuffle(files, rng);
    TakePages(files, kind, options.pages_per_category, options, out, stats);
  }
  if (options.verbose) {
    std::fprintf(
        stderr,
        "corpus: %-10s %5zu pages from %zu files (%zu listed); dropped: "
        "%zu same-filled, %zu not text, %zu wrong codec path\n",
        name, out.size(), stats.files_read, stats.files_listed,
        stats.dropped_same_filled, stats.dropped_not_text,
        stats.dropped_codec_path);
  }
  if (out.size() < options.pages_per_category) {
    std::fprintf(stderr,
                 "corpus: WARNING: category %s has only %zu of %zu pages "
                 "(sources missing on this machine)\n",
                 name, out.size(), options.pages_per_category);
  }
  return out;
}

}  // namespace

std::string_view PageCategoryName(PageCategory c) {
  switch (c) {
    case PageCategory::kText:
      return "text";
    case PageCategory::kBinary:
      return "binary";
    case PageCategory::kCompressed:
      return "compressed";
    case PageCategory::kZero:
      return "zero";
    case PageCategory::kSameFilled:
      return "same_filled";
    case PageCategory::kMix:
      return "mix";
  }
  return "unknown";
}

std::vector<size_t> PageCorpus::Lz4Sizes(const PageSet& set) {
  std::vector<size_t> sizes;
  sizes.reserve(set.size());
  for (const Page& p : set) sizes.push_back(Lz4Size(p.bytes.data()));
  return sizes;
}

PageCorpus PageCorpus::Build(const CorpusOptions& options) {
  PageCorpus c;
  SplitMix64 rng(options.seed);

  const PathFilter any = [](const fs::path&) { return true; };
  const PathFilter not_compressed = [](const fs::path& p) {
    return !IsCompressedName(p);
  };
  const PathFilter source_text = [](const fs::path& p) {
    return HasExtension(p, {".py", ".pm", ".pl", ".sh", ".txt", ".md", ".html",
                            ".css", ".js", ".xml", ".json", ".rst", ".tex"});
  };
  const PathFilter elf = [](const fs::path& p) {
    return FileStartsWith(p,
                          "\x7f"
                          "ELF");
  };
  const PathFilter shared_object = [](const fs::path& p) {
    return LooksLikeSharedObject(p) && FileStartsWith(p,
                                                      "\x7f"
                                                      "ELF");
  };
  const PathFilter compressed = [](const fs::path& p) {
    return IsCompressedName(p);
  };

  c.sets_[static_cast<int>(PageCategory::kText)] =
      FillCategory("text", PageKind::kText,
                   {{"/usr/share/common-licenses", any},
                    {"/usr/include", any},
                    {"/usr/share/doc", not_compressed}},
                   {{"/usr/share/perl5", source_text},
                    {"/usr/lib/python3", source_text},
                    {"/usr/share", source_text},
                    {"/etc", any}},
                   options, rng);
  c.sets_[static_cast<int>(PageCategory::kBinary)] = FillCategory(
      "binary", PageKind::kBinary,
      {{"/usr/bin", elf}, {"/usr/lib/x86_64-linux-gnu", shared_object}},
      {{"/usr/sbin", elf},
       {"/usr/libexec", elf},
       {"/usr/lib", elf},
       {"/bin", elf},
       {"/lib", elf}},
      options, rng);
  c.sets_[static_cast<int>(PageCategory::kCompressed)] = FillCategory(
      "compressed", PageKind::kCompressed,
      {{"/usr/share/doc", compressed},
       {"/usr/share/man", compressed},
       {"/usr/share/icons", compressed},
       {"/usr/share/pixmaps", compressed},
       {"/var/cache/apt/archives", compressed}},
      {{"/usr/share", compressed}, {"/usr/lib", compressed}}, options, rng);

  PageSet& incompressible =
      c.sets_[static_cast<int>(PageCategory::kCompressed)];
  if (incompressible.empty()) {
    // Random bytes are what compressed data looks like to LZ4; better a
    // synthetic raw-path category than none.
    std::fprintf(stderr,
                 "corpus: WARNING: no compressed files found; using %zu "
                 "pseudo-random pages for the compressed category\n",
                 options.pages_per_category);
    SplitMix64 bytes_rng(options.seed ^ 0xc0ffee);
    incompressible.resize(options.pages_per_category);
    for (Page& p : incompressible) {
      for (size_t off = 0; off < kPageSize; off += 8) {
        const uint64_t w = bytes_rng.Next();
        std::memcpy(p.bytes.data() + off, &w, sizeof(w));
      }
    }
  }

  // Zero pages: value-initialized.
  c.sets_[static_cast<int>(PageCategory::kZero)].resize(options.fill_pages);
  // Same-filled pages: all-ones and byte patterns (memset-style fills), then
  // arbitrary words, none of them zero.
  PageSet& same = c.sets_[static_cast<int>(PageCategory::kSameFilled)];
  same.resize(options.fill_pages);
  SplitMix64 word_rng(options.seed ^ 0x5a5a5a5a);
  for (size_t i = 0; i < same.size(); ++i) {
    uint64_t word;
    if (i % 4 == 0) {
      word = ~uint64_t{0};
    } else if (i % 4 == 1) {
      word = 0x0101010101010101ull * (1 + word_rng.Below(255));
    } else {
      do {
        word = word_rng.Next();
      } while (word == 0);
    }
    for (size_t off = 0; off < kPageSize; off += sizeof(word)) {
      std::memcpy(same[i].bytes.data() + off, &word, sizeof(word));
    }
  }

  // Text and binary interleaved: the LZ4-path set.
  {
    const PageSet& t = c.pages(PageCategory::kText);
    const PageSet& b = c.pages(PageCategory::kBinary);
    c.text_and_binary_.reserve(t.size() + b.size());
    for (size_t i = 0; i < std::max(t.size(), b.size()); ++i) {
      if (i < t.size()) c.text_and_binary_.push_back(t[i]);
      if (i < b.size()) c.text_and_binary_.push_back(b[i]);
    }
  }

  // The mix: each category's share of the labels, shuffled; a category that
  // is empty gives its share to the others in proportion.
  struct Share {
    PageCategory category;
    double weight;
  };
  const double fill = options.mix_fill_percent;
  std::vector<Share> shares = {
      {PageCategory::kText, static_cast<double>(options.mix_text_percent)},
      {PageCategory::kBinary, static_cast<double>(options.mix_binary_percent)},
      {PageCategory::kCompressed,
       static_cast<double>(options.mix_compressed_percent)},
      {PageCategory::kZero, fill * 2.0 / 3.0},
      {PageCategory::kSameFilled, fill / 3.0},
  };
  double total_weight = 0;
  for (const Share& s : shares) {
    if (c.pages(s.category).empty()) {
      std::fprintf(stderr,
                   "corpus: WARNING: mix has no %s pages; its share goes to "
                   "the other categories\n",
                   std::string(PageCategoryName(s.category)).c_str());
      continue;
    }
    total_weight += s.weight;
  }
  std::vector<PageCategory> labels;
  const size_t mix_pages = options.pages_per_category;
  if (total_weight > 0) {
    // Cumulative rounding, so the shares add up to exactly mix_pages.
    double cumulative = 0;
    size_t assigned = 0;
    for (const Share& s : shares) {
      if (c.pages(s.category).empty()) continue;
      cumulative += s.weight;
      const auto upto = static_cast<size_t>(std::llround(
          static_cast<double>(mix_pages) * cumulative / total_weight));
      labels.insert(labels.end(), upto - assigned, s.category);
      assigned = upto;
    }
  }
  DeterministicShuffle(labels, rng);
  PageSet& mix = c.sets_[static_cast<int>(PageCategory::kMix)];
  mix.reserve(labels.size());
  std::array<size_t, kNumPageCategories> next{};
  for (PageCategory label : labels) {
    const PageSet& from = c.pages(label);
    size_t& i = next[static_cast<int>(label)];
    mix.push_back(from[i % from.size()]);
    ++i;
  }
  if (options.verbose) std::fprintf(stderr, "%s", c.Describe().c_str());
  return c;
}

std::string PageCorpus::Describe() const {
  std::string out;
  char line[160];
  for (int i = 0; i < kNumPageCategories; ++i) {
    const PageSet& set = sets_[i];
    double mean = 0;
    if (!set.empty()) {
      uint64_t sum = 0;
      for (size_t s : Lz4Sizes(set)) sum += s;
      mean = static_cast<double>(sum) / static_cast<double>(set.size());
    }
    std::snprintf(
        line, sizeof(line),
        "corpus: %-11s %5zu pages, mean LZ4 block %6.0f bytes "
        "(ratio %.2f)\n",
        std::string(PageCategoryName(static_cast<PageCategory>(i))).c_str(),
        set.size(), mean, mean > 0 ? kPageSize / mean : 0.0);
    out += line;
  }
  return out;
}

}  // namespace tmem::bench
