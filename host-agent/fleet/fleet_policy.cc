#include "host-agent/fleet/fleet_policy.h"

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "host-agent/common/proto_mode.h"
#include "host-agent/common/setting_ranges.h"
#include "host-agent/common/vm_name.h"

namespace tmem {
namespace {

using nlohmann::json;

size_t PrefixSize() { return std::string_view(kFleetPolicyPrefix).size(); }

bool SameMessage(const google::protobuf::Message& a,
                 const google::protobuf::Message& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

absl::Status Refuse(const std::string& key, const std::string& field,
                    const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", field, ": ", why));
}

// JSON integers only: 8.0 is not 8, "8" is not 8, -1 is not a size.
absl::StatusOr<uint64_t> Unsigned(const std::string& key,
                                  const std::string& field, const json& v) {
  if (!v.is_number_integer()) return Refuse(key, field, "must be an integer");
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  const int64_t i = v.get<int64_t>();
  if (i < 0)
    return Refuse(key, field, absl::StrCat("must not be negative, got ", i));
  return static_cast<uint64_t>(i);
}

absl::StatusOr<v1::Mode> Mode(const std::string& key, const std::string& field,
                              const json& v, DefaultMode default_mode) {
  if (!v.is_string()) return Refuse(key, field, "must be a string");
  return ProtoModeFromText(v.get<std::string>(), default_mode,
                           absl::StrCat(key, ": ", field));
}

absl::Status ParseHostSection(const std::string& key, const json& h,
                              v1::SetHostPolicyRequest* out) {
  if (!h.is_object()) return Refuse(key, "host", "must be an object");
  for (const auto& [name, v] : h.items()) {
    const std::string field = absl::StrCat("host.", name);
    if (name == "memory_cap_bytes") {
      absl::StatusOr<uint64_t> cap = Unsigned(key, field, v);
      if (!cap.ok()) return cap.status();
      if (absl::Status s = CheckRange(ranges::kMemoryCap, *cap,
                                      absl::StrCat(key, ": ", field));
          !s.ok()) {
        return s;
      }
      out->set_memory_cap_bytes(*cap);
    } else if (name == "cpu_budget_percent") {
      if (!v.is_number()) return Refuse(key, field, "must be a number");
      const double b = v.get<double>();
      if (absl::Status s = CheckRange(ranges::kCpuBudgetPercent, b,
                                      absl::StrCat(key, ": ", field));
          !s.ok()) {
        return s;
      }
      out->set_cpu_budget_percent(b);
    } else if (name == "mode") {
      absl::StatusOr<v1::Mode> m = Mode(key, field, v, DefaultMode::kRefused);
      if (!m.ok()) return m.status();
      out->set_default_mode(*m);
    } else {
      return Refuse(key, field,
                    "unknown field (host takes memory_cap_bytes, "
                    "cpu_budget_percent, mode)");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseVmSection(const std::string& key, const json& vm,
                            v1::SetVmPolicyRequest* out) {
  if (!vm.is_object()) return Refuse(key, "vm", "must be an object");
  for (const auto& [name, v] : vm.items()) {
    const std::string field = absl::StrCat("vm.", name);
    const std::string source = absl::StrCat(key, ": ", field);
    if (name == "quota_bytes") {
      absl::StatusOr<uint64_t> q = Unsigned(key, field, v);
      if (!q.ok()) return q.status();
      if (absl::Status s = CheckRange(ranges::kQuota, *q, source); !s.ok()) {
        return s;
      }
      out->set_quota_bytes(*q);
    } else if (name == "weight") {
      absl::StatusOr<uint64_t> w = Unsigned(key, field, v);
      if (!w.ok()) return w.status();
      if (absl::Status s = CheckRange(ranges::kWeight, *w, source); !s.ok()) {
        return s;
      }
      out->set_weight(static_cast<int64_t>(*w));
    } else if (name == "mode") {
      absl::StatusOr<v1::Mode> m = Mode(key, field, v, DefaultMode::kAllowed);
      if (!m.ok()) return m.status();
      out->set_mode(*m);
    } else if (name == "swap_quota_bytes") {
      absl::StatusOr<uint64_t> q = Unsigned(key, field, v);
      if (!q.ok()) return q.status();
      if (absl::Status s = CheckRange(ranges::kSwapQuota, *q, source);
          !s.ok()) {
        return s;
      }
      out->set_swap_quota_bytes(*q);
    } else if (name == "swap_mode") {
      absl::StatusOr<v1::Mode> m = Mode(key, field, v, DefaultMode::kAllowed);
      if (!m.ok()) return m.status();
      out->set_swap_mode(*m);
    } else if (name == "enabled" || name == "frozen") {
      if (!v.is_boolean()) return Refuse(key, field, "must be true or false");
      if (name == "enabled") {
        out->set_enabled(v.get<bool>());
      } else {
        out->set_frozen(v.get<bool>());
      }
    } else {
      return Refuse(key, field,
                    "unknown field (vm takes quota_bytes, weight, mode, "
                    "enabled, frozen, swap_quota_bytes, swap_mode)");
    }
  }
  return absl::OkStatus();
}

// Layers in resolution order (least specific first).
std::vector<std::string> HostLayerKeys(const std::string& host,
                                       const std::vector<std::string>& groups) {
  std::vector<std::string> keys;
  keys.push_back(absl::StrCat(kFleetPolicyPrefix, "fleet"));
  for (const std::string& g : groups) {
    keys.push_back(absl::StrCat(kFleetPolicyPrefix, "groups/", g));
  }
  keys.push_back(absl::StrCat(kFleetPolicyPrefix, "hosts/", host));
  return keys;
}

}  // namespace

bool operator==(const FleetLayer& a, const FleetLayer& b) {
  return SameMessage(a.host, b.host) && SameMessage(a.vm, b.vm);
}

std::optional<size_t> InvalidUtf8Offset(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t min = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) {
      n = 1;
      min = 0x80;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      min = 0x800;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      min = 0x10000;
      cp = c & 0x07;
    } else {
      return i;
    }
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return i;
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and beyond U+10FFFF are not UTF-8.
    if (cp < min || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return i;
    i += n + 1;
  }
  return std::nullopt;
}

std::string FleetKeyText(std::string_view key) {
  return absl::CHexEscape(absl::string_view(key.data(), key.size()));
}

absl::Status CheckFleetKey(const std::string& key) {
  if (!std::string_view(key).starts_with(kFleetPolicyPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key '", FleetKeyText(key), "' is not under ", kFleetPolicyPrefix));
  }
  const std::string rest = key.substr(PrefixSize());
  if (rest == "fleet") return absl::OkStatus();
  for (const std::string kind : {"groups/", "hosts/", "vms/"}) {
    if (rest.starts_with(kind)) {
      const std::string name = rest.substr(kind.size());
      if (absl::Status s = ValidateVmName(name); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "key '", FleetKeyText(key), "': the name after ", kind,
            " must be 1-64 of [A-Za-z0-9._-], starting with a letter or "
            "digit"));
      }
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("key '", FleetKeyText(key), "': want ", kFleetPolicyPrefix,
                   "fleet, groups/<group>, hosts/<host> or vms/<vm>"));
}

absl::StatusOr<FleetLayer> ParseFleetLayer(const std::string& key,
                                           const std::string& value) {
  if (absl::Status s = CheckFleetKey(key); !s.ok()) return s;
  const bool vm_key =
      std::string_view(key.substr(PrefixSize())).starts_with("vms/");
  if (std::optional<size_t> bad = InvalidUtf8Offset(value)) {
    return Refuse(
        key, "value",
        absl::StrFormat("byte 0x%02x at offset %d is not UTF-8 "
                        "(a value is JSON text)",
                        static_cast<unsigned char>(value[*bad]), *bad));
  }
  json j = json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Refuse(key, "value", "is not valid JSON");
  if (!j.is_object()) return Refuse(key, "value", "must be a JSON object");
  if (!j.contains("version")) {
    return Refuse(key, "version",
                  absl::StrCat("missing (want ", kFleetFormatVersion, ")"));
  }
  if (!j.at("version").is_number_integer() ||
      j.at("version").get<int64_t>() != kFleetFormatVersion) {
    return Refuse(
        key, "version",
        absl::StrCat("unsupported ", j.at("version").dump(),
                     " (this tmemd reads version ", kFleetFormatVersion, ")"));
  }
  FleetLayer layer;
  for (const auto& [name, v] : j.items()) {
    if (name == "version") continue;
    if (name == "host" && !vm_key) {
      if (absl::Status s = ParseHostSection(key, v, &layer.host); !s.ok()) {
        return s;
      }
    } else if (name == "vm") {
      if (absl::Status s = ParseVmSection(key, v, &layer.vm); !s.ok()) {
        return s;
      }
    } else {
      return Refuse(key, name,
                    vm_key ? "unknown field (a vms/<vm> value takes version "
                             "and vm)"
                           : "unknown field (takes version, host, vm)");
    }
  }
  return layer;
}

std::string FormatFleetLayer(const FleetLayer& layer) {
  json j;
  j["version"] = kFleetFormatVersion;
  json h = json::object();
  if (layer.host.has_memory_cap_bytes()) {
    h["memory_cap_bytes"] = layer.host.memory_cap_bytes();
  }
  if (layer.host.has_cpu_budget_percent()) {
    h["cpu_budget_percent"] = layer.host.cpu_budget_percent();
  }
  if (layer.host.default_mode() != v1::MODE_UNSPECIFIED) {
    h["mode"] = ProtoModeText(layer.host.default_mode());
  }
  if (!h.empty()) j["host"] = h;
  json vm = json::object();
  if (layer.vm.has_quota_bytes()) vm["quota_bytes"] = layer.vm.quota_bytes();
  if (layer.vm.has_weight()) vm["weight"] = layer.vm.weight();
  if (layer.vm.mode() != v1::MODE_UNSPECIFIED) {
    vm["mode"] = ProtoModeText(layer.vm.mode());
  }
  if (layer.vm.has_enabled()) vm["enabled"] = layer.vm.enabled();
  if (layer.vm.has_frozen()) vm["frozen"] = layer.vm.frozen();
  if (layer.vm.has_swap_quota_bytes()) {
    vm["swap_quota_bytes"] = layer.vm.swap_quota_bytes();
  }
  if (layer.vm.swap_mode() != v1::MODE_UNSPECIFIED) {
    vm["swap_mode"] = ProtoModeText(layer.vm.swap_mode());
  }
  if (!vm.empty()) j["vm"] = vm;
  return j.dump();
}

absl::StatusOr<PolicySet> ResolveFleetPolicy(
    const std::map<std::string, std::string>& keys, const std::string& host,
    const std::vector<std::string>& groups) {
  PolicySet out;
  for (const std::string& key : HostLayerKeys(host, groups)) {
    auto it = keys.find(key);
    if (it == keys.end()) continue;
    absl::StatusOr<FleetLayer> layer = ParseFleetLayer(key, it->second);
    if (!layer.ok()) return layer.status();
    out.host.MergeFrom(layer->host);
    out.vm_defaults.MergeFrom(layer->vm);
  }
  const std::string vm_prefix = absl::StrCat(kFleetPolicyPrefix, "vms/");
  for (auto it = keys.lower_bound(vm_prefix);
       it != keys.end() && std::string_view(it->first).starts_with(vm_prefix);
       ++it) {
    absl::StatusOr<FleetLayer> layer = ParseFleetLayer(it->first, it->second);
    if (!layer.ok()) return layer.status();
    out.vms[it->first.substr(vm_prefix.size())] = layer->vm;
  }
  return out;
}

bool FleetKeyKept(const std::string& key, const std::string& host,
                  const std::vector<std::string>& groups) {
  if (key == kFleetAppliedKey) return false;
  return FleetKeyConcernsHost(key, host, groups) || !CheckFleetKey(key).ok();
}

bool FleetKeyConcernsHost(const std::string& key, const std::string& host,
                          const std::vector<std::string>& groups) {
  for (const std::string& k : HostLayerKeys(host, groups)) {
    if (key == k) return true;
  }
  return std::string_view(key).starts_with(
      absl::StrCat(kFleetPolicyPrefix, "vms/"));
}

}  // namespace tmem
