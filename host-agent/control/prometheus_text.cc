#include "host-agent/control/prometheus_text.h"

#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

// HELP text escapes only backslash and newline (the format's rule).
std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatDouble(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // The shortest text that reads back as the same double: integers stay
  // exact (up to 2^53) and 0.1 prints as 0.1.
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return ec == std::errc() ? std::string(buf, end) : "NaN";
}

}  // namespace

std::string PrometheusText::EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void PrometheusText::Add(const MetricFamily& family,
                         const std::vector<MetricLabel>& labels,
                         uint64_t value) {
  AddFormatted(family, labels, absl::StrCat(value));
}

void PrometheusText::Add(const MetricFamily& family,
                         const std::vector<MetricLabel>& labels, double value) {
  AddFormatted(family, labels, FormatDouble(value));
}

void PrometheusText::AddFormatted(const MetricFamily& family,
                                  const std::vector<MetricLabel>& labels,
                                  const std::string& value) {
  auto it = index_.find(family.name);
  if (it == index_.end()) {
    it = index_.emplace(std::string(family.name), families_.size()).first;
    families_.push_back(Family{family, {}});
  }
  Family& f = families_[it->second];
  if (f.spec.type != family.type || f.spec.help != family.help) {
    ++conflicts_;
    return;
  }
  std::string& line = f.samples;
  line += family.name;
  if (!labels.empty()) {
    line += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i != 0) line += ',';
      line += labels[i].name;
      line += "=\"";
      line += EscapeLabelValue(labels[i].value);
      line += '"';
    }
    line += '}';
  }
  line += ' ';
  line += value;
  line += '\n';
}

std::string PrometheusText::Render() const {
  std::string out;
  for (const Family& f : families_) {
    out += "# HELP ";
    out += f.spec.name;
    out += ' ';
    out += EscapeHelp(f.spec.help);
    out += "\n# TYPE ";
    out += f.spec.name;
    out += f.spec.type == MetricType::kCounter ? " counter\n" : " gauge\n";
    out += f.samples;
  }
  return out;
}

}  // namespace tmem
