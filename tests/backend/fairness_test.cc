// Weighted fair sharing of a full host (tmem_store.h "Eviction when the host
// is full"): VMs converge to cap x weight / sum of weights, and a VM within
// its share is never robbed while another is over.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/stats.h"
#include "backend/tmem_store.h"
#include "gtest/gtest.h"

namespace tmem {
namespace {

using Page = std::array<uint8_t, kPageSize>;
constexpr uint64_t kMiB = uint64_t{1} << 20;
// Every page below is stored raw, so every page costs the same.
// A raw page in an object that already exists.
constexpr uint64_t kPageCharge = BlobCharge(kPageSize) + kPageEntryCharge;

// A page that is neither zero nor same-filled and names its (vm, n). Stored
// with PutMode::kRaw, so its content does not change its cost.
Page TaggedPage(uint64_t vm, uint64_t n) {
  Page page;
  for (size_t off = 0; off < kPageSize; off += 8) {
    const uint64_t word = (vm << 56) ^ (n << 16) ^ off;
    std::memcpy(page.data() + off, &word, 8);
  }
  return page;
}

uint64_t Get(const CounterValues& v, Counter c) {
  return v[static_cast<int>(c)];
}

class FairnessTest : public ::testing::Test {
 protected:
  void Open(uint64_t cap_bytes) {
    StoreOptions options;
    options.memory_cap_bytes = cap_bytes;
    options.address_space_bytes = 64 * kMiB;
    options.num_shards = 4;
    store_ = TmemStore::Create(options).value();
  }
  struct Vm {
    VmId id = 0;
    PoolId pool = -1;
    uint32_t weight = 0;
    uint64_t next = 0;  // next page number to put
  };
  Vm AddVm(const std::string& name, uint32_t weight) {
    VmPolicy policy;
    policy.weight = weight;
    Vm vm;
    vm.id = store_->AddVm(name, policy).value();
    vm.pool = store_->NewPool(vm.id, nullptr).value();
    vm.weight = weight;
    return vm;
  }
  void PutNext(Vm& vm) {
    const uint64_t n = vm.next++;
    const PutResult r = store_
                            ->Put(vm.id, vm.pool, ObjectId::FromInode(n / 64),
                                  n, TaggedPage(vm.id, n), PutMode::kRaw)
                            .value();
    ASSERT_TRUE(r.stored) << RefuseReasonName(r.reason);
    max_evicted_ = std::max(max_evicted_, r.evicted);
  }
  uint32_t max_evicted_ = 0;  // by one put
  CounterValues Counters(const Vm& vm) {
    return store_->GetVmStats(vm.id).value().counters;
  }
  uint64_t Charged(const Vm& vm) {
    return Get(Counters(vm), Counter::kChargedBytes);
  }

  std::unique_ptr<TmemStore> store_;
};

TEST_F(FairnessTest, FullHostIsSharedByWeight) {
  const uint64_t cap = 8 * kMiB;
  Open(cap);
  std::vector<Vm> vms = {AddVm("w1", 100), AddVm("w2", 200), AddVm("w3", 300)};
  const double weight_sum = 600;
  const double few_pages = 4.0 * kPageCharge;
  const int rounds_to_fill = static_cast<int>(cap / kPageCharge);

  // Each VM alone could fill the host several times over. After two fills
  // the host is in steady state: from then on the shares are checked every
  // few rounds, not only at the end, since the promise holds at all times.
  int checks = 0;
  for (int round = 0; round < 4 * rounds_to_fill; ++round) {
    for (Vm& vm : vms) ASSERT_NO_FATAL_FAILURE(PutNext(vm));
    if (round < 2 * rounds_to_fill || round % 8 != 0) continue;
    ++checks;
    std::vector<double> charged;
    double total = 0;
    for (const Vm& vm : vms) {
      charged.push_back(static_cast<double>(Charged(vm)));
      total += charged.back();
    }
    // Most of the cap holds pages (the rest is entries, indexes and partly
    // used slabs).
    const HostStats host = store_->GetHostStats();
    ASSERT_GT(total, 0.75 * cap)
        << "round " << round << ": used " << host.memory_used_bytes
        << ", slabs " << host.slab_bytes << " (live slots "
        << host.blob_slot_bytes << "), metadata " << host.metadata_bytes;
    ASSERT_LE(total, cap);
    for (size_t i = 0; i < vms.size(); ++i) {
      const double share_of_cap =
          static_cast<double>(cap) * vms[i].weight / weight_sum;
      const double share_of_held = total * vms[i].weight / weight_sum;
      SCOPED_TRACE(testing::Message()
                   << "round " << round << ": weight " << vms[i].weight
                   << " charged " << charged[i] << " share of cap "
                   << share_of_cap << " share of held " << share_of_held);
      // 15%, as against the cap: a VM's all-in charge moves in steps (an
      // object node chunk, a slab's tail share), and which VM's page an
      // eviction frees depends on the hash layout, which absl seeds per
      // process; 10% failed 7 runs in 400, before and after this session.
      ASSERT_LE(std::abs(charged[i] - share_of_held),
                std::max(0.15 * share_of_held, few_pages));
      ASSERT_LE(std::abs(charged[i] - share_of_cap),
                std::max(0.15 * share_of_cap, few_pages));
    }
  }
  EXPECT_GT(checks, 10);
  // A put that needs table room or a fresh slab empties a whole slab (16
  // raw pages here), the emptiest (tmem_store.h). In 1,500 runs the most
  // one put evicted was 49; when it evicted in plain LRU order until some
  // slab happened to empty, 17% of runs had a put evict over 100 pages and
  // 0.3% over 878 (of ~2,000 held), which also broke the share checks.
  EXPECT_LE(max_evicted_, 64u);
  for (const Vm& vm : vms) {
    EXPECT_GT(Get(Counters(vm), Counter::kEvictionsHostCap), 0u)
        << "every VM was over its share at some point while filling";
  }
  // Heavier weights hold more.
  EXPECT_LT(Charged(vms[0]), Charged(vms[1]));
  EXPECT_LT(Charged(vms[1]), Charged(vms[2]));
}

TEST_F(FairnessTest, VmWithinItsShareIsNotRobbed) {
  const uint64_t cap = 8 * kMiB;
  Open(cap);
  Vm modest = AddVm("modest", 100);
  Vm greedy = AddVm("greedy", 100);
  constexpr int kModestPages = 100;  // ~400 KiB, a tenth of its 4 MiB share
  for (int i = 0; i < kModestPages; ++i)
    ASSERT_NO_FATAL_FAILURE(PutNext(modest));
  const uint64_t modest_charged = Charged(modest);

  for (int i = 0; i < 5 * static_cast<int>(cap / kPageCharge); ++i) {
    ASSERT_NO_FATAL_FAILURE(PutNext(greedy));
    if (i % 256 == 0) {
      ASSERT_EQ(Charged(modest), modest_charged) << "after greedy put " << i;
    }
  }
  const CounterValues c = Counters(modest);
  EXPECT_EQ(Get(c, Counter::kPagesHeld), static_cast<uint64_t>(kModestPages));
  EXPECT_EQ(Get(c, Counter::kEvictionsHostCap), 0u);
  EXPECT_GT(Get(Counters(greedy), Counter::kEvictionsHostCap), 0u)
      << "the greedy VM did fill the host";
  // Greedy got the rest of the host.
  EXPECT_GT(Charged(greedy), cap / 2);
  for (int n = 0; n < kModestPages; ++n) {
    Page out;
    ASSERT_TRUE(
        store_->Get(modest.id, modest.pool, ObjectId::FromInode(n / 64), n, out)
            .value())
        << n;
    EXPECT_EQ(out, TaggedPage(modest.id, n));
  }
}

TEST_F(FairnessTest, LateComerGetsItsShareFromTheIncumbent) {
  const uint64_t cap = 8 * kMiB;
  Open(cap);
  Vm incumbent = AddVm("incumbent", 100);
  for (int i = 0; i < 2 * static_cast<int>(cap / kPageCharge); ++i) {
    ASSERT_NO_FATAL_FAILURE(PutNext(incumbent));
  }
  EXPECT_GT(Charged(incumbent), cap * 3 / 4) << "alone, it may use the host";

  Vm late = AddVm("late", 300);
  for (int i = 0; i < 3 * static_cast<int>(cap / kPageCharge); ++i) {
    ASSERT_NO_FATAL_FAILURE(PutNext(incumbent));
    ASSERT_NO_FATAL_FAILURE(PutNext(late));
  }
  const auto total = static_cast<double>(Charged(incumbent) + Charged(late));
  const double late_share = total * 3 / 4;
  EXPECT_NEAR(static_cast<double>(Charged(late)), late_share,
              std::max(0.05 * late_share, 4.0 * kPageCharge));
}

// The valve marks a VM whose pages never come back with an eviction bias:
// on a full host its pages go first, though the weights are equal.
TEST_F(FairnessTest, EvictionBiasMakesAVmGoFirst) {
  const uint64_t cap = 8 * kMiB;
  Open(cap);
  Vm reread = AddVm("reread", 100);
  Vm stream = AddVm("stream", 100);
  ASSERT_TRUE(store_->SetEvictionBias(stream.id, 16).ok());
  EXPECT_EQ(store_->SetEvictionBias(12345, 16).code(),
            absl::StatusCode::kNotFound);
  // The re-reading VM fills 3/4 of the host, then the streamer pushes.
  const auto reread_pages = static_cast<int>(3 * cap / 4 / kPageCharge);
  for (int i = 0; i < reread_pages; ++i) {
    ASSERT_NO_FATAL_FAILURE(PutNext(reread));
  }
  const uint64_t held = Get(Counters(reread), Counter::kPagesHeld);
  for (int i = 0; i < 4 * static_cast<int>(cap / kPageCharge); ++i) {
    ASSERT_NO_FATAL_FAILURE(PutNext(stream));
  }
  // Unbiased, fair share would cut the re-reader to half the host; biased,
  // the streamer's share is 1/17 of it, so the re-reader keeps what it had
  // (but for the first few puts, when the streamer holds nothing yet and
  // the re-reader is the only VM with pages to give: seen 1 page).
  EXPECT_GE(Get(Counters(reread), Counter::kPagesHeld), held - held / 100);
  EXPECT_LE(Get(Counters(reread), Counter::kEvictionsHostCap), held / 100);
  EXPECT_GT(Get(Counters(stream), Counter::kEvictionsHostCap), 0u);
  // Back to neutral: the fair share applies again.
  ASSERT_TRUE(store_->SetEvictionBias(stream.id, 1).ok());
  for (int i = 0; i < 4 * static_cast<int>(cap / kPageCharge); ++i) {
    ASSERT_NO_FATAL_FAILURE(PutNext(stream));
  }
  EXPECT_LT(Charged(reread), cap * 6 / 10);
  EXPECT_GT(Charged(reread), cap * 4 / 10);
}

}  // namespace
}  // namespace tmem
