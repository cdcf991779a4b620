#include "host-agent/control/policy_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "host-agent/common/setting_ranges.h"

namespace tmem {
namespace {

using nlohmann::json;

absl::Status StaleGeneration(const std::string& what, uint64_t requested,
                             uint64_t applied) {
  return absl::FailedPreconditionError(absl::StrCat(
      "policy generation ", requested, " for ", what,
      " is not newer than the applied generation ", applied,
      ": a newer policy is already in place; re-read it (tmemctl vm/status) "
      "and push with a generation above ",
      applied, " (or 0 for the next one)"));
}

absl::Status ErrnoStatus(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(
      what, " '", path, "': ", std::generic_category().message(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PolicyStore>> PolicyStore::Open(
    const std::string& path) {
  std::unique_ptr<PolicyStore> store(new PolicyStore(path));
  if (path.empty()) return store;
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT) return store;
    return ErrnoStatus("cannot read state file", path);
  }
  std::stringstream buf;
  buf << in.rdbuf();
  MutexLock lock(&store->mu_);
  if (absl::Status s = store->LoadLocked(buf.str()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state file '", path, "' is not valid (", s.message(),
        "); fix or move it away, tmemd then starts with no saved policy"));
  }
  return store;
}

absl::Status PolicyStore::LoadLocked(const std::string& text) {
  try {
    const json j = json::parse(text);
    if (j.value("version", 0) != 1) {
      return absl::InvalidArgumentError("unknown version (want 1)");
    }
    if (j.contains("host")) {
      const json& h = j.at("host");
      host_.generation = h.value("generation", uint64_t{0});
      if (h.contains("memory_cap_bytes")) {
        const uint64_t cap = h.at("memory_cap_bytes").get<uint64_t>();
        if (absl::Status s =
                CheckRange(ranges::kMemoryCap, cap, "host.memory_cap_bytes");
            !s.ok()) {
          return s;
        }
        host_.memory_cap_bytes = cap;
      }
      if (h.contains("cpu_budget_percent")) {
        const double budget = h.at("cpu_budget_percent").get<double>();
        if (absl::Status s = CheckRange(ranges::kCpuBudgetPercent, budget,
                                        "host.cpu_budget_percent");
            !s.ok()) {
          return s;
        }
        host_.cpu_budget_percent = budget;
      }
      if (h.contains("default_mode")) {
        ValveMode m;
        if (!ParseValveMode(h.at("default_mode").get<std::string>(), &m)) {
          return absl::InvalidArgumentError("bad host.default_mode");
        }
        host_.default_mode = m;
      }
    }
    if (j.contains("vms")) {
      for (const auto& [name, v] : j.at("vms").items()) {
        StoredVmPolicy p;
        p.generation = v.at("generation").get<uint64_t>();
        // Read wide and range-checked: get<uint32_t>() would wrap
        // 5000000000 to 705032704.
        const std::string where = absl::StrCat("vms.", name);
        const uint64_t quota = v.at("quota_bytes").get<uint64_t>();
        if (quota != kUnlimitedQuota) {  // older files wrote UINT64_MAX
          if (absl::Status s =
                  CheckRange(ranges::kQuota, quota, where + ".quota_bytes");
              !s.ok()) {
            return s;
          }
        }
        p.policy.quota_bytes = QuotaFromSetting(quota);
        const uint64_t weight = v.at("weight").get<uint64_t>();
        if (absl::Status s =
                CheckRange(ranges::kWeight, weight, where + ".weight");
            !s.ok()) {
          return s;
        }
        p.policy.weight = static_cast<uint32_t>(weight);
        p.policy.enabled = v.at("enabled").get<bool>();
        p.policy.frozen = v.at("frozen").get<bool>();
        if (!ParseValveMode(v.at("mode").get<std::string>(), &p.policy.mode)) {
          return absl::InvalidArgumentError(
              absl::StrCat("bad mode for VM '", name, "'"));
        }
        // Swap fields: absent from state files written before they
        // existed; the VM then keeps VmPolicy's defaults.
        if (v.contains("swap_quota_bytes")) {
          const json& q = v.at("swap_quota_bytes");
          if (!q.is_number_unsigned()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ".swap_quota_bytes: ", q.dump(),
                             " is not a byte count (0: unlimited)"));
          }
          if (absl::Status s = CheckRange(ranges::kSwapQuota, q.get<uint64_t>(),
                                          where + ".swap_quota_bytes");
              !s.ok()) {
            return s;
          }
          p.policy.swap_quota_bytes = QuotaFromSetting(q.get<uint64_t>());
        }
        if (v.contains("swap_mode")) {
          const json& m = v.at("swap_mode");
          if (!m.is_string() ||
              !ParseValveMode(m.get<std::string>(), &p.policy.swap_mode)) {
            return absl::InvalidArgumentError(absl::StrCat(
                where, ".swap_mode: ", m.dump(),
                " is not a mode (default, off, always, adaptive)"));
          }
        }
        vms_[name] = p;
      }
    }
    if (j.contains("shared_pools")) {
      for (const json& g : j.at("shared_pools")) {
        grants_.push_back(
            {g.at("uuid").get<std::string>(), g.at("vm").get<std::string>()});
      }
      std::sort(grants_.begin(), grants_.end());
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
  return absl::OkStatus();
}

std::string PolicyStore::SerializeLocked() const {
  json j;
  j["version"] = 1;
  json h;
  h["generation"] = host_.generation;
  if (host_.memory_cap_bytes) h["memory_cap_bytes"] = *host_.memory_cap_bytes;
  if (host_.cpu_budget_percent) {
    h["cpu_budget_percent"] = *host_.cpu_budget_percent;
  }
  if (host_.default_mode) {
    h["default_mode"] = std::string(ValveModeName(*host_.default_mode));
  }
  j["host"] = h;
  json vms = json::object();
  for (const auto& [name, p] : vms_) {
    vms[name] = {
        {"generation", p.generation},
        // 0: unlimited, as everywhere (setting_ranges.h).
        {"quota_bytes", p.policy.quota_bytes == kUnlimitedQuota
                            ? uint64_t{0}
                            : p.policy.quota_bytes},
        {"weight", p.policy.weight},
        {"enabled", p.policy.enabled},
        {"frozen", p.policy.frozen},
        {"mode", std::string(ValveModeName(p.policy.mode))},
        {"swap_quota_bytes", p.policy.swap_quota_bytes == kUnlimitedQuota
                                 ? uint64_t{0}
                                 : p.policy.swap_quota_bytes},
        {"swap_mode", std::string(ValveModeName(p.policy.swap_mode))}};
  }
  j["vms"] = vms;
  json grants = json::array();
  for (const SharedPoolGrant& g : grants_) {
    grants.push_back({{"uuid", g.uuid}, {"vm", g.vm}});
  }
  j["shared_pools"] = grants;
  return j.dump(2) + "\n";
}

std::string PolicyStore::Serialize() const {
  MutexLock lock(&mu_);
  return SerializeLocked();
}

absl::Status PolicyStore::SaveLocked() const {
  if (path_.empty()) return absl::OkStatus();
  const std::string text = SerializeLocked();
  const std::string tmp = absl::StrCat(path_, ".tmp.", getpid());
  // A temporary left by a crashed tmemd of the same pid goes first (unlink
  // removes a link itself, never its target); then the file is created new,
  // never opened through a link someone planted (O_EXCL | O_NOFOLLOW).
  if (unlink(tmp.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus("cannot remove stale state file temporary", tmp);
  }
  const int fd = open(
      tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus("cannot create state file temporary", tmp);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = ErrnoStatus("cannot write state file", tmp);
      close(fd);
      unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    absl::Status s = ErrnoStatus("cannot fsync state file", tmp);
    close(fd);
    unlink(tmp.c_str());
    return s;
  }
  close(fd);
  if (rename(tmp.c_str(), path_.c_str()) != 0) {
    absl::Status s = ErrnoStatus("cannot rename state file onto", path_);
    unlink(tmp.c_str());
    return s;
  }
  // The rename itself is durable once the directory is synced.
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PolicyStore::NextVmGeneration(
    const std::string& vm, uint64_t requested) const {
  MutexLock lock(&mu_);
  auto it = vms_.find(vm);
  const uint64_t applied = it == vms_.end() ? 0 : it->second.generation;
  if (requested == 0) return applied + 1;
  if (requested <= applied) {
    return StaleGeneration(absl::StrCat("VM '", vm, "'"), requested, applied);
  }
  return requested;
}

absl::StatusOr<uint64_t> PolicyStore::NextHostGeneration(
    uint64_t requested) const {
  MutexLock lock(&mu_);
  if (requested == 0) return host_.generation + 1;
  if (requested <= host_.generation) {
    return StaleGeneration("the host", requested, host_.generation);
  }
  return requested;
}

absl::Status PolicyStore::CommitVm(const std::string& vm,
                                   const StoredVmPolicy& policy) {
  MutexLock lock(&mu_);
  vms_[vm] = policy;
  return SaveLocked();
}

absl::Status PolicyStore::CommitHost(const StoredHostPolicy& policy) {
  MutexLock lock(&mu_);
  host_ = policy;
  return SaveLocked();
}

absl::Status PolicyStore::SetSharedPoolGrant(const SharedPoolGrant& grant,
                                             bool granted) {
  MutexLock lock(&mu_);
  auto it = std::lower_bound(grants_.begin(), grants_.end(), grant);
  const bool present = it != grants_.end() && *it == grant;
  if (granted && !present) grants_.insert(it, grant);
  if (!granted && present) grants_.erase(it);
  return SaveLocked();
}

std::optional<StoredVmPolicy> PolicyStore::Vm(const std::string& vm) const {
  MutexLock lock(&mu_);
  auto it = vms_.find(vm);
  if (it == vms_.end()) return std::nullopt;
  return it->second;
}

StoredHostPolicy PolicyStore::Host() const {
  MutexLock lock(&mu_);
  return host_;
}

std::vector<SharedPoolGrant> PolicyStore::SharedPoolGrants() const {
  MutexLock lock(&mu_);
  return grants_;
}

}  // namespace tmem
