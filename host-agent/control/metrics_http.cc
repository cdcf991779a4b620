#include "host-agent/control/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "host-agent/control/prometheus_text.h"
#include "host-agent/log.h"

namespace tmem {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const Agent* agent, const std::string& address, int port,
    ExtraMetrics extra) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (port < 0 || port > 65535 ||
      inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, ":", port,
                     "' is not an IPv4 address and port"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 16) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen for metrics on ", address, ":", port, ": ",
                     std::generic_category().message(err)));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::InternalError("eventfd() failed");
  }
  std::unique_ptr<MetricsServer> s(new MetricsServer(
      agent, fd, wake, ntohs(addr.sin_port), std::move(extra)));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsServer::MetricsServer(const Agent* agent, int listen_fd, int wake_fd,
                             int port, ExtraMetrics extra)
    : agent_(agent),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port),
      extra_(std::move(extra)) {}

MetricsServer::~MetricsServer() {
  Stop();
  close(listen_fd_);
  close(wake_fd_);
}

void MetricsServer::Stop() {
  if (stop_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

namespace {

constexpr size_t kMaxRequestBytes = 8192;

bool RequestComplete(const std::string& r) {
  return r.find("\r\n\r\n") != std::string::npos ||
         r.find("\n\n") != std::string::npos || r.size() >= kMaxRequestBytes;
}

constexpr MetricFamily kHttpRefused{
    "tmem_metrics_http_refused_connections_total", MetricType::kCounter,
    "Connections to /metrics closed at accept: the open-connection limit "
    "was reached."};
constexpr MetricFamily kHttpTimedOut{
    "tmem_metrics_http_timed_out_connections_total", MetricType::kCounter,
    "Connections to /metrics closed at their deadline (slow or idle "
    "clients)."};
constexpr MetricFamily kHttpAcceptFailures{
    "tmem_metrics_http_accept_failures_total", MetricType::kCounter,
    "accept() failures on /metrics for want of descriptors or memory; the "
    "listener retries."};

std::string Respond(const Agent& agent, const MetricsServer& server,
                    const std::string& request) {
  std::string status = "200 OK";
  std::string body;
  const std::string type = "text/plain; version=0.0.4; charset=utf-8";
  if (request.rfind("GET /metrics ", 0) == 0 ||
      request.rfind("GET /metrics\r", 0) == 0) {
    PrometheusText text;
    AppendAgentMetrics(agent, text);
    text.Add(kHttpRefused, {}, server.refused());
    text.Add(kHttpTimedOut, {}, server.timed_out());
    text.Add(kHttpAcceptFailures, {}, server.accept_failures());
    server.AppendExtra(text);
    body = text.Render();
  } else if (request.rfind("GET ", 0) == 0) {
    status = "404 Not Found";
    body = "tmemd serves only /metrics\n";
  } else {
    status = "400 Bad Request";
    body = "send GET /metrics\n";
  }
  return absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

// One thread, no blocking call: every client socket is non-blocking and
// polled with the listener, so a client that sends slowly, never reads, or
// just holds its connection costs one slot until its deadline, never the
// other scrapers' turn.
void MetricsServer::Loop() {
  struct Client {
    int fd;
    std::chrono::steady_clock::time_point deadline;
    std::string request;
    std::string response;
    size_t sent = 0;
  };
  std::vector<Client> clients;
  auto drop = [&](size_t i) {
    close(clients[i].fd);
    clients[i] = std::move(clients.back());
    clients.pop_back();
  };
  // While accept() fails for want of descriptors the listener stays out of
  // the poll (fd -1 is ignored) until retry_at.
  std::chrono::steady_clock::time_point retry_at{};
  std::chrono::steady_clock::time_point last_log{};
  while (!stop_.load()) {
    auto now = std::chrono::steady_clock::now();
    const bool listening = now >= retry_at;
    std::vector<pollfd> fds = {{listening ? listen_fd_ : -1, POLLIN, 0},
                               {wake_fd_, POLLIN, 0}};
    int timeout_ms =
        listening ? -1
                  : static_cast<int>(
                        std::chrono::duration_cast<std::chrono::milliseconds>(
                            retry_at - now)
                            .count() +
                        1);
    for (const Client& c : clients) {
      fds.push_back(
          {c.fd, c.response.empty() ? short{POLLIN} : short{POLLOUT}, 0});
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            c.deadline - now)
                            .count();
      const int ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
      timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(kRetryAfter);
      continue;
    }
    if ((fds[1].revents & POLLIN) != 0) break;
    now = std::chrono::steady_clock::now();
    // Clients first (their pollfds follow the two fixed ones, in order);
    // walk backwards so dropping one moves only already-visited entries.
    for (size_t i = clients.size(); i-- > 0;) {
      Client& c = clients[i];
      const short ev = fds[2 + i].revents;
      bool done = false;
      if (c.response.empty() && (ev & (POLLIN | POLLHUP | POLLERR)) != 0) {
        char buf[1024];
        const ssize_t n = read(c.fd, buf, sizeof(buf));
        if (n > 0) c.request.append(buf, static_cast<size_t>(n));
        if (n > 0 ? RequestComplete(c.request) : n == 0) {
          c.response = Respond(*agent_, *this, c.request);
        } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
          done = true;
        }
      } else if (!c.response.empty() && (ev & (POLLOUT | POLLERR)) != 0) {
        const ssize_t n = send(c.fd, c.response.data() + c.sent,
                               c.response.size() - c.sent, MSG_NOSIGNAL);
        if (n > 0) c.sent += static_cast<size_t>(n);
        done = n < 0 ? errno != EAGAIN && errno != EINTR
                     : c.sent == c.response.size();
      }
      if (!done && now >= c.deadline) {
        timed_out_.fetch_add(1, std::memory_order_relaxed);
        done = true;
      }
      if (done) drop(i);
    }
    if ((fds[0].revents & POLLIN) != 0) {
      const int fd =
          accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
                     errno == ENOMEM)) {
        const int err = errno;
        accept_failures_.fetch_add(1, std::memory_order_relaxed);
        retry_at = now + kRetryAfter;
        if (now - last_log >= std::chrono::seconds(1)) {
          last_log = now;
          Log(LogLevel::kWarn, "metrics_accept_failed",
              {{"error", std::generic_category().message(err)},
               {"accept_failures", accept_failures()}});
        }
      } else if (fd >= 0 && clients.size() >= kMaxClients) {
        refused_.fetch_add(1, std::memory_order_relaxed);
        close(fd);
      } else if (fd >= 0) {
        clients.push_back(Client{fd, now + kClientDeadline, {}, {}, 0});
      }
    }
  }
  for (const Client& c : clients) close(c.fd);
}

}  // namespace tmem
