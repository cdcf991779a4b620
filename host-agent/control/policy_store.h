// PolicyStore: the policies pushed over the control plane, their
// generations, and the state file that makes them survive a restart.
//
// Generations: every VM and the host carry the generation of the last
// policy applied. A push must carry a newer one, or 0 for "the next one"
// (what an interactive tmemctl sends); an older or equal generation is
// FAILED_PRECONDITION, so a delayed push from a fleet tool never overwrites
// a newer one. Generations live in the state file too, so the rule holds
// across restarts.
//
// Persistence: the whole state is one JSON file, rewritten on every change
// through a temporary file, fsync and rename(2) in the same directory, so a
// crash leaves either the old or the new file, never half of one. An empty
// path keeps the state in memory only.
//
// Thread-safe: one mutex. The caller (ControlPlane) serializes
// check-apply-commit sequences itself; PolicyStore only guards its maps.
#ifndef TMEMD_HOST_AGENT_CONTROL_POLICY_STORE_H_
#define TMEMD_HOST_AGENT_CONTROL_POLICY_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/mutex.h"
#include "backend/tmem_store.h"

namespace tmem {

struct StoredVmPolicy {
  VmPolicy policy;
  uint64_t generation = 0;
};

// Only what was pushed is set; the rest stays as configured.
struct StoredHostPolicy {
  std::optional<uint64_t> memory_cap_bytes;
  std::optional<double> cpu_budget_percent;
  std::optional<ValveMode> default_mode;
  uint64_t generation = 0;
};

struct SharedPoolGrant {
  std::string uuid;  // 8-4-4-4-12 hex
  std::string vm;
  friend bool operator<(const SharedPoolGrant& a, const SharedPoolGrant& b) {
    return std::tie(a.uuid, a.vm) < std::tie(b.uuid, b.vm);
  }
  friend bool operator==(const SharedPoolGrant&,
                         const SharedPoolGrant&) = default;
};

class PolicyStore {
 public:
  // Loads `path` if it exists (INVALID_ARGUMENT naming the file if it is
  // not a valid state file); a missing file is an empty state. "" means in
  // memory only.
  static absl::StatusOr<std::unique_ptr<PolicyStore>> Open(
      const std::string& path);

  // The generation a push with `requested` would get for this VM / the
  // host: requested itself if newer than the applied one, applied + 1 if
  // requested is 0, FAILED_PRECONDITION otherwise.
  absl::StatusOr<uint64_t> NextVmGeneration(const std::string& vm,
                                            uint64_t requested) const;
  absl::StatusOr<uint64_t> NextHostGeneration(uint64_t requested) const;

  // Records an applied policy and rewrites the state file. On a write
  // error the memory state still changes (the policy is live) and the
  // error is returned so the caller can report it.
  absl::Status CommitVm(const std::string& vm, const StoredVmPolicy& policy);
  absl::Status CommitHost(const StoredHostPolicy& policy);
  absl::Status SetSharedPoolGrant(const SharedPoolGrant& grant, bool granted);

  std::optional<StoredVmPolicy> Vm(const std::string& vm) const;
  StoredHostPolicy Host() const;
  std::vector<SharedPoolGrant> SharedPoolGrants() const;
  const std::string& path() const { return path_; }

  // Exposed for tests: the JSON text of the current state.
  std::string Serialize() const;

 private:
  explicit PolicyStore(std::string path) : path_(std::move(path)) {}
  absl::Status LoadLocked(const std::string& text)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string SerializeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SaveLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable Mutex mu_;  // lock order: host-agent/lock_order.h
  std::map<std::string, StoredVmPolicy> vms_ ABSL_GUARDED_BY(mu_);
  StoredHostPolicy host_ ABSL_GUARDED_BY(mu_);
  std::vector<SharedPoolGrant> grants_ ABSL_GUARDED_BY(mu_);  // sorted
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_POLICY_STORE_H_
