// Deferred compression in the scenario report: the compactor (mode
// `deferred`) beside the synchronous valve (`adaptive`) and `always`/`none`.
//
// Per run, DeferredMetrics turns tmemd's compactor_stats line, its
// steady-state compression ratio and (scenario `phases`) tmemd's CPU per
// busy/idle phase into named metrics; the scenario medians them over rounds
// like its other metrics. DeferredTargets then gives the verdict
// rows, each for `deferred` and, as "the same table for the current valve",
// for synchronous `adaptive`:
//   idle    >= 95% of the compactor's pages compressed within 2 s of their
//           put; compression ratio >= 0.95x of `always` (same rounds);
//   phases  re-read hit ratio >= synchronous adaptive's; tmemd's CPU over
//           the busy phases (worst run) <= the CPU budget, of the host;
//   stream  throughput >= 0.98x of `none` (median of per-round ratios).
// "Within 2 s" counts pages the compactor compressed in time over the
// stored pages that should have been compressed: compressed (in time or
// late) + no_room (no memory for the block) + queue overflows (never
// queued) + the valve's raw decisions (out of CPU: stored raw, never
// queued). Pages read, invalidated, evicted or re-put before their turn are
// left out (not stored long enough to compress), and so are pages LZ4
// could not shrink (kept_raw: raw in every mode). Synchronous modes
// compress in the put, so the share is N/A for them.
#ifndef TMEMD_BENCH_SCENARIO_DEFERRED_REPORT_H_
#define TMEMD_BENCH_SCENARIO_DEFERRED_REPORT_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/scenario/host_phases.h"
#include "bench/scenario/report_rows.h"
#include "bench/scenario/tmemd_log.h"

namespace tmem::scenario {

// Names of the metrics DeferredMetrics fills, in table order.
const std::vector<std::string>& DeferredMetricNames();

// `phases`: null outside the phases scenario (its metrics are then NaN).
std::map<std::string, double> DeferredMetrics(const TmemdLog& log,
                                              const PhaseTotals* phases,
                                              int cpus);

// The worst (largest) value of `metric` over the successful runs of
// scenario/mode; NaN when there is none.
using WorstOf =
    std::function<double(const std::string& scenario, const std::string& mode,
                         const std::string& metric)>;

// Empty unless `modes` has "deferred"; only scenarios that ran get rows.
std::vector<Target> DeferredTargets(const std::vector<std::string>& scenarios,
                                    const std::vector<std::string>& modes,
                                    const std::vector<Row>& rows,
                                    const WorstOf& worst,
                                    double cpu_budget_percent);

// The compactor's figures per scenario/mode (medians), or "" when neither
// `deferred` nor an idle/phases scenario ran.
std::string DeferredTable(const std::vector<std::string>& scenarios,
                          const std::vector<std::string>& modes,
                          const std::vector<Row>& rows);

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_DEFERRED_REPORT_H_
