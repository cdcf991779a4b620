#include "host-agent/channel/channel.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "host-agent/fault_point.h"
#include "host-agent/log.h"

namespace tmem {
namespace {

int64_t MonotonicNanos() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// The owner's store VM, or a new one for this channel alone.
absl::StatusOr<VmId> RegisterVm(const ChannelOptions& options,
                                TmemStore* store) {
  if (options.store_vm) return *options.store_vm;
  return store->AddVm(options.vm_name, options.policy);
}

}  // namespace

Channel::Channel(ChannelOptions options, TmemStore* store, VmId vm)
    : options_(std::move(options)), store_(store), vm_(vm) {}

absl::StatusOr<std::unique_ptr<Channel>> Channel::Create(
    const ChannelOptions& options, TmemStore* store, uint64_t host_generation,
    PutAdvisor* advisor) {
  absl::StatusOr<RegionLayout> layout =
      RegionLayout::ForSize(options.region_bytes, options.ring_entries);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<VmId> vm = RegisterVm(options, store);
  if (!vm.ok()) return vm.status();
  std::unique_ptr<Channel> ch(new Channel(options, store, *vm));
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(
      absl::StrCat("tmem-", options.vm_name), *layout, host_generation);
  if (!region.ok()) return region.status();  // ~Channel forgets the VM
  ch->region_ = std::move(*region);
  ch->advisor_ = advisor;
  ch->consumer_ = std::make_unique<RingConsumer>(ch->region_.get(), store, *vm,
                                                 &ch->metrics_, advisor);
  absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
      IvshmemServer::Listen(options.server, ch->region_->fd(), &ch->metrics_);
  if (!server.ok()) return server.status();
  ch->server_ = std::move(*server);
  ch->server_->SetObserver(ch.get());
  ch->region_->SetHostPeerId(
      static_cast<uint32_t>(options.server.host_peer_id));
  ch->StoreFds();
  return ch;
}

absl::StatusOr<std::unique_ptr<Channel>> Channel::Restore(
    const ChannelOptions& options, const IvshmemServerFds& fds,
    TmemStore* store, uint64_t host_generation, PutAdvisor* advisor) {
  absl::StatusOr<VmId> vm = RegisterVm(options, store);
  if (!vm.ok()) {
    for (int fd : {fds.listen, fds.shm, fds.client, fds.attaching}) {
      if (fd >= 0) close(fd);
    }
    for (int fd : fds.doorbells) close(fd);
    for (int fd : fds.interrupts) close(fd);
    return vm.status();
  }
  std::unique_ptr<Channel> ch(new Channel(options, store, *vm));
  const bool had_client = fds.client >= 0;
  const bool had_attaching = fds.attaching >= 0;
  // The region needs its own descriptor of the memfd: the server keeps one
  // to send QEMU at each handshake.
  const int shm_for_region =
      fds.shm < 0 ? -1 : fcntl(fds.shm, F_DUPFD_CLOEXEC, 0);
  absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
      IvshmemServer::Adopt(options.server, fds, &ch->metrics_);
  if (!server.ok()) {
    if (shm_for_region >= 0) close(shm_for_region);
    return server.status();  // ~Channel forgets the VM
  }
  ch->server_ = std::move(*server);
  ch->server_->SetObserver(ch.get());
  if (had_client && !ch->server_->connected() && options.fd_store != nullptr) {
    // QEMU hung up while no tmemd watched: its stored end is dead too.
    options.fd_store->Remove(ChannelFdName(options.vm_name, "client"));
  }
  if (had_attaching && !had_client) {
    // The predecessor died between storing a connection and recording its
    // handshake: Adopt kept it if the handshake provably went out, else
    // refused it.
    Log(LogLevel::kWarn, "handshake_interrupted",
        {{"vm", options.vm_name},
         {"action", ch->server_->connected()
                        ? "kept: the guest got its whole handshake"
                        : "refused: the guest may connect again"}});
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Adopt(shm_for_region, options.ring_entries, host_generation,
                          static_cast<uint32_t>(options.server.host_peer_id));
  if (!region.ok()) return region.status();
  ch->region_ = std::move(*region);
  ch->advisor_ = advisor;
  ch->consumer_ = std::make_unique<RingConsumer>(ch->region_.get(), store, *vm,
                                                 &ch->metrics_, advisor);
  ch->metrics_.Inc(ChannelCounter::kRestoredAcrossRestart);
  ch->restored_at_ns_ = MonotonicNanos();
  ch->metrics_.Inc(ChannelCounter::kChannelResets);
  // From systemd's store they are stored already, and storing a name again
  // is harmless; after an exec they must be (re)stored for the next crash.
  ch->StoreFds();
  // After the client is stored under its own name (StoreFds), never before.
  if (had_attaching && options.fd_store != nullptr) {
    options.fd_store->Remove(ChannelFdName(options.vm_name, "attaching"));
  }
  return ch;
}

std::vector<NamedFd> Channel::HandoffFds() const {
  const std::string& vm = options_.vm_name;
  std::vector<NamedFd> out = {
      {ChannelFdName(vm, "shm"), server_->shm_fd()},
      {ChannelFdName(vm, "listen"), server_->listen_fd()},
  };
  if (server_->client_fd() >= 0) {
    out.push_back({ChannelFdName(vm, "client"), server_->client_fd()});
  }
  for (int v = 0; v < server_->vectors(); ++v) {
    out.push_back(
        {ChannelFdName(vm, absl::StrCat("db", v)), server_->doorbell_fd(v)});
    out.push_back(
        {ChannelFdName(vm, absl::StrCat("irq", v)), server_->interrupt_fd(v)});
  }
  return out;
}

void Channel::StoreFds() const {
  if (options_.fd_store == nullptr) return;
  for (const NamedFd& f : HandoffFds()) options_.fd_store->Store(f.name, f.fd);
}

void Channel::KeepForSuccessor() {
  keep_for_successor_ = true;
  if (server_ != nullptr) server_->KeepSocketPath();
}

bool Channel::BeforeHandshake(int fd) {
  FaultPoint("attach_accepted");
  if (options_.fd_store != nullptr &&
      !options_.fd_store->Store(ChannelFdName(options_.vm_name, "attaching"),
                                fd)) {
    // Answering a guest that a crash would lose is worse than refusing it
    // now: QEMU reports the refused connection; a lost one it never
    // notices.
    Log(LogLevel::kWarn, "guest_refused",
        {{"vm", options_.vm_name},
         {"reason", "its connection could not be kept in the fd store"}});
    return false;
  }
  FaultPoint("attach_stored");
  return true;
}

void Channel::AfterHandshake(int fd) {
  FaultPoint("attach_answered");
  if (options_.fd_store != nullptr) {
    // A failure is logged and counted by the store; the guest is answered
    // already and is served.
    options_.fd_store->Store(ChannelFdName(options_.vm_name, "client"), fd);
    FaultPoint("attach_recorded");
    options_.fd_store->Remove(ChannelFdName(options_.vm_name, "attaching"));
  }
  FaultPoint("attach_done");
  Log(LogLevel::kInfo, "guest_attached", {{"vm", options_.vm_name}});
}

void Channel::HandshakeFailed(int /*fd*/) {
  if (options_.fd_store != nullptr) {
    options_.fd_store->Remove(ChannelFdName(options_.vm_name, "attaching"));
  }
}

void Channel::LogFirstRequestAfterRestore() {
  const int64_t waited = MonotonicNanos() - restored_at_ns_;
  restored_at_ns_ = 0;
  Log(LogLevel::kInfo, "first_request_after_restore",
      {{"vm", options_.vm_name}, {"after_us", waited / 1000}});
}

void Channel::OnForeignRegion() {
  consumer_->DropPools();
  region_->Reset(/*fresh_host=*/true);
  consumer_ = std::make_unique<RingConsumer>(region_.get(), store_, vm_,
                                             &metrics_, advisor_);
  metrics_.Inc(ChannelCounter::kForeignRegions);
  metrics_.Inc(ChannelCounter::kChannelResets);
}

Channel::~Channel() {
  if (options_.fd_store != nullptr && server_ != nullptr &&
      !keep_for_successor_) {
    for (const NamedFd& f : HandoffFds()) options_.fd_store->Remove(f.name);
    // A connection that went away before is not in HandoffFds, but may
    // still be stored (e.g. handed over already dead).
    if (server_->client_fd() < 0) {
      options_.fd_store->Remove(ChannelFdName(options_.vm_name, "client"));
    }
    options_.fd_store->Remove(ChannelFdName(options_.vm_name, "attaching"));
  }
  // Tell an attached guest (which keeps its mapping) that nobody serves this
  // region any more, so it stops waiting on it (a successor re-initializes
  // it with a new generation).
  if (region_ != nullptr) region_->MarkUnserved();
  server_.reset();  // unlinks the socket first: no new client can arrive
  // The VM's other frontends keep their pools; only this guest's go.
  if (options_.store_vm && consumer_ != nullptr) consumer_->DropPools();
  consumer_.reset();
  region_.reset();
  if (!options_.store_vm) (void)store_->ForgetVm(vm_);
}

void Channel::ClientLeaving(int /*fd*/, LeaveReason reason) {
  FaultPoint("detach_begin");
  if (options_.fd_store != nullptr) {
    options_.fd_store->Remove(ChannelFdName(options_.vm_name, "client"));
  }
  FaultPoint("detach_unstored");
  // The guest's pool ids die with it: the next client starts from nothing.
  consumer_->DropPools();
  // The guest's self-report leaves with it (a reset with the guest still
  // attached keeps it: that guest rewrites it).
  region_->ClearGuestReport();
  region_->Reset();
  // A fresh consumer starts from the reset region's zero indices.
  consumer_ = std::make_unique<RingConsumer>(region_.get(), store_, vm_,
                                             &metrics_, advisor_);
  metrics_.Inc(ChannelCounter::kChannelResets);
  FaultPoint("detach_reset");
  Log(LogLevel::kInfo, "guest_detached",
      {{"vm", options_.vm_name},
       {"reason", reason == LeaveReason::kGarbage ? "sent bytes" : "hang-up"}});
}

void Channel::PublishAdmissionHint() {
  if (advisor_ == nullptr) return;
  // One relaxed load per worker round: the flag only ever lowers what this
  // VM is admitted, so a guest that flips it at will hurts only itself.
  const bool aside =
      (__atomic_load_n(&region_->header()->guest_flags, __ATOMIC_RELAXED) &
       TMEM_GUEST_STANDING_ASIDE) != 0;
  if (aside != guest_standing_aside_) {
    guest_standing_aside_ = aside;
    advisor_->OnGuestStandingAside(vm_, aside);
  }
  const uint64_t ram_pages =
      __atomic_load_n(&region_->header()->guest_ram_pages, __ATOMIC_RELAXED);
  if (ram_pages != guest_ram_pages_) {
    guest_ram_pages_ = ram_pages;
    advisor_->OnGuestRamPages(vm_, ram_pages);
  }
  region_->PublishAdmissionHint(advisor_->AdmissionHint(vm_));
  region_->PublishReachPages(advisor_->ReachPages(vm_));
}

}  // namespace tmem
