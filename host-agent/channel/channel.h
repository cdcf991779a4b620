// Channel: everything tmemd holds for one VM's data plane.
//
// Creating a channel registers the VM in the store, creates its shared
// region (sealed memfd), and starts listening on its ivshmem socket, in that
// order, so the socket only accepts once everything behind it exists (QEMU
// fails to start a VM whose socket is not listening, and never retries).
// Destroying it closes the socket (unlinking the path) and forgets the VM
// (its pages go). An owner that serves the same VM through other frontends
// too (the agent: a swap device) registers the store VM itself and names
// it in ChannelOptions::store_vm: the channel then neither registers nor
// forgets the VM, and its destruction drops only the pools its guest made.
//
// Restart: Restore() builds the channel from the descriptors a previous
// tmemd handed over (fd_handoff.h): the region is re-initialized with a new
// host generation, so the guest drops its pool ids and resynchronizes
// without a device re-plug. The VM's stored pages were in the old process
// and are gone; the new generation is what tells the guest so. With an
// FdStore, every descriptor is stored as it is created and removed when
// the channel goes for good.
//
// A guest's connection is stored before it is answered, so a crash at any
// step leaves a successor what it needs (fault_point.h names the steps):
//   attach: stored as VM/attaching, handshake sent, stored as VM/client,
//           VM/attaching removed. A successor that finds VM/attaching
//           without VM/client refuses that connection (the guest sees EOF
//           where its handshake stopped, never a silent stall); with
//           VM/client it keeps the guest. A handshake that fails removes
//           VM/attaching.
//   detach: every way a guest leaves (hang-up, garbage, found dead when
//           another connects) removes VM/client from the store, drops the
//           guest's pools and resets the region, and only then closes the
//           connection, all before any other connection is answered: a
//           newcomer never sees its predecessor's pages or pools.
//
// Not thread-safe: the worker that drives it owns it; metrics() may be read
// from any thread.
#ifndef TMEMD_HOST_AGENT_CHANNEL_CHANNEL_H_
#define TMEMD_HOST_AGENT_CHANNEL_CHANNEL_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "backend/tmem_store.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/fd_handoff.h"
#include "host-agent/channel/guest_report.h"
#include "host-agent/channel/ivshmem_server.h"
#include "host-agent/channel/region_layout.h"
#include "host-agent/channel/ring_consumer.h"
#include "host-agent/channel/shared_region.h"

namespace tmem {

struct ChannelOptions {
  std::string vm_name;
  IvshmemServerOptions server;  // socket path, vectors, mode, owner
  uint64_t region_bytes = uint64_t{4} << 20;
  uint32_t ring_entries = 256;
  VmPolicy policy;
  FdStore* fd_store = nullptr;  // must outlive the channel
  // A store VM registered by the owner (who forgets it after the channel
  // is gone); unset: the channel registers `vm_name` and forgets it.
  std::optional<VmId> store_vm;
};

class Channel final : private IvshmemClientObserver {
 public:
  static absl::StatusOr<std::unique_ptr<Channel>> Create(
      const ChannelOptions& options, TmemStore* store, uint64_t host_generation,
      PutAdvisor* advisor = nullptr);
  // Takes `fds` (closed on failure); options.server's socket settings are
  // not used (the socket already exists), its host_peer_id is.
  static absl::StatusOr<std::unique_ptr<Channel>> Restore(
      const ChannelOptions& options, const IvshmemServerFds& fds,
      TmemStore* store, uint64_t host_generation,
      PutAdvisor* advisor = nullptr);
  ~Channel() override;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const std::string& name() const { return options_.vm_name; }
  VmId vm() const { return vm_; }
  SharedRegion& region() { return *region_; }
  IvshmemServer& server() { return *server_; }
  RingConsumer& consumer() { return *consumer_; }
  PutAdvisor* advisor() const { return advisor_; }
  ChannelMetrics& metrics() { return metrics_; }
  const ChannelMetrics& metrics() const { return metrics_; }

  // The header holds a host_generation this process did not write (the
  // region arrived by live migration): drop the VM's pools and pages and
  // re-initialize the region, so the guest resynchronizes. Worker thread.
  void OnForeignRegion();

  // The worker consumed entries: the first time after a Restore, logs how
  // long the guest took to use the restored channel (restart benchmark).
  void NoteServed() {
    if (restored_at_ns_ != 0) LogFirstRequestAfterRestore();
  }

  // Every descriptor a successor needs, named as in fd_handoff.h.
  std::vector<NamedFd> HandoffFds() const;
  // This process is handing the channel to a successor (fd store restart):
  // destruction leaves the socket path and the fd store alone.
  void KeepForSuccessor();

  // Tells the advisor when the guest's TMEM_GUEST_STANDING_ASIDE flag
  // changed, then copies its admission rate for this VM into the shared
  // header (host-written field) if it changed. Worker thread only.
  void PublishAdmissionHint();

  // The guest's self-report, read once from the header. Any thread.
  GuestReport guest_report() const {
    return ReadGuestReport(region_->header());
  }

 private:
  Channel(ChannelOptions options, TmemStore* store, VmId vm);
  void StoreFds() const;
  // IvshmemClientObserver: the attach and detach steps above.
  bool BeforeHandshake(int fd) override;
  void AfterHandshake(int fd) override;
  void HandshakeFailed(int fd) override;
  void ClientLeaving(int fd, LeaveReason reason) override;
  void LogFirstRequestAfterRestore();

  ChannelOptions options_;
  TmemStore* store_;
  PutAdvisor* advisor_ = nullptr;
  bool guest_standing_aside_ = false;  // as last told to the advisor
  uint64_t guest_ram_pages_ = 0;       // as last told to the advisor
  VmId vm_;
  ChannelMetrics metrics_;
  std::unique_ptr<SharedRegion> region_;
  std::unique_ptr<IvshmemServer> server_;
  std::unique_ptr<RingConsumer> consumer_;
  bool keep_for_successor_ = false;
  int64_t restored_at_ns_ = 0;  // worker thread after Restore
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_CHANNEL_H_
