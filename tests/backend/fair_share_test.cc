// Tests for the weighted fair-share rules (backend/fair_share.h).
#include "backend/fair_share.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tmem {
namespace {

int Victim(const std::vector<ShareInput>& vms) {
  return PickEvictionVictim(vms);
}

TEST(PickEvictionVictimTest, NobodyHoldingAnythingIsMinusOne) {
  EXPECT_EQ(Victim({}), -1);
  EXPECT_EQ(Victim({{0, 1}}), -1);
  EXPECT_EQ(Victim({{0, 100}, {0, 0}, {0, 7}}), -1);
}

TEST(PickEvictionVictimTest, SingleHolderIsTheVictim) {
  EXPECT_EQ(Victim({{0, 100}, {4096, 100}, {0, 100}}), 1);
  // However small its charge and however large its weight.
  EXPECT_EQ(Victim({{0, 1}, {1, UINT32_MAX}}), 1);
}

TEST(PickEvictionVictimTest, LargestChargePerWeightWins) {
  // 1000/100 = 10 vs 1500/300 = 5: the first is further over its share
  // even though it holds less.
  EXPECT_EQ(Victim({{1000, 100}, {1500, 300}}), 0);
  EXPECT_EQ(Victim({{1500, 300}, {1000, 100}}), 1);
  // Equal weights: the larger charge.
  EXPECT_EQ(Victim({{10, 5}, {30, 5}, {20, 5}}), 1);
  // Weights 1:2:3 with charges 100:200:301 -> the third is just over.
  EXPECT_EQ(Victim({{100, 1}, {200, 2}, {301, 3}}), 2);
  EXPECT_EQ(Victim({{101, 1}, {200, 2}, {300, 3}}), 0);
  EXPECT_EQ(Victim({{100, 1}, {201, 2}, {300, 3}}), 1);
}

TEST(PickEvictionVictimTest, TiesPickOneOfTheTied) {
  const int equal = Victim({{500, 1}, {500, 1}});
  EXPECT_TRUE(equal == 0 || equal == 1) << equal;
  // Same ratio, different charges.
  const int same_ratio = Victim({{100, 1}, {200, 2}, {50, 1}});
  EXPECT_TRUE(same_ratio == 0 || same_ratio == 1) << same_ratio;
  // A non-holder with a tied ratio of 0 is never picked.
  EXPECT_EQ(Victim({{0, 1}, {0, 2}, {10, 1}}), 2);
}

TEST(PickEvictionVictimTest, ZeroWeightCountsAsOne) {
  // Zero weight must not mean "never a victim" nor divide by zero.
  EXPECT_EQ(Victim({{200, 0}, {150, 1}}), 0);
  EXPECT_EQ(Victim({{100, 0}, {150, 1}}), 1);
  EXPECT_EQ(Victim({{100, 0}, {1000, 100}}), 0) << "100/1 > 1000/100";
  const int tie = Victim({{100, 0}, {100, 1}});
  EXPECT_TRUE(tie == 0 || tie == 1);
  EXPECT_EQ(Victim({{5, 0}}), 0);
}

TEST(PickEvictionVictimTest, LargeValuesDoNotOverflow) {
  const uint64_t big = uint64_t{1} << 44;  // 16 TiB of charges
  // big / (2^32 - 1) vs (big - 1) / (2^32 - 2): the second is larger; a
  // 64-bit cross-multiplication would overflow here.
  EXPECT_EQ(Victim({{big, UINT32_MAX}, {big - 1, UINT32_MAX - 1}}), 1);
  EXPECT_EQ(Victim({{big, 1}, {big, UINT32_MAX}}), 0);
  EXPECT_EQ(Victim({{UINT64_MAX / 2, UINT32_MAX}, {UINT64_MAX / 4, 1}}), 1);
}

TEST(PickEvictionVictimTest, MatchesBruteForceOnRandomInputs) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 2000; ++round) {
    std::vector<ShareInput> vms(1 + rng() % 8);
    for (ShareInput& in : vms) {
      in.charged_bytes = rng() % 4 == 0 ? 0 : rng() % 100000;
      in.weight = static_cast<uint32_t>(rng() % 5 == 0 ? 0 : 1 + rng() % 1000);
    }
    const int victim = PickEvictionVictim(vms);
    bool anyone = false;
    long double best = -1;
    for (const ShareInput& in : vms) {
      if (in.charged_bytes == 0) continue;
      anyone = true;
      const long double ratio = static_cast<long double>(in.charged_bytes) /
                                (in.weight == 0 ? 1 : in.weight);
      if (ratio > best) best = ratio;
    }
    if (!anyone) {
      EXPECT_EQ(victim, -1);
      continue;
    }
    ASSERT_GE(victim, 0);
    ASSERT_LT(victim, static_cast<int>(vms.size()));
    const ShareInput& v = vms[victim];
    EXPECT_GT(v.charged_bytes, 0u);
    const long double ratio = static_cast<long double>(v.charged_bytes) /
                              (v.weight == 0 ? 1 : v.weight);
    // Exact integer comparison would be nicer; the ratios here are far
    // from long double's precision limits.
    EXPECT_EQ(ratio, best) << "round " << round;
  }
}

TEST(FairShareBytesTest, SplitsTheCapByWeight) {
  const std::vector<ShareInput> vms = {{10, 100}, {10, 200}, {10, 300}};
  EXPECT_EQ(FairShareBytes(600, vms, 0), 100u);
  EXPECT_EQ(FairShareBytes(600, vms, 1), 200u);
  EXPECT_EQ(FairShareBytes(600, vms, 2), 300u);
}

TEST(FairShareBytesTest, OnlyHoldersAndTheAskerCount) {
  // VM 1 holds nothing: it does not dilute the others' shares...
  const std::vector<ShareInput> vms = {{10, 1}, {0, 2}, {10, 3}};
  EXPECT_EQ(FairShareBytes(600, vms, 0), 150u);
  EXPECT_EQ(FairShareBytes(600, vms, 2), 450u);
  // ...but asking for its own share counts it.
  EXPECT_EQ(FairShareBytes(600, vms, 1), 200u);
  // Alone, a VM's share is the whole cap.
  const std::vector<ShareInput> alone = {{0, 5}, {0, 7}};
  EXPECT_EQ(FairShareBytes(1000, alone, 1), 1000u);
}

TEST(FairShareBytesTest, ZeroWeightCountsAsOne) {
  const std::vector<ShareInput> vms = {{10, 0}, {10, 1}};
  EXPECT_EQ(FairShareBytes(1000, vms, 0), 500u);
  EXPECT_EQ(FairShareBytes(1000, vms, 1), 500u);
}

TEST(FairShareBytesTest, SharesSumToAtMostTheCap) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 1000; ++round) {
    std::vector<ShareInput> vms(1 + rng() % 10);
    for (ShareInput& in : vms) {
      in.charged_bytes = 1 + rng() % 1000;
      in.weight = static_cast<uint32_t>(1 + rng() % 1000);
    }
    const uint64_t cap = rng() % (uint64_t{1} << 40);
    uint64_t sum = 0;
    for (int i = 0; i < static_cast<int>(vms.size()); ++i) {
      sum += FairShareBytes(cap, vms, i);
    }
    EXPECT_LE(sum, cap);
    EXPECT_GE(sum + vms.size(), cap) << "rounding loses under a byte per VM";
  }
}

TEST(FairShareBytesTest, LargeCapAndWeightsDoNotOverflow) {
  const uint64_t cap = uint64_t{1} << 44;
  const std::vector<ShareInput> vms = {{1, UINT32_MAX}, {1, UINT32_MAX}};
  EXPECT_EQ(FairShareBytes(cap, vms, 0), cap / 2);
}

}  // namespace
}  // namespace tmem
