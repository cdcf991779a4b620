// FakeHypervisor: an in-memory Hypervisor for DomainManager's unit tests.
//
// Domains have a live and a persistent list of device XML strings, live and
// persistent metadata, a machine type and ACPI switch. Events are emitted
// synchronously on the thread that caused them, as libvirt would emit them:
// define/undefine, start/destroy, metadata changes, device removal. A live
// detach completes at once when the domain's `guest_acks` is true (a guest
// OS that handles ACPI unplug); otherwise it stays pending until the test
// calls GuestAcks() or destroys the domain. Thread-safe.
#ifndef TMEMD_TESTS_LIBVIRT_FAKE_HYPERVISOR_H_
#define TMEMD_TESTS_LIBVIRT_FAKE_HYPERVISOR_H_

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "host-agent/libvirt/domain_xml.h"
#include "host-agent/libvirt/hypervisor.h"

namespace tmem {

class FakeHypervisor final : public Hypervisor {
 public:
  struct Domain {
    std::string uuid;
    bool active = false;
    bool persistent = true;
    std::string machine = "pc-i440fx-7.2";
    bool acpi = true;
    bool pcie_to_pci_bridge = false;
    bool guest_acks = true;
    std::vector<std::string> live_devices;
    std::vector<std::string> config_devices;
    std::optional<std::string> live_metadata;
    std::optional<std::string> config_metadata;
    bool detach_pending = false;
    // The <qemu:override> of the persistent definition (DefineXml).
    std::string config_qemu_override;
    // <disk> elements and the <memoryBacking> as DefineXml last wrote them
    // (and the running QEMU's copy, taken at Start).
    std::vector<std::string> config_disks;
    std::string config_memory_backing;
    std::vector<std::string> live_disks;
    std::string live_memory_backing;
  };

  void SetEventHandler(EventHandler handler) override {
    std::lock_guard<std::mutex> l(handler_mu_);
    handler_ = std::move(handler);
  }
  bool Connected() const override { return connected_; }
  std::string Uri() const override { return "fake:///"; }

  // --- driving the fake ---------------------------------------------------
  void Define(const std::string& name, Domain d) {
    if (d.uuid.empty()) {
      d.uuid = absl::StrCat("00000000-0000-0000-0000-", 100000000000 + next_++);
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      domains_[name] = std::move(d);
    }
    Emit(DomainEvent::Kind::kDefined, name);
  }
  void Start(const std::string& name) {
    {
      std::lock_guard<std::mutex> l(mu_);
      Domain& d = domains_.at(name);
      d.active = true;
      d.live_devices = d.config_devices;
      d.live_metadata = d.config_metadata;
      d.live_disks = d.config_disks;
      d.live_memory_backing = d.config_memory_backing;
    }
    Emit(DomainEvent::Kind::kStarted, name);
  }
  void Destroy(const std::string& name,
               const std::string& detail = "destroyed") {
    bool transient = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      Domain& d = domains_.at(name);
      d.active = false;
      d.live_devices.clear();
      d.live_disks.clear();
      d.live_memory_backing.clear();
      d.detach_pending = false;
      transient = !d.persistent;
      if (transient) domains_.erase(name);
    }
    Emit(DomainEvent::Kind::kStopped, name, "", detail);
  }
  void Undefine(const std::string& name) {
    {
      std::lock_guard<std::mutex> l(mu_);
      Domain& d = domains_.at(name);
      if (d.active) {
        d.persistent = false;
      } else {
        domains_.erase(name);
      }
    }
    Emit(DomainEvent::Kind::kUndefined, name);
  }
  void GuestAcks(const std::string& name) {
    std::string alias = "shmem0";
    {
      std::lock_guard<std::mutex> l(mu_);
      Domain& d = domains_.at(name);
      if (!d.detach_pending) return;
      d.detach_pending = false;
      if (!d.live_devices.empty()) alias = AliasOf(d.live_devices[0], 0);
      d.live_devices.clear();
    }
    Emit(DomainEvent::Kind::kDeviceRemoved, name, alias);
  }
  void LoseConnection() {
    connected_ = false;
    Emit(DomainEvent::Kind::kConnectionLost, "");
  }
  void Reconnect() {
    connected_ = true;
    Emit(DomainEvent::Kind::kReconnected, "");
  }
  // Changes a domain behind tmemd's back (e.g. while "disconnected").
  void Mutate(const std::string& name, const std::function<void(Domain&)>& f) {
    std::lock_guard<std::mutex> l(mu_);
    f(domains_.at(name));
  }
  // Emits an event without changing the domain (races libvirt can show:
  // e.g. a STOPPED handled after the domain was started again).
  void EmitRaw(DomainEvent::Kind kind, const std::string& name,
               const std::string& detail = "") {
    Emit(kind, name, "", detail);
  }
  // While quiet, no events are emitted (as while disconnected).
  void SetQuiet(bool quiet) { quiet_ = quiet; }
  void Erase(const std::string& name) {
    std::lock_guard<std::mutex> l(mu_);
    domains_.erase(name);
  }
  // Runs inside AttachDevice (e.g. to check the socket listens already).
  void SetAttachHook(std::function<void(const std::string& xml)> hook) {
    std::lock_guard<std::mutex> l(mu_);
    attach_hook_ = std::move(hook);
  }
  int attach_calls() const {
    std::lock_guard<std::mutex> l(mu_);
    return attach_calls_;
  }

  // --- Hypervisor -----------------------------------------------------------
  absl::StatusOr<std::vector<DomainSummary>> ListDomains() override {
    if (!connected_) return absl::UnavailableError("fake: disconnected");
    std::lock_guard<std::mutex> l(mu_);
    std::vector<DomainSummary> out;
    for (const auto& [name, d] : domains_) out.push_back(Summary(name, d));
    return out;
  }
  absl::StatusOr<DomainSummary> GetDomain(const std::string& name) override {
    if (!connected_) return absl::UnavailableError("fake: disconnected");
    std::lock_guard<std::mutex> l(mu_);
    auto it = domains_.find(name);
    if (it == domains_.end()) return NoDomain(name);
    return Summary(name, it->second);
  }
  absl::StatusOr<std::string> GetXml(const std::string& name,
                                     bool inactive) override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = domains_.find(name);
    if (it == domains_.end()) return NoDomain(name);
    const Domain& d = it->second;
    const bool live = d.active && !inactive;
    std::string xml = absl::StrCat(
        "<domain type='qemu'", live ? " id='1'" : "", ">\n  <name>", name,
        "</name>\n  <uuid>", d.uuid, "</uuid>\n",
        live ? d.live_memory_backing : d.config_memory_backing,
        "  <os>\n    <type arch='x86_64' machine='", d.machine,
        "'>hvm</type>\n  </os>\n  <features>", d.acpi ? "<acpi/>" : "",
        "</features>\n  <devices>\n");
    if (d.pcie_to_pci_bridge) {
      xml +=
          "    <controller type='pci' index='1' model='pcie-to-pci-bridge'/>\n";
    }
    for (const std::string& disk : live ? d.live_disks : d.config_disks) {
      absl::StrAppend(&xml, "    ", disk, "\n");
    }
    int n = 0;
    for (std::string dev : live ? d.live_devices : d.config_devices) {
      if (live && dev.find("<alias ") == std::string::npos) {
        const size_t at = dev.rfind("</shmem>");
        dev.insert(at, absl::StrCat("<alias name='", AliasOf(dev, n), "'/>"));
      }
      ++n;
      absl::StrAppend(&xml, "    ", dev, "\n");
    }
    xml += "  </devices>\n";
    if (!live && !d.config_qemu_override.empty()) {
      xml.insert(xml.find('>'),
                 " xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'");
      absl::StrAppend(&xml, "  ", d.config_qemu_override, "\n");
    }
    xml += "</domain>\n";
    return xml;
  }
  absl::StatusOr<std::optional<std::string>> GetMetadata(
      const std::string& name, bool inactive) override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = domains_.find(name);
    if (it == domains_.end()) return NoDomain(name);
    const Domain& d = it->second;
    return d.active && !inactive ? d.live_metadata : d.config_metadata;
  }
  absl::Status SetMetadata(const std::string& name, const std::string& xml,
                           bool live, bool config) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = domains_.find(name);
      if (it == domains_.end()) return NoDomain(name);
      Domain& d = it->second;
      if (!live && !config) (d.active ? live : config) = true;
      if (live) d.live_metadata = xml;
      if (config) d.config_metadata = xml;
    }
    Emit(DomainEvent::Kind::kMetadataChanged, name);
    return absl::OkStatus();
  }
  absl::Status AttachDevice(const std::string& name, const std::string& xml,
                            bool live, bool config) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      ++attach_calls_;
      auto it = domains_.find(name);
      if (it == domains_.end()) return NoDomain(name);
      Domain& d = it->second;
      if (live && !d.active) {
        return absl::FailedPreconditionError("fake: domain is not running");
      }
      if (attach_hook_) attach_hook_(xml);
      if (live) d.live_devices.push_back(xml);
      if (config) d.config_devices.push_back(xml);
    }
    if (config) Emit(DomainEvent::Kind::kDefined, name);
    return absl::OkStatus();
  }
  // Models what tmemd changes with a definition: the <qemu:override>, the
  // disks and the <memoryBacking>.
  absl::Status DefineXml(const std::string& xml) override {
    ++define_calls_;
    if (!connected_) return absl::UnavailableError("fake: disconnected");
    const size_t n0 = xml.find("<name>");
    const size_t n1 = xml.find("</name>");
    if (n0 == std::string::npos || n1 == std::string::npos) {
      return absl::InvalidArgumentError("fake: no <name>");
    }
    const std::string name = xml.substr(n0 + 6, n1 - n0 - 6);
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = domains_.find(name);
      if (it == domains_.end()) return NoDomain(name);
      if (!define_error_.empty()) {
        return absl::InvalidArgumentError(define_error_);
      }
      const size_t o0 = xml.find("<qemu:override>");
      const size_t o1 = xml.find("</qemu:override>");
      it->second.config_qemu_override =
          o0 == std::string::npos || o1 == std::string::npos
              ? ""
              : xml.substr(o0, o1 + 16 - o0);
      it->second.config_disks.clear();
      for (size_t at = xml.find("<disk "); at != std::string::npos;
           at = xml.find("<disk ", at + 1)) {
        const size_t end = xml.find("</disk>", at);
        if (end == std::string::npos) break;
        it->second.config_disks.push_back(xml.substr(at, end + 7 - at));
      }
      const size_t m0 = xml.find("<memoryBacking");
      const size_t m1 = xml.find("</memoryBacking>");
      it->second.config_memory_backing =
          m0 == std::string::npos || m1 == std::string::npos
              ? ""
              : absl::StrCat("  ", xml.substr(m0, m1 + 16 - m0), "\n");
    }
    Emit(DomainEvent::Kind::kDefined, name);
    return absl::OkStatus();
  }
  int define_calls() const { return define_calls_; }
  // DefineXml fails with this message (empty: succeeds).
  void SetDefineError(const std::string& error) {
    std::lock_guard<std::mutex> l(mu_);
    define_error_ = error;
  }
  absl::Status DetachDevice(const std::string& name, const std::string& /*xml*/,
                            bool live, bool config) override {
    bool removed = false;
    std::string alias = "shmem0";
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = domains_.find(name);
      if (it == domains_.end()) return NoDomain(name);
      Domain& d = it->second;
      if (config) d.config_devices.clear();
      if (live) {
        if (d.guest_acks) {
          if (!d.live_devices.empty()) alias = AliasOf(d.live_devices[0], 0);
          d.live_devices.clear();
          removed = true;
        } else {
          d.detach_pending = true;
        }
      }
    }
    if (config) Emit(DomainEvent::Kind::kDefined, name);
    if (removed) Emit(DomainEvent::Kind::kDeviceRemoved, name, alias);
    return absl::OkStatus();
  }

 private:
  // libvirt's alias of a device: its user alias ("ua-..."), else shmem<N>.
  static std::string AliasOf(const std::string& dev, int n) {
    const size_t at = dev.find("<alias name='");
    if (at == std::string::npos) return absl::StrCat("shmem", n);
    const size_t b = at + 13;
    return dev.substr(b, dev.find('\'', b) - b);
  }
  static absl::Status NoDomain(const std::string& name) {
    return absl::NotFoundError(absl::StrCat("fake: no domain '", name, "'"));
  }
  static DomainSummary Summary(const std::string& name, const Domain& d) {
    return DomainSummary{name, d.uuid, d.active, d.persistent};
  }
  void Emit(DomainEvent::Kind kind, const std::string& name,
            const std::string& alias = "", const std::string& detail = "") {
    if (quiet_) return;
    DomainEvent e;
    e.kind = kind;
    e.domain = name;
    e.alias = alias;
    e.detail = detail;
    std::lock_guard<std::mutex> l(handler_mu_);
    if (handler_) handler_(e);
  }

  mutable std::mutex mu_;
  std::map<std::string, Domain> domains_;
  int attach_calls_ = 0;
  std::atomic<int> define_calls_{0};
  std::string define_error_;
  std::function<void(const std::string&)> attach_hook_;
  int next_ = 0;
  std::atomic<bool> connected_{true};
  std::atomic<bool> quiet_{false};
  std::mutex handler_mu_;
  EventHandler handler_;
};

}  // namespace tmem

#endif  // TMEMD_TESTS_LIBVIRT_FAKE_HYPERVISOR_H_
