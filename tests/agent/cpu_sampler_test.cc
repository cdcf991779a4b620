// ProcCpuSampler: parsing of /proc/stat and /proc/pressure/cpu, and a live
// sample of this machine.
#include "host-agent/cpu_sampler.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

namespace tmem {
namespace {

TEST(CpuSamplerTest, ParsesTheAggregateCpuLine) {
  uint64_t busy = 0, total = 0;
  // user nice system idle iowait irq softirq steal guest guest_nice
  ASSERT_TRUE(ProcCpuSampler::ParseStat(
                  "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 1 2 3 4 5 6 7 8\n",
                  &busy, &total)
                  .ok());
  const uint64_t tick =
      1000000000ull / static_cast<uint64_t>(sysconf(_SC_CLK_TCK));
  EXPECT_EQ(total, (100 + 5 + 50 + 800 + 40 + 3 + 2 + 0) * tick);
  EXPECT_EQ(busy, (100 + 5 + 50 + 3 + 2) * tick);  // idle+iowait are not busy
}

TEST(CpuSamplerTest, RejectsGarbage) {
  uint64_t busy = 0, total = 0;
  EXPECT_FALSE(ProcCpuSampler::ParseStat("", &busy, &total).ok());
  EXPECT_FALSE(
      ProcCpuSampler::ParseStat("cpu0 1 2 3 4 5 6 7 8\n", &busy, &total).ok());
  EXPECT_FALSE(
      ProcCpuSampler::ParseStat("cpu 1 2 x 4 5 6 7 8\n", &busy, &total).ok());
  EXPECT_FALSE(ProcCpuSampler::ParsePressure("full avg10=1.0").ok());
  EXPECT_FALSE(ProcCpuSampler::ParsePressure("some avg10=abc avg60=0").ok());
}

TEST(CpuSamplerTest, ParsesPressure) {
  absl::StatusOr<double> p = ProcCpuSampler::ParsePressure(
      "some avg10=12.34 avg60=1.00 avg300=0.50 total=123456\n"
      "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n");
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ(*p, 12.34);
}

TEST(CpuSamplerTest, MissingPressureFileIsNotAnError) {
  ProcCpuSampler s("/proc/stat", "/nonexistent/pressure");
  absl::StatusOr<CpuSample> a = s.Sample();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->has_pressure);
}

TEST(CpuSamplerTest, MissingStatFileIsAnError) {
  ProcCpuSampler s("/nonexistent/stat", "/nonexistent/pressure");
  EXPECT_FALSE(s.Sample().ok());
}

TEST(CpuSamplerTest, LiveSamplesMoveForward) {
  ProcCpuSampler s;
  absl::StatusOr<CpuSample> a = s.Sample();
  ASSERT_TRUE(a.ok()) << a.status();
  // Burn some CPU so tmemd's (this process's) clock moves.
  volatile uint64_t x = 0;
  for (int i = 0; i < 20000000; ++i) x = x + static_cast<uint64_t>(i);
  usleep(20000);
  absl::StatusOr<CpuSample> b = s.Sample();
  ASSERT_TRUE(b.ok());
  EXPECT_GE(a->num_cpus, 1);
  EXPECT_GT(b->wall_nanos, a->wall_nanos);
  EXPECT_GE(b->host_total_nanos, a->host_total_nanos);
  EXPECT_LE(b->host_busy_nanos - a->host_busy_nanos,
            b->host_total_nanos - a->host_total_nanos);
  EXPECT_GT(b->agent_nanos, a->agent_nanos);
}

}  // namespace
}  // namespace tmem
