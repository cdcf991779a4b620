#include "tests/guest/fake_host.h"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

namespace tmem::testing {
namespace {

template <typename T>
T LoadAcquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void StoreRelease(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
template <typename T>
void StoreRelaxed(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

[[noreturn]] void Die(const char* what) {
  perror(what);
  std::abort();
}

}  // namespace

FakeHost::FakeHost(const FakeHostOptions& options)
    : options_(options), generation_(options.host_generation) {
  fd_ = memfd_create("fake-tmem", MFD_CLOEXEC);
  if (fd_ < 0) Die("memfd_create");
  if (ftruncate(fd_, static_cast<off_t>(options_.region_bytes)) != 0) {
    Die("ftruncate");
  }
  void* base = mmap(nullptr, options_.region_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED, fd_, 0);
  if (base == MAP_FAILED) Die("mmap");
  base_ = static_cast<uint8_t*>(base);
  interrupt_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (interrupt_fd_ < 0) Die("eventfd");
  sq_offset_ = TMEM_PAGE_SIZE;
  cq_offset_ = sq_offset_ + options_.sq_entries * sizeof(tmem_sqe);
  const uint32_t rings_end =
      cq_offset_ + options_.cq_entries * sizeof(tmem_cqe);
  slots_offset_ =
      (rings_end + TMEM_PAGE_SIZE - 1) / TMEM_PAGE_SIZE * TMEM_PAGE_SIZE;
  if (slots_offset_ + uint64_t{options_.slot_count} * TMEM_PAGE_SIZE >
      options_.region_bytes) {
    std::fprintf(stderr, "FakeHost: slots do not fit the region\n");
    std::abort();
  }
  WriteHeader();
  if (options_.publish_ready) SetState(TMEM_HOST_STATE_READY);
}

FakeHost::~FakeHost() {
  Stop();
  munmap(base_, options_.region_bytes);
  close(fd_);
  close(interrupt_fd_);
}

void FakeHost::WriteHeader() {
  tmem_shm_header* h = header();
  StoreRelaxed(&h->magic, TMEM_ABI_MAGIC);
  StoreRelaxed(&h->version, TMEM_ABI_VERSION);
  StoreRelaxed(&h->features_host, options_.features);
  StoreRelaxed(&h->header_size, static_cast<tmem_u32>(sizeof(tmem_shm_header)));
  StoreRelaxed(&h->region_size, tmem_u64{options_.region_bytes});
  StoreRelaxed(&h->sq_offset, sq_offset_);
  StoreRelaxed(&h->sq_entries, options_.sq_entries);
  StoreRelaxed(&h->cq_offset, cq_offset_);
  StoreRelaxed(&h->cq_entries, options_.cq_entries);
  StoreRelaxed(&h->slots_offset, slots_offset_);
  StoreRelaxed(&h->slot_count, options_.slot_count);
  StoreRelaxed(&h->host_generation, tmem_u64{generation_});
  StoreRelaxed(&h->host_peer_id, options_.host_peer_id);
  StoreRelaxed(&h->host_flags,
               options_.needs_doorbell ? TMEM_HOST_NEEDS_DOORBELL : 0u);
  StoreRelaxed(&h->admission_hint, TMEM_ADMIT_ALL);
  StoreRelaxed(&h->flush_done_seq, tmem_u64{0});
  StoreRelaxed(&h->flush_request, tmem_u64{0});
  StoreRelaxed(&h->flush_request_seq, tmem_u64{0});
  StoreRelaxed(&h->sq_head.value, 0u);
  StoreRelaxed(&h->sq_tail.value, 0u);
  StoreRelaxed(&h->cq_head.value, 0u);
  StoreRelaxed(&h->cq_tail.value, 0u);
}

void FakeHost::SetState(uint32_t state) {
  StoreRelease(&header()->host_state, state);
}

void FakeHost::SetNeedsDoorbell(bool needs) {
  StoreRelease(&header()->host_flags, needs ? TMEM_HOST_NEEDS_DOORBELL : 0u);
}

void FakeHost::SetAdmissionHint(uint32_t hint) {
  StoreRelease(&header()->admission_hint, hint);
}

void FakeHost::Reset() {
  std::lock_guard<std::mutex> lock(step_mu_);
  SetState(TMEM_HOST_STATE_RESET);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  ++generation_;
  WriteHeader();
  DropAll();
  sq_head_ = 0;
  cq_tail_ = 0;
  flush_done_ = 0;
  guest_generation_ = 0;
  SetState(TMEM_HOST_STATE_READY);
}

void FakeHost::DropAll() {
  pools_.reset();
  shared_.reset();
  shared_by_uuid_.clear();
  pages_.clear();
}

void FakeHost::DoorbellPeer(uint32_t peer, int vector) {
  if (peer != options_.host_peer_id) {
    ++wrong_peer_doorbells_;
    return;
  }
  Doorbell(vector);
}

void FakeHost::Doorbell(int vector) {
  ++doorbells_;
  if (vector != 0 || running_.load() || paused.load()) return;
  Step();
}

const tmem_sqe& FakeHost::sqe_at(uint32_t index) const {
  return reinterpret_cast<const tmem_sqe*>(
      base_ + sq_offset_)[index & (options_.sq_entries - 1)];
}

bool FakeHost::HasPage(uint16_t pool, const std::array<uint32_t, 6>& oid,
                       uint64_t index) const {
  return pages_.count(Key{pool, oid, index}) != 0;
}

void FakeHost::ApplyFlushIfReached() {
  tmem_shm_header* h = header();
  const uint64_t seq = LoadAcquire(&h->flush_request_seq);
  if (seq == flush_done_ ||
      static_cast<int32_t>(sq_head_ - static_cast<uint32_t>(seq)) < 0) {
    return;
  }
  // Bits after the seq: the guest ORs them in before releasing the seq.
  const uint64_t bits = LoadAcquire(&h->flush_request);
  for (auto it = pages_.begin(); it != pages_.end();) {
    const uint16_t pool = std::get<0>(it->first);
    if (pool < TMEM_MAX_POOLS && ((bits >> pool) & 1) != 0) {
      it = pages_.erase(it);
    } else {
      ++it;
    }
  }
  flush_done_ = seq;
  ++flushes_applied_;
  StoreRelease(&h->flush_done_seq, seq);
}

uint32_t FakeHost::Step(uint32_t max) {
  std::lock_guard<std::mutex> lock(step_mu_);
  tmem_shm_header* h = header();
  if (LoadAcquire(&h->host_state) != TMEM_HOST_STATE_READY) return 0;
  const uint32_t tail = LoadAcquire(&h->sq_tail.value);
  const uint32_t cq_head = LoadAcquire(&h->cq_head.value);
  const uint64_t gen = LoadAcquire(&h->guest_generation);
  if (gen != guest_generation_) {
    if (guest_generation_ != 0) {
      ++generation_changes_;
      DropAll();
    }
    guest_generation_ = gen;
  }
  uint32_t done = 0;
  bool irq = false;
  while (sq_head_ != tail && done < max &&
         cq_tail_ - cq_head < options_.cq_entries) {
    ApplyFlushIfReached();
    tmem_sqe sqe{};
    std::memcpy(&sqe, &sqe_at(sq_head_), sizeof(sqe));
    const tmem_cqe cqe = Execute(sqe);
    if ((sqe.flags & TMEM_SQE_F_IRQ) != 0) irq = true;
    std::memcpy(base_ + cq_offset_ +
                    (cq_tail_ & (options_.cq_entries - 1)) * sizeof(tmem_cqe),
                &cqe, sizeof(cqe));
    ++cq_tail_;
    StoreRelease(&h->cq_tail.value, cq_tail_);
    ++sq_head_;
    StoreRelease(&h->sq_head.value, sq_head_);
    ++done;
  }
  ApplyFlushIfReached();
  if (irq) {
    const uint64_t one = 1;
    (void)!write(interrupt_fd_, &one, sizeof(one));
  }
  return done;
}

tmem_cqe FakeHost::Execute(const tmem_sqe& sqe) {
  tmem_cqe cqe{sqe.tag, TMEM_OK, 0};
  if (sqe.opcode >= TMEM_OP_MAX) {
    cqe.status = TMEM_ERR_INVAL;
    return cqe;
  }
  ++op_counts_[sqe.opcode];
  std::array<uint32_t, 6> oid{};
  std::memcpy(oid.data(), sqe.oid, sizeof(oid));
  const bool uses_pool =
      sqe.opcode != TMEM_OP_NOP && sqe.opcode != TMEM_OP_NEW_POOL;
  if (uses_pool && (sqe.pool >= TMEM_MAX_POOLS || !pools_.test(sqe.pool))) {
    cqe.status = TMEM_ERR_NOENT;
    return cqe;
  }
  if ((sqe.opcode == TMEM_OP_PUT || sqe.opcode == TMEM_OP_GET) &&
      sqe.slot >= options_.slot_count) {
    cqe.status = TMEM_ERR_INVAL;
    return cqe;
  }
  if (sqe.opcode == TMEM_OP_GET_BATCH) {
    // Only when offered, on private pools, within the slots.
    if ((options_.features & TMEM_FEAT_GET_BATCH) == 0 ||
        shared_.test(sqe.pool) || sqe.count == 0 ||
        sqe.count > TMEM_GET_BATCH_MAX ||
        uint64_t{sqe.slot} + sqe.count > options_.slot_count) {
      cqe.status = TMEM_ERR_INVAL;
      return cqe;
    }
    for (uint32_t k = 0; k < sqe.count; ++k) {
      auto it = pages_.find(Key{sqe.pool, oid, sqe.index + k});
      if (it == pages_.end()) continue;
      std::memcpy(Slot(sqe.slot + k), it->second.data(), TMEM_PAGE_SIZE);
      pages_.erase(it);  // exclusive, as a single GET
      cqe.result |= 1u << k;
    }
    batch_pages_.fetch_add(sqe.count);
    return cqe;
  }
  const Key key{sqe.pool, oid, sqe.index};
  switch (sqe.opcode) {
    case TMEM_OP_NEW_POOL: {
      if (refuse_pools.load()) {
        cqe.status = TMEM_ERR_PERM;
        return cqe;
      }
      const bool shared = (sqe.flags & TMEM_SQE_F_SHARED) != 0;
      std::array<uint8_t, 16> uuid{};
      std::memcpy(uuid.data(), sqe.oid, uuid.size());
      if (shared) {
        auto it = shared_by_uuid_.find(uuid);
        if (it != shared_by_uuid_.end()) {
          cqe.result = it->second;
          return cqe;
        }
      }
      for (uint16_t id = 0; id < TMEM_MAX_POOLS; ++id) {
        if (pools_.test(id)) continue;
        pools_.set(id);
        if (shared) {
          shared_.set(id);
          shared_by_uuid_[uuid] = id;
        }
        cqe.result = id;
        return cqe;
      }
      cqe.status = TMEM_ERR_NOSPC;
      return cqe;
    }
    case TMEM_OP_PUT:
      if (drop_puts.load()) {
        pages_.erase(key);  // a refused put still kills the old page
        cqe.status = TMEM_ERR_DROPPED;
        return cqe;
      }
      if (keep_first_put.load() && pages_.count(key) != 0) return cqe;
      pages_[key].assign(Slot(sqe.slot), Slot(sqe.slot) + TMEM_PAGE_SIZE);
      return cqe;
    case TMEM_OP_GET: {
      auto it = pages_.find(key);
      if (it == pages_.end()) return cqe;
      std::memcpy(Slot(sqe.slot), it->second.data(), TMEM_PAGE_SIZE);
      cqe.result = 1;
      if (!shared_.test(sqe.pool)) pages_.erase(it);
      return cqe;
    }
    case TMEM_OP_INVAL_PAGE:
      if (ignore_invalidates.load()) return cqe;
      pages_.erase(key);
      return cqe;
    case TMEM_OP_INVAL_OBJECT:
    case TMEM_OP_INVAL_POOL:
      if (ignore_invalidates.load()) return cqe;
      for (auto it = pages_.begin(); it != pages_.end();) {
        const bool match =
            std::get<0>(it->first) == sqe.pool &&
            (sqe.opcode == TMEM_OP_INVAL_POOL || std::get<1>(it->first) == oid);
        it = match ? pages_.erase(it) : std::next(it);
      }
      return cqe;
    default:
      return cqe;
  }
}

void FakeHost::Start() {
  if (running_.exchange(true)) return;
  thread_ = std::thread([this] {
    while (running_.load()) {
      if (paused.load() || Step() == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  });
}

void FakeHost::Stop() {
  if (!running_.exchange(false)) return;
  thread_.join();
}

}  // namespace tmem::testing
