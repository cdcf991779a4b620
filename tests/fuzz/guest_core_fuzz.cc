// libFuzzer target for the guest protocol core (guest-driver/core), the code
// the kernel module and the userspace library both run, against a hostile
// host: the mirror image of ring_consumer_fuzz.cc.
//
// The host owns half of the shared header, the CQ and the get slots; a
// buggy, malicious or restarting tmemd can write anything there at any
// moment. The core must never crash, touch memory outside the region, trip
// ASan/UBSan, or lose track of its own slots and entries, whatever the host
// does (invariant 3, guest side).
//
// The input is a script. Each step takes one byte: the low 4 bits pick an
// action, the rest (and following bytes) its arguments:
//   guest:  put, get, invalidate page/object/pool, new handle (private or
//           shared), release handle, poll;
//   host:   complete SQEs honestly (echo the tag, fuzzed status/result),
//           write a garbage CQE (fuzzed tag, status, result), write a fuzzed
//           value into any header field (lying indices, a changed geometry,
//           state or generation), reset the channel (RESET, new generation,
//           zeroed indices, READY), raise the interrupt.
// A get or a pool creation waits through ops->wait; every wait lets the
// script's host act (so resets and garbage land mid-get), and the fake
// clock moves on every now_ns(), so get timeouts come deterministically.
//
// After every step the core's bookkeeping is checked: free slots and free
// entries within bounds and never listed twice.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "guest-driver/core/tmem_core.h"
#include "proto/tmem_abi.h"

namespace {

constexpr uint64_t kRegionBytes = 1 << 20;
constexpr uint32_t kEntries = 8;
// 16 ordinary slots and, when the script offers GET_BATCH, 2 windows of 32.
constexpr uint32_t kSlotCount = 136;
constexpr uint32_t kSqOffset = TMEM_PAGE_SIZE;
constexpr uint32_t kCqOffset = kSqOffset + kEntries * sizeof(tmem_sqe);
constexpr uint32_t kSlotsOffset = 2 * TMEM_PAGE_SIZE;
constexpr int kMaxSteps = 512;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "guest_core_fuzz: %s\n", what);
  std::abort();
}

std::vector<uint8_t>& Region() {
  // Never destroyed: libFuzzer may exit from any thread at any time.
  static auto* const region = new std::vector<uint8_t>(kRegionBytes);
  return *region;
}

struct Harness {
  explicit Harness(const uint8_t* data, size_t size) : fdp(data, size) {}

  FuzzedDataProvider fdp;
  // Exactly the region: ASan flags any access past it. Allocated once (a
  // fresh 1 MiB per input would dominate the run); each input zeroes the
  // header and rings, and slot bytes never steer the core.
  std::vector<uint8_t>& region = Region();
  uint64_t clock_ns = 1;
  uint64_t random = 0x9e3779b97f4a7c15ULL;
  uint32_t host_sq_head = 0;
  uint32_t host_cq_tail = 0;
  uint64_t host_generation = 7;
  int wait_depth = 0;
  tmem_core_config cfg{};
  tmem_core core{};
  std::vector<tmem_core_pending> pending = std::vector<tmem_core_pending>(64);
  std::vector<uint32_t> free_pending = std::vector<uint32_t>(64);
  std::vector<uint32_t> free_slots = std::vector<uint32_t>(kSlotCount);
  std::vector<std::vector<unsigned long>> filters =
      std::vector<std::vector<unsigned long>>(TMEM_MAX_POOLS);
  uint8_t page[TMEM_PAGE_SIZE] = {};

  tmem_shm_header* header() {
    return reinterpret_cast<tmem_shm_header*>(region.data());
  }

  void WriteHeader() {
    tmem_shm_header* h = header();
    std::memset(region.data(), 0, kSlotsOffset);
    h->magic = TMEM_ABI_MAGIC;
    h->version = TMEM_ABI_VERSION;
    h->features_host = fdp.ConsumeIntegral<uint8_t>() & 0xf;
    h->header_size = sizeof(tmem_shm_header);
    h->region_size = kRegionBytes;
    h->sq_offset = kSqOffset;
    h->sq_entries = kEntries;
    h->cq_offset = kCqOffset;
    h->cq_entries = kEntries;
    h->slots_offset = kSlotsOffset;
    h->slot_count = kSlotCount;
    h->host_generation = host_generation;
    h->host_peer_id = fdp.ConsumeIntegral<uint8_t>() & 3;
    h->host_flags = TMEM_HOST_NEEDS_DOORBELL;
    h->admission_hint = TMEM_ADMIT_ALL;
    host_sq_head = 0;
    host_cq_tail = 0;
    __atomic_store_n(&h->host_state, TMEM_HOST_STATE_READY, __ATOMIC_RELEASE);
  }

  void HostReset() {
    __atomic_store_n(&header()->host_state, TMEM_HOST_STATE_RESET,
                     __ATOMIC_RELEASE);
    ++host_generation;
    WriteHeader();
  }

  void PostCqe(const tmem_cqe& cqe) {
    tmem_shm_header* h = header();
    std::memcpy(region.data() + kCqOffset +
                    (host_cq_tail & (kEntries - 1)) * sizeof(tmem_cqe),
                &cqe, sizeof(cqe));
    ++host_cq_tail;
    __atomic_store_n(&h->cq_tail.value, host_cq_tail, __ATOMIC_RELEASE);
  }

  // Executes up to n SQEs the way a host would, with fuzzed outcomes.
  void HostComplete(uint32_t n) {
    tmem_shm_header* h = header();
    const uint32_t tail = __atomic_load_n(&h->sq_tail.value, __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < n && host_sq_head != tail; ++i) {
      tmem_sqe sqe;
      std::memcpy(&sqe,
                  region.data() + kSqOffset +
                      (host_sq_head & (kEntries - 1)) * sizeof(tmem_sqe),
                  sizeof(sqe));
      ++host_sq_head;
      __atomic_store_n(&h->sq_head.value, host_sq_head, __ATOMIC_RELEASE);
      tmem_cqe cqe{sqe.tag, TMEM_OK, 0};
      const uint8_t how = fdp.ConsumeIntegral<uint8_t>();
      if ((how & 3) == 1) cqe.status = -fdp.ConsumeIntegralInRange<int>(0, 120);
      cqe.result = (how & 4) ? fdp.ConsumeIntegral<uint32_t>() : (how >> 3) & 1;
      if (sqe.opcode == TMEM_OP_NEW_POOL && (how & 3) != 1) {
        cqe.result = (how >> 4) & 7;
      }
      // The host writes get slots it was told to: anywhere it likes, in
      // fact, but only inside the region (the host is bound by it too).
      if (sqe.slot < kSlotCount) {
        std::memset(
            region.data() + kSlotsOffset + uint64_t{sqe.slot} * TMEM_PAGE_SIZE,
            how, TMEM_PAGE_SIZE);
      }
      PostCqe(cqe);
    }
  }

  void HostWritesField() {
    tmem_shm_header* h = header();
    const uint64_t v = fdp.ConsumeIntegral<uint64_t>();
    switch (fdp.ConsumeIntegralInRange<int>(0, 12)) {
      case 0:
        h->sq_head.value = static_cast<uint32_t>(v);
        break;
      case 1:
        h->cq_tail.value = static_cast<uint32_t>(v);
        break;
      case 2:
        h->host_state = static_cast<uint32_t>(v % 4);
        break;
      case 3:
        h->host_generation = v;
        break;
      case 4:
        h->flush_done_seq = v;
        break;
      case 5:
        h->admission_hint = static_cast<uint32_t>(v);
        break;
      case 6:
        h->host_flags = static_cast<uint32_t>(v);
        break;
      case 7:
        h->sq_entries = static_cast<uint32_t>(v);
        break;
      case 8:
        h->slot_count = static_cast<uint32_t>(v);
        break;
      case 9:
        h->slots_offset = static_cast<uint32_t>(v);
        break;
      case 10:
        h->features_host = static_cast<uint32_t>(v);
        break;
      case 11:
        h->host_peer_id = static_cast<uint32_t>(v);
        break;
      default: {
        // A guest-owned index, rewritten as a reset would.
        h->sq_tail.value = static_cast<uint32_t>(v);
        break;
      }
    }
  }

  // The host's turn: one action from the script.
  void HostActs() {
    if (fdp.remaining_bytes() == 0) return;
    const uint8_t b = fdp.ConsumeIntegral<uint8_t>();
    switch (b & 7) {
      case 0:
      case 1:
      case 2:
        HostComplete(1 + (b >> 3));
        break;
      case 3: {
        tmem_cqe cqe{};
        cqe.tag = fdp.ConsumeIntegral<uint64_t>();
        if (b & 8) {  // a live tag, with a lie in status or result
          cqe.tag = core.pending[fdp.ConsumeIntegralInRange<uint32_t>(
                                     0, kEntries * 2 - 1)]
                        .tag;
        }
        cqe.status = fdp.ConsumeIntegral<int32_t>();
        cqe.result = fdp.ConsumeIntegral<uint32_t>();
        PostCqe(cqe);
        break;
      }
      case 4:
        HostWritesField();
        break;
      case 5:
        HostReset();
        break;
      default:
        break;  // the host does nothing this time
    }
  }

  void CheckBookkeeping() const {
    if (core.nfree_slots > core.slots_usable) Die("more free slots than slots");
    if (core.nfree_pending > core.pending_cap)
      Die("more free entries than entries");
    std::vector<bool> seen(kSlotCount);
    for (uint32_t i = 0; i < core.nfree_slots; ++i) {
      const uint32_t s = core.free_slots[i];
      if (s >= core.slots_usable || s >= kSlotCount)
        Die("free slot out of range");
      if (seen[s]) Die("slot freed twice");
      seen[s] = true;
    }
    for (uint32_t i = 0; i < core.nwin; ++i) {
      const tmem_core_window& w = core.win[i];
      const uint32_t mask = w.count >= 32 ? ~0u : (1u << w.count) - 1;
      if ((w.present | w.missing) & ~mask) Die("window bits past its count");
      if (w.present & w.missing) Die("a page both present and missing");
      if (w.count > TMEM_GET_BATCH_MAX) Die("window too long");
      if (core.aside && w.state != 0 && w.present)
        Die("prefetched while aside");
    }
    std::vector<bool> seen_entry(pending.size());
    for (uint32_t i = 0; i < core.nfree_pending; ++i) {
      const uint32_t e = core.free_pending[i];
      if (e >= core.pending_cap) Die("free entry out of range");
      if (seen_entry[e]) Die("entry freed twice");
      seen_entry[e] = true;
    }
  }
};

void OpsLock(void*, unsigned long*) {}
void OpsUnlock(void*, unsigned long) {}
uint64_t OpsNow(void* ctx) {
  auto* h = static_cast<Harness*>(ctx);
  h->clock_ns += 3'000;
  return h->clock_ns;
}
void OpsDoorbell(void* ctx, uint32_t /*value*/) {
  static_cast<Harness*>(ctx)->HostActs();
}
bool OpsWait(void* ctx, bool (*)(void*), void*, uint64_t timeout_ns) {
  auto* h = static_cast<Harness*>(ctx);
  h->clock_ns += timeout_ns / 2 + 1;
  // An exhausted script makes the host silent: gets then time out.
  if (h->wait_depth++ == 0) h->HostActs();
  --h->wait_depth;
  return true;
}
void OpsCopyToSlot(void*, void* slot, const void* page) {
  std::memcpy(slot, page, TMEM_PAGE_SIZE);
}
void OpsCopyFromSlot(void*, void* page, const void* slot) {
  std::memcpy(page, slot, TMEM_PAGE_SIZE);
}
uint64_t OpsRandom(void* ctx) {
  auto* h = static_cast<Harness*>(ctx);
  h->random = h->random * 6364136223846793005ULL + 1442695040888963407ULL;
  return h->random;
}

const tmem_core_ops kOps = {
    .lock = OpsLock,
    .unlock = OpsUnlock,
    .now_ns = OpsNow,
    .doorbell = OpsDoorbell,
    .wait = OpsWait,
    .copy_to_slot = OpsCopyToSlot,
    .copy_from_slot = OpsCopyFromSlot,
    .random_u64 = OpsRandom,
};

int Handle(Harness& h) { return h.fdp.ConsumeIntegralInRange<int>(-1, 4); }

void Oid(Harness& h, uint32_t oid[TMEM_OBJECT_WORDS]) {
  std::memset(oid, 0, TMEM_OBJECT_WORDS * sizeof(uint32_t));
  oid[0] = h.fdp.ConsumeIntegralInRange<uint32_t>(0, 2);
}

void NewHandle(Harness& h, bool shared) {
  std::vector<unsigned long> filter;
  if (!shared) filter.assign(1024 / (sizeof(unsigned long) * 8), 0);
  uint8_t uuid[16] = {};
  uuid[0] = h.fdp.ConsumeIntegral<uint8_t>() & 1;
  unsigned long* old = nullptr;
  const int handle = tmem_core_new_handle(
      &h.core, shared, uuid, filter.empty() ? nullptr : filter.data(),
      filter.empty() ? 0 : 1024, &old);
  if (handle >= 0) h.filters[handle].swap(filter);
}

void GuestActs(Harness& h, uint8_t b) {
  uint32_t oid[TMEM_OBJECT_WORDS];
  switch (b >> 4) {
    case 0:
    case 1:
    case 2: {
      const int pool = Handle(h);
      Oid(h, oid);
      std::memset(h.page, b, sizeof(h.page));
      tmem_core_put(&h.core, pool, oid,
                    h.fdp.ConsumeIntegralInRange<uint64_t>(0, 40), h.page);
      break;
    }
    case 3:
    case 4:
    case 5: {
      const int pool = Handle(h);
      Oid(h, oid);
      const uint64_t index = h.fdp.ConsumeIntegralInRange<uint64_t>(0, 40);
      tmem_core_get(&h.core, pool, oid, index,
                    h.fdp.ConsumeIntegralInRange<uint32_t>(0, 40), h.page);
      break;
    }
    case 6: {
      const int pool = Handle(h);
      Oid(h, oid);
      tmem_core_invalidate_page(&h.core, pool, oid,
                                h.fdp.ConsumeIntegralInRange<uint64_t>(0, 40));
      break;
    }
    case 7: {
      const int pool = Handle(h);
      Oid(h, oid);
      tmem_core_invalidate_object(&h.core, pool, oid);
      break;
    }
    case 8:
      tmem_core_invalidate_pool(&h.core, Handle(h));
      break;
    case 9:
      NewHandle(h, false);
      break;
    case 10:
      NewHandle(h, true);
      break;
    case 11:
      tmem_core_release_handle(&h.core, Handle(h));
      break;
    case 12:
      tmem_core_interrupt(&h.core);
      break;
    default:
      tmem_core_poll(&h.core);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness h(data, size);
  h.cfg.get_spin_ns = 5'000;
  h.cfg.get_timeout_ns = 200'000;
  h.cfg.pool_create_timeout_ns = 100'000;
  h.cfg.pool_retry_ns = 50'000;
  h.cfg.stall_probe_ns = 100'000;
  h.cfg.ring_full_spin_ns = 10'000;
  h.cfg.stall_after_timeouts = 2;
  h.cfg.skip_unsent_gets = h.fdp.ConsumeBool();
  h.cfg.batch_pages = h.fdp.ConsumeIntegralInRange<uint32_t>(0, 40);
  h.cfg.prefetch_windows = 2;
  // Sometimes a guest that stands aside quickly (and comes back).
  h.cfg.miss_cost_ns = h.fdp.ConsumeBool() ? 50'000 : 0;
  h.cfg.aside_sample_gets = 4;
  h.cfg.aside_probe_ns = 300'000;
  h.WriteHeader();
  tmem_core_init(&h.core, &kOps, &h, &h.cfg);
  tmem_core_bind(&h.core, h.region.data(), kRegionBytes, h.pending.data(),
                 h.free_pending.data(), static_cast<uint32_t>(h.pending.size()),
                 h.free_slots.data(),
                 static_cast<uint32_t>(h.free_slots.size()));
  NewHandle(h, false);
  for (int step = 0; step < kMaxSteps && h.fdp.remaining_bytes() > 0; ++step) {
    const uint8_t b = h.fdp.ConsumeIntegral<uint8_t>();
    if (b & 1) {
      h.HostActs();
    } else {
      GuestActs(h, b);
    }
    h.CheckBookkeeping();
  }
  tmem_core_unbind(&h.core);
  return 0;
}
