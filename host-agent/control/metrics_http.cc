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
#include "host-agent/control/control_plane.h"

namespace tmem {
namespace {

void Series(std::string& out, const std::string& name, bool gauge,
            const std::string& labels, uint64_t value, bool& typed) {
  const std::string metric = absl::StrCat("tmem_", name, gauge ? "" : "_total");
  if (!typed) {
    absl::StrAppend(&out, "# TYPE ", metric, gauge ? " gauge\n" : " counter\n");
    typed = true;
  }
  absl::StrAppend(&out, metric, labels, " ", value, "\n");
}

}  // namespace

std::string RenderPrometheus(const Agent& agent) {
  std::string out;
  const AgentStatus st = agent.Status();
  absl::StrAppend(
      &out, "# TYPE tmem_memory_cap_bytes gauge\n", "tmem_memory_cap_bytes ",
      st.store.memory_cap_bytes, "\n", "# TYPE tmem_memory_used_bytes gauge\n",
      "tmem_memory_used_bytes ", st.store.memory_used_bytes, "\n",
      "# TYPE tmem_cpu_budget_fraction gauge\n", "tmem_cpu_budget_fraction ",
      st.valve.budget_fraction, "\n", "# TYPE tmem_agent_busy_fraction gauge\n",
      "tmem_agent_busy_fraction ", st.valve.agent_busy_fraction, "\n",
      "# TYPE tmem_host_busy_fraction gauge\n", "tmem_host_busy_fraction ",
      st.valve.host_busy_fraction, "\n", "# TYPE tmem_uptime_seconds gauge\n",
      "tmem_uptime_seconds ", st.uptime_nanos / 1000000000, "\n");
  // Deferred compression (backend/compactor.h): host-wide.
  {
    const CompactorStats& k = st.compactor;
    auto counter = [&out](const std::string& name, uint64_t value,
                          bool gauge = false) {
      bool typed = false;
      Series(out, name, gauge, "", value, typed);
    };
    counter("compactor_compressed", k.compressed);
    counter("compactor_kept_raw", k.kept_raw);
    counter("compactor_stale", k.stale);
    counter("compactor_no_room", k.no_room);
    counter("compactor_queue_length", k.queue.length, true);
    counter("compactor_queue_capacity", k.queue.capacity, true);
    counter("compactor_queue_overflows", k.queue.overflows);
    counter("compactor_pressure_batches", k.pressure_batches);
    counter("compactor_priority_failures", k.priority_failures);
    bool typed = false;
    for (int i = 0; i < kNumCompactionSkips; ++i) {
      Series(
          out, "compactor_skipped", false,
          absl::StrCat(
              "{cause=\"",
              std::string(CompactionSkipName(static_cast<CompactionSkip>(i))),
              "\"}"),
          k.queue.skipped[i], typed);
    }
    typed = false;
    Series(out, "compactor_cpu_ns", false, "{class=\"idle\"}", k.idle_cpu_ns,
           typed);
    Series(out, "compactor_cpu_ns", false, "{class=\"normal\"}",
           k.normal_cpu_ns, typed);
    // Put to compressed, as a Prometheus histogram (cumulative buckets).
    absl::StrAppend(&out,
                    "# TYPE tmem_compactor_put_to_compressed_seconds "
                    "histogram\n");
    uint64_t cumulative = 0;
    for (size_t b = 0; b < k.latency.size(); ++b) {
      cumulative += k.latency[b];
      const std::string le =
          kCompactLatencyBoundsMs[b] == INT64_MAX
              ? std::string("+Inf")
              : absl::StrCat(static_cast<double>(kCompactLatencyBoundsMs[b]) /
                             1000.0);
      absl::StrAppend(&out,
                      "tmem_compactor_put_to_compressed_seconds_bucket{le=\"",
                      le, "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "tmem_compactor_put_to_compressed_seconds_sum ",
                    static_cast<double>(k.latency_sum_ns) / 1e9, "\n",
                    "tmem_compactor_put_to_compressed_seconds_count ",
                    cumulative, "\n");
  }
  const std::vector<VmInfo> vms = agent.ListVms();
  // Store counters: host total (no label) and per VM.
  for (int i = 0; i < kNumCounters; ++i) {
    const auto c = static_cast<Counter>(i);
    bool typed = false;
    Series(out, std::string(CounterName(c)), CounterIsGauge(c), "",
           st.store.counters[i], typed);
    for (const VmInfo& vm : vms) {
      Series(out, std::string(CounterName(c)), CounterIsGauge(c),
             absl::StrCat("{vm=\"", vm.name, "\"}"), vm.stats.counters[i],
             typed);
    }
  }
  for (int i = 0; i < kNumValveCounters; ++i) {
    bool typed = false;
    const std::string name = absl::StrCat(
        "valve_", std::string(ValveCounterName(static_cast<ValveCounter>(i))));
    for (const VmInfo& vm : vms) {
      Series(out, name, false, absl::StrCat("{vm=\"", vm.name, "\"}"),
             vm.valve.counters[i], typed);
    }
  }
  for (int i = 0; i < kNumChannelCounters; ++i) {
    bool typed = false;
    const std::string name = absl::StrCat(
        "channel_",
        std::string(ChannelCounterName(static_cast<ChannelCounter>(i))));
    for (const VmInfo& vm : vms) {
      Series(out, name, false, absl::StrCat("{vm=\"", vm.name, "\"}"),
             vm.channel[i], typed);
    }
  }
  bool typed = false;
  for (const VmInfo& vm : vms) {
    Series(out, "vm_admission", true, absl::StrCat("{vm=\"", vm.name, "\"}"),
           vm.valve.admission, typed);
  }
  // The guest's own report (ABI v2; untrusted, shown as written).
  struct GuestSeries {
    const char* name;
    bool gauge;
    uint64_t (*value)(const GuestReport&);
  };
  static constexpr GuestSeries kGuestSeries[] = {
      {"guest_standing_aside", true,
       [](const GuestReport& g) -> uint64_t { return g.standing_aside; }},
      {"guest_get_ns", true,
       [](const GuestReport& g) -> uint64_t { return g.get_ns; }},
      {"guest_miss_ns", true,
       [](const GuestReport& g) -> uint64_t { return g.miss_ns; }},
      {"guest_prefetch_used", false,
       [](const GuestReport& g) -> uint64_t { return g.prefetch_used; }},
      {"guest_prefetch_unused", false,
       [](const GuestReport& g) -> uint64_t { return g.prefetch_unused; }},
      {"guest_ram_pages", true,
       [](const GuestReport& g) -> uint64_t { return g.ram_pages; }},
  };
  for (const GuestSeries& series : kGuestSeries) {
    bool guest_typed = false;
    for (const VmInfo& vm : vms) {
      Series(out, series.name, series.gauge,
             absl::StrCat("{vm=\"", vm.name, "\"}"), series.value(vm.guest),
             guest_typed);
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const Agent* agent, const std::string& address, int port) {
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
  std::unique_ptr<MetricsServer> s(
      new MetricsServer(agent, fd, wake, ntohs(addr.sin_port)));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsServer::MetricsServer(const Agent* agent, int listen_fd, int wake_fd,
                             int port)
    : agent_(agent), listen_fd_(listen_fd), wake_fd_(wake_fd), port_(port) {}

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

std::string Respond(const Agent& agent, const std::string& request) {
  std::string status = "200 OK";
  std::string body;
  const std::string type = "text/plain; version=0.0.4; charset=utf-8";
  if (request.rfind("GET /metrics ", 0) == 0 ||
      request.rfind("GET /metrics\r", 0) == 0) {
    body = RenderPrometheus(agent);
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
  while (!stop_.load()) {
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    auto now = std::chrono::steady_clock::now();
    int timeout_ms = -1;
    for (const Client& c : clients) {
      fds.push_back(
          {c.fd, c.response.empty() ? short{POLLIN} : short{POLLOUT}, 0});
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            c.deadline - now)
                            .count();
      const int ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
      timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) continue;
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
          c.response = Respond(*agent_, c.request);
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
      if (fd >= 0 && clients.size() >= kMaxClients) {
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
