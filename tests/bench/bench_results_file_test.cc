// The benchmarks' results file (bench/results_file.h): a benchmark's
// record replaces its own section and nothing else, the file is replaced
// whole (never left torn or half-written, never clobbered when it is not a
// results file), values that were not measured are null, and any text
// survives the round trip.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "bench/results_file.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/temp_dir.h"

namespace tmem::bench {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

json ReadJson(const std::string& path) { return json::parse(ReadAll(path)); }

BenchmarkSection Section(const std::string& id, double value) {
  BenchmarkSection s;
  s.benchmark = id;
  s.command = id + " --quick";
  ResultRecord r;
  r.name = id + " row";
  r.value = value;
  r.unit = "x";
  r.goal = ">=";
  r.target = 1;
  r.verdict = value >= 1 ? "PASS" : "FAIL";
  s.rows.push_back(r);
  AssignRowIds(s.rows);
  return s;
}

class ResultsFileTest : public ::testing::Test {
 protected:
  testing::TempDir dir_{"results-file-test"};
  std::string path_ = dir_.path() + "/sub/latest.json";
};

TEST_F(ResultsFileTest, FirstRecordCreatesTheFileWithItsSection) {
  BenchmarkSection s = Section("ring", 1.5);
  s.warnings = {"put: WARNING: 3 puts refused"};
  ASSERT_TRUE(MergeResults(path_, s).ok());
  const json doc = ReadJson(path_);
  EXPECT_EQ(doc["schema"], kResultsSchema);
  ASSERT_TRUE(doc["benchmarks"].contains("ring"));
  const json& ring = doc["benchmarks"]["ring"];
  EXPECT_EQ(ring["command"], "ring --quick");
  EXPECT_EQ(ring["commit"], s.commit);
  EXPECT_EQ(ring["date"], s.date);
  EXPECT_EQ(ring["machine"]["cpus"], s.machine.cpus);
  EXPECT_GT(ring["machine"]["cpus"].get<int>(), 0);
  EXPECT_GT(ring["machine"]["mem_bytes"].get<uint64_t>(), 0u);
  EXPECT_FALSE(ring["machine"]["kernel"].get<std::string>().empty());
  ASSERT_EQ(ring["rows"].size(), 1u);
  const json& row = ring["rows"][0];
  EXPECT_EQ(row["id"], "ring-row");
  EXPECT_EQ(row["name"], "ring row");
  EXPECT_EQ(row["value"], 1.5);
  EXPECT_EQ(row["unit"], "x");
  EXPECT_EQ(row["goal"], ">=");
  EXPECT_EQ(row["target"], 1);
  EXPECT_EQ(row["verdict"], "PASS");
  EXPECT_EQ(ring["warnings"], json({"put: WARNING: 3 puts refused"}));
  // ISO-8601 UTC to the second.
  EXPECT_EQ(s.date.size(), 20u) << s.date;
  EXPECT_EQ(s.date[10], 'T');
  EXPECT_EQ(s.date.back(), 'Z');
}

TEST_F(ResultsFileTest, ARecordReplacesOnlyItsOwnSection) {
  ASSERT_TRUE(MergeResults(path_, Section("scenario", 0.9)).ok());
  ASSERT_TRUE(MergeResults(path_, Section("ring", 1.5)).ok());
  const json before = ReadJson(path_);
  ASSERT_TRUE(MergeResults(path_, Section("ring", 2.5)).ok());
  const json after = ReadJson(path_);
  EXPECT_EQ(after["benchmarks"]["scenario"], before["benchmarks"]["scenario"]);
  EXPECT_EQ(after["benchmarks"]["ring"]["rows"][0]["value"], 2.5);
  EXPECT_EQ(after["benchmarks"].size(), 2u);
  // A section a newer program version added (unknown keys) is kept too.
  json doc = after;
  doc["benchmarks"]["other"] = {{"future_field", 7}};
  std::ofstream(path_) << doc.dump();
  ASSERT_TRUE(MergeResults(path_, Section("ring", 3.5)).ok());
  EXPECT_EQ(ReadJson(path_)["benchmarks"]["other"]["future_field"], 7);
}

TEST_F(ResultsFileTest, NotMeasuredIsNull) {
  BenchmarkSection s = Section("micro", std::nan(""));
  ResultRecord info;
  info.name = "floor";
  info.value = std::numeric_limits<double>::infinity();
  info.verdict = "info";
  s.rows.push_back(info);
  AssignRowIds(s.rows);
  ASSERT_TRUE(MergeResults(path_, s).ok());
  const std::string text = ReadAll(path_);
  for (const char* bad : {": NaN", ": nan", ": inf", ": -inf", ": Infinity"}) {
    EXPECT_EQ(text.find(bad), std::string::npos) << bad << "\n" << text;
  }
  ASSERT_TRUE(json::accept(text)) << text;
  const json rows = json::parse(text)["benchmarks"]["micro"]["rows"];
  EXPECT_TRUE(rows[0]["value"].is_null());
  EXPECT_TRUE(rows[1]["value"].is_null());
  EXPECT_TRUE(rows[1]["target"].is_null());  // info: no target
  EXPECT_EQ(rows[1]["goal"], "info");
}

TEST_F(ResultsFileTest, AnyTextSurvivesTheRoundTrip) {
  BenchmarkSection s = Section("scenario", 1);
  const std::string nasty =
      "quote \" backslash \\ newline \n tab \t ctl \x01 pipe | <a> & "
      "unicode \xc3\xa9";
  s.command = nasty;
  s.rows[0].note = nasty;
  s.rows[0].name = nasty;
  s.rows[0].id = "nasty";
  s.warnings = {nasty};
  ASSERT_TRUE(MergeResults(path_, s).ok());
  const json sec = ReadJson(path_)["benchmarks"]["scenario"];
  EXPECT_EQ(sec["command"], nasty);
  EXPECT_EQ(sec["rows"][0]["note"], nasty);
  EXPECT_EQ(sec["rows"][0]["name"], nasty);
  EXPECT_EQ(sec["warnings"][0], nasty);
  // Bytes that are not UTF-8 do not lose the record: they become U+FFFD.
  s.rows[0].note = "bad \xff byte";
  ASSERT_TRUE(MergeResults(path_, s).ok());
  EXPECT_EQ(ReadJson(path_)["benchmarks"]["scenario"]["rows"][0]["note"],
            "bad \xef\xbf\xbd byte");
}

TEST_F(ResultsFileTest, AFileThatIsNotAResultsFileIsRefusedAndKept) {
  fs::create_directories(fs::path(path_).parent_path());
  for (const std::string garbage :
       {"not json {", "[1, 2]", "{\"schema\": 1}", "{\"benchmarks\": 3}"}) {
    std::ofstream(path_) << garbage;
    const absl::Status st = MergeResults(path_, Section("ring", 1));
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << garbage;
    EXPECT_EQ(ReadAll(path_), garbage);
  }
}

TEST_F(ResultsFileTest, BadSectionsAreRefusedAndChangeNothing) {
  ASSERT_TRUE(MergeResults(path_, Section("ring", 1)).ok());
  const std::string before = ReadAll(path_);
  BenchmarkSection unnamed = Section("x", 1);
  unnamed.benchmark = "";
  EXPECT_EQ(MergeResults(path_, unnamed).code(),
            absl::StatusCode::kInvalidArgument);
  BenchmarkSection twice = Section("micro", 1);
  twice.rows.push_back(twice.rows[0]);  // same id
  EXPECT_EQ(MergeResults(path_, twice).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadAll(path_), before);
}

TEST_F(ResultsFileTest, TheFileIsReplacedWholeAndNoTemporaryIsLeft) {
  ASSERT_TRUE(MergeResults(path_, Section("ring", 1)).ok());
  // A reader holding the old file keeps reading the old file: the new one
  // arrives by rename, not by rewriting the old one in place.
  std::ifstream held(path_);
  ASSERT_TRUE(held.good());
  ASSERT_TRUE(MergeResults(path_, Section("micro", 2)).ok());
  std::stringstream old_text;
  old_text << held.rdbuf();
  EXPECT_FALSE(json::parse(old_text.str())["benchmarks"].contains("micro"));
  EXPECT_TRUE(ReadJson(path_)["benchmarks"].contains("micro"));
  for (const auto& e : fs::directory_iterator(fs::path(path_).parent_path())) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "latest.json" || name == "latest.json.lock") << name;
  }
}

// Several processes recording different sections at once: every section is
// there at the end (the read-modify-write is serialized), and the file
// parses after every step.
TEST_F(ResultsFileTest, ConcurrentRecordsKeepEverySection) {
  constexpr int kWriters = 6;
  constexpr int kRecordsEach = 10;
  ASSERT_TRUE(MergeResults(path_, Section("seed", 1)).ok());
  std::vector<pid_t> pids;
  for (int w = 0; w < kWriters; ++w) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (int i = 0; i < kRecordsEach; ++i) {
        const BenchmarkSection s = Section("writer" + std::to_string(w), i);
        if (!MergeResults(path_, s).ok()) _exit(1);
        if (!json::accept(ReadAll(path_))) _exit(2);
      }
      _exit(0);
    }
    pids.push_back(pid);
  }
  for (const pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  const json doc = ReadJson(path_);
  EXPECT_EQ(doc["benchmarks"].size(), kWriters + 1u);
  for (int w = 0; w < kWriters; ++w) {
    EXPECT_EQ(
        doc["benchmarks"]["writer" + std::to_string(w)]["rows"][0]["value"],
        kRecordsEach - 1);
  }
}

TEST(RowSlugTest, StableLowerCaseDashes) {
  EXPECT_EQ(RowSlug("put LZ4 path / LZ4_compress_default"),
            "put-lz4-path-lz4-compress-default");
  EXPECT_EQ(
      RowSlug("  get round trip p99: ring, worker polling (poll_us 1 s) "),
      "get-round-trip-p99-ring-worker-polling-poll-us-1-s");
  EXPECT_EQ(RowSlug("tmemd CPU / (wall x cores), adaptive, worst run"),
            "tmemd-cpu-wall-x-cores-adaptive-worst-run");
  EXPECT_EQ(RowSlug("\xc3\xa9t\xc3\xa9"), "t");
  EXPECT_EQ(RowSlug("%%"), "");
}

TEST(RowSlugTest, RepeatedIdsGetSuffixesInOrder) {
  std::vector<ResultRecord> rows(4);
  rows[0].name = "a b";
  rows[1].name = "A-B";
  rows[2].name = "c";
  rows[3].name = "a: b";
  AssignRowIds(rows);
  EXPECT_EQ(rows[0].id, "a-b");
  EXPECT_EQ(rows[1].id, "a-b-2");
  EXPECT_EQ(rows[2].id, "c");
  EXPECT_EQ(rows[3].id, "a-b-3");
}

TEST(CommandLineTest, QuotesWhatAShellWouldSplit) {
  const char* argv[] = {
      "tmem_ring_bench", "--sections", "put1,get_poll", "a b", "it's", ""};
  EXPECT_EQ(CommandLine(6, argv),
            "tmem_ring_bench --sections put1,get_poll 'a b' 'it'\\''s' ''");
}

TEST(CommandLineTest, PathsUnderTheRepositoryAreRelative) {
  setenv("TMEM_REPO_ROOT", "/src/tmemd", 1);  // NOLINT(concurrency-mt-unsafe)
  const char* argv[] = {"/src/tmemd/build/release/bench/tmem_ring_bench",
                        "--results", "/src/tmemd/bench/results/latest.json",
                        "/elsewhere/x"};
  EXPECT_EQ(CommandLine(4, argv),
            "build/release/bench/tmem_ring_bench --results "
            "bench/results/latest.json /elsewhere/x");
  unsetenv("TMEM_REPO_ROOT");  // NOLINT(concurrency-mt-unsafe)
}

}  // namespace
}  // namespace tmem::bench
