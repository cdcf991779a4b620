#include "bench/ring/ring_host.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <system_error>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/method.h"
#include "bench/ring/common.h"

namespace tmem::bench::ring {

RingHost::RingHost(int guests, const WorkerOptions& worker_options,
                   const TmemGuestOptions& guest_options) {
  if (dir_.empty()) {
    Die("mkdtemp", absl::InternalError(std::generic_category().message(errno)));
  }
  store_ = NewBenchStore(kStoreCapBytes);
  // Distinct per host, like tmemd's (a guest compares for equality).
  static uint64_t generation =
      static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  ++generation;
  for (int i = 0; i < guests; ++i) {
    ChannelOptions co;  // tmemd's defaults: 4 MiB region, 256 entries
    co.vm_name = "ring-vm-" + std::to_string(i);
    co.server.socket_path = dir_ + "/" + co.vm_name + ".sock";
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        Channel::Create(co, store_.get(), generation);
    if (!ch.ok()) Die("Channel::Create " + co.vm_name, ch.status());
    paths_.push_back(co.server.socket_path);
    channels_.push_back(*std::move(ch));
  }
  const int workers = std::clamp<int>(
      static_cast<int>(std::thread::hardware_concurrency()), 1, guests);
  for (int w = 0; w < workers; ++w) {
    workers_.push_back(std::make_unique<Worker>(worker_options));
    // The thread Start() adds is the worker: its CPU time is tmemd's
    // host cost, apart from the guests' (which includes their waiting).
    const std::set<std::string> before = TaskIds();
    if (absl::Status s = workers_.back()->Start(); !s.ok()) {
      Die("Worker::Start", s);
    }
    for (const std::string& tid : TaskIds()) {
      if (before.count(tid) == 0) worker_tids_.push_back(tid);
    }
  }
  for (size_t i = 0; i < channels_.size(); ++i) {
    workers_[i % workers_.size()]->AddChannel(channels_[i].get());
  }
  for (int i = 0; i < guests; ++i) {
    absl::StatusOr<std::unique_ptr<IvshmemClient>> client =
        IvshmemClient::Connect(paths_[i], IvshmemClientOptions{});
    if (!client.ok()) Die("IvshmemClient::Connect", client.status());
    absl::StatusOr<std::unique_ptr<TmemGuest>> guest =
        TmemGuest::Create(client->get(), guest_options);
    if (!guest.ok()) Die("TmemGuest::Create", guest.status());
    absl::StatusOr<TmemGuest::PoolHandle> pool = (*guest)->InitFs();
    if (!pool.ok()) Die("TmemGuest::InitFs", pool.status());
    if ((*guest)->host_pool_id(*pool) < 0) {
      Die("TmemGuest::InitFs", absl::UnavailableError("no host pool"));
    }
    // The guest's view of the header, as a driver reads it; the host
    // wrote the geometry before READY.
    const auto* header =
        reinterpret_cast<const tmem_shm_header*>((*client)->shm_base());
    headers_.push_back(header);
    limits_.push_back(header->sq_entries - (*guest)->invalidate_reserve());
    pools_.push_back(*pool);
    clients_.push_back(*std::move(client));
    guests_.push_back(*std::move(guest));
  }
}

RingHost::~RingHost() {
  workers_.clear();
  guests_.clear();
  clients_.clear();
  channels_.clear();  // unlinks the sockets, forgets the VMs
  store_.reset();
}

// TmemGuest::Put never blocks: with the ring full it drops the put (sending
// an INVAL_PAGE in its place), as cleancache allows. A throughput benchmark
// must not count a dropped put as done, so the guest first waits for room:
// the fastest a guest can feed the host without losing pages. It sleeps
// briefly while it waits: with more guest threads than cores, a spinning or
// yielding guest takes the CPU from the worker it waits for (a yield
// returns at once when the other runnable threads are guests too), and a
// real guest never waits here at all. Returns true if it had to wait (the
// host was the bottleneck at that moment).
constexpr auto kRoomPause = std::chrono::microseconds(20);
constexpr auto kRoomPerEntry = std::chrono::microseconds(3);

bool WaitForRoom(TmemGuest& g, uint32_t limit) {
  if (g.in_flight() < limit && g.free_slots() > 0) return false;
  // Full: wait until half the ring has drained, so the guest wakes once per
  // half ring rather than once per entry, and refills it in one burst
  // while the worker still has the other half to do.
  const uint32_t resume = std::max<uint32_t>(1, limit / 2);
  const uint32_t slots = g.slots_usable();
  for (;;) {
    g.Poll();
    const uint32_t in_flight = g.in_flight();
    if (in_flight < resume && g.free_slots() >= std::min(resume, slots)) {
      return true;
    }
    // Sleep about as long as the host needs for the excess (undershooting:
    // a page costs the host ~5 us), not a fixed tick: each wake-up of a
    // guest thread preempts a worker on this 2-CPU machine.
    const uint32_t excess = in_flight >= resume ? in_flight - resume + 1 : 1;
    std::this_thread::sleep_for(std::max(kRoomPause, kRoomPerEntry * excess));
  }
}

void WaitConsumed(TmemGuest& g) {
  for (;;) {
    g.Poll();
    if (g.in_flight() == 0) return;
    std::this_thread::sleep_for(kRoomPause);
  }
}

void RingPut(RingHost& h, int i, uint64_t key, const Page& page) {
  WaitForRoom(h.guest(i), h.limit(i));
  h.guest(i).Put(h.pool(i), GuestOid(key), KeyIndex(key),
                 TmemGuest::Page(page.bytes));
}

void AddRingResidentPopulation(RingHost& h, int i, const PageSet& set,
                               uint64_t pages) {
  if (set.empty()) return;
  for (uint64_t k = 0; k < pages; ++k) {
    RingPut(h, i, kResidentKeyBase + k, set[k % set.size()]);
  }
  SplitMix64 rng(0x686f6c6573);  // "holes", as AddResidentPopulation
  for (uint64_t k = 0; k < pages; ++k) {
    if (rng.Below(2) == 0) continue;
    const uint64_t key = kResidentKeyBase + k;
    WaitForRoom(h.guest(i), h.limit(i));
    h.guest(i).InvalidatePage(h.pool(i), GuestOid(key), KeyIndex(key));
  }
  WaitConsumed(h.guest(i));
}

void RingPrefill(RingHost& h, int i, const PageSet& set) {
  for (uint64_t k = 0; k < kSteadyStateKeys; ++k) {
    RingPut(h, i, k, set[k % set.size()]);
  }
  WaitConsumed(h.guest(i));
}

}  // namespace tmem::bench::ring
