// ProcCpuSampler: the real CpuSampler, from the kernel's own counters.
//
//  * host busy/total: the "cpu" line of /proc/stat (USER_HZ ticks; idle and
//    iowait count as not busy);
//  * CPU pressure: "some avg10" of /proc/pressure/cpu, when PSI exists;
//  * tmemd's own CPU: CLOCK_PROCESS_CPUTIME_ID (all threads).
// Paths are parameters so tests can point it at files of their own.
//
// Thread-compatible.
#ifndef TMEMD_HOST_AGENT_CPU_SAMPLER_H_
#define TMEMD_HOST_AGENT_CPU_SAMPLER_H_

#include <string>

#include "absl/status/statusor.h"
#include "backend/cpu_sample.h"

namespace tmem {

class ProcCpuSampler final : public CpuSampler {
 public:
  explicit ProcCpuSampler(std::string stat_path = "/proc/stat",
                          std::string pressure_path = "/proc/pressure/cpu");
  absl::StatusOr<CpuSample> Sample() override;

  // Parsers, exposed for tests.
  // The aggregate "cpu ..." line: busy and total nanoseconds.
  static absl::Status ParseStat(const std::string& text, uint64_t* busy_ns,
                                uint64_t* total_ns);
  // "some avg10=1.23 ..." -> 1.23.
  static absl::StatusOr<double> ParsePressure(const std::string& text);

 private:
  std::string stat_path_;
  std::string pressure_path_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CPU_SAMPLER_H_
