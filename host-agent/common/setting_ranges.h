// SettingRanges: the one table of numeric ranges for tmemd's settings.
//
// Every place a number enters tmemd -- command-line flags, the TOML config
// file, the policy state file, gRPC requests, libvirt metadata -- checks it
// against the same entry here, so a value means the same and is refused the
// same way wherever it comes from. A value out of range (NaN included) is an
// error naming its source, never clamped.
//
// Quota and swap quota: 0 means "unlimited" everywhere (file, flag, state
// file, RPC, metadata, tmemctl); QuotaFromSetting turns it into
// kUnlimitedQuota. A VM that must store nothing is disabled (enabled =
// false), not given quota 0.
#ifndef TMEMD_HOST_AGENT_COMMON_SETTING_RANGES_H_
#define TMEMD_HOST_AGENT_COMMON_SETTING_RANGES_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "backend/types.h"

namespace tmem {

struct IntRange {
  std::string_view name;
  int64_t lo;
  int64_t hi;
};

struct DoubleRange {
  std::string_view name;
  double lo;
  double hi;
};

namespace ranges {
inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kPiB = int64_t{1} << 50;

// [store]
inline constexpr IntRange kMemoryCap{"memory_cap (bytes)", kMiB, kPiB};
inline constexpr IntRange kShards{"shards", 1, 4096};
inline constexpr IntRange kPoorCompressionThreshold{
    "poor_compression_threshold (bytes)", 1, 4096};
inline constexpr IntRange kMaxEvictionsPerPut{"max_evictions_per_put", 1,
                                              1 << 20};
// [channels]
inline constexpr IntRange kRegionSize{"region_size (bytes)", int64_t{64} << 10,
                                      int64_t{1} << 32};
inline constexpr IntRange kRingEntries{"ring_entries", 8, 4096};
inline constexpr IntRange kVectors{"vectors", 1, 16};
// [worker]
inline constexpr IntRange kWorkers{"workers (0: one per CPU)", 0, 64};
inline constexpr IntRange kPollUs{"poll_us", 0, 1000000};
inline constexpr IntRange kBatch{"batch", 1, 4096};
inline constexpr IntRange kIdleCheckMs{"idle_check_ms", 1, 10000};
// [valve]
inline constexpr DoubleRange kCpuBudgetPercent{"cpu_budget_percent", 0, 100};
inline constexpr DoubleRange kCpuFloorPercent{"cpu_floor_percent", 0, 100};
inline constexpr DoubleRange kSpareCpuFraction{"spare_cpu_fraction", 0, 1};
inline constexpr DoubleRange kCpuPressureStart{"cpu_pressure_start", 0, 100};
inline constexpr DoubleRange kCpuPressureFull{"cpu_pressure_full", 0, 100};
inline constexpr IntRange kSamplePeriodMs{"sample_period_ms", 10, 10000};
inline constexpr DoubleRange kSmoothing{"smoothing", 0.01, 1};
inline constexpr DoubleRange kThrottleBelow{"throttle_below", 0, 1};
inline constexpr DoubleRange kRestoreAbove{"restore_above", 0, 1};
inline constexpr IntRange kMinSamples{"min_samples", 0, 100000000};
inline constexpr IntRange kMinDwellPeriods{"min_dwell_periods", 0, 100000};
inline constexpr IntRange kMinAdmission{"min_admission", 1, 65536};
inline constexpr DoubleRange kMemoryHeadroomFraction{"memory_headroom_fraction",
                                                     0, 0.99};
// [log]
inline constexpr IntRange kStatsIntervalSeconds{
    "stats_interval_seconds (0: only at exit)", 0, 86400};
// [control]
inline constexpr IntRange kMetricsPort{"metrics_port (-1: off, 0: any)", -1,
                                       65535};
inline constexpr IntRange kMaxAdminConnections{"max_admin_connections", 1,
                                               65536};
inline constexpr IntRange kMaxReadonlyConnections{"max_readonly_connections", 1,
                                                  65536};
inline constexpr IntRange kMaxTcpConnections{"max_tcp_connections", 1, 65536};
inline constexpr IntRange kReservedVmChannels{"reserved_vm_channels", 0,
                                              100000};
// [libvirt]
inline constexpr IntRange kDetachTimeoutSeconds{"detach_timeout_seconds", 1,
                                                3600};
// [fleet]
inline constexpr IntRange kLeaseTtlSeconds{"lease_ttl_seconds", 2, 600};
// Per VM ([[vm]], state file, RPC, libvirt metadata).
inline constexpr IntRange kQuota{"quota (bytes; 0: unlimited)", 0, kPiB};
// The part of the quota swap pages may take (VmPolicy::swap_quota_bytes).
inline constexpr IntRange kSwapQuota{"swap quota (bytes; 0: unlimited)", 0,
                                     kPiB};
inline constexpr IntRange kWeight{"weight", 1, 1000000};
// A swap device: a positive multiple of 4096 (checked apart) up to 1 PiB.
inline constexpr IntRange kSwapSize{"swap size (bytes)", 4096, kPiB};
}  // namespace ranges

// OK if `value` lies in `range`; else INVALID_ARGUMENT
// "<source>: <name> must be in [lo, hi], got <value>".
absl::Status CheckRange(const IntRange& range, int64_t value,
                        std::string_view source);
// For unsigned inputs (a value above INT64_MAX is out of every range).
absl::Status CheckRange(const IntRange& range, uint64_t value,
                        std::string_view source);
// NaN and infinities are out of every range.
absl::Status CheckRange(const DoubleRange& range, double value,
                        std::string_view source);

// A quota setting (0: unlimited) as the store's quota.
inline uint64_t QuotaFromSetting(uint64_t bytes) {
  return bytes == 0 ? kUnlimitedQuota : bytes;
}

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_COMMON_SETTING_RANGES_H_
