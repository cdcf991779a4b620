// PrometheusText: builds a Prometheus text exposition (format 0.0.4) from
// samples added in any order. Every family is written once, HELP and TYPE
// first, then all of its samples together: the format (and `promtool check
// metrics`) refuses a family split in two, so callers may add a family's
// samples from several loops (one per counter, one per VM) without caring
// about order. Label values are escaped as the format says; metric and label
// names are the caller's constants and must match [a-zA-Z_][a-zA-Z0-9_]*.
//
// A family is named by its first sample; a later sample that names the same
// family with another type or HELP text is dropped and counted in
// conflicts() (a programming error the renderer's tests look for, never a
// reason to emit an exposition Prometheus rejects). Not thread-safe: build
// one per scrape.
#ifndef TMEMD_HOST_AGENT_CONTROL_PROMETHEUS_TEXT_H_
#define TMEMD_HOST_AGENT_CONTROL_PROMETHEUS_TEXT_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tmem {

enum class MetricType { kCounter, kGauge };

// What a family is: its full name (counters end in _total), type and HELP.
struct MetricFamily {
  std::string_view name;
  MetricType type;
  std::string_view help;
};

struct MetricLabel {
  std::string_view name;
  std::string value;
};

class PrometheusText {
 public:
  void Add(const MetricFamily& family, const std::vector<MetricLabel>& labels,
           uint64_t value);
  void Add(const MetricFamily& family, const std::vector<MetricLabel>& labels,
           double value);

  // The exposition: families in the order their first sample was added.
  std::string Render() const;
  int conflicts() const { return conflicts_; }

  // `value` escaped for a label value (backslash, double quote, newline).
  static std::string EscapeLabelValue(std::string_view value);

 private:
  struct Family {
    MetricFamily spec;
    std::string samples;  // "name{labels} value\n" lines
  };
  void AddFormatted(const MetricFamily& family,
                    const std::vector<MetricLabel>& labels,
                    const std::string& value);

  std::vector<Family> families_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> families_
  int conflicts_ = 0;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_PROMETHEUS_TEXT_H_
