// Hostile-guest harness: a real tmemd process, a well-behaved
// guest whose every page read back is verified, hostile guests that write
// raw ring entries, and a sampler that watches quotas and the host cap over
// gRPC while they run. Shared by tests/hostile/hostile_guest_test.cc (which
// asserts guarantees) and bench/isolation_bench.cc (which reports ratios).
//
// Every guest here stands where QEMU stands: IvshmemClient connects to the
// VM's socket and receives the memfd and eventfds. The verified guest runs
// the userspace TmemGuest (the protocol core the kernel module runs); the
// attackers skip it and post entries straight into the submission ring,
// ignoring the admission hint and keeping their ring full, as a hostile
// guest kernel would.
//
// Thread safety: each VerifiedGuest and RawAttacker runs its own thread
// (Start/Stop from one controlling thread); their counters are atomics any
// thread may read. Tmemd's RPC helpers may be called from any thread.
#ifndef TMEMD_TESTS_HOSTILE_HOSTILE_HARNESS_H_
#define TMEMD_TESTS_HOSTILE_HOSTILE_HARNESS_H_

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "proto/tmem/v1/control.grpc.pb.h"
#include "tests/process.h"

namespace tmem::hostile {

struct VmSpec {
  std::string name;
  uint64_t quota_bytes = 0;  // 0: unlimited
  // "default" (the host's valve mode), "off", "always" or "adaptive".
  // "always" takes the valve out of an attack: quotas and the cap must
  // hold on their own.
  std::string mode = "default";
};

struct TmemdSpec {
  std::string tmemd_bin;
  std::string dir;  // scratch directory the caller owns (sockets, log)
  uint64_t memory_cap_bytes = 256ull << 20;
  int workers = 1;  // 1: every VM on the same worker (the worst case)
  std::string valve_mode = "adaptive";
  std::vector<VmSpec> vms;
};

// A tmemd process started on a config file written from a TmemdSpec, with
// its admin control socket; stopped with SIGTERM on destruction.
class Tmemd {
 public:
  static absl::StatusOr<std::unique_ptr<Tmemd>> Start(const TmemdSpec& spec);
  ~Tmemd();
  Tmemd(const Tmemd&) = delete;
  Tmemd& operator=(const Tmemd&) = delete;

  std::string Socket(const std::string& vm) const;
  absl::StatusOr<v1::HostStatus> Status() const;
  absl::StatusOr<v1::VmDetail> GetVm(const std::string& vm) const;
  bool Alive() const;
  std::string Log() const { return process_->Log(); }
  pid_t pid() const { return process_->pid(); }
  // SIGTERM and wait; the exit code (-1 if it did not exit in time).
  int Stop();

 private:
  Tmemd() = default;
  std::string dir_;
  std::unique_ptr<testing::Process> process_;
  std::unique_ptr<v1::TmemControl::Stub> stub_;
  bool stopped_ = false;
};

// The value of the counter `name` in a list of v1 counters; -1 if absent.
int64_t CounterValue(
    const google::protobuf::RepeatedPtrField<v1::Counter>& counters,
    const std::string& name);

// Bytes of a working-set page: content determined by (key, version), about
// half compressible, never zero- or same-filled. Version 0 is never used.
void FillWorkingPage(uint64_t key, uint64_t version, uint8_t* page);
// The fill byte of bulk object `i` (a same-filled page, never zero).
uint8_t BulkByte(uint64_t i);

// The neighbour's operations by kind, and the time each kind spent inside
// the guest library's call (posting, waiting for tmemd, copying): a get
// that hits costs more than one that misses, so throughput over a mixed
// workload moves with the hit ratio; time per kind does not.
enum class OpKind { kGetHit, kGetMiss, kPut, kInvalidate };
inline constexpr int kNumOpKinds = 4;
const char* OpKindName(OpKind kind);

struct OpTimes {
  std::array<uint64_t, kNumOpKinds> count{};
  std::array<uint64_t, kNumOpKinds> ns{};
  OpTimes operator-(const OpTimes& o) const;
  OpTimes& operator+=(const OpTimes& o);
  // Mean microseconds per op of `kind` (0 when none).
  double MeanUs(OpKind kind) const;
};

struct VerifiedGuestOptions {
  // Keys of the working set, cycled through at random: get (verify), then
  // put a new version; one op in 16 invalidates the key instead.
  uint32_t working_pages = 2048;
  // One op in this many reads a bulk object back (verify) and puts it
  // again; 0: never. Only with Fill().
  uint32_t bulk_read_every = 8;
};

// The well-behaved neighbour. Every hit is compared with the bytes of the
// latest put of that key (or counted as a mismatch if the key was
// invalidated or read since: private gets are exclusive).
class VerifiedGuest {
 public:
  static absl::StatusOr<std::unique_ptr<VerifiedGuest>> Connect(
      const std::string& socket, const VerifiedGuestOptions& options);
  ~VerifiedGuest();  // stops the thread
  VerifiedGuest(const VerifiedGuest&) = delete;
  VerifiedGuest& operator=(const VerifiedGuest&) = delete;

  // Before Start: puts `objects` one-page objects (same-filled pages) in a
  // second pool, retrying puts the ring had no room for; fails if puts are
  // refused otherwise (the caller sizes the cap and quota for them).
  absl::Status Fill(uint64_t objects);

  void Start();
  void Stop();

  // Live counters (any thread).
  uint64_t ops() const { return ops_.load(std::memory_order_relaxed); }
  uint64_t gets() const { return gets_.load(std::memory_order_relaxed); }
  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t bulk_hits() const {
    return bulk_hits_.load(std::memory_order_relaxed);
  }
  uint64_t mismatches() const {
    return mismatches_.load(std::memory_order_relaxed);
  }
  OpTimes op_times() const;
  // The kernel thread id of the guest's loop once started (0 before), for
  // reading its scheduler statistics in /proc.
  pid_t tid() const { return tid_.load(std::memory_order_acquire); }
  // After Stop: the first mismatches, described, and the guest counters.
  std::vector<std::string> mismatch_log() const;
  GuestCounters counters() const;

 private:
  VerifiedGuest() = default;
  void Loop();
  void Count(OpKind kind, std::chrono::steady_clock::time_point since);
  bool Verify(const char* what, uint64_t key, const uint8_t* got,
              const uint8_t* want);

  VerifiedGuestOptions options_;
  std::unique_ptr<IvshmemClient> client_;
  std::unique_ptr<TmemGuest> guest_;
  TmemGuest::PoolHandle working_pool_ = -1;
  TmemGuest::PoolHandle bulk_pool_ = -1;
  uint64_t bulk_objects_ = 0;
  std::vector<uint64_t> versions_;  // 0: the host must not hold the key
  uint64_t next_version_ = 1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> ops_{0}, gets_{0}, hits_{0}, bulk_hits_{0},
      mismatches_{0};
  std::atomic<pid_t> tid_{0};
  std::array<std::atomic<uint64_t>, kNumOpKinds> op_count_{};
  std::array<std::atomic<uint64_t>, kNumOpKinds> op_ns_{};
  mutable std::mutex log_mu_;
  std::vector<std::string> mismatch_log_;  // guarded by log_mu_
  GuestCounters final_counters_;           // guarded by log_mu_
};

enum class Attack {
  kInvalidatePoolStorm,  // INVAL_POOL on its own empty pool, back to back
  kDestroyPoolStorm,     // NEW_POOL + DESTROY_POOL (+ INVAL_POOL), repeated
  kZeroPageFlood,        // PUT of a zero page, each in a new object
  kPutFlood,             // PUT of distinct compressible pages
};
const char* AttackName(Attack attack);

// A hostile guest: keeps its submission ring full of one kind of entry,
// ignoring the admission hint, rings only when the host asks, and waits for
// completions on its interrupt (it marks the last entry of each burst).
class RawAttacker {
 public:
  static absl::StatusOr<std::unique_ptr<RawAttacker>> Connect(
      const std::string& socket, Attack attack);
  ~RawAttacker();
  RawAttacker(const RawAttacker&) = delete;
  RawAttacker& operator=(const RawAttacker&) = delete;

  // `sched_idle`: the attacker's thread runs at SCHED_IDLE, so it gets a
  // CPU only when the neighbour and tmemd leave one free. The isolation
  // benchmark's stand-in for a hypervisor bounding each VM's vCPUs (a
  // cgroup's cpu.max / cpu.weight): on a 2-CPU test host the simulated
  // guests otherwise compete with the neighbour and tmemd for the CPUs,
  // which real VMs with their own vCPUs would not.
  void Start(bool sched_idle = false);
  void Stop();
  // The kernel thread id of the attacker's loop once started (0 before).
  pid_t tid() const { return tid_.load(std::memory_order_acquire); }
  // Start(true) could not lower the thread to SCHED_IDLE.
  bool idle_failed() const {
    return idle_failed_.load(std::memory_order_relaxed);
  }
  // Entries the host completed: OK, any error status, of which
  // TMEM_ERR_DROPPED (puts not stored).
  uint64_t completed() const {
    return completed_.load(std::memory_order_relaxed);
  }
  uint64_t errors() const { return errors_.load(std::memory_order_relaxed); }
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

 private:
  RawAttacker() = default;
  absl::Status Attach();
  void Loop();
  // Reaps every completion; returns how many.
  uint32_t Reap();
  void Post(const tmem_sqe& sqe);
  void Publish();
  tmem_sqe NextEntry();

  Attack attack_ = Attack::kInvalidatePoolStorm;
  std::unique_ptr<IvshmemClient> client_;
  tmem_shm_header* header_ = nullptr;
  uint8_t* base_ = nullptr;
  uint32_t sq_entries_ = 0, cq_entries_ = 0, slot_count_ = 0;
  uint32_t sq_offset_ = 0, cq_offset_ = 0, slots_offset_ = 0;
  uint32_t sq_tail_ = 0, cq_head_ = 0, in_flight_ = 0;
  uint16_t pool_ = 0;
  uint64_t sequence_ = 0;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> completed_{0}, errors_{0}, dropped_{0};
  std::atomic<pid_t> tid_{0};
  std::atomic<bool> idle_failed_{false};
};

// Samples tmemd every `interval_ms` while running: host memory against the
// cap, and each watched VM's all-in charge against its quota.
struct SampleSummary {
  uint64_t samples = 0;
  uint64_t rpc_errors = 0;
  uint64_t max_used_bytes = 0;
  uint64_t cap_bytes = 0;
  uint64_t cap_exceeded = 0;  // samples with used > cap
  // Largest charged/quota seen over the watched VMs (0 with no quota).
  double max_quota_ratio = 0;
  uint64_t quota_exceeded = 0;          // samples with charged > quota * 1.05
  std::vector<std::string> violations;  // the first few, described
};

class Sampler {
 public:
  Sampler(const Tmemd* tmemd, std::vector<std::string> watched_vms,
          int interval_ms = 50);
  ~Sampler();
  void Start();
  SampleSummary Stop();

 private:
  void SampleOnce();
  const Tmemd* tmemd_;
  std::vector<std::string> watched_;
  int interval_ms_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  SampleSummary summary_;  // sampler thread until Stop joins it
};

}  // namespace tmem::hostile

#endif  // TMEMD_TESTS_HOSTILE_HOSTILE_HARNESS_H_
