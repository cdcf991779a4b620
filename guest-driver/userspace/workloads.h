// Guest workloads for tmem-guestsim and the integration tests: each drives
// one TmemGuest the way a guest kernel's page cache would.
//
//  seq        streams `pages` distinct pages, each put once and never read
//             back (the 2011 report's sequential read: puts high, gets ~0).
//  reread     puts a working set of `pages` pages, lets the host take them
//             (waits, up to 10 s, until nothing is in flight), then `ops`
//             times reads a page back (random) and puts it again (it is
//             evicted again).
//  random     `ops` mixed puts, gets and invalidates over `pages` keys.
//  coherency  like random, but every page encodes (guest, key, version) and
//             every hit is checked against a local model: it must equal the
//             latest put of that key with no invalidate (nor, in a private
//             pool, a hit) since. Any other hit is a mismatch.
//
// Keys map to (object, index) as files of 64 pages; the guest index is part
// of the object id, so guests sharing a pool never touch each other's keys.
// Page contents are deterministic in (guest, key, version) and mix the kinds
// the host stores differently: same-filled, compressible and random.
//
// Thread safety: RunWorkload uses only its own guest; run one per thread.
#ifndef TMEMD_GUEST_DRIVER_USERSPACE_WORKLOADS_H_
#define TMEMD_GUEST_DRIVER_USERSPACE_WORKLOADS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "guest-driver/userspace/tmem_guest.h"

namespace tmem {

enum class WorkloadKind { kSeq, kReread, kRandom, kCoherency };

std::optional<WorkloadKind> ParseWorkloadKind(std::string_view name);
std::string_view WorkloadKindName(WorkloadKind kind);

struct WorkloadConfig {
  WorkloadKind kind = WorkloadKind::kSeq;
  uint64_t pages = 4096;
  uint64_t ops = 100'000;
  uint64_t seed = 1;
  uint32_t guest_index = 0;
  // Set: the workload uses a shared pool of this UUID (InitSharedFs).
  std::optional<TmemGuest::Uuid> shared_uuid;
  // How many mismatches are described in WorkloadResult::mismatch_report.
  int max_reported_mismatches = 5;
  // Called from the workload's thread every check_every_ops ops; a non-OK
  // status ends the run with it (tmem-guestsim passes the client's
  // PollServer, which notices tmemd going away).
  std::function<absl::Status()> health_check;
  uint64_t check_every_ops = 1024;
};

// Operations the workload will count in WorkloadResult::ops, for progress.
uint64_t ExpectedOps(const WorkloadConfig& config);

struct WorkloadResult {
  // Setup failure (the pool could not be created) or a failed health check.
  absl::Status status;
  uint64_t ops = 0;
  uint64_t puts = 0;
  uint64_t gets = 0;
  uint64_t hits = 0;
  uint64_t invalidates = 0;
  uint64_t verified_hits = 0;  // coherency and reread: hits checked
  uint64_t mismatches = 0;
  std::string mismatch_report;  // the first few, one per line
  double seconds = 0;
};

// Runs `config` on `guest`. `progress`, if set, is advanced as ops complete;
// `stop`, if set, ends the run early when it becomes true.
WorkloadResult RunWorkload(TmemGuest& guest, const WorkloadConfig& config,
                           std::atomic<uint64_t>* progress = nullptr,
                           const std::atomic<bool>* stop = nullptr);

// The deterministic page of (guest, key, version); version >= 1.
void FillPage(uint32_t guest, uint64_t key, uint64_t version, uint8_t* page);

}  // namespace tmem

#endif  // TMEMD_GUEST_DRIVER_USERSPACE_WORKLOADS_H_
