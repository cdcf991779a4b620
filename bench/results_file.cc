#include "bench/results_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "nlohmann/json.hpp"

namespace tmem::bench {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A number, or null where there is none: JSON has no NaN.
json Number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

std::string ErrnoText(const std::string& what, const std::string& path) {
  return what + " " + path + ": " +
         std::strerror(errno);  // NOLINT(concurrency-mt-unsafe)
}

std::string FirstField(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

json SectionJson(const BenchmarkSection& s) {
  json rows = json::array();
  for (const ResultRecord& r : s.rows) {
    rows.push_back({{"id", r.id},
                    {"name", r.name},
                    {"value", Number(r.value)},
                    {"unit", r.unit},
                    {"goal", r.goal},
                    {"target", Number(r.target)},
                    {"verdict", r.verdict},
                    {"note", r.note}});
  }
  return {{"machine",
           {{"hostname", s.machine.hostname},
            {"kernel", s.machine.kernel},
            {"cpus", s.machine.cpus},
            {"cpu_model", s.machine.cpu_model},
            {"mem_bytes", s.machine.mem_bytes}}},
          {"date", s.date},
          {"commit", s.commit},
          {"command", s.command},
          {"rows", std::move(rows)},
          {"warnings", s.warnings}};
}

// Holds an exclusive flock on a lock file beside the results file for its
// lifetime (the results file itself is replaced by rename, so it cannot
// carry the lock).
class FileLock {
 public:
  explicit FileLock(const std::string& path)
      : fd_(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ >= 0 && flock(fd_, LOCK_EX) != 0) {
      close(fd_);
      fd_ = -1;
    }
  }
  ~FileLock() {
    if (fd_ >= 0) close(fd_);  // releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_;
};

// Writes `text` to a new file in `path`'s directory, flushes it to disk
// and renames it over `path`.
absl::Status ReplaceFile(const std::string& path, const std::string& text) {
  std::string tmp = path + ".XXXXXX";
  const int fd = mkstemp(tmp.data());
  if (fd < 0) return absl::InternalError(ErrnoText("cannot create", tmp));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = ErrnoText("cannot write", tmp);
      close(fd);
      unlink(tmp.c_str());
      return absl::InternalError(err);
    }
    done += static_cast<size_t>(n);
  }
  // Readable by everyone, as a file the user wrote would be (mkstemp: 0600).
  if (fchmod(fd, 0644) != 0 || fsync(fd) != 0 || close(fd) != 0) {
    const std::string err = ErrnoText("cannot finish", tmp);
    unlink(tmp.c_str());
    return absl::InternalError(err);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = ErrnoText("cannot rename over", path);
    unlink(tmp.c_str());
    return absl::InternalError(err);
  }
  return absl::OkStatus();
}

}  // namespace

MachineInfo MachineInfo::Here() {
  MachineInfo m;
  utsname u{};
  if (uname(&u) == 0) {
    m.hostname = u.nodename;
    m.kernel = u.release;
  }
  m.cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  m.cpu_model = FirstField("/proc/cpuinfo", "model name");
  const std::string mem = FirstField("/proc/meminfo", "MemTotal");  // "N kB"
  m.mem_bytes = std::strtoull(mem.c_str(), nullptr, 10) * 1024;
  return m;
}

std::string BenchmarkSection::NowUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string BenchmarkSection::CommitId() {
  // Read once at start-up by the programs' single thread.
  const char* c = std::getenv("TMEM_COMMIT");  // NOLINT(concurrency-mt-unsafe)
  return c != nullptr && *c != '\0' ? c : "unknown";
}

absl::Status MergeResults(const std::string& path,
                          const BenchmarkSection& section) {
  if (section.benchmark.empty()) {
    return absl::InvalidArgumentError("results: empty benchmark id");
  }
  std::set<std::string> ids;
  for (const ResultRecord& r : section.rows) {
    if (r.id.empty() || !ids.insert(r.id).second) {
      return absl::InvalidArgumentError("results: " + section.benchmark +
                                        ": empty or repeated row id '" + r.id +
                                        "' (row '" + r.name + "')");
    }
  }
  const fs::path file(path);
  std::error_code ec;
  if (file.has_parent_path()) fs::create_directories(file.parent_path(), ec);
  if (ec) {
    return absl::InternalError("cannot create " + file.parent_path().string() +
                               ": " + ec.message());
  }
  const FileLock lock(path + ".lock");
  if (!lock.held()) return absl::InternalError(ErrnoText("cannot lock", path));

  json doc = {{"schema", kResultsSchema}, {"benchmarks", json::object()}};
  if (std::ifstream in(path); in) {
    std::stringstream text;
    text << in.rdbuf();
    json old = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (!old.is_object() || !old.contains("benchmarks") ||
        !old["benchmarks"].is_object() || old.value("schema", 0) < 1) {
      return absl::FailedPreconditionError(
          path + " exists but is not a benchmark results file; not replaced");
    }
    doc = std::move(old);
  }
  doc["schema"] = kResultsSchema;
  doc["benchmarks"][section.benchmark] = SectionJson(section);
  // Bytes that are not UTF-8 (a path in a note) become U+FFFD instead of
  // failing the whole record.
  const std::string text =
      doc.dump(2, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace) +
      "\n";
  return ReplaceFile(path, text);
}

bool RecordResults(const std::string& path, const BenchmarkSection& section) {
  if (path.empty()) return true;
  const absl::Status st = MergeResults(path, section);
  if (!st.ok()) {
    std::fprintf(stderr, "results not recorded: %s\n", st.ToString().c_str());
    return false;
  }
  std::fprintf(stderr, "results recorded in %s (section \"%s\", %zu rows)\n",
               path.c_str(), section.benchmark.c_str(), section.rows.size());
  return true;
}

std::string RowSlug(std::string_view name) {
  std::string out;
  bool dash = false;
  for (const char ch : name) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) {
      if (dash && !out.empty()) out += '-';
      out += static_cast<char>(c);
      dash = false;
    } else if (c >= 'A' && c <= 'Z') {
      if (dash && !out.empty()) out += '-';
      out += static_cast<char>(c - 'A' + 'a');
      dash = false;
    } else {
      dash = true;
    }
  }
  return out;
}

void AssignRowIds(std::vector<ResultRecord>& rows) {
  std::map<std::string, int> seen;
  for (ResultRecord& r : rows) {
    if (r.id.empty()) r.id = RowSlug(r.name);
    if (r.id.empty()) r.id = "row";
    const int n = ++seen[r.id];
    if (n > 1) {
      r.id += '-';
      r.id += std::to_string(n);
    }
  }
}

std::string CommandLine(int argc, const char* const* argv) {
  // Read once per call on the benchmark's main thread.
  const char* root_env =
      std::getenv("TMEM_REPO_ROOT");  // NOLINT(concurrency-mt-unsafe)
  const std::string root = root_env != nullptr && *root_env != '\0'
                               ? std::string(root_env) + "/"
                               : "";
  std::string out;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    for (size_t at = root.empty() ? std::string::npos : a.find(root);
         at != std::string::npos; at = a.find(root, at)) {
      a.erase(at, root.size());
    }
    if (!out.empty()) out += ' ';
    const bool plain =
        !a.empty() && a.find_first_not_of(
                          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                          "0123456789-_./=:,+@%") == std::string::npos;
    if (plain) {
      out += a;
      continue;
    }
    out += '\'';
    for (const char c : a) {
      if (c == '\'') {
        out += "'\\''";
      } else {
        out += c;
      }
    }
    out += '\'';
  }
  return out;
}

}  // namespace tmem::bench
