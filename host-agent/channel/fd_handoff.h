// Handing a VM's descriptors from one tmemd process to the next, so a
// running VM keeps its ivshmem device across a tmemd restart or upgrade
// (QEMU never reconnects to the server socket; docs/operations.md).
//
// Each channel is a set of named descriptors, "VM/KIND" with KIND one of
// shm (the region memfd), listen (the ivshmem socket), client (QEMU's
// connection), attaching (a connection stored before its handshake, see
// channel.h), dbN and irqN (doorbell and interrupt eventfds of vector N).
// VM names never hold '/', ':', ';' or '=' (ValidateVmName), so the names
// are valid systemd FDNAMEs and parse back unambiguously.
//
// Two ways across:
//  * systemd's file-descriptor store (crash, `systemctl restart`): tmemd
//    sends every descriptor with FDSTORE=1 as it creates it (and the
//    client's when QEMU connects), removes them with FDSTOREREMOVE=1 when a
//    VM goes, and the next tmemd gets them back as LISTEN_FDS /
//    LISTEN_FDNAMES. The unit needs FileDescriptorStoreMax=.
//  * exec in place (SIGHUP, a planned upgrade): tmemd clears close-on-exec
//    on the descriptors, lists them in TMEMD_HANDOFF_FDS ("name=fd;..."),
//    and execs its binary; the descriptors keep their numbers (no dup2
//    while other threads may still hold descriptor numbers).
//
// Thread safety: SystemdFdStore may be used from any thread (each call is
// one datagram); InheritedFds and ExecWithFds are for the main thread.
#ifndef TMEMD_HOST_AGENT_CHANNEL_FD_HANDOFF_H_
#define TMEMD_HOST_AGENT_CHANNEL_FD_HANDOFF_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "host-agent/channel/ivshmem_server.h"

namespace tmem {

struct NamedFd {
  std::string name;
  int fd = -1;
};

// Where tmemd keeps descriptors for its successor. A store that refuses is
// logged and counted by the implementation; Store says whether the
// descriptor was handed over (once it returns true, a crash cannot lose it).
class FdStore {
 public:
  virtual ~FdStore() = default;
  virtual bool Store(const std::string& name, int fd) = 0;
  virtual void Remove(const std::string& name) = 0;
};

// sd_pid_notify_with_fds to $NOTIFY_SOCKET (systemd, or a test playing it).
class SystemdFdStore final : public FdStore {
 public:
  // nullptr when $NOTIFY_SOCKET is not set (not run by systemd).
  static std::unique_ptr<SystemdFdStore> FromEnvironment();
  bool Store(const std::string& name, int fd) override;
  void Remove(const std::string& name) override;
  uint64_t stored() const { return stored_.load(); }
  uint64_t failures() const { return failures_.load(); }

 private:
  SystemdFdStore() = default;
  std::atomic<uint64_t> stored_{0};
  std::atomic<uint64_t> failures_{0};
};

// "web1/db0" and the like.
std::string ChannelFdName(std::string_view vm, std::string_view kind);

// The descriptors a previous tmemd handed over, grouped by VM.
struct InheritedChannels {
  std::map<std::string, IvshmemServerFds> vms;
  // Descriptors whose name did not parse, or that completed no channel:
  // closed, and counted so an operator sees it.
  uint64_t rejected = 0;
  std::vector<std::string> errors;
  // "systemd" (LISTEN_FDS), "exec" (TMEMD_HANDOFF_FDS) or "" (fresh start).
  std::string source;
};

// Reads TMEMD_HANDOFF_FDS, else LISTEN_FDS/LISTEN_FDNAMES (checking
// LISTEN_PID), and unsets them so children never see them. Every
// descriptor is validated as open; each channel must have its shm, listen
// socket and matching dbN/irqN runs starting at 0, or it is rejected whole.
InheritedChannels TakeInheritedChannels();

// Hands `fds` to a fresh image of `exe` (argv as given): clears their
// close-on-exec flags, sets TMEMD_HANDOFF_FDS and execs. Returns only on
// failure, with close-on-exec restored.
absl::Status ExecWithFds(const std::string& exe,
                         const std::vector<std::string>& argv,
                         const std::vector<NamedFd>& fds);

// systemd readiness protocol (no-ops without $NOTIFY_SOCKET). `status` is
// the one-line STATUS= that `systemctl status` shows.
// READY=1 and RELOADING=1 wait for room in systemd's queue; STATUS=,
// WATCHDOG=1 (main-loop ticks) and STOPPING=1 never block and are dropped
// when the queue is full.
void NotifyReady(const std::string& status);
void NotifyStatus(const std::string& status);
void NotifyStopping();
// Before an exec in place (SIGHUP): the same PID sends READY=1 again when
// the new image serves. STOPPING=1 there would make systemd treat the
// service as stopping and SIGKILL it after TimeoutStopSec=.
void NotifyReloading();
// WATCHDOG_USEC (and WATCHDOG_PID, if set, naming this process): the
// interval within which systemd wants WATCHDOG=1; nullopt without one.
// Kept across an exec in place (same PID, same environment).
std::optional<std::chrono::microseconds> WatchdogInterval();
void NotifyWatchdog(const std::string& status);
// While a stop is under way (STOPPING=1 or RELOADING=1 sent): WATCHDOG=1,
// EXTEND_TIMEOUT_USEC= (systemd gives the stop `extend` more from now,
// beyond TimeoutStopSec=) and STATUS=. Never blocks.
void NotifyStopProgress(const std::string& status,
                        std::chrono::microseconds extend);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_CHANNEL_FD_HANDOFF_H_
