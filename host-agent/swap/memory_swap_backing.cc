#include "host-agent/swap/memory_swap_backing.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tmem::swap {

MemorySwapBacking::MemorySwapBacking(uint64_t page_count,
                                     std::optional<uint64_t> max_stored)
    : page_count_(page_count), max_stored_(max_stored) {}

absl::Status MemorySwapBacking::CheckRange(
    uint64_t first_page, uint64_t count,
    std::span<const GuestSpan> spans) const {
  if (first_page > page_count_ || count > page_count_ - first_page) {
    return absl::OutOfRangeError(absl::StrCat("pages [", first_page, ", +",
                                              count, ") beyond ", page_count_));
  }
  uint64_t total = 0;
  for (const GuestSpan& s : spans) total += s.len;
  if (total != count * kSwapPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("spans hold ", total, " bytes for ", count, " pages"));
  }
  return absl::OkStatus();
}

namespace {
// Walks spans as one byte stream.
class SpanCursor {
 public:
  explicit SpanCursor(std::span<const GuestSpan> spans) : spans_(spans) {}
  // Copies the next n bytes out of (to_spans=false) or into the spans.
  void Move(uint8_t* buf, size_t n, bool to_spans) {
    while (n > 0) {
      const GuestSpan& s = spans_[i_];
      const size_t take = std::min(n, s.len - off_);
      if (to_spans) {
        std::memcpy(s.data + off_, buf, take);
      } else {
        std::memcpy(buf, s.data + off_, take);
      }
      buf += take;
      n -= take;
      off_ += take;
      if (off_ == s.len) {
        ++i_;
        off_ = 0;
      }
    }
  }

 private:
  std::span<const GuestSpan> spans_;
  size_t i_ = 0;
  size_t off_ = 0;
};
}  // namespace

absl::Status MemorySwapBacking::ReadPages(uint64_t first_page, uint64_t count,
                                          std::span<const GuestSpan> dst) {
  if (absl::Status s = CheckRange(first_page, count, dst); !s.ok()) return s;
  static const Page kZero{};
  SpanCursor cur(dst);
  MutexLock lock(&mu_);
  for (uint64_t i = 0; i < count; ++i) {
    auto it = pages_.find(first_page + i);
    const Page& src = it == pages_.end() ? kZero : *it->second;
    cur.Move(const_cast<uint8_t*>(src.data()), kSwapPageSize,
             /*to_spans=*/true);
  }
  return absl::OkStatus();
}

absl::Status MemorySwapBacking::WritePages(uint64_t first_page, uint64_t count,
                                           std::span<const GuestSpan> src) {
  if (absl::Status s = CheckRange(first_page, count, src); !s.ok()) return s;
  SpanCursor cur(src);
  MutexLock lock(&mu_);
  for (uint64_t i = 0; i < count; ++i) {
    auto it = pages_.find(first_page + i);
    if (it == pages_.end()) {
      if (max_stored_.has_value() && pages_.size() >= *max_stored_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("memory backing full (", *max_stored_, " pages)"));
      }
      it = pages_.emplace(first_page + i, std::make_unique<Page>()).first;
    }
    // One copy out of guest memory; the page is ours from here on.
    cur.Move(it->second->data(), kSwapPageSize, /*to_spans=*/false);
  }
  return absl::OkStatus();
}

absl::Status MemorySwapBacking::DiscardPages(uint64_t first_page,
                                             uint64_t count) {
  if (first_page > page_count_ || count > page_count_ - first_page) {
    return absl::OutOfRangeError(absl::StrCat("pages [", first_page, ", +",
                                              count, ") beyond ", page_count_));
  }
  MutexLock lock(&mu_);
  // Iterate the smaller side: a huge discard over a sparse map stays
  // O(stored pages), a small one O(count).
  if (count < pages_.size()) {
    for (uint64_t i = 0; i < count; ++i) pages_.erase(first_page + i);
  } else {
    absl::erase_if(pages_, [&](const auto& kv) {
      return kv.first >= first_page && kv.first - first_page < count;
    });
  }
  return absl::OkStatus();
}

absl::Status MemorySwapBacking::WriteZeroPages(uint64_t first_page,
                                               uint64_t count,
                                               bool /*may_unmap*/) {
  // A missing page reads as zeros: freeing is writing zeros here.
  return DiscardPages(first_page, count);
}

uint64_t MemorySwapBacking::stored_pages() const {
  MutexLock lock(&mu_);
  return pages_.size();
}

bool MemorySwapBacking::CorruptPage(uint64_t page) {
  MutexLock lock(&mu_);
  auto it = pages_.find(page);
  if (it == pages_.end()) return false;
  (*it->second)[123] ^= 0x5a;
  return true;
}

}  // namespace tmem::swap
