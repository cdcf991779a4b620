#include "guest-driver/userspace/tmem_guest.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

// A tag is (serial << kTagIndexBits) | pending-table index: the index finds
// the entry in O(1), the serial tells a live entry from a stale CQE.
constexpr int kTagIndexBits = 16;
constexpr uint64_t kTagIndexMask = (uint64_t{1} << kTagIndexBits) - 1;
constexpr uint32_t kMaxPending = uint32_t{1} << kTagIndexBits;
constexpr uint32_t kNoSlot = UINT32_MAX;
constexpr uint32_t kFeaturesUnderstood =
    TMEM_FEAT_SHARED_POOLS | TMEM_FEAT_ADMISSION_HINT | TMEM_FEAT_FLUSH_BARRIER;
// A Get waiting on the interrupt re-checks the ring at least this often:
// interrupts can be lost (before MSI-X is enabled, across resets).
constexpr std::chrono::microseconds kWaitSlice{1000};

uint64_t Mix64(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Two filter positions from one hash of the key (k = 2).
uint64_t KeyHash(const TmemGuest::ObjectId& oid, uint64_t index) {
  uint64_t h = Mix64(index);
  for (size_t i = 0; i < oid.size(); i += 2) {
    h = Mix64(h ^ (uint64_t{oid[i]} | uint64_t{oid[i + 1]} << 32));
  }
  return h;
}

void MarkSent(std::vector<uint64_t>& bits, uint64_t hash) {
  if (bits.empty()) return;
  const uint64_t mask = bits.size() * 64 - 1;
  for (uint64_t pos : {hash & mask, (hash >> 32) & mask}) {
    bits[pos / 64] |= uint64_t{1} << (pos % 64);
  }
}

bool MaybeSent(const std::vector<uint64_t>& bits, uint64_t hash) {
  if (bits.empty()) return true;  // no filter: assume the worst
  const uint64_t mask = bits.size() * 64 - 1;
  for (uint64_t pos : {hash & mask, (hash >> 32) & mask}) {
    if ((bits[pos / 64] & (uint64_t{1} << (pos % 64))) == 0) return false;
  }
  return true;
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Non-zero and different from `previous`: the host compares generations
// for equality only, so any fresh value works; random plus the clock makes a
// restarted guestsim differ from its predecessor.
uint64_t NewGeneration(uint64_t previous) {
  std::random_device rd;
  uint64_t g = (uint64_t{rd()} << 32) ^ uint64_t { rd() } ^
               static_cast<uint64_t>(
                   std::chrono::steady_clock::now().time_since_epoch().count());
  while (g == 0 || g == previous) {
    g = g * 6364136223846793005ULL + 1442695040888963407ULL;
  }
  return g;
}

absl::Status RefusalStatus(int32_t status, bool shared) {
  switch (status) {
    case TMEM_ERR_PERM:
      return absl::PermissionDeniedError(
          "the host refused the shared pool: this VM is not authorized for "
          "its UUID");
    case TMEM_ERR_NOSPC:
      return absl::ResourceExhaustedError(
          "the host refused a new pool: this VM has too many");
    default:
      return absl::InternalError(absl::StrCat("the host refused NEW_POOL",
                                              shared ? " (shared)" : "",
                                              " with status ", status));
  }
}

}  // namespace

std::vector<std::pair<std::string_view, uint64_t>> CounterList(
    const GuestCounters& c) {
  std::vector<std::pair<std::string_view, uint64_t>> out;
  ForEachCounter(c, [&out](std::string_view name, uint64_t value) {
    out.emplace_back(name, value);
  });
  return out;
}

void AddCounters(GuestCounters* total, const GuestCounters& c) {
  std::vector<uint64_t> values;
  ForEachCounter(
      c, [&values](std::string_view, uint64_t v) { values.push_back(v); });
  size_t i = 0;
  ForEachCounter(
      *total, [&](std::string_view, uint64_t& field) { field += values[i++]; });
}

// ---------------------------------------------------------------------------
// Channel state

TmemGuest::TmemGuest(GuestDevice* device, const TmemGuestOptions& options)
    : device_(device),
      options_(options),
      region_(device->shm_base(), device->shm_size()) {}

absl::StatusOr<std::unique_ptr<TmemGuest>> TmemGuest::Create(
    GuestDevice* device, const TmemGuestOptions& options) {
  if (device == nullptr || device->shm_base() == nullptr) {
    return absl::InvalidArgumentError("TmemGuest needs a mapped device");
  }
  std::unique_ptr<TmemGuest> guest(new TmemGuest(device, options));
  const Clock::time_point deadline = Clock::now() + options.attach_timeout;
  for (;;) {
    absl::Status s = guest->Attach();
    if (s.ok()) return guest;
    // Only "not READY yet" is worth waiting for; a bad header stays bad.
    if (!absl::IsUnavailable(s)) return s;
    if (Clock::now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "the host did not publish READY within ",
          options.attach_timeout.count(), " ms (is tmemd serving this VM?)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool TmemGuest::HostChanged() const {
  return region_.LoadHostState() != TMEM_HOST_STATE_READY ||
         region_.LoadHostGeneration() != host_generation_;
}

bool TmemGuest::EnsureAttached() {
  if (attached_) {
    if (!HostChanged()) return !broken_;
    Detach();
  }
  if (region_.LoadHostState() != TMEM_HOST_STATE_READY) return false;
  absl::Status s = Attach();
  if (!s.ok() && !absl::IsUnavailable(s)) ++counters_.errors;
  return s.ok();
}

absl::Status TmemGuest::Attach() {
  absl::StatusOr<RegionGeometry> g = region_.ReadGeometry();
  if (!g.ok()) return g.status();
  const bool same_rings = have_rings_ &&
                          g->host_generation == rings_generation_ &&
                          g->sq_entries == region_.geometry().sq_entries &&
                          g->cq_entries == region_.geometry().cq_entries &&
                          g->slot_count == region_.geometry().slot_count;
  if (same_rings && broken_) {
    // The host has not reset the rings whose indices it corrupted.
    return absl::UnavailableError("waiting for the host to reset the ring");
  }
  if (!same_rings) {
    // New rings (first attach, or the host re-initialized the region): the
    // host executes none of our old entries any more, so every slot and
    // tag is free again.
    region_.Bind(*g);
    const uint32_t capacity = static_cast<uint32_t>(std::min<uint64_t>(
        uint64_t{g->sq_entries} + g->cq_entries, kMaxPending));
    pending_.assign(capacity, Pending{});
    free_pending_.clear();
    for (uint32_t i = capacity; i > 0; --i) free_pending_.push_back(i - 1);
    slots_usable_ = std::min(g->slot_count, capacity);
    free_slots_.clear();
    for (uint32_t i = slots_usable_; i > 0; --i) free_slots_.push_back(i - 1);
    reserve_ = options_.invalidate_reserve != 0
                   ? options_.invalidate_reserve
                   : std::max<uint32_t>(1, g->sq_entries / 8);
    reserve_ = std::min(reserve_, g->sq_entries - 1);
    doorbell_batch_ = options_.posted_doorbell_batch != 0
                          ? options_.posted_doorbell_batch
                          : std::max<uint32_t>(
                                1, std::min(g->sq_entries, slots_usable_) / 16);
    unrung_ = 0;
    // Adopt the SQ tail the host (re)wrote, repaired if it cannot be right
    // (a previous guest left garbage).
    sq_tail_ = region_.LoadSqTail();
    if (sq_tail_ - region_.LoadSqHead() > g->sq_entries) {
      sq_tail_ = region_.LoadSqHead();
      region_.PublishSqTail(sq_tail_);
    }
    // Completions already there belong to a previous guest: skip them. Ones
    // for its entries still in the SQ come later; a random serial start
    // keeps their tags from matching ours (a restarted guestsim starts
    // counting from scratch too).
    cq_head_ = region_.LoadCqTail();
    region_.PublishCqHead(cq_head_);
    next_serial_ = (NewGeneration(0) >> 32) | 1;
    flush_bits_ = 0;
    wanted_bits_ = 0;
    flush_seq_ = 0;
    wait_tag_ = 0;
    consecutive_timeouts_ = 0;
    stalled_until_ = {};
    have_rings_ = true;
    rings_generation_ = g->host_generation;
  }
  features_ = g->features_host & kFeaturesUnderstood;
  region_.StoreFeaturesGuest(features_);
  // A fresh generation on every attach: the host forgets whatever pools and
  // pages this VM had, so nothing from before can be stale now.
  guest_generation_ = NewGeneration(guest_generation_);
  region_.StoreGuestGeneration(guest_generation_);
  host_generation_ = g->host_generation;
  attached_ = true;
  broken_ = false;
  VoidPools(/*shared_lost_invalidates=*/false);
  return absl::OkStatus();
}

void TmemGuest::Detach() {
  attached_ = false;
  ++counters_.host_resets_seen;
  // The host may have discarded entries we posted (a reset zeroes the ring).
  VoidPools(/*shared_lost_invalidates=*/true);
  wanted_bits_ = 0;
}

void TmemGuest::VoidPools(bool shared_lost_invalidates) {
  ++epoch_;
  for (Pool& p : pools_) {
    if (p.state == PoolState::kUnused) continue;
    // Other members keep a shared pool (and the pages this VM put in it)
    // alive on the host. If our invalidates may have been lost with the
    // ring, wipe the pool when we join it again.
    if (shared_lost_invalidates && p.shared && p.state != PoolState::kNone) {
      p.inval_on_ready = true;
    }
    p.state = PoolState::kNone;
  }
}

void TmemGuest::GuestReset(uint64_t lost_bits) {
  // The last resort for an invalidate that cannot be queued or barriered:
  // a new guest_generation makes the host forget every pool and page of
  // this VM. In-flight entries and slots stay ours until their CQEs come.
  // A shared pool outlives this VM on the host, so one whose invalidate is
  // lost here is wiped when it is joined again.
  lost_bits |= wanted_bits_;
  for (Pool& p : pools_) {
    if (p.shared && p.state == PoolState::kReady &&
        ((lost_bits >> p.host_id) & 1) != 0) {
      p.inval_on_ready = true;
    }
  }
  guest_generation_ = NewGeneration(guest_generation_);
  region_.StoreGuestGeneration(guest_generation_);
  ++counters_.guest_resets;
  VoidPools(/*shared_lost_invalidates=*/false);
  wanted_bits_ = 0;
  MaybeDoorbell();
}

void TmemGuest::HostFault(const char* what) {
  // A reset rewrites the indices after publishing RESET (release), so an
  // index that looks corrupt during a reset shows up as a host change here.
  if (HostChanged()) {
    Detach();
    return;
  }
  (void)what;
  ++counters_.errors;
  broken_ = true;
  VoidPools(/*shared_lost_invalidates=*/true);
}

// ---------------------------------------------------------------------------
// Ring

bool TmemGuest::HaveRoom(Need need) {
  if (!attached_ || broken_ || free_pending_.empty()) return false;
  if ((need == Need::kPut || need == Need::kGet) && free_slots_.empty()) {
    return false;
  }
  const uint32_t entries = region_.geometry().sq_entries;
  const uint32_t used = sq_tail_ - region_.LoadSqHead();
  if (used > entries) {
    HostFault("sq_head");
    return false;
  }
  const uint32_t limit =
      need == Need::kInvalidate ? entries : entries - reserve_;
  return used < limit;
}

uint64_t TmemGuest::Post(tmem_sqe& sqe, uint32_t slot, PoolHandle pool) {
  const uint32_t index = free_pending_.back();
  free_pending_.pop_back();
  const uint64_t tag = (next_serial_++ << kTagIndexBits) | index;
  Pending& p = pending_[index];
  p.tag = tag;
  p.opcode = sqe.opcode;
  p.slot = slot;
  p.pool = pool;
  p.incarnation = pool >= 0 ? pools_[pool].incarnation : 0;
  p.epoch = epoch_;
  sqe.tag = tag;
  region_.WriteSqe(sq_tail_, sqe);
  // A host reset rewrites sq_tail (a guest-owned index) to zero; storing our
  // old-based tail over that would look like a corrupt ring and cost a
  // second reset. Re-checking narrows that window to a few instructions;
  // the host resets again for what is left. Unpublished, the entry is
  // nobody's: free it (the op then simply did not happen).
  if (HostChanged()) {
    p.tag = 0;
    free_pending_.push_back(index);
    if (slot != kNoSlot) free_slots_.push_back(slot);
    return 0;
  }
  ++sq_tail_;
  region_.PublishSqTail(sq_tail_);
  ++counters_.sqes_posted;
  ++unrung_;
  const bool waited_on =
      (sqe.flags & TMEM_SQE_F_IRQ) != 0 ||
      (sqe.opcode != TMEM_OP_PUT && sqe.opcode != TMEM_OP_INVAL_PAGE &&
       sqe.opcode != TMEM_OP_INVAL_OBJECT && sqe.opcode != TMEM_OP_INVAL_POOL);
  if (waited_on || unrung_ >= doorbell_batch_) {
    MaybeDoorbell();
  } else {
    // Only the counter and unrung_ depend on this read: a stale value at
    // most delays a doorbell by a batch, which the host's re-check timer
    // bounds, so it needs no Dekker fence.
    if ((region_.LoadHostFlags() & TMEM_HOST_NEEDS_DOORBELL) != 0) {
      ++counters_.doorbells_deferred;
    } else {
      unrung_ = 0;  // the host is polling: it sees them
    }
  }
  return tag;
}

void TmemGuest::MaybeDoorbell() {
  GuestRegion::FenceBeforeDoorbellCheck();
  if ((region_.LoadHostFlags() & TMEM_HOST_NEEDS_DOORBELL) != 0) {
    device_->Doorbell(TMEM_VEC_SUBMIT);
    ++counters_.doorbells;
  }
  unrung_ = 0;
}

void TmemGuest::Reap() {
  if (!attached_ || broken_) return;
  const uint32_t tail = region_.LoadCqTail();
  if (tail - cq_head_ > region_.geometry().cq_entries) {
    HostFault("cq_tail");
    return;
  }
  if (tail != cq_head_) {
    while (cq_head_ != tail) {
      const tmem_cqe cqe = region_.ReadCqe(cq_head_);
      ++cq_head_;
      Complete(cqe);
    }
    // As in Post: never write an old-based index over a reset's zero.
    if (HostChanged()) return;
    region_.PublishCqHead(cq_head_);
  }
  if (flush_bits_ != 0 && region_.LoadFlushDoneSeq() == flush_seq_) {
    region_.ClearFlushRequest();  // acked: see CheckFlushDone
    flush_bits_ = 0;
  }
  FlushWanted();
}

void TmemGuest::Complete(const tmem_cqe& cqe) {
  const uint64_t index = cqe.tag & kTagIndexMask;
  if (cqe.tag == 0 || index >= pending_.size() ||
      pending_[index].tag != cqe.tag) {
    ++counters_.stale_completions;
    return;
  }
  ++counters_.completions_reaped;
  const Pending p = pending_[index];
  pending_[index].tag = 0;
  free_pending_.push_back(static_cast<uint32_t>(index));
  const int32_t status = cqe.status;
  const uint32_t result = cqe.result;

  switch (p.opcode) {
    case TMEM_OP_PUT:
      // The host copied the page out before completing: the slot is free.
      free_slots_.push_back(p.slot);
      if (status == TMEM_ERR_DROPPED) {
        ++counters_.puts_dropped_by_host;
      } else if (status != TMEM_OK) {
        OpFailed(p, status);
      }
      break;
    case TMEM_OP_GET: {
      const bool hit = status == TMEM_OK && result == 1;
      if (status == TMEM_OK && result > 1) ++counters_.errors;
      if (wait_tag_ != 0 && cqe.tag == wait_tag_) {
        if (hit) {
          region_.CopyFromSlot(p.slot,
                               wait_out_);  // before the slot is freed
        }
        wait_hit_ = hit;
        wait_done_ = true;
      }
      // A timed-out Get's page is simply not delivered.
      free_slots_.push_back(p.slot);
      if (status != TMEM_OK) OpFailed(p, status);
      break;
    }
    case TMEM_OP_NEW_POOL: {
      Pool& pool = pools_[p.pool];
      // Voided (reset) or superseded since it was posted: ignore.
      if (pool.state != PoolState::kCreating || pool.create_tag != cqe.tag) {
        break;
      }
      if (status == TMEM_OK && result < TMEM_MAX_POOLS) {
        pool.state = PoolState::kReady;
        pool.host_id = static_cast<uint16_t>(result);
        pool.incarnation = next_incarnation_++;
        // A private pool is born empty.
        std::fill(pool.sent.begin(), pool.sent.end(), 0);
        ++counters_.pools_created;
      } else {
        pool.state = PoolState::kFailed;
        pool.refusal = status == TMEM_OK ? TMEM_ERR_INVAL : status;
        pool.retry_after = Clock::now() + options_.pool_retry_interval;
        ++counters_.errors;
      }
      break;
    }
    default:
      if (status != TMEM_OK) OpFailed(p, status);
      break;
  }
}

void TmemGuest::OpFailed(const Pending& p, int32_t status) {
  // Entries from before a guest reset may name pools the host forgot.
  if (p.epoch != epoch_) return;
  ++counters_.errors;
  if (status == TMEM_ERR_NOENT && p.pool >= 0) {
    // The host forgot this pool (and its pages): make it again on next use.
    Pool& pool = pools_[p.pool];
    if (pool.state == PoolState::kReady && pool.incarnation == p.incarnation) {
      pool.state = PoolState::kNone;
    }
  }
}

TmemGuest::WaitResult TmemGuest::WaitUntil(const std::function<bool()>& done,
                                           Clock::time_point deadline) {
  const Clock::time_point spin_until = Clock::now() + options_.get_spin;
  for (;;) {
    Reap();
    if (done()) return WaitResult::kDone;
    if (!attached_ || broken_ || HostChanged()) return WaitResult::kLost;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return WaitResult::kTimeout;
    if (now < spin_until) {
      CpuRelax();
      continue;
    }
    const auto slice = std::min<Clock::duration>(deadline - now, kWaitSlice);
    const int fd = device_->interrupt_fd(TMEM_VEC_COMPLETE);
    if (fd < 0) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(slice, std::chrono::microseconds(50)));
      continue;
    }
    ++counters_.interrupt_waits;
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    timespec ts{static_cast<time_t>(ns / 1'000'000'000),
                static_cast<long>(ns % 1'000'000'000)};
    pollfd pfd{fd, POLLIN, 0};
    if (ppoll(&pfd, 1, &ts, nullptr) > 0 && (pfd.revents & POLLIN) != 0) {
      uint64_t count;
      // Clears the eventfd (non-blocking: EAGAIN if someone else did).
      (void)!read(fd, &count, sizeof(count));
    }
  }
}

// ---------------------------------------------------------------------------
// Pools

absl::StatusOr<TmemGuest::PoolHandle> TmemGuest::InitFs() {
  return NewHandle(/*shared=*/false, Uuid{});
}

absl::StatusOr<TmemGuest::PoolHandle> TmemGuest::InitSharedFs(
    const Uuid& uuid) {
  return NewHandle(/*shared=*/true, uuid);
}

absl::StatusOr<TmemGuest::PoolHandle> TmemGuest::NewHandle(bool shared,
                                                           const Uuid& uuid) {
  PoolHandle h = -1;
  for (PoolHandle i = 0; i < static_cast<PoolHandle>(pools_.size()); ++i) {
    if (pools_[i].state == PoolState::kUnused) {
      h = i;
      break;
    }
  }
  if (h < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a guest has at most ", TMEM_MAX_POOLS, " pools (TMEM_MAX_POOLS)"));
  }
  Pool& p = pools_[h];
  p = Pool{};
  p.state = PoolState::kNone;
  p.shared = shared;
  p.uuid = uuid;
  // Shared pools get none: other VMs' puts of a key are invisible to us.
  if (!shared && options_.sent_filter_bits >= 64 &&
      std::has_single_bit(options_.sent_filter_bits)) {
    p.sent.assign(options_.sent_filter_bits / 64, 0);
  }
  if (!EnsureAttached()) return h;  // made on first use
  if (shared && (features_ & TMEM_FEAT_SHARED_POOLS) == 0) {
    p.state = PoolState::kUnused;
    return absl::FailedPreconditionError(
        "the host does not offer shared pools (TMEM_FEAT_SHARED_POOLS)");
  }
  StartCreate(h);
  if (p.state == PoolState::kCreating) {
    const Clock::time_point deadline =
        Clock::now() + options_.pool_create_timeout;
    WaitUntil([&p] { return p.state != PoolState::kCreating; }, deadline);
  }
  if (p.state == PoolState::kFailed) {
    absl::Status s = RefusalStatus(p.refusal, shared);
    p.state = PoolState::kUnused;
    return s;
  }
  return h;
}

void TmemGuest::StartCreate(PoolHandle h) {
  Pool& p = pools_[h];
  if (p.shared && (features_ & TMEM_FEAT_SHARED_POOLS) == 0) {
    p.state = PoolState::kFailed;
    p.refusal = TMEM_ERR_PERM;
    p.retry_after = Clock::now() + options_.pool_retry_interval;
    return;
  }
  if (!HaveRoom(Need::kControl)) {
    Reap();
    if (!HaveRoom(Need::kControl)) return;  // next use tries again
  }
  tmem_sqe sqe{};
  sqe.opcode = TMEM_OP_NEW_POOL;
  // IRQ: InitFs may be waiting for it.
  sqe.flags = TMEM_SQE_F_IRQ | (p.shared ? TMEM_SQE_F_SHARED : 0);
  if (p.shared) {
    static_assert(sizeof(sqe.oid) >= sizeof(Uuid));
    std::memcpy(sqe.oid, p.uuid.data(), p.uuid.size());
  }
  const uint64_t tag = Post(sqe, kNoSlot, h);
  if (tag == 0) return;  // the host reset meanwhile
  p.state = PoolState::kCreating;
  p.create_tag = tag;
}

int TmemGuest::Resolve(PoolHandle h, bool create) {
  if (h < 0 || h >= static_cast<PoolHandle>(pools_.size()) ||
      pools_[h].state == PoolState::kUnused) {
    ++counters_.errors;  // a caller bug: no such handle
    return -1;
  }
  Pool& p = pools_[h];
  switch (p.state) {
    case PoolState::kReady:
      if (p.inval_on_ready) {
        p.inval_on_ready = false;
        IssueInvalidate(TMEM_OP_INVAL_POOL, h, p.host_id, nullptr, 0);
        // A reap in there may have voided the pool again.
        if (p.state != PoolState::kReady) return -1;
      }
      return p.host_id;
    case PoolState::kNone:
      if (create) StartCreate(h);
      return -1;
    case PoolState::kFailed:
      if (create && Clock::now() >= p.retry_after) StartCreate(h);
      return -1;
    case PoolState::kCreating:
    case PoolState::kUnused:
      break;
  }
  return -1;
}

int TmemGuest::host_pool_id(PoolHandle h) const {
  if (h < 0 || h >= static_cast<PoolHandle>(pools_.size()) ||
      pools_[h].state != PoolState::kReady || !attached()) {
    return -1;
  }
  return pools_[h].host_id;
}

// ---------------------------------------------------------------------------
// Flush barrier and invalidates

bool TmemGuest::Flagged(int host_id) const {
  return (((flush_bits_ | wanted_bits_) >> host_id) & 1) != 0;
}

void TmemGuest::CheckFlushDone() {
  if (flush_bits_ != 0 && region_.LoadFlushDoneSeq() == flush_seq_) {
    // The host read our bits after the seq (see RequestFlush) and flushed
    // them; it ignores the bits until the seq moves again.
    region_.ClearFlushRequest();
    flush_bits_ = 0;
  }
  // Pools waiting for the next barrier: Reap() issues their flush, right
  // after it made room.
  if (flush_bits_ == 0 && wanted_bits_ != 0) Reap();
}

void TmemGuest::FlushWanted() {
  if (flush_bits_ != 0 || wanted_bits_ == 0 || !attached_ || broken_) return;
  // Pools that needed a flush while one was pending. Each gets an
  // INVAL_POOL now, or, with the ring still full, one new barrier. Called
  // just after a reap, so no room means a full SQ: the tail is a whole ring
  // ahead of the head, which is at or past the done seq, so the new seq
  // differs from it.
  uint64_t bits = wanted_bits_;
  wanted_bits_ = 0;
  while (bits != 0) {
    const int id = std::countr_zero(bits);
    if (!HaveRoom(Need::kInvalidate)) {
      // A fault or reset in there voided everything; else barrier the rest.
      if (attached_ && !broken_) RequestFlush(bits);
      return;
    }
    tmem_sqe sqe{};
    sqe.opcode = TMEM_OP_INVAL_POOL;
    sqe.pool = static_cast<uint16_t>(id);
    Post(sqe, kNoSlot, -1);
    bits &= bits - 1;
  }
}

void TmemGuest::RequestFlush(uint64_t bits) {
  if ((features_ & TMEM_FEAT_FLUSH_BARRIER) == 0) {
    GuestReset(bits);
    return;
  }
  // Flagged from now on: nothing of these pools is posted until a barrier
  // or INVAL_POOL that comes first in ring order has wiped them.
  ForgetSent(bits);
  if (flush_bits_ != 0) {
    // One barrier at a time: the host acknowledges a seq, not bits, so bits
    // added to a barrier the host may be completing right now could be
    // acknowledged without having been flushed. Until the pending one is
    // done these pools are flagged (gets miss, puts drop), which is all the
    // invalidate needs meanwhile.
    wanted_bits_ |= bits;
    return;
  }
  const uint64_t seq = sq_tail_;
  if (seq == region_.LoadFlushDoneSeq()) {
    // The host would take this request as already done. Cannot happen with
    // a full ring (see FlushWanted); never risk a lost invalidate.
    GuestReset(bits);
    return;
  }
  region_.RequestFlush(bits, seq);
  flush_bits_ = bits;
  flush_seq_ = seq;
  MaybeDoorbell();
}

void TmemGuest::IssueInvalidate(uint8_t opcode, PoolHandle h, int host_id,
                                const ObjectId* oid, uint64_t index) {
  if (Flagged(host_id)) return;  // the pending flush covers it
  if (!HaveRoom(Need::kInvalidate)) {
    Reap();
    // A reset or fault in the reap voided everything anyway: the host drops
    // this VM's pages before it serves anything again.
    if (!attached_ || broken_ || Flagged(host_id)) return;
    if (!HaveRoom(Need::kInvalidate)) {
      ++counters_.flush_fallbacks;
      RequestFlush(uint64_t{1} << host_id);
      return;
    }
  }
  tmem_sqe sqe{};
  sqe.opcode = opcode;
  sqe.pool = static_cast<uint16_t>(host_id);
  sqe.index = index;
  if (oid != nullptr) std::memcpy(sqe.oid, oid->data(), sizeof(sqe.oid));
  Post(sqe, kNoSlot, h);
  if (opcode == TMEM_OP_INVAL_POOL) ForgetSent(uint64_t{1} << host_id);
}

void TmemGuest::ForgetSent(uint64_t host_id_bits) {
  for (Pool& p : pools_) {
    if (p.state == PoolState::kReady && ((host_id_bits >> p.host_id) & 1)) {
      std::fill(p.sent.begin(), p.sent.end(), 0);
    }
  }
}

void TmemGuest::DropPut(PoolHandle h, int host_id, const ObjectId& oid,
                        uint64_t index) {
  if (!MaybeSent(pools_[h].sent, KeyHash(oid, index))) {
    ++counters_.drop_invalidates_avoided;
    return;
  }
  ++counters_.invalidates_for_dropped_puts;
  IssueInvalidate(TMEM_OP_INVAL_PAGE, h, host_id, &oid, index);
}

void TmemGuest::Invalidate(uint8_t opcode, PoolHandle h, const ObjectId* oid,
                           uint64_t index) {
  ++counters_.invalidates;
  // Channel down: the next attach writes a new guest generation, and the
  // host drops this VM's pages when it sees it.
  if (!EnsureAttached()) {
    if (h >= 0 && h < static_cast<PoolHandle>(pools_.size()) &&
        pools_[h].shared) {
      pools_[h].inval_on_ready = true;
    }
    return;
  }
  const int id = Resolve(h, /*create=*/false);
  if (id < 0) {
    // Not on the host in this generation, so it holds none of our pages;
    // but a shared pool may hold other VMs' pages for this key.
    if (h >= 0 && h < static_cast<PoolHandle>(pools_.size()) &&
        pools_[h].shared) {
      pools_[h].inval_on_ready = true;
    }
    return;
  }
  CheckFlushDone();
  IssueInvalidate(opcode, h, id, oid, index);
}

void TmemGuest::InvalidatePage(PoolHandle pool, const ObjectId& oid,
                               uint64_t index) {
  Invalidate(TMEM_OP_INVAL_PAGE, pool, &oid, index);
}

void TmemGuest::InvalidateObject(PoolHandle pool, const ObjectId& oid) {
  Invalidate(TMEM_OP_INVAL_OBJECT, pool, &oid, 0);
}

void TmemGuest::InvalidatePool(PoolHandle pool) {
  Invalidate(TMEM_OP_INVAL_POOL, pool, nullptr, 0);
}

// ---------------------------------------------------------------------------
// Put / Get

bool TmemGuest::Admit() {
  if ((features_ & TMEM_FEAT_ADMISSION_HINT) == 0) return true;
  const uint32_t hint = std::min(region_.LoadAdmissionHint(), TMEM_ADMIT_ALL);
  if (hint == TMEM_ADMIT_ALL) return true;
  // Bresenham: exactly `hint` of every TMEM_ADMIT_ALL puts go out, evenly
  // spread, the same on every run.
  hint_credit_ += hint;
  if (hint_credit_ >= TMEM_ADMIT_ALL) {
    hint_credit_ -= TMEM_ADMIT_ALL;
    return true;
  }
  return false;
}

void TmemGuest::Put(PoolHandle h, const ObjectId& oid, uint64_t index,
                    Page page) {
  if (!EnsureAttached()) {
    ++counters_.puts_dropped_no_pool;
    return;
  }
  // Nobody waits for a put's CQE, but the host stops consuming when the CQ
  // is full: reap once half of it may be in use, so the host never idles
  // waiting for us (one load when there is nothing to reap).
  if (in_flight() >= region_.geometry().cq_entries / 2) Reap();
  int id = Resolve(h, /*create=*/true);
  if (id < 0 && h >= 0 && h < static_cast<PoolHandle>(pools_.size()) &&
      pools_[h].state == PoolState::kCreating) {
    Reap();  // its NEW_POOL may have completed already
    id = Resolve(h, /*create=*/false);
  }
  if (id < 0) {
    ++counters_.puts_dropped_no_pool;
    return;
  }
  CheckFlushDone();
  if (Flagged(id)) {
    // The barrier will drop the pool's pages, older versions of this key
    // included: nothing else to do.
    ++counters_.puts_dropped_flush_pending;
    return;
  }
  // An unsent put must still kill the key's older page (put-put-get
  // coherency); the INVAL_PAGE costs a ring entry, not a page copy.
  if (!Admit()) {
    ++counters_.puts_skipped_by_hint;
    DropPut(h, id, oid, index);
    return;
  }
  if (!HaveRoom(Need::kPut)) {
    Reap();
    id = Resolve(h, /*create=*/false);
    if (id < 0 || !HaveRoom(Need::kPut) || Flagged(id)) {
      ++counters_.puts_dropped_ring_full;
      if (id >= 0) DropPut(h, id, oid, index);
      return;
    }
  }
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  region_.CopyToSlot(slot, page.data());
  tmem_sqe sqe{};
  sqe.opcode = TMEM_OP_PUT;  // no IRQ: nobody waits for a put
  sqe.pool = static_cast<uint16_t>(id);
  sqe.slot = slot;
  sqe.index = index;
  std::memcpy(sqe.oid, oid.data(), sizeof(sqe.oid));
  if (Post(sqe, slot, h) == 0) {
    ++counters_.puts_dropped_no_pool;  // the host reset meanwhile
    return;
  }
  MarkSent(pools_[h].sent, KeyHash(oid, index));
  ++counters_.puts_sent;
}

bool TmemGuest::Get(PoolHandle h, const ObjectId& oid, uint64_t index,
                    MutablePage out) {
  const auto miss_local = [this] {
    ++counters_.gets_miss;
    ++counters_.gets_miss_local;
    return false;
  };
  if (!EnsureAttached()) return miss_local();
  Reap();  // frees slots, completes barriers and pool creations
  if (stalled_until_ != Clock::time_point{} && Clock::now() < stalled_until_) {
    if (region_.LoadSqHead() == stall_sq_head_) {
      ++counters_.gets_skipped_stalled;
      return miss_local();
    }
    stalled_until_ = {};  // the host moved: it is back
    consecutive_timeouts_ = 0;
  }
  // A key this guest never sent cannot be there (private pools keep the
  // filter; it has no false negatives): miss without a round trip, so a
  // streaming reader's page-cache misses never wait on the host.
  if (options_.skip_unsent_gets && h >= 0 &&
      static_cast<size_t>(h) < pools_.size() &&
      !MaybeSent(pools_[h].sent, KeyHash(oid, index))) {
    ++counters_.gets_skipped_never_sent;
    return miss_local();
  }
  const int id = Resolve(h, /*create=*/true);
  if (id < 0 || Flagged(id)) return miss_local();
  if (!HaveRoom(Need::kGet)) return miss_local();

  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  tmem_sqe sqe{};
  sqe.opcode = TMEM_OP_GET;
  sqe.flags = TMEM_SQE_F_IRQ;
  sqe.pool = static_cast<uint16_t>(id);
  sqe.slot = slot;
  sqe.index = index;
  std::memcpy(sqe.oid, oid.data(), sizeof(sqe.oid));
  wait_tag_ = Post(sqe, slot, h);
  wait_out_ = out.data();
  wait_done_ = false;
  wait_hit_ = false;
  const WaitResult r = WaitUntil([this] { return wait_done_; },
                                 Clock::now() + options_.get_timeout);
  wait_tag_ = 0;
  wait_out_ = nullptr;
  if (r == WaitResult::kTimeout) {
    NoteGetTimeout();
  } else {
    consecutive_timeouts_ = 0;
  }
  if (r == WaitResult::kDone && wait_hit_) {
    ++counters_.gets_hit;
    return true;
  }
  ++counters_.gets_miss;
  if (r == WaitResult::kTimeout) ++counters_.gets_timeout;
  if (r == WaitResult::kLost) ++counters_.gets_miss_local;
  return false;
}

void TmemGuest::NoteGetTimeout() {
  const uint32_t limit = options_.stall_after_timeouts;
  if (limit == 0) return;
  const uint32_t head = region_.LoadSqHead();
  // Timeouts while the host keeps consuming mean a slow host, not a dead
  // one: only a run of them without progress counts.
  if (consecutive_timeouts_ > 0 && head != stall_sq_head_) {
    consecutive_timeouts_ = 0;
  }
  stall_sq_head_ = head;
  if (++consecutive_timeouts_ < limit) return;
  if (consecutive_timeouts_ == limit) ++counters_.host_stalls;
  stalled_until_ = Clock::now() + options_.stall_probe_interval;
}

void TmemGuest::Poll() {
  if (EnsureAttached()) Reap();
}

}  // namespace tmem
