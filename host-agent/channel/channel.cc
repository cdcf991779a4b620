#include "host-agent/channel/channel.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem {

Channel::Channel(ChannelOptions options, TmemStore* store, VmId vm)
    : options_(std::move(options)), store_(store), vm_(vm) {}

absl::StatusOr<std::unique_ptr<Channel>> Channel::Create(
    const ChannelOptions& options, TmemStore* store, uint64_t host_generation,
    PutAdvisor* advisor) {
  absl::StatusOr<RegionLayout> layout =
      RegionLayout::ForSize(options.region_bytes, options.ring_entries);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<VmId> vm = store->AddVm(options.vm_name, options.policy);
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
  return ch;
}

Channel::~Channel() {
  // Tell an attached guest (which keeps its mapping) that nobody serves this
  // region any more, so it stops waiting on it.
  if (region_ != nullptr) {
    __atomic_store_n(&region_->header()->host_state, TMEM_HOST_STATE_RESET,
                     __ATOMIC_RELEASE);
  }
  server_.reset();  // unlinks the socket first: no new client can arrive
  consumer_.reset();
  region_.reset();
  (void)store_->ForgetVm(vm_);
}

void Channel::OnGuestDetached() {
  consumer_->DropPools();
  // The guest's self-report leaves with it (a reset with the guest still
  // attached keeps it: that guest rewrites it).
  tmem_shm_header* h = region_->header();
  __atomic_store_n(&h->guest_flags, tmem_u32{0}, __ATOMIC_RELAXED);
  __atomic_store_n(&h->guest_get_ns, tmem_u64{0}, __ATOMIC_RELAXED);
  __atomic_store_n(&h->guest_miss_ns, tmem_u64{0}, __ATOMIC_RELAXED);
  __atomic_store_n(&h->guest_prefetch_used, tmem_u64{0}, __ATOMIC_RELAXED);
  __atomic_store_n(&h->guest_prefetch_unused, tmem_u64{0}, __ATOMIC_RELAXED);
  region_->Reset();
  // A fresh consumer starts from the reset region's zero indices.
  consumer_ = std::make_unique<RingConsumer>(region_.get(), store_, vm_,
                                             &metrics_, advisor_);
  metrics_.Inc(ChannelCounter::kChannelResets);
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
  const uint32_t hint = advisor_->AdmissionHint(vm_);
  uint32_t* field = &region_->header()->admission_hint;
  if (__atomic_load_n(field, __ATOMIC_RELAXED) != hint) {
    __atomic_store_n(field, hint, __ATOMIC_RELAXED);
  }
}

}  // namespace tmem
