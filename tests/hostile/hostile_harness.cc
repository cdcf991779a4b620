#include "tests/hostile/hostile_harness.h"

#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/tmem_abi.h"

namespace tmem::hostile {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

namespace {

// A 64-bit mix (splitmix64's finalizer): page bytes and fill bytes from keys.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

TmemGuest::ObjectId WorkingObject(uint64_t key) {
  // 16 pages per object, like a small file.
  return {static_cast<uint32_t>(key / 16), 0x57u, 0, 0, 0, 0};
}
TmemGuest::ObjectId BulkObject(uint64_t i) {
  return {
      static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), 0xb0u, 0, 0, 0};
}

grpc::ClientContext* WithDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + milliseconds(5000));
  return ctx;
}

}  // namespace

// ---------------------------------------------------------------- Tmemd

absl::StatusOr<std::unique_ptr<Tmemd>> Tmemd::Start(const TmemdSpec& spec) {
  auto t = std::unique_ptr<Tmemd>(new Tmemd());
  t->dir_ = spec.dir;
  const std::string config = spec.dir + "/tmemd.toml";
  {
    std::ofstream out(config);
    out << "[store]\nmemory_cap = " << spec.memory_cap_bytes << "\n"
        << "[channels]\nsocket_dir = \"" << spec.dir << "/sock\"\n"
        << "[worker]\nworkers = " << spec.workers << "\n"
        << "[valve]\nmode = \"" << spec.valve_mode << "\"\n"
        << "[control]\nsocket = \"" << spec.dir << "/control.sock\"\n";
    for (const VmSpec& vm : spec.vms) {
      out << "[[vm]]\nname = \"" << vm.name << "\"\n";
      if (vm.quota_bytes != 0) out << "quota = " << vm.quota_bytes << "\n";
      out << "mode = \"" << vm.mode << "\"\n";
    }
    if (!out) return absl::InternalError("cannot write " + config);
  }
  t->process_ = std::make_unique<testing::Process>(
      std::vector<std::string>{spec.tmemd_bin, "--config", config,
                               "--no-fd-store"},
      spec.dir + "/tmemd.log");
  if (t->process_->pid() <= 0) {
    return absl::InternalError("cannot spawn " + spec.tmemd_bin);
  }
  std::vector<std::string> paths = {spec.dir + "/control.sock"};
  for (const VmSpec& vm : spec.vms) paths.push_back(t->Socket(vm.name));
  for (const std::string& p : paths) {
    if (!testing::WaitUntil([&] { return testing::PathExists(p); }, 20000)) {
      return absl::DeadlineExceededError(
          absl::StrCat("tmemd did not create ", p, "\n", t->Log()));
    }
  }
  t->stub_ = v1::TmemControl::NewStub(
      grpc::CreateChannel("unix:" + spec.dir + "/control.sock",
                          grpc::InsecureChannelCredentials()));
  return t;
}

Tmemd::~Tmemd() { Stop(); }

int Tmemd::Stop() {
  if (stopped_) return 0;
  stopped_ = true;
  return process_->Stop();
}

std::string Tmemd::Socket(const std::string& vm) const {
  return dir_ + "/sock/" + vm + ".sock";
}

bool Tmemd::Alive() const { return kill(process_->pid(), 0) == 0 && !stopped_; }

absl::StatusOr<v1::HostStatus> Tmemd::Status() const {
  grpc::ClientContext ctx;
  v1::HostStatus out;
  const grpc::Status s =
      stub_->Status(WithDeadline(&ctx), v1::StatusRequest(), &out);
  if (!s.ok()) return absl::UnavailableError("Status: " + s.error_message());
  return out;
}

absl::StatusOr<v1::VmDetail> Tmemd::GetVm(const std::string& vm) const {
  grpc::ClientContext ctx;
  v1::GetVmRequest req;
  req.set_vm(vm);
  v1::VmDetail out;
  const grpc::Status s = stub_->GetVm(WithDeadline(&ctx), req, &out);
  if (!s.ok()) return absl::UnavailableError("GetVm: " + s.error_message());
  return out;
}

int64_t CounterValue(
    const google::protobuf::RepeatedPtrField<v1::Counter>& counters,
    const std::string& name) {
  for (const v1::Counter& c : counters) {
    if (c.name() == name) return static_cast<int64_t>(c.value());
  }
  return -1;
}

// ---------------------------------------------------------------- pages

void FillWorkingPage(uint64_t key, uint64_t version, uint8_t* page) {
  // Eight words repeated per 64 bytes in the first half (LZ4 takes it),
  // fresh words in the second: about 2:1, like the corpus the valve sees.
  uint64_t words[TMEM_PAGE_SIZE / 8];
  const uint64_t seed = Mix(key * 0x100000001b3ull ^ Mix(version));
  for (size_t i = 0; i < std::size(words); ++i) {
    words[i] = i < std::size(words) / 2 ? Mix(seed + (i % 8)) : Mix(seed + i);
  }
  words[0] = key;
  words[1] = version;
  std::memcpy(page, words, TMEM_PAGE_SIZE);
}

uint8_t BulkByte(uint64_t i) {
  return static_cast<uint8_t>(Mix(i) | 1);  // never a zero page
}

// ---------------------------------------------------------------- guest

absl::StatusOr<std::unique_ptr<VerifiedGuest>> VerifiedGuest::Connect(
    const std::string& socket, const VerifiedGuestOptions& options) {
  auto g = std::unique_ptr<VerifiedGuest>(new VerifiedGuest());
  g->options_ = options;
  IvshmemClientOptions client_options;
  client_options.timeout = milliseconds(20000);
  absl::StatusOr<std::unique_ptr<IvshmemClient>> client =
      IvshmemClient::Connect(socket, client_options);
  if (!client.ok()) return client.status();
  g->client_ = std::move(*client);
  TmemGuestOptions guest_options;
  // Loaded 2-core machine under ASan: a slow host is a miss, never a stall.
  guest_options.attach_timeout = milliseconds(20000);
  guest_options.pool_create_timeout = milliseconds(20000);
  guest_options.get_timeout = std::chrono::microseconds(2'000'000);
  guest_options.get_batch_pages = 1;  // random reads: plain gets
  // Ring for every entry posted while the host sleeps: a guest that only
  // puts (the fill) would otherwise wait for the host's timer each ring.
  guest_options.posted_doorbell_batch = 1;
  absl::StatusOr<std::unique_ptr<TmemGuest>> guest =
      TmemGuest::Create(g->client_.get(), guest_options);
  if (!guest.ok()) return guest.status();
  g->guest_ = std::move(*guest);
  absl::StatusOr<TmemGuest::PoolHandle> working = g->guest_->InitFs();
  if (!working.ok()) return working.status();
  g->working_pool_ = *working;
  g->versions_.assign(options.working_pages, 0);
  return g;
}

VerifiedGuest::~VerifiedGuest() { Stop(); }

absl::Status VerifiedGuest::Fill(uint64_t objects) {
  absl::StatusOr<TmemGuest::PoolHandle> bulk = guest_->InitFs();
  if (!bulk.ok()) return bulk.status();
  bulk_pool_ = *bulk;
  alignas(64) uint8_t page[TMEM_PAGE_SIZE];
  const auto deadline = steady_clock::now() + std::chrono::minutes(4);
  // Never let a put find the ring full: an unsent put of a key the
  // sent-keys filter may have seen (1M keys saturate it) must invalidate
  // it, and with no ring room that is the pool's flush barrier, which wipes
  // the whole pool (correct, and fatal to a fill).
  const uint32_t max_in_flight =
      std::max<uint32_t>(1, std::min<uint32_t>(64, guest_->slots_usable() / 4));
  for (uint64_t i = 0; i < objects; ++i) {
    std::memset(page, BulkByte(i), sizeof(page));
    while (guest_->in_flight() >= max_in_flight) {
      guest_->Poll();
      if (guest_->in_flight() >= max_in_flight) std::this_thread::yield();
    }
    for (;;) {
      const uint64_t sent = guest_->counters().puts_sent;
      guest_->Put(bulk_pool_, BulkObject(i), 0, TmemGuest::Page(page));
      if (guest_->counters().puts_sent > sent) break;
      // Ring full: let the host catch up, then put the same key again.
      guest_->Poll();
      if (steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("filled ", i, " of ", objects, " objects"));
      }
      std::this_thread::yield();
    }
  }
  // Wait until the host completed every put, then check none was refused.
  while (guest_->in_flight() > 0 && steady_clock::now() < deadline) {
    guest_->Poll();
    std::this_thread::sleep_for(milliseconds(1));
  }
  const GuestCounters& c = guest_->counters();
  if (c.flush_fallbacks != 0) {
    return absl::InternalError(absl::StrCat(
        "the fill fell back to ", c.flush_fallbacks, " flush barriers"));
  }
  if (c.puts_dropped_by_host != 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        c.puts_dropped_by_host, " of ", objects, " bulk puts were not stored"));
  }
  bulk_objects_ = objects;
  return absl::OkStatus();
}

void VerifiedGuest::Start() {
  stop_.store(false);
  thread_ = std::thread([this] { Loop(); });
}

void VerifiedGuest::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::vector<std::string> VerifiedGuest::mismatch_log() const {
  std::lock_guard<std::mutex> lock(log_mu_);
  return mismatch_log_;
}

GuestCounters VerifiedGuest::counters() const {
  std::lock_guard<std::mutex> lock(log_mu_);
  return final_counters_;
}

bool VerifiedGuest::Verify(const char* what, uint64_t key, const uint8_t* got,
                           const uint8_t* want) {
  if (want != nullptr && std::memcmp(got, want, TMEM_PAGE_SIZE) == 0) {
    return true;
  }
  mismatches_.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(log_mu_);
  if (mismatch_log_.size() < 8) {
    uint64_t head[2];
    std::memcpy(head, got, sizeof(head));
    mismatch_log_.push_back(absl::StrCat(
        what, " key ", key,
        want == nullptr ? " hit although invalidated or already read"
                        : " bytes differ",
        " (page starts ", head[0], ",", head[1], ")"));
  }
  return false;
}

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kGetHit:
      return "get hit";
    case OpKind::kGetMiss:
      return "get miss";
    case OpKind::kPut:
      return "put";
    case OpKind::kInvalidate:
      return "invalidate";
  }
  return "?";
}

OpTimes OpTimes::operator-(const OpTimes& o) const {
  OpTimes d;
  for (int k = 0; k < kNumOpKinds; ++k) {
    d.count[k] = count[k] - o.count[k];
    d.ns[k] = ns[k] - o.ns[k];
  }
  return d;
}

OpTimes& OpTimes::operator+=(const OpTimes& o) {
  for (int k = 0; k < kNumOpKinds; ++k) {
    count[k] += o.count[k];
    ns[k] += o.ns[k];
  }
  return *this;
}

double OpTimes::MeanUs(OpKind kind) const {
  const auto k = static_cast<size_t>(kind);
  return count[k] == 0
             ? 0
             : static_cast<double>(ns[k]) / 1e3 / static_cast<double>(count[k]);
}

OpTimes VerifiedGuest::op_times() const {
  OpTimes t;
  for (int k = 0; k < kNumOpKinds; ++k) {
    t.count[k] = op_count_[k].load(std::memory_order_relaxed);
    t.ns[k] = op_ns_[k].load(std::memory_order_relaxed);
  }
  return t;
}

void VerifiedGuest::Count(OpKind kind,
                          std::chrono::steady_clock::time_point since) {
  const auto k = static_cast<size_t>(kind);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - since)
                      .count();
  op_ns_[k].fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  op_count_[k].fetch_add(1, std::memory_order_relaxed);
}

void VerifiedGuest::Loop() {
  using Clock = std::chrono::steady_clock;
  tid_.store(gettid(), std::memory_order_release);
  std::mt19937_64 rng(0x5eed);
  alignas(64) uint8_t got[TMEM_PAGE_SIZE];
  alignas(64) uint8_t want[TMEM_PAGE_SIZE];
  const uint32_t n = options_.working_pages;
  while (!stop_.load(std::memory_order_relaxed)) {
    const uint64_t r = rng();
    if (bulk_objects_ > 0 && options_.bulk_read_every > 0 &&
        r % options_.bulk_read_every == 0) {
      // Read a bulk object back; a hit is exclusive, so put it again.
      const uint64_t i = (r >> 8) % bulk_objects_;
      gets_.fetch_add(1, std::memory_order_relaxed);
      std::memset(want, BulkByte(i), sizeof(want));
      Clock::time_point t0 = Clock::now();
      const bool hit = guest_->Get(bulk_pool_, BulkObject(i), 0,
                                   TmemGuest::MutablePage(got));
      Count(hit ? OpKind::kGetHit : OpKind::kGetMiss, t0);
      if (hit) {
        bulk_hits_.fetch_add(1, std::memory_order_relaxed);
        Verify("bulk", i, got, want);
      }
      t0 = Clock::now();
      guest_->Put(bulk_pool_, BulkObject(i), 0, TmemGuest::Page(want));
      Count(OpKind::kPut, t0);
      ops_.fetch_add(2, std::memory_order_relaxed);
      continue;
    }
    const uint64_t key = (r >> 8) % n;
    if ((r & 0xf) == 1) {
      const Clock::time_point t0 = Clock::now();
      guest_->InvalidatePage(working_pool_, WorkingObject(key), key % 16);
      Count(OpKind::kInvalidate, t0);
      versions_[key] = 0;
      ops_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    gets_.fetch_add(1, std::memory_order_relaxed);
    Clock::time_point t0 = Clock::now();
    const bool hit = guest_->Get(working_pool_, WorkingObject(key), key % 16,
                                 TmemGuest::MutablePage(got));
    Count(hit ? OpKind::kGetHit : OpKind::kGetMiss, t0);
    if (hit) {
      hits_.fetch_add(1, std::memory_order_relaxed);
      if (versions_[key] == 0) {
        Verify("working", key, got, nullptr);
      } else {
        FillWorkingPage(key, versions_[key], want);
        Verify("working", key, got, want);
      }
    }
    // Exclusive get: after a hit the host holds nothing of the key; after
    // a miss it holds nothing either. Either way the next put is the truth.
    const uint64_t version = next_version_++;
    FillWorkingPage(key, version, want);
    t0 = Clock::now();
    guest_->Put(working_pool_, WorkingObject(key), key % 16,
                TmemGuest::Page(want));
    Count(OpKind::kPut, t0);
    versions_[key] = version;
    ops_.fetch_add(2, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> lock(log_mu_);
  final_counters_ = guest_->counters();
}

// ---------------------------------------------------------------- attacker

const char* AttackName(Attack attack) {
  switch (attack) {
    case Attack::kInvalidatePoolStorm:
      return "invalidate-pool storm";
    case Attack::kDestroyPoolStorm:
      return "new/destroy-pool storm";
    case Attack::kZeroPageFlood:
      return "zero-page-per-object flood";
    case Attack::kPutFlood:
      return "put flood";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<RawAttacker>> RawAttacker::Connect(
    const std::string& socket, Attack attack) {
  auto a = std::unique_ptr<RawAttacker>(new RawAttacker());
  a->attack_ = attack;
  IvshmemClientOptions client_options;
  client_options.timeout = milliseconds(20000);
  absl::StatusOr<std::unique_ptr<IvshmemClient>> client =
      IvshmemClient::Connect(socket, client_options);
  if (!client.ok()) return client.status();
  a->client_ = std::move(*client);
  if (absl::Status s = a->Attach(); !s.ok()) return s;
  return a;
}

RawAttacker::~RawAttacker() { Stop(); }

absl::Status RawAttacker::Attach() {
  base_ = client_->shm_base();
  header_ = reinterpret_cast<tmem_shm_header*>(base_);
  if (!testing::WaitUntil(
          [&] {
            return __atomic_load_n(&header_->host_state, __ATOMIC_ACQUIRE) ==
                   TMEM_HOST_STATE_READY;
          },
          20000)) {
    return absl::UnavailableError("host never READY");
  }
  // The layout as the host published it; a hostile guest trusts it as far
  // as it needs to (it only hurts itself otherwise).
  sq_offset_ = header_->sq_offset;
  sq_entries_ = header_->sq_entries;
  cq_offset_ = header_->cq_offset;
  cq_entries_ = header_->cq_entries;
  slots_offset_ = header_->slots_offset;
  slot_count_ = header_->slot_count;
  if (sq_entries_ == 0 || cq_entries_ == 0 || slot_count_ < sq_entries_) {
    return absl::FailedPreconditionError("unexpected ring layout");
  }
  sq_tail_ = __atomic_load_n(&header_->sq_tail.value, __ATOMIC_ACQUIRE);
  cq_head_ = __atomic_load_n(&header_->cq_head.value, __ATOMIC_ACQUIRE);
  std::random_device rd;
  const uint64_t generation = (uint64_t{rd()} << 32 | rd()) | 1;
  // No TMEM_FEAT_ADMISSION_HINT: the host must sample our puts itself.
  __atomic_store_n(&header_->features_guest, 0u, __ATOMIC_RELAXED);
  __atomic_store_n(&header_->guest_generation, generation, __ATOMIC_RELEASE);
  if (attack_ == Attack::kPutFlood) {
    // Compressible, distinct per slot; each put also stamps a counter.
    for (uint32_t s = 0; s < slot_count_; ++s) {
      FillWorkingPage(~uint64_t{s}, 1,
                      base_ + slots_offset_ + uint64_t{s} * TMEM_PAGE_SIZE);
    }
  } else {
    std::memset(base_ + slots_offset_, 0,
                uint64_t{slot_count_} * TMEM_PAGE_SIZE);
  }
  // One pool of our own (the storms target it; floods fill it).
  tmem_sqe sqe{};
  sqe.opcode = TMEM_OP_NEW_POOL;
  sqe.flags = TMEM_SQE_F_IRQ;
  sqe.tag = ~uint64_t{0};
  Post(sqe);
  Publish();
  const auto deadline = steady_clock::now() + milliseconds(20000);
  while (in_flight_ > 0) {
    const uint32_t tail =
        __atomic_load_n(&header_->cq_tail.value, __ATOMIC_ACQUIRE);
    if (tail != cq_head_) {
      const auto* cqe = reinterpret_cast<const tmem_cqe*>(
          base_ + cq_offset_ +
          uint64_t{cq_head_ & (cq_entries_ - 1)} * sizeof(tmem_cqe));
      if (cqe->status != TMEM_OK) {
        return absl::InternalError(
            absl::StrCat("NEW_POOL failed: ", cqe->status));
      }
      pool_ = static_cast<uint16_t>(cqe->result);
      ++cq_head_;
      --in_flight_;
      __atomic_store_n(&header_->cq_head.value, cq_head_, __ATOMIC_RELEASE);
      break;
    }
    if (steady_clock::now() > deadline) {
      return absl::DeadlineExceededError("NEW_POOL never completed");
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  return absl::OkStatus();
}

void RawAttacker::Post(const tmem_sqe& sqe) {
  auto* slot = reinterpret_cast<tmem_sqe*>(
      base_ + sq_offset_ +
      uint64_t{sq_tail_ & (sq_entries_ - 1)} * sizeof(tmem_sqe));
  std::memcpy(slot, &sqe, sizeof(sqe));
  ++sq_tail_;
  ++in_flight_;
}

void RawAttacker::Publish() {
  __atomic_store_n(&header_->sq_tail.value, sq_tail_, __ATOMIC_RELEASE);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if ((__atomic_load_n(&header_->host_flags, __ATOMIC_ACQUIRE) &
       TMEM_HOST_NEEDS_DOORBELL) != 0) {
    client_->DoorbellPeer(
        __atomic_load_n(&header_->host_peer_id, __ATOMIC_RELAXED),
        TMEM_VEC_SUBMIT);
  }
}

uint32_t RawAttacker::Reap() {
  const uint32_t tail =
      __atomic_load_n(&header_->cq_tail.value, __ATOMIC_ACQUIRE);
  uint32_t n = 0;
  while (cq_head_ != tail && in_flight_ > 0) {
    const auto* cqe = reinterpret_cast<const tmem_cqe*>(
        base_ + cq_offset_ +
        uint64_t{cq_head_ & (cq_entries_ - 1)} * sizeof(tmem_cqe));
    const int32_t status = cqe->status;
    if (status == TMEM_ERR_DROPPED) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
    } else if (status != TMEM_OK) {
      errors_.fetch_add(1, std::memory_order_relaxed);
    }
    ++cq_head_;
    --in_flight_;
    ++n;
  }
  if (n > 0) {
    __atomic_store_n(&header_->cq_head.value, cq_head_, __ATOMIC_RELEASE);
    completed_.fetch_add(n, std::memory_order_relaxed);
  }
  return n;
}

tmem_sqe RawAttacker::NextEntry() {
  tmem_sqe sqe{};
  sqe.tag = sequence_;
  sqe.pool = pool_;
  const uint64_t n = sequence_++;
  switch (attack_) {
    case Attack::kInvalidatePoolStorm:
      sqe.opcode = TMEM_OP_INVAL_POOL;
      break;
    case Attack::kDestroyPoolStorm:
      // Destroy our pool, make it again (the host hands out the lowest
      // free id, so the same id comes back), invalidate it.
      sqe.opcode = n % 3 == 0   ? TMEM_OP_DESTROY_POOL
                   : n % 3 == 1 ? TMEM_OP_NEW_POOL
                                : TMEM_OP_INVAL_POOL;
      if (sqe.opcode == TMEM_OP_NEW_POOL) sqe.pool = 0;
      break;
    case Attack::kZeroPageFlood:
      sqe.opcode = TMEM_OP_PUT;
      sqe.slot = static_cast<uint32_t>(n % slot_count_);
      sqe.oid[0] = static_cast<uint32_t>(n);
      sqe.oid[1] = static_cast<uint32_t>(n >> 32);
      sqe.oid[2] = 0x2e20;
      break;
    case Attack::kPutFlood: {
      sqe.opcode = TMEM_OP_PUT;
      sqe.slot = static_cast<uint32_t>(n % slot_count_);
      uint8_t* page =
          base_ + slots_offset_ + uint64_t{sqe.slot} * TMEM_PAGE_SIZE;
      std::memcpy(page + 16, &n, sizeof(n));  // every page distinct
      sqe.oid[0] = static_cast<uint32_t>(n / 16);
      sqe.oid[1] = static_cast<uint32_t>(n >> 36);
      sqe.oid[2] = 0xf100d;
      sqe.index = n % 16;
      break;
    }
  }
  return sqe;
}

void RawAttacker::Start(bool sched_idle) {
  stop_.store(false);
  thread_ = std::thread([this, sched_idle] {
    if (sched_idle) {
      // Allowed unprivileged (lowering one's own priority); a failure only
      // leaves the attacker unbounded, which the bench reports per row.
      sched_param param{};
      if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &param) != 0) {
        idle_failed_.store(true, std::memory_order_relaxed);
      }
    }
    tid_.store(gettid(), std::memory_order_release);
    Loop();
  });
}

void RawAttacker::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void RawAttacker::Loop() {
  // Never more in flight than either ring holds (the host completes only
  // what the CQ has room for) nor than there are slots (a put's slot is
  // ours again only after its completion).
  const uint32_t limit = std::min(sq_entries_, cq_entries_);
  const int irq_fd = client_->interrupt_fd(TMEM_VEC_COMPLETE);
  while (!stop_.load(std::memory_order_relaxed)) {
    Reap();
    if (in_flight_ < limit) {
      while (in_flight_ < limit) {
        tmem_sqe sqe = NextEntry();
        // Ask for an interrupt on the last entry of the burst: we sleep
        // until the host has worked through it.
        if (in_flight_ + 1 == limit) sqe.flags |= TMEM_SQE_F_IRQ;
        Post(sqe);
      }
      Publish();
      continue;
    }
    if (irq_fd >= 0) {
      pollfd p{irq_fd, POLLIN, 0};
      if (poll(&p, 1, 2) > 0) {
        uint64_t v;
        ssize_t unused = read(irq_fd, &v, sizeof(v));
        (void)unused;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

// ---------------------------------------------------------------- sampler

Sampler::Sampler(const Tmemd* tmemd, std::vector<std::string> watched_vms,
                 int interval_ms)
    : tmemd_(tmemd),
      watched_(std::move(watched_vms)),
      interval_ms_(interval_ms) {}

Sampler::~Sampler() { Stop(); }

void Sampler::Start() {
  stop_.store(false);
  thread_ = std::thread([this] {
    while (!stop_.load(std::memory_order_relaxed)) {
      SampleOnce();
      std::this_thread::sleep_for(milliseconds(interval_ms_));
    }
    SampleOnce();  // one more after the attack's last entries
  });
}

SampleSummary Sampler::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  return summary_;
}

void Sampler::SampleOnce() {
  SampleSummary& s = summary_;
  auto violation = [&s](std::string what) {
    if (s.violations.size() < 8) s.violations.push_back(std::move(what));
  };
  absl::StatusOr<v1::HostStatus> host = tmemd_->Status();
  if (!host.ok()) {
    ++s.rpc_errors;
    return;
  }
  ++s.samples;
  s.cap_bytes = host->memory_cap_bytes();
  s.max_used_bytes =
      std::max<uint64_t>(s.max_used_bytes, host->memory_used_bytes());
  if (host->memory_used_bytes() > host->memory_cap_bytes()) {
    ++s.cap_exceeded;
    violation(absl::StrCat("host uses ", host->memory_used_bytes(),
                           " B over its cap of ", host->memory_cap_bytes()));
  }
  for (const std::string& vm : watched_) {
    absl::StatusOr<v1::VmDetail> d = tmemd_->GetVm(vm);
    if (!d.ok()) {
      ++s.rpc_errors;
      continue;
    }
    const uint64_t quota = d->summary().policy().quota_bytes();
    if (quota == 0) continue;
    const uint64_t charged = d->summary().charged_bytes();
    const double ratio =
        static_cast<double>(charged) / static_cast<double>(quota);
    s.max_quota_ratio = std::max(s.max_quota_ratio, ratio);
    if (ratio > 1.05) {
      ++s.quota_exceeded;
      violation(absl::StrCat(vm, " holds ", charged, " B over quota ", quota,
                             " + 5%"));
    }
  }
}

}  // namespace tmem::hostile
