#include "backend/compaction_queue.h"

#include <algorithm>

namespace tmem {

std::string_view CompactionSkipName(CompactionSkip why) {
  switch (why) {
    case CompactionSkip::kRead:
      return "read";
    case CompactionSkip::kInvalidated:
      return "invalidated";
    case CompactionSkip::kEvicted:
      return "evicted";
    case CompactionSkip::kReplaced:
      return "replaced";
  }
  return "unknown";
}

CompactionQueue::CompactionQueue(size_t capacity)
    : ring_(std::clamp<size_t>(capacity, 1, kMaxCapacity)) {}

bool CompactionQueue::TryPush(const CompactionTicket& ticket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (length_ == ring_.size()) {
      overflows_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    ring_[(head_ + length_) % ring_.size()] = ticket;
    ++length_;
    approx_length_.store(length_, std::memory_order_relaxed);
  }
  pushed_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

size_t CompactionQueue::PopBatch(std::span<CompactionTicket> out) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = std::min(out.size(), length_);
  for (size_t i = 0; i < n; ++i) {
    out[i] = ring_[head_];
    head_ = (head_ + 1) % ring_.size();
  }
  length_ -= n;
  approx_length_.store(length_, std::memory_order_relaxed);
  return n;
}

CompactionQueueStats CompactionQueue::Stats() const {
  CompactionQueueStats s;
  s.capacity = ring_.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.length = length_;
  }
  s.pushed = pushed_.load(std::memory_order_relaxed);
  s.overflows = overflows_.load(std::memory_order_relaxed);
  for (int i = 0; i < kNumCompactionSkips; ++i) {
    s.skipped[i] = skipped_[i].load(std::memory_order_relaxed);
  }
  return s;
}

}  // namespace tmem
