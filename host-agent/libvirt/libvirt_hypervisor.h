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
// fail with UNAVAILABLE. With `connect_in_background` the first connection
// is made the same way, by that thread (kReconnected when it is up): a
// daemon that starts before libvirtd (ordered Before=libvirtd.service, or
// libvirtd down) must not wait for it, or for a socket-activated libvirtd
// that in turn waits for the daemon.
//
// Thread-safe: one mutex guards the connection; libvirt calls are made
// under it (libvirt's own client is thread-safe, this keeps reconnect
// simple).
#ifndef TMEMD_HOST_AGENT_LIBVIRT_LIBVIRT_HYPERVISOR_H_
#define TMEMD_HOST_AGENT_LIBVIRT_LIBVIRT_HYPERVISOR_H_

#include <libvirt/libvirt.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "backend/mutex.h"
#include "host-agent/libvirt/hypervisor.h"

namespace tmem {

struct LibvirtOptions {
  std::string uri = "qemu:///system";
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{5000};
  // virConnectSetKeepAlive: notices a hung libvirtd in ~interval*(count+1).
  int keepalive_interval_s = 5;
  unsigned keepalive_count = 3;
  // Connect() returns at once, not connected; the reconnect thread makes
  // the first connection (retrying with the backoff above).
  bool connect_in_background = false;
};

class LibvirtHypervisor final : public Hypervisor {
 public:
  // Connects once; UNAVAILABLE with libvirt's message when that fails.
  // With options.connect_in_background, never fails for an unreachable
  // libvirtd: connects in the background (see above).
  static absl::StatusOr<std::unique_ptr<LibvirtHypervisor>> Connect(
      const LibvirtOptions& options);
  ~LibvirtHypervisor() override;
  LibvirtHypervisor(const LibvirtHypervisor&) = delete;
  LibvirtHypervisor& operator=(const LibvirtHypervisor&) = delete;

  void SetEventHandler(EventHandler handler) override
      ABSL_LOCKS_EXCLUDED(handler_mu_);
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
  absl::Status DefineXml(const std::string& xml) override;

  // Called from libvirt's callbacks (public for the C trampolines).
  void Emit(const DomainEvent& event) ABSL_LOCKS_EXCLUDED(handler_mu_);
  void OnClosed(virConnectPtr conn, int reason)
      ABSL_LOCKS_EXCLUDED(reconnect_mu_);

 private:
  explicit LibvirtHypervisor(LibvirtOptions options);
  // AttachDevice (attach) or DetachDevice.
  absl::Status ChangeDevice(const std::string& name, const std::string& xml,
                            bool live, bool config, bool attach)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status OpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReconnectLoop() ABSL_LOCKS_EXCLUDED(mu_, reconnect_mu_);

  const LibvirtOptions options_;
  // Three leaves, never held together (host-agent/lock_order.h). mu_ is
  // held across libvirt calls, which the domain manager makes under its
  // op_mu_; handler_mu_ is held while the handler runs (it takes the
  // domain manager's queue lock); libvirt's callbacks reach handler_mu_
  // and reconnect_mu_ under the live-instance lock.
  Mutex mu_;
  virConnectPtr conn_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<int> callback_ids_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> connected_{false};
  std::atomic<int> reconnects_{0};

  Mutex handler_mu_;
  EventHandler handler_ ABSL_GUARDED_BY(handler_mu_);

  Mutex reconnect_mu_;
  CondVar reconnect_cv_;  // lost_ or stop_ set
  bool lost_ ABSL_GUARDED_BY(reconnect_mu_) = false;
  // Not connected yet at all: the first connection is still to be made.
  bool never_connected_ ABSL_GUARDED_BY(reconnect_mu_) = false;
  bool stop_ ABSL_GUARDED_BY(reconnect_mu_) = false;
  std::thread reconnect_thread_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_LIBVIRT_LIBVIRT_HYPERVISOR_H_
