// tmemd's data-plane components in this process, driven as tmemd drives
// them, with a guest library per channel (the ring side of every
// comparison), and the guest-side helpers that feed it without dropping a
// put.
#ifndef TMEMD_BENCH_RING_RING_HOST_H_
#define TMEMD_BENCH_RING_RING_HOST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/tmem_store.h"
#include "bench/bench_support.h"
#include "bench/method.h"
#include "bench/page_corpus.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "host-agent/channel/channel.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/worker.h"
#include "proto/tmem_abi.h"
#include "tests/temp_dir.h"

namespace tmem::bench::ring {

// The guest library's object id for key `k`: the same (object, index) the
// in-process side uses (bench_support.h's key space).
inline TmemGuest::ObjectId GuestOid(uint64_t k) { return KeyObject(k).words; }

// One TmemStore, `guests` channels (each its own VM, region and socket),
// driven as tmemd drives them -- one Worker per CPU, channels spread over
// them round robin (tmemd gives each new VM the least loaded worker) --
// and per channel a TmemGuest attached through a real ivshmem client with
// one private pool. Teardown stops the workers first, so nothing touches a
// channel while it goes away.
class RingHost {
 public:
  RingHost(int guests, const WorkerOptions& worker_options,
           const TmemGuestOptions& guest_options = {});
  ~RingHost();
  RingHost(const RingHost&) = delete;
  RingHost& operator=(const RingHost&) = delete;

  TmemGuest& guest(int i) { return *guests_[i]; }
  TmemGuest::PoolHandle pool(int i) const { return pools_[i]; }
  // SQ entries a put may use: the ring minus the library's invalidate
  // reserve. Below it (and with a free slot) TmemGuest::Put never drops.
  uint32_t limit(int i) const { return limits_[i]; }

  // True while the worker asks for doorbells (it is asleep or about to be).
  bool HostWantsDoorbell(int i) const {
    return (__atomic_load_n(&headers_[i]->host_flags, __ATOMIC_ACQUIRE) &
            TMEM_HOST_NEEDS_DOORBELL) != 0;
  }

  // CPU time of the worker threads so far (0 if none could be found).
  int64_t WorkerCpuNs() const {
    int64_t ns = 0;
    for (const std::string& tid : worker_tids_) ns += TaskCpuNs(tid);
    return ns;
  }
  int workers() const { return static_cast<int>(workers_.size()); }

  uint64_t Metric(int i, ChannelCounter c) const {
    return channels_[i]->metrics().Get(c);
  }
  uint64_t MetricSum(ChannelCounter c) const {
    uint64_t n = 0;
    for (const auto& ch : channels_) n += ch->metrics().Get(c);
    return n;
  }
  GuestCounters GuestTotals() const {
    GuestCounters total;
    for (const auto& g : guests_) AddCounters(&total, g->counters());
    return total;
  }

 private:
  // Declared first, so it goes last: the channels unlink their sockets in it.
  tmem::testing::TempDir tmp_{"tmem-ring-bench"};
  std::string dir_ = tmp_.path();
  std::vector<std::string> paths_;
  std::unique_ptr<TmemStore> store_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::string> worker_tids_;
  std::vector<std::unique_ptr<IvshmemClient>> clients_;
  std::vector<std::unique_ptr<TmemGuest>> guests_;
  std::vector<const tmem_shm_header*> headers_;
  std::vector<uint32_t> limits_;
  std::vector<TmemGuest::PoolHandle> pools_;
};

// Waits until the guest may put without dropping (see ring_host.cc); true
// if it had to wait (the host was the bottleneck at that moment).
bool WaitForRoom(TmemGuest& g, uint32_t limit);

// Until every entry posted has its CQE reaped: for puts, the host has
// stored the page.
void WaitConsumed(TmemGuest& g);

// A put through guest `i` that never drops.
void RingPut(RingHost& h, int i, uint64_t key, const Page& page);

// The ring twin of bench_support's AddResidentPopulation: the same pages
// under the same keys, then the same half invalidated, through the guest.
void AddRingResidentPopulation(RingHost& h, int i, const PageSet& set,
                               uint64_t pages);

// Every steady-state key put once through guest `i`, and stored.
void RingPrefill(RingHost& h, int i, const PageSet& set);

}  // namespace tmem::bench::ring

#endif  // TMEMD_BENCH_RING_RING_HOST_H_
