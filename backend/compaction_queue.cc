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
  }
  pushed_.fetch_add(1, std::memory_order_relaxed);
  // Cheap when nobody waits (no syscall); the compactor waits only when the
  // queue was empty.
  cv_.notify_one();
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
  return n;
}

bool CompactionQueue::WaitForWork(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t epoch = wake_epoch_;
  cv_.wait_for(lock, timeout,
               [&] { return length_ > 0 || wake_epoch_ != epoch; });
  return length_ > 0;
}

void CompactionQueue::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++wake_epoch_;
  }
  cv_.notify_all();
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
