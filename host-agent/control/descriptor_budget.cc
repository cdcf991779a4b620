#include "host-agent/control/descriptor_budget.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "host-agent/control/control_acceptor.h"

namespace tmem {

absl::StatusOr<DescriptorLimit> RaiseDescriptorLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return absl::InternalError(absl::StrCat(
        "getrlimit(RLIMIT_NOFILE): ", std::generic_category().message(errno)));
  }
  DescriptorLimit out;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
      return absl::InternalError(absl::StrCat(
          "setrlimit(RLIMIT_NOFILE) to the hard limit ", lim.rlim_max, ": ",
          std::generic_category().message(errno)));
    }
    out.raised = true;
  }
  // RLIM_INFINITY is not a real value for descriptors (nr_open caps it).
  auto value = [](rlim_t v) {
    return v == RLIM_INFINITY ? INT64_MAX
                              : static_cast<int64_t>(std::min<rlim_t>(
                                    v, static_cast<rlim_t>(INT64_MAX)));
  };
  out.soft = value(lim.rlim_cur);
  out.hard = value(lim.rlim_max);
  return out;
}

absl::StatusOr<DescriptorBudget> PlanDescriptorBudget(
    const DescriptorBudgetInput& in) {
  DescriptorBudget b;
  b.guest_reserve =
      in.reserved_vm_channels * DescriptorsPerVmChannel(in.vectors);
  b.control_descriptors =
      in.limit - kFixedDescriptors - b.guest_reserve - in.metrics_clients;
  const int64_t slots =
      b.control_descriptors / kDescriptorsPerControlConnection;
  b.admin = in.admin;
  b.readonly = in.readonly;
  b.tcp = in.tcp;
  const int64_t wanted = int64_t{in.admin} + in.readonly + in.tcp;
  const int64_t minimum =
      (in.admin > 0 ? 1 : 0) + (in.readonly > 0 ? 1 : 0) + (in.tcp > 0 ? 1 : 0);
  if (slots < minimum) {
    return absl::ResourceExhaustedError(
        absl::StrCat("RLIMIT_NOFILE ", in.limit,
                     " leaves no descriptor for the control "
                     "plane: ",
                     kFixedDescriptors, " for tmemd itself + ", b.guest_reserve,
                     " for ", in.reserved_vm_channels,
                     " guest channels ([control] "
                     "reserved_vm_channels) + ",
                     in.metrics_clients,
                     " for /metrics; raise LimitNOFILE= (ulimit -n) or lower "
                     "reserved_vm_channels"));
  }
  int64_t excess = wanted - slots;
  for (int* cap : {&b.readonly, &b.tcp, &b.admin}) {
    if (excess <= 0) break;
    if (*cap <= 1) continue;
    const int64_t cut = std::min<int64_t>(excess, *cap - 1);
    *cap -= static_cast<int>(cut);
    excess -= cut;
    b.lowered = true;
  }
  return b;
}

}  // namespace tmem
