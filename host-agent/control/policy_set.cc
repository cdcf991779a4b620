#include "host-agent/control/policy_set.h"

#include <google/protobuf/util/message_differencer.h>

namespace tmem {
namespace {

bool SameMessage(const google::protobuf::Message& a,
                 const google::protobuf::Message& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

}  // namespace

bool operator==(const PolicySet& a, const PolicySet& b) {
  if (!SameMessage(a.host, b.host) ||
      !SameMessage(a.vm_defaults, b.vm_defaults) ||
      a.vms.size() != b.vms.size()) {
    return false;
  }
  for (auto ia = a.vms.begin(), ib = b.vms.begin(); ia != a.vms.end();
       ++ia, ++ib) {
    if (ia->first != ib->first || !SameMessage(ia->second, ib->second)) {
      return false;
    }
  }
  return true;
}

v1::SetVmPolicyRequest PolicySet::ForVm(const std::string& vm) const {
  v1::SetVmPolicyRequest r = vm_defaults;
  if (auto it = vms.find(vm); it != vms.end()) r.MergeFrom(it->second);
  r.set_vm(vm);
  return r;
}

}  // namespace tmem
