// DomainControl: what the control plane asks of the hypervisor side.
//
// The gRPC service (AttachDomain/DetachDomain) and tmemctl talk to this
// interface; the libvirt glue (host-agent/libvirt/) implements it. When
// tmemd runs without libvirt the service has none and answers
// FAILED_PRECONDITION ("libvirt integration is not enabled: start tmemd
// with --libvirt-uri").
//
// Thread-safe: called from gRPC threads.
#ifndef TMEMD_HOST_AGENT_DOMAIN_CONTROL_H_
#define TMEMD_HOST_AGENT_DOMAIN_CONTROL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/tmem_store.h"

namespace tmem {

struct DomainAttachState {
  std::string domain;       // libvirt domain name
  std::string vm;           // tmemd VM name (channel)
  bool attached = false;    // the shmem device is in the live config
  bool persistent = false;  // ... and in the persistent config
  std::string detail;       // e.g. "detach requested, waiting for guest ack"
};

class DomainControl {
 public:
  virtual ~DomainControl() = default;
  // Creates the VM's channel, then live-attaches the ivshmem-doorbell
  // device; `persistent` also adds it to the domain's persistent config.
  // NOT_FOUND (no such domain), FAILED_PRECONDITION (not running, machine
  // type cannot hotplug: the message says how to fix it), ALREADY_EXISTS.
  virtual absl::StatusOr<DomainAttachState> Attach(const std::string& domain,
                                                   bool persistent) = 0;
  // Requests detach; completes asynchronously (DEVICE_REMOVED). Returns the
  // state right after the request.
  virtual absl::StatusOr<DomainAttachState> Detach(const std::string& domain,
                                                   bool persistent) = 0;
  virtual std::vector<DomainAttachState> List() = 0;
  // libvirt's qemu hook, with the domain's full XML. Runs while libvirtd
  // holds the domain, so it must not call libvirt back (that could wait
  // for the hook: a deadlock). Prepare: a domain whose XML has the tmem
  // device gets its channel now (policy from the XML's metadata), so the
  // socket listens before QEMU starts; OK with nothing done for a domain
  // without the device. Release: QEMU is gone; the channel on the device's
  // socket goes (the next prepare makes it again). INVALID_ARGUMENT for an
  // XML without name/uuid, a bad metadata element or a socket outside
  // tmemd's directory (the hook fails, and libvirt does not start QEMU).
  virtual absl::StatusOr<DomainAttachState> PrepareFromHook(
      const std::string& domain_xml) = 0;
  virtual absl::StatusOr<DomainAttachState> ReleaseFromHook(
      const std::string& domain_xml) = 0;
  // A policy set for VM `vm` through the control plane (gRPC), already
  // applied: written into the tmemd metadata element of the domain the VM
  // serves (live, and the persistent config when the domain has one), so it
  // travels with the domain (migration) and survives a tmemd restart. OK
  // and nothing done when no domain is served by `vm`; an error (libvirt's)
  // when the write failed.
  virtual absl::Status PolicyChanged(const std::string& vm,
                                     const VmPolicy& policy) = 0;

  // The swap device (docs/libvirt.md, "Swap device"). AttachSwap has tmemd
  // create a swap device of `size_bytes` for the domain's VM and writes
  // its vhostuser disk and shared memfd memory into the domain's
  // PERSISTENT definition; QEMU reads both only when it starts, so the
  // state's detail says when it takes effect. Attaching again is a no-op.
  // NOT_FOUND (no such domain), FAILED_PRECONDITION (transient domain, a
  // <memoryBacking> tmemd will not rewrite: the message says what to
  // change). DetachSwap removes the disk from the persistent definition
  // (the <memoryBacking> stays) and the device, unless a running QEMU still
  // uses it (then it stays until the next detach of the shut-off domain).
  virtual absl::StatusOr<DomainAttachState> AttachSwap(
      const std::string& domain, uint64_t size_bytes) = 0;
  virtual absl::StatusOr<DomainAttachState> DetachSwap(
      const std::string& domain) = 0;
  // libvirt's qemu hook "migrate" (run on the destination before the
  // incoming QEMU starts): FAILED_PRECONDITION, naming the domain and why,
  // when its XML has a disk on one of this tmemd's swap sockets (tmemd does
  // not migrate swap devices). No libvirt calls, like PrepareFromHook.
  virtual absl::StatusOr<DomainAttachState> MigrateFromHook(
      const std::string& domain_xml) = 0;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_DOMAIN_CONTROL_H_
