// DomainManager's logic against FakeHypervisor and a real Agent (real
// channels and sockets in a temporary directory, a real store).
#include "host-agent/libvirt/domain_manager.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "host-agent/agent.h"
#include "host-agent/libvirt/domain_xml.h"
#include "tests/libvirt/fake_hypervisor.h"
#include "tests/temp_dir.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using std::chrono::milliseconds;

std::string Meta(const std::string& inner) {
  return "<tmem xmlns=\"https://tmemd.dev/xmlns/tmem/1\">" + inner + "</tmem>";
}

bool Exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

class DomainManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.empty()) << "mkdtemp failed";
    AgentOptions o;
    o.socket_dir = dir_;
    o.state_dir = dir_;
    o.workers = 1;
    o.run_valve_ticker = false;
    absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = std::move(*a);
    DomainManagerOptions mo;
    mo.detach_timeout = milliseconds(200);
    mo.add_swap_device = [this](const std::string& vm, uint64_t size) {
      std::lock_guard<std::mutex> l(swap_mu_);
      if (swap_devices_.contains(vm)) {
        return absl::AlreadyExistsError("fake: swap device exists");
      }
      swap_devices_[vm] = size;
      return absl::OkStatus();
    };
    mo.remove_swap_device = [this](const std::string& vm) {
      std::lock_guard<std::mutex> l(swap_mu_);
      return swap_devices_.erase(vm) > 0
                 ? absl::OkStatus()
                 : absl::NotFoundError("fake: no swap device");
    };
    manager_ = std::make_unique<DomainManager>(agent_.get(), &hv_, mo);
  }
  void TearDown() override {
    manager_.reset();
    agent_.reset();
  }

  FakeHypervisor::Domain WithDevice(const std::string& sock) {
    FakeHypervisor::Domain d;
    d.config_devices.push_back(TmemShmemXml(dir_ + "/" + sock, 1));
    return d;
  }
  // Stores `n` pages for the VM; returns the VM's page count.
  uint64_t PutPages(const std::string& vm, int n) {
    TmemStore& store = agent_->store();
    const VmId id = store.FindVm(vm).value();
    const PoolId pool = store.NewPool(id, nullptr).value();
    for (int i = 0; i < n; ++i) {
      ObjectId oid;
      oid.words[0] = 7;
      const test::Page page = test::TextPage(i);
      EXPECT_TRUE(store.Put(id, pool, oid, i, ConstPage(page)).ok());
    }
    return Pages(vm);
  }
  uint64_t Pages(const std::string& vm) {
    absl::StatusOr<VmInfo> info = agent_->GetVm(vm);
    if (!info.ok()) return 0;
    return info->stats.counters[static_cast<int>(Counter::kPagesHeld)];
  }
  std::optional<DomainAttachState> Find(const std::string& domain) {
    for (const DomainAttachState& s : manager_->List()) {
      if (s.domain == domain) return s;
    }
    return std::nullopt;
  }

  std::map<std::string, uint64_t> SwapDevices() {
    std::lock_guard<std::mutex> l(swap_mu_);
    return swap_devices_;
  }

  std::mutex swap_mu_;
  std::map<std::string, uint64_t> swap_devices_;  // guarded by swap_mu_
  tmem::testing::TempDir tmp_{"tmemd-dm"};
  std::string dir_ = tmp_.path();
  FakeHypervisor hv_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<DomainManager> manager_;
};

TEST_F(DomainManagerTest, StartupCreatesChannelsForDomainsWithTheDevice) {
  hv_.Define("web1", WithDevice("web1.sock"));
  hv_.Define("plain", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());
  EXPECT_TRUE(agent_->HasVm("web1"));
  EXPECT_TRUE(Exists(dir_ + "/web1.sock"));
  EXPECT_FALSE(agent_->HasVm("plain"));
  ASSERT_EQ(manager_->List().size(), 1u);
  EXPECT_TRUE(manager_->List()[0].persistent);
  EXPECT_FALSE(manager_->List()[0].attached);
  // A domain defined later with the device gets its channel on DEFINED.
  hv_.Define("web2", WithDevice("web2.sock"));
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("web2"));
}

// A domain's <server path> must lie in the socket directory: used as is,
// whoever could define a domain would make tmemd bind, chmod, chown and
// unlink anywhere.
TEST_F(DomainManagerTest, SocketPathOutsideTheSocketDirectoryIsRefused) {
  tmem::testing::TempDir elsewhere{"tmemd-dm-elsewhere"};
  const std::string outside = elsewhere.path() + "/evil.sock";
  FakeHypervisor::Domain evil;
  evil.config_devices.push_back(TmemShmemXml(outside, 1));
  hv_.Define("evil", evil);
  FakeHypervisor::Domain dotdot;
  dotdot.config_devices.push_back(
      TmemShmemXml(dir_ + "/../" + "dotdot.sock", 1));
  hv_.Define("dotdot", dotdot);
  hv_.Define("good", WithDevice("good.sock"));
  ASSERT_TRUE(manager_->Start().ok());
  EXPECT_FALSE(agent_->HasVm("evil"));
  EXPECT_FALSE(agent_->HasVm("dotdot"));
  EXPECT_FALSE(Exists(outside)) << "nothing created outside the directory";
  EXPECT_TRUE(agent_->HasVm("good"));
}

// libvirt's qemu hook: the XML alone makes the channel (no libvirt call:
// FakeHypervisor knows no such domain), with the metadata's policy; the
// STARTED reconcile adopts it; refusals name their reason.
TEST_F(DomainManagerTest, HookPrepareMakesTheChannelFromTheXmlAlone) {
  ASSERT_TRUE(manager_->Start().ok());
  const std::string xml = absl::StrCat(
      "<domain type='qemu'><name>tr1</name>"
      "<uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa0</uuid><metadata>"
      "<other:tmem xmlns:other='https://example.org/x'><quota>1</quota>"
      "</other:tmem>"
      "<tmem:tmem xmlns:tmem='https://tmemd.dev/xmlns/tmem/1'>"
      "<quota>32MiB</quota></tmem:tmem></metadata><devices>",
      TmemShmemXml(dir_ + "/tr1.sock", 1), "</devices></domain>");
  absl::StatusOr<DomainAttachState> st = manager_->PrepareFromHook(xml);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->vm, "tr1");
  EXPECT_TRUE(Exists(dir_ + "/tr1.sock"));
  absl::StatusOr<VmInfo> info = agent_->GetVm("tr1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->policy.quota_bytes, uint64_t{32} << 20);
  // A second prepare (a restart) is fine: same socket.
  EXPECT_TRUE(manager_->PrepareFromHook(xml).ok());
  // Release of a domain the manager does not follow removes it.
  st = manager_->ReleaseFromHook(xml);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->detail, "released");
  EXPECT_FALSE(agent_->HasVm("tr1"));

  // No device: nothing to do. Refusals: no uuid, a path outside, bad value.
  st = manager_->PrepareFromHook(
      "<domain><name>p</name><uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa1</uuid>"
      "<devices/></domain>");
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(agent_->HasVm("p"));
  EXPECT_FALSE(
      manager_->PrepareFromHook("<domain><name>x</name></domain>").ok());
  tmem::testing::TempDir elsewhere{"tmemd-dm-hook"};
  absl::StatusOr<DomainAttachState> bad =
      manager_->PrepareFromHook(absl::StrCat(
          "<domain><name>out</name><uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa2"
          "</uuid><devices>",
          TmemShmemXml(elsewhere.path() + "/out.sock", 1),
          "</devices></domain>"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(Exists(elsewhere.path() + "/out.sock"));
  bad = manager_->PrepareFromHook(absl::StrCat(
      "<domain><name>bq</name><uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa3"
      "</uuid><metadata><tmem:tmem xmlns:tmem='https://tmemd.dev/xmlns/tmem/1'>"
      "<quota>banana</quota></tmem:tmem></metadata><devices>",
      TmemShmemXml(dir_ + "/bq.sock", 1), "</devices></domain>"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("quota"), absl::string_view::npos);
  EXPECT_FALSE(agent_->HasVm("bq"));
}

TEST_F(DomainManagerTest, HookReleaseLeavesFollowedDomainsToTheirEvents) {
  FakeHypervisor::Domain d = WithDevice("web1.sock");
  d.uuid = "4dea22b3-1d52-d8f3-2516-782e98ab3fa9";
  hv_.Define("web1", d);
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(agent_->HasVm("web1"));
  const std::string xml = absl::StrCat(
      "<domain><name>web1</name><uuid>", d.uuid, "</uuid><devices>",
      TmemShmemXml(dir_ + "/web1.sock", 1), "</devices></domain>");
  absl::StatusOr<DomainAttachState> st = manager_->ReleaseFromHook(xml);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(agent_->HasVm("web1")) << st->detail;
}

// The connection was down while a transient domain's hook made its channel
// and the domain started and stopped (its events lost, its release hook
// answered while the manager was busy): the resync releases the channel;
// a hook channel whose domain runs is adopted and kept.
TEST_F(DomainManagerTest, HookChannelOfADomainGoneWhileDisconnectedIsReleased) {
  ASSERT_TRUE(manager_->Start().ok());
  hv_.LoseConnection();
  manager_->Flush();
  auto xml = [&](const std::string& name, const std::string& uuid) {
    return absl::StrCat("<domain type='qemu'><name>", name, "</name><uuid>",
                        uuid, "</uuid><devices>",
                        TmemShmemXml(dir_ + "/" + name + ".sock", 1),
                        "</devices></domain>");
  };
  ASSERT_TRUE(
      manager_
          ->PrepareFromHook(xml("gone", "4dea22b3-1d52-d8f3-2516-782e98ab3fb0"))
          .ok());
  FakeHypervisor::Domain runs = WithDevice("runs.sock");
  runs.uuid = "4dea22b3-1d52-d8f3-2516-782e98ab3fb1";
  ASSERT_TRUE(manager_->PrepareFromHook(xml("runs", runs.uuid)).ok());
  hv_.SetQuiet(true);
  hv_.Define("runs", runs);
  hv_.Start("runs");
  hv_.SetQuiet(false);
  ASSERT_TRUE(agent_->HasVm("gone"));
  hv_.Reconnect();
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("gone"));
  EXPECT_FALSE(Exists(dir_ + "/gone.sock"));
  EXPECT_TRUE(agent_->HasVm("runs"));
  ASSERT_TRUE(Find("runs").has_value());
}

// libvirt runs the release hook while an operation holds the manager (here
// an attach inside its libvirt call): the hook does not wait, and the
// manager's thread releases the channel the hook made once it is free.
TEST_F(DomainManagerTest, HookReleaseWhileTheManagerIsBusyIsQueued) {
  hv_.Define("busy", FakeHypervisor::Domain{});
  hv_.Start("busy");
  ASSERT_TRUE(manager_->Start().ok());
  const std::string xml = absl::StrCat(
      "<domain type='qemu'><name>tr4</name>"
      "<uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fb4</uuid><devices>",
      TmemShmemXml(dir_ + "/tr4.sock", 1), "</devices></domain>");
  ASSERT_TRUE(manager_->PrepareFromHook(xml).ok());
  ASSERT_TRUE(agent_->HasVm("tr4"));
  std::string detail;
  hv_.SetAttachHook([&](const std::string&) {
    absl::StatusOr<DomainAttachState> st = manager_->ReleaseFromHook(xml);
    if (st.ok()) detail = st->detail;
  });
  ASSERT_TRUE(manager_->Attach("busy", false).ok());
  EXPECT_EQ(detail, "queued: released by tmemd's libvirt thread");
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("tr4"));
  EXPECT_TRUE(agent_->HasVm("busy"));
}

TEST_F(DomainManagerTest, RunningDeviceFromAnEarlierTmemdIsReported) {
  hv_.Define("old", WithDevice("old.sock"));
  hv_.Start("old");  // QEMU connected to a tmemd that is gone
  ASSERT_TRUE(manager_->Start().ok());
  EXPECT_TRUE(agent_->HasVm("old"));
  auto st = Find("old");
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(st->attached);
  EXPECT_NE(st->detail.find("does not reconnect"), std::string::npos)
      << st->detail;
}

TEST_F(DomainManagerTest, AttachListensBeforeTheDeviceIsAdded) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Start("web1");
  ASSERT_TRUE(manager_->Start().ok());
  bool listening_at_attach = false;
  hv_.SetAttachHook([&](const std::string& xml) {
    auto dev =
        FindTmemDevice("<domain><devices>" + xml + "</devices></domain>");
    listening_at_attach = dev && Exists(dev->server_path);
  });
  absl::StatusOr<DomainAttachState> s = manager_->Attach("web1", false);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(listening_at_attach);
  EXPECT_TRUE(s->attached);
  EXPECT_FALSE(s->persistent);
  EXPECT_EQ(s->vm, "web1");
  absl::StatusOr<VmInfo> vm = agent_->GetVm("web1");
  ASSERT_TRUE(vm.ok());
  const std::string uuid = hv_.GetDomain("web1")->uuid;
  EXPECT_EQ(vm->socket_path, dir_ + "/" + uuid + ".sock");
  EXPECT_EQ(manager_->Attach("web1", false).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Persistent on top of live: only the config is added.
  s = manager_->Attach("web1", true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->persistent);
  EXPECT_TRUE(FindTmemDevice(hv_.GetXml("web1", true).value()).has_value());
}

TEST_F(DomainManagerTest, AttachErrorsSayWhatToDoAndLeaveNoChannel) {
  FakeHypervisor::Domain no_acpi;
  no_acpi.acpi = false;
  hv_.Define("noacpi", no_acpi);
  hv_.Start("noacpi");
  FakeHypervisor::Domain q35;
  q35.machine = "pc-q35-7.2";
  hv_.Define("q35", q35);
  hv_.Start("q35");
  FakeHypervisor::Domain q35b = q35;
  q35b.pcie_to_pci_bridge = true;
  hv_.Define("q35b", q35b);
  hv_.Start("q35b");
  hv_.Define("off", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());

  EXPECT_EQ(manager_->Attach("nosuch", false).status().code(),
            absl::StatusCode::kNotFound);
  absl::Status s = manager_->Attach("off", false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("not running"), absl::string_view::npos) << s;
  s = manager_->Attach("noacpi", false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("<acpi/>"), absl::string_view::npos) << s;
  s = manager_->Attach("q35", false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("pcie-to-pci-bridge"), absl::string_view::npos)
      << s;
  EXPECT_TRUE(agent_->VmNames().empty());
  EXPECT_TRUE(manager_->List().empty());
  EXPECT_TRUE(manager_->Attach("q35b", false).ok());
  // A stopped domain can get the device in its config for the next start.
  absl::StatusOr<DomainAttachState> off = manager_->Attach("off", true);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->attached);
  EXPECT_TRUE(off->persistent);
  EXPECT_TRUE(agent_->HasVm("off"));
}

TEST_F(DomainManagerTest, DetachAckedByTheGuestReleasesTheChannel) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Start("web1");
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(manager_->Attach("web1", false).ok());
  EXPECT_EQ(PutPages("web1", 5), 5u);
  absl::StatusOr<DomainAttachState> s = manager_->Detach("web1", false);
  ASSERT_TRUE(s.ok()) << s.status();
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("web1"));
  EXPECT_TRUE(manager_->List().empty());
  EXPECT_EQ(manager_->Detach("web1", false).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(DomainManagerTest, DetachTheGuestNeverAcksTimesOutVisibly) {
  FakeHypervisor::Domain d;
  d.guest_acks = false;
  hv_.Define("web1", d);
  hv_.Start("web1");
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(manager_->Attach("web1", false).ok());
  absl::StatusOr<DomainAttachState> s = manager_->Detach("web1", false);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->detail.find("waiting"), std::string::npos) << s->detail;
  EXPECT_TRUE(agent_->HasVm("web1"));  // QEMU still holds the device
  std::this_thread::sleep_for(milliseconds(400));
  auto st = Find("web1");
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(st->attached);
  EXPECT_NE(st->detail.find("timed out"), std::string::npos) << st->detail;
  EXPECT_TRUE(agent_->HasVm("web1"));
  // A late ack still completes the detach.
  hv_.GuestAcks("web1");
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("web1"));
}

TEST_F(DomainManagerTest, StopDropsPagesAndKeepsAnEmptyChannelForNextStart) {
  hv_.Define("web1", WithDevice("web1.sock"));
  ASSERT_TRUE(manager_->Start().ok());
  hv_.Start("web1");
  manager_->Flush();
  EXPECT_EQ(PutPages("web1", 10), 10u);
  hv_.Destroy("web1");
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("web1"));  // recreated for the next start
  EXPECT_TRUE(Exists(dir_ + "/web1.sock"));
  EXPECT_EQ(Pages("web1"), 0u);
  // Crash and migration drop pages the same way.
  hv_.Start("web1");
  PutPages("web1", 3);
  hv_.Destroy("web1", "migrated");
  manager_->Flush();
  EXPECT_EQ(Pages("web1"), 0u);
  // Undefine a stopped domain: the channel goes.
  hv_.Undefine("web1");
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("web1"));
  EXPECT_FALSE(Exists(dir_ + "/web1.sock"));
  EXPECT_TRUE(manager_->List().empty());
}

TEST_F(DomainManagerTest, StopHandledAfterARestartKeepsTheChannel) {
  hv_.Define("web1", WithDevice("web1.sock"));
  hv_.Start("web1");
  ASSERT_TRUE(manager_->Start().ok());
  EXPECT_EQ(PutPages("web1", 3), 3u);
  // virsh destroy; virsh start, faster than tmemd handles STOPPED: the new
  // QEMU may already be on the socket, which must not be unlinked (the
  // channel itself drops the old boot's pools when the new guest starts).
  hv_.EmitRaw(DomainEvent::Kind::kStopped, "web1", "destroyed");
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("web1"));
  EXPECT_EQ(Pages("web1"), 3u);  // the same channel, not a recreated one
}

TEST_F(DomainManagerTest, TransientDomainStopReleasesEverything) {
  FakeHypervisor::Domain d;
  d.persistent = false;
  hv_.Define("t1", d);
  hv_.Start("t1");
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(manager_->Attach("t1", false).ok());
  PutPages("t1", 4);
  hv_.Destroy("t1", "crashed");
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("t1"));
  EXPECT_TRUE(manager_->List().empty());
}

TEST_F(DomainManagerTest, MetadataIsAppliedAndFollowedLive) {
  FakeHypervisor::Domain d = WithDevice("web1.sock");
  d.config_metadata = Meta("<quota>512MiB</quota><weight>200</weight>");
  hv_.Define("web1", d);
  ASSERT_TRUE(manager_->Start().ok());
  EXPECT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{512} << 20);
  EXPECT_EQ(agent_->GetVmPolicy("web1")->weight, 200u);
  hv_.Start("web1");
  ASSERT_TRUE(hv_.SetMetadata("web1",
                              Meta("<quota>64MiB</quota><mode>off</mode>"),
                              true, false)
                  .ok());
  manager_->Flush();
  absl::StatusOr<VmPolicy> p = agent_->GetVmPolicy("web1");
  EXPECT_EQ(p->quota_bytes, uint64_t{64} << 20);
  EXPECT_EQ(p->weight, 100u);  // absent: back to the default
  EXPECT_EQ(agent_->GetVm("web1")->valve.mode,
            ValveMode::kOff);  // the valve keeps modes
  // A gRPC-style change holds until the metadata changes again.
  VmPolicy grpc = *p;
  grpc.quota_bytes = uint64_t{8} << 20;
  ASSERT_TRUE(agent_->SetVmPolicy("web1", grpc).ok());
  hv_.Destroy("web1");  // lifecycle events alone do not reapply...
  manager_->Flush();
  hv_.Start("web1");
  manager_->Flush();
  // ...except that a stop recreates the channel, from metadata.
  EXPECT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{512} << 20);
  ASSERT_TRUE(agent_->SetVmPolicy("web1", grpc).ok());
  hv_.Define("web1", d);  // e.g. virsh edit of something else
  manager_->Flush();
  EXPECT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{8} << 20);
  // Bad metadata keeps the last good policy and says why.
  ASSERT_TRUE(
      hv_.SetMetadata("web1", Meta("<quota>huge</quota>"), true, true).ok());
  manager_->Flush();
  EXPECT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{8} << 20);
  auto st = Find("web1");
  ASSERT_TRUE(st.has_value());
  EXPECT_NE(st->detail.find("quota"), std::string::npos) << st->detail;
}

// Devices are migratable (role='master', QEMU master=on) by
// default, because tmemd is ivshmem peer 1 by default; a peer-0 tmemd (for
// guest drivers older than ABI v2) attaches peer-mode devices, which QEMU
// would otherwise refuse (master=on needs the VM to be peer 0).
TEST_F(DomainManagerTest, DevicesAreMigratableExactlyWhenTmemdIsPeerOne) {
  EXPECT_EQ(agent_->options().host_peer_id, 1);  // the default
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Start("web1");
  ASSERT_TRUE(manager_->Start().ok());
  std::string attached;
  hv_.SetAttachHook([&](const std::string& xml) { attached = xml; });
  ASSERT_TRUE(manager_->Attach("web1", false).ok());
  EXPECT_NE(attached.find("<shmem name='tmem0' role='master'>"),
            std::string::npos)
      << attached;

  tmem::testing::TempDir dir0{"tmemd-dm-peer0"};
  AgentOptions o;
  o.socket_dir = dir0.path();
  o.workers = 1;
  o.run_valve_ticker = false;
  o.host_peer_id = 0;
  absl::StatusOr<std::unique_ptr<Agent>> peer0 = Agent::Create(o);
  ASSERT_TRUE(peer0.ok()) << peer0.status();
  FakeHypervisor hv0;
  hv0.Define("web2", FakeHypervisor::Domain{});
  hv0.Start("web2");
  DomainManager m0(peer0->get(), &hv0, DomainManagerOptions{});
  ASSERT_TRUE(m0.Start().ok());
  hv0.SetAttachHook([&](const std::string& xml) { attached = xml; });
  ASSERT_TRUE(m0.Attach("web2", false).ok());
  EXPECT_EQ(attached.find("role="), std::string::npos) << attached;
  m0.Stop();
}

// A policy set through gRPC is written into the domain's metadata
// (live and persistent, autoattach kept), so it travels with the domain; a
// restarted tmemd applies it from there, over its own state file's value.
TEST_F(DomainManagerTest, PolicyChangesAreWrittenIntoTheDomainMetadata) {
  FakeHypervisor::Domain d = WithDevice("web1.sock");
  d.config_metadata = Meta("<autoattach>true</autoattach><quota>1MiB</quota>");
  hv_.Define("web1", d);
  hv_.Start("web1");
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{1} << 20);
  VmPolicy p = *agent_->GetVmPolicy("web1");
  p.quota_bytes = uint64_t{256} << 20;
  p.weight = 300;
  p.mode = ValveMode::kAlways;
  p.frozen = true;
  // What ControlPlane::SetVmPolicy does: apply, then write back.
  ASSERT_TRUE(agent_->SetVmPolicy("web1", p).ok());
  ASSERT_TRUE(manager_->PolicyChanged("web1", p).ok());
  manager_->Flush();  // the METADATA_CHANGE echo
  for (const bool inactive : {false, true}) {
    absl::StatusOr<std::optional<std::string>> xml =
        hv_.GetMetadata("web1", inactive);
    ASSERT_TRUE(xml.ok() && xml->has_value()) << inactive;
    absl::StatusOr<TmemMetadata> m = ParseTmemMetadata(**xml);
    ASSERT_TRUE(m.ok()) << m.status() << **xml;
    EXPECT_EQ(m->policy.quota_bytes, uint64_t{256} << 20) << **xml;
    EXPECT_EQ(m->policy.weight, 300u);
    EXPECT_EQ(m->policy.mode, ValveMode::kAlways);
    EXPECT_TRUE(m->policy.frozen);
    EXPECT_TRUE(m->autoattach) << "autoattach kept: " << **xml;
  }
  EXPECT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{256} << 20);
  EXPECT_EQ(agent_->GetVmPolicy("web1")->weight, 300u);
  // A VM no domain is served by: nothing to write.
  ASSERT_TRUE(agent_->AddVm("plain", VmPolicy{}).ok());
  EXPECT_TRUE(manager_->PolicyChanged("plain", p).ok());

  // Restart (or arrival on another host): a new agent whose state file says
  // otherwise (a stale weight from an earlier visit) gets the metadata's.
  manager_.reset();
  agent_.reset();
  AgentOptions o;
  o.socket_dir = dir_;
  o.workers = 1;
  o.run_valve_ticker = false;
  absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  agent_ = std::move(*a);
  agent_->SetVmPolicyResolver([](const std::string&, const VmPolicy& asked) {
    VmPolicy stale = asked;
    stale.weight = 5;
    return stale;
  });
  manager_ = std::make_unique<DomainManager>(agent_.get(), &hv_,
                                             DomainManagerOptions{});
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(agent_->HasVm("web1"));
  EXPECT_EQ(agent_->GetVmPolicy("web1")->weight, 300u);
  EXPECT_EQ(agent_->GetVmPolicy("web1")->quota_bytes, uint64_t{256} << 20);
  EXPECT_TRUE(agent_->GetVmPolicy("web1")->frozen);
}

TEST_F(DomainManagerTest, AutoattachOnStartAndWhenSwitchedOn) {
  FakeHypervisor::Domain d;
  d.config_metadata = Meta("<autoattach>true</autoattach><quota>1MiB</quota>");
  hv_.Define("auto", d);
  hv_.Define("later", FakeHypervisor::Domain{});
  hv_.Start("later");
  ASSERT_TRUE(manager_->Start().ok());
  EXPECT_FALSE(agent_->HasVm("auto"));  // not running yet
  hv_.Start("auto");
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("auto"));
  EXPECT_TRUE(FindTmemDevice(hv_.GetXml("auto", false).value()).has_value());
  EXPECT_EQ(agent_->GetVmPolicy("auto")->quota_bytes, uint64_t{1} << 20);
  EXPECT_FALSE(agent_->HasVm("later"));
  // A domain that cannot hot-plug is listed with the reason.
  FakeHypervisor::Domain no_acpi;
  no_acpi.acpi = false;
  no_acpi.config_metadata = Meta("<autoattach>true</autoattach>");
  hv_.Define("noacpi", no_acpi);
  hv_.Start("noacpi");
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("noacpi"));
  auto st = Find("noacpi");
  ASSERT_TRUE(st.has_value());
  EXPECT_NE(st->detail.find("autoattach failed"), std::string::npos)
      << st->detail;
  EXPECT_NE(st->detail.find("<acpi/>"), std::string::npos) << st->detail;
  ASSERT_TRUE(
      hv_.SetMetadata("later", Meta("<autoattach>on</autoattach>"), true, false)
          .ok());
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("later"));
  EXPECT_TRUE(FindTmemDevice(hv_.GetXml("later", false).value()).has_value());
}

TEST_F(DomainManagerTest, ResynchronizesAfterReconnect) {
  hv_.Define("gone", WithDevice("gone.sock"));
  hv_.Define("stays", WithDevice("stays.sock"));
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(agent_->HasVm("gone"));
  hv_.LoseConnection();
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("gone"));  // kept while disconnected
  // Meanwhile (events lost): one domain undefined, one defined.
  hv_.SetQuiet(true);
  hv_.Erase("gone");
  hv_.Define("new", WithDevice("new.sock"));
  hv_.SetQuiet(false);
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("new"));
  hv_.Reconnect();
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("gone"));
  EXPECT_TRUE(agent_->HasVm("stays"));
  EXPECT_TRUE(agent_->HasVm("new"));
}

// tmemd started before libvirtd (ordered before it at boot, or libvirtd
// down): Start succeeds at once; the first connection makes the first sync;
// an attach made while the connection is coming waits for it, and one made
// when it does not come fails UNAVAILABLE.
TEST_F(DomainManagerTest, StartsBeforeLibvirtAndSyncsOnTheFirstConnection) {
  hv_.Define("web1", WithDevice("web1.sock"));
  hv_.Define("web2", FakeHypervisor::Domain{});
  hv_.Start("web2");
  hv_.LoseConnection();  // nobody listens yet: as if never connected
  ASSERT_TRUE(manager_->Start().ok());
  manager_->Flush();
  EXPECT_FALSE(agent_->HasVm("web1"));
  EXPECT_TRUE(manager_->List().empty());
  std::thread later([this] {
    std::this_thread::sleep_for(milliseconds(300));
    hv_.Reconnect();
  });
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<DomainAttachState> s = manager_->Attach("web2", false);
  const auto waited = std::chrono::steady_clock::now() - t0;
  later.join();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->attached);
  EXPECT_GE(waited, milliseconds(250));
  manager_->Flush();
  EXPECT_TRUE(agent_->HasVm("web1"));
  EXPECT_TRUE(agent_->HasVm("web2"));
}

TEST_F(DomainManagerTest, AttachWithoutAConnectionFailsAfterTheWait) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Start("web1");
  DomainManagerOptions mo;
  mo.connect_wait = milliseconds(200);
  manager_ = std::make_unique<DomainManager>(agent_.get(), &hv_, mo);
  hv_.LoseConnection();
  ASSERT_TRUE(manager_->Start().ok());
  absl::StatusOr<DomainAttachState> s = manager_->Attach("web1", false);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  EXPECT_FALSE(agent_->HasVm("web1"));
}

// libvirt 9.0 drops role='master' of an ivshmem-doorbell: a persistent
// attach writes master=on as a <qemu:override> into the definition (and a
// persistent detach takes it out); a live-only attach says that the domain
// cannot migrate until then.
TEST_F(DomainManagerTest, PersistentAttachMakesTheDefinitionMigratable) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Start("web1");
  hv_.Define("live", FakeHypervisor::Domain{});
  hv_.Start("live");
  ASSERT_TRUE(manager_->Start().ok());

  absl::StatusOr<DomainAttachState> s = manager_->Attach("live", false);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->detail.find("not migratable"), std::string::npos) << s->detail;
  EXPECT_EQ(hv_.define_calls(), 0);

  s = manager_->Attach("web1", true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->detail.find("migratable from the next start"), std::string::npos)
      << s->detail;
  const std::string config = hv_.GetXml("web1", true).value();
  EXPECT_TRUE(HasTmemMasterOverride(config)) << config;
  EXPECT_EQ(FindTmemDevice(config)->alias, "ua-tmem0");
  // The live device has the same user alias (what DEVICE_REMOVED names).
  EXPECT_EQ(FindTmemDevice(hv_.GetXml("web1", false).value())->alias,
            "ua-tmem0");

  s = manager_->Detach("web1", true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(HasTmemMasterOverride(hv_.GetXml("web1", true).value()));
  manager_->Flush();
  // The guest acked at once (the fake's default): channel released.
  EXPECT_FALSE(agent_->HasVm("web1"));
}

TEST_F(DomainManagerTest, AFailedOverrideIsReportedAndTheAttachStands) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());
  hv_.SetDefineError("fake: schema says no");
  absl::StatusOr<DomainAttachState> s = manager_->Attach("web1", true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->persistent);
  EXPECT_NE(s->detail.find("not migratable"), std::string::npos) << s->detail;
  EXPECT_NE(s->detail.find("schema says no"), std::string::npos) << s->detail;
  EXPECT_FALSE(HasTmemMasterOverride(hv_.GetXml("web1", true).value()));
}

size_t CountOf(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos;
       at = s.find(what, at + 1)) {
    ++n;
  }
  return n;
}

TEST_F(DomainManagerTest, SwapAttachWritesThePersistentDefinitionOnce) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Start("web1");
  hv_.Define("off", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());
  const std::string sock = dir_ + "/web1.swap.sock";

  absl::StatusOr<DomainAttachState> s = manager_->AttachSwap("web1", 64 << 20);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(SwapDevices(),
            (std::map<std::string, uint64_t>{{"web1", 64 << 20}}));
  EXPECT_TRUE(s->persistent);
  // Running: a reboot inside the guest is not enough.
  EXPECT_NE(s->detail.find("next cold boot"), std::string::npos) << s->detail;
  EXPECT_NE(s->detail.find("reboot inside the guest"), std::string::npos);
  const std::string config = hv_.GetXml("web1", true).value();
  EXPECT_EQ(VhostUserDiskSockets(config), std::vector<std::string>{sock})
      << config;
  EXPECT_NE(config.find("<access mode='shared'/>"), std::string::npos);
  // The running QEMU is not touched.
  EXPECT_TRUE(VhostUserDiskSockets(hv_.GetXml("web1", false).value()).empty());

  // Again: nothing added, nothing redefined.
  const int defines = hv_.define_calls();
  s = manager_->AttachSwap("web1", 64 << 20);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(hv_.define_calls(), defines);
  EXPECT_EQ(CountOf(hv_.GetXml("web1", true).value(), "vhostuser"), 1u);
  EXPECT_NE(s->detail.find("already in"), std::string::npos) << s->detail;

  // A shut-off domain: from its next start.
  s = manager_->AttachSwap("off", 1 << 30);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->detail.find("takes effect when the domain next starts"),
            std::string::npos)
      << s->detail;
}

TEST_F(DomainManagerTest, SwapAttachRefusalsLeaveNoDevice) {
  FakeHypervisor::Domain transient;
  transient.persistent = false;
  transient.active = true;
  hv_.Define("transient", transient);
  hv_.Define("huge", FakeHypervisor::Domain{});
  hv_.Define("schema", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());

  absl::StatusOr<DomainAttachState> s = manager_->AttachSwap("transient", 4096);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("transient"), std::string::npos);
  EXPECT_EQ(manager_->AttachSwap("nosuch", 4096).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(manager_->AttachSwap("huge", 0).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Private hugepages: refused before the device is made.
  hv_.Mutate("huge", [](FakeHypervisor::Domain& d) {
    d.config_memory_backing = "  <memoryBacking><hugepages/></memoryBacking>\n";
  });
  s = manager_->AttachSwap("huge", 4096);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("domain 'huge'"), std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("<hugepages/>"), std::string::npos);

  // libvirt refuses the definition: the device made for it goes again.
  hv_.SetDefineError("fake: schema says no");
  s = manager_->AttachSwap("schema", 4096);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("schema says no"), std::string::npos);
  EXPECT_TRUE(SwapDevices().empty());
}

TEST_F(DomainManagerTest, SwapDetachKeepsADeviceARunningQemuUses) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(manager_->AttachSwap("web1", 4096).ok());
  hv_.Start("web1");  // the cold boot: QEMU has the disk
  ASSERT_EQ(VhostUserDiskSockets(hv_.GetXml("web1", false).value()).size(), 1u);

  absl::StatusOr<DomainAttachState> s = manager_->DetachSwap("web1");
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string config = hv_.GetXml("web1", true).value();
  EXPECT_TRUE(VhostUserDiskSockets(config).empty()) << config;
  // The memoryBacking stays, and the answer says so.
  EXPECT_NE(config.find("<access mode='shared'/>"), std::string::npos);
  EXPECT_NE(s->detail.find("<memoryBacking>"), std::string::npos) << s->detail;
  // QEMU still uses the device: kept.
  EXPECT_TRUE(s->attached);
  EXPECT_EQ(SwapDevices().size(), 1u);
  EXPECT_NE(s->detail.find("keeps serving"), std::string::npos) << s->detail;

  hv_.Destroy("web1");
  s = manager_->DetachSwap("web1");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->attached);
  EXPECT_TRUE(SwapDevices().empty());
}

// A domain whose only tmemd device is its swap device (the Agent serves it,
// as for [swap.NAME] in tmemd's config) takes its metadata's policy, swap
// fields included, and follows the element's changes; a domain with no
// element keeps the VM's own policy; a policy set through gRPC is written
// back into the element.
TEST_F(DomainManagerTest, SwapOnlyDomainTakesTheMetadataPolicy) {
  ASSERT_TRUE(agent_->AddSwapDevice("web1", 1 << 20).ok());
  ASSERT_TRUE(agent_->AddSwapDevice("plain", 1 << 20).ok());
  VmPolicy own;
  own.weight = 33;
  ASSERT_TRUE(agent_->SetVmPolicy("plain", own).ok());
  FakeHypervisor::Domain d;
  d.config_metadata = Meta(
      "<weight>200</weight><swap_quota>8MiB</swap_quota>"
      "<swap_mode>off</swap_mode>");
  hv_.Define("web1", d);
  hv_.Define("plain", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());
  VmPolicy p = agent_->GetVm("web1")->policy;
  EXPECT_EQ(p.weight, 200u);
  EXPECT_EQ(p.swap_quota_bytes, uint64_t{8} << 20);
  EXPECT_EQ(p.swap_mode, ValveMode::kOff);
  EXPECT_EQ(agent_->GetVm("plain")->policy.weight, 33u);
  // Listed (no channel: no VM of a tmem device to name).
  std::optional<DomainAttachState> st = Find("web1");
  ASSERT_TRUE(st.has_value());
  EXPECT_FALSE(st->attached);

  hv_.Start("web1");
  ASSERT_TRUE(hv_.SetMetadata("web1",
                              Meta("<weight>300</weight>"
                                   "<swap_mode>always</swap_mode>"),
                              true, false)
                  .ok());
  manager_->Flush();
  p = agent_->GetVm("web1")->policy;
  EXPECT_EQ(p.weight, 300u);
  EXPECT_EQ(p.swap_quota_bytes, kUnlimitedQuota);  // absent: the default
  EXPECT_EQ(p.swap_mode, ValveMode::kAlways);

  VmPolicy grpc = p;
  grpc.swap_quota_bytes = uint64_t{16} << 20;
  ASSERT_TRUE(manager_->PolicyChanged("web1", grpc).ok());
  absl::StatusOr<std::optional<std::string>> live =
      hv_.GetMetadata("web1", /*inactive=*/false);
  ASSERT_TRUE(live.ok() && live->has_value());
  absl::StatusOr<TmemMetadata> written = ParseTmemMetadata(**live);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->policy.swap_quota_bytes, uint64_t{16} << 20);
  EXPECT_EQ(written->policy.swap_mode, ValveMode::kAlways);
}

// AttachSwap: the new device's VM takes the domain's metadata policy at
// once.
TEST_F(DomainManagerTest, SwapAttachAppliesTheMetadataPolicy) {
  DomainManagerOptions mo;
  mo.add_swap_device = [this](const std::string& vm, uint64_t size) {
    return agent_->AddSwapDevice(vm, size).status();
  };
  mo.remove_swap_device = [this](const std::string& vm) {
    return agent_->RemoveSwapDevice(vm);
  };
  manager_ = std::make_unique<DomainManager>(agent_.get(), &hv_, mo);
  FakeHypervisor::Domain d;
  d.config_metadata = Meta("<quota>32MiB</quota><swap_quota>4MiB</swap_quota>");
  hv_.Define("web1", d);
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(manager_->AttachSwap("web1", 1 << 20).ok());
  const VmPolicy p = agent_->GetVm("web1")->policy;
  EXPECT_EQ(p.quota_bytes, uint64_t{32} << 20);
  EXPECT_EQ(p.swap_quota_bytes, uint64_t{4} << 20);
}

TEST_F(DomainManagerTest, MigrateHookRefusesADomainWithThisTmemdsSwapDevice) {
  hv_.Define("web1", FakeHypervisor::Domain{});
  hv_.Define("plain", FakeHypervisor::Domain{});
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(manager_->AttachSwap("web1", 4096).ok());
  // The hook gets the XML libvirt migrates (the source's).
  absl::StatusOr<DomainAttachState> s =
      manager_->MigrateFromHook(hv_.GetXml("web1", true).value());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("domain 'web1'"), std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find(dir_ + "/web1.swap.sock"),
            std::string::npos);
  s = manager_->MigrateFromHook(hv_.GetXml("plain", true).value());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->domain, "plain");
}

}  // namespace
}  // namespace tmem
