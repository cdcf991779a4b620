// DomainManager over the real LibvirtHypervisor against libvirt's test
// driver (test:///default, in-process): real libvirt events and metadata,
// no QEMU. The test driver cannot attach or detach devices, so those are
// only checked to fail cleanly here (libvirt_qemu_test does them for real).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "host-agent/agent.h"
#include "host-agent/libvirt/domain_manager.h"
#include "host-agent/libvirt/domain_xml.h"
#include "host-agent/libvirt/libvirt_hypervisor.h"
#include "tests/libvirt/libvirt_test_support.h"
#include "tests/temp_dir.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kEventTimeout{5000};
constexpr char kUri[] = "test:///default";

class LibvirtTestDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.empty()) << "mkdtemp failed";
    AgentOptions o;
    o.socket_dir = dir_;
    o.workers = 1;
    o.run_valve_ticker = false;
    auto a = Agent::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = std::move(*a);
    LibvirtOptions lo;
    lo.uri = kUri;
    auto hv = LibvirtHypervisor::Connect(lo);
    ASSERT_TRUE(hv.ok()) << hv.status();
    hv_ = std::move(*hv);
    // test:///default is one shared state per process: this connection
    // sees what tmemd's sees.
    raw_ = std::make_unique<RawConnection>(kUri);
    ASSERT_NE(raw_->get(), nullptr) << VirError();
    manager_ = std::make_unique<DomainManager>(agent_.get(), hv_.get(),
                                               DomainManagerOptions{});
    ASSERT_TRUE(manager_->Start().ok());
  }
  void TearDown() override {
    if (raw_) raw_->Remove(name_);
    manager_.reset();
    hv_.reset();
    raw_.reset();
    agent_.reset();
  }
  std::string DomainXml(const std::string& metadata) const {
    return absl::StrCat("<domain type='test'><name>", name_,
                        "</name><memory>65536</memory><os><type>hvm</type></os>"
                        "<metadata>",
                        metadata, "</metadata><devices>",
                        TmemShmemXml(dir_ + "/" + name_ + ".sock", 1),
                        "</devices></domain>");
  }
  uint64_t Quota() {
    auto p = agent_->GetVmPolicy(name_);
    return p.ok() ? p->quota_bytes : 0;
  }
  uint64_t Pages() {
    auto vm = agent_->GetVm(name_);
    return vm.ok() ? vm->stats.counters[static_cast<int>(Counter::kPagesHeld)]
                   : 0;
  }

  tmem::testing::TempDir tmp_{"tmemd-lvt"};
  std::string dir_ = tmp_.path();
  std::string name_ = absl::StrCat("tmemd-td-", getpid());
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<LibvirtHypervisor> hv_;
  std::unique_ptr<RawConnection> raw_;
  std::unique_ptr<DomainManager> manager_;
};

TEST_F(LibvirtTestDriverTest, LifecycleAndMetadataFollowLibvirtEvents) {
  std::string err;
  ASSERT_TRUE(raw_->Define(
      DomainXml("<tmem:tmem xmlns:tmem='https://tmemd.dev/xmlns/tmem/1'>"
                "<tmem:quota>256MiB</tmem:quota><tmem:weight>300</tmem:weight>"
                "</tmem:tmem>"),
      &err))
      << err;
  // DEFINED: the channel exists before the domain starts, with the quota
  // of its metadata.
  ASSERT_TRUE(WaitFor([&] { return agent_->HasVm(name_); }, kEventTimeout));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/" + name_ + ".sock"));
  EXPECT_EQ(Quota(), uint64_t{256} << 20);
  EXPECT_EQ(agent_->GetVmPolicy(name_)->weight, 300u);

  ASSERT_TRUE(raw_->With(name_, virDomainCreate, &err)) << err;
  // METADATA_CHANGE on the running domain reaches the store.
  ASSERT_TRUE(raw_->With(
      name_,
      [](virDomainPtr d) {
        return virDomainSetMetadata(
            d, VIR_DOMAIN_METADATA_ELEMENT,
            "<tmem><quota>32MiB</quota><mode>off</mode></tmem>", "tmem",
            "https://tmemd.dev/xmlns/tmem/1", VIR_DOMAIN_AFFECT_LIVE);
      },
      &err))
      << err;
  ASSERT_TRUE(
      WaitFor([&] { return Quota() == uint64_t{32} << 20; }, kEventTimeout))
      << "quota is " << Quota();
  EXPECT_EQ(agent_->GetVm(name_)->valve.mode, ValveMode::kOff);

  // Pages stored while running are dropped when the domain stops; the
  // channel comes back empty for the next start (the config keeps the
  // device), with the persistent metadata's policy.
  {
    TmemStore& store = agent_->store();
    const VmId id = store.FindVm(name_).value();
    const PoolId pool = store.NewPool(id, nullptr).value();
    for (int i = 0; i < 4; ++i) {
      const test::Page page = test::TextPage(i);
      ASSERT_TRUE(store.Put(id, pool, ObjectId{}, i, ConstPage(page)).ok());
    }
  }
  EXPECT_EQ(Pages(), 4u);
  ASSERT_TRUE(raw_->With(name_, virDomainDestroy, &err)) << err;
  ASSERT_TRUE(WaitFor(
      [&] {
        return agent_->HasVm(name_) && Pages() == 0 &&
               Quota() == uint64_t{256} << 20;
      },
      kEventTimeout));

  // The test driver cannot hot-plug: a clean error, no channel leaked.
  ASSERT_TRUE(raw_->With(name_, virDomainCreate, &err)) << err;
  manager_->Flush();
  EXPECT_EQ(manager_->Attach(name_, false).status().code(),
            absl::StatusCode::kAlreadyExists);

  // UNDEFINED after stop: the channel goes.
  ASSERT_TRUE(raw_->With(name_, virDomainDestroy, &err)) << err;
  ASSERT_TRUE(raw_->With(name_, virDomainUndefine, &err)) << err;
  // HasVm turns false before the channel is destroyed (and its socket
  // unlinked), outside the agent's lock.
  const std::string sock = dir_ + "/" + name_ + ".sock";
  ASSERT_TRUE(WaitFor(
      [&] { return !agent_->HasVm(name_) && !std::filesystem::exists(sock); },
      kEventTimeout));
  EXPECT_TRUE(manager_->List().empty());
}

TEST_F(LibvirtTestDriverTest, AttachUnsupportedByTheDriverFailsCleanly) {
  // test:///default ships a running domain "test" (machine pc, no ACPI
  // element in its XML): either the hotplug check or the driver refuses.
  absl::StatusOr<DomainAttachState> s = manager_->Attach("test", false);
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(agent_->HasVm("test"));
  EXPECT_TRUE(manager_->List().empty());
  EXPECT_EQ(manager_->Attach("no-such-domain", false).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tmem
