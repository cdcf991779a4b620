// LibvirtHypervisor: Hypervisor over libvirt's C API (libvirt 9.0).
//
// Events: libvirt's default event loop (virEventRegisterDefaultImpl before
// the first virConnectOpen) runs in one process-wide thread for the life of
// the process (libvirt offers no way to unregister it). Domain events
// (LIFECYCLE, DEVICE_REMOVED, DEVICE_REMOVAL_FAILED, METADATA_CHANGE for
// tmemd's namespace) are translated to DomainEvent on that thread.
//
// Reconnect: a close callback (libvirtd exited or restarted; keepalive
// notices a hung one) wakes a reconnect thread, which reports
// kConnectionLost, closes the dead connection and reopens it with
// exponential backoff (100 ms doubling to 5 s, logging each failure), then
// re-registers the events and reports kReconnected. Calls made meanwhile
// fail with UNAVAILABLE.
//
// Thread-safe: one mutex guards the connection; libvirt calls are made
// under it (libvirt's own client is thread-safe, this keeps reconnect
// simple).
#ifndef TMEMD_HOST_AGENT_LIBVIRT_LIBVIRT_HYPERVISOR_H_
#define TMEMD_HOST_AGENT_LIBVIRT_LIBVIRT_HYPERVISOR_H_

#include <libvirt/libvirt.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "host-agent/libvirt/hypervisor.h"

namespace tmem {

struct LibvirtOptions {
  std::string uri = "qemu:///system";
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{5000};
  // virConnectSetKeepAlive: notices a hung libvirtd in ~interval*(count+1).
  int keepalive_interval_s = 5;
  unsigned keepalive_count = 3;
};

class LibvirtHypervisor final : public Hypervisor {
 public:
  // Connects once; UNAVAILABLE with libvirt's message when that fails.
  static absl::StatusOr<std::unique_ptr<LibvirtHypervisor>> Connect(
      const LibvirtOptions& options);
  ~LibvirtHypervisor() override;
  LibvirtHypervisor(const LibvirtHypervisor&) = delete;
  LibvirtHypervisor& operator=(const LibvirtHypervisor&) = delete;

  void SetEventHandler(EventHandler handler) override;
  bool Connected() const override { return connected_.load(); }
  std::string Uri() const override { return options_.uri; }
  // Successful reconnects since Connect (tests).
  int reconnects() const { return reconnects_.load(); }

  absl::StatusOr<std::vector<DomainSummary>> ListDomains() override;
  absl::StatusOr<DomainSummary> GetDomain(const std::string& name) override;
  absl::StatusOr<std::string> GetXml(const std::string& name,
                                     bool inactive) override;
  absl::StatusOr<std::optional<std::string>> GetMetadata(
      const std::string& name, bool inactive) override;
  absl::Status SetMetadata(const std::string& name, const std::string& xml,
                           bool live, bool config) override;
  absl::Status AttachDevice(const std::string& name, const std::string& xml,
                            bool live, bool config) override;
  absl::Status DetachDevice(const std::string& name, const std::string& xml,
                            bool live, bool config) override;

  // Called from libvirt's callbacks (public for the C trampolines).
  void Emit(const DomainEvent& event);
  void OnClosed(virConnectPtr conn, int reason);

 private:
  explicit LibvirtHypervisor(LibvirtOptions options);
  // AttachDevice (attach) or DetachDevice.
  absl::Status ChangeDevice(const std::string& name, const std::string& xml,
                            bool live, bool config, bool attach);
  absl::Status OpenLocked();
  void CloseLocked();
  void ReconnectLoop();

  const LibvirtOptions options_;
  std::mutex mu_;
  virConnectPtr conn_ = nullptr;   // guarded by mu_
  std::vector<int> callback_ids_;  // guarded by mu_
  std::atomic<bool> connected_{false};
  std::atomic<int> reconnects_{0};

  std::mutex handler_mu_;
  EventHandler handler_;  // guarded by handler_mu_

  std::mutex reconnect_mu_;
  std::condition_variable reconnect_cv_;
  bool lost_ = false;  // guarded by reconnect_mu_
  bool stop_ = false;  // guarded by reconnect_mu_
  std::thread reconnect_thread_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_LIBVIRT_LIBVIRT_HYPERVISOR_H_
