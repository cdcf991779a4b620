#include "host-agent/fleet/fleet_view.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"

namespace tmem {

FleetView::FleetView(std::string host, std::vector<std::string> groups)
    : host_(std::move(host)),
      groups_(std::move(groups)),
      vm_prefix_(absl::StrCat(kFleetPolicyPrefix, "vms/")) {}

bool FleetView::Keeps(const std::string& key) const {
  return FleetKeyKept(key, host_, groups_);
}

bool FleetView::IsVmKey(const std::string& key) const {
  return std::string_view(key).starts_with(vm_prefix_);
}

void FleetView::Forget(const std::string& key) {
  if (refused_.erase(key) > 0) changed_ = true;
  if (IsVmKey(key)) {
    if (policy_.vms.erase(key.substr(vm_prefix_.size())) > 0) changed_ = true;
  } else if (host_layers_.erase(key) > 0) {
    host_dirty_ = true;
    changed_ = true;
  }
}

bool FleetView::Put(const std::string& key, const std::string& value) {
  if (!Keeps(key)) return false;
  auto [it, inserted] = keys_.try_emplace(key, value);
  if (!inserted) {
    if (it->second == value) return true;
    it->second = value;
  }
  ++layers_parsed_;
  absl::StatusOr<FleetLayer> layer = ParseFleetLayer(key, value);
  if (!layer.ok()) {
    Forget(key);
    refused_[key] = std::string(layer.status().message());
    changed_ = true;
    return true;
  }
  if (refused_.erase(key) > 0) changed_ = true;
  if (IsVmKey(key)) {
    auto [vm, added] =
        policy_.vms.try_emplace(key.substr(vm_prefix_.size()), layer->vm);
    if (!added && !google::protobuf::util::MessageDifferencer::Equals(
                      vm->second, layer->vm)) {
      vm->second = layer->vm;
      changed_ = true;
    }
    if (added) changed_ = true;
    return true;
  }
  auto [h, added] = host_layers_.try_emplace(key, *layer);
  if (added || !(h->second == *layer)) {
    h->second = *std::move(layer);
    host_dirty_ = true;
    changed_ = true;
  }
  return true;
}

bool FleetView::Delete(const std::string& key) {
  if (keys_.erase(key) == 0) return false;
  Forget(key);
  return true;
}

void FleetView::Clear() {
  keys_.clear();
  host_layers_.clear();
  refused_.clear();
  policy_ = PolicySet();
  host_dirty_ = true;
  changed_ = true;
}

absl::StatusOr<const PolicySet*> FleetView::Resolve() {
  if (!refused_.empty()) {
    std::string reason = refused_.begin()->second;
    if (refused_.size() > 1) {
      absl::StrAppend(&reason, " (and ", refused_.size() - 1,
                      " more refused keys)");
    }
    return absl::InvalidArgumentError(reason);
  }
  if (host_dirty_) {
    // Least specific first, as ResolveFleetPolicy merges them.
    policy_.host.Clear();
    policy_.vm_defaults.Clear();
    std::vector<std::string> order = {
        absl::StrCat(kFleetPolicyPrefix, "fleet")};
    for (const std::string& g : groups_) {
      order.push_back(absl::StrCat(kFleetPolicyPrefix, "groups/", g));
    }
    order.push_back(absl::StrCat(kFleetPolicyPrefix, "hosts/", host_));
    for (const std::string& k : order) {
      auto it = host_layers_.find(k);
      if (it == host_layers_.end()) continue;
      policy_.host.MergeFrom(it->second.host);
      policy_.vm_defaults.MergeFrom(it->second.vm);
    }
    host_dirty_ = false;
  }
  return &policy_;
}

}  // namespace tmem
