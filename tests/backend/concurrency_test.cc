// Concurrency stress test: several VMs, one thread each, run mixed random
// operations against their own models while a control thread reads
// statistics, changes policies and restarts a separate VM. Wrong bytes must
// never appear; run under TSan and ASan as well.
//
// Each worker checks its own keys exactly (miss, or the latest put it made);
// other workers' keys in the shared pool, and the separate VM's pages, are
// checked for integrity (the page is one that was put under that key).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using test::Page;
constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = kKiB * kKiB;
constexpr int kWorkers = 4;
constexpr int kPrivatePools = 2;
constexpr uint64_t kObjects = 16;
constexpr uint64_t kIndexes = 16;
constexpr uint64_t kSharedObjectBase = 1000;  // worker w uses object 1000 + w
constexpr int kOpsPerWorker = 40000;
// Sanitizers slow everything down; the test stops early rather than time out.
constexpr auto kTimeLimit = std::chrono::seconds(12);
constexpr uint64_t kCap = 1 * kMiB;
constexpr int kShards = 8;
// tmem_store.h: the cap may be exceeded by one table growth per concurrently
// putting thread (a shard's index doubling from n to 2n slots of 5 bytes).
// Here at most ~2200 keys are live, so a shard's index stays under 4 K slots
// and one growth is under 20 KiB (plus its object table); 64 KiB per putting
// thread (the workers and the control thread) is generous.
constexpr uint64_t kSlack = uint64_t{kWorkers + 1} * 64 * kKiB;
constexpr uint64_t kMagic = 0x636f6e632d6b6579ull;

// What a page is the content of: owner tag (worker, or 100 + churn
// generation), pool tag, object, index, version.
struct Key {
  uint64_t owner;
  uint64_t pool;  // private pool slot, or kSharedPool
  uint64_t object;
  uint64_t index;
  auto Tie() const { return std::tie(owner, pool, object, index); }
  friend bool operator<(const Key& a, const Key& b) {
    return a.Tie() < b.Tie();
  }
};
constexpr uint64_t kSharedPool = 99;

uint64_t KeyHash(const Key& k) {
  return test::Mix64(
      test::Mix64(test::Mix64(test::Mix64(k.owner) ^ k.pool) ^ k.object) ^
      k.index);
}

using Style = test::PageStyle;

Page MakePage(const Key& key, uint64_t version, Style style) {
  const uint64_t seed = KeyHash(key) ^ test::Mix64(version);
  Page page = test::StyledPage(
      style, seed, (version << 32) | ((KeyHash(key) & 0xffffffffu) | 1));
  if (style == Style::kZero || style == Style::kSameFilled) return page;
  const uint64_t header[7] = {kMagic,
                              key.owner,
                              key.pool,
                              key.object,
                              key.index,
                              version,
                              static_cast<uint64_t>(style)};
  std::memcpy(page.data(), header, sizeof(header));
  return page;
}

// True if `page` is some version of `key` (for pages whose latest version
// the reader cannot know).
bool IsSomeVersionOf(const Page& page, const Key& key) {
  uint64_t word;
  std::memcpy(&word, page.data(), 8);
  bool same_filled = true;
  for (size_t off = 8; off < kPageSize && same_filled; off += 8) {
    uint64_t w;
    std::memcpy(&w, page.data() + off, 8);
    same_filled = w == word;
  }
  if (same_filled) {
    if (word == 0) return true;  // zero pages carry no identity
    return (word & 0xffffffffu) == ((KeyHash(key) & 0xffffffffu) | 1);
  }
  uint64_t header[7];
  std::memcpy(header, page.data(), sizeof(header));
  if (header[0] != kMagic || header[1] != key.owner || header[2] != key.pool ||
      header[3] != key.object || header[4] != key.index || header[6] > 1) {
    return false;
  }
  return page == MakePage(key, header[5], static_cast<Style>(header[6]));
}

// The separate VM the control thread restarts: its id and generation,
// published together so readers see a consistent pair.
struct ChurnHandle {
  std::atomic<uint64_t> packed{0};  // generation << 32 | VmId; 0 = none
  void Publish(uint32_t generation, VmId id) {
    packed.store((uint64_t{generation} << 32) | id, std::memory_order_release);
  }
  std::pair<uint32_t, VmId> Read() const {
    const uint64_t v = packed.load(std::memory_order_acquire);
    return {static_cast<uint32_t>(v >> 32), static_cast<VmId>(v)};
  }
};

struct Failures {
  std::mutex mu;
  std::vector<std::string> messages;
  std::atomic<int> count{0};
  void Add(std::string message) {
    count.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    if (messages.size() < 20) messages.push_back(std::move(message));
  }
};

struct WorkerResult {
  uint64_t ops = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t foreign_hits = 0;
};

class Worker {
 public:
  Worker(TmemStore* store, int index, VmId vm,
         std::array<PoolId, kPrivatePools> pools, PoolId shared,
         const ChurnHandle* churn, Failures* failures)
      : store_(store),
        w_(index),
        vm_(vm),
        pools_(pools),
        shared_(shared),
        churn_(churn),
        failures_(failures),
        rng_(1000 + index) {}

  WorkerResult Run(std::chrono::steady_clock::time_point deadline) {
    WorkerResult result;
    for (int op = 0; op < kOpsPerWorker; ++op) {
      if ((op & 255) == 0 && std::chrono::steady_clock::now() > deadline) break;
      if (failures_->count.load() > 0) break;
      // Per mille. Pool-wide operations are rare so the pools fill past
      // the cap.
      const uint64_t r = rng_() % 1000;
      if (r < 480) {
        Put();
      } else if (r < 800) {
        GetOwn(result);
      } else if (r < 880) {
        InvalidatePage();
      } else if (r < 910) {
        InvalidateObject();
      } else if (r < 913) {
        InvalidatePrivatePool();
      } else if (r < 916) {
        RecreatePrivatePool();
      } else if (r < 950) {
        GetOthersShared(result);
      } else if (r < 990) {
        ContendedSharedOp(result);
      } else {
        PokeChurnVm(result);
      }
      ++result.ops;
    }
    return result;
  }

  // After all threads stopped: every key of this worker's that the store
  // still holds must be exactly its latest put (nothing invalidated or
  // replaced survived), and the contended keys hold some valid version.
  void FinalCheck() {
    for (int slot = 0; slot <= kPrivatePools; ++slot) {
      const bool shared = slot == kPrivatePools;
      const PoolId pool = shared ? shared_ : pools_[slot];
      for (uint64_t object = 0; object < (shared ? 1 : kObjects); ++object) {
        for (uint64_t index = 0; index < kIndexes; ++index) {
          const Key key{static_cast<uint64_t>(w_),
                        shared ? kSharedPool : static_cast<uint64_t>(slot),
                        shared ? kSharedObjectBase + w_ : object, index};
          Page out;
          absl::StatusOr<bool> hit = store_->Get(
              vm_, pool, ObjectId::FromInode(key.object), key.index, out);
          if (!hit.ok()) return Fail("final get: " + hit.status().ToString());
          if (!*hit) continue;
          auto it = model_.find(key);
          if (it == model_.end() ||
              out != MakePage(key, it->second.first, it->second.second)) {
            Fail("final sweep: pool " + std::to_string(key.pool) + " object " +
                 std::to_string(key.object) + " index " +
                 std::to_string(index) + " holds a stale or foreign page");
          }
        }
      }
    }
    for (uint64_t index = 0; index < kContendedIndexes; ++index) {
      const Key key = ContendedKey(index);
      Page out;
      absl::StatusOr<bool> hit = store_->Get(
          vm_, shared_, ObjectId::FromInode(key.object), index, out);
      if (hit.ok() && *hit && !IsSomeVersionOf(out, key)) {
        Fail("final sweep: contended index " + std::to_string(index) +
             " holds a foreign page");
      }
    }
  }

 private:
  static constexpr uint64_t kContendedIndexes = 4;
  // Keys every worker puts and gets in the shared pool; only integrity can
  // be checked for them.
  static Key ContendedKey(uint64_t index) {
    return Key{77, kSharedPool, kSharedObjectBase + 100, index};
  }

  void ContendedSharedOp(WorkerResult& result) {
    const Key key = ContendedKey(rng_() % kContendedIndexes);
    const ObjectId oid = ObjectId::FromInode(key.object);
    if (rng_() % 2 == 0) {
      // Unique versions across workers.
      const uint64_t version =
          (uint64_t{static_cast<uint32_t>(w_)} << 24) | (++version_ & 0xffffff);
      const auto style = static_cast<Style>(rng_() % 4);
      absl::StatusOr<PutResult> r = store_->Put(vm_, shared_, oid, key.index,
                                                MakePage(key, version, style));
      if (!r.ok()) Fail("contended put: " + r.status().ToString());
      return;
    }
    Page out;
    absl::StatusOr<bool> hit = store_->Get(vm_, shared_, oid, key.index, out);
    if (!hit.ok()) return Fail("contended get: " + hit.status().ToString());
    if (*hit) {
      ++result.foreign_hits;
      if (!IsSomeVersionOf(out, key)) {
        Fail("contended get of index " + std::to_string(key.index) +
             " returned another key's page");
      }
    }
  }

  // A key of this worker's: private pool slot, or the shared pool.
  std::pair<Key, PoolId> PickKey() {
    const uint64_t p = rng_() % (kPrivatePools + 1);
    Key key{static_cast<uint64_t>(w_), p, rng_() % kObjects, rng_() % kIndexes};
    if (p == kPrivatePools) {
      key.pool = kSharedPool;
      key.object = kSharedObjectBase + w_;
      return {key, shared_};
    }
    return {key, pools_[p]};
  }

  void Fail(const std::string& what) {
    failures_->Add("worker " + std::to_string(w_) + ": " + what);
  }

  void Put() {
    auto [key, pool] = PickKey();
    const uint64_t version = ++version_;
    const uint64_t s = rng_() % 10;
    const Style style = s < 5   ? Style::kText
                        : s < 8 ? Style::kRandom
                        : s < 9 ? Style::kSameFilled
                                : Style::kZero;
    const PutMode mode = rng_() % 10 == 0 ? PutMode::kRaw : PutMode::kCompress;
    absl::StatusOr<PutResult> r =
        store_->Put(vm_, pool, ObjectId::FromInode(key.object), key.index,
                    MakePage(key, version, style), mode);
    if (!r.ok()) return Fail("put: " + r.status().ToString());
    if (r->stored) {
      model_[key] = {version, style};
    } else {
      model_.erase(key);
    }
  }

  void GetOwn(WorkerResult& result) {
    auto [key, pool] = PickKey();
    Page out;
    absl::StatusOr<bool> hit =
        store_->Get(vm_, pool, ObjectId::FromInode(key.object), key.index, out);
    if (!hit.ok()) return Fail("get: " + hit.status().ToString());
    auto it = model_.find(key);
    if (!*hit) {
      ++result.misses;
      if (it != model_.end()) model_.erase(it);  // evicted
      return;
    }
    ++result.hits;
    if (it == model_.end()) {
      return Fail("hit on a key with no live put, pool " +
                  std::to_string(key.pool) + " object " +
                  std::to_string(key.object) + " index " +
                  std::to_string(key.index));
    }
    if (out != MakePage(key, it->second.first, it->second.second)) {
      return Fail("wrong bytes for pool " + std::to_string(key.pool) +
                  " object " + std::to_string(key.object) + " index " +
                  std::to_string(key.index) + " (expected version " +
                  std::to_string(it->second.first) + ", " +
                  (IsSomeVersionOf(out, key) ? "got another version)"
                                             : "got another key's page)"));
    }
    if (key.pool != kSharedPool) model_.erase(it);  // exclusive
  }

  void InvalidatePage() {
    auto [key, pool] = PickKey();
    absl::Status s = store_->InvalidatePage(
        vm_, pool, ObjectId::FromInode(key.object), key.index);
    if (!s.ok()) return Fail("invalidate page: " + s.ToString());
    model_.erase(key);
  }

  void InvalidateObject() {
    auto [key, pool] = PickKey();
    absl::Status s =
        store_->InvalidateObject(vm_, pool, ObjectId::FromInode(key.object));
    if (!s.ok()) return Fail("invalidate object: " + s.ToString());
    for (uint64_t i = 0; i < kIndexes; ++i) {
      model_.erase(Key{key.owner, key.pool, key.object, i});
    }
  }

  void ErasePool(uint64_t slot) {
    for (auto it = model_.begin(); it != model_.end();) {
      it = it->first.pool == slot ? model_.erase(it) : std::next(it);
    }
  }

  // Only private pools: the shared pool holds the other workers' keys too.
  void InvalidatePrivatePool() {
    const uint64_t slot = rng_() % kPrivatePools;
    absl::Status s = store_->InvalidatePool(vm_, pools_[slot]);
    if (!s.ok()) return Fail("invalidate pool: " + s.ToString());
    ErasePool(slot);
  }

  void RecreatePrivatePool() {
    const uint64_t slot = rng_() % kPrivatePools;
    absl::Status s = store_->DestroyPool(vm_, pools_[slot]);
    if (!s.ok()) return Fail("destroy pool: " + s.ToString());
    ErasePool(slot);
    absl::StatusOr<PoolId> pool = store_->NewPool(vm_, nullptr);
    if (!pool.ok()) return Fail("new pool: " + pool.status().ToString());
    pools_[slot] = *pool;
  }

  // Another worker's key in the shared pool: its latest version is unknown
  // here, but any hit must be some version of exactly that key.
  void GetOthersShared(WorkerResult& result) {
    const int other = static_cast<int>(rng_() % kWorkers);
    if (other == w_) return;
    const Key key{static_cast<uint64_t>(other), kSharedPool,
                  kSharedObjectBase + other, rng_() % kIndexes};
    Page out;
    absl::StatusOr<bool> hit = store_->Get(
        vm_, shared_, ObjectId::FromInode(key.object), key.index, out);
    if (!hit.ok()) return Fail("shared get: " + hit.status().ToString());
    if (*hit) {
      ++result.foreign_hits;
      if (!IsSomeVersionOf(out, key)) {
        Fail("shared get of worker " + std::to_string(other) + "'s index " +
             std::to_string(key.index) + " returned another key's page");
      }
    }
  }

  // Reads (and sometimes invalidates) the control thread's separate VM
  // through whatever handle is current. The VM may be forgotten at any
  // moment: NOT_FOUND is fine, but a hit must be that generation's page.
  void PokeChurnVm(WorkerResult& result) {
    const auto [generation, vm] = churn_->Read();
    if (vm == 0 && generation == 0) return;
    const Key key{100u + generation, 0, 0, rng_() % kIndexes};
    Page out;
    absl::StatusOr<bool> hit =
        store_->Get(vm, /*pool=*/0, ObjectId::FromInode(0), key.index, out);
    if (!hit.ok()) {
      if (hit.status().code() != absl::StatusCode::kNotFound) {
        Fail("churn get: " + hit.status().ToString());
      }
      return;
    }
    if (*hit) {
      ++result.foreign_hits;
      if (!IsSomeVersionOf(out, key)) {
        Fail("churn VM generation " + std::to_string(generation) +
             " returned a page of another generation or key");
      }
    }
  }

  TmemStore* const store_;
  const int w_;
  const VmId vm_;
  std::array<PoolId, kPrivatePools> pools_;
  const PoolId shared_;
  const ChurnHandle* const churn_;
  Failures* const failures_;
  std::mt19937_64 rng_;
  uint64_t version_ = 0;
  std::map<Key, std::pair<uint64_t, Style>> model_;
};

TEST(ConcurrencyTest, MixedOperationsNeverReturnWrongBytes) {
  StoreOptions options;
  options.memory_cap_bytes = kCap;
  options.address_space_bytes = 64 * kMiB;
  options.num_shards = kShards;
  std::unique_ptr<TmemStore> store = TmemStore::Create(options).value();

  PoolUuid uuid;
  uuid.bytes.fill(0xc0);
  std::vector<VmId> vms;
  std::vector<std::unique_ptr<Worker>> workers;
  ChurnHandle churn;
  Failures failures;
  for (int w = 0; w < kWorkers; ++w) {
    const std::string name = "worker" + std::to_string(w);
    store->AuthorizeSharedPool(uuid, name);
    const VmId vm = store->AddVm(name, {}).value();
    std::array<PoolId, kPrivatePools> pools{};
    for (PoolId& p : pools) p = store->NewPool(vm, nullptr).value();
    const PoolId shared = store->NewPool(vm, &uuid).value();
    vms.push_back(vm);
    workers.push_back(std::make_unique<Worker>(store.get(), w, vm, pools,
                                               shared, &churn, &failures));
  }

  const auto deadline = std::chrono::steady_clock::now() + kTimeLimit;
  std::atomic<int> workers_running{kWorkers};
  std::vector<WorkerResult> results(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      results[w] = workers[w]->Run(deadline);
      workers_running.fetch_sub(1);
    });
  }

  // The control thread: statistics, policies, and a separate VM that is
  // forgotten and re-added over and over.
  uint64_t control_rounds = 0;
  uint64_t churn_hits = 0;
  std::thread control([&] {
    std::mt19937_64 rng(77);
    uint32_t generation = 0;
    std::array<uint64_t, kWorkers> quotas{};
    quotas.fill(kUnlimitedQuota);
    while (workers_running.load() > 0 && failures.count.load() == 0) {
      ++control_rounds;
      const HostStats host = store->GetHostStats();
      if (host.memory_used_bytes > kCap + kSlack) {
        failures.Add("host memory " + std::to_string(host.memory_used_bytes) +
                     " over cap + slack");
      }
      for (int w = 0; w < kWorkers; ++w) {
        absl::StatusOr<VmStats> stats = store->GetVmStats(vms[w]);
        if (!stats.ok()) {
          failures.Add("GetVmStats: " + stats.status().ToString());
          continue;
        }
        const uint64_t charged =
            stats->counters[static_cast<int>(Counter::kChargedBytes)];
        // A put in flight may have been admitted under the previous quota.
        if (quotas[w] != kUnlimitedQuota &&
            charged >
                quotas[w] + BlobCharge(kPageSize) + kMaxPageMetadataCharge) {
          failures.Add("worker " + std::to_string(w) + " charged " +
                       std::to_string(charged) + " over quota " +
                       std::to_string(quotas[w]));
        }
      }
      if (rng() % 4 == 0) {
        const int w = static_cast<int>(rng() % kWorkers);
        VmPolicy policy;
        policy.weight = static_cast<uint32_t>(50 + rng() % 300);
        const uint64_t q = rng() % 3;
        // Only lower quotas are checked, so raise first, lower after.
        policy.quota_bytes = q == 0   ? kUnlimitedQuota
                             : q == 1 ? 256 * kKiB
                                      : 1 * kMiB;
        if (policy.quota_bytes > quotas[w]) quotas[w] = policy.quota_bytes;
        const absl::Status s = store->SetVmPolicy(vms[w], policy);
        if (!s.ok()) failures.Add("SetVmPolicy: " + s.ToString());
        quotas[w] = policy.quota_bytes;
      }

      // The cap lowered to 3/4 and raised back, in turns: a lowered cap
      // empties whole slabs while the workers put, get and evict.
      if (control_rounds % 8 == 0) {
        const uint64_t cap = control_rounds % 16 == 0 ? kCap : kCap / 4 * 3;
        const absl::Status s = store->SetMemoryCap(cap);
        if (!s.ok()) failures.Add("SetMemoryCap: " + s.ToString());
      }

      // One life of the separate VM.
      ++generation;
      absl::StatusOr<VmId> vm = store->AddVm("churn", {});
      if (!vm.ok()) {
        failures.Add("AddVm churn: " + vm.status().ToString());
        break;
      }
      absl::StatusOr<PoolId> pool = store->NewPool(*vm, nullptr);
      if (!pool.ok()) {
        failures.Add("NewPool churn: " + pool.status().ToString());
        break;
      }
      churn.Publish(generation, *vm);
      std::map<uint64_t, std::pair<uint64_t, Style>> model;
      for (int i = 0; i < 32; ++i) {
        const Key key{100u + generation, 0, 0, rng() % kIndexes};
        const auto style = static_cast<Style>(rng() % 4);
        absl::StatusOr<PutResult> put =
            store->Put(*vm, *pool, ObjectId::FromInode(0), key.index,
                       MakePage(key, i, style));
        if (!put.ok()) {
          failures.Add("churn put: " + put.status().ToString());
          break;
        }
        if (put->stored) {
          model[key.index] = {static_cast<uint64_t>(i), style};
        } else {
          model.erase(key.index);
        }
        if (rng() % 3 == 0) {
          const Key probe{100u + generation, 0, 0, rng() % kIndexes};
          Page out;
          absl::StatusOr<bool> hit =
              store->Get(*vm, *pool, ObjectId::FromInode(0), probe.index, out);
          if (!hit.ok()) {
            failures.Add("churn get: " + hit.status().ToString());
            break;
          }
          auto it = model.find(probe.index);
          if (*hit) {
            ++churn_hits;
            // Workers may have taken or invalidated pages (a miss), never
            // changed them.
            if (it == model.end() ||
                out != MakePage(probe, it->second.first, it->second.second)) {
              failures.Add("churn VM read wrong bytes");
            }
          }
          if (it != model.end()) model.erase(it);
        }
      }
      const absl::Status forgot = store->ForgetVm(*vm);
      if (!forgot.ok()) failures.Add("ForgetVm churn: " + forgot.ToString());
      // The stale handle is dead at once.
      Page out;
      if (store->Get(*vm, *pool, ObjectId::FromInode(0), 0, out)
              .status()
              .code() != absl::StatusCode::kNotFound) {
        failures.Add("stale churn handle still answers");
      }
    }
  });

  for (std::thread& t : threads) t.join();
  control.join();
  for (auto& worker : workers) worker->FinalCheck();

  for (const std::string& message : failures.messages) ADD_FAILURE() << message;
  EXPECT_EQ(failures.count.load(), 0);

  uint64_t total_ops = 0;
  for (int w = 0; w < kWorkers; ++w) {
    total_ops += results[w].ops;
    EXPECT_GT(results[w].hits, 0u) << "worker " << w;
    EXPECT_GT(results[w].misses, 0u) << "worker " << w;
  }
  EXPECT_GT(total_ops, 4000u) << "the run made progress";
  EXPECT_GT(control_rounds, 0u);

  // After the storm: the store is consistent and within its cap.
  const HostStats host = store->GetHostStats();
  EXPECT_LE(host.memory_used_bytes, kCap + kSlack);
  EXPECT_GT(host.counters[static_cast<int>(Counter::kEvictionsHostCap)] +
                host.counters[static_cast<int>(Counter::kEvictionsQuota)],
            0u)
      << "the cap is small enough to force evictions";
  uint64_t pages = 0;
  for (VmId vm : vms) {
    pages += store->GetVmStats(vm)
                 .value()
                 .counters[static_cast<int>(Counter::kPagesHeld)];
  }
  EXPECT_EQ(host.counters[static_cast<int>(Counter::kPagesHeld)], pages)
      << "only the workers hold pages once the separate VM is gone";
  EXPECT_FALSE(store->FindVm("churn").ok());
  RecordProperty(
      "evictions",
      static_cast<int>(
          host.counters[static_cast<int>(Counter::kEvictionsHostCap)] +
          host.counters[static_cast<int>(Counter::kEvictionsQuota)]));
  RecordProperty("ops", static_cast<int>(total_ops));
  RecordProperty("control_rounds", static_cast<int>(control_rounds));
  EXPECT_GT(host.slabs_emptied_for_room, 0u)
      << "the lowered cap emptied slabs while the workers ran";
  RecordProperty("slabs_emptied_for_room",
                 static_cast<int>(host.slabs_emptied_for_room));
  RecordProperty("churn_hits", static_cast<int>(churn_hits));
}

// VMs added and forgotten in a loop on two threads while two
// steady VMs put and get on two more. Every call with a forgotten VM's id
// (whose slot a later VM often holds by then) is refused and counted, the
// steady VMs never see wrong bytes, and VM churn allocates no new VM
// structs: they stay at the most VMs held at once.
TEST(VmChurnTest, StaleHandlesAreRefusedAndChurnDoesNotGrowMemory) {
  constexpr int kSteady = 2;
  constexpr int kChurners = 2;
  constexpr int kMinCycles = 300;
  constexpr auto kChurnTime = std::chrono::seconds(4);
  StoreOptions options;
  options.memory_cap_bytes = 4 * kMiB;
  options.address_space_bytes = 64 * kMiB;
  options.num_shards = kShards;
  std::unique_ptr<TmemStore> store = TmemStore::Create(options).value();
  Failures failures;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> stale_calls{0};
  std::atomic<uint64_t> slot_reused{0};

  std::vector<VmId> steady(kSteady);
  std::vector<PoolId> steady_pool(kSteady);
  for (int w = 0; w < kSteady; ++w) {
    steady[w] = store->AddVm("steady" + std::to_string(w), VmPolicy{}).value();
    steady_pool[w] = store->NewPool(steady[w], nullptr).value();
  }
  std::vector<std::thread> threads;
  for (int w = 0; w < kSteady; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(w);
      // The page last put under each key and not yet taken by a get
      // (private gets are exclusive): a hit must return exactly it.
      std::map<std::pair<uint64_t, uint64_t>, Page> held;
      for (uint64_t version = 1; !stop.load(std::memory_order_relaxed);
           ++version) {
        const uint64_t object = rng() % kObjects;
        const uint64_t index = rng() % kIndexes;
        const Key key{static_cast<uint64_t>(w), 0, object, index};
        const Page page = MakePage(key, version, static_cast<Style>(rng() % 4));
        const absl::StatusOr<PutResult> put =
            store->Put(steady[w], steady_pool[w], ObjectId::FromInode(object),
                       index, page);
        if (!put.ok()) {
          failures.Add("steady put: " + put.status().ToString());
          return;
        }
        if (put->stored) {
          held[{object, index}] = page;
        } else {
          held.erase({object, index});
        }
        const uint64_t get_object = rng() % kObjects;
        const uint64_t get_index = rng() % kIndexes;
        Page out;
        const absl::StatusOr<bool> hit =
            store->Get(steady[w], steady_pool[w],
                       ObjectId::FromInode(get_object), get_index, out);
        if (!hit.ok()) {
          failures.Add("steady get: " + hit.status().ToString());
          return;
        }
        auto it = held.find({get_object, get_index});
        if (*hit && (it == held.end() || out != it->second)) {
          failures.Add("steady VM " + std::to_string(w) +
                       " got bytes it did not put last");
        }
        if (it != held.end()) held.erase(it);  // exclusive get, or a miss
      }
    });
  }
  const auto churn_end = std::chrono::steady_clock::now() + kChurnTime;
  for (int c = 0; c < kChurners; ++c) {
    threads.emplace_back([&, c] {
      VmId stale = 0;
      PoolId stale_pool = 0;
      for (int cycle = 0;
           cycle < kMinCycles || std::chrono::steady_clock::now() < churn_end;
           ++cycle) {
        const std::string name =
            "churn" + std::to_string(c) + "-" + std::to_string(cycle);
        const absl::StatusOr<VmId> vm = store->AddVm(name, VmPolicy{});
        if (!vm.ok()) {
          failures.Add("AddVm: " + vm.status().ToString());
          return;
        }
        if (stale != 0 && (stale & 0xFFFF) == (*vm & 0xFFFF)) {
          slot_reused.fetch_add(1, std::memory_order_relaxed);
        }
        const PoolId pool = store->NewPool(*vm, nullptr).value();
        for (PageIndex i = 0; i < 8; ++i) {
          const Key key{100 + static_cast<uint64_t>(c), 0, 0, i};
          (void)store->Put(*vm, pool, ObjectId::FromInode(0), i,
                           MakePage(key, cycle, Style::kText));
        }
        // The previous VM's handle: NOT_FOUND for every call, whether or
        // not its slot now serves this VM or the other churner's.
        if (stale != 0) {
          Page page{};
          const absl::StatusCode codes[] = {
              store->Put(stale, stale_pool, ObjectId::FromInode(0), 0, page)
                  .status()
                  .code(),
              store->Get(stale, stale_pool, ObjectId::FromInode(0), 0, page)
                  .status()
                  .code(),
              store->SetVmPolicy(stale, VmPolicy{}).code(),
              store->GetVmPolicy(stale).status().code(),
              store->SetEvictionBias(stale, 2).code(),
              store->GetVmStats(stale).status().code(),
              store->NewPool(stale, nullptr).status().code(),
              store->InvalidatePool(stale, stale_pool).code(),
              store->ForgetVm(stale).code(),
          };
          for (absl::StatusCode code : codes) {
            stale_calls.fetch_add(1, std::memory_order_relaxed);
            if (code != absl::StatusCode::kNotFound) {
              failures.Add("a stale VM id reached a VM: " +
                           std::string(absl::StatusCodeToString(code)));
            }
          }
        }
        if (!store->ForgetVm(*vm).ok()) {
          failures.Add("ForgetVm of a live VM failed");
          return;
        }
        stale = *vm;
        stale_pool = pool;
      }
    });
  }
  threads[kSteady].join();
  threads[kSteady + 1].join();
  stop.store(true);
  threads[0].join();
  threads[1].join();
  for (const std::string& m : failures.messages) ADD_FAILURE() << m;
  ASSERT_EQ(failures.count.load(), 0);

  const HostStats host = store->GetHostStats();
  EXPECT_EQ(host.unknown_vm_ids_refused, stale_calls.load())
      << "every stale call, and nothing else, was refused as unknown";
  EXPECT_GE(stale_calls.load(), uint64_t{kChurners} * (kMinCycles - 1) * 9);
  EXPECT_GT(slot_reused.load(), 0u) << "stale ids met reused slots";
  EXPECT_EQ(host.vms, uint64_t{kSteady});
  EXPECT_LE(host.vm_structs, uint64_t{kSteady + kChurners})
      << "VM structs stay at the most VMs held at once";
  // The churned VMs' pages all went with them.
  uint64_t steady_pages = 0;
  for (VmId vm : steady) {
    steady_pages += store->GetVmStats(vm)
                        .value()
                        .counters[static_cast<int>(Counter::kPagesHeld)];
  }
  EXPECT_EQ(host.counters[static_cast<int>(Counter::kPagesHeld)], steady_pages);
}

}  // namespace
}  // namespace tmem
