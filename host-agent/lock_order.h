// Lock order in tmemd, written once: every mutex declaration in host-agent/
// points here. A thread takes a lock only after the locks it holds that come
// earlier in this list, never one that comes later. Locks on one line are
// never held together.
//
//   1. ControlPlane::write_mu_ (one control-plane write at a time: check,
//      apply, commit; the fleet watcher's ApplyPolicySet included).
//   2. Agent::lifecycle_mu_ (a whole AddVm/RestoreVm/RemoveVm).
//   3. Agent::mu_ (the VM table, worker load, the policy resolver).
//   4. Taken under Agent::mu_ and holding nothing further of host-agent:
//      ControlPlane::fleet_mu_ and PolicyStore::mu_ (the resolver, called in
//      AddVm); Worker::mu_ (channel commands; RemoveChannel waits for the
//      worker, which never takes 1-3).
//   5. The backend's own locks: Valve::mu_, then the store's list in
//      backend/tmem_store.h. Valve::mu_ no longer nests the store's
//      locks: the caller samples the store first (backend/memory_sample.h).
//
// Agent::ticker_mu_ is a leaf (std::mutex: std::condition_variable waits on
// it). Not yet annotated (std::mutex with "guarded by" comments, their order
// stated beside them): Worker, FleetWatcher, the gRPC server's stop mutex,
// the libvirt glue (host-agent/libvirt/).
//
// Annotated fields use ABSL_GUARDED_BY with the wrappers of backend/mutex.h
// (std locks, which TSan intercepts), checked by clang's -Wthread-safety
// (tmem_warnings adds it for clang: the tsan and clang presets).
#ifndef TMEMD_HOST_AGENT_LOCK_ORDER_H_
#define TMEMD_HOST_AGENT_LOCK_ORDER_H_
#endif  // TMEMD_HOST_AGENT_LOCK_ORDER_H_
