// FleetView: the fleet keys one host reads, kept parsed, so that a revision
// costs work in proportion to the keys it changed, not to the keys there
// are (a fleet may hold a vms/<vm> key for each of many thousand VMs).
//
// It keeps the raw bytes of every key FleetKeyKept() names (for the state
// file), the parsed layer of each valid one, and the reason each refused
// one is refused: a value that is not UTF-8 or not a valid layer, a key
// outside the documented layout. While any key is refused the view
// resolves to the first refusal (keys in order), so the host keeps the
// last policy it applied; the refusal goes when the key is fixed or
// deleted. Each Put parses only its own value; Resolve merges the few host
// layers and hands out the per-VM map kept up to date key by key.
//
// Pure logic: no I/O. Thread-compatible (the fleet watcher's thread).
#ifndef TMEMD_HOST_AGENT_FLEET_FLEET_VIEW_H_
#define TMEMD_HOST_AGENT_FLEET_FLEET_VIEW_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "host-agent/fleet/fleet_policy.h"

namespace tmem {

class FleetView {
 public:
  FleetView(std::string host, std::vector<std::string> groups);

  // Whether this host keeps `key` (FleetKeyKept).
  bool Keeps(const std::string& key) const;
  // A key's new value or its deletion; keys it does not keep are ignored
  // (false). A value equal to the one held costs nothing.
  bool Put(const std::string& key, const std::string& value);
  bool Delete(const std::string& key);
  void Clear();

  // Every kept key, bytes as etcd holds them.
  const std::map<std::string, std::string>& keys() const { return keys_; }
  // The policy the keys resolve to (valid until the next change), or the
  // first refused key's reason (INVALID_ARGUMENT, keys shown escaped).
  absl::StatusOr<const PolicySet*> Resolve();
  // Whether what Resolve gives may differ from what was last marked
  // applied (true until the first MarkApplied).
  bool changed() const { return changed_; }
  void MarkApplied() { changed_ = false; }
  // Values parsed since construction: the work counter behind "in
  // proportion to the change".
  uint64_t layers_parsed() const { return layers_parsed_; }

 private:
  bool IsVmKey(const std::string& key) const;
  // Drops what the view derived from `key` (its layer or its refusal).
  void Forget(const std::string& key);

  const std::string host_;
  const std::vector<std::string> groups_;
  const std::string vm_prefix_;
  std::map<std::string, std::string> keys_;
  std::map<std::string, FleetLayer> host_layers_;  // fleet, groups, hosts/
  std::map<std::string, std::string> refused_;     // key -> reason
  PolicySet policy_;  // vms kept per key; host parts by Resolve
  bool host_dirty_ = true;
  bool changed_ = true;
  uint64_t layers_parsed_ = 0;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_FLEET_FLEET_VIEW_H_
