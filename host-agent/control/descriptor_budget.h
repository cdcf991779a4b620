// DescriptorBudget: how tmemd shares its RLIMIT_NOFILE between guest
// channels, its own fixed needs and the control-plane connections.
//
// A local user may open as many connections to the world-accessible
// read-only socket as tmemd lets them; without a budget those connections
// take the descriptors a new guest's channel (QEMU's handshake) and the
// admin socket need. So, at start-up:
//
//  1. RaiseDescriptorLimit() lifts the soft RLIMIT_NOFILE to the hard one
//     (systemd's default soft limit is 1024; the unit sets LimitNOFILE=).
//  2. PlanDescriptorBudget() checks
//
//       kFixedDescriptors                          tmemd's own (logs, state
//                                                  file, eventfds, epoll,
//                                                  gRPC, libvirt, etcd)
//     + reserved_vm_channels * (3 + 2 * vectors)   each guest channel: its
//                                                  memfd, listening socket,
//                                                  QEMU's connection, and a
//                                                  doorbell and an interrupt
//                                                  eventfd per vector
//     + metrics_clients                            /metrics: listener and
//                                                  clients (0 when off)
//     + 2 * (admin + readonly + tcp)               each control connection
//                                                  (control_acceptor.h)
//     <= the soft limit
//
//     and, when the configured caps do not fit, lowers them in this order
//     until they do: read-only first, then TCP, then admin, none below 1.
//     If even one connection per listener does not fit, the limit is too
//     low for the reservation: an error names both.
//
// The guarantee: with at most reserved_vm_channels guests, no number of
// control or metrics connections can take a descriptor a guest channel or
// an admin connection needs. Pure functions apart from RaiseDescriptorLimit.
#ifndef TMEMD_HOST_AGENT_CONTROL_DESCRIPTOR_BUDGET_H_
#define TMEMD_HOST_AGENT_CONTROL_DESCRIPTOR_BUDGET_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tmem {

inline constexpr int64_t kFixedDescriptors = 128;

// Descriptors one guest channel holds with `vectors` interrupt vectors.
inline constexpr int64_t DescriptorsPerVmChannel(int vectors) {
  return 3 + int64_t{2} * vectors;
}

struct DescriptorLimit {
  int64_t soft = 0;
  int64_t hard = 0;
  bool raised = false;  // the soft limit was below the hard one
};

// Sets the soft RLIMIT_NOFILE to the hard limit; returns both after.
absl::StatusOr<DescriptorLimit> RaiseDescriptorLimit();

struct DescriptorBudgetInput {
  int64_t limit = 0;  // the soft RLIMIT_NOFILE
  int64_t reserved_vm_channels = 0;
  int vectors = 1;
  int64_t metrics_clients = 0;  // listener + clients; 0: no metrics server
  // Configured caps; 0: that listener is off.
  int admin = 0;
  int readonly = 0;
  int tcp = 0;
};

struct DescriptorBudget {
  int64_t guest_reserve = 0;
  int64_t control_descriptors = 0;  // what the caps below may use
  int admin = 0;
  int readonly = 0;
  int tcp = 0;
  bool lowered = false;  // a configured cap did not fit
};

absl::StatusOr<DescriptorBudget> PlanDescriptorBudget(
    const DescriptorBudgetInput& in);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CONTROL_DESCRIPTOR_BUDGET_H_
