// VhostUserBlkSession: the back-end state of one vhost-user connection to a
// vhost-user-blk front-end (QEMU): negotiated features, the guest memory
// table, and per virtqueue its size, base, ring addresses, eventfds and
// enable state; and the serving of a queue after a kick.
//
// Contract:
//  * HandleMessage applies one parsed request and returns the bytes to send
//    back (empty: no reply). It answers GET_FEATURES, GET_PROTOCOL_FEATURES
//    (MQ, REPLY_ACK, CONFIG: nothing else is offered), GET_QUEUE_NUM,
//    GET_VRING_BASE (which stops that ring) and GET_CONFIG; with REPLY_ACK
//    negotiated, every other request carrying NEED_REPLY gets a u64 ack
//    (0: applied). It takes ownership of `fds`, whatever happens.
//  * A request that is not acceptable (features outside the offer, a
//    vring index >= the queue count, a bad memory table, ring addresses
//    outside guest memory, a request we do not serve) returns an error
//    Status naming the source; the caller drops the connection. Nothing the
//    front-end or guest sends can make the session touch memory outside
//    the mapped table.
//  * A ring runs once it has a kick fd and is enabled (SET_VRING_ENABLE
//    when VHOST_USER_F_PROTOCOL_FEATURES was negotiated, else at once); it
//    stops at GET_VRING_BASE, RESET_OWNER/RESET_DEVICE, or a fault found in
//    its rings (the queue is then "broken": counted, no longer served, and
//    the request that broke it is not completed, because a completion
//    without a trustworthy status byte could tell the guest bad data was
//    good). The next configuration of the ring clears it.
//  * ServeQueue completes every available request synchronously, so at
//    GET_VRING_BASE nothing is in flight and last_avail_idx is exact.
// Not thread-safe: one thread (the device's loop) owns a session.
#ifndef TMEMD_HOST_AGENT_SWAP_VHOST_USER_SESSION_H_
#define TMEMD_HOST_AGENT_SWAP_VHOST_USER_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "host-agent/swap/descriptor_chain.h"
#include "host-agent/swap/guest_memory.h"
#include "host-agent/swap/split_virtqueue.h"
#include "host-agent/swap/swap_backing.h"
#include "host-agent/swap/swap_metrics.h"
#include "host-agent/swap/vhost_user_message.h"
#include "host-agent/swap/virtio_blk.h"

namespace tmem::swap {

class VhostUserBlkSession {
 public:
  VhostUserBlkSession(const BlkDeviceConfig& config, SwapBacking* backing,
                      SwapMetrics* metrics);
  ~VhostUserBlkSession();
  VhostUserBlkSession(const VhostUserBlkSession&) = delete;
  VhostUserBlkSession& operator=(const VhostUserBlkSession&) = delete;

  absl::StatusOr<std::vector<uint8_t>> HandleMessage(
      const VhostUserMessage& msg, std::vector<int> fds);

  // Serves queue `index` until its available ring is empty, then calls the
  // guest if it asked for it. No-op for a queue that is not running.
  void ServeQueue(uint32_t index);

  uint32_t queue_count() const { return static_cast<uint32_t>(queues_.size()); }
  // The kick eventfd of a queue (-1: none); the device polls these.
  int kick_fd(uint32_t index) const { return queues_[index].kick_fd; }
  bool running(uint32_t index) const;
  uint64_t offered_features() const { return offered_features_; }
  uint64_t acked_features() const { return acked_features_; }

 private:
  struct Queue {
    uint32_t num = 0;
    uint16_t base = 0;
    VringAddrDesc addr;
    bool addr_set = false;
    int kick_fd = -1;
    int call_fd = -1;
    int err_fd = -1;
    bool enabled = false;
    bool started = false;  // has a kick fd and a configured ring
    bool broken = false;
    SplitVirtqueue vq;
  };

  absl::Status StartQueue(uint32_t index);
  void StopQueue(uint32_t index);
  void ResetAll();
  void CountChainError(ChainError e);
  bool protocol_features_acked() const;

  const BlkDeviceConfig config_;
  SwapBacking* const backing_;
  SwapMetrics* const metrics_;
  const uint64_t offered_features_;
  const uint64_t offered_protocol_features_;
  uint64_t acked_features_ = 0;
  uint64_t acked_protocol_features_ = 0;
  GuestMemory memory_;
  std::vector<Queue> queues_;
  DescriptorChain chain_;  // reused by every request
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_VHOST_USER_SESSION_H_
