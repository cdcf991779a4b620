#include "host-agent/swap/vhost_user_session.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tmem::swap {
namespace {

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

void CloseAll(std::vector<int>* fds) {
  for (int& fd : *fds) CloseFd(&fd);
  fds->clear();
}

absl::Status Refused(const VhostUserMessage& msg, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("vhost-user request ", msg.raw_request, ": ", why));
}

}  // namespace

VhostUserBlkSession::VhostUserBlkSession(const BlkDeviceConfig& config,
                                         SwapBacking* backing,
                                         SwapMetrics* metrics)
    : config_(config),
      backing_(backing),
      metrics_(metrics),
      offered_features_(BlkDeviceFeatures(config) |
                        (1ull << kVhostUserFeatureProtocolFeatures)),
      // INFLIGHT_SHMFD is not offered: requests complete synchronously, so
      // there is never an in-flight request to resubmit after a reconnect.
      offered_protocol_features_((1ull << kProtocolFeatureMq) |
                                 (1ull << kProtocolFeatureReplyAck) |
                                 (1ull << kProtocolFeatureConfig)),
      queues_(std::max<uint16_t>(config.num_queues, 1)) {}

VhostUserBlkSession::~VhostUserBlkSession() { ResetAll(); }

bool VhostUserBlkSession::protocol_features_acked() const {
  return (acked_features_ & (1ull << kVhostUserFeatureProtocolFeatures)) != 0;
}

bool VhostUserBlkSession::running(uint32_t index) const {
  const Queue& q = queues_[index];
  return q.started && !q.broken && (q.enabled || !protocol_features_acked());
}

void VhostUserBlkSession::StopQueue(uint32_t index) {
  Queue& q = queues_[index];
  if (q.started) q.base = q.vq.last_avail_idx();
  q.started = false;
  q.broken = false;
  q.vq.Reset();
  CloseFd(&q.kick_fd);
}

void VhostUserBlkSession::ResetAll() {
  for (uint32_t i = 0; i < queues_.size(); ++i) {
    StopQueue(i);
    Queue& q = queues_[i];
    CloseFd(&q.call_fd);
    CloseFd(&q.err_fd);
    q = Queue{};
  }
  memory_ = GuestMemory();
  acked_features_ = 0;
}

absl::Status VhostUserBlkSession::StartQueue(uint32_t index) {
  Queue& q = queues_[index];
  q.started = false;
  q.broken = false;
  if (memory_.empty() || !q.addr_set) {
    metrics_->Inc(SwapCounter::kVringSetupRefused);
    return absl::FailedPreconditionError(absl::StrCat(
        "vring ", index, " kicked before its memory table and addresses"));
  }
  const bool event_idx =
      (acked_features_ & (1ull << kVirtioRingFEventIdx)) != 0;
  if (absl::Status s = q.vq.Configure(memory_, q.num, q.addr.desc_user_addr,
                                      q.addr.avail_user_addr,
                                      q.addr.used_user_addr, event_idx);
      !s.ok()) {
    metrics_->Inc(SwapCounter::kVringSetupRefused);
    return absl::InvalidArgumentError(
        absl::StrCat("vring ", index, ": ", s.message()));
  }
  q.vq.set_last_avail_idx(q.base);
  q.started = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> VhostUserBlkSession::HandleMessage(
    const VhostUserMessage& msg, std::vector<int> fds) {
  metrics_->Inc(SwapCounter::kMessages);
  const bool ack_wanted =
      msg.need_reply &&
      (acked_protocol_features_ & (1ull << kProtocolFeatureReplyAck)) != 0;
  const auto ack = [&](uint64_t value) -> std::vector<uint8_t> {
    if (!ack_wanted) return {};
    return EncodeVhostUserReplyU64(msg.raw_request, value);
  };
  const auto check_index = [&](uint32_t index) -> absl::Status {
    if (index < queues_.size()) return absl::OkStatus();
    metrics_->Inc(SwapCounter::kVringSetupRefused);
    return Refused(msg, absl::StrCat("vring index ", index,
                                     " >= ", queues_.size(), " queues"));
  };

  switch (msg.request) {
    case VhostUserRequest::kGetFeatures:
      return EncodeVhostUserReplyU64(msg.raw_request, offered_features_);

    case VhostUserRequest::kSetFeatures:
      if ((msg.u64 & ~offered_features_) != 0) {
        metrics_->Inc(SwapCounter::kFeaturesRefused);
        return Refused(msg, absl::StrCat("features 0x", absl::Hex(msg.u64),
                                         " outside the offer 0x",
                                         absl::Hex(offered_features_)));
      }
      acked_features_ = msg.u64;
      return ack(0);

    case VhostUserRequest::kGetProtocolFeatures:
      return EncodeVhostUserReplyU64(msg.raw_request,
                                     offered_protocol_features_);

    case VhostUserRequest::kSetProtocolFeatures:
      if ((msg.u64 & ~offered_protocol_features_) != 0) {
        metrics_->Inc(SwapCounter::kFeaturesRefused);
        return Refused(msg,
                       absl::StrCat("protocol features 0x", absl::Hex(msg.u64),
                                    " outside the offer"));
      }
      acked_protocol_features_ = msg.u64;
      return ack(0);

    case VhostUserRequest::kGetQueueNum:
      return EncodeVhostUserReplyU64(msg.raw_request, queues_.size());

    case VhostUserRequest::kSetOwner:
      // One front-end per connection already; nothing else to record.
      return ack(0);

    case VhostUserRequest::kResetOwner:
    case VhostUserRequest::kResetDevice:
      ResetAll();
      return ack(0);

    case VhostUserRequest::kSetMemTable: {
      absl::StatusOr<GuestMemory> mem = GuestMemory::Map(msg.regions, fds);
      fds.clear();  // Map closed them
      if (!mem.ok()) {
        metrics_->Inc(SwapCounter::kMemTablesRefused);
        return Refused(msg, mem.status().message());
      }
      // Running rings move to the new table where they are.
      std::vector<uint32_t> restart;
      for (uint32_t i = 0; i < queues_.size(); ++i) {
        if (queues_[i].started) {
          queues_[i].base = queues_[i].vq.last_avail_idx();
          restart.push_back(i);
        }
      }
      memory_ = *std::move(mem);
      metrics_->Inc(SwapCounter::kMemTablesMapped);
      for (uint32_t i : restart) {
        if (absl::Status s = StartQueue(i); !s.ok()) return s;
      }
      return ack(0);
    }

    case VhostUserRequest::kSetVringNum: {
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) return s;
      const uint32_t n = msg.vring_num;
      if (n == 0 || n > kMaxQueueSize || (n & (n - 1)) != 0) {
        metrics_->Inc(SwapCounter::kVringSetupRefused);
        return Refused(msg, absl::StrCat("queue size ", n));
      }
      queues_[msg.vring_index].num = n;
      return ack(0);
    }

    case VhostUserRequest::kSetVringBase:
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) return s;
      if (msg.vring_num > 0xffff) {
        metrics_->Inc(SwapCounter::kVringSetupRefused);
        return Refused(msg, "split ring base above 65535");
      }
      queues_[msg.vring_index].base = static_cast<uint16_t>(msg.vring_num);
      return ack(0);

    case VhostUserRequest::kSetVringAddr:
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) return s;
      queues_[msg.vring_index].addr = msg.vring_addr;
      queues_[msg.vring_index].addr_set = true;
      return ack(0);

    case VhostUserRequest::kGetVringBase: {
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) return s;
      StopQueue(msg.vring_index);
      return EncodeVhostUserReplyVringState(msg.raw_request, msg.vring_index,
                                            queues_[msg.vring_index].base);
    }

    case VhostUserRequest::kSetVringKick: {
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) {
        CloseAll(&fds);
        return s;
      }
      Queue& q = queues_[msg.vring_index];
      if (q.started) q.base = q.vq.last_avail_idx();
      CloseFd(&q.kick_fd);
      if (!fds.empty()) {
        q.kick_fd = fds[0];
        fds.clear();
      }
      // Without a kick fd the ring would have to be polled; we do not
      // offer that, so a ring without one does not start.
      if (q.kick_fd < 0) {
        q.started = false;
        return ack(0);
      }
      if (absl::Status s = StartQueue(msg.vring_index); !s.ok()) return s;
      return ack(0);
    }

    case VhostUserRequest::kSetVringCall:
    case VhostUserRequest::kSetVringErr: {
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) {
        CloseAll(&fds);
        return s;
      }
      Queue& q = queues_[msg.vring_index];
      int* slot = msg.request == VhostUserRequest::kSetVringCall ? &q.call_fd
                                                                 : &q.err_fd;
      CloseFd(slot);
      if (!fds.empty()) {
        *slot = fds[0];
        fds.clear();
      }
      return ack(0);
    }

    case VhostUserRequest::kSetVringEnable:
      if (absl::Status s = check_index(msg.vring_index); !s.ok()) return s;
      if (msg.vring_num > 1) {
        metrics_->Inc(SwapCounter::kMessagesRefused);
        return Refused(msg, "enable is neither 0 nor 1");
      }
      queues_[msg.vring_index].enabled = msg.vring_num == 1;
      return ack(0);

    case VhostUserRequest::kGetConfig: {
      metrics_->Inc(SwapCounter::kConfigReads);
      const std::vector<uint8_t> space = EncodeBlkConfigSpace(config_);
      const uint64_t end = uint64_t{msg.config.offset} + msg.config.size;
      if (end > kVhostUserMaxConfigSize) {
        metrics_->Inc(SwapCounter::kMessagesRefused);
        // The protocol's way to fail GET_CONFIG: an empty payload.
        return EncodeVhostUserReplyConfig(msg.raw_request, msg.config.offset,
                                          msg.config.flags, {});
      }
      std::vector<uint8_t> out(msg.config.size, 0);
      for (uint32_t i = 0; i < msg.config.size; ++i) {
        const uint64_t at = uint64_t{msg.config.offset} + i;
        if (at < space.size()) out[i] = space[at];
      }
      return EncodeVhostUserReplyConfig(msg.raw_request, msg.config.offset,
                                        msg.config.flags, out);
    }

    case VhostUserRequest::kSetConfig:
      // Nothing in our config space is writable (no writeback toggle).
      metrics_->Inc(SwapCounter::kConfigWritesRefused);
      return ack(1);

    case VhostUserRequest::kSetLogBase:
    case VhostUserRequest::kSetLogFd:
    case VhostUserRequest::kGetInflightFd:
    case VhostUserRequest::kSetInflightFd:
    case VhostUserRequest::kGetMaxMemSlots:
    case VhostUserRequest::kUnknown:
      break;
  }
  CloseAll(&fds);
  metrics_->Inc(SwapCounter::kMessagesUnsupported);
  // A request for a feature we never offered: the front-end is not one we
  // can serve, and it may be waiting for a reply we cannot give.
  return Refused(msg, "not supported by this back-end");
}

void VhostUserBlkSession::CountChainError(ChainError e) {
  switch (e) {
    case ChainError::kNone:
      return;
    case ChainError::kHeadOutOfRange:
      metrics_->Inc(SwapCounter::kChainHeadOutOfRange);
      return;
    case ChainError::kNextOutOfRange:
      metrics_->Inc(SwapCounter::kChainNextOutOfRange);
      return;
    case ChainError::kTooLong:
      metrics_->Inc(SwapCounter::kChainTooLong);
      return;
    case ChainError::kIndirectNotNegotiated:
    case ChainError::kIndirectWithNext:
    case ChainError::kNestedIndirect:
    case ChainError::kIndirectBadLength:
      metrics_->Inc(SwapCounter::kChainIndirectRefused);
      return;
    case ChainError::kIndirectOutOfMemory:
    case ChainError::kBufferOutOfMemory:
      metrics_->Inc(SwapCounter::kChainOutOfMemory);
      return;
    case ChainError::kReadableAfterWritable:
      metrics_->Inc(SwapCounter::kChainBadOrder);
      return;
    case ChainError::kTooLarge:
      metrics_->Inc(SwapCounter::kChainTooLarge);
      return;
  }
}

void VhostUserBlkSession::ServeQueue(uint32_t index) {
  if (index >= queues_.size() || !running(index)) return;
  Queue& q = queues_[index];
  const bool indirect =
      (acked_features_ & (1ull << kVirtioRingFIndirectDesc)) != 0;
  bool completed = false;
  while (true) {
    uint16_t head = 0;
    SplitVirtqueue::PopResult r;
    while ((r = q.vq.Pop(&head)) == SplitVirtqueue::PopResult::kHead) {
      const ChainError e =
          WalkDescriptorChain(memory_, q.vq.descriptor_table(), q.vq.size(),
                              head, indirect, &chain_);
      if (e != ChainError::kNone) {
        CountChainError(e);
        metrics_->Inc(SwapCounter::kQueuesBroken);
        q.broken = true;
        break;
      }
      const uint32_t used_len =
          ExecuteBlkRequest(chain_, config_, backing_, metrics_);
      q.vq.PushUsed(head, used_len);
      completed = true;
    }
    if (r == SplitVirtqueue::PopResult::kCorrupt) {
      metrics_->Inc(SwapCounter::kQueueCorruptIndex);
      metrics_->Inc(SwapCounter::kQueuesBroken);
      q.broken = true;
    }
    if (q.broken || !q.vq.EnableKicks()) break;
  }
  if (!completed) return;
  if (q.vq.NeedsCall() && q.call_fd >= 0) {
    const uint64_t one = 1;
    // An eventfd write only fails if the counter would overflow, i.e. the
    // guest already has an interrupt pending: nothing lost.
    [[maybe_unused]] ssize_t n = write(q.call_fd, &one, sizeof one);
    metrics_->Inc(SwapCounter::kCalls);
  } else {
    metrics_->Inc(SwapCounter::kCallsSuppressed);
  }
}

}  // namespace tmem::swap
