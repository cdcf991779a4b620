#include "host-agent/channel/ring_consumer.h"

#include <algorithm>
#include <array>
#include <bit>
#include <bitset>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/page_codec.h"
#include "backend/types.h"
#include "host-agent/channel/region_layout.h"

namespace tmem {
namespace {

static_assert(kPageSize == TMEM_PAGE_SIZE, "a slot holds exactly one page");
static_assert(sizeof(ObjectId) == sizeof(tmem_sqe::oid),
              "the wire object id is the cleancache filekey");
static_assert(sizeof(PoolUuid) <= sizeof(tmem_sqe::oid),
              "NEW_POOL carries the uuid in the first bytes of oid");
static_assert(TMEM_MAX_POOLS <= 64, "flush_request is a 64-bit pool bitmap");
static_assert(TMEM_GET_BATCH_MAX <= TmemStore::kMaxGetRun &&
                  TMEM_GET_BATCH_MAX <= 32,
              "a GET_BATCH is one store run; its hit bitmap is cqe.result");

// ---------------------------------------------------------------------------
// Raw shared-memory access. Everything that touches the guest's memory goes
// through the few helpers below, so each unsafe step is stated once.
//
// Ring indices and header fields are accessed with __atomic builtins: they
// are naturally aligned 32/64-bit words (static asserts in tmem_abi.h fix the
// layout), so each load is a single untorn read, and the compiler can never
// re-read or merge it. Entry and slot copies use memcpy followed by a
// compiler barrier (see CopyFromGuest).
// ---------------------------------------------------------------------------

// A compiler-only barrier (the kernel's barrier()): the compiler must assume
// all memory changed here. No CPU fence is needed for what it guards (a
// single thread's own copy); the cross-CPU ordering comes from the
// acquire/release index accesses.
inline void CompilerBarrier() { asm volatile("" ::: "memory"); }

// Copies `n` bytes out of guest-writable memory into tmemd's own.
// Relies on: [src, src + n) inside the mapping (callers bound-check against
// the RegionLayout that SharedRegion::Create validated), and an acquire load
// of the index that published those bytes having happened before. The
// barrier forbids the compiler from dropping the local copy and re-reading
// the guest's memory later (a double fetch: a field validated in the copy
// but used from shared memory, which the guest may have changed meanwhile).
inline void CopyFromGuest(void* dst, const uint8_t* src, size_t n) {
  std::memcpy(dst, src, n);
  CompilerBarrier();
}

// Copies `n` bytes of tmemd's memory into the guest's. Relies on: [dst,
// dst + n) inside the mapping; the release store of the index that hands
// the bytes over (cq_tail) comes after it.
inline void CopyToGuest(uint8_t* dst, const void* src, size_t n) {
  std::memcpy(dst, src, n);
}

template <typename T>
T LoadAcquire(const T* field) {
  return __atomic_load_n(field, __ATOMIC_ACQUIRE);
}
template <typename T>
T LoadRelaxed(const T* field) {
  return __atomic_load_n(field, __ATOMIC_RELAXED);
}

// ---------------------------------------------------------------------------
// Entry execution: a validated local copy of one SQE in, a completion out.
// ---------------------------------------------------------------------------

struct Completion {
  int32_t status = TMEM_OK;
  uint32_t result = 0;
};

// The one place where store errors become wire statuses.
int32_t WireStatus(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kNotFound:
      return TMEM_ERR_NOENT;
    case absl::StatusCode::kPermissionDenied:
      return TMEM_ERR_PERM;
    case absl::StatusCode::kResourceExhausted:
      return TMEM_ERR_NOSPC;
    default:
      return TMEM_ERR_INVAL;
  }
}

ObjectId ObjectIdOf(const tmem_sqe& sqe) {
  ObjectId oid;
  std::memcpy(oid.words.data(), sqe.oid, sizeof(sqe.oid));
  return oid;
}

bool AllZero(const uint8_t* bytes, size_t n) {
  return std::all_of(bytes, bytes + n, [](uint8_t b) { return b == 0; });
}

class EntryExecutor {
 public:
  EntryExecutor(const RegionLayout& layout, uint8_t* base, TmemStore* store,
                VmId vm, ChannelMetrics* metrics, PutAdvisor* advisor,
                std::bitset<TMEM_MAX_POOLS>* pools,
                std::bitset<TMEM_MAX_POOLS>* shared_pools,
                std::span<uint8_t> batch_pages, bool guest_applies_hint,
                bool compress_later)
      : layout_(layout),
        base_(base),
        store_(store),
        vm_(vm),
        metrics_(metrics),
        advisor_(advisor),
        pools_(pools),
        shared_pools_(shared_pools),
        batch_pages_(batch_pages),
        guest_applies_hint_(guest_applies_hint),
        compress_later_(compress_later) {}

  // `sqe` is tmemd's own copy: every field is read from it, never from the
  // ring, and validated before use.
  Completion Execute(const tmem_sqe& sqe) {
    if (sqe.opcode >= TMEM_OP_MAX) {
      return Fail(ChannelCounter::kSqeBadOpcode, TMEM_ERR_INVAL);
    }
    const auto op = static_cast<tmem_opcode>(sqe.opcode);
    // Unknown bits are refused rather than ignored, so a later ABI can give
    // them a meaning without old hosts silently misreading new guests.
    const unsigned allowed =
        TMEM_SQE_F_IRQ | (op == TMEM_OP_NEW_POOL ? TMEM_SQE_F_SHARED : 0u);
    // `count` means something only to GET_BATCH (checked there).
    if ((sqe.flags & ~allowed) != 0 ||
        (op != TMEM_OP_GET_BATCH && sqe.count != 0) ||
        !AllZero(sqe.reserved, sizeof(sqe.reserved))) {
      return Fail(ChannelCounter::kSqeBadFlags, TMEM_ERR_INVAL);
    }
    const bool uses_pool = op != TMEM_OP_NOP && op != TMEM_OP_NEW_POOL;
    if (uses_pool && !KnownPool(sqe.pool)) {
      return Fail(ChannelCounter::kSqeBadPool, TMEM_ERR_NOENT);
    }
    const bool uses_slot = op == TMEM_OP_PUT || op == TMEM_OP_GET;
    // Against tmemd's layout, never the header's slot_count (guest-writable).
    if (uses_slot && sqe.slot >= layout_.slot_count) {
      return Fail(ChannelCounter::kSqeBadSlot, TMEM_ERR_INVAL);
    }
    switch (op) {
      case TMEM_OP_NOP:
        return {};
      case TMEM_OP_NEW_POOL:
        return NewPool(sqe);
      case TMEM_OP_DESTROY_POOL:
        return DestroyPool(sqe);
      case TMEM_OP_PUT:
        return Put(sqe);
      case TMEM_OP_GET:
        return Get(sqe);
      case TMEM_OP_INVAL_PAGE:
        return Done(
            store_->InvalidatePage(vm_, sqe.pool, ObjectIdOf(sqe), sqe.index));
      case TMEM_OP_INVAL_OBJECT:
        return Done(store_->InvalidateObject(vm_, sqe.pool, ObjectIdOf(sqe)));
      case TMEM_OP_INVAL_POOL:
        return Done(store_->InvalidatePool(vm_, sqe.pool));
      case TMEM_OP_GET_BATCH:
        return GetBatch(sqe);
      case TMEM_OP_MAX:
        break;
    }
    return Fail(ChannelCounter::kSqeBadOpcode, TMEM_ERR_INVAL);
  }

 private:
  Completion Fail(ChannelCounter counter, int32_t status) {
    metrics_->Inc(counter);
    return {status, 0};
  }

  Completion Done(const absl::Status& status) {
    if (status.ok()) return {};
    metrics_->Inc(ChannelCounter::kSqeStoreErrors);
    return {WireStatus(status), 0};
  }

  bool KnownPool(uint16_t pool) const {
    return pool < TMEM_MAX_POOLS && pools_->test(pool);
  }

  // Relies on: slot < layout_.slot_count (checked in Execute) and
  // SharedRegion::Create having checked slots_offset + slot_count pages <=
  // region_bytes, so the page lies inside the mapping. 64-bit arithmetic:
  // slot * 4096 does not wrap.
  uint8_t* Slot(uint32_t slot) const {
    return base_ + uint64_t{layout_.slots_offset} +
           uint64_t{slot} * TMEM_PAGE_SIZE;
  }

  Completion NewPool(const tmem_sqe& sqe) {
    PoolUuid uuid;
    const bool shared = (sqe.flags & TMEM_SQE_F_SHARED) != 0;
    if (shared) std::memcpy(uuid.bytes.data(), sqe.oid, uuid.bytes.size());
    absl::StatusOr<PoolId> id = store_->NewPool(vm_, shared ? &uuid : nullptr);
    if (!id.ok()) return Done(id.status());
    if (*id < 0 || *id >= static_cast<PoolId>(TMEM_MAX_POOLS)) {
      // The wire's pool field and the flush bitmap name at most 64 pools
      // per VM: give this one straight back rather than hand out an id the
      // guest could never flush.
      store_->DestroyPool(vm_, *id).IgnoreError();
      return Fail(ChannelCounter::kSqeBadPool, TMEM_ERR_NOSPC);
    }
    pools_->set(static_cast<size_t>(*id));
    shared_pools_->set(static_cast<size_t>(*id), shared);
    return {TMEM_OK, static_cast<uint32_t>(*id)};
  }

  Completion DestroyPool(const tmem_sqe& sqe) {
    // Forgotten whatever the store says: if it no longer knows the pool,
    // neither should we.
    pools_->reset(sqe.pool);
    shared_pools_->reset(sqe.pool);
    return Done(store_->DestroyPool(vm_, sqe.pool));
  }

  Completion Put(const tmem_sqe& sqe) {
    // The guest may rewrite the slot while we work (it is hostile, or
    // buggy): take one snapshot, so that what the store inspects,
    // compresses and keeps is one consistent page. Not zero-filled: every
    // byte is overwritten by the copy.
    std::array<uint8_t, kPageSize> page;  // NOLINT(*-member-init)
    CopyFromGuest(page.data(), Slot(sqe.slot), kPageSize);
    const ObjectId oid = ObjectIdOf(sqe);
    PutMode mode = advisor_ != nullptr
                       ? advisor_->Advise(vm_, KeyHash(oid, sqe.index),
                                          guest_applies_hint_)
                       : PutMode::kCompress;
    if ((mode == PutMode::kCompress || mode == PutMode::kDefer) &&
        compress_later_) {
      // Other VMs wait on this worker: the page is stored raw now and its
      // compression queued for the compactor at idle priority (its raw
      // size charged to this VM), so a flood of compressing puts cannot
      // stand in front of them, nor its compression beside them.
      mode = PutMode::kDeferIdle;
      metrics_->Inc(ChannelCounter::kPutsCompressionDeferred);
    }
    // Even a put the valve drops goes to the store: a refused put must
    // still remove the key's earlier page (invariant 1).
    absl::StatusOr<PutResult> put =
        store_->Put(vm_, sqe.pool, oid, sqe.index, ConstPage(page), mode);
    if (!put.ok()) return Done(put.status());
    if (!put->stored) {
      return Fail(ChannelCounter::kPutsDroppedByHost, TMEM_ERR_DROPPED);
    }
    return {};
  }

  Completion Get(const tmem_sqe& sqe) {
    // Decompress into tmemd's memory, then copy once: the store never
    // writes into (or reads back from) memory the guest can change.
    std::array<uint8_t, kPageSize> page;  // NOLINT(*-member-init)
    const ObjectId oid = ObjectIdOf(sqe);
    absl::StatusOr<bool> hit =
        store_->Get(vm_, sqe.pool, oid, sqe.index, MutablePage(page));
    if (!hit.ok()) return Done(hit.status());
    if (advisor_ != nullptr)
      advisor_->OnGet(vm_, KeyHash(oid, sqe.index), *hit);
    if (!*hit) return {TMEM_OK, 0};
    CopyToGuest(Slot(sqe.slot), page.data(), kPageSize);
    return {TMEM_OK, 1};
  }

  // TMEM_OP_GET_BATCH: pages index .. index + count - 1 of one object into
  // slots slot .. slot + count - 1; the result is the hit bitmap.
  Completion GetBatch(const tmem_sqe& sqe) {
    const uint32_t count = sqe.count;
    if (count == 0 || count > TMEM_GET_BATCH_MAX ||
        sqe.index + (count - 1) < sqe.index) {
      return Fail(ChannelCounter::kGetBatchBadCount, TMEM_ERR_INVAL);
    }
    // Our own record of how the pool was created, never a guest claim:
    // a shared pool's hits are not exclusive, so its pages cannot be
    // handed over to a guest-side prefetch slot.
    if (shared_pools_->test(sqe.pool)) {
      return Fail(ChannelCounter::kGetBatchSharedPool, TMEM_ERR_INVAL);
    }
    // Against tmemd's layout (guest-writable header never read); 64-bit, so
    // a slot near UINT32_MAX cannot wrap past the check.
    if (uint64_t{sqe.slot} + count > layout_.slot_count) {
      return Fail(ChannelCounter::kGetBatchBadSlots, TMEM_ERR_INVAL);
    }
    // Decoded into tmemd's memory, then copied once per hit (as Get).
    const ObjectId oid = ObjectIdOf(sqe);
    absl::StatusOr<uint64_t> hits =
        store_->GetRun(vm_, sqe.pool, oid, sqe.index, count, batch_pages_);
    if (!hits.ok()) return Done(hits.status());
    metrics_->Inc(ChannelCounter::kGetBatches);
    metrics_->Inc(ChannelCounter::kGetBatchPages, count);
    metrics_->Inc(ChannelCounter::kGetBatchHits,
                  static_cast<uint64_t>(std::popcount(*hits)));
    for (uint32_t k = 0; k < count; ++k) {
      const bool hit = ((*hits >> k) & 1) != 0;
      // The first page is what the guest asked for; the rest are its
      // prefetch. A prefetched miss says nothing about reuse (the guest may
      // never read that page), so only the asked page's miss is a get the
      // valve hears of; every hit is a page that came back.
      if (advisor_ != nullptr && (hit || k == 0)) {
        advisor_->OnGet(vm_, KeyHash(oid, sqe.index + k), hit);
      }
      if (hit) {
        CopyToGuest(Slot(sqe.slot + k),
                    batch_pages_.data() + size_t{k} * kPageSize, kPageSize);
      }
    }
    return {TMEM_OK, static_cast<uint32_t>(*hits)};
  }

  const RegionLayout& layout_;
  uint8_t* const base_;
  TmemStore* const store_;
  const VmId vm_;
  ChannelMetrics* const metrics_;
  PutAdvisor* const advisor_;
  std::bitset<TMEM_MAX_POOLS>* const pools_;
  std::bitset<TMEM_MAX_POOLS>* const shared_pools_;
  const std::span<uint8_t> batch_pages_;  // TMEM_GET_BATCH_MAX pages
  const bool guest_applies_hint_;
  const bool compress_later_;
};

}  // namespace

RingConsumer::RingConsumer(SharedRegion* region, TmemStore* store, VmId vm,
                           ChannelMetrics* metrics, PutAdvisor* advisor)
    : region_(region),
      store_(store),
      vm_(vm),
      metrics_(metrics),
      advisor_(advisor),
      region_generation_(region->host_generation()),
      batch_pages_(std::make_unique<BatchPages>()) {}

RingConsumer::DrainResult RingConsumer::Drain(uint32_t max_entries,
                                              bool compress_later) {
  DrainResult out;
  if (region_->host_generation() != region_generation_) {
    // The region's owner re-initialized it (SharedRegion::Reset): indices
    // and flush fields are zero again and the guest must re-attach and
    // forget its pool ids, so the pools behind those ids go too.
    DropPools();
    sq_head_ = 0;
    cq_tail_ = 0;
    flush_done_seq_ = 0;
    guest_generation_ = 0;
    region_generation_ = region_->host_generation();
  }

  // Every size, offset and mask below comes from tmemd's own layout, which
  // SharedRegion::Create validated (power-of-two ring sizes, rings and slots
  // inside the mapping). The header's copies are never read.
  const RegionLayout& layout = region_->layout();
  tmem_shm_header* const h = region_->header();
  uint8_t* const sq_base = region_->base() + layout.sq_offset;
  uint8_t* const cq_base = region_->base() + layout.cq_offset;
  const uint32_t sq_mask = layout.sq_entries - 1;
  const uint32_t cq_mask = layout.cq_entries - 1;
  // Read once per drain; a guest that lies only changes who samples its
  // puts (the CPU budget still bounds what they cost).
  const bool guest_applies_hint =
      (LoadRelaxed(&h->features_guest) & TMEM_FEAT_ADMISSION_HINT) != 0;
  EntryExecutor executor(layout, region_->base(), store_, vm_, metrics_,
                         advisor_, &pools_, &shared_pools_, *batch_pages_,
                         guest_applies_hint, compress_later);

  // Rounds: each reads the guest's indices once, then works from those
  // snapshots; a later round picks up what the guest posted meanwhile.
  for (;;) {
    // Acquire: the SQEs and slot bytes the guest wrote before publishing
    // this tail are visible to the copies below.
    const uint32_t sq_tail = LoadAcquire(&h->sq_tail.value);
    // Acquire: the guest has finished reading every CQE below cq_head
    // before we overwrite it.
    const uint32_t cq_head = LoadAcquire(&h->cq_head.value);
    // After the tail: a guest writes its generation before posting entries,
    // so the generation read here is at least as new as those entries.
    const uint64_t guest_generation = LoadAcquire(&h->guest_generation);
    // Acquire: pairs with the guest's release of the sequence after it ORed
    // the pool bits into flush_request.
    const uint64_t flush_seq = LoadAcquire(&h->flush_request_seq);
    // Host-owned: read back only to catch a guest that wrote them.
    const uint32_t seen_sq_head = LoadRelaxed(&h->sq_head.value);
    const uint32_t seen_cq_tail = LoadRelaxed(&h->cq_tail.value);
    const uint64_t seen_host_generation = LoadRelaxed(&h->host_generation);

    if (guest_generation != guest_generation_) {
      // Any change from a recorded generation (to 0 too: detached) means
      // the pool ids we handed out belong to a guest that is gone. The first
      // nonzero value after none is only recorded.
      if (guest_generation_ != 0) {
        metrics_->Inc(ChannelCounter::kGuestRestarts);
        DropPools();
      }
      guest_generation_ = guest_generation;
    }

    // Unsigned differences of free-running indices: correct across wrap,
    // and any claim of more than a ring's worth is impossible.
    const uint32_t available = sq_tail - sq_head_;
    const uint32_t cq_used = cq_tail_ - cq_head;
    // A header holding a generation tmemd did not write came from
    // elsewhere (live migration copies another host's region into ours),
    // or the guest scribbled on it: either way its rings are not ours.
    const bool foreign = seen_host_generation != region_generation_;
    if (foreign || seen_sq_head != sq_head_ || seen_cq_tail != cq_tail_ ||
        available > layout.sq_entries || cq_used > layout.cq_entries) {
      // We cannot tell which entries the guest meant, so an invalidate may
      // be lost: drop everything (nothing stale survives) and start over.
      metrics_->Inc(foreign ? ChannelCounter::kRegionForeign
                            : ChannelCounter::kRingCorruptIndex);
      metrics_->Inc(ChannelCounter::kChannelResets);
      DropPools();
      region_->Reset();
      sq_head_ = 0;
      cq_tail_ = 0;
      flush_done_seq_ = 0;
      // The guest re-attaches (with this or a new generation): record it
      // afresh rather than count a restart for what was our reset.
      guest_generation_ = 0;
      region_generation_ = region_->host_generation();
      out.reset = true;
      return out;
    }

    // Flush barrier. The low 32 bits of flush_request_seq are the sq_tail
    // at the request; the whole 64 bits name the request (a guest may use
    // the high bits to tell apart two requests made at one tail). It is
    // applied exactly when sq_head reaches that tail: after the entries
    // posted before the request, before any posted after it.
    const auto flush_at = static_cast<uint32_t>(flush_seq);
    auto flush_if_reached = [&] {
      // Signed distance: at or past the requested position (a hostile
      // guest's far-off value only delays or hastens its own flush).
      if (flush_seq == flush_done_seq_ ||
          static_cast<int32_t>(sq_head_ - flush_at) < 0) {
        return;
      }
      const uint64_t bits = LoadAcquire(&h->flush_request);
      for (uint32_t id = 0; id < TMEM_MAX_POOLS; ++id) {
        // Bits of pools we never created name nothing of this VM's.
        if (((bits >> id) & 1) == 0 || !pools_.test(id)) continue;
        if (!store_->InvalidatePool(vm_, static_cast<PoolId>(id)).ok()) {
          metrics_->Inc(ChannelCounter::kSqeStoreErrors);
        }
      }
      flush_done_seq_ = flush_seq;
      // Release: the guest that sees the ack also sees everything we
      // published before it (the CQEs up to flush_at).
      region_->PublishFlushDone(flush_seq);
      metrics_->Inc(ChannelCounter::kFlushBarriers);
    };

    // Consume only what we can complete: the CQ must have room for each
    // CQE, so tmemd never waits on the guest.
    const uint32_t cq_room = layout.cq_entries - cq_used;
    const uint32_t budget =
        std::min({available, cq_room, max_entries - out.consumed});
    uint32_t done = 0;
    bool waited_on = false;
    for (; done < budget && !waited_on; ++done) {
      flush_if_reached();
      tmem_sqe sqe;  // NOLINT(*-member-init): filled by the copy
      // Relies on: (sq_head_ & sq_mask) < sq_entries, and the SQ inside the
      // mapping; the acquire of sq_tail above published this entry.
      CopyFromGuest(&sqe, sq_base + size_t{sq_head_ & sq_mask} * sizeof(sqe),
                    sizeof(sqe));
      const Completion c = executor.Execute(sqe);
      // Honoured even on an error completion: the guest may be waiting.
      // And it ends this drain right after the entry: the guest is blocked
      // on it (a get), so its interrupt goes out now rather than after the
      // puts queued behind it are compressed (up to a batch of them, ~7 us
      // each). The worker drains again at once (`more`).
      if ((sqe.flags & TMEM_SQE_F_IRQ) != 0) {
        out.interrupt = true;
        waited_on = true;
      }
      const tmem_cqe cqe{sqe.tag, c.status, c.result};
      // Relies on: cq_used < cq_entries (cq_room > 0), so this CQE is one
      // the guest has reaped, and the CQ inside the mapping.
      CopyToGuest(cq_base + size_t{cq_tail_ & cq_mask} * sizeof(cqe), &cqe,
                  sizeof(cqe));
      ++cq_tail_;
      // Release: the CQE (and a GET's slot bytes) before the tail that
      // hands them over. One entry at a time, so a waiting get completes
      // without waiting for the rest of the batch.
      region_->PublishCqTail(cq_tail_);
      ++sq_head_;
      // Release: our copy of the SQE is done before the guest may reuse it.
      region_->PublishSqHead(sq_head_);
      metrics_->Inc(ChannelCounter::kSqeProcessed);
      metrics_->Inc(ChannelCounter::kCqeWritten);
    }
    flush_if_reached();
    out.consumed += done;
    if (waited_on) {
      out.more = available > done;
      return out;
    }
    if (done == 0) {
      // Entries left that we could have taken but for max_entries (a full
      // CQ is not "more": only the guest reaping can unblock it).
      out.more = available > 0 && cq_room > 0 && out.consumed >= max_entries;
      return out;
    }
  }
}

void RingConsumer::DropPools() {
  for (uint32_t id = 0; id < TMEM_MAX_POOLS; ++id) {
    if (!pools_.test(id)) continue;
    const absl::Status s = store_->DestroyPool(vm_, static_cast<PoolId>(id));
    // NOT_FOUND: already gone (the VM was forgotten); nothing left to drop.
    if (!s.ok() && !absl::IsNotFound(s)) {
      metrics_->Inc(ChannelCounter::kSqeStoreErrors);
    }
  }
  pools_.reset();
  shared_pools_.reset();
}

uint32_t RingConsumer::Pending() const {
  const RegionLayout& layout = region_->layout();
  // After a Reset() by the region's owner, the next Drain starts from 0.
  const uint32_t head =
      region_->host_generation() == region_generation_ ? sq_head_ : 0;
  const uint32_t sq_tail = LoadAcquire(&region_->header()->sq_tail.value);
  const uint32_t pending = sq_tail - head;
  return pending <= layout.sq_entries ? pending : 0;
}

}  // namespace tmem
