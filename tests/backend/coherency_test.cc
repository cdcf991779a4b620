// Randomized coherency test (architecture invariant 1): long mixed sequences
// of puts, gets, invalidates, pool destruction, shared-pool membership
// changes, VM restarts and policy changes run against a reference model.
// Page contents encode (key, version), so stale or misdirected data shows.
//
// Rule checked on every get: a miss, or exactly the bytes of the latest
// stored put of that key with every later invalidate honoured. With a large
// cap and no quotas nothing is ever evicted, so there a miss is also wrong
// whenever the model holds the key ("strict" runs).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
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

constexpr int kNumVms = 3;
constexpr int kPrivatePoolsPerVm = 2;
constexpr int kSharedSpace = kNumVms * kPrivatePoolsPerVm;  // model space id

struct Key {
  int space;  // vm * kPrivatePoolsPerVm + slot, or kSharedSpace
  uint64_t object;
  uint64_t index;
  auto Tie() const { return std::tie(space, object, index); }
  friend bool operator<(const Key& a, const Key& b) {
    return a.Tie() < b.Tie();
  }
};

using Style = test::PageStyle;

// The page of one version of one key. Text and random pages start with a
// header naming the key and version; same-filled pages use a word derived
// from them. Zero pages carry no identity, but every zero page is the same,
// so returning an older zero page is indistinguishable and harmless.
Page MakePage(const Key& key, uint64_t version, Style style) {
  const uint64_t seed =
      test::Mix64(test::Mix64(test::Mix64(key.space) ^ key.object) ^
                  key.index) ^
      test::Mix64(version);
  Page page = test::StyledPage(style, seed, seed | 1);
  if (style == Style::kZero || style == Style::kSameFilled) return page;
  const uint64_t header[5] = {0x746d656d2d6b6579ull,
                              static_cast<uint64_t>(key.space), key.object,
                              key.index, version};
  std::memcpy(page.data(), header, sizeof(header));
  return page;
}

// For failure messages: what a returned page claims to be.
std::string Describe(const Page& page) {
  uint64_t header[5];
  std::memcpy(header, page.data(), sizeof(header));
  if (header[0] != 0x746d656d2d6b6579ull)
    return "(no header: zero/same-filled)";
  return "space " + std::to_string(header[1]) + " object " +
         std::to_string(header[2]) + " index " + std::to_string(header[3]) +
         " version " + std::to_string(header[4]);
}

struct RunConfig {
  uint64_t seed;
  int ops;
  uint64_t cap_bytes;
  int num_shards;
  bool strict;       // no eviction possible: a modelled key must hit
  bool vary_quotas;  // SetVmPolicy with small quotas (forces evictions)
  uint64_t objects;  // key space per pool: objects x indexes
  uint64_t indexes;
};

// Per-mille weights of each operation. Pool-wide operations empty many keys
// at once, so runs meant to fill the cap make them rarer.
struct OpMix {
  int put, get, invalidate_page, invalidate_object, invalidate_pool,
      recreate_pool, toggle_shared, restart_vm, change_policy;
};
constexpr OpMix kBalancedMix = {450, 380, 80, 40, 10, 10, 10, 3, 17};
constexpr OpMix kFillingMix = {560, 340, 50, 20, 4, 4, 8, 2, 12};

std::ostream& operator<<(std::ostream& os, const RunConfig& c) {
  return os << "seed" << c.seed << "_cap" << c.cap_bytes / kKiB << "k_shards"
            << c.num_shards << (c.strict ? "_strict" : "_ephemeral")
            << (c.vary_quotas ? "_quotas" : "");
}

class CoherencyTest : public ::testing::TestWithParam<RunConfig> {
 protected:
  struct Expected {
    uint64_t version;
    Style style;
    int owner;  // model VM whose put stored it
  };
  struct VmState {
    std::string name;
    VmId id = 0;
    std::array<PoolId, kPrivatePoolsPerVm> pools{};
    std::optional<PoolId> shared;
    VmPolicy policy;
    std::vector<Key> recent_puts;  // gets favour these, so many of them hit
  };

  void SetUp() override {
    const RunConfig& config = GetParam();
    StoreOptions options;
    options.memory_cap_bytes = config.cap_bytes;
    options.address_space_bytes = 128 * kMiB;
    options.num_shards = config.num_shards;
    store_ = TmemStore::Create(options).value();
    uuid_.bytes.fill(0x5e);
    rng_.seed(config.seed);
    for (int v = 0; v < kNumVms; ++v) {
      vms_[v].name = "vm" + std::to_string(v);
      store_->AuthorizeSharedPool(uuid_, vms_[v].name);
      StartVm(v);
    }
  }

  void StartVm(int v) {
    VmState& vm = vms_[v];
    vm.policy = VmPolicy{};
    vm.id = store_->AddVm(vm.name, vm.policy).value();
    for (PoolId& pool : vm.pools)
      pool = store_->NewPool(vm.id, nullptr).value();
    vm.shared = store_->NewPool(vm.id, &uuid_).value();
  }

  bool AnySharedMember() const {
    for (const VmState& vm : vms_) {
      if (vm.shared) return true;
    }
    return false;
  }
  void EraseSpace(int space) {
    for (auto it = model_.begin(); it != model_.end();) {
      it = it->first.space == space ? model_.erase(it) : std::next(it);
    }
  }
  void EraseObject(int space, uint64_t object) {
    for (uint64_t i = 0; i < GetParam().indexes; ++i)
      model_.erase(Key{space, object, i});
  }
  void EraseSharedOwnedBy(int v) {
    for (auto it = model_.begin(); it != model_.end();) {
      const bool drop =
          it->first.space == kSharedSpace && it->second.owner == v;
      it = drop ? model_.erase(it) : std::next(it);
    }
  }

  // Picks one of VM v's spaces: its private pools, or the shared pool if it
  // is a member. Returns the model space and the store's pool id.
  std::pair<int, PoolId> PickSpace(int v) {
    const VmState& vm = vms_[v];
    const uint64_t r = rng_() % (kPrivatePoolsPerVm + 1);
    if (r == kPrivatePoolsPerVm && vm.shared) return {kSharedSpace, *vm.shared};
    const int slot = static_cast<int>(r % kPrivatePoolsPerVm);
    return {v * kPrivatePoolsPerVm + slot, vm.pools[slot]};
  }

  void DoPut(int v) {
    const auto [space, pool] = PickSpace(v);
    const Key key{space, rng_() % GetParam().objects,
                  rng_() % GetParam().indexes};
    const uint64_t version = ++version_;
    const uint64_t s = rng_() % 20;
    const Style style = s < 9    ? Style::kText
                        : s < 15 ? Style::kRandom
                        : s < 18 ? Style::kSameFilled
                                 : Style::kZero;
    const uint64_t m = rng_() % 20;
    const PutMode mode = m < 17   ? PutMode::kCompress
                         : m < 19 ? PutMode::kRaw
                                  : PutMode::kDrop;
    const PutResult r =
        store_
            ->Put(vms_[v].id, pool, ObjectId::FromInode(key.object), key.index,
                  MakePage(key, version, style), mode)
            .value();
    std::vector<Key>& recent = vms_[v].recent_puts;
    if (recent.size() < 16) {
      recent.push_back(key);
    } else {
      recent[rng_() % recent.size()] = key;
    }
    if (r.stored) {
      model_[key] = Expected{version, style, v};
    } else {
      // A refused put still removes the earlier version.
      model_.erase(key);
      if (GetParam().strict) {
        // Without eviction pressure only policy refuses.
        EXPECT_EQ(r.reason, RefuseReason::kPolicy) << "op " << op_;
      }
    }
  }

  // The store's pool for a model space of VM v, if v can reach it now.
  std::optional<PoolId> PoolFor(int v, int space) const {
    const VmState& vm = vms_[v];
    if (space == kSharedSpace) return vm.shared;
    if (space / kPrivatePoolsPerVm != v) return std::nullopt;
    return vm.pools[space % kPrivatePoolsPerVm];
  }

  void DoGet(int v) {
    auto [space, pool] = PickSpace(v);
    Key key{space, rng_() % GetParam().objects, rng_() % GetParam().indexes};
    const std::vector<Key>& recent = vms_[v].recent_puts;
    if (!recent.empty() && rng_() % 2 == 0) {
      const Key& candidate = recent[rng_() % recent.size()];
      if (std::optional<PoolId> p = PoolFor(v, candidate.space)) {
        key = candidate;
        space = candidate.space;
        pool = *p;
      }
    }
    Page out;
    const bool hit = store_
                         ->Get(vms_[v].id, pool,
                               ObjectId::FromInode(key.object), key.index, out)
                         .value();
    auto it = model_.find(key);
    if (hit) {
      ASSERT_TRUE(it != model_.end())
          << "op " << op_ << ": hit on a key with no live put (space "
          << key.space << " object " << key.object << " index " << key.index
          << "), got " << Describe(out);
      const Page want = MakePage(key, it->second.version, it->second.style);
      ASSERT_TRUE(out == want)
          << "op " << op_ << ": wrong bytes for space " << key.space
          << " object " << key.object << " index " << key.index
          << ": expected version " << it->second.version << ", got "
          << Describe(out);
      ++hits_;
      // A private hit is exclusive.
      if (space != kSharedSpace) model_.erase(it);
    } else {
      if (GetParam().strict) {
        ASSERT_TRUE(it == model_.end())
            << "op " << op_ << ": miss without eviction for space " << key.space
            << " object " << key.object << " index " << key.index << " version "
            << it->second.version;
      }
      if (it != model_.end()) model_.erase(it);  // evicted: gone for good
      ++misses_;
    }
  }

  void DoInvalidate(int v, uint64_t which) {
    const auto [space, pool] = PickSpace(v);
    const uint64_t object = rng_() % GetParam().objects;
    const VmId id = vms_[v].id;
    if (which == 0) {
      const uint64_t index = rng_() % GetParam().indexes;
      ASSERT_TRUE(
          store_->InvalidatePage(id, pool, ObjectId::FromInode(object), index)
              .ok());
      model_.erase(Key{space, object, index});
    } else if (which == 1) {
      ASSERT_TRUE(
          store_->InvalidateObject(id, pool, ObjectId::FromInode(object)).ok());
      EraseObject(space, object);
    } else {
      ASSERT_TRUE(store_->InvalidatePool(id, pool).ok());
      EraseSpace(space);
    }
  }

  void DoRecreatePrivatePool(int v) {
    const int slot = static_cast<int>(rng_() % kPrivatePoolsPerVm);
    VmState& vm = vms_[v];
    ASSERT_TRUE(store_->DestroyPool(vm.id, vm.pools[slot]).ok());
    EraseSpace(v * kPrivatePoolsPerVm + slot);
    // Pool ids are reused, so the new pool often has the old id.
    vm.pools[slot] = store_->NewPool(vm.id, nullptr).value();
  }

  void DoToggleSharedMembership(int v) {
    VmState& vm = vms_[v];
    if (vm.shared) {
      ASSERT_TRUE(store_->DestroyPool(vm.id, *vm.shared).ok());
      vm.shared.reset();
      // Pages stay while any member remains; the last one out drops them.
      if (!AnySharedMember()) EraseSpace(kSharedSpace);
    } else {
      vm.shared = store_->NewPool(vm.id, &uuid_).value();
    }
  }

  void DoRestartVm(int v) {
    VmState& vm = vms_[v];
    const VmId old = vm.id;
    ASSERT_TRUE(store_->ForgetVm(old).ok());
    for (int slot = 0; slot < kPrivatePoolsPerVm; ++slot) {
      EraseSpace(v * kPrivatePoolsPerVm + slot);
    }
    // Every page it put anywhere goes, shared pool included.
    EraseSharedOwnedBy(v);
    vm.shared.reset();
    if (!AnySharedMember()) EraseSpace(kSharedSpace);
    StartVm(v);
    // The old handle never reaches the new VM.
    Page out;
    EXPECT_EQ(store_->Get(old, vm.pools[0], ObjectId::FromInode(0), 0, out)
                  .status()
                  .code(),
              absl::StatusCode::kNotFound);
  }

  void DoChangePolicy(int v) {
    VmState& vm = vms_[v];
    vm.policy.frozen = rng_() % 8 == 0;
    vm.policy.enabled = rng_() % 16 != 0;
    vm.policy.weight = static_cast<uint32_t>(50 + rng_() % 300);
    if (GetParam().vary_quotas) {
      const uint64_t q = rng_() % 3;
      vm.policy.quota_bytes = q == 0   ? kUnlimitedQuota
                              : q == 1 ? 64 * kKiB
                                       : 256 * kKiB;
    }
    ASSERT_TRUE(store_->SetVmPolicy(vm.id, vm.policy).ok());
  }

  void CheckGauges() {
    const HostStats host = store_->GetHostStats();
    uint64_t pages = 0;
    for (const VmState& vm : vms_) {
      pages += store_->GetVmStats(vm.id)
                   .value()
                   .counters[static_cast<int>(Counter::kPagesHeld)];
    }
    const uint64_t host_pages =
        host.counters[static_cast<int>(Counter::kPagesHeld)];
    ASSERT_EQ(host_pages, pages) << "op " << op_;
    if (GetParam().strict) {
      ASSERT_EQ(host_pages, model_.size())
          << "op " << op_ << ": store holds pages the model does not (or "
          << "lost some)";
      ASSERT_EQ(host.counters[static_cast<int>(Counter::kEvictionsHostCap)] +
                    host.counters[static_cast<int>(Counter::kEvictionsQuota)],
                0u);
    } else {
      ASSERT_LE(host_pages, model_.size()) << "op " << op_;
    }
  }

  std::unique_ptr<TmemStore> store_;
  PoolUuid uuid_;
  std::array<VmState, kNumVms> vms_;
  std::map<Key, Expected> model_;
  std::mt19937_64 rng_;
  uint64_t version_ = 0;
  int op_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

TEST_P(CoherencyTest, GetsReturnOnlyTheLatestPut) {
  const RunConfig& config = GetParam();
  for (op_ = 0; op_ < config.ops; ++op_) {
    const int v = static_cast<int>(rng_() % kNumVms);
    const OpMix& mix = config.strict ? kBalancedMix : kFillingMix;
    int r = static_cast<int>(rng_() % 1000);
    auto pick = [&r](int weight) {
      r -= weight;
      return r < 0;
    };
    if (pick(mix.put)) {
      ASSERT_NO_FATAL_FAILURE(DoPut(v));
    } else if (pick(mix.get)) {
      ASSERT_NO_FATAL_FAILURE(DoGet(v));
    } else if (pick(mix.invalidate_page)) {
      ASSERT_NO_FATAL_FAILURE(DoInvalidate(v, 0));
    } else if (pick(mix.invalidate_object)) {
      ASSERT_NO_FATAL_FAILURE(DoInvalidate(v, 1));
    } else if (pick(mix.invalidate_pool)) {
      ASSERT_NO_FATAL_FAILURE(DoInvalidate(v, 2));
    } else if (pick(mix.recreate_pool)) {
      ASSERT_NO_FATAL_FAILURE(DoRecreatePrivatePool(v));
    } else if (pick(mix.toggle_shared)) {
      ASSERT_NO_FATAL_FAILURE(DoToggleSharedMembership(v));
    } else if (pick(mix.restart_vm)) {
      ASSERT_NO_FATAL_FAILURE(DoRestartVm(v));
    } else {
      ASSERT_NO_FATAL_FAILURE(DoChangePolicy(v));
    }
    if (op_ % 1000 == 0) {
      ASSERT_NO_FATAL_FAILURE(CheckGauges());
    }
  }
  ASSERT_NO_FATAL_FAILURE(CheckGauges());
  // The run exercised both outcomes.
  EXPECT_GT(hits_, static_cast<uint64_t>(config.ops) / 50);
  EXPECT_GT(misses_, 0u);
  const HostStats host = store_->GetHostStats();
  if (!config.strict) {
    EXPECT_GT(host.counters[static_cast<int>(Counter::kEvictionsHostCap)] +
                  host.counters[static_cast<int>(Counter::kEvictionsQuota)],
              0u)
        << "the small-cap runs are meant to evict";
  }
  RecordProperty(
      "evictions",
      static_cast<int>(
          host.counters[static_cast<int>(Counter::kEvictionsHostCap)] +
          host.counters[static_cast<int>(Counter::kEvictionsQuota)]));
  RecordProperty("hits", static_cast<int>(hits_));
  RecordProperty("misses", static_cast<int>(misses_));
}

INSTANTIATE_TEST_SUITE_P(
    Runs, CoherencyTest,
    ::testing::Values(
        // Small key spaces: keys are revisited often.
        RunConfig{1, 50000, 64 * kMiB, 64, /*strict=*/true, false, 4, 8},
        RunConfig{2, 50000, 64 * kMiB, 8, /*strict=*/true, false, 4, 8},
        // ~900 keys of ~3 KiB each cannot fit in 512 KiB: constant eviction.
        RunConfig{3, 50000, 512 * kKiB, 2, /*strict=*/false, false, 8, 16},
        RunConfig{4, 50000, 512 * kKiB, 4, /*strict=*/false, true, 8, 16}),
    [](const ::testing::TestParamInfo<RunConfig>& info) {
      std::ostringstream name;
      name << info.param;
      return name.str();
    });

}  // namespace
}  // namespace tmem
