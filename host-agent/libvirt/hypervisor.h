// Hypervisor: the few libvirt operations and events tmemd's libvirt glue
// needs, behind an interface so the glue's logic is tested against a fake
// (tests/libvirt/fake_hypervisor.h) and run against libvirt's C API
// (LibvirtHypervisor).
//
// Domains are named by their libvirt name. Events arrive on a thread of the
// implementation (libvirt's event loop); the handler must be quick and must
// not call back into the Hypervisor (DomainManager only queues them).
//
// Thread-safe.
#ifndef TMEMD_HOST_AGENT_LIBVIRT_HYPERVISOR_H_
#define TMEMD_HOST_AGENT_LIBVIRT_HYPERVISOR_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tmem {

struct DomainSummary {
  std::string name;
  std::string uuid;
  bool active = false;      // running (or paused): a QEMU exists
  bool persistent = false;  // has a persistent (inactive) config
};

struct DomainEvent {
  enum class Kind {
    kDefined,              // persistent config created or changed
    kUndefined,            // persistent config removed
    kStarted,              // QEMU started (boot, restore, incoming migration)
    kStopped,              // QEMU gone: shutdown, destroy, crash, migrated...
    kDeviceRemoved,        // `alias` left the live config (guest acked)
    kDeviceRemovalFailed,  // the guest refused the unplug
    kMetadataChanged,      // tmemd's metadata element changed
    kConnectionLost,       // libvirtd went away; reconnecting
    kReconnected,          // connected again: resynchronize everything
  };
  Kind kind = Kind::kDefined;
  std::string domain;  // empty for the connection events
  std::string uuid;
  std::string alias;   // device events
  std::string detail;  // e.g. "destroyed", "migrated", "crashed"
};

class Hypervisor {
 public:
  using EventHandler = std::function<void(const DomainEvent&)>;

  virtual ~Hypervisor() = default;

  // Set before the first event can matter (DomainManager::Start).
  virtual void SetEventHandler(EventHandler handler) = 0;
  virtual bool Connected() const = 0;
  virtual std::string Uri() const = 0;

  // Active and inactive domains.
  virtual absl::StatusOr<std::vector<DomainSummary>> ListDomains() = 0;
  virtual absl::StatusOr<DomainSummary> GetDomain(const std::string& name) = 0;
  // `inactive`: the persistent config instead of the live one, with
  // secrets (as DefineXml needs it back).
  virtual absl::StatusOr<std::string> GetXml(const std::string& name,
                                             bool inactive) = 0;
  // tmemd's metadata element (root element of namespace kTmemMetadataUri);
  // nullopt when the domain has none. `inactive` as for GetXml.
  virtual absl::StatusOr<std::optional<std::string>> GetMetadata(
      const std::string& name, bool inactive) = 0;
  // `live` / `config`: where the element goes (both allowed).
  virtual absl::Status SetMetadata(const std::string& name,
                                   const std::string& xml, bool live,
                                   bool config) = 0;
  virtual absl::Status AttachDevice(const std::string& name,
                                    const std::string& xml, bool live,
                                    bool config) = 0;
  // Live detach is asynchronous: OK means "requested"; DEVICE_REMOVED tells
  // when QEMU has let go of the device.
  virtual absl::Status DetachDevice(const std::string& name,
                                    const std::string& xml, bool live,
                                    bool config) = 0;
  // Replaces a persistent domain's definition with `xml` (its name and
  // uuid say which; a running domain keeps running, the new definition
  // applies from its next start).
  virtual absl::Status DefineXml(const std::string& xml) = 0;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_LIBVIRT_HYPERVISOR_H_
