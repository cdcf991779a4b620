#include "host-agent/swap/swap_device.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "host-agent/swap/vhost_user_message.h"
#include "host-agent/swap/vhost_user_session.h"

namespace tmem::swap {
namespace {

// epoll data: what woke us.
constexpr uint64_t kTagStop = 1ull << 32;
constexpr uint64_t kTagListen = 2ull << 32;
constexpr uint64_t kTagClient = 3ull << 32;
constexpr uint64_t kTagKick = 4ull << 32;  // | queue index
constexpr uint64_t kTagMask = 0xffffffffull << 32;

int64_t ThreadCpuNanos() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (static_cast<int64_t>(ts.tv_sec) * 1'000'000'000) + ts.tv_nsec;
}

// Waits until `fd` is readable or the deadline passes.
bool WaitReadable(int fd, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// Reads one whole message (header, then the payload it announces) with the
// descriptors that came with it. Closed connection: kUnavailable.
absl::Status ReadMessage(int fd, std::vector<uint8_t>* bytes,
                         std::vector<int>* fds) {
  bytes->assign(kVhostUserHeaderSize, 0);
  fds->clear();
  const auto deadline = std::chrono::steady_clock::now() + kMessageTimeout;
  size_t got = 0;
  bool first = true;
  // QEMU sends the descriptors with the first byte of the header.
  while (got < kVhostUserHeaderSize) {
    if (!first && !WaitReadable(fd, deadline)) {
      return absl::DeadlineExceededError("front-end stalled in a header");
    }
    iovec iov{bytes->data() + got, kVhostUserHeaderSize - got};
    alignas(cmsghdr)
        std::array<char, CMSG_SPACE(sizeof(int) * kVhostUserMaxFds)>
            ctl{};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.data();
    mh.msg_controllen = ctl.size();
    const ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      first = false;
      continue;
    }
    if (n < 0) {
      // Any receive error ends this front-end's connection.
      return absl::UnavailableError(
          absl::ErrnoToStatus(errno, "recvmsg").message());
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr;
         c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int v;
          std::memcpy(&v, CMSG_DATA(c) + i * sizeof(int), sizeof v);
          fds->push_back(v);
        }
      }
    }
    if ((mh.msg_flags & MSG_CTRUNC) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", kVhostUserMaxFds,
                       " file descriptors with one message"));
    }
    if (n == 0) {
      return got == 0 && fds->empty()
                 ? absl::UnavailableError("front-end closed the connection")
                 : absl::InvalidArgumentError("connection closed mid-header");
    }
    got += static_cast<size_t>(n);
    first = false;
  }
  absl::StatusOr<uint32_t> size = ParseVhostUserHeaderSize(*bytes);
  if (!size.ok()) return size.status();
  bytes->resize(kVhostUserHeaderSize + *size);
  while (got < bytes->size()) {
    if (!WaitReadable(fd, deadline)) {
      return absl::DeadlineExceededError("front-end stalled in a payload");
    }
    const ssize_t n =
        recv(fd, bytes->data() + got, bytes->size() - got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {
      return absl::InvalidArgumentError("connection closed mid-payload");
    }
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

bool SendAll(int fd, const std::vector<uint8_t>& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n =
        send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

SwapDevice::SwapDevice(SwapDeviceOptions options, SwapBacking* backing)
    : options_(std::move(options)), backing_(backing) {
  options_.blk.capacity_sectors = backing_->page_count() * kSectorsPerPage;
}

absl::StatusOr<std::unique_ptr<SwapDevice>> SwapDevice::Start(
    SwapDeviceOptions options, SwapBacking* backing) {
  if (backing == nullptr || backing->page_count() == 0) {
    return absl::InvalidArgumentError("swap device needs a non-empty backing");
  }
  if (options.blk.num_queues == 0 || options.blk.num_queues > 64) {
    return absl::InvalidArgumentError("num_queues must be 1 to 64");
  }
  std::unique_ptr<SwapDevice> dev(new SwapDevice(std::move(options), backing));
  dev->listen_fd_ =
      socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (dev->listen_fd_ < 0) {
    return absl::ErrnoToStatus(errno, "socket(AF_UNIX)");
  }
  if (absl::Status s =
          BindUnixSocket(dev->listen_fd_, dev->options_.socket_path,
                         dev->options_.socket_mode, 4);
      !s.ok()) {
    return s;
  }
  dev->published_ = true;
  dev->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (dev->stop_fd_ < 0) {
    return absl::ErrnoToStatus(errno, "eventfd");
  }
  dev->thread_ = std::thread([d = dev.get()] { d->Loop(); });
  return dev;
}

SwapDevice::~SwapDevice() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
  // Only a path we published is ours to remove: when Start failed, what is
  // there may be another server's live socket.
  if (published_) unlink(options_.socket_path.c_str());
  if (stop_fd_ >= 0) close(stop_fd_);
}

void SwapDevice::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(stop_fd_, &one, sizeof one);
  thread_.join();
  // Stop listening now, not at destruction: tmemd writes the backing back
  // between the two, and meanwhile a reconnecting QEMU (reconnect=1) must be
  // refused and retry. A listener left open would let the kernel complete
  // its connect into a backlog nobody accepts; QEMU 7.2 then sends its
  // first message, fails when the process exits, and never re-runs the
  // handshake on its next connection (seen: the restarted tmemd accepted
  // QEMU and got no message).
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

void SwapDevice::Loop() {
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return;
  const auto add = [ep](int fd, uint64_t tag) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
    return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0;
  };
  add(stop_fd_, kTagStop);
  add(listen_fd_, kTagListen);

  int client = -1;
  std::unique_ptr<VhostUserBlkSession> session;
  std::vector<int> registered_kicks;  // fds currently in the epoll set

  const auto sync_kicks = [&] {
    // Re-registers from scratch: an fd number the session closed and got
    // again for a new eventfd must not be mistaken for the old one.
    for (int fd : registered_kicks) epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
    registered_kicks.clear();
    if (!session) return;
    for (uint32_t i = 0; i < session->queue_count(); ++i) {
      const int fd = session->kick_fd(i);
      if (fd >= 0 && add(fd, kTagKick | i)) registered_kicks.push_back(fd);
    }
  };
  const auto drop_client = [&](std::string_view event,
                               absl::string_view reason) {
    if (client < 0) return;
    for (int fd : registered_kicks) epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
    registered_kicks.clear();
    epoll_ctl(ep, EPOLL_CTL_DEL, client, nullptr);
    close(client);
    client = -1;
    session.reset();
    connected_.store(false);
    if (options_.on_event) {
      options_.on_event(event, std::string_view(reason.data(), reason.size()));
    }
  };

  // A queue pass, charged to the VM when the owner asked for it.
  const auto serve = [&](uint32_t q) {
    if (!options_.charge_cpu) {
      session->ServeQueue(q);
      return;
    }
    const int64_t start = ThreadCpuNanos();
    session->ServeQueue(q);
    const int64_t used = ThreadCpuNanos() - start;
    if (used > 0) options_.charge_cpu(used);
  };

  std::vector<uint8_t> bytes;
  std::vector<int> fds;
  bool stop = false;
  while (!stop) {
    std::array<epoll_event, 16> evs{};
    const int n = epoll_wait(ep, evs.data(), evs.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < n && !stop; ++i) {
      const uint64_t tag = evs[i].data.u64 & kTagMask;
      if (tag == kTagStop) {
        stop = true;
      } else if (tag == kTagListen) {
        const int c =
            accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) continue;
        if (client >= 0) {
          metrics_.Inc(SwapCounter::kClientsRejectedBusy);
          close(c);
          if (options_.on_event) {
            options_.on_event("swap_client_rejected",
                              "a front-end is already connected");
          }
          continue;
        }
        client = c;
        session = std::make_unique<VhostUserBlkSession>(options_.blk, backing_,
                                                        &metrics_);
        add(client, kTagClient);
        connected_.store(true);
        metrics_.Inc(SwapCounter::kClientsAccepted);
      } else if (tag == kTagClient) {
        if (client < 0) continue;
        absl::Status s = ReadMessage(client, &bytes, &fds);
        if (!s.ok()) {
          for (int fd : fds) close(fd);
          fds.clear();
          if (absl::IsUnavailable(s)) {
            metrics_.Inc(SwapCounter::kClientDisconnects);
            drop_client("swap_client_disconnected", s.message());
          } else {
            metrics_.Inc(SwapCounter::kMessagesMalformed);
            metrics_.Inc(SwapCounter::kSessionResets);
            drop_client("swap_session_reset", s.message());
          }
          continue;
        }
        absl::StatusOr<VhostUserMessage> msg =
            ParseVhostUserMessage(bytes, fds.size());
        if (!msg.ok()) {
          for (int fd : fds) close(fd);
          fds.clear();
          metrics_.Inc(SwapCounter::kMessagesMalformed);
          metrics_.Inc(SwapCounter::kSessionResets);
          drop_client("swap_session_reset", msg.status().message());
          continue;
        }
        absl::StatusOr<std::vector<uint8_t>> reply =
            session->HandleMessage(*msg, std::move(fds));
        fds.clear();
        if (!reply.ok()) {
          metrics_.Inc(SwapCounter::kSessionResets);
          drop_client("swap_session_reset", reply.status().message());
          continue;
        }
        if (!reply->empty() && !SendAll(client, *reply)) {
          metrics_.Inc(SwapCounter::kClientDisconnects);
          drop_client("swap_client_disconnected", "reply could not be sent");
          continue;
        }
        sync_kicks();
        // A ring that just started may already hold requests (a front-end
        // reconnecting to a running guest): serve them without a kick.
        for (uint32_t q = 0; q < session->queue_count(); ++q) {
          serve(q);
        }
      } else if (tag == kTagKick) {
        const auto q = static_cast<uint32_t>(evs[i].data.u64);
        if (!session || q >= session->queue_count()) continue;
        const int fd = session->kick_fd(q);
        if (fd < 0) continue;
        uint64_t v;
        // Drain the counter: one pass serves every kick so far.
        [[maybe_unused]] ssize_t r = read(fd, &v, sizeof v);
        metrics_.Inc(SwapCounter::kKicks);
        serve(q);
      }
    }
  }
  drop_client("swap_device_stopped", "stopping");
  close(ep);
}

}  // namespace tmem::swap
