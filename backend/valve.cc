#include "backend/valve.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "backend/page_charge.h"
#include "backend/tmem_store.h"  // kMaxVms

namespace tmem {
namespace {

constexpr uint32_t kAdmitAll = 65536;  // TMEM_ADMIT_ALL
// Below this many held pages, a VM's cost per page is taken as a raw page's.
constexpr uint64_t kMinPagesForCost = 64;
// A VM at least this share of whose puts come back is not cut for CPU (its
// puts are stored raw when it is out of tokens): see valve.h.
constexpr double kCpuCutExemptReuse = 0.5;

int SlotOf(VmId vm) { return static_cast<int>(vm & 0xffff); }

}  // namespace

std::string_view ValveCounterName(ValveCounter c) {
  switch (c) {
    case ValveCounter::kCompressed:
      return "compressed";
    case ValveCounter::kRaw:
      return "raw";
    case ValveCounter::kDroppedCpu:
      return "dropped_cpu";
    case ValveCounter::kDroppedReuse:
      return "dropped_reuse";
    case ValveCounter::kDroppedMemory:
      return "dropped_memory";
    case ValveCounter::kDroppedOff:
      return "dropped_off";
    case ValveCounter::kDroppedAside:
      return "dropped_aside";
    case ValveCounter::kGhostHits:
      return "ghost_hits";
    case ValveCounter::kGhostHitsFar:
      return "ghost_hits_far";
    case ValveCounter::kThrottleEvents:
      return "throttle_events";
    case ValveCounter::kRestoreEvents:
      return "restore_events";
    case ValveCounter::kNumCounters:
      break;
  }
  return "unknown";
}

struct Valve::VmState {
  explicit VmState(VmId vm, int ghost_bits)
      : id(vm),
        ghost_mask((uint64_t{1} << ghost_bits) - 1),
        ghost(new std::atomic<uint64_t>[size_t{1} << ghost_bits]) {
    for (uint64_t i = 0; i <= ghost_mask; ++i) ghost[i].store(0);
  }
  void Count(ValveCounter c) {
    counters[static_cast<int>(c)].fetch_add(1, std::memory_order_relaxed);
  }
  // Direct-mapped set of recently let-go keys: the slot is picked by the
  // hash's low bits; it holds 24 more bits of the hash (bit 0 forced, so a
  // used slot is never 0) and the guest-eviction clock when the key was let
  // go (40 bits, in 1/kClockUnit puts: wraps after 2^32 puts, far beyond any
  // reach that matters).
  static constexpr int kStampBits = 40;
  static constexpr uint64_t kStampMask = (uint64_t{1} << kStampBits) - 1;
  static constexpr uint64_t kClockUnit = 256;
  static uint64_t GhostTag(uint64_t h) {
    return ((h >> kStampBits) | 1) << kStampBits;
  }
  void GhostInsert(uint64_t h) {
    const uint64_t now = clock.load(std::memory_order_relaxed);
    ghost[h & ghost_mask].store(GhostTag(h) | (now & kStampMask),
                                std::memory_order_relaxed);
  }
  // If `h` is a ghost: forgets it and returns how many of the guest's
  // evictions came since it was let go.
  std::optional<uint64_t> GhostTake(uint64_t h) {
    std::atomic<uint64_t>& slot = ghost[h & ghost_mask];
    uint64_t seen = slot.load(std::memory_order_relaxed);
    if ((seen & ~kStampMask) != GhostTag(h) ||
        !slot.compare_exchange_strong(seen, 0, std::memory_order_relaxed)) {
      return std::nullopt;
    }
    const uint64_t now = clock.load(std::memory_order_relaxed);
    return ((now - seen) & kStampMask) / kClockUnit;
  }
  // Advances the guest-eviction clock by one arriving put, which stands for
  // kAdmitAll / admission of the guest's evictions when the guest samples
  // its puts by the hint.
  // Returns the clock after it.
  uint64_t CountPut(uint32_t admission, bool guest_applies_hint) {
    const uint64_t step =
        guest_applies_hint && admission > 0 && admission < kAdmitAll
            ? kClockUnit * kAdmitAll / admission
            : kClockUnit;
    return clock.fetch_add(step, std::memory_order_relaxed) + step;
  }

  const VmId id;
  // Hot-path state.
  std::atomic<uint8_t> mode{static_cast<uint8_t>(ValveMode::kDefault)};
  // For its swap devices' puts (DecideSwap); kDefault follows `mode`.
  std::atomic<uint8_t> swap_mode{static_cast<uint8_t>(ValveMode::kDefault)};
  std::atomic<uint32_t> weight{100};
  std::atomic<uint32_t> admission{kAdmitAll};
  std::atomic<bool> standing_aside{false};
  // Throttled for no reuse (changed under the valve's mutex).
  std::atomic<bool> throttled{false};
  std::atomic<uint64_t> clock{0};  // guest evictions seen, x kClockUnit
  // The clock at which this VM's reuse may first be judged, armed by Tick
  // while that point lies ahead (UINT64_MAX: not armed). The put that
  // reaches it judges at once instead of at the next tick: a streamer's
  // puts admitted in between cost its guest a copy each for nothing (a
  // period of a fast reader's evictions, thousands of pages).
  std::atomic<uint64_t> judge_clock{UINT64_MAX};
  std::atomic<uint64_t> reach_pages{UINT64_MAX};  // set by Tick
  // Its weighted share of the cap in pages at its cost per page, less the
  // memory headroom, and what it holds (set by Tick; no store: unbounded).
  std::atomic<uint64_t> fair_pages{UINT64_MAX};
  std::atomic<uint64_t> held_pages{0};
  std::atomic<uint64_t> guest_ram_pages{0};  // as the guest says
  std::atomic<int64_t> tokens{0};
  std::atomic<int64_t> share{0};
  std::atomic<uint64_t> cpu_used{0};
  std::atomic<uint64_t> admitted_puts{0};  // since the last tick
  std::atomic<uint64_t> useful_gets{0};    // hits + ghost hits, since tick
  std::atomic<uint64_t> starved{0};        // raw/drop-cpu decisions since tick
  std::atomic<uint64_t> sample_credit{0};
  std::array<std::atomic<uint64_t>, kNumValveCounters> counters{};
  const uint64_t ghost_mask;
  std::unique_ptr<std::atomic<uint64_t>[]> ghost;

  // Tick-only state (under the valve's mutex).
  double win_puts = 0;
  double win_useful = 0;
  double demand_ns = 0;  // smoothed CPU per period it used or wanted
  double cpu_admission = kAdmitAll;  // what CPU alone would admit
  uint64_t last_cpu_used = 0;
  int periods_in_state = 0;
  uint64_t clock_at_state = 0;  // `clock` at the last change of state

  // Smoothed share of admitted puts that came back (tick-only state).
  double ReuseRatio() const { return win_puts > 0 ? win_useful / win_puts : 0; }
  // Evictions since the last change of state.
  uint64_t EvictionsInState() const {
    return (clock.load(std::memory_order_relaxed) - clock_at_state) /
           kClockUnit;
  }
  // Reuse can be judged once min(reach, 2 x guest RAM) evictions passed.
  uint64_t JudgeAfterEvictions() const {
    const uint64_t ram = guest_ram_pages.load(std::memory_order_relaxed);
    if (ram == 0) return 0;
    const uint64_t twice = ram > UINT64_MAX / 2 ? UINT64_MAX : ram * 2;
    return std::min(twice, reach_pages.load(std::memory_order_relaxed));
  }
  void ChangeState(bool now_throttled) {
    throttled.store(now_throttled, std::memory_order_relaxed);
    periods_in_state = 0;
    clock_at_state = clock.load(std::memory_order_relaxed);
  }
};

Valve::Valve(const ValveOptions& options)
    : options_(options),
      by_slot_(new std::atomic<VmState*>[size_t{kMaxVms} + 1]),
      default_mode_(static_cast<int>(options.default_mode)),
      deferred_compression_(options.deferred_compression) {
  for (int i = 0; i <= kMaxVms; ++i) by_slot_[i].store(nullptr);
  host_.options = options;
  // Until samples say otherwise, assume the whole budget is there: a valve
  // that starts closed would drop the first puts of every VM.
  host_.budget_fraction = options.cpu_budget_percent / 100.0;
  host_.token_fraction = host_.budget_fraction;
  host_.num_cpus = 1;
}

Valve::~Valve() = default;

absl::Status Valve::ValidateOptions(const ValveOptions& o) {
  if (o.default_mode == ValveMode::kDefault) {
    return absl::InvalidArgumentError(
        "the host default mode must be off, always or adaptive");
  }
  if (!(o.cpu_budget_percent >= 0 && o.cpu_budget_percent <= 100)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cpu_budget_percent ", o.cpu_budget_percent, " is not in 0..100"));
  }
  if (!(o.cpu_floor_percent >= 0 &&
        o.cpu_floor_percent <= o.cpu_budget_percent)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cpu_floor_percent ", o.cpu_floor_percent,
        " must be in 0..cpu_budget_percent (", o.cpu_budget_percent, ")"));
  }
  if (!(o.spare_cpu_fraction >= 0 && o.spare_cpu_fraction <= 1)) {
    return absl::InvalidArgumentError("spare_cpu_fraction must be in 0..1");
  }
  if (!(o.cpu_pressure_start >= 0 &&
        o.cpu_pressure_full > o.cpu_pressure_start &&
        o.cpu_pressure_full <= 100)) {
    return absl::InvalidArgumentError(
        "need 0 <= cpu_pressure_start < cpu_pressure_full <= 100");
  }
  if (o.sample_period_ms < 10 || o.sample_period_ms > 10000) {
    return absl::InvalidArgumentError("sample_period_ms must be in 10..10000");
  }
  if (!(o.smoothing > 0 && o.smoothing <= 1)) {
    return absl::InvalidArgumentError("smoothing must be in (0, 1]");
  }
  if (!(o.throttle_below >= 0 && o.restore_above > o.throttle_below &&
        o.restore_above <= 1)) {
    return absl::InvalidArgumentError(
        "need 0 <= throttle_below < restore_above <= 1 (the gap is the "
        "hysteresis)");
  }
  if (o.min_admission < 1 || o.min_admission > kAdmitAll) {
    return absl::InvalidArgumentError(
        "min_admission must be in 1..65536 (of 65536)");
  }
  if (!(o.reuse_window_decay > 0 && o.reuse_window_decay < 1)) {
    return absl::InvalidArgumentError("reuse_window_decay must be in (0, 1)");
  }
  if (o.ghost_bits < 4 || o.ghost_bits > 24) {
    return absl::InvalidArgumentError("ghost_bits must be in 4..24");
  }
  if (!(o.memory_headroom_fraction >= 0 && o.memory_headroom_fraction < 1)) {
    return absl::InvalidArgumentError(
        "memory_headroom_fraction must be in 0..1");
  }
  if (o.min_dwell_periods < 0) {
    return absl::InvalidArgumentError("min_dwell_periods must be >= 0");
  }
  return absl::OkStatus();
}

absl::Status Valve::SetOptions(const ValveOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  MutexLock lock(&mu_);
  if (options.ghost_bits != options_.ghost_bits && !owned_.empty()) {
    return absl::FailedPreconditionError(
        "ghost_bits can only change while no VM is registered");
  }
  options_ = options;
  host_.options = options;
  default_mode_.store(static_cast<int>(options.default_mode),
                      std::memory_order_relaxed);
  deferred_compression_.store(options.deferred_compression,
                              std::memory_order_relaxed);
  return absl::OkStatus();
}

ValveOptions Valve::options() const {
  MutexLock lock(&mu_);
  return options_;
}

void Valve::AddVm(VmId vm, const VmPolicy& policy) {
  MutexLock lock(&mu_);
  auto state = std::make_unique<VmState>(vm, options_.ghost_bits);
  state->mode.store(static_cast<uint8_t>(policy.mode));
  state->swap_mode.store(static_cast<uint8_t>(policy.swap_mode));
  state->weight.store(std::max<uint32_t>(policy.weight, 1));
  VmState* raw = state.get();
  // A new VM starts with an even share of the current budget so its first
  // puts compress; the next tick re-balances.
  if (host_.budget_fraction > 0) {  // (num_cpus is 1 until the first tick)
    const double period_ns = options_.sample_period_ms * 1e6;
    const auto share = static_cast<int64_t>(
        host_.budget_fraction * host_.num_cpus * period_ns /
        static_cast<double>(owned_.size() + 1));
    raw->tokens.store(share);
    raw->share.store(share);
  }
  owned_.push_back(std::move(state));
  by_slot_[SlotOf(vm)].store(raw, std::memory_order_release);
}

void Valve::RemoveVm(VmId vm) {
  MutexLock lock(&mu_);
  VmState* s = by_slot_[SlotOf(vm)].load(std::memory_order_acquire);
  if (s == nullptr || s->id != vm) return;
  by_slot_[SlotOf(vm)].store(nullptr, std::memory_order_release);
  std::erase_if(owned_, [s](const auto& p) { return p.get() == s; });
}

void Valve::SetVmPolicy(VmId vm, const VmPolicy& policy) {
  MutexLock lock(&mu_);
  VmState* s = Find(vm);
  if (s == nullptr) return;
  s->mode.store(static_cast<uint8_t>(policy.mode), std::memory_order_relaxed);
  s->swap_mode.store(static_cast<uint8_t>(policy.swap_mode),
                     std::memory_order_relaxed);
  s->weight.store(std::max<uint32_t>(policy.weight, 1),
                  std::memory_order_relaxed);
}

ValveMode Valve::EffectiveSwapMode(const VmState& s) const {
  auto mode =
      static_cast<ValveMode>(s.swap_mode.load(std::memory_order_relaxed));
  if (mode == ValveMode::kDefault) {
    mode = static_cast<ValveMode>(s.mode.load(std::memory_order_relaxed));
  }
  if (mode == ValveMode::kDefault) {
    mode =
        static_cast<ValveMode>(default_mode_.load(std::memory_order_relaxed));
  }
  return mode;
}

Valve::VmState* Valve::Find(VmId vm) const {
  if (SlotOf(vm) > kMaxVms) return nullptr;
  VmState* s = by_slot_[SlotOf(vm)].load(std::memory_order_acquire);
  return s != nullptr && s->id == vm ? s : nullptr;
}

PutMode Valve::Decide(VmId vm, uint64_t key_hash, bool guest_applies_hint) {
  VmState* s = Find(vm);
  if (s == nullptr) return PutMode::kCompress;
  auto mode = static_cast<ValveMode>(s->mode.load(std::memory_order_relaxed));
  if (mode == ValveMode::kDefault) {
    mode =
        static_cast<ValveMode>(default_mode_.load(std::memory_order_relaxed));
  }
  if (mode == ValveMode::kOff) {
    s->Count(ValveCounter::kDroppedOff);
    return PutMode::kDrop;
  }
  if (s->standing_aside.load(std::memory_order_relaxed)) {
    s->Count(ValveCounter::kDroppedAside);
    return PutMode::kDrop;
  }
  if (mode == ValveMode::kAlways) {
    s->CountPut(kAdmitAll, guest_applies_hint);
    s->admitted_puts.fetch_add(1, std::memory_order_relaxed);
    s->Count(ValveCounter::kCompressed);
    return PutMode::kCompress;
  }
  const uint32_t admission = s->admission.load(std::memory_order_relaxed);
  if (s->CountPut(admission, guest_applies_hint) >=
      s->judge_clock.load(std::memory_order_relaxed)) {
    JudgeAtThreshold(s);
  }
  if (admission < kAdmitAll && !guest_applies_hint) {
    // The guest ignores the hint: sample here, evenly (Bresenham), so the
    // VM sees the same rate a cooperating guest would apply.
    const uint64_t credit =
        s->sample_credit.fetch_add(admission, std::memory_order_relaxed) +
        admission;
    if (credit / kAdmitAll == (credit - admission) / kAdmitAll) {
      s->GhostInsert(key_hash);
      s->Count(ValveCounter::kDroppedReuse);
      return PutMode::kDrop;
    }
  }
  s->admitted_puts.fetch_add(1, std::memory_order_relaxed);
  if (s->throttled.load(std::memory_order_relaxed)) {
    // The sample a VM throttled for no reuse still sends is there to show
    // whether its pages start coming back. A ghost shows it as well as a
    // stored page (a get of the key within the VM's reach counts as reuse)
    // and costs the host no copy, no compression and no eviction. Storing
    // it would cost tmemd ~12 us per put of a streamer, mostly on the
    // streamer's own core: a few percent of its throughput on a saturated
    // host.
    s->GhostInsert(key_hash);
    s->Count(ValveCounter::kDroppedReuse);
    return PutMode::kDrop;
  }
  const int64_t tokens = s->tokens.load(std::memory_order_relaxed);
  if (tokens > 0) {
    s->Count(ValveCounter::kCompressed);
    return deferred_compression_.load(std::memory_order_relaxed)
               ? PutMode::kDefer
               : PutMode::kCompress;
  }
  // Out of tokens. The lever that saves real CPU is the admission hint
  // (Tick lowers it), so the guest stops sending; what still arrives is
  // stored raw -- the page is already copied out of the slot, a raw store is
  // one more memcpy -- unless memory is short, or the guest ignores the
  // hint and is a whole period's share in debt.
  s->starved.fetch_add(1, std::memory_order_relaxed);
  // Short of memory, a raw page would evict a compressed one -- but only a
  // VM holding its share of the cap evicts its own: one below it makes the
  // store evict from those above theirs (a throttled streamer first), so
  // its raw put stands.
  if (memory_tight_.load(std::memory_order_relaxed) &&
      s->held_pages.load(std::memory_order_relaxed) >=
          s->fair_pages.load(std::memory_order_relaxed)) {
    s->GhostInsert(key_hash);
    s->Count(ValveCounter::kDroppedMemory);
    return PutMode::kDrop;
  }
  if (!guest_applies_hint &&
      tokens <= -s->share.load(std::memory_order_relaxed)) {
    s->GhostInsert(key_hash);
    s->Count(ValveCounter::kDroppedCpu);
    return PutMode::kDrop;
  }
  s->Count(ValveCounter::kRaw);
  // Stored raw now for want of CPU; with deferred compression it is also
  // queued, so the compactor compresses it once the host has idle cycles
  // instead of leaving it raw for good -- at SCHED_IDLE even when memory is
  // tight (kDeferIdle): this VM has no tokens to pay for compressing it at
  // normal priority, and synchronous adaptive would not compress it either.
  return deferred_compression_.load(std::memory_order_relaxed)
             ? PutMode::kDeferIdle
             : PutMode::kRaw;
}

PutMode Valve::DecideSwap(VmId vm) {
  VmState* s = Find(vm);
  if (s == nullptr) return PutMode::kCompress;
  const ValveMode mode = EffectiveSwapMode(*s);
  if (mode == ValveMode::kOff) {
    s->Count(ValveCounter::kDroppedOff);
    return PutMode::kDrop;
  }
  // Deferred whatever deferred_compression says: the guest's write
  // completes once its page is copied, never waiting for LZ4.
  if (mode == ValveMode::kAlways ||
      s->tokens.load(std::memory_order_relaxed) > 0) {
    s->Count(ValveCounter::kCompressed);
    return PutMode::kDefer;
  }
  // Out of tokens: a memcpy now. The page is not dropped -- the guest
  // would read it from the image instead, at more host CPU and disk than
  // the raw store costs -- and its VM's demand shows in the next refill
  // (starved), as for a ring put.
  s->starved.fetch_add(1, std::memory_order_relaxed);
  s->Count(ValveCounter::kRaw);
  return PutMode::kDeferIdle;
}

void Valve::RecordGet(VmId vm, uint64_t key_hash, bool hit) {
  VmState* s = Find(vm);
  if (s == nullptr) return;
  if (hit) {
    s->useful_gets.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const std::optional<uint64_t> distance = s->GhostTake(key_hash);
  if (!distance) return;
  if (*distance <= s->reach_pages.load(std::memory_order_relaxed)) {
    s->useful_gets.fetch_add(1, std::memory_order_relaxed);
    s->Count(ValveCounter::kGhostHits);
  } else {
    s->Count(ValveCounter::kGhostHitsFar);
  }
}

void Valve::RecordEviction(VmId vm, uint64_t key_hash) {
  VmState* s = Find(vm);
  if (s != nullptr) s->GhostInsert(key_hash);
}

void Valve::ChargeCpu(VmId vm, int64_t nanos) {
  VmState* s = Find(vm);
  if (s == nullptr || nanos <= 0) return;
  s->tokens.fetch_sub(nanos, std::memory_order_relaxed);
  s->cpu_used.fetch_add(static_cast<uint64_t>(nanos),
                        std::memory_order_relaxed);
}

// What the host and tmemd used since the previous sample.
struct Valve::CpuDelta {
  int64_t dt;        // wall time
  uint64_t d_total;  // host CPU time, all cores
  uint64_t d_busy;   // of it, busy
  uint64_t d_agent;  // tmemd's
};

// An adaptive VM's claim on the period's token budget.
struct Valve::Claim {
  VmState* s;
  double used;
  double want;
  double weight;
  // Its cleancache mode is not adaptive (only its swap mode is): tokens
  // only, its admission stays what the mode fixes.
  bool admission_fixed = false;
  double give = 0;
};

void Valve::Tick(const CpuSample& sample, const MemorySample& memory) {
  MutexLock lock(&mu_);
  host_.num_cpus = std::max(sample.num_cpus, 1);
  ++host_.ticks;
  const std::optional<CpuDelta> delta = TakeCpuDelta(sample);
  if (!delta) return;
  UpdateUtilization(sample, *delta);
  UpdateBudget(sample);
  const double period_budget_ns = UpdateTokenBudget(*delta);
  UpdateMemoryHeadroom(memory);
  UpdateReach(memory);
  std::vector<Claim> claims = CollectClaims(period_budget_ns);
  WaterFill(claims, period_budget_ns);
  for (const Claim& c : claims) ApplyClaim(c);
}

std::optional<Valve::CpuDelta> Valve::TakeCpuDelta(const CpuSample& sample) {
  if (!have_sample_) {
    last_sample_ = sample;
    have_sample_ = true;
    return std::nullopt;
  }
  const int64_t dt = sample.wall_nanos - last_sample_.wall_nanos;
  const uint64_t d_total =
      sample.host_total_nanos - last_sample_.host_total_nanos;
  if (dt <= 0 || d_total == 0 ||
      sample.host_total_nanos < last_sample_.host_total_nanos) {
    last_sample_ = sample;
    return std::nullopt;
  }
  const uint64_t d_busy =
      sample.host_busy_nanos >= last_sample_.host_busy_nanos
          ? sample.host_busy_nanos - last_sample_.host_busy_nanos
          : 0;
  const uint64_t d_agent = sample.agent_nanos >= last_sample_.agent_nanos
                               ? sample.agent_nanos - last_sample_.agent_nanos
                               : 0;
  last_sample_ = sample;
  return CpuDelta{dt, d_total, d_busy, d_agent};
}

void Valve::UpdateUtilization(const CpuSample& sample, const CpuDelta& d) {
  // Host utilization, and tmemd's part of it, as shares of the whole host.
  const double busy = std::clamp(
      static_cast<double>(d.d_busy) / static_cast<double>(d.d_total), 0.0, 1.0);
  const double agent =
      std::clamp(static_cast<double>(d.d_agent) /
                     (static_cast<double>(d.dt) * host_.num_cpus),
                 0.0, 1.0);
  const double a = options_.smoothing;
  const bool first = host_.ticks <= 2;
  host_.host_busy_fraction =
      first ? busy : a * busy + (1 - a) * host_.host_busy_fraction;
  host_.agent_busy_fraction =
      first ? agent : a * agent + (1 - a) * host_.agent_busy_fraction;
  host_.cpu_pressure = sample.has_pressure ? sample.pressure_some_avg10 : 0;
}

void Valve::UpdateBudget(const CpuSample& sample) {
  // Budget: what the host does not use for anything but tmemd, scaled by
  // spare_cpu_fraction, capped by cpu_budget_percent, and shrunk when tasks
  // queue for CPU.
  const ValveOptions& o = options_;
  const double others =
      std::max(0.0, host_.host_busy_fraction - host_.agent_busy_fraction);
  double budget = std::min(o.cpu_budget_percent / 100.0,
                           (1.0 - others) * o.spare_cpu_fraction);
  if (sample.has_pressure && host_.cpu_pressure > o.cpu_pressure_start) {
    budget *=
        std::max(0.0, 1.0 - (host_.cpu_pressure - o.cpu_pressure_start) /
                                (o.cpu_pressure_full - o.cpu_pressure_start));
  }
  host_.budget_fraction = std::max(o.cpu_floor_percent / 100.0, budget);
}

double Valve::UpdateTokenBudget(const CpuDelta& d) {
  // tmemd's CPU that no VM was charged for comes out of the budget first,
  // so the budget bounds all of tmemd, not only its ring batches.
  const ValveOptions& o = options_;
  uint64_t charged_ns = 0;
  for (const auto& owned : owned_) {
    charged_ns += owned->cpu_used.load(std::memory_order_relaxed);
  }
  const uint64_t d_charged =
      charged_ns >= last_charged_ns_ ? charged_ns - last_charged_ns_ : 0;
  last_charged_ns_ = charged_ns;
  const double overhead = std::clamp(
      (static_cast<double>(d.d_agent) - static_cast<double>(d_charged)) /
          (static_cast<double>(d.dt) * host_.num_cpus),
      0.0, 1.0);
  const double a = o.smoothing;
  const bool first = host_.ticks <= 2;
  host_.overhead_fraction =
      first ? overhead : a * overhead + (1 - a) * host_.overhead_fraction;
  host_.token_fraction =
      std::max(o.cpu_floor_percent / 100.0,
               host_.budget_fraction - host_.overhead_fraction);
  return host_.token_fraction * host_.num_cpus * static_cast<double>(d.dt);
}

void Valve::UpdateMemoryHeadroom(const MemorySample& memory) {
  // Memory headroom (host-wide).
  if (memory.cap_bytes != 0) {
    const double free_fraction =
        1.0 - static_cast<double>(memory.used_bytes) /
                  static_cast<double>(memory.cap_bytes);
    memory_tight_.store(free_fraction < options_.memory_headroom_fraction,
                        std::memory_order_relaxed);
  }
}

void Valve::UpdateReach(const MemorySample& memory) {
  // Reach per VM: the pages its weighted share of the cap holds at what its
  // pages cost it now (raw pages until it holds enough to tell), or what
  // it holds, if more (others leave their share unused).
  if (memory.cap_bytes == 0) return;
  const uint64_t cap = memory.cap_bytes;
  double weights = 0;
  for (const auto& owned : owned_) {
    weights += owned->weight.load(std::memory_order_relaxed);
  }
  for (const auto& owned : owned_) {
    VmState* s = owned.get();
    auto page_bytes = static_cast<double>(kPageSize + kPageEntryCharge);
    uint64_t held = 0;
    if (auto use = memory.vms.find(s->id); use != memory.vms.end()) {
      held = use->second.pages_held;
      const uint64_t charged = use->second.charged_bytes;
      if (held >= kMinPagesForCost) {
        page_bytes = static_cast<double>(charged) / static_cast<double>(held);
      }
    }
    const double share = static_cast<double>(cap) *
                         s->weight.load(std::memory_order_relaxed) /
                         std::max(weights, 1.0);
    const auto reach = static_cast<uint64_t>(share / page_bytes);
    // Within the headroom of its share counts as holding it (a cap that
    // is full to the headroom leaves every VM that much short).
    s->fair_pages.store(
        static_cast<uint64_t>(static_cast<double>(reach) *
                              (1.0 - options_.memory_headroom_fraction)),
        std::memory_order_relaxed);
    s->held_pages.store(held, std::memory_order_relaxed);
    s->reach_pages.store(std::max(reach, held), std::memory_order_relaxed);
  }
}

std::vector<Valve::Claim> Valve::CollectClaims(double period_budget_ns) {
  // Demand per adaptive VM: what it used, or "everything" if it ran out of
  // tokens this period; WaterFill then splits the budget by it.
  const ValveOptions& o = options_;
  const double a = o.smoothing;
  std::vector<Claim> claims;
  const auto default_mode =
      static_cast<ValveMode>(default_mode_.load(std::memory_order_relaxed));
  for (auto& owned : owned_) {
    VmState* s = owned.get();
    auto mode = static_cast<ValveMode>(s->mode.load(std::memory_order_relaxed));
    if (mode == ValveMode::kDefault) mode = default_mode;
    const uint64_t used_total = s->cpu_used.load(std::memory_order_relaxed);
    const auto used = static_cast<double>(used_total - s->last_cpu_used);
    s->last_cpu_used = used_total;
    const bool starved = s->starved.exchange(0, std::memory_order_relaxed) > 0;
    s->demand_ns = a * used + (1 - a) * s->demand_ns;

    // Reuse window.
    const auto puts = static_cast<double>(
        s->admitted_puts.exchange(0, std::memory_order_relaxed));
    const auto useful = static_cast<double>(
        s->useful_gets.exchange(0, std::memory_order_relaxed));
    s->win_puts = s->win_puts * o.reuse_window_decay + puts;
    s->win_useful = s->win_useful * o.reuse_window_decay + useful;
    ++s->periods_in_state;
    const double want = starved ? period_budget_ns
                                : s->demand_ns * 1.25 + 0.01 * period_budget_ns;
    const auto weight =
        static_cast<double>(s->weight.load(std::memory_order_relaxed));
    if (mode != ValveMode::kAdaptive) {
      s->throttled.store(false, std::memory_order_relaxed);
      s->judge_clock.store(UINT64_MAX, std::memory_order_relaxed);
      s->admission.store(mode == ValveMode::kOff ? 0 : kAdmitAll,
                         std::memory_order_relaxed);
      // Its swap pages may still be adaptive: they store compressed or raw
      // by the VM's tokens, so it claims them, its admission left fixed.
      if (EffectiveSwapMode(*s) == ValveMode::kAdaptive) {
        claims.push_back({s, used, want, weight, /*admission_fixed=*/true});
      }
      continue;
    }
    JudgeReuse(s);
    claims.push_back({s, used, want, weight, /*admission_fixed=*/false});
  }
  return claims;
}

void Valve::JudgeReuse(VmState* s) {
  const ValveOptions& o = options_;
  const double ratio = s->ReuseRatio();
  if (!s->throttled.load(std::memory_order_relaxed)) {
    if (ShowsNoReuse(*s, s->win_puts, s->win_useful, o)) {
      s->ChangeState(true);
      s->Count(ValveCounter::kThrottleEvents);
    }
  } else if (ratio > o.restore_above &&
             s->periods_in_state >= o.min_dwell_periods) {
    s->ChangeState(false);
    s->Count(ValveCounter::kRestoreEvents);
  }
  // Arm the early judgement while the threshold lies ahead; past it,
  // the ticks judge.
  const uint64_t judge_after = s->JudgeAfterEvictions();
  s->judge_clock.store(
      !s->throttled.load(std::memory_order_relaxed) && judge_after > 0 &&
              s->EvictionsInState() < judge_after
          ? s->clock_at_state + judge_after * VmState::kClockUnit
          : UINT64_MAX,
      std::memory_order_relaxed);
}

void Valve::WaterFill(std::vector<Claim>& claims, double period_budget_ns) {
  // Water-fill the budget by weight: VMs that want less than their
  // weighted share get what they want, the rest is split among the others
  // (lending).
  double left = period_budget_ns;
  std::vector<Claim*> open;
  for (Claim& c : claims) open.push_back(&c);
  for (bool capped = true; capped && !open.empty();) {
    capped = false;
    double wsum = 0;
    for (Claim* c : open) wsum += c->weight;
    const double per_weight = left / wsum;
    for (auto it = open.begin(); it != open.end();) {
      if ((*it)->want <= per_weight * (*it)->weight) {
        (*it)->give = (*it)->want;
        left -= (*it)->want;
        it = open.erase(it);
        capped = true;
      } else {
        ++it;
      }
    }
  }
  double wsum = 0;
  for (Claim* c : open) wsum += c->weight;
  for (Claim* c : open) c->give = std::max(left, 0.0) * c->weight / wsum;
}

void Valve::ApplyClaim(const Claim& c) {
  const ValveOptions& o = options_;
  const auto give = static_cast<int64_t>(c.give);
  c.s->share.store(give, std::memory_order_relaxed);
  // CPU admission: a VM spending more than its share is told to send
  // less (multiplicative decrease, at most halving per period); one well
  // within it gets admission back (multiplicative increase).
  VmState* s = c.s;
  const double reuse = s->ReuseRatio();
  if (c.admission_fixed) {
    // Tokens only (below).
  } else if (c.used > c.give * 1.1 && reuse < kCpuCutExemptReuse) {
    const double factor = std::clamp(c.give / std::max(c.used, 1.0), 0.5, 1.0);
    s->cpu_admission =
        std::max<double>(o.min_admission, s->cpu_admission * factor);
  } else if (c.used < c.give * 0.8 || reuse >= kCpuCutExemptReuse) {
    s->cpu_admission =
        std::min<double>(kAdmitAll, s->cpu_admission * 1.5 + 256);
  }
  if (!c.admission_fixed) {
    const uint32_t reuse_admission =
        s->throttled.load(std::memory_order_relaxed) ? o.min_admission
                                                     : kAdmitAll;
    s->admission.store(
        std::min(reuse_admission, static_cast<uint32_t>(s->cpu_admission)),
        std::memory_order_relaxed);
  }
  // Refill, but never bank more than one period's share: an idle VM must
  // not save up a burst that blows the budget later. Debt carries over.
  int64_t cur = c.s->tokens.load(std::memory_order_relaxed);
  int64_t next;
  do {
    next = std::min(cur + give, give);
  } while (
      !c.s->tokens.compare_exchange_weak(cur, next, std::memory_order_relaxed));
}

bool Valve::ShowsNoReuse(const VmState& s, double puts, double useful,
                         const ValveOptions& o) {
  // Judged only on enough evidence: min_samples admitted puts in the
  // window, and a state held for min_dwell_periods. And only once its puts
  // could have come back (a re-read of more than the guest's RAM begins
  // only after that many evictions).
  const double ratio = puts > 0 ? useful / puts : 0;
  return puts >= static_cast<double>(o.min_samples) &&
         ratio < o.throttle_below &&
         s.periods_in_state >= o.min_dwell_periods &&
         s.EvictionsInState() >= s.JudgeAfterEvictions();
}

void Valve::JudgeAtThreshold(VmState* s) {
  // A worker's put: never wait for the tick (which then judges itself);
  // the next put tries again while the point stays armed.
  // Decide calls it on its adaptive path only (Tick disarms other modes).
  if (!mu_.TryLock()) return;
  s->judge_clock.store(UINT64_MAX, std::memory_order_relaxed);
  // The window as the next tick would see it, without its decay.
  const double puts =
      s->win_puts +
      static_cast<double>(s->admitted_puts.load(std::memory_order_relaxed));
  const double useful =
      s->win_useful +
      static_cast<double>(s->useful_gets.load(std::memory_order_relaxed));
  if (!s->throttled.load(std::memory_order_relaxed) &&
      ShowsNoReuse(*s, puts, useful, options_)) {
    s->ChangeState(true);
    s->Count(ValveCounter::kThrottleEvents);
    s->admission.store(std::min(options_.min_admission,
                                static_cast<uint32_t>(s->cpu_admission)),
                       std::memory_order_relaxed);
  }
  mu_.Unlock();
}

uint32_t Valve::AdmissionHint(VmId vm) const {
  VmState* s = Find(vm);
  if (s == nullptr) return kAdmitAll;
  auto mode = static_cast<ValveMode>(s->mode.load(std::memory_order_relaxed));
  if (mode == ValveMode::kDefault) {
    mode =
        static_cast<ValveMode>(default_mode_.load(std::memory_order_relaxed));
  }
  if (mode == ValveMode::kOff) return 0;
  if (s->standing_aside.load(std::memory_order_relaxed)) return 0;
  if (mode == ValveMode::kAlways) return kAdmitAll;
  return s->admission.load(std::memory_order_relaxed);
}

uint64_t Valve::ReachPages(VmId vm) const {
  VmState* s = Find(vm);
  if (s == nullptr) return 0;
  const uint64_t reach = s->reach_pages.load(std::memory_order_relaxed);
  return reach == UINT64_MAX ? 0 : reach;
}

bool Valve::ExpectsNoReuse(VmId vm) const {
  VmState* s = Find(vm);
  return s != nullptr && (s->throttled.load(std::memory_order_relaxed) ||
                          s->standing_aside.load(std::memory_order_relaxed));
}

void Valve::OnGuestStandingAside(uint32_t vm, bool aside) {
  VmState* s = Find(vm);
  if (s != nullptr) s->standing_aside.store(aside, std::memory_order_relaxed);
}

void Valve::OnGuestRamPages(uint32_t vm, uint64_t pages) {
  VmState* s = Find(vm);
  if (s != nullptr) s->guest_ram_pages.store(pages, std::memory_order_relaxed);
}

ValveVmStatus Valve::VmStatus(VmId vm) const {
  MutexLock lock(&mu_);
  ValveVmStatus out;
  VmState* s = Find(vm);
  if (s == nullptr) return out;
  out.mode = static_cast<ValveMode>(s->mode.load(std::memory_order_relaxed));
  out.effective_mode =
      out.mode == ValveMode::kDefault ? options_.default_mode : out.mode;
  out.swap_mode =
      static_cast<ValveMode>(s->swap_mode.load(std::memory_order_relaxed));
  out.effective_swap_mode = EffectiveSwapMode(*s);
  out.weight = s->weight.load(std::memory_order_relaxed);
  out.admission = AdmissionHint(vm);
  out.throttled = s->throttled.load(std::memory_order_relaxed);
  out.standing_aside = s->standing_aside.load(std::memory_order_relaxed);
  out.reach_pages = s->reach_pages.load(std::memory_order_relaxed);
  out.guest_ram_pages = s->guest_ram_pages.load(std::memory_order_relaxed);
  out.evictions_in_state = s->EvictionsInState();
  out.judge_after_evictions = s->JudgeAfterEvictions();
  out.reuse_ratio = s->ReuseRatio();
  out.cpu_tokens_ns = s->tokens.load(std::memory_order_relaxed);
  out.cpu_share_ns = s->share.load(std::memory_order_relaxed);
  out.cpu_used_ns = s->cpu_used.load(std::memory_order_relaxed);
  for (int i = 0; i < kNumValveCounters; ++i) {
    out.counters[i] = s->counters[i].load(std::memory_order_relaxed);
  }
  return out;
}

ValveHostStatus Valve::HostStatus() const {
  MutexLock lock(&mu_);
  return host_;
}

}  // namespace tmem
