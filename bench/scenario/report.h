// tmem-scenario's report: the runs aggregated into rows (medians over
// rounds per scenario/mode/VM), the targets judged from them (verdicts as
// bench/method.h forms them), and the outputs written to --out (text and
// Markdown tables, CSVs, the gnuplot PNG).
#ifndef TMEMD_BENCH_SCENARIO_REPORT_H_
#define TMEMD_BENCH_SCENARIO_REPORT_H_

#include <string>
#include <vector>

#include "bench/results_file.h"
#include "bench/scenario/config.h"
#include "bench/scenario/decide_cost.h"
#include "bench/scenario/report_rows.h"
#include "bench/scenario/runner.h"

namespace tmem::scenario {

std::vector<Row> Aggregate(const Config& c, const std::vector<RunResult>& runs,
                           int rounds);
std::vector<Target> Targets(const Config& c, const std::vector<Row>& rows,
                            const std::vector<RunResult>& runs, int rounds,
                            const DecideCost& dc);

std::string Table(const std::vector<Row>& rows);
std::string DeferredSection(const Config& c, const std::vector<Row>& rows);
std::string Markdown(const std::vector<Row>& rows);
std::string TargetsText(const std::vector<Target>& t);
std::string Csv(const std::vector<Row>& rows);
std::string RunsCsv(const std::vector<RunResult>& runs);
std::string TargetsCsv(const std::vector<Target>& t);
// The targets as results-file rows (bench/results_file.h): printed name,
// value, the unit its goal or measured text shows, bound, verdict, and the
// measured text as the note.
std::vector<bench::ResultRecord> TargetRecords(const std::vector<Target>& t);

// scenario.png in c.out (gnuplot); false if gnuplot failed or is missing.
bool Plot(const Config& c, const std::vector<Row>& rows);

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_REPORT_H_
