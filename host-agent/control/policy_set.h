// PolicySet: a whole policy applied at once: the host's fields, the
// defaults every VM gets, and each named VM's own fields over them. The
// control plane applies one (ControlPlane::ApplyPolicySet); a desired-state
// source such as the fleet watcher builds one. Fields a message leaves unset
// are not said, and leave the current value alone.
//
// Owned by the control plane so that sources of policy depend on it, never
// the other way round. Pure value type. Thread-compatible.
#ifndef TMEMD_HOST_AGENT_CONTROL_POLICY_SET_H_
#define TMEMD_HOST_AGENT_CONTROL_POLICY_SET_H_

#include <map>
#include <string>

#include "proto/tmem/v1/control.pb.h"

namespace tmem {

struct PolicySet {
  v1::SetHostPolicyRequest host;
  v1::SetVmPolicyRequest vm_defaults;
  // Every VM the set names, present on this host or not (a VM may arrive
  // later).
  std::map<std::string, v1::SetVmPolicyRequest> vms;
  // The request one VM gets (defaults overlaid by its own fields).
  v1::SetVmPolicyRequest ForVm(const std::string& vm) const;
  friend bool operator==(const PolicySet& a, const PolicySet& b);
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_POLICY_SET_H_
