#include "host-agent/tmemctl/policy_file.h"

#include <toml++/toml.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "host-agent/common/proto_mode.h"
#include "host-agent/common/size_text.h"
#include "host-agent/common/vm_name.h"

namespace tmem {
namespace {

using nlohmann::json;

json TomlToJson(const toml::node& n) {
  if (const toml::table* t = n.as_table()) {
    json j = json::object();
    for (const auto& [k, v] : *t) j[std::string(k.str())] = TomlToJson(v);
    return j;
  }
  if (const toml::array* a = n.as_array()) {
    json j = json::array();
    for (const toml::node& v : *a) j.push_back(TomlToJson(v));
    return j;
  }
  if (auto v = n.value_exact<int64_t>()) return *v;
  if (auto v = n.value_exact<double>()) return *v;
  if (auto v = n.value_exact<bool>()) return *v;
  if (auto v = n.value_exact<std::string>()) return *v;
  return nullptr;  // dates and times: rejected by the reader below
}

class Reader {
 public:
  Reader(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  absl::Status Keys(std::initializer_list<std::string_view> known) const {
    if (!j_.is_object()) return Bad("", "must be a table (object)");
    for (const auto& [k, v] : j_.items()) {
      bool ok = false;
      for (std::string_view n : known) ok = ok || k == n;
      if (!ok) {
        std::string list;
        for (std::string_view n : known) {
          absl::StrAppend(&list, list.empty() ? "" : ", ", std::string(n));
        }
        return absl::InvalidArgumentError(
            absl::StrCat("unknown key '", where_, k, "' (known: ", list, ")"));
      }
    }
    return absl::OkStatus();
  }
  bool Has(const char* key) const { return j_.contains(key); }
  absl::StatusOr<std::string> String(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_string()) return Bad(key, "must be a string");
    return v.get<std::string>();
  }
  absl::StatusOr<int64_t> Int(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_number_integer()) return Bad(key, "must be an integer");
    return v.get<int64_t>();
  }
  absl::StatusOr<double> Number(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_number()) return Bad(key, "must be a number");
    return v.get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_boolean()) return Bad(key, "must be true or false");
    return v.get<bool>();
  }
  // A size: an integer of bytes or a string like "512MiB" / "unlimited".
  absl::StatusOr<uint64_t> Size(const char* key, bool allow_unlimited) const {
    const json& v = j_.at(key);
    if (v.is_number_integer()) {
      if (v.get<int64_t>() < 0) return Bad(key, "must not be negative");
      return v.get<uint64_t>();
    }
    if (!v.is_string()) {
      return Bad(key, "must be a size: bytes or a string like \"512MiB\"");
    }
    absl::StatusOr<uint64_t> s = allow_unlimited
                                     ? ParseQuota(v.get<std::string>())
                                     : ParseSize(v.get<std::string>());
    if (!s.ok()) return Bad(key, s.status().message());
    return *s;
  }
  // "vm[0].mode": names a key in error messages.
  std::string Where(std::string_view key) const {
    return absl::StrCat(where_, std::string(key));
  }
  absl::Status Bad(std::string_view key, absl::string_view why) const {
    return absl::InvalidArgumentError(
        absl::StrCat("'", where_, std::string(key), "' ", why));
  }

 private:
  const json& j_;
  std::string where_;
};

template <typename T>
absl::Status Take(absl::StatusOr<T> v, T* out) {
  if (!v.ok()) return v.status();
  *out = *v;
  return absl::OkStatus();
}

absl::Status ParseHost(const json& j, v1::SetHostPolicyRequest& out) {
  Reader r(j, "host.");
  if (auto s =
          r.Keys({"generation", "memory_cap", "cpu_budget_percent", "mode"});
      !s.ok())
    return s;
  if (r.Has("generation")) {
    int64_t g = 0;
    if (auto s = Take(r.Int("generation"), &g); !s.ok()) return s;
    if (g < 0) return r.Bad("generation", "must not be negative");
    out.set_generation(static_cast<uint64_t>(g));
  }
  if (r.Has("memory_cap")) {
    uint64_t cap = 0;
    if (auto s = Take(r.Size("memory_cap", false), &cap); !s.ok()) return s;
    out.set_memory_cap_bytes(cap);
  }
  if (r.Has("cpu_budget_percent")) {
    double b = 0;
    if (auto s = Take(r.Number("cpu_budget_percent"), &b); !s.ok()) return s;
    if (!(b > 0 && b <= 100)) {
      return r.Bad("cpu_budget_percent", "must be in (0, 100]");
    }
    out.set_cpu_budget_percent(b);
  }
  if (r.Has("mode")) {
    std::string m;
    if (auto s = Take(r.String("mode"), &m); !s.ok()) return s;
    absl::StatusOr<v1::Mode> mode =
        ProtoModeFromText(m, DefaultMode::kRefused, r.Where("mode"));
    if (!mode.ok()) return mode.status();
    out.set_default_mode(*mode);
  }
  return absl::OkStatus();
}

absl::Status ParseVm(const json& j, size_t i, v1::SetVmPolicyRequest& out) {
  Reader r(j, absl::StrCat("vm[", i, "]."));
  if (auto s = r.Keys({"name", "generation", "quota", "weight", "mode",
                       "enabled", "frozen", "swap_quota", "swap_mode"});
      !s.ok())
    return s;
  if (!r.Has("name")) return r.Bad("name", "is missing");
  std::string name;
  if (auto s = Take(r.String("name"), &name); !s.ok()) return s;
  if (auto s = ValidateVmName(name); !s.ok()) return r.Bad("name", s.message());
  out.set_vm(name);
  if (r.Has("generation")) {
    int64_t g = 0;
    if (auto s = Take(r.Int("generation"), &g); !s.ok()) return s;
    if (g < 0) return r.Bad("generation", "must not be negative");
    out.set_generation(static_cast<uint64_t>(g));
  }
  if (r.Has("quota")) {
    uint64_t q = 0;
    if (auto s = Take(r.Size("quota", true), &q); !s.ok()) return s;
    out.set_quota_bytes(q);
  }
  if (r.Has("weight")) {
    int64_t w = 0;
    if (auto s = Take(r.Int("weight"), &w); !s.ok()) return s;
    if (w < 1 || w > 1000000) return r.Bad("weight", "must be in 1..1000000");
    out.set_weight(w);
  }
  if (r.Has("mode")) {
    std::string m;
    if (auto s = Take(r.String("mode"), &m); !s.ok()) return s;
    absl::StatusOr<v1::Mode> mode =
        ProtoModeFromText(m, DefaultMode::kAllowed, r.Where("mode"));
    if (!mode.ok()) return mode.status();
    out.set_mode(*mode);
  }
  if (r.Has("swap_quota")) {
    uint64_t q = 0;
    if (auto s = Take(r.Size("swap_quota", true), &q); !s.ok()) return s;
    out.set_swap_quota_bytes(q);
  }
  if (r.Has("swap_mode")) {
    std::string m;
    if (auto s = Take(r.String("swap_mode"), &m); !s.ok()) return s;
    absl::StatusOr<v1::Mode> mode =
        ProtoModeFromText(m, DefaultMode::kAllowed, r.Where("swap_mode"));
    if (!mode.ok()) return mode.status();
    out.set_swap_mode(*mode);
  }
  for (const char* key : {"enabled", "frozen"}) {
    if (!r.Has(key)) continue;
    bool b = false;
    if (auto s = Take(r.Bool(key), &b); !s.ok()) return s;
    if (std::string_view(key) == "enabled") {
      out.set_enabled(b);
    } else {
      out.set_frozen(b);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ParseQuota(std::string_view text) {
  if (text == "unlimited" || text == "none") return 0;
  return ParseSize(text);
}

absl::StatusOr<PolicyFile> ParsePolicyFile(std::string_view text,
                                           std::string_view source_name) {
  json root;
  const size_t first = text.find_first_not_of(" \t\r\n");
  try {
    if (first != std::string_view::npos && text[first] == '{') {
      root = json::parse(text);
    } else {
      root = TomlToJson(toml::parse(text, source_name));
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source_name), ": not valid JSON: ", e.what()));
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(source_name), ":", e.source().begin.line, ":",
        e.source().begin.column, ": ", std::string(e.description())));
  }
  PolicyFile out;
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source_name), ": must be a table/object"));
  }
  for (const auto& [k, v] : root.items()) {
    absl::Status s;
    if (k == "host") {
      out.host.emplace();
      s = ParseHost(v, *out.host);
    } else if (k == "vm") {
      if (!v.is_array()) {
        s = absl::InvalidArgumentError(
            "'vm' must be a list: [[vm]] sections in TOML, an array in JSON");
      } else {
        for (size_t i = 0; i < v.size() && s.ok(); ++i) {
          s = ParseVm(v[i], i, out.vms.emplace_back());
        }
      }
    } else {
      s = absl::InvalidArgumentError(
          absl::StrCat("unknown section '", k, "' (use [host] and [[vm]])"));
    }
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(source_name), ": ", s.message()));
    }
  }
  if (!out.host && out.vms.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source_name),
                     ": no [host] and no [[vm]]: nothing to apply"));
  }
  return out;
}

absl::StatusOr<PolicyFile> LoadPolicyFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read policy file '", path, "'"));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  return ParsePolicyFile(buf.str(), path);
}

}  // namespace tmem
