// PolicyStore: generation rules and the state file (no gRPC, no agent).
#include "host-agent/control/policy_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "tests/control/test_util.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

class PolicyStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path();
    path_ = dir_ + "/state.json";
  }
  testing::TempDir tmp_{"tmem-policy"};
  std::string dir_, path_;
};

TEST_F(PolicyStoreTest, GenerationsMustGrowPerVmAndForTheHost) {
  auto store = PolicyStore::Open("");
  ASSERT_TRUE(store.ok());
  PolicyStore& s = **store;
  EXPECT_EQ(*s.NextVmGeneration("a", 0), 1u);
  EXPECT_EQ(*s.NextVmGeneration("a", 7), 7u);
  ASSERT_TRUE(s.CommitVm("a", {VmPolicy{}, 7}).ok());
  EXPECT_EQ(s.NextVmGeneration("a", 7).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.NextVmGeneration("a", 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*s.NextVmGeneration("a", 0), 8u);
  EXPECT_EQ(*s.NextVmGeneration("b", 1), 1u);  // per VM
  EXPECT_EQ(*s.NextHostGeneration(0), 1u);
  StoredHostPolicy h;
  h.generation = 4;
  ASSERT_TRUE(s.CommitHost(h).ok());
  EXPECT_EQ(s.NextHostGeneration(4).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*s.NextHostGeneration(5), 5u);
}

TEST_F(PolicyStoreTest, StateRoundTripsThroughTheFile) {
  {
    auto store = PolicyStore::Open(path_);
    ASSERT_TRUE(store.ok());
    VmPolicy p;
    p.quota_bytes = 123456;
    p.weight = 42;
    p.enabled = false;
    p.frozen = true;
    p.mode = ValveMode::kAlways;
    ASSERT_TRUE((*store)->CommitVm("web1", {p, 3}).ok());
    StoredHostPolicy h;
    h.memory_cap_bytes = uint64_t{2} << 30;
    h.cpu_budget_percent = 12.5;
    h.default_mode = ValveMode::kOff;
    h.generation = 9;
    ASSERT_TRUE((*store)->CommitHost(h).ok());
    ASSERT_TRUE((*store)
                    ->SetSharedPoolGrant(
                        {"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "web1"}, true)
                    .ok());
  }
  // Atomic replace: no temporary file is left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  auto store = PolicyStore::Open(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  std::optional<StoredVmPolicy> vm = (*store)->Vm("web1");
  ASSERT_TRUE(vm.has_value());
  EXPECT_EQ(vm->generation, 3u);
  EXPECT_EQ(vm->policy.quota_bytes, 123456u);
  EXPECT_EQ(vm->policy.weight, 42u);
  EXPECT_FALSE(vm->policy.enabled);
  EXPECT_TRUE(vm->policy.frozen);
  EXPECT_EQ(vm->policy.mode, ValveMode::kAlways);
  const StoredHostPolicy h = (*store)->Host();
  EXPECT_EQ(h.generation, 9u);
  EXPECT_EQ(*h.memory_cap_bytes, uint64_t{2} << 30);
  EXPECT_DOUBLE_EQ(*h.cpu_budget_percent, 12.5);
  EXPECT_EQ(*h.default_mode, ValveMode::kOff);
  ASSERT_EQ((*store)->SharedPoolGrants().size(), 1u);
  EXPECT_FALSE((*store)->Vm("other").has_value());
}

TEST_F(PolicyStoreTest, SwapPolicyRoundTripsThroughTheFile) {
  {
    auto store = PolicyStore::Open(path_);
    ASSERT_TRUE(store.ok());
    VmPolicy p;
    p.swap_quota_bytes = uint64_t{256} << 20;
    p.swap_mode = ValveMode::kOff;
    ASSERT_TRUE((*store)->CommitVm("web1", {p, 1}).ok());
    ASSERT_TRUE((*store)->CommitVm("web2", {VmPolicy{}, 1}).ok());
    // Unlimited is written as 0, as the quota is.
    EXPECT_NE((*store)->Serialize().find("\"swap_quota_bytes\": 0"),
              std::string::npos)
        << (*store)->Serialize();
  }
  auto store = PolicyStore::Open(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  std::optional<StoredVmPolicy> web1 = (*store)->Vm("web1");
  ASSERT_TRUE(web1.has_value());
  EXPECT_EQ(web1->policy.swap_quota_bytes, uint64_t{256} << 20);
  EXPECT_EQ(web1->policy.swap_mode, ValveMode::kOff);
  std::optional<StoredVmPolicy> web2 = (*store)->Vm("web2");
  ASSERT_TRUE(web2.has_value());
  EXPECT_EQ(web2->policy.swap_quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(web2->policy.swap_mode, ValveMode::kDefault);
}

// A state file from before the swap fields loads; its VMs get the
// defaults (unlimited, following the mode).
TEST_F(PolicyStoreTest, StateFileWithoutSwapFieldsLoads) {
  std::ofstream(path_) << R"({"version": 1, "host": {"generation": 2},
      "vms": {"web1": {"generation": 4, "quota_bytes": 1048576,
      "weight": 7, "enabled": true, "frozen": false, "mode": "always"}},
      "shared_pools": []})";
  auto store = PolicyStore::Open(path_);
  ASSERT_TRUE(store.ok()) << store.status();
  std::optional<StoredVmPolicy> vm = (*store)->Vm("web1");
  ASSERT_TRUE(vm.has_value());
  EXPECT_EQ(vm->generation, 4u);
  EXPECT_EQ(vm->policy.quota_bytes, 1048576u);
  EXPECT_EQ(vm->policy.mode, ValveMode::kAlways);
  EXPECT_EQ(vm->policy.swap_quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(vm->policy.swap_mode, ValveMode::kDefault);
}

TEST_F(PolicyStoreTest, BadSwapFieldsNameTheirKey) {
  const std::string vm = R"({"version": 1, "vms": {"a": {"generation": 1,
      "quota_bytes": 0, "weight": 1, "enabled": true, "frozen": false,
      "mode": "off", )";
  struct Bad {
    const char* fields;
    const char* reason;
  } bad[] = {
      {R"("swap_quota_bytes": 2251799813685248)",
       "vms.a.swap_quota_bytes: swap quota"},
      {R"("swap_quota_bytes": -1)",
       "vms.a.swap_quota_bytes: -1 is not a byte count"},
      {R"("swap_quota_bytes": "1GiB")",
       "vms.a.swap_quota_bytes: \"1GiB\" is not a byte count"},
      {R"("swap_mode": "fast")", "vms.a.swap_mode: \"fast\" is not a mode"},
      {R"("swap_mode": 3)", "vms.a.swap_mode: 3 is not a mode"},
  };
  for (const Bad& b : bad) {
    std::ofstream(path_) << vm << b.fields << "}}}";
    auto s = PolicyStore::Open(path_);
    ASSERT_FALSE(s.ok()) << b.fields;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(b.reason), std::string::npos)
        << b.fields << " -> " << s.status().message();
  }
}

TEST_F(PolicyStoreTest, MissingFileIsEmptyAndCorruptFileIsAClearError) {
  auto empty = PolicyStore::Open(path_);
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE((*empty)->Vm("x").has_value());
  for (const char* bad :
       {"{not json", R"({"version": 2})",
        R"({"version": 1, "vms": {"a": {"generation": "x"}}})",
        R"({"version": 1, "vms": {"a": {"generation": 1, "quota_bytes": 1,
            "weight": 1, "enabled": true, "frozen": false, "mode": "fast"}}})"}) {
    std::ofstream(path_) << bad;
    auto s = PolicyStore::Open(path_);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(path_), std::string::npos);
  }
}

TEST_F(PolicyStoreTest, WriteFailureIsReported) {
  auto store = PolicyStore::Open(dir_ + "/no/such/dir/state.json");
  ASSERT_TRUE(store.ok());
  const absl::Status s = (*store)->CommitVm("a", {VmPolicy{}, 1});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("state file"), std::string::npos) << s;
  // The in-memory state still moved on (the policy is live).
  EXPECT_EQ((*store)->Vm("a")->generation, 1u);
}

// The state file's temporary is never opened through whatever sits at its
// name: a symlink planted there is neither followed nor its target changed.
TEST_F(PolicyStoreTest, TemporaryNeverFollowsAPlantedSymlink) {
  const std::string victim = dir_ + "/victim";
  { std::ofstream(victim) << "precious"; }
  ASSERT_EQ(chmod(victim.c_str(), 0644), 0);
  const std::string tmp = path_ + ".tmp." + std::to_string(getpid());
  ASSERT_EQ(symlink(victim.c_str(), tmp.c_str()), 0);
  auto store = PolicyStore::Open(path_);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->CommitVm("a", {VmPolicy{}, 1}).ok());
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "precious") << "the state was written through the link";
  struct stat st {};
  ASSERT_EQ(stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the state file is a file of its own";
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  auto reopened = PolicyStore::Open(path_);
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->Vm("a")->generation, 1u);
}

// State-file values are range-checked with the same table as flags, config
// and RPCs: a weight of 5000000000 is refused, never wrapped to 705032704.
TEST_F(PolicyStoreTest, StateFileValuesAreRangeChecked) {
  auto write = [&](const std::string& vm_json) {
    std::ofstream(path_) << R"({"version": 1, "vms": {"a": )" << vm_json
                         << "}}";
  };
  const std::string ok_rest =
      R"("enabled": true, "frozen": false, "mode": "default"})";
  write(R"({"generation": 1, "quota_bytes": 0, "weight": 5000000000, )" +
        ok_rest);
  auto store = PolicyStore::Open(path_);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find("vms.a.weight"), std::string::npos)
      << store.status();
  write(R"({"generation": 1, "quota_bytes": 0, "weight": 0, )" + ok_rest);
  EXPECT_FALSE(PolicyStore::Open(path_).ok());
  std::ofstream(path_)
      << R"({"version": 1, "host": {"cpu_budget_percent": 500}})";
  store = PolicyStore::Open(path_);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find("cpu_budget_percent"),
            std::string::npos)
      << store.status();
  // quota 0 (and the UINT64_MAX older files wrote) is unlimited.
  for (const char* quota : {"0", "18446744073709551615"}) {
    write(std::string(R"({"generation": 1, "quota_bytes": )") + quota +
          R"(, "weight": 100, )" + ok_rest);
    store = PolicyStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ((*store)->Vm("a")->policy.quota_bytes, kUnlimitedQuota) << quota;
  }
}

}  // namespace
}  // namespace tmem
