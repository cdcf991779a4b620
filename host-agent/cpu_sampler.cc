#include "host-agent/cpu_sampler.h"

#include <unistd.h>

#include <ctime>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tmem {
namespace {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

int64_t ClockNanos(clockid_t id) {
  timespec ts{};
  clock_gettime(id, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

}  // namespace

ProcCpuSampler::ProcCpuSampler(std::string stat_path, std::string pressure_path)
    : stat_path_(std::move(stat_path)),
      pressure_path_(std::move(pressure_path)) {}

absl::Status ProcCpuSampler::ParseStat(const std::string& text,
                                       uint64_t* busy_ns, uint64_t* total_ns) {
  const std::string first_line = text.substr(0, text.find('\n'));
  std::vector<absl::string_view> f =
      absl::StrSplit(first_line, ' ', absl::SkipEmpty());
  // cpu user nice system idle iowait irq softirq steal [guest guest_nice]
  if (f.size() < 9 || f[0] != "cpu") {
    return absl::InvalidArgumentError(
        "/proc/stat: first line is not the aggregate 'cpu' line");
  }
  uint64_t v[8];
  for (int i = 0; i < 8; ++i) {
    if (!absl::SimpleAtoi(f[i + 1], &v[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("/proc/stat: bad field '", f[i + 1], "'"));
    }
  }
  // guest time is already inside user; steal is time we did not get.
  const uint64_t idle = v[3] + v[4];
  const uint64_t total = v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
  static const long hz = sysconf(_SC_CLK_TCK);
  const uint64_t ns_per_tick = 1000000000ull / static_cast<uint64_t>(hz);
  *busy_ns = (total - idle) * ns_per_tick;
  *total_ns = total * ns_per_tick;
  return absl::OkStatus();
}

absl::StatusOr<double> ProcCpuSampler::ParsePressure(const std::string& text) {
  const size_t at = text.find("some avg10=");
  if (at == std::string::npos) {
    return absl::InvalidArgumentError("pressure: no 'some avg10=' field");
  }
  const size_t start = at + 11;
  const size_t end = text.find(' ', start);
  double value = 0;
  if (!absl::SimpleAtod(text.substr(start, end - start), &value)) {
    return absl::InvalidArgumentError("pressure: bad avg10 value");
  }
  return value;
}

absl::StatusOr<CpuSample> ProcCpuSampler::Sample() {
  CpuSample s;
  s.wall_nanos = ClockNanos(CLOCK_MONOTONIC);
  s.num_cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (s.num_cpus < 1) s.num_cpus = 1;
  absl::StatusOr<std::string> stat = ReadSmallFile(stat_path_);
  if (!stat.ok()) return stat.status();
  if (absl::Status st =
          ParseStat(*stat, &s.host_busy_nanos, &s.host_total_nanos);
      !st.ok()) {
    return st;
  }
  s.agent_nanos = static_cast<uint64_t>(ClockNanos(CLOCK_PROCESS_CPUTIME_ID));
  absl::StatusOr<std::string> pressure = ReadSmallFile(pressure_path_);
  if (pressure.ok()) {
    absl::StatusOr<double> p = ParsePressure(*pressure);
    if (p.ok()) {
      s.has_pressure = true;
      s.pressure_some_avg10 = *p;
    }
  }
  return s;
}

}  // namespace tmem
