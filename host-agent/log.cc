#include "host-agent/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "host-agent/common/json_text.h"

namespace tmem {

namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};

std::string_view LevelName(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

void AppendJsonString(std::string& out, std::string_view s) {
  out.push_back('"');
  AppendJsonEscaped(out, s);
  out.push_back('"');
}

// logfmt quotes values with spaces, quotes or '='.
void AppendTextValue(std::string& out, std::string_view s) {
  const bool quote =
      s.empty() || s.find_first_of(" \"=\t\n") != std::string_view::npos;
  if (!quote) {
    out += s;
    return;
  }
  AppendJsonString(out, s);
}

std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      now.time_since_epoch())
                      .count() %
                  1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  return absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
                         tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                         tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
void SetLogFormat(LogFormat format) {
  g_format.store(static_cast<int>(format));
}

bool ParseLogLevel(std::string_view s, LogLevel* out) {
  for (LogLevel l :
       {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn, LogLevel::kError}) {
    if (s == LevelName(l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

void Log(LogLevel level, std::string_view event,
         std::initializer_list<LogField> fields) {
  if (static_cast<int>(level) < g_level.load(std::memory_order_relaxed)) return;
  const bool json = g_format.load(std::memory_order_relaxed) ==
                    static_cast<int>(LogFormat::kJson);
  std::string line;
  line.reserve(128);
  if (json) {
    absl::StrAppend(&line, R"({"ts":")", Timestamp(), R"(","level":")",
                    std::string(LevelName(level)), R"(","event":)");
    AppendJsonString(line, event);
  } else {
    absl::StrAppend(&line, "ts=", Timestamp(),
                    " level=", std::string(LevelName(level)),
                    " event=", std::string(event));
  }
  for (const LogField& f : fields) {
    std::string value;
    bool is_string = false;
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::string>) {
            value = v;
            is_string = true;
          } else if constexpr (std::is_same_v<T, bool>) {
            value = v ? "true" : "false";
          } else {
            value = absl::StrCat(v);
          }
        },
        f.value);
    if (json) {
      line += ',';
      AppendJsonString(line, f.key);
      line += ':';
      if (is_string) {
        AppendJsonString(line, value);
      } else {
        line += value;
      }
    } else {
      absl::StrAppend(&line, " ", std::string(f.key), "=");
      AppendTextValue(line, value);
    }
  }
  if (json) line += '}';
  line += '\n';
  // One write per line keeps lines whole across threads.
  ssize_t unused = write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace tmem
