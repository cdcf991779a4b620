// Runs tmem-scenario (the scenario benchmark) in a tiny configuration and
// checks that it produces well-formed, sane output: every scenario/mode/VM
// row in the CSV, throughputs and hit ratios in range, "off" storing
// nothing, "always" hitting on the re-read working set, the targets listed
// and recorded in the results file (--results) as printed; and deferred
// compression's idle/phases scenarios with the compactor's figures.
// Performance targets are the benchmark's business, never this test's.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace {

namespace fs = std::filesystem;

std::string ReadAll(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A CSV line's fields; a quoted field may hold commas (targets.csv quotes
// names and texts, never numbers; no field holds a quote).
std::vector<std::string> SplitCsvLine(const std::string& line) {
  std::vector<std::string> cells(1);
  bool quoted = false;
  for (const char c : line) {
    if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      cells.emplace_back();
    } else {
      cells.back() += c;
    }
  }
  return cells;
}

// CSV rows as maps from header name to field.
std::vector<std::map<std::string, std::string>> ReadCsv(const fs::path& p) {
  std::vector<std::map<std::string, std::string>> rows;
  std::ifstream f(p);
  std::string line;
  if (!std::getline(f, line)) return rows;
  const std::vector<std::string> header = SplitCsvLine(line);
  while (std::getline(f, line)) {
    const std::vector<std::string> cells = SplitCsvLine(line);
    EXPECT_EQ(cells.size(), header.size()) << line;
    std::map<std::string, std::string> row;
    for (size_t i = 0; i < header.size() && i < cells.size(); ++i) {
      row[header[i]] = cells[i];
    }
    rows.push_back(row);
  }
  return rows;
}

double D(const std::map<std::string, std::string>& row, const char* key) {
  auto it = row.find(key);
  return it == row.end() ? -1 : std::strtod(it->second.c_str(), nullptr);
}

// Runs tmem-scenario with `flags` (${OUT} standing for the directory) into a
// fresh directory named after `tag` and asserts it exited 0; returns the
// directory.
fs::path RunScenario(const std::string& tag, const std::string& flags) {
  fs::path out = fs::temp_directory_path() / absl::StrCat(tag, "-", getpid());
  fs::remove_all(out);
  const std::string cmd = absl::StrCat(
      SCENARIO_BIN, " ", absl::StrReplaceAll(flags, {{"${OUT}", out.string()}}),
      " --out ", out.string(), " > ", (out / "stdout.txt").string(), " 2>&1");
  fs::create_directories(out);
  // The test is single-threaded: system() is safe here.
  const int status = std::system(cmd.c_str());  // NOLINT(concurrency-mt-unsafe)
  EXPECT_TRUE(WIFEXITED(status)) << cmd;
  EXPECT_EQ(WEXITSTATUS(status), 0) << ReadAll(out / "stdout.txt");
  return out;
}

// The results file's section for the run in `out` (--results
// out/latest.json): one row per line of targets.csv, with the same value
// and verdict, ids unique, and the run's machine, date and command.
void ExpectTargetsRecorded(const fs::path& out, const std::string& section) {
  const nlohmann::json doc =
      nlohmann::json::parse(ReadAll(out / "latest.json"), nullptr, false);
  ASSERT_TRUE(doc.is_object()) << ReadAll(out / "latest.json");
  EXPECT_EQ(doc["schema"], 1);
  ASSERT_EQ(doc["benchmarks"].size(), 1u) << doc.dump(2);
  ASSERT_TRUE(doc["benchmarks"].contains(section)) << doc.dump(2);
  const nlohmann::json& sec = doc["benchmarks"][section];
  EXPECT_GT(sec["machine"]["cpus"].get<int>(), 0);
  EXPECT_FALSE(sec["date"].get<std::string>().empty());
  EXPECT_NE(sec["command"].get<std::string>().find("--results"),
            std::string::npos);
  const auto targets = ReadCsv(out / "targets.csv");
  const nlohmann::json& rows = sec["rows"];
  ASSERT_EQ(rows.size(), targets.size()) << sec.dump(2);
  std::set<std::string> ids;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& t = targets[i];
    const nlohmann::json& r = rows[i];
    SCOPED_TRACE(r.dump());
    EXPECT_TRUE(ids.insert(r["id"].get<std::string>()).second);
    EXPECT_EQ(r["name"], t.at("target"));
    EXPECT_EQ(r["note"], t.at("measured"));
    EXPECT_EQ(r["verdict"], t.at("verdict"));
    const std::string v = t.at("verdict");
    EXPECT_TRUE(v == "PASS" || v == "FAIL" || v == "N/A" || v == "info") << v;
    if (t.at("value") == "n/a") {
      EXPECT_TRUE(r["value"].is_null());
    } else {
      ASSERT_TRUE(r["value"].is_number());
      EXPECT_NEAR(r["value"].get<double>(), D(t, "value"),
                  1e-5 * std::abs(D(t, "value")) + 1e-9);
    }
    if (v == "info") {
      EXPECT_EQ(r["goal"], "info");
    } else {
      EXPECT_TRUE(r["goal"] == ">=" || r["goal"] == "<=" || r["goal"] == "<");
      EXPECT_TRUE(r["target"].is_number());
    }
  }
}

TEST(ScenarioToolTest, TinyRunProducesSaneTableCsvAndTargets) {
  const fs::path out = RunScenario(
      "tmem-scenario-test",
      "--rounds 1 --duration 0.6 --memory-cap 16MiB --cache-pages 256"
      " --working-set 768 --stream-hogs 0 --corpus-pages 64"
      " --micro-rounds 1 --progress 0 --no-plot --results "
      "${OUT}/latest.json");
  if (::testing::Test::HasFailure()) return;

  const std::string text = ReadAll(out / "scenario.txt");
  EXPECT_NE(text.find("targets:"), std::string::npos) << text;
  EXPECT_NE(text.find("0 run(s) failed"), std::string::npos) << text;

  const auto rows = ReadCsv(out / "scenario.csv");
  // stream x 4 modes, reread x 4, both (2 VMs) x 4.
  ASSERT_EQ(rows.size(), 16u) << ReadAll(out / "scenario.csv");
  for (const auto& r : rows) {
    SCOPED_TRACE(
        absl::StrCat(r.at("scenario"), "/", r.at("mode"), "/", r.at("vm")));
    EXPECT_EQ(r.at("runs"), "1");
    EXPECT_GT(D(r, "mb_per_s"), 0);
    EXPECT_LT(D(r, "mb_per_s"), 1e5);
    EXPECT_GE(D(r, "hit_ratio"), 0);
    EXPECT_LE(D(r, "hit_ratio"), 1);
    EXPECT_GE(D(r, "tmemd_cpu_s"), 0);
    EXPECT_GE(D(r, "tmemd_cpu_frac"), 0);
    EXPECT_LE(D(r, "tmemd_cpu_frac"), 1.05);
    EXPECT_GT(D(r, "pages_read"), 0);
    EXPECT_LE(D(r, "tmem_hits"), D(r, "tmem_gets"));
    if (r.at("mode") == "none") {
      // No tmem at all: no gets, nothing stored.
      EXPECT_EQ(D(r, "tmem_gets"), 0);
      EXPECT_EQ(D(r, "pages"), 0);
    }
    if (r.at("mode") == "off") {
      // Nothing stored, nothing hit; the valve counted no compression.
      EXPECT_EQ(D(r, "pages"), 0);
      EXPECT_EQ(D(r, "hit_ratio"), 0);
      EXPECT_EQ(D(r, "valve_compressed"), 0);
    }
    if (r.at("mode") == "always") {
      EXPECT_EQ(D(r, "valve_raw") + D(r, "valve_dropped_cpu") +
                    D(r, "valve_dropped_reuse"),
                0);
      EXPECT_GT(D(r, "valve_compressed"), 0);
      if (r.at("vm") == "reread" && r.at("scenario") == "reread") {
        EXPECT_GT(D(r, "hit_ratio"), 0.2);  // working set fits in tmem
      }
    }
  }

  const auto runs = ReadCsv(out / "runs.csv");
  EXPECT_EQ(runs.size(), 16u);
  for (const auto& r : runs) EXPECT_EQ(r.at("ok"), "1");

  const std::string targets = ReadAll(out / "targets.csv");
  EXPECT_EQ(std::count(targets.begin(), targets.end(), '\n'), 8) << targets;
  EXPECT_NE(targets.find("Decide"), std::string::npos);
  ExpectTargetsRecorded(out, "scenario");
  fs::remove_all(out);
}

// Deferred compression's scenarios and rows: idle and phases, each mode a row
// with the compactor's figures, the deferred targets listed for deferred and
// for the synchronous valve.
TEST(ScenarioToolTest, DeferredScenariosProduceCompactorRowsAndTargets) {
  const fs::path out = RunScenario(
      "tmem-scenario-deferred-test",
      "--rounds 1 --duration 0.6 --memory-cap 16MiB --cache-pages 256"
      " --working-set 768 --corpus-pages 64 --micro-rounds -1 --progress 0"
      " --no-plot --scenarios idle,phases --modes always,adaptive,deferred"
      " --results ${OUT}/latest.json");
  if (::testing::Test::HasFailure()) return;

  const std::string text = ReadAll(out / "scenario.txt");
  EXPECT_NE(text.find("\ndeferred compression: ratio:"), std::string::npos)
      << text;

  const auto rows = ReadCsv(out / "scenario.csv");
  // idle x 3 modes, phases x 3 modes, one VM (reread) each.
  ASSERT_EQ(rows.size(), 6u) << ReadAll(out / "scenario.csv");
  for (const auto& r : rows) {
    SCOPED_TRACE(absl::StrCat(r.at("scenario"), "/", r.at("mode")));
    EXPECT_EQ(r.at("vm"), "reread");
    EXPECT_EQ(r.at("runs"), "1");
    if (r.at("mode") == "deferred") {
      EXPECT_LE(D(r, "compact_within_2s"), D(r, "compact_compressed"));
      // What the share is over: at least the compressed pages.
      EXPECT_GE(D(r, "compact_owed"), D(r, "compact_compressed"));
    } else {
      // Synchronous modes never queue a page for the compactor.
      EXPECT_EQ(D(r, "compact_compressed"), 0);
      EXPECT_EQ(r.at("compact_share_2s"), "n/a");
    }
    if (r.at("scenario") == "phases") {
      // At least 8 s measured in 2 s periods: 3 switches or more.
      EXPECT_GE(D(r, "phase_switches"), 3);
      EXPECT_GE(D(r, "busy_tmemd_cpu_frac"), 0);
      EXPECT_LE(D(r, "busy_tmemd_cpu_frac"), 1.05);
      EXPECT_GE(D(r, "idle_tmemd_cpu_frac"), 0);
      EXPECT_LE(D(r, "idle_tmemd_cpu_frac"), 1.05);
    } else {
      EXPECT_EQ(r.at("phase_switches"), "n/a");
    }
  }

  const std::string targets = ReadAll(out / "targets.csv");
  // 7 rows of the valve's targets, 6 of deferred compression's, the header.
  EXPECT_EQ(std::count(targets.begin(), targets.end(), '\n'), 14) << targets;
  for (const char* row :
       {"idle: deferred pages compressed within 2 s",
        "idle: compression ratio, synchronous adaptive / always",
        "phases (busy/idle every 2 s): hit ratio deferred / adaptive",
        "phases: tmemd CPU in busy phases, deferred, worst run"}) {
    EXPECT_NE(targets.find(row), std::string::npos) << row;
  }
  ExpectTargetsRecorded(out, "scenario-deferred");
  fs::remove_all(out);
}

}  // namespace
