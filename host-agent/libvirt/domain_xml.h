// The bits of libvirt domain XML tmemd reads and writes: the tmem shmem
// device, the machine's hotplug ability, and tmemd's metadata element.
//
// libvirt generates the XML it returns, so a small scanner is enough here
// (no libxml2): attributes may use either quote, elements may carry a
// namespace prefix. Pure functions, thread-safe.
#ifndef TMEMD_HOST_AGENT_LIBVIRT_DOMAIN_XML_H_
#define TMEMD_HOST_AGENT_LIBVIRT_DOMAIN_XML_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/tmem_store.h"

namespace tmem {

// The shmem device's name in the domain XML (QEMU id "shmem<N>", libvirt
// alias "shmem<N>"); one tmem device per domain.
inline constexpr std::string_view kTmemShmemName = "tmem0";
// tmemd's metadata namespace and its usual prefix.
inline constexpr std::string_view kTmemMetadataUri =
    "https://tmemd.dev/xmlns/tmem/1";
inline constexpr std::string_view kTmemMetadataPrefix = "tmem";

// <shmem name='tmem0'><model type='ivshmem-doorbell'/><server path='P'/>
// <msi vectors='N' ioeventfd='on'/></shmem>
// `master` (the default): role='master' (QEMU master=on), the migratable
// device; it needs tmemd to be ivshmem peer 1 (the VM peer 0, tmemd's
// default), see IvshmemServer. false: role omitted, QEMU's peer mode, which
// blocks migration.
// With `master` the device also carries the user alias kTmemDeviceAlias,
// which the <qemu:override> below names.
std::string TmemShmemXml(std::string_view socket_path, int vectors,
                         bool master = true);

// libvirt's namespace for QEMU-specific domain XML and the tmem device's
// user alias (libvirt requires the "ua-" prefix).
inline constexpr std::string_view kQemuXmlnsUri =
    "http://libvirt.org/schemas/domain/qemu/1.0";
inline constexpr std::string_view kTmemDeviceAlias = "ua-tmem0";

// libvirt 9.0 does not pass role='master' of an ivshmem-doorbell device on
// to QEMU (docs/libvirt.md), so QEMU runs it in peer mode, which blocks
// migration. A persistent definition gets master=on through
//   <qemu:override><qemu:device alias='ua-tmem0'><qemu:frontend>
//     <qemu:property name='master' type='string' value='on'/>
//   </qemu:frontend></qemu:device></qemu:override>
// (applied when QEMU starts; a hot-plugged device cannot have it).
// True when `domain_xml` has that override.
bool HasTmemMasterOverride(std::string_view domain_xml);
// The domain XML with the override added (the qemu namespace declared on
// <domain>, an existing <qemu:override> kept and extended); unchanged when
// it is there. FAILED_PRECONDITION when the XML binds prefix "qemu" to
// another namespace or already overrides ua-tmem0 without master=on (an
// operator's own override is never rewritten).
absl::StatusOr<std::string> WithTmemMasterOverride(std::string_view domain_xml);
// The domain XML without tmemd's override (an emptied <qemu:override> goes
// too); unchanged when there is none.
std::string WithoutTmemMasterOverride(std::string_view domain_xml);

struct TmemDevice {
  std::string server_path;  // <server path=...>
  std::string alias;        // live XML only: libvirt's alias ("shmem0")
};
// The tmem shmem device of a domain XML, if any: a <shmem name='tmem0'>
// at /domain/devices/shmem in no namespace, nowhere else (an element of
// that name inside <metadata> or in another namespace is not a device).
std::optional<TmemDevice> FindTmemDevice(std::string_view domain_xml);

// OK when QEMU can hot-plug a PCI device into this (live) domain:
// machine pc (i440fx) with <acpi/>, or q35 with a pcie-to-pci-bridge
// controller. FAILED_PRECONDITION otherwise, saying how to fix it.
absl::Status CheckPciHotplug(std::string_view domain_xml);

// Per-VM settings from the domain metadata:
//   <tmem:tmem xmlns:tmem="https://tmemd.dev/xmlns/tmem/1">
//     <enabled>true</enabled> <quota>512MiB</quota> <weight>200</weight>
//     <mode>adaptive</mode> <frozen>false</frozen>
//     <autoattach>true</autoattach>
//     <swap_quota>256MiB</swap_quota> <swap_mode>off</swap_mode>
//   </tmem:tmem>
// Every element is optional; missing ones keep VmPolicy's defaults.
// swap_quota ("unlimited" or 0: none) is how much of the quota the swap
// device's pages may take in memory, swap_mode how the valve stores them
// (default: as `mode`); FormatTmemMetadata writes them only when they are
// not the defaults.
struct TmemMetadata {
  VmPolicy policy;
  bool autoattach = false;
  // The domain has the element (ParseTmemMetadata sets it); false: all
  // defaults because there is none.
  bool present = false;
};
// INVALID_ARGUMENT naming the element for a bad value or an unknown element
// (a typo must not silently fall back to a default).
absl::StatusOr<TmemMetadata> ParseTmemMetadata(std::string_view xml);
// The element for virDomainSetMetadata (root without a namespace: libvirt
// puts it in kTmemMetadataUri with the prefix it is given).
std::string FormatTmemMetadata(const TmemMetadata& metadata);

// The tmem element inside a full domain XML's <metadata>: its settings,
// or all defaults (present false) when there is none.
absl::StatusOr<TmemMetadata> DomainTmemMetadata(std::string_view domain_xml);

// libvirt's <uuid> and <name> of a domain XML: direct children of the
// root <domain>, in no namespace ("" when absent).
std::string DomainXmlElement(std::string_view domain_xml,
                             std::string_view element);

// --- the swap device (docs/swap-device.md, docs/libvirt.md "Swap device")
//
// tmemd serves a domain's swap device as a vhost-user-blk backend on
// SOCKET_DIR/NAME.swap.sock; QEMU reaches it through
//   <disk type='vhostuser' device='disk'>
//     <driver name='qemu' type='raw' queues='1'/>
//     <source type='unix' path='SOCKET'>
//       <reconnect enabled='yes' timeout='1'/></source>
//     <target dev='vdX' bus='virtio'/></disk>
// and, because a vhost-user backend maps the guest's RAM, the guest's
// memory must be shareable by file descriptor:
//   <memoryBacking><source type='memfd'/><access mode='shared'/>
//   </memoryBacking>
// (libvirt refuses the disk without it: "'vhostuser' requires shared
// memory"). Both are read by QEMU only when it starts, so they go into the
// persistent definition and take effect at the domain's next cold boot.
inline constexpr std::string_view kSwapSocketSuffix = ".swap.sock";

// SOCKET_DIR/NAME.swap.sock.
std::string SwapSocketPath(std::string_view socket_dir, std::string_view name);
// True when `path` is a file directly in `socket_dir` whose name ends in
// kSwapSocketSuffix: a swap device of the tmemd that uses `socket_dir`.
bool IsTmemdSwapSocket(std::string_view path, std::string_view socket_dir);

// The swap disk element for `socket_path` with target `target_dev`.
std::string SwapDiskXml(std::string_view socket_path,
                        std::string_view target_dev);

// What WithSwapDisk did to a domain XML.
struct SwapDiskEdit {
  std::string xml;          // the edited domain XML
  std::string target_dev;   // the disk's vdX (the one there, or the new one)
  bool disk_added = false;  // false: the disk was already there
  bool memory_backing_added = false;  // memfd + shared access written
  bool changed() const { return disk_added || memory_backing_added; }
};
// The domain XML (libvirt's inactive XML) with the swap disk for
// `socket_path` under /domain/devices, on the virtio target vdX after the
// last one other disks use (libvirt boots the first virtio disk by name),
// and with shareable memory. Idempotent: a vhostuser disk
// on that socket is not added twice. An existing <memoryBacking> is kept
// when its access is already shared (any fd-backed source), or extended
// with <source type='memfd'/> and <access mode='shared'/> when it says
// nothing about either; FAILED_PRECONDITION, naming the element and what
// to change by hand, when it conflicts: hugepages or another source
// without shared access, access mode='private', an anonymous source (no
// file descriptor to share) or a NUMA cell with memAccess='private'.
// INVALID_ARGUMENT when the XML has no <domain> with <devices>.
absl::StatusOr<SwapDiskEdit> WithSwapDisk(std::string_view domain_xml,
                                          std::string_view socket_path);

// The domain XML without the vhostuser disk on `socket_path`; `removed`
// false (XML unchanged) when there is none. The <memoryBacking> stays:
// other vhost-user devices may need it, and shared memory is harmless.
struct SwapDiskRemoval {
  std::string xml;
  bool removed = false;
};
SwapDiskRemoval WithoutSwapDisk(std::string_view domain_xml,
                                std::string_view socket_path);

// The source paths of every /domain/devices/disk[@type='vhostuser'] in
// no namespace (look-alikes inside <metadata> are not disks).
std::vector<std::string> VhostUserDiskSockets(std::string_view domain_xml);

// Whether a domain may migrate: FAILED_PRECONDITION naming the domain and
// the socket when it has a vhostuser disk on a swap socket of the tmemd
// that uses `socket_dir` (tmemd does not move a swap device's contents to
// another host yet, and QEMU would carry the device across without them).
absl::Status CheckMigratableWithSwap(std::string_view domain_xml,
                                     std::string_view socket_dir);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_LIBVIRT_DOMAIN_XML_H_
