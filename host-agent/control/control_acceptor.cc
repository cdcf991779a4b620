#include "host-agent/control/control_acceptor.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "host-agent/log.h"

namespace tmem {
namespace {

// Connections taken from one listener per wake-up, so a flood on one socket
// cannot keep the loop from the others (poll is level-triggered: the rest
// are taken on the next turn).
constexpr int kAcceptsPerTurn = 32;

constexpr std::chrono::seconds kLogEvery{1};

bool OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ControlAcceptor>> ControlAcceptor::Start(
    std::vector<ControlListenerSpec> listeners) {
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int err = errno;
    for (const ControlListenerSpec& l : listeners) close(l.listen_fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "control acceptor: eventfd: ", std::generic_category().message(err)));
  }
  std::unique_ptr<ControlAcceptor> self(new ControlAcceptor(wake));
  for (ControlListenerSpec& spec : listeners) {
    auto l = std::make_unique<Listener>();
    l->spec = std::move(spec);
    self->listeners_.push_back(std::move(l));
  }
  self->thread_ = std::thread([p = self.get()] { p->Loop(); });
  return self;
}

ControlAcceptor::ControlAcceptor(int wake_fd) : wake_fd_(wake_fd) {}

ControlAcceptor::~ControlAcceptor() {
  Stop();
  close(wake_fd_);
}

void ControlAcceptor::Stop() {
  if (stop_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  for (const Watch& w : watches_) {
    close(w.fd);
    w.listener->open.fetch_sub(1, std::memory_order_relaxed);
  }
  watches_.clear();
  for (const auto& l : listeners_) {
    close(l->spec.listen_fd);
    l->spec.listen_fd = -1;
  }
}

std::vector<ControlListenerStats> ControlAcceptor::Stats() const {
  std::vector<ControlListenerStats> out;
  for (const auto& l : listeners_) {
    out.push_back({l->spec.name, l->open.load(std::memory_order_relaxed),
                   l->spec.max_connections,
                   l->refused.load(std::memory_order_relaxed),
                   l->accept_failures.load(std::memory_order_relaxed)});
  }
  return out;
}

void ControlAcceptor::LogRateLimited(
    Listener& l, const char* event, int err,
    std::chrono::steady_clock::time_point now) {
  if (now - l.last_log < kLogEvery) {
    ++l.unlogged;
    return;
  }
  l.last_log = now;
  Log(LogLevel::kWarn, event,
      {{"listener", l.spec.name},
       {"open", l.open.load(std::memory_order_relaxed)},
       {"max_connections", l.spec.max_connections},
       {"refused", l.refused.load(std::memory_order_relaxed)},
       {"accept_failures", l.accept_failures.load(std::memory_order_relaxed)},
       {"error", err == 0 ? std::string("connection limit reached")
                          : std::generic_category().message(err)},
       {"not_logged", l.unlogged}});
  l.unlogged = 0;
}

void ControlAcceptor::AcceptFrom(Listener& l,
                                 std::chrono::steady_clock::time_point now) {
  for (int i = 0; i < kAcceptsPerTurn; ++i) {
    const int fd = accept4(l.spec.listen_fd, nullptr, nullptr,
                           SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      if (OutOfResources(err)) {
        // The connection stays in the backlog; poll leaves this socket out
        // until retry_at instead of waking on it again at once.
        l.accept_failures.fetch_add(1, std::memory_order_relaxed);
        l.retry_at = now + kRetryAfter;
        LogRateLimited(l, "control_accept_failed", err, now);
      } else if (err != EAGAIN) {
        l.retry_at = now + kRetryAfter;
        LogRateLimited(l, "control_accept_failed", err, now);
      }
      return;
    }
    if (l.open.load(std::memory_order_relaxed) >= l.spec.max_connections) {
      close(fd);
      l.refused.fetch_add(1, std::memory_order_relaxed);
      LogRateLimited(l, "control_connection_refused", 0, now);
      continue;
    }
    const int watch = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (watch < 0) {
      const int err = errno;
      close(fd);
      l.accept_failures.fetch_add(1, std::memory_order_relaxed);
      l.retry_at = now + kRetryAfter;
      LogRateLimited(l, "control_accept_failed", err, now);
      return;
    }
    l.open.fetch_add(1, std::memory_order_relaxed);
    watches_.push_back({watch, &l});
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
    p.listener_fd = l.spec.listen_fd;
    p.fd = fd;  // gRPC owns it from here (closes it if it is shutting down)
    l.spec.to_grpc->HandleNewConnection(&p);
  }
}

// One thread, poll(): the wake eventfd, each listener that is not waiting to
// retry, and the watched duplicates (no events asked: POLLHUP and POLLERR
// always report; POLLRDHUP is the peer's half close, after which gRPC ends
// the connection itself).
void ControlAcceptor::Loop() {
  std::vector<pollfd> fds;
  std::vector<Listener*> polled;
  while (!stop_.load()) {
    auto now = std::chrono::steady_clock::now();
    fds.clear();
    polled.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    int timeout_ms = -1;
    for (const auto& l : listeners_) {
      if (now < l->retry_at) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                              l->retry_at - now)
                              .count() +
                          1;
        timeout_ms = timeout_ms < 0
                         ? static_cast<int>(left)
                         : std::min(timeout_ms, static_cast<int>(left));
        continue;
      }
      fds.push_back({l->spec.listen_fd, POLLIN, 0});
      polled.push_back(l.get());
    }
    const size_t first_watch = fds.size();
    for (const Watch& w : watches_) fds.push_back({w.fd, POLLRDHUP, 0});
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      // Only EFAULT/EINVAL/ENOMEM: wait a little rather than spin.
      std::this_thread::sleep_for(kRetryAfter);
      continue;
    }
    if ((fds[0].revents & POLLIN) != 0) break;
    now = std::chrono::steady_clock::now();
    // Closed connections first: their slots and descriptors come back before
    // the listeners are served. Backwards, so removing one moves only an
    // entry already visited.
    bool freed = false;
    for (size_t i = watches_.size(); i-- > 0;) {
      if (fds[first_watch + i].revents == 0) continue;
      close(watches_[i].fd);
      watches_[i].listener->open.fetch_sub(1, std::memory_order_relaxed);
      watches_[i] = watches_.back();
      watches_.pop_back();
      freed = true;
    }
    for (size_t i = 0; i < polled.size(); ++i) {
      if ((fds[1 + i].revents & POLLIN) != 0) AcceptFrom(*polled[i], now);
    }
    // A descriptor came back: listeners waiting out an accept failure may
    // try again now rather than at their retry time.
    if (freed) {
      for (const auto& l : listeners_) l->retry_at = {};
    }
  }
}

}  // namespace tmem
