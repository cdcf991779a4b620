// Worker: the thread that drives channels.
//
// One epoll loop watches each channel's listening socket, attached client
// and doorbell eventfds. It drains submission rings in batches (per VM, in
// ring order; which VM next is the TurnScheduler's: a VM with a backlog
// cannot keep a light VM's entries waiting), raises the guest's completion
// interrupt only when a completed entry asked for one, and polls adaptively:
// after finding work it keeps polling the rings for `poll_us` with
// TMEM_HOST_NEEDS_DOORBELL cleared, so a busy guest posts puts without a
// doorbell (a VM exit) each; when idle it sets the flag, fences, re-checks the
// rings (see the Dekker note in proto/tmem_abi.h) and sleeps. A short timer
// re-checks every ring anyway, so a guest that forgets a doorbell is slow,
// never stuck.
//
// A listening socket that cannot accept (out of descriptors, see
// IvshmemServer) stays readable: the worker stops polling it and looks
// again after a back-off that doubles up to kMaxAcceptBackoffMs, logging
// each stop (the server counts them), instead of spinning on it.
//
// Thread-safety: AddChannel/RemoveChannel/Stop may be called from any
// thread; everything else runs on the worker thread.
#ifndef TMEMD_HOST_AGENT_WORKER_H_
#define TMEMD_HOST_AGENT_WORKER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "backend/mutex.h"
#include "host-agent/channel/channel.h"
#include "host-agent/turn_scheduler.h"

namespace tmem {

struct WorkerOptions {
  int poll_us = 50;        // keep polling this long after the last work
  uint32_t batch = 64;     // SQEs per backlogged channel per round
  int idle_check_ms = 10;  // timer re-check while asleep
  // See TurnScheduler: a backlogged channel's entries between looks at
  // the light ones, and a light channel's entries per look.
  uint32_t chunk = 1;
  uint32_t light_quantum = 8;
  // Called on the worker thread at the top of every loop round. Tests use
  // it to hold the worker busy; empty in tmemd.
  std::function<void()> round_hook;
};

class Worker {
 public:
  static constexpr int64_t kMinAcceptBackoffMs = 10;
  static constexpr int64_t kMaxAcceptBackoffMs = 1000;

  explicit Worker(const WorkerOptions& options);
  ~Worker();  // stops and joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  absl::Status Start();
  // Asks the loop to end and waits, up to `deadline`, for the thread to
  // leave it; true once it has (the thread is joined). False if it is
  // still busy (in a store operation, say) when the deadline passes: the
  // caller then decides (tmemd exits without tearing down what the thread
  // may still touch). May be called again to wait longer.
  // A negative deadline waits for as long as it takes.
  bool Stop(std::chrono::milliseconds deadline = std::chrono::milliseconds(-1))
      ABSL_LOCKS_EXCLUDED(mu_);

  // The channel must outlive its registration (until RemoveChannel returns).
  void AddChannel(Channel* channel) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns once the worker no longer touches the channel.
  void RemoveChannel(Channel* channel) ABSL_LOCKS_EXCLUDED(mu_);

  // The polling window in force (options.poll_us at start). Polling spins a
  // CPU that no VM is charged for, so the agent shrinks the window when the
  // valve's CPU budget shrinks. Any thread.
  void SetPollMicros(int poll_us) {
    poll_us_.store(poll_us, std::memory_order_relaxed);
  }

 private:
  enum class FdKind : uint8_t { kWake, kListen, kClient, kDoorbell };
  struct FdTarget {
    Channel* channel;
    FdKind kind;
  };
  struct Command {
    Channel* channel;
    bool add;
  };

  void Loop();
  void ApplyCommands() ABSL_LOCKS_EXCLUDED(mu_);
  // Queues a command, wakes the loop and waits until it has been applied
  // (or the worker stopped).
  void RunCommand(Channel* channel, bool add) ABSL_LOCKS_EXCLUDED(mu_);
  void Register(int fd, Channel* channel, FdKind kind);
  void Unregister(int fd);
  // The listening socket's events: attach, detach of a dead predecessor,
  // and the back-off when accept cannot get a descriptor.
  void OnListenEvent(Channel* channel);
  // Polls again every listening socket whose back-off has passed.
  void RearmListeners(int64_t now_us);
  void Attach(Channel* channel);
  void Detach(Channel* channel);
  class ActiveRings;
  // One TurnScheduler round over the connected channels; true if any SQE
  // was consumed. `rung`: channels whose doorbell fired this round.
  bool DrainAll(const std::vector<Channel*>& rung);
  // Sets or clears TMEM_HOST_NEEDS_DOORBELL on every connected channel;
  // when setting, returns true if a ring turned out to have work after all.
  bool SetNeedsDoorbell(bool needs);

  const WorkerOptions options_;
  std::atomic<int> poll_us_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  bool running_ = false;  // worker thread only

  // Taken by the agent under Agent::mu_; the worker thread takes nothing
  // else while holding it. Lock order: host-agent/lock_order.h.
  Mutex mu_;
  CondVar cv_;  // commands_done_ advanced or stop_ set
  std::vector<Command> commands_ ABSL_GUARDED_BY(mu_);
  uint64_t commands_done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t commands_queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool exited_ ABSL_GUARDED_BY(mu_) = false;  // the loop has returned
  bool started_ ABSL_GUARDED_BY(mu_) = false;

  // Worker thread only.
  std::vector<Channel*> channels_;
  std::unordered_map<int, FdTarget> fds_;
  std::unordered_map<Channel*, int> client_fd_of_;
  struct ListenBackoff {
    int64_t retry_at_us = 0;  // 0: polled
    int64_t delay_ms = 0;     // the last back-off
  };
  std::unordered_map<Channel*, ListenBackoff> listen_backoff_;
  bool polling_ = false;
  struct ResetLogState {
    int64_t last_log_us = -1000000000;
    uint64_t suppressed = 0;
  };
  std::unordered_map<Channel*, ResetLogState> reset_log_;
  TurnScheduler turns_;
  std::vector<Channel*> active_;       // this round's connected channels
  std::vector<Channel*> last_active_;  // the previous round's
  std::vector<uint8_t> served_;        // per active_ index, this round
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_WORKER_H_
