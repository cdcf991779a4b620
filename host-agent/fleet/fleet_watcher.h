// FleetWatcher: tmemd's side of fleet policy (docs/fleet.md).
//
// One thread watches /tmemd/v1/policy/ over etcd's gRPC Watch from the
// revision after the last one seen (a full Range first when there is none,
// or when etcd compacted it away), resolves what concerns this host, and
// applies each revision whole through ControlPlane::ApplyPolicySet, the
// path SetHostPolicy/SetVmPolicy use. Keys and values are bytes: one that
// is not UTF-8, not a valid layer, or outside the layout is refused with
// its reason (escaped), the revision is rejected and the last good policy
// stays (FleetView). Its view (revision, the keys it keeps, any rejection)
// is saved in STATE_DIR/fleet-state.json (a snapshot) plus
// fleet-state.journal (one line per revision: its changed keys), both
// written after the revision's policy is applied and saved, so the saved
// revision never runs ahead of the saved policy; the snapshot is rewritten
// only when the journal outgrows it, so a revision costs in proportion to
// what it changed. The applied policy itself is in tmemd's state file. While
// etcd is unreachable nothing changes: the host keeps enforcing what it
// applied, and the watcher retries the endpoints in turn.
//
// A second thread owns the lease and the status key
// /tmemd/v1/status/hosts/<host> (applied revision, rejection, mode, VM
// count), rewritten after every revision and kept alive every TTL/3; it
// also registers the host under /tmemd/v1/members/<host>.
//
// Every failed etcd call is logged (fleet_etcd_unavailable, or
// fleet_etcd_tls_error when EtcdClient traced it to TLS: a refused client
// certificate, an untrusted server) and counted (FleetCounters, also in
// tmemd's Status() host counters as fleet_etcd_errors and
// fleet_etcd_tls_errors). Nothing is applied until etcd answers.
//
// Thread-safe: the two threads share only counters under one mutex; Stop()
// (or the destructor) cancels the watch stream and joins both.
#ifndef TMEMD_HOST_AGENT_FLEET_FLEET_WATCHER_H_
#define TMEMD_HOST_AGENT_FLEET_FLEET_WATCHER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "backend/mutex.h"
#include "host-agent/agent.h"
#include "host-agent/config.h"
#include "host-agent/control/control_plane.h"
#include "host-agent/fleet/etcd_client.h"
#include "host-agent/fleet/fleet_policy.h"
#include "host-agent/fleet/fleet_view.h"

namespace grpc {
class ClientContext;
}

namespace tmem {

// Counted since start; in tmemd's Status() host counters (fleet_*).
struct FleetCounters {
  uint64_t etcd_errors = 0;      // failed etcd calls/streams, every cause
  uint64_t etcd_tls_errors = 0;  // of those, traced to TLS (etcd_tls.h)
  uint64_t revisions_applied = 0;
  uint64_t revisions_rejected = 0;
  // Work, in proportion to the changes seen (a test asserts it).
  uint64_t layers_parsed = 0;        // etcd values parsed
  uint64_t state_bytes_written = 0;  // snapshot and journal bytes
};

struct FleetProgress {
  int64_t seen_revision = 0;     // the view is complete up to here
  int64_t applied_revision = 0;  // the policy in force is this revision's
  int64_t rejected_revision = 0;
  std::string rejected_reason;  // "" unless the current view is refused
};

class FleetWatcher {
 public:
  // Loads the saved view (re-applying it, so VMs added later get it) and
  // starts both threads. `config.host` must be set. Control and agent
  // must outlive the watcher.
  static absl::StatusOr<std::unique_ptr<FleetWatcher>> Start(
      const FleetConfig& config, ControlPlane* control, Agent* agent);
  ~FleetWatcher();
  FleetWatcher(const FleetWatcher&) = delete;
  FleetWatcher& operator=(const FleetWatcher&) = delete;

  // Stops both threads; revokes the lease so the status key goes at once.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  FleetProgress Progress() const ABSL_LOCKS_EXCLUDED(mu_);
  FleetCounters Counters() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  FleetWatcher(FleetConfig config, ControlPlane* control, Agent* agent,
               std::unique_ptr<EtcdClient> watch_client,
               std::unique_ptr<EtcdClient> status_client);
  // One revision's changes to the kept keys (nullopt: deleted).
  using Changes =
      std::vector<std::pair<std::string, std::optional<std::string>>>;
  void LoadState();
  // The journal line for `changes`, or a whole snapshot when one is due
  // (after a full read, a failed write, or a journal larger than it).
  absl::Status SaveState(const Changes& changes);
  absl::Status WriteSnapshot();
  void WatchLoop();
  void StatusLoop();
  absl::Status FullRead();
  // Runs one watch stream until it ends; sets *compacted when etcd no
  // longer has the revision asked for.
  absl::Status RunWatch(bool* compacted);
  // Resolves keys_ as of `revision` and applies it (or records why not).
  void Process(int64_t revision, const Changes& changes);
  // Sleeps up to `d` unless stopping; false when stopping.
  bool Pause(std::chrono::milliseconds d) ABSL_LOCKS_EXCLUDED(mu_);
  bool Stopping() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string StatusJson() const;
  // Counts and logs one failed etcd call.
  void RecordEtcdError(const absl::Status& s, const EtcdClient& etcd,
                       const char* step) ABSL_LOCKS_EXCLUDED(mu_);

  const FleetConfig config_;
  const std::string state_path_;
  ControlPlane* const control_;
  Agent* const agent_;
  // Only the watch thread touches these (and LoadState before it starts).
  std::unique_ptr<EtcdClient> watch_client_;
  FleetView view_;
  const std::string journal_path_;
  bool snapshot_due_ = true;  // the journal cannot carry the next save
  uint64_t snapshot_bytes_ = 0;
  uint64_t journal_bytes_ = 0;
  // Only the status thread.
  std::unique_ptr<EtcdClient> status_client_;

  // A leaf: etcd calls, ApplyPolicySet and the Agent are called without
  // it (host-agent/lock_order.h).
  mutable Mutex mu_;
  CondVar cv_;  // stop_ or status_dirty_ set
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool status_dirty_ ABSL_GUARDED_BY(mu_) = true;
  // When the status thread writes a dirty status: at once for its own
  // reasons (a new lease, a failed put), at this host's offset in
  // kStatusSpread after an apply (fleet_watcher.cc).
  std::chrono::steady_clock::time_point status_due_ ABSL_GUARDED_BY(mu_);
  FleetProgress progress_ ABSL_GUARDED_BY(mu_);
  FleetCounters counters_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* watch_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread watch_thread_;
  std::thread status_thread_;
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_FLEET_FLEET_WATCHER_H_
