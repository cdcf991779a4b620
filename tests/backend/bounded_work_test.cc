// Every put and get does bounded work whatever mix of page kinds fills the
// cap (tmem_store.h, "Bounded work"): a metadata-only flood (zero pages,
// each its own object, across 64 pools) that fills the cap must not make a
// neighbour's put walk the store, and evicting entries gives budget back a
// chunk at a time. The work is read from HostStats::max_op_work and, for
// the slab choice that used to walk every page per eviction, from
// HostStats::slab_choice_pages_walked: counters, not clocks.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::FilledWith;
using test::Page;
using test::RandomPage;
using test::TextPage;
constexpr uint64_t kMiB = uint64_t{1} << 20;

// Work one put or get may do, whatever the store holds: at most
// kMaxRoomRounds x (a slab choice of 8192 pages + a batch of 512 evictions
// and its compaction) plus a class scan and the in-shard evictions. The
// store's own bound; a walk of the whole store (tens of thousands of pages
// here, per eviction) is far above it.
constexpr uint64_t kWorkBound = 200000;

uint64_t Get(const CounterValues& v, Counter c) {
  return v[static_cast<int>(c)];
}

std::unique_ptr<TmemStore> OpenStore(uint64_t cap, int shards) {
  StoreOptions options;
  options.memory_cap_bytes = cap;
  options.address_space_bytes = 64 * kMiB;
  options.num_shards = shards;
  return TmemStore::Create(options).value();
}

// The reported livelock, scaled down: VM c fills the cap with zero pages
// under distinct object keys across 64 pools; then VM b puts compressible
// pages and reads them back. Each of b's puts must finish within the work
// bound and b must get hits. On the old code the first put that needed a
// slab walked every page twice per page it evicted (slab choice), evicting
// zero pages whose entries returned no budget until a whole shard emptied.
TEST(BoundedWorkTest, ZeroPageFloodThenNeighbourPutsStayBoundedAndHit) {
  auto store = OpenStore(4 * kMiB, 64);
  const VmId c = store->AddVm("c", VmPolicy{}).value();
  const VmId b = store->AddVm("b", VmPolicy{}).value();
  std::vector<PoolId> pools;
  for (int i = 0; i < 64; ++i)
    pools.push_back(store->NewPool(c, nullptr).value());
  const Page zero = FilledWith(0);
  // Until the cap is full: puts start evicting c's own pages.
  uint64_t key = 0;
  for (; key < 200000; ++key) {
    const PutResult r =
        store->Put(c, pools[key % 64], ObjectId::FromInode(key), 0, zero)
            .value();
    ASSERT_TRUE(r.stored);
    if (r.evicted > 0) break;
  }
  HostStats host = store->GetHostStats();
  ASSERT_GT(key, 10000u) << "the flood should hold many pages";
  ASSERT_EQ(host.slab_bytes, 0u) << "zero pages hold no blob";
  ASSERT_GE(host.memory_used_bytes + uint64_t{64} * 1024,
            host.memory_cap_bytes);

  const PoolId pb = store->NewPool(b, nullptr).value();
  const uint64_t walked_before = host.slab_choice_pages_walked;
  int stored = 0;
  constexpr int kPuts = 512;
  for (int i = 0; i < kPuts; ++i) {
    const PutResult r =
        store->Put(b, pb, ObjectId::FromInode(1), i, TextPage(i)).value();
    stored += r.stored ? 1 : 0;
    host = store->GetHostStats();
    ASSERT_LE(host.max_op_work, kWorkBound) << "put " << i;
    ASSERT_LE(host.memory_used_bytes, host.memory_cap_bytes) << "put " << i;
    // At most a bounded sample per round, never the whole store per page.
    ASSERT_LE(host.slab_choice_pages_walked - walked_before,
              static_cast<uint64_t>(i + 1) * 8 * 8192)
        << "put " << i;
  }
  EXPECT_GT(stored, kPuts / 2);
  EXPECT_GT(host.metadata_chunks_released, 0u)
      << "evicted entries must give budget back before their shard empties";
  int hits = 0;
  for (int i = 0; i < kPuts; ++i) {
    Page out;
    if (store->Get(b, pb, ObjectId::FromInode(1), i, out).value()) {
      ++hits;
      ASSERT_EQ(out, TextPage(i)) << i;
    }
  }
  EXPECT_GT(hits, kPuts / 2);
  EXPECT_LE(store->GetHostStats().max_op_work, kWorkBound);
}

// Random mixes of page kinds (zero, same-filled, raw, LZ4-compressible),
// many objects and pools, several VMs with quotas, at a full cap; after
// every operation: the op's work is bounded, the cap holds, each VM is
// within its quota, and what is used is what VMs are charged plus the
// host's own overhead (reported apart).
TEST(BoundedWorkTest, RandomKindMixesAtAFullCap) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    auto store = OpenStore(3 * kMiB, 16);
    std::mt19937_64 rng(seed);
    struct Tenant {
      VmId id;
      uint64_t quota;
      std::vector<PoolId> pools;
    };
    std::vector<Tenant> vms;
    for (int v = 0; v < 4; ++v) {
      VmPolicy policy;
      policy.quota_bytes = v == 0 ? kUnlimitedQuota : (1 + v) * kMiB / 2;
      Tenant t{store->AddVm("vm" + std::to_string(v), policy).value(),
               policy.quota_bytes,
               {}};
      for (int p = 0; p < 8; ++p) {
        t.pools.push_back(store->NewPool(t.id, nullptr).value());
      }
      vms.push_back(t);
    }
    uint64_t max_overhead = 0;
    for (int op = 0; op < 30000; ++op) {
      Tenant& t = vms[rng() % vms.size()];
      const PoolId pool = t.pools[rng() % t.pools.size()];
      // Skewed: a few big objects and many one-page ones.
      const uint64_t ino = rng() % 4 == 0 ? rng() % 8 : 100 + rng() % 50000;
      const PageIndex index = rng() % 4 == 0 ? rng() % 64 : 0;
      const ObjectId oid = ObjectId::FromInode(ino);
      const uint64_t kind = rng() % 10;
      if (kind < 7) {
        Page page;
        const int shape = static_cast<int>(rng() % 4);
        if (shape == 0) page = FilledWith(0);
        if (shape == 1) page = FilledWith(rng() | 1);
        if (shape == 2) page = RandomPage(rng());
        if (shape == 3) page = TextPage(rng());
        ASSERT_TRUE(store->Put(t.id, pool, oid, index, page).ok());
      } else if (kind < 9) {
        Page out;
        ASSERT_TRUE(store->Get(t.id, pool, oid, index, out).ok());
      } else {
        ASSERT_TRUE(store->InvalidateObject(t.id, pool, oid).ok());
      }
      const HostStats host = store->GetHostStats();
      ASSERT_LE(host.max_op_work, kWorkBound) << "op " << op;
      ASSERT_LE(host.memory_used_bytes, host.memory_cap_bytes) << "op " << op;
      // Host overhead: what no VM is charged. Apart from slab slack
      // (free slots of partly used slabs, reported as slab_bytes -
      // blob_slot_bytes) it stays within kShardOverheadBytes per shard.
      const uint64_t slab_slack = host.slab_bytes - host.blob_slot_bytes;
      ASSERT_LE(host.host_overhead_bytes,
                slab_slack + 16 * TmemStore::kShardOverheadBytes)
          << "op " << op << " used " << host.memory_used_bytes << " charged "
          << host.vm_charged_bytes;
      max_overhead = std::max(
          max_overhead, host.host_overhead_bytes -
                            std::min(host.host_overhead_bytes, slab_slack));
      for (const Tenant& each : vms) {
        const uint64_t charged =
            Get(store->GetVmStats(each.id).value().counters,
                Counter::kChargedBytes);
        ASSERT_LE(charged, each.quota) << "op " << op;
      }
    }
    const HostStats host = store->GetHostStats();
    RecordProperty("max_op_work_seed" + std::to_string(seed),
                   static_cast<int>(host.max_op_work));
    RecordProperty("max_overhead_beyond_slab_slack_seed" + std::to_string(seed),
                   static_cast<int>(max_overhead));
    EXPECT_GT(Get(host.counters, Counter::kEvictionsHostCap), 0u)
        << "the cap was never full";
  }
}

// One VM with an 8 MiB quota floods zero pages under distinct keys across
// 64 pools and holds them. Its charge stays within its quota, and what the
// host uses beyond what VMs are charged is reported as host overhead,
// within slab slack + kShardOverheadBytes per shard (tmem_store.h, "Host
// overhead"): used <= sum of quotas + that bound.
TEST(BoundedWorkTest, QuotaFloodOverheadIsReportedAndBounded) {
  constexpr int kShards = 64;
  auto store = OpenStore(64 * kMiB, kShards);
  VmPolicy policy;
  policy.quota_bytes = 8 * kMiB;
  const VmId vm = store->AddVm("flood", policy).value();
  std::vector<PoolId> pools;
  for (int i = 0; i < 64; ++i)
    pools.push_back(store->NewPool(vm, nullptr).value());
  const Page zero = FilledWith(0);
  for (uint64_t key = 0; key < 150000; ++key) {
    ASSERT_TRUE(
        store->Put(vm, pools[key % 64], ObjectId::FromInode(key), 0, zero)
            .ok());
  }
  const HostStats host = store->GetHostStats();
  const uint64_t charged =
      Get(store->GetVmStats(vm).value().counters, Counter::kChargedBytes);
  ASSERT_GT(Get(host.counters, Counter::kEvictionsQuota), 0u)
      << "the flood should reach the quota";
  EXPECT_LE(charged, policy.quota_bytes);
  EXPECT_EQ(host.vm_charged_bytes, charged);
  const uint64_t bound = (host.slab_bytes - host.blob_slot_bytes) +
                         uint64_t{kShards} * TmemStore::kShardOverheadBytes;
  EXPECT_LE(host.host_overhead_bytes, bound);
  EXPECT_LE(host.memory_used_bytes, policy.quota_bytes + bound);
  RecordProperty(
      "used_over_quota_permille",
      static_cast<int>(host.memory_used_bytes * 1000 / policy.quota_bytes));
  RecordProperty("host_overhead_bytes",
                 static_cast<int>(host.host_overhead_bytes));
  RecordProperty("overhead_bound_bytes", static_cast<int>(bound));
}

}  // namespace
}  // namespace tmem
