#include "bench/scenario/tmemd_log.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tmem::scenario {

Fields ParseFlatJson(const std::string& s) {
  Fields out;
  size_t i = s.find('{');
  if (i == std::string::npos) return out;
  ++i;
  auto skip = [&] {
    while (i < s.size() && (s[i] == ' ' || s[i] == ',')) ++i;
  };
  auto read_string = [&]() -> std::string {
    std::string v;
    ++i;  // opening quote
    while (i < s.size() && s[i] != '"') {
      if (s[i] == '\\' && i + 1 < s.size()) ++i;
      v += s[i++];
    }
    ++i;
    return v;
  };
  while (true) {
    skip();
    if (i >= s.size() || s[i] != '"') break;
    std::string key = read_string();
    while (i < s.size() && (s[i] == ' ' || s[i] == ':')) ++i;
    if (i >= s.size()) break;
    std::string value;
    if (s[i] == '"') {
      value = read_string();
    } else {
      while (i < s.size() && s[i] != ',' && s[i] != '}') value += s[i++];
      while (!value.empty() && value.back() == ' ') value.pop_back();
    }
    out[key] = value;
  }
  return out;
}

double Num(const Fields& m, const std::string& key) {
  auto it = m.find(key);
  if (it == m.end()) return 0;
  if (it->second == "true") return 1;
  if (it->second == "false") return 0;
  return std::strtod(it->second.c_str(), nullptr);
}

TmemdLog ReadTmemdLog(const std::string& path) {
  TmemdLog out;
  std::ifstream f(path);
  std::string line;
  std::map<std::string, double> peak_vm_pages;
  struct HostSample {
    double pages;
    double ratio;
  };
  std::vector<HostSample> host;
  while (std::getline(f, line)) {
    if (line.find(R"("event":"vm_stats")") != std::string::npos) {
      Fields m = ParseFlatJson(line);
      double& peak = peak_vm_pages[m["vm"]];
      peak = std::max(peak, Num(m, "pages"));
      out.vm_stats[m["vm"]] = std::move(m);
    } else if (line.find(R"("event":"compactor_stats")") != std::string::npos) {
      out.compactor = ParseFlatJson(line);
    } else if (line.find(R"("event":"stats")") != std::string::npos ||
               line.find(R"("event":"final_stats")") != std::string::npos) {
      const Fields m = ParseFlatJson(line);
      host.push_back({Num(m, "pages"), Num(m, "compression_ratio")});
    }
  }
  for (auto& [vm, m] : out.vm_stats) {
    m["pages"] = absl::StrCat(peak_vm_pages[vm]);
  }
  for (const HostSample& h : host) {
    out.peak_pages = std::max(out.peak_pages, h.pages);
  }
  out.compression_ratio = std::nan("");
  for (const HostSample& h : host) {
    if (h.pages > 0 && h.pages >= 0.9 * out.peak_pages) {
      out.compression_ratio = h.ratio;
    }
  }
  return out;
}

}  // namespace tmem::scenario
