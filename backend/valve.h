// Valve: tmemd's host-wide, CPU-aware throttle across VMs (pure logic).
//
// For every put the valve answers compress, store raw, or drop, and per VM
// it publishes an admission rate the guest applies before it even copies a
// page. Inputs:
//  * CPU: a host-wide budget for tmemd, "at most cpu_budget_percent of the
//    host, and only cycles the host is not using" (from CpuSample), split
//    across VMs by weight as token buckets in CPU-nanoseconds. The worker
//    charges each VM what its ring batches actually cost (ChargeCpu). A VM
//    that does not use its share lends it to the others (the refill is
//    water-filled over the VMs' recent demand). A VM with tokens compresses;
//    one without stores raw (a memcpy instead of LZ4), and its admission
//    hint is cut in proportion to its overspend, so its guest stops even
//    copying pages (the CPU that matters is saved there) -- unless at least
//    kCpuCutExemptReuse of its puts come back: a page that comes back saves
//    the guest a disk read, which costs the host more CPU than the memcpy
//    of a raw put and the get together, so cutting those puts would spend
//    CPU, not save it. A guest that ignores the hint and is a period's
//    share in debt gets drops. The budget covers all of tmemd's CPU: what
//    no VM is charged for (polling, wake-ups, the control plane) is taken
//    out of it before the token buckets are filled.
//  * Memory (MemorySample, taken by the caller from the store and passed
//    to Tick; the valve holds no store): with less than
//    memory_headroom_fraction of the cap free, a VM out of tokens that
//    holds at least its weighted share of the cap drops instead of storing
//    raw (its raw pages would only evict its compressed ones); one below
//    its share stores raw, and the store makes room by evicting from VMs
//    above theirs.
//  * Reuse: per VM, the share of admitted puts that came back (gets that hit,
//    plus gets for "ghost" keys the valve dropped or the store evicted,
//    which show admitting would have paid -- but only when the key comes
//    back within the VM's reach: at most as many of the guest's evictions
//    after it was let go as the VM's share of the cap holds pages, or what
//    it holds now if more. A key asked for again only after the guest
//    evicted many times that much could not have survived in the VM's
//    memory: a guest re-reading a data set far larger than the cap is a
//    streaming guest, and its far ghost hits count apart). A VM below
//    throttle_below (with enough samples) is throttled to min_admission,
//    a sampling rate that lets it recover once its pages return (the
//    sample is kept as ghosts, never stored: a ghost hit shows reuse as
//    well as a hit, at no copy, compression or eviction); above
//    restore_above it gets full admission again. The gap between the two and
//    min_dwell_periods keep it from flapping. A VM is judged only once its
//    puts had a chance to come back: after twice the guest's RAM in
//    evictions (the guest says its size, ABI v3), or its reach if less,
//    since the last change of state. Before that, a guest re-reading a data
//    set larger than its RAM has shown no reuse only because the re-read
//    has not begun.
//  * Guest stand-aside (ABI v2): a guest that measured tmem costing it more
//    than it saves says so; it is admitted nothing while it does.
//  * Modes (per VM, or the host default): off drops every put and tells the
//    guest to send nothing; always compresses every put regardless of CPU
//    (the zcache-like behaviour of the 2011 report); adaptive is all of the
//    above. With deferred_compression, adaptive answers "defer" where it
//    would answer "compress" (counted as compressed: the compactor does it).
//    A VM's swap devices follow its swap_mode (DecideSwap), or its mode
//    when that is default; a VM whose swap mode is adaptive gets CPU tokens
//    even when its cleancache mode is not.
//
// Every decision is counted per VM (ValveCounter).
//
// Threads: Decide/RecordGet/RecordEviction/ChargeCpu are called by workers
// (any number, concurrently; a VM is driven by one worker at a time) and are
// lock-free. Tick, AddVm/RemoveVm/SetVmPolicy, SetOptions and the status
// getters take an internal mutex and may be called from any thread. A VM
// must not be removed while a worker may still call Decide for it.
#ifndef TMEMD_BACKEND_VALVE_H_
#define TMEMD_BACKEND_VALVE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "backend/clock.h"
#include "backend/cpu_sample.h"
#include "backend/eviction_listener.h"
#include "backend/memory_sample.h"
#include "backend/mutex.h"
#include "backend/put_advisor.h"
#include "backend/types.h"

namespace tmem {

struct ValveOptions {
  ValveMode default_mode = ValveMode::kAdaptive;  // never kDefault
  // At most this share of the whole host (all cores) for tmemd's puts...
  double cpu_budget_percent = 25.0;
  // ...and at most this share of the cycles the host leaves idle.
  double spare_cpu_fraction = 0.8;
  // ...but never less than this (so a saturated host still gets its
  // re-read VMs served, at a trickle).
  double cpu_floor_percent = 2.0;
  // Above this CPU pressure (PSI "some" avg10, percent) the budget shrinks
  // linearly to zero at cpu_pressure_full.
  double cpu_pressure_start = 20.0;
  double cpu_pressure_full = 80.0;
  int sample_period_ms = 100;
  double smoothing = 0.5;  // EWMA weight of the newest sample, (0, 1]
  // Reuse-aware admission.
  double throttle_below = 0.02;     // reuse ratio that throttles a VM
  double restore_above = 0.08;      // reuse ratio that restores it
  uint64_t min_samples = 512;       // admitted puts before judging reuse
  int min_dwell_periods = 4;        // periods between state changes
  uint32_t min_admission = 1024;    // of TMEM_ADMIT_ALL (65536): 1/64
  double reuse_window_decay = 0.9;  // per period, of the reuse counters
  int ghost_bits = 16;              // ghost list: 2^bits key hashes per VM
  double memory_headroom_fraction = 0.05;
  // Adaptive mode: a put the valve would compress, or would store raw for
  // want of CPU tokens, is stored raw at once and compressed later by the
  // compactor with idle cycles (PutMode::kDefer, backend/compactor.h).
  // false: compress in the put (raw when out of tokens). `always` stays
  // synchronous either way.
  bool deferred_compression = false;
};

// The valve's per-VM decision counters.
enum class ValveCounter : int {
  kCompressed = 0,  // told to compress
  kRaw,             // told to store raw (out of CPU tokens)
  kDroppedCpu,      // dropped: deep in CPU debt
  kDroppedReuse,    // dropped: throttled for no reuse (host-side sampling)
  kDroppedMemory,   // dropped: out of tokens and no memory headroom
  kDroppedOff,      // dropped: mode off
  kDroppedAside,    // dropped: the guest stands aside (guest_flags)
  kGhostHits,       // a get missed on a key the valve/store had let go,
                    // within the VM's reach: admitting would have paid
  kGhostHitsFar,    // the same, but beyond what the VM's share of the cap
                    // holds: no admitted page survives that long
  kThrottleEvents,  // transitions to the throttled state
  kRestoreEvents,   // transitions back to full admission
  kNumCounters,
};
inline constexpr int kNumValveCounters =
    static_cast<int>(ValveCounter::kNumCounters);
std::string_view ValveCounterName(ValveCounter c);
using ValveCounterValues = std::array<uint64_t, kNumValveCounters>;

struct ValveVmStatus {
  ValveMode mode = ValveMode::kDefault;  // as set on the VM
  ValveMode effective_mode = ValveMode::kAdaptive;
  // For its swap devices' puts, as set (kDefault follows `mode`), and what
  // DecideSwap applies.
  ValveMode swap_mode = ValveMode::kDefault;
  ValveMode effective_swap_mode = ValveMode::kAdaptive;
  uint32_t weight = 100;
  uint32_t admission = 65536;   // of 65536
  bool throttled = false;       // reuse throttle engaged
  bool standing_aside = false;  // the guest said tmem does not pay for it
  // Pages the VM's share of the cap holds (or what it holds, if more): the
  // reuse distance within which a ghost hit counts. UINT64_MAX without a
  // store.
  uint64_t reach_pages = UINT64_MAX;
  uint64_t guest_ram_pages = 0;  // as the guest says (0: not said)
  // Evictions since the last change of state, and how many must pass
  // before reuse is judged (min(reach, 2 x guest RAM); 0 without RAM).
  uint64_t evictions_in_state = 0;
  uint64_t judge_after_evictions = 0;
  double reuse_ratio = 0;     // smoothed (hits + ghost hits) / admitted puts
  int64_t cpu_tokens_ns = 0;  // may be negative (debt)
  int64_t cpu_share_ns = 0;   // refill per period
  uint64_t cpu_used_ns = 0;   // total charged
  ValveCounterValues counters{};
};

struct ValveHostStatus {
  ValveOptions options;
  int num_cpus = 0;
  double host_busy_fraction = 0;   // smoothed, whole host, incl. tmemd
  double agent_busy_fraction = 0;  // smoothed, tmemd's share of the host
  double cpu_pressure = 0;         // PSI some avg10, percent
  double budget_fraction = 0;      // tmemd's current budget, share of host
  // tmemd's CPU no VM was charged for (polling, wake-ups, the control
  // plane), smoothed, share of host: it comes out of the budget first.
  double overhead_fraction = 0;
  // What is left of the budget for the VMs' token buckets (never below
  // cpu_floor_percent).
  double token_fraction = 0;
  uint64_t ticks = 0;
};

class Valve final : public PutAdvisor, public EvictionListener {
 public:
  explicit Valve(const ValveOptions& options);
  ~Valve() override;
  Valve(const Valve&) = delete;
  Valve& operator=(const Valve&) = delete;

  static absl::Status ValidateOptions(const ValveOptions& options);
  absl::Status SetOptions(const ValveOptions& options);
  ValveOptions options() const;

  void AddVm(VmId vm, const VmPolicy& policy);
  void RemoveVm(VmId vm);
  void SetVmPolicy(VmId vm, const VmPolicy& policy);

  // Hot path. `key_hash`: any well-mixed hash of (pool, object, index).
  // `guest_applies_hint`: the guest advertised TMEM_FEAT_ADMISSION_HINT, so
  // what arrives is already the sample; otherwise the valve samples itself.
  PutMode Decide(VmId vm, uint64_t key_hash, bool guest_applies_hint);
  // A put to one of the VM's swap devices (a persistent pool). A swap page
  // always comes back (the guest reads every page it did not discard), so
  // this answers only how to store it, from the VM's CPU tokens, and always
  // deferred (whatever deferred_compression says), so a guest's write
  // completes once its page is copied: with tokens (or in mode always)
  // kDefer, compressed soon by the compactor; without, kDeferIdle, raw
  // until the compactor finds idle cycles. A store without a compaction
  // queue compresses either in the put. It never drops for
  // reuse, CPU debt, memory headroom or a guest standing aside: room is the
  // store's business (a refused put spills to the device's image), and the
  // decision touches no reuse statistics, so a VM's swap traffic neither
  // hides nor fakes its cleancache reuse. The mode is the VM's swap_mode,
  // or its mode when that is kDefault, or the host default when both are:
  // off is the one drop (no tmem memory for its swap pages: every one goes
  // to the image, the device is a plain disk), always is kDefer whatever
  // the tokens, adaptive as above. Counted as kCompressed / kRaw /
  // kDroppedOff. Lock-free, like Decide.
  PutMode DecideSwap(VmId vm);
  void RecordGet(VmId vm, uint64_t key_hash, bool hit);
  void RecordEviction(VmId vm, uint64_t key_hash);
  void ChargeCpu(VmId vm, int64_t nanos) override;

  // PutAdvisor and EvictionListener: the same, for the data plane and the
  // store.
  PutMode Advise(uint32_t vm, uint64_t key_hash,
                 bool guest_applies_hint) override {
    return Decide(vm, key_hash, guest_applies_hint);
  }
  void OnGet(uint32_t vm, uint64_t key_hash, bool hit) override {
    RecordGet(vm, key_hash, hit);
  }
  void OnEvicted(VmId vm, uint64_t key_hash) override {
    RecordEviction(vm, key_hash);
  }
  // A VM whose guest stands aside is admitted nothing (hint 0, every put
  // that still arrives dropped) until it says otherwise.
  void OnGuestStandingAside(uint32_t vm, bool aside) override;
  // The guest's RAM in pages (0: unknown): reuse is judged only after
  // min(reach, 2 x this) evictions since the VM's last change of state.
  void OnGuestRamPages(uint32_t vm, uint64_t pages) override;

  // Periodic (every sample_period_ms): CPU budget from the CPU sample, token
  // refill by weight with lending, reuse evaluation, admission rates; memory
  // headroom and each VM's reach from the memory sample (default: not known,
  // the previous verdicts stand).
  void Tick(const CpuSample& sample, const MemorySample& memory = {});

  uint32_t AdmissionHint(VmId vm) const override;
  // reach_pages as the last Tick set it; 0 before one, or without a store.
  uint64_t ReachPages(VmId vm) const override;
  // Its pages are not expected back: throttled for no reuse, or its guest
  // stands aside. Lock-free; any thread.
  bool ExpectsNoReuse(VmId vm) const;
  ValveVmStatus VmStatus(VmId vm) const;
  ValveHostStatus HostStatus() const;

 private:
  struct VmState;
  struct CpuDelta;
  struct Claim;
  VmState* Find(VmId vm) const;
  // swap_mode, else mode, else the host default. Lock-free.
  ValveMode EffectiveSwapMode(const VmState& s) const;

  // Tick's steps, in the order Tick runs them (all under mu_).
  // The CPU used since the last sample; none on the first sample, or when
  // the host's clocks did not move forward (then only remembered).
  std::optional<CpuDelta> TakeCpuDelta(const CpuSample& sample)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Smoothed host and tmemd utilization, CPU pressure.
  void UpdateUtilization(const CpuSample& sample, const CpuDelta& d)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // tmemd's budget from what the others leave and the pressure.
  void UpdateBudget(const CpuSample& sample) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The budget less tmemd's uncharged CPU; returns the period's token
  // budget in CPU-nanoseconds.
  double UpdateTokenBudget(const CpuDelta& d)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateMemoryHeadroom(const MemorySample& memory)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each VM's reach, fair share and holding, from the memory sample.
  void UpdateReach(const MemorySample& memory)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Per VM: demand and the reuse window; non-adaptive VMs get their fixed
  // admission, adaptive ones are judged (JudgeReuse) and claim tokens.
  std::vector<Claim> CollectClaims(double period_budget_ns)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Throttle or restore for reuse; arms the early judgement.
  void JudgeReuse(VmState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Splits the token budget over the claims by weight, with lending.
  static void WaterFill(std::vector<Claim>& claims, double period_budget_ns);
  // A VM's share, CPU admission, admission hint and token refill.
  void ApplyClaim(const Claim& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The throttle rule for a VM at full reuse admission, on a window of
  // `puts` admitted puts of which `useful` came back.
  static bool ShowsNoReuse(const VmState& s, double puts, double useful,
                           const ValveOptions& o);
  // Called by the put that reaches the VM's armed judge_clock.
  void JudgeAtThreshold(VmState* s) ABSL_LOCKS_EXCLUDED(mu_);

  mutable Mutex mu_;
  ValveOptions options_ ABSL_GUARDED_BY(mu_);
  ValveHostStatus host_ ABSL_GUARDED_BY(mu_);
  CpuSample last_sample_ ABSL_GUARDED_BY(mu_);
  uint64_t last_charged_ns_ ABSL_GUARDED_BY(mu_) = 0;  // sum of cpu_used
  bool have_sample_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<VmState>> owned_ ABSL_GUARDED_BY(mu_);
  // Indexed by VM slot; read lock-free on the hot path.
  std::unique_ptr<std::atomic<VmState*>[]> by_slot_;
  std::atomic<int> default_mode_;
  std::atomic<bool> deferred_compression_;
  std::atomic<bool> memory_tight_{false};
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_VALVE_H_
