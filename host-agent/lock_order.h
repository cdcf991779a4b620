// Lock order in tmemd, written once: every mutex declaration in host-agent/
// points here. A thread takes a lock only after the locks it holds that come
// earlier in this list, never one that comes later. Locks on one line are
// never held together.
//
// The control path:
//   1. ControlPlane::write_mu_ (one control-plane write at a time: check,
//      apply, commit; the fleet watcher's ApplyPolicySet included).
//   2. DomainManager::op_mu_ (one libvirt-glue operation; SetVmPolicy calls
//      PolicyChanged under 1). The libvirt hooks only try it (TryLock):
//      libvirtd may be waiting for a hook while 2 waits on libvirtd.
//   3. Agent::lifecycle_mu_ (a whole AddVm/RestoreVm/RemoveVm).
//   4. Agent::mu_ (the VM table, worker load, the policy resolver).
//   5. Taken under Agent::mu_ and holding nothing further of host-agent:
//      ControlPlane::fleet_mu_ and PolicyStore::mu_ (the resolver, called in
//      AddVm); Worker::mu_ (channel commands; RemoveChannel waits for the
//      worker thread, which never takes 1-4).
//   6. The backend's own locks: Valve::mu_, then the store's list in
//      backend/tmem_store.h. Valve::mu_ never nests the store's locks:
//      the caller samples the store first (backend/memory_sample.h).
//      A worker's put only tries Valve::mu_ (Valve::JudgeAtThreshold,
//      holding nothing), never waits for it.
//   LibvirtHypervisor::mu_ (the connection, held across libvirt calls) is
//   taken under 2 and takes nothing further.
//   A swap device's TmemSwapBacking: relief_mu_ (one relief step), then
//   one page's stripe lock, then 6. The ticker's swap relief holds 3 (not
//   4) across the step; a graceful stop's write-back takes the stripes
//   under 4.
//
// libvirt's event thread:
//   a. the live-instance lock (libvirt_hypervisor.cc: a callback reaches
//      an instance only while it is alive);
//   b. LibvirtHypervisor::handler_mu_ (held while the handler runs) or
//      LibvirtHypervisor::reconnect_mu_;
//   c. DomainManager::mu_ (the event queue; the handler appends to it).
//   The manager's thread takes c alone, and 2 only after it dropped c.
//
// Leaves, held alone (nothing else is taken under them, and they are
// taken under nothing but what is listed):
//   ControlPlane::extra_mu_, then FleetWatcher::mu_ (the status counters
//   read the watcher's counters); FleetWatcher::mu_ otherwise alone (etcd,
//   ApplyPolicySet and the Agent are called without it); Agent::ticker_mu_;
//   StopSignal::mu_ (the gRPC server's shutdown); DomainManager::hook_mu_
//   (the hook's channels not yet adopted; also taken under 2, and the Agent
//   is called without it).
//
// Every mutex here is a Mutex of backend/mutex.h (std locks, which TSan
// intercepts); waits use its CondVar. Fields carry ABSL_GUARDED_BY and
// helpers that expect a lock ABSL_EXCLUSIVE_LOCKS_REQUIRED, checked by
// clang's -Wthread-safety (tmem_warnings adds it for clang: the tsan and
// clang presets). The analysis checks what each lock guards; the order
// above is checked by TSan's deadlock detector in the tests, not by clang.
#ifndef TMEMD_HOST_AGENT_LOCK_ORDER_H_
#define TMEMD_HOST_AGENT_LOCK_ORDER_H_
#endif  // TMEMD_HOST_AGENT_LOCK_ORDER_H_
