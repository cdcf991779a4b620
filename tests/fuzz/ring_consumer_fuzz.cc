// libFuzzer target for RingConsumer (host-agent/channel/ring_consumer.h).
//
// The guest controls every byte of the shared region; tmemd must never
// crash, touch memory outside the region, or trip ASan/UBSan, whatever the
// header, the rings and the slots hold (invariant 3). The input is laid over
// the region as the guest would write it:
//
//   byte 0      control: bit 0  overwrite host-owned header fields too
//                               (otherwise only guest-owned ones, which
//                               lets the fuzzer get past the corruption
//                               checks and into the ops)
//                        bit 1  copy trailing bytes into the page slots
//                        bit 2-3 extra drains (1..4 drains in all)
//                        bit 4  between drains, act like a guest: reap
//                               the CQ and re-post `repost` entries
//                        bit 5  between drains, the guest restarts (its
//                               generation changes)
//   byte 1      bits 0-1 put mode the valve advises (kCompress/kRaw/kDrop)
//               bits 2-5 repost count
//   then        the header image (sizeof(tmem_shm_header) bytes), the SQ
//               image, the CQ image, and slot bytes; missing bytes are 0.
//
// ABI v2 is covered through the same bytes: GET_BATCH entries (opcode 8,
// `count` in the SQE), and the guest's flags and cost fields in the
// header, which tmemd reads once per report (ReadGuestReport) and passes
// to the advisor (stand-aside). Checked after the first drain: every
// GET_BATCH completed OK has a hit bitmap within its count, and no OK
// completion comes from an entry with an impossible count.
//
// The store and region are created once; every input starts from a reset
// region and a fresh consumer, and drops its pools at the end, so inputs do
// not depend on each other (crashes reproduce from one file).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "backend/tmem_store.h"
#include "backend/types.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/guest_report.h"
#include "host-agent/channel/region_layout.h"
#include "host-agent/channel/ring_consumer.h"
#include "host-agent/channel/shared_region.h"
#include "proto/tmem_abi.h"

namespace tmem {
namespace {

constexpr uint64_t kRegionBytes = 256 << 10;
constexpr uint32_t kEntries = 8;
constexpr uint32_t kMaxDrain = 64;
constexpr char kVmName[] = "fuzz-vm";

class ModeAdvisor : public PutAdvisor {
 public:
  PutMode Advise(uint32_t /*vm*/, uint64_t /*key_hash*/,
                 bool /*guest_applies_hint*/) override {
    return aside ? PutMode::kDrop : mode;
  }
  void OnGuestStandingAside(uint32_t /*vm*/, bool a) override { aside = a; }
  PutMode mode = PutMode::kCompress;
  bool aside = false;
};

struct Env {
  std::unique_ptr<TmemStore> store;
  std::unique_ptr<SharedRegion> region;
  VmId vm = 0;
  ChannelMetrics metrics;
  ModeAdvisor advisor;
};

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "ring_consumer_fuzz: %s\n", what);
  std::abort();
}

Env& GetEnv() {
  // Never destroyed: libFuzzer may exit from any thread at any time.
  static Env* const env = [] {
    auto* e = new Env;
    StoreOptions options;
    options.memory_cap_bytes = uint64_t{32} << 20;
    options.address_space_bytes = uint64_t{64} << 20;
    options.num_shards = 4;
    absl::StatusOr<std::unique_ptr<TmemStore>> store =
        TmemStore::Create(options);
    if (!store.ok()) Die("TmemStore::Create failed");
    e->store = std::move(*store);
    absl::StatusOr<VmId> vm = e->store->AddVm(kVmName, VmPolicy{});
    if (!vm.ok()) Die("AddVm failed");
    e->vm = *vm;
    // Shared pools the fuzzer can reach: the all-zero uuid and 01..10.
    PoolUuid zero;
    PoolUuid counting;
    for (size_t i = 0; i < counting.bytes.size(); ++i) {
      counting.bytes[i] = static_cast<uint8_t>(i + 1);
    }
    e->store->AuthorizeSharedPool(zero, kVmName);
    e->store->AuthorizeSharedPool(counting, kVmName);
    absl::StatusOr<RegionLayout> layout =
        RegionLayout::ForSize(kRegionBytes, kEntries);
    if (!layout.ok()) Die("RegionLayout::ForSize failed");
    absl::StatusOr<std::unique_ptr<SharedRegion>> region =
        SharedRegion::Create("ring-consumer-fuzz", *layout, 1);
    if (!region.ok()) Die("SharedRegion::Create failed");
    e->region = std::move(*region);
    return e;
  }();
  return *env;
}

// Copies up to `n` input bytes to `dst`, zero-filling what the input lacks.
void Take(const uint8_t*& data, size_t& size, void* dst, size_t n) {
  const size_t k = n < size ? n : size;
  std::memcpy(dst, data, k);
  std::memset(static_cast<uint8_t*>(dst) + k, 0, n - k);
  data += k;
  size -= k;
}

// Overlays the guest-owned part of `image` onto the live header: guest
// section, sq_tail, cq_head.
void CopyGuestOwned(tmem_shm_header* h, const tmem_shm_header& image) {
  const size_t from = offsetof(tmem_shm_header, guest_generation);
  const size_t to = offsetof(tmem_shm_header, sq_head);
  std::memcpy(reinterpret_cast<uint8_t*>(h) + from,
              reinterpret_cast<const uint8_t*>(&image) + from, to - from);
  h->sq_tail = image.sq_tail;
  h->cq_head = image.cq_head;
}

}  // namespace
}  // namespace tmem

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tmem;  // NOLINT(google-build-using-namespace)
  Env& env = GetEnv();
  SharedRegion& region = *env.region;
  const RegionLayout& layout = region.layout();
  tmem_shm_header* const h = region.header();

  uint8_t control[2];
  Take(data, size, control, sizeof(control));
  const bool overwrite_host_fields = (control[0] & 1) != 0;
  const bool fill_slots = (control[0] & 2) != 0;
  const int drains = 1 + ((control[0] >> 2) & 3);
  const bool act_between = (control[0] & 16) != 0;
  const bool restart_between = (control[0] & 32) != 0;
  static constexpr PutMode kModes[] = {PutMode::kCompress, PutMode::kRaw,
                                       PutMode::kDrop, PutMode::kCompress};
  env.advisor.mode = kModes[control[1] & 3];
  env.advisor.aside = false;
  const uint32_t repost = (control[1] >> 2) & 15;

  // A clean channel, then the guest's bytes over it.
  region.Reset();
  RingConsumer consumer(&region, env.store.get(), env.vm, &env.metrics,
                        &env.advisor);
  tmem_shm_header image{};
  Take(data, size, &image, sizeof(image));
  if (overwrite_host_fields) {
    std::memcpy(h, &image, sizeof(image));
  } else {
    CopyGuestOwned(h, image);
  }
  Take(data, size, region.base() + layout.sq_offset,
       size_t{layout.sq_entries} * sizeof(tmem_sqe));
  Take(data, size, region.base() + layout.cq_offset,
       size_t{layout.cq_entries} * sizeof(tmem_cqe));
  if (fill_slots) {
    const size_t slots = size_t{layout.slot_count} * TMEM_PAGE_SIZE;
    const size_t n = size < slots ? size : slots;
    std::memcpy(region.base() + layout.slots_offset, data, n);
  }

  for (int i = 0; i < drains; ++i) {
    const RingConsumer::DrainResult r = consumer.Drain(kMaxDrain);
    if (r.consumed > kMaxDrain) Die("drained more than asked");
    // The guest's self-report, read as tmemd reads it, handed to the
    // advisor as the channel does.
    const GuestReport report = ReadGuestReport(h);
    if (report.standing_aside !=
        ((report.flags & TMEM_GUEST_STANDING_ASIDE) != 0)) {
      Die("standing_aside disagrees with guest_flags");
    }
    env.advisor.OnGuestStandingAside(env.vm, report.standing_aside);
    if (i == 0 && !r.reset && r.consumed <= kEntries) {
      // First drain from a reset region: SQE k completed as CQE k, and the
      // harness has not touched either ring since.
      const auto* sq =
          reinterpret_cast<const tmem_sqe*>(region.base() + layout.sq_offset);
      const auto* cq =
          reinterpret_cast<const tmem_cqe*>(region.base() + layout.cq_offset);
      for (uint32_t k = 0; k < r.consumed; ++k) {
        const tmem_sqe& sqe = sq[k & (layout.sq_entries - 1)];
        const tmem_cqe& cqe = cq[k & (layout.cq_entries - 1)];
        if (sqe.opcode != TMEM_OP_GET_BATCH || cqe.status != TMEM_OK) continue;
        if (sqe.count == 0 || sqe.count > TMEM_GET_BATCH_MAX ||
            uint64_t{sqe.slot} + sqe.count > layout.slot_count) {
          Die("GET_BATCH with an impossible count or slots completed OK");
        }
        if ((uint64_t{cqe.result} >> sqe.count) != 0) {
          Die("GET_BATCH hit bitmap beyond its count");
        }
      }
    }
    if (!r.reset) {
      // tmemd never overfills the CQ: it holds at most cq_entries
      // unreaped completions (the guest cannot change the indices while
      // Drain runs here, so this reads what Drain left).
      const uint32_t unreaped = h->cq_tail.value - h->cq_head.value;
      if (unreaped > layout.cq_entries) Die("CQ overfilled");
    }
    if (consumer.Pending() > layout.sq_entries) Die("impossible Pending()");
    if (act_between) {
      // Reap everything, then re-post entries already in the ring (a
      // guest reusing its SQEs), so sequences like NEW_POOL, PUT, GET run
      // more than once.
      h->cq_head.value = h->cq_tail.value;
      h->sq_tail.value = h->sq_head.value + (repost % (kEntries + 1));
    }
    if (restart_between) ++h->guest_generation;
  }
  // Nothing carries over to the next input.
  consumer.DropPools();
  return 0;
}
