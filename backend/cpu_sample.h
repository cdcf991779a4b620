// CpuSample / CpuSampler: how host CPU use reaches the valve.
//
// A sample holds cumulative counters; the valve differences two samples.
// The real sampler (host-agent/cpu_sampler.h) reads /proc/stat,
// /proc/pressure/cpu and tmemd's own CPU clock; tests build samples by hand.
#ifndef TMEMD_BACKEND_CPU_SAMPLE_H_
#define TMEMD_BACKEND_CPU_SAMPLE_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace tmem {

struct CpuSample {
  int64_t wall_nanos = 0;          // monotonic time the sample was taken
  int num_cpus = 1;                // online CPUs
  uint64_t host_busy_nanos = 0;    // all CPUs, not idle/iowait (tmemd included)
  uint64_t host_total_nanos = 0;   // all CPUs, everything
  uint64_t agent_nanos = 0;        // tmemd's own CPU (all its threads)
  bool has_pressure = false;       // /proc/pressure/cpu exists (PSI)
  double pressure_some_avg10 = 0;  // percent of time some task waited on CPU
};

// Thread-compatible: one caller (the agent's valve ticker).
class CpuSampler {
 public:
  virtual ~CpuSampler() = default;
  virtual absl::StatusOr<CpuSample> Sample() = 0;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_CPU_SAMPLE_H_
