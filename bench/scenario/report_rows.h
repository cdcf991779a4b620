// The scenario report's two building blocks, shared by the report files:
// a Row (medians over rounds for one scenario/mode/VM) and a Target (one
// verdict row: a measured value against a bound, PASS/FAIL/N/A, or "info"
// for a figure shown without a bound).
#ifndef TMEMD_BENCH_SCENARIO_REPORT_ROWS_H_
#define TMEMD_BENCH_SCENARIO_REPORT_ROWS_H_

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench/method.h"

namespace tmem::scenario {

struct Row {
  std::string scenario, mode, vm;
  int runs = 0;
  std::map<std::string, double> m;  // metric -> median
};

inline const Row* FindRow(const std::vector<Row>& rows, const std::string& s,
                          const std::string& mode, const std::string& vm) {
  for (const Row& r : rows) {
    if (r.scenario == s && r.mode == mode && r.vm == vm) return &r;
  }
  return nullptr;
}

// A row's median of `metric`; NaN when the row or the metric is missing.
inline double RowMetric(const std::vector<Row>& rows, const std::string& s,
                        const std::string& mode, const std::string& vm,
                        const std::string& metric) {
  const Row* r = FindRow(rows, s, mode, vm);
  if (r == nullptr) return std::nan("");
  auto it = r->m.find(metric);
  return it == r->m.end() ? std::nan("") : it->second;
}

struct Target {
  std::string name;
  std::string measured;  // human text
  double value = std::nan("");
  std::string goal;  // ">= 0.97"
  double bound = 0;
  bool at_least = true;
  bool info = false;
  bool Known() const { return !std::isnan(value); }
  bench::Goal GoalKind() const {
    if (info) return bench::Goal::kInfo;
    return at_least ? bench::Goal::kAtLeast : bench::Goal::kAtMost;
  }
  bool Pass() const {
    return Known() &&
           bench::Meets(at_least ? bench::Goal::kAtLeast : bench::Goal::kAtMost,
                        value, bound);
  }
  // bench/method.h's verdict: info, N/A (not measured), PASS or FAIL.
  std::string Verdict() const {
    return bench::VerdictName(
        bench::VerdictOf(GoalKind(), value, bound, /*disturbed=*/false));
  }
};

inline std::string Fmt(double v, const char* fmt = "%.3f") {
  if (std::isnan(v)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_REPORT_ROWS_H_
