#include "bench/bench_support.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace tmem::bench {
namespace {

[[noreturn]] void Die(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "bench setup failed: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  // Setup runs before any benchmark thread exists.
  std::exit(2);  // NOLINT(concurrency-mt-unsafe)
}

std::string Format(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

// Numbers in the table: enough digits to compare, no more.
std::string Num(double v) {
  if (v == 0) return "-";
  if (v >= 1000) return Format("%.0f", v);
  if (v >= 100) return Format("%.1f", v);
  if (v >= 10) return Format("%.2f", v);
  return Format("%.3f", v);
}

std::string CsvQuote(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string MarkdownEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::unique_ptr<TmemStore> NewBenchStore(uint64_t cap_bytes) {
  StoreOptions options;
  options.memory_cap_bytes = cap_bytes;
  options.address_space_bytes = cap_bytes;
  absl::StatusOr<std::unique_ptr<TmemStore>> store = TmemStore::Create(options);
  if (!store.ok()) Die("TmemStore::Create", store.status());
  return *std::move(store);
}

BenchStore::BenchStore(int num_vms, uint64_t cap_bytes) {
  store_ = NewBenchStore(cap_bytes);
  for (int i = 0; i < num_vms; ++i) {
    absl::StatusOr<VmId> vm =
        store_->AddVm("bench-vm-" + std::to_string(i), VmPolicy{});
    if (!vm.ok()) Die("AddVm", vm.status());
    absl::StatusOr<PoolId> pool = store_->NewPool(*vm, nullptr);
    if (!pool.ok()) Die("NewPool", pool.status());
    vms_.push_back(*vm);
    pools_.push_back(*pool);
  }
}

void AddResidentPopulation(BenchStore& s, int vm, const PageSet& set,
                           uint64_t pages) {
  if (set.empty()) return;
  for (uint64_t k = 0; k < pages; ++k) {
    s.Put(vm, kResidentKeyBase + k, set[k % set.size()].view());
  }
  SplitMix64 rng(0x686f6c6573);  // "holes"
  for (uint64_t k = 0; k < pages; ++k) {
    if (rng.Below(2) == 0) continue;
    const uint64_t key = kResidentKeyBase + k;
    absl::Status st = s.store().InvalidatePage(s.vm(vm), s.pool(vm),
                                               KeyObject(key), KeyIndex(key));
    if (!st.ok()) Die("InvalidatePage", st);
  }
}

std::string ResultRow::TargetText() const {
  const std::string t =
      Num(target) + (value_unit == "x" ? "x" : " " + value_unit);
  switch (goal) {
    case Goal::kInfo:
      return "-";
    case Goal::kAtMost:
      return "<= " + t;
    case Goal::kBelow:
      return "< " + t;
    case Goal::kAtLeast:
      return ">= " + t;
  }
  return "?";
}

namespace {

int CountVerdicts(const std::vector<ResultRow>& rows, Verdict v) {
  int n = 0;
  for (const ResultRow& r : rows) {
    n += VerdictOf(r.goal, r.value, r.target, r.inconclusive) == v;
  }
  return n;
}

}  // namespace

int ResultTable::failures() const {
  return CountVerdicts(rows, Verdict::kFail);
}

int ResultTable::inconclusive() const {
  return CountVerdicts(rows, Verdict::kInconclusive);
}

namespace {

std::vector<std::vector<std::string>> Cells(const ResultTable& t) {
  std::vector<std::vector<std::string>> cells;
  cells.push_back({"measurement", "pages", "measured", "baseline", "unit",
                   "result", "target", "verdict", "note"});
  for (const ResultRow& r : t.rows) {
    const std::string value =
        Num(r.value) + (r.value_unit == "x" ? "x" : " " + r.value_unit);
    cells.push_back({r.what, r.pages, Num(r.measured), Num(r.baseline), r.unit,
                     value, r.TargetText(), r.VerdictText(), r.note});
  }
  return cells;
}

}  // namespace

std::string ResultTable::ToText() const {
  const std::vector<std::vector<std::string>> cells = Cells(*this);
  // The note column is printed unpadded, last.
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& row : cells) {
    for (size_t i = 0; i + 1 < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  std::ostringstream out;
  out << "\n=== " << title << " ===\n";
  if (!context.empty()) out << context << "\n";
  for (size_t r = 0; r < cells.size(); ++r) {
    for (size_t i = 0; i < cells[r].size(); ++i) {
      out << cells[r][i];
      if (i + 1 < cells[r].size()) {
        out << std::string(width[i] - cells[r][i].size() + 2, ' ');
      }
    }
    out << "\n";
    if (r == 0) {
      size_t total = 0;
      for (size_t i = 0; i + 1 < width.size(); ++i) total += width[i] + 2;
      out << std::string(total + 4, '-') << "\n";
    }
  }
  const int failed = failures();
  const int unmeasured = inconclusive();
  int targets = 0;
  for (const ResultRow& r : rows) targets += r.has_target();
  out << "\n"
      << CountVerdicts(rows, Verdict::kPass) << " of " << targets
      << " targets met";
  if (failed > 0) {
    out << "; MISSED:";
    for (const ResultRow& r : rows) {
      if (r.VerdictText() == "FAIL") {
        out << "\n  - " << r.what << ": " << Num(r.value)
            << (r.value_unit == "x" ? "x" : " " + r.value_unit) << ", target "
            << r.TargetText();
      }
    }
  }
  if (unmeasured > 0) {
    out << "\nINCONCLUSIVE (not measurable in this run; re-run on a quieter "
           "machine):";
    for (const ResultRow& r : rows) {
      if (r.VerdictText() == "INCONCLUSIVE")
        out << "\n  - " << r.what << ": " << r.note;
    }
  }
  out << "\n";
  return out.str();
}

std::string ResultTable::ToMarkdown() const {
  const std::vector<std::vector<std::string>> cells = Cells(*this);
  std::ostringstream out;
  out << "### " << title << "\n\n";
  if (!context.empty()) out << context << "\n\n";
  for (size_t r = 0; r < cells.size(); ++r) {
    out << "|";
    for (const std::string& c : cells[r]) {
      const bool verdict =
          r > 0 && (c == "PASS" || c == "FAIL" || c == "INCONCLUSIVE");
      out << " " << (verdict ? "**" + c + "**" : MarkdownEscape(c)) << " |";
    }
    out << "\n";
    if (r == 0) {
      out << "|";
      for (size_t i = 0; i < cells[r].size(); ++i) {
        // Numbers right-aligned.
        out << ((i >= 2 && i <= 3) || i == 5 ? "---:|" : "---|");
      }
      out << "\n";
    }
  }
  return out.str();
}

std::string ResultTable::ToCsv() const {
  std::ostringstream out;
  out << "measurement,pages,measured,baseline,unit,value,value_unit,goal,"
         "target,verdict,note\n";
  for (const ResultRow& r : rows) {
    const char* goal = r.goal == Goal::kAtMost    ? "<="
                       : r.goal == Goal::kBelow   ? "<"
                       : r.goal == Goal::kAtLeast ? ">="
                                                  : "";
    char nums[160];
    std::snprintf(nums, sizeof(nums), "%.6g,%.6g", r.measured, r.baseline);
    char value[64];
    std::snprintf(value, sizeof(value), "%.6g", r.value);
    char target[64];
    std::snprintf(target, sizeof(target), "%.6g", r.target);
    out << CsvQuote(r.what) << "," << CsvQuote(r.pages) << "," << nums << ","
        << CsvQuote(r.unit) << "," << value << "," << CsvQuote(r.value_unit)
        << "," << goal << "," << (r.has_target() ? target : "") << ","
        << r.VerdictText() << "," << CsvQuote(r.note) << "\n";
  }
  return out.str();
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  f.close();
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  return true;
}

void EmitTable(const ResultTable& table, const std::string& markdown_path,
               const std::string& csv_path) {
  std::printf("%s", table.ToText().c_str());
  std::fflush(stdout);
  if (!markdown_path.empty() && WriteFile(markdown_path, table.ToMarkdown())) {
    std::fprintf(stderr, "markdown table written to %s\n",
                 markdown_path.c_str());
  }
  if (!csv_path.empty() && WriteFile(csv_path, table.ToCsv())) {
    std::fprintf(stderr, "csv table written to %s\n", csv_path.c_str());
  }
}

BenchmarkSection TableSection(const ResultTable& table,
                              const std::string& benchmark,
                              const std::string& command) {
  BenchmarkSection section;
  section.benchmark = benchmark;
  section.command = command;
  for (const ResultRow& r : table.rows) {
    ResultRecord rec;
    rec.name = r.what;
    rec.value = r.value;
    rec.unit = r.value_unit;
    rec.goal = GoalSymbol(r.goal);
    if (r.has_target()) rec.target = r.target;
    rec.verdict = r.VerdictText();
    std::string lead;
    if (!r.pages.empty()) lead = "pages " + r.pages + "; ";
    if (r.measured != 0) {
      lead += "measured " + Num(r.measured) + " " + r.unit;
      if (r.baseline != 0)
        lead += ", baseline " + Num(r.baseline) + " " + r.unit;
      lead += "; ";
    }
    rec.note = lead + r.note;
    section.rows.push_back(std::move(rec));
  }
  AssignRowIds(section.rows);
  for (const ResultRecord& rec : section.rows) {
    for (size_t at = rec.note.find("WARNING: "); at != std::string::npos;
         at = rec.note.find("WARNING: ", at + 1)) {
      const size_t end = rec.note.find(';', at);
      section.warnings.push_back(
          rec.id + ": " +
          rec.note.substr(at, end == std::string::npos ? end : end - at));
    }
  }
  return section;
}

std::string MachineDescription() {
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 2);
      break;
    }
  }
  const std::string load = LoadAverageText();
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " CPUs, 1-min load average " + load;
}

}  // namespace tmem::bench
