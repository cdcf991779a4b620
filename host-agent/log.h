// Structured logging for tmemd: one line per event, logfmt (key=value) or
// JSON, on stderr. Events are short snake_case names ("channel_created");
// fields carry the details. Thread-safe (one write(2) per line).
#ifndef TMEMD_HOST_AGENT_LOG_H_
#define TMEMD_HOST_AGENT_LOG_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <variant>

#include "absl/strings/string_view.h"

namespace tmem {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
enum class LogFormat : int { kText = 0, kJson = 1 };

struct LogField {
  LogField(std::string_view k, std::string_view v)
      : key(k), value(std::string(v)) {}
  LogField(std::string_view k, const char* v) : key(k), value(std::string(v)) {}
  LogField(std::string_view k, const std::string& v) : key(k), value(v) {}
  // Debian's abseil has its own string_view (Status::message() returns it).
  LogField(std::string_view k, absl::string_view v)
      : key(k), value(std::string(v.data(), v.size())) {}
  LogField(std::string_view k, int64_t v) : key(k), value(v) {}
  LogField(std::string_view k, int v) : key(k), value(int64_t{v}) {}
  LogField(std::string_view k, uint32_t v) : key(k), value(int64_t{v}) {}
  LogField(std::string_view k, uint64_t v) : key(k), value(v) {}
  LogField(std::string_view k, double v) : key(k), value(v) {}
  LogField(std::string_view k, bool v) : key(k), value(v) {}
  std::string_view key;
  std::variant<std::string, int64_t, uint64_t, double, bool> value;
};

// Process-wide settings; set once at startup.
void SetLogLevel(LogLevel level);
void SetLogFormat(LogFormat format);
bool ParseLogLevel(std::string_view s, LogLevel* out);

void Log(LogLevel level, std::string_view event,
         std::initializer_list<LogField> fields = {});

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_LOG_H_
