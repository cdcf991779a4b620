#include "host-agent/worker.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "host-agent/log.h"
#include "proto/tmem_abi.h"

namespace tmem {

namespace {

int64_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What a VM is charged for the worker's time on its ring. Wall time, not
// CLOCK_THREAD_CPUTIME_ID: that clock is a system call, read at every
// switch between VMs (two per round with one VM busy), which added ~2.5 us
// to a polled get round trip (bench/run_ring.sh get_poll, 2.0 -> 4.4 us
// over an in-process get). A charge window spans one round's serving, so
// wall time differs from CPU time only when the worker is preempted
// mid-round, and then the VM whose entries it was serving pays.
int64_t ChargeClockNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Worker::Worker(const WorkerOptions& options)
    : options_(options),
      poll_us_(options.poll_us),
      turns_(TurnOptions{.batch = options.batch,
                         .chunk = options.chunk,
                         .light_quantum = options.light_quantum}) {}

Worker::~Worker() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

absl::Status Worker::Start() {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) {
    return absl::InternalError(absl::StrCat(
        "epoll_create1: ", std::generic_category().message(errno)));
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    return absl::InternalError(
        absl::StrCat("eventfd: ", std::generic_category().message(errno)));
  }
  Register(wake_fd_, nullptr, FdKind::kWake);
  {
    MutexLock lock(&mu_);
    started_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

bool Worker::Stop(std::chrono::milliseconds deadline) {
  {
    MutexLock lock(&mu_);
    if (!started_) return true;
    if (!stop_) {
      stop_ = true;
      uint64_t one = 1;
      ssize_t unused = write(wake_fd_, &one, sizeof(one));
      (void)unused;
    }
    const auto until = std::chrono::steady_clock::now() + deadline;
    while (!exited_) {
      if (deadline.count() < 0) {
        cv_.Wait(&mu_);
      } else if (!cv_.WaitUntil(&mu_, until)) {
        break;  // the deadline passed
      }
    }
    if (!exited_) return false;
  }
  if (thread_.joinable()) thread_.join();
  return true;
}

void Worker::AddChannel(Channel* channel) { RunCommand(channel, true); }

void Worker::RemoveChannel(Channel* channel) { RunCommand(channel, false); }

void Worker::RunCommand(Channel* channel, bool add) {
  MutexLock lock(&mu_);
  // Once stopped, the loop is gone: nothing touches the channel any more and
  // nothing would apply the command.
  if (stop_) return;
  commands_.push_back({channel, add});
  const uint64_t ticket = ++commands_queued_;
  uint64_t one = 1;
  ssize_t unused = write(wake_fd_, &one, sizeof(one));
  (void)unused;
  while (commands_done_ < ticket && !stop_) cv_.Wait(&mu_);
}

void Worker::Register(int fd, Channel* channel, FdKind kind) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (kind == FdKind::kClient) ev.events |= EPOLLRDHUP;
  ev.data.fd = fd;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    Log(LogLevel::kError, "epoll_add_failed",
        {{"fd", fd}, {"error", std::generic_category().message(errno)}});
    return;
  }
  fds_[fd] = {channel, kind};
}

void Worker::Unregister(int fd) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  fds_.erase(fd);
}

void Worker::Attach(Channel* ch) {
  channels_.push_back(ch);
  Register(ch->server().listen_fd(), ch, FdKind::kListen);
  for (int v = 0; v < ch->server().vectors(); ++v) {
    Register(ch->server().doorbell_fd(v), ch, FdKind::kDoorbell);
  }
  if (ch->server().connected()) {
    client_fd_of_[ch] = ch->server().client_fd();
    Register(ch->server().client_fd(), ch, FdKind::kClient);
  }
}

void Worker::Detach(Channel* ch) {
  Unregister(ch->server().listen_fd());
  listen_backoff_.erase(ch);
  for (int v = 0; v < ch->server().vectors(); ++v) {
    Unregister(ch->server().doorbell_fd(v));
  }
  auto it = client_fd_of_.find(ch);
  if (it != client_fd_of_.end()) {
    Unregister(it->second);
    client_fd_of_.erase(it);
  }
  channels_.erase(std::remove(channels_.begin(), channels_.end(), ch),
                  channels_.end());
  reset_log_.erase(ch);
}

void Worker::OnListenEvent(Channel* ch) {
  // The server may close the attached client (a dead predecessor found
  // when a newcomer connects) and the next accept may reuse its number:
  // out of the epoll set first, back in below if still attached.
  auto it = client_fd_of_.find(ch);
  if (it != client_fd_of_.end()) {
    Unregister(it->second);
    client_fd_of_.erase(it);
  }
  IvshmemServer& server = ch->server();
  server.OnListenReadable();
  if (server.connected()) {
    client_fd_of_[ch] = server.client_fd();
    Register(server.client_fd(), ch, FdKind::kClient);
  }
  if (!server.accept_blocked()) {
    listen_backoff_.erase(ch);
    return;
  }
  // Still readable, nothing acceptable: stop polling it for a while.
  ListenBackoff& b = listen_backoff_[ch];
  b.delay_ms =
      std::clamp(b.delay_ms * 2, kMinAcceptBackoffMs, kMaxAcceptBackoffMs);
  b.retry_at_us = NowMicros() + b.delay_ms * 1000;
  epoll_event ev{};
  ev.events = 0;  // registered, but reports nothing until re-armed
  ev.data.fd = server.listen_fd();
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, server.listen_fd(), &ev);
  // Every stop is counted; the log has the 1st, 2nd, 4th, 8th...
  const uint64_t n = server.accept_backoffs();
  if ((n & (n - 1)) == 0) {
    Log(LogLevel::kWarn, "ivshmem_accept_backoff",
        {{"vm", ch->name()},
         {"reason", "no descriptor for a queued guest connection"},
         {"backoffs", n},
         {"retry_ms", b.delay_ms}});
  }
}

void Worker::RearmListeners(int64_t now_us) {
  for (auto& [ch, b] : listen_backoff_) {
    if (b.retry_at_us == 0 || now_us < b.retry_at_us) continue;
    b.retry_at_us = 0;  // the delay stays until an accept succeeds
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = ch->server().listen_fd();
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, ch->server().listen_fd(), &ev);
  }
}

void Worker::ApplyCommands() {
  std::vector<Command> commands;
  {
    MutexLock lock(&mu_);
    commands.swap(commands_);
    running_ = !stop_;
  }
  for (const Command& c : commands) {
    if (c.add) {
      Attach(c.channel);
    } else {
      Detach(c.channel);
    }
  }
  {
    MutexLock lock(&mu_);
    commands_done_ += commands.size();
  }
  cv_.NotifyAll();
}

// The worker's connected rings as the TurnScheduler sees them. Serving a
// ring drains it, sends the guest's interrupt, and charges the VM the
// worker time it used: the clock is read only when the worker moves from
// one VM's ring to another's, so a backlogged VM served in chunks pays
// no clock reads while nobody else has work.
class Worker::ActiveRings : public TurnScheduler::Rings {
 public:
  ActiveRings(Worker* worker, const std::vector<Channel*>& rung)
      : worker_(worker), rung_(rung) {}
  ~ActiveRings() override { ChargeTo(nullptr); }
  ActiveRings(const ActiveRings&) = delete;
  ActiveRings& operator=(const ActiveRings&) = delete;

  size_t size() const override { return worker_->active_.size(); }
  bool Pending(size_t i) override {
    return worker_->active_[i]->consumer().Pending() > 0;
  }
  RingConsumer::DrainResult Serve(size_t i, uint32_t max_entries,
                                  bool others_light) override;

 private:
  // The CPU since the last switch goes to the VM that used it.
  void ChargeTo(Channel* next);

  Worker* const worker_;
  const std::vector<Channel*>& rung_;
  Channel* charging_ = nullptr;
  int64_t charging_since_ns_ = 0;
};

void Worker::ActiveRings::ChargeTo(Channel* next) {
  if (next == charging_) return;
  const int64_t now = ChargeClockNanos();
  if (charging_ != nullptr && charging_->advisor() != nullptr) {
    // The valve's CPU accounting: what this VM's entries really cost, its
    // completion interrupts included (an eventfd write per get a sleeping
    // guest waits on).
    charging_->advisor()->ChargeCpu(charging_->vm(), now - charging_since_ns_);
  }
  charging_ = next;
  charging_since_ns_ = now;
}

RingConsumer::DrainResult Worker::ActiveRings::Serve(size_t i,
                                                     uint32_t max_entries,
                                                     bool others_light) {
  Channel* ch = worker_->active_[i];
  // A ring with no entries costs a few header loads: not worth the clock
  // reads of a switch (the previous VM, if any, is charged for them).
  if (ch->consumer().Pending() > 0) ChargeTo(ch);
  // A backlogged VM's compression waits for the compactor while others
  // are light: a flood of compressing puts slows only itself.
  const RingConsumer::DrainResult r =
      ch->consumer().Drain(max_entries, others_light);
  if (r.interrupt) {
    // NotifyGuest counts what it really sent (kInterruptsSent).
    ch->server().NotifyGuest(TMEM_VEC_COMPLETE);
  }
  if (r.consumed > 0 && worker_->served_[i] == 0) {
    worker_->served_[i] = 1;
    ch->NoteServed();
    // Work found without this guest ringing: what polling saves (once
    // per round, however many chunks the round took).
    if (std::find(rung_.begin(), rung_.end(), ch) == rung_.end()) {
      ch->metrics().Inc(ChannelCounter::kPollRounds);
    }
  }
  if (r.reset) {
    // A hostile guest can reset its channel thousands of times a second;
    // the counter has every one, the log one line per second per VM.
    ResetLogState& state = worker_->reset_log_[ch];
    const int64_t now = NowMicros();
    if (now - state.last_log_us >= 1000000) {
      Log(LogLevel::kWarn, "channel_reset",
          {{"vm", ch->name()},
           {"reason", "corrupt ring indices"},
           {"suppressed_since_last", state.suppressed}});
      state.last_log_us = now;
      state.suppressed = 0;
    } else {
      ++state.suppressed;
    }
  }
  return r;
}

bool Worker::DrainAll(const std::vector<Channel*>& rung) {
  active_.clear();
  for (Channel* ch : channels_) {
    if (!ch->server().connected()) continue;
    if (ch->region().IsForeign()) {
      // Another host's header (live migration copied the region in, maybe
      // still copying): nothing in it is ours to execute.
      ch->OnForeignRegion();
      // Each round of an incoming migration may rewrite the header again,
      // and a hostile guest can scribble on it at will: the counter has
      // every one, the log the 1st, 2nd, 4th, 8th...
      const uint64_t n = ch->metrics().Get(ChannelCounter::kForeignRegions);
      if ((n & (n - 1)) == 0) {
        Log(LogLevel::kInfo, "foreign_region_reset",
            {{"vm", ch->name()}, {"count", n}});
      }
      continue;
    }
    ch->PublishAdmissionHint();
    active_.push_back(ch);
  }
  if (active_ != last_active_) {
    // Ring indices name other channels now.
    turns_.Forget();
    last_active_ = active_;
  }
  served_.assign(active_.size(), 0);
  ActiveRings rings(this, rung);
  return turns_.Round(rings) > 0;
}

bool Worker::SetNeedsDoorbell(bool needs) {
  bool pending = false;
  for (Channel* ch : channels_) {
    if (!ch->server().connected()) continue;
    ch->region().SetNeedsDoorbell(needs);
  }
  if (!needs) return false;
  // Dekker with the guest (proto/tmem_abi.h): flag store, full fence, then
  // re-read the rings, so a tail published before the guest saw the flag is
  // not slept on.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (Channel* ch : channels_) {
    if (ch->server().connected() && ch->consumer().Pending() > 0) {
      pending = true;
    }
  }
  return pending;
}

void Worker::Loop() {
  // Named so that per-thread CPU and scheduling figures (top -H, /proc,
  // tmem-isolation-bench) tell the data plane from gRPC and other threads.
  pthread_setname_np(pthread_self(), "tmem-worker");
  running_ = true;
  std::vector<epoll_event> events(64);
  int64_t last_work_us = 0;
  // While polling, guests do not ring and the rings are read directly: an
  // epoll_wait per spin would be a syscall per round, the largest part of
  // tmemd's CPU under a busy re-reader. Sockets are looked at every
  // kSpinsPerEventCheck rounds.
  constexpr int kSpinsPerEventCheck = 16;
  int spins = 0;
  while (running_) {
    if (options_.round_hook) options_.round_hook();
    int n = 0;
    if (!polling_ || ++spins >= kSpinsPerEventCheck) {
      spins = 0;
      const int timeout_ms = polling_ ? 0 : options_.idle_check_ms;
      n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()),
                     timeout_ms);
    }
    if (n < 0 && errno != EINTR) {
      Log(LogLevel::kError, "epoll_wait_failed",
          {{"error", std::generic_category().message(errno)}});
      break;
    }
    std::vector<Channel*> rung;
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      auto it = fds_.find(fd);
      if (it == fds_.end()) continue;
      const FdTarget target = it->second;
      switch (target.kind) {
        case FdKind::kWake: {
          uint64_t v;
          ssize_t unused = read(fd, &v, sizeof(v));
          (void)unused;
          ApplyCommands();
          break;
        }
        case FdKind::kListen:
          OnListenEvent(target.channel);
          break;
        case FdKind::kClient: {
          Channel* ch = target.channel;
          // Unregister before the server closes the fd: a closed fd number
          // may be reused at once by the next accept.
          Unregister(fd);
          client_fd_of_.erase(ch);
          // A guest that left went through the channel's detach (fd
          // store, pools, region) inside OnClientEvent.
          if (!ch->server().OnClientEvent()) {
            client_fd_of_[ch] = fd;
            Register(fd, ch, FdKind::kClient);
          }
          break;
        }
        case FdKind::kDoorbell: {
          uint64_t v;
          if (read(fd, &v, sizeof(v)) == sizeof(v)) {
            target.channel->metrics().Inc(ChannelCounter::kDoorbells);
          }
          rung.push_back(target.channel);
          break;
        }
      }
    }
    if (!running_) break;
    const bool work = DrainAll(rung);
    const int64_t now = NowMicros();
    if (!listen_backoff_.empty()) RearmListeners(now);
    if (work) {
      last_work_us = now;
      if (!polling_) {
        polling_ = true;
        SetNeedsDoorbell(false);
      }
      continue;
    }
    if (polling_ &&
        now - last_work_us >= poll_us_.load(std::memory_order_relaxed)) {
      // Going to sleep: ask for doorbells, then look once more.
      polling_ = SetNeedsDoorbell(true);
      if (polling_) SetNeedsDoorbell(false);
    }
  }
  // Leave every guest able to wake a future tmemd... which will not come
  // for these regions; ask for doorbells so no guest spins on us.
  SetNeedsDoorbell(true);
  {
    MutexLock lock(&mu_);
    stop_ = true;
    exited_ = true;
  }
  cv_.NotifyAll();
}

}  // namespace tmem
