// A tiny HTTP/1.0 responder that serves tmemd's Prometheus exposition
// (metrics_exposition.h) on GET /metrics (there is no prometheus-cpp in
// Debian 12), plus its own two counters (tmem_metrics_http_*). Opt-in:
// tmemd starts it only with a metrics port.
//
// MetricsServer runs one thread polling non-blocking sockets: it accepts,
// reads the request, writes the response and closes. No client can block
// another: each gets kClientDeadline for its whole exchange and at most
// kMaxClients are open at once (more are closed at accept, counted in
// refused()); one that runs out of time is closed (timed_out()). An
// accept() that fails for want of descriptors or memory is counted
// (accept_failures()), logged at most once a second, and the listener is
// left out of the poll for kRetryAfter: it recovers when descriptors come
// back, and never spins on a connection it cannot take.
// Thread-safe; Stop() (and the destructor) joins the thread.
#ifndef TMEMD_HOST_AGENT_CONTROL_METRICS_HTTP_H_
#define TMEMD_HOST_AGENT_CONTROL_METRICS_HTTP_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "host-agent/agent.h"
#include "host-agent/control/metrics_exposition.h"

namespace tmem {

class MetricsServer {
 public:
  // `address`: an IPv4 address to bind ("127.0.0.1", "0.0.0.0"); port 0
  // picks a free one (see port()).
  // `extra` (may be empty) adds families of other parts (the control
  // listeners') to each scrape; it runs on the server's thread and must be
  // thread-safe and outlive the server.
  using ExtraMetrics = std::function<void(PrometheusText&)>;
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const Agent* agent, const std::string& address, int port,
      ExtraMetrics extra = nullptr);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  static constexpr size_t kMaxClients = 16;
  static constexpr std::chrono::seconds kClientDeadline{2};
  static constexpr std::chrono::milliseconds kRetryAfter{100};
  // Descriptors the server can hold: its listener and kMaxClients.
  static constexpr int kDescriptors = 1 + kMaxClients;

  int port() const { return port_; }
  void Stop();
  // Connections closed at accept (kMaxClients open) / at their deadline.
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }
  uint64_t timed_out() const {
    return timed_out_.load(std::memory_order_relaxed);
  }
  uint64_t accept_failures() const {
    return accept_failures_.load(std::memory_order_relaxed);
  }
  // Adds the `extra` families (see Start) to `out`.
  void AppendExtra(PrometheusText& out) const {
    if (extra_) extra_(out);
  }

 private:
  MetricsServer(const Agent* agent, int listen_fd, int wake_fd, int port,
                ExtraMetrics extra);
  void Loop();

  const Agent* const agent_;
  const int listen_fd_;
  const int wake_fd_;  // eventfd: Stop() wakes the poll
  const int port_;
  const ExtraMetrics extra_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> timed_out_{0};
  std::atomic<uint64_t> accept_failures_{0};
  std::thread thread_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_METRICS_HTTP_H_
