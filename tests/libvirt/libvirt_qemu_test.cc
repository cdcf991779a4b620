// The libvirt glue against a real libvirtd (qemu:///system) and real QEMU
// TCG domains. The domains have no disk and no OS: SeaBIOS finds nothing to
// boot and loops, which is all QEMU needs to realize the ivshmem-doorbell
// device and connect to tmemd's socket -- and, with no OS to handle the
// ACPI unplug request, a detach is never acked.
//
// libvirtd comes from scripts/start-libvirtd.sh (scripts/test.sh runs it
// before ctest; the suite runs it again, it is idempotent) with libvirt's
// default qemu.conf: QEMU runs as libvirt-qemu (checked in every test that
// starts one), dynamic ownership on. tmemd's sockets reach it through their
// group (socket_group.h): the socket directory is 0750 in that group. If
// libvirtd cannot run at all, every test skips saying why. Domains are named
// tmemd-test-<pid>-*, and removed (destroy + undefine) after each test and
// before the suite, failed or not.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "host-agent/agent.h"
#include "host-agent/channel/socket_group.h"
#include "host-agent/control/control_plane.h"
#include "host-agent/control/policy_store.h"
#include "host-agent/libvirt/domain_manager.h"
#include "host-agent/libvirt/domain_xml.h"
#include "host-agent/libvirt/libvirt_hypervisor.h"
#include "host-agent/log.h"
#include "tests/libvirt/libvirt_test_support.h"
#include "tests/temp_dir.h"
#include "tests/test_pages.h"

namespace tmem {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;
constexpr char kUri[] = "qemu:///system";
constexpr milliseconds kTimeout{20000};

std::string libvirtd_problem;  // why libvirtd cannot run; empty if it can

double Seconds(steady_clock::time_point since) {
  return std::chrono::duration<double>(steady_clock::now() - since).count();
}

// The real and effective uid of the QEMU libvirt runs for `domain` (from
// libvirt's pid file and /proc), or -1.
long QemuUid(const std::string& domain) {
  std::ifstream pidfile("/run/libvirt/qemu/" + domain + ".pid");
  long pid = 0;
  if (!(pidfile >> pid) || pid <= 0) return -1;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Uid:", 0) == 0) return std::stol(line.substr(4));
  }
  return -1;
}

class LibvirtQemuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string script =
        std::string(TMEM_SOURCE_DIR) + "/scripts/start-libvirtd.sh";
    // NOLINTNEXTLINE(concurrency-mt-unsafe): before any test thread
    const int rc = std::system(script.c_str());
    if (rc != 0) {
      libvirtd_problem = absl::StrCat(
          script, " failed (exit ", rc,
          "): libvirtd cannot run here, so the qemu:///system tests cannot");
    }
  }

  void SetUp() override {
    if (!libvirtd_problem.empty()) GTEST_SKIP() << libvirtd_problem;
    if (access("/usr/bin/qemu-system-x86_64", X_OK) != 0) {
      GTEST_SKIP() << "qemu-system-x86_64 is not installed";
    }
    ASSERT_FALSE(dir_.empty()) << "mkdtemp failed";
    // What tmemd does with its socket directory: the default group (Debian
    // libvirt's QEMU group) may search it, nobody else.
    absl::StatusOr<SocketGroupChoice> group = ChooseSocketGroup(std::nullopt);
    ASSERT_TRUE(group.ok()) << group.status();
    ASSERT_TRUE(group->gid.has_value()) << "no group for QEMU: " << group->note;
    qemu_gid_ = *group->gid;
    ASSERT_EQ(chown(dir_.c_str(), static_cast<uid_t>(-1), qemu_gid_), 0);
    ASSERT_EQ(chmod(dir_.c_str(), 0750), 0);
    ASSERT_TRUE(CheckGroupCanReach(dir_, qemu_gid_).ok());
    AgentOptions o;
    o.socket_dir = dir_;
    o.socket_gid = qemu_gid_;
    o.workers = 1;
    o.run_valve_ticker = false;
    auto a = Agent::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = std::move(*a);
    LibvirtOptions lo;
    lo.uri = kUri;
    lo.max_backoff = milliseconds(500);
    auto hv = LibvirtHypervisor::Connect(lo);
    ASSERT_TRUE(hv.ok()) << hv.status();
    hv_ = std::move(*hv);
    raw_ = std::make_unique<RawConnection>(kUri);
    ASSERT_NE(raw_->get(), nullptr) << VirError();
    RemoveOurDomains();
    DomainManagerOptions mo;
    mo.detach_timeout = milliseconds(2000);
    manager_ = std::make_unique<DomainManager>(agent_.get(), hv_.get(), mo);
    ASSERT_TRUE(manager_->Start().ok());
  }

  void TearDown() override {
    if (raw_) RemoveOurDomains();
    manager_.reset();
    hv_.reset();
    raw_.reset();
    agent_.reset();
  }

  // Every tmemd-test-* domain, including leftovers of crashed runs.
  void RemoveOurDomains() {
    virDomainPtr* doms = nullptr;
    const int n = virConnectListAllDomains(raw_->get(), &doms, 0);
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) {
      const std::string name = virDomainGetName(doms[i]);
      if (name.rfind("tmemd-test-", 0) == 0) names.push_back(name);
      virDomainFree(doms[i]);
    }
    free(doms);  // NOLINT(cppcoreguidelines-no-malloc)
    for (const std::string& name : names) raw_->Remove(name);
  }

  std::string Name(const std::string& what) const {
    return absl::StrCat("tmemd-test-", getpid(), "-", what);
  }

  // A diskless TCG domain; `device_sock` non-empty: with the tmem device in
  // its config.
  std::string DomainXml(const std::string& name, bool acpi,
                        const std::string& device_sock = "") const {
    return absl::StrCat(
        "<domain type='qemu'><name>", name,
        "</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>"
        "<os><type arch='x86_64' machine='pc'>hvm</type></os>"
        "<features>",
        acpi ? "<acpi/>" : "",
        "</features><on_poweroff>destroy</on_poweroff>"
        "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator>"
        "<memballoon model='none'/>",
        device_sock.empty() ? "" : TmemShmemXml(device_sock, 1),
        "</devices></domain>");
  }

  void DefineAndStart(const std::string& name, bool acpi,
                      const std::string& device_sock = "") {
    std::string err;
    ASSERT_TRUE(raw_->Define(DomainXml(name, acpi, device_sock), &err)) << err;
    ASSERT_TRUE(raw_->With(name, virDomainCreate, &err)) << err;
  }

  bool Connected(const std::string& vm) {
    auto info = agent_->GetVm(vm);
    return info.ok() && info->connected;
  }
  std::optional<DomainAttachState> Find(const std::string& domain) {
    for (const DomainAttachState& s : manager_->List()) {
      if (s.domain == domain) return s;
    }
    return std::nullopt;
  }

  // QEMU runs unprivileged and reached the socket through its group.
  void ExpectUnprivilegedQemu(const std::string& domain) {
    const long uid = QemuUid(domain);
    EXPECT_GT(uid, 0) << "QEMU of " << domain
                      << " runs as root (or was not found): the tests must "
                         "run with libvirt's default qemu.conf";
    struct stat st {};
    ASSERT_EQ(stat(agent_->GetVm(domain)->socket_path.c_str(), &st), 0);
    // tmemd's, as tmemd made it: dynamic ownership did not relabel it.
    EXPECT_EQ(st.st_uid, geteuid());
    EXPECT_EQ(st.st_gid, qemu_gid_);
    EXPECT_EQ(st.st_mode & 07777, 0660u);
  }

  tmem::testing::TempDir tmp_{"tmemd-lvq"};
  std::string dir_ = tmp_.path();
  gid_t qemu_gid_ = 0;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<LibvirtHypervisor> hv_;
  std::unique_ptr<RawConnection> raw_;
  std::unique_ptr<DomainManager> manager_;
};

TEST_F(LibvirtQemuTest,
       AttachConnectsQemuMetadataAppliesDetachTimesOutDestroyFrees) {
  const std::string name = Name("attach");
  DefineAndStart(name, /*acpi=*/true);

  auto t0 = steady_clock::now();
  absl::StatusOr<DomainAttachState> s = manager_->Attach(name, false);
  ASSERT_TRUE(s.ok()) << s.status();
  const double attach_s = Seconds(t0);
  EXPECT_TRUE(s->attached);
  ASSERT_EQ(s->vm, name);
  ASSERT_TRUE(WaitFor([&] { return Connected(name); }, kTimeout))
      << "QEMU never connected to tmemd's socket";
  ExpectUnprivilegedQemu(name);
  Log(LogLevel::kInfo, "test_timing",
      {{"attach_s", attach_s}, {"connected_s", Seconds(t0)}});
  std::string live;
  ASSERT_TRUE(raw_->With(name, [&](virDomainPtr d) {
    char* xml = virDomainGetXMLDesc(d, 0);
    if (xml == nullptr) return -1;
    live = xml;
    free(xml);  // NOLINT(cppcoreguidelines-no-malloc)
    return 0;
  }));
  auto dev = FindTmemDevice(live);
  ASSERT_TRUE(dev.has_value()) << live;
  EXPECT_EQ(dev->server_path, agent_->GetVm(name)->socket_path);
  EXPECT_FALSE(dev->alias.empty());

  // A metadata quota change reaches the backend.
  std::string err;
  ASSERT_TRUE(raw_->With(
      name,
      [](virDomainPtr d) {
        return virDomainSetMetadata(
            d, VIR_DOMAIN_METADATA_ELEMENT,
            "<tmem><quota>128MiB</quota><weight>50</weight></tmem>", "tmem",
            "https://tmemd.dev/xmlns/tmem/1", VIR_DOMAIN_AFFECT_LIVE);
      },
      &err))
      << err;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto p = agent_->GetVmPolicy(name);
        return p.ok() && p->quota_bytes == uint64_t{128} << 20;
      },
      kTimeout));
  EXPECT_EQ(agent_->GetVmPolicy(name)->weight, 50u);

  // Some pages, to see them freed.
  {
    TmemStore& store = agent_->store();
    const VmId id = store.FindVm(name).value();
    const PoolId pool = store.NewPool(id, nullptr).value();
    for (int i = 0; i < 8; ++i) {
      const test::Page page = test::TextPage(i);
      ASSERT_TRUE(store.Put(id, pool, ObjectId{}, i, ConstPage(page)).ok());
    }
  }
  EXPECT_EQ(
      agent_->Status().store.counters[static_cast<int>(Counter::kPagesHeld)],
      8u);

  // Detach: no OS to ack the ACPI unplug, so it times out, visibly.
  t0 = steady_clock::now();
  s = manager_->Detach(name, false);
  ASSERT_TRUE(s.ok()) << s.status();
  const double detach_call_s = Seconds(t0);
  EXPECT_NE(s->detail.find("waiting"), std::string::npos) << s->detail;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto st = Find(name);
        return st && st->detail.find("timed out") != std::string::npos;
      },
      kTimeout));
  Log(LogLevel::kInfo, "test_timing",
      {{"detach_call_s", detach_call_s}, {"timed_out_s", Seconds(t0)}});
  EXPECT_TRUE(agent_->HasVm(name));  // QEMU still holds the device
  EXPECT_TRUE(Find(name)->attached);

  // Destroy: QEMU is gone, so channel and pages go.
  ASSERT_TRUE(raw_->With(name, virDomainDestroy, &err)) << err;
  // (Agent::RemoveVm unlists the VM before it drops the pages: wait for both.)
  EXPECT_TRUE(WaitFor(
      [&] {
        return !agent_->HasVm(name) &&
               agent_->Status()
                       .store.counters[static_cast<int>(Counter::kPagesHeld)] ==
                   0;
      },
      kTimeout));
  EXPECT_FALSE(Find(name).has_value());
}

TEST_F(LibvirtQemuTest, AttachToPcWithoutAcpiSaysHowToFixIt) {
  const std::string name = Name("noacpi");
  DefineAndStart(name, /*acpi=*/false);
  absl::StatusOr<DomainAttachState> s = manager_->Attach(name, false);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("<acpi/>"), absl::string_view::npos)
      << s.status();
  EXPECT_FALSE(agent_->HasVm(name));
}

TEST_F(LibvirtQemuTest, PersistentDeviceListensBeforeStartAndAgainAfterStop) {
  const std::string name = Name("persist");
  const std::string sock = dir_ + "/persist.sock";
  std::string err;
  ASSERT_TRUE(raw_->Define(DomainXml(name, true, sock), &err)) << err;
  ASSERT_TRUE(WaitFor([&] { return agent_->HasVm(name); }, kTimeout));
  // QEMU fails to start if the socket does not listen: this start works.
  ASSERT_TRUE(raw_->With(name, virDomainCreate, &err)) << err;
  ASSERT_TRUE(WaitFor([&] { return Connected(name); }, kTimeout));
  ExpectUnprivilegedQemu(name);
  // Dynamic ownership did not take the socket away from tmemd's group.
  ASSERT_TRUE(raw_->With(name, virDomainDestroy, &err)) << err;
  // Released and recreated empty (once the STOPPED event is handled), so a
  // second start works too.
  ASSERT_TRUE(WaitFor(
      [&] {
        auto st = Find(name);
        return st && st->detail.find("stopped") != std::string::npos &&
               agent_->HasVm(name) && !Connected(name);
      },
      kTimeout));
  ASSERT_TRUE(raw_->With(name, virDomainCreate, &err)) << err;
  ASSERT_TRUE(WaitFor([&] { return Connected(name); }, kTimeout));
}

// A policy set through the control plane (what the gRPC
// SetVmPolicy calls) lands in the domain's tmemd metadata, live and
// persistent, in libvirtd itself; a tmemd started afresh (new agent, empty
// state file) applies it from there, as a migration destination would.
TEST_F(LibvirtQemuTest, PolicySetOverTheControlPlaneIsWrittenIntoMetadata) {
  const std::string name = Name("policy");
  std::string err;
  ASSERT_TRUE(raw_->Define(DomainXml(name, true, dir_ + "/policy.sock"), &err))
      << err;
  // The socket listens once tmemd has handled DEFINED.
  ASSERT_TRUE(WaitFor([&] { return agent_->HasVm(name); }, kTimeout));
  ASSERT_TRUE(raw_->With(name, virDomainCreate, &err)) << err;
  ASSERT_TRUE(WaitFor([&] { return Connected(name); }, kTimeout));
  ExpectUnprivilegedQemu(name);
  {
    absl::StatusOr<std::unique_ptr<PolicyStore>> policies =
        PolicyStore::Open(dir_ + "/state.json");
    ASSERT_TRUE(policies.ok()) << policies.status();
    ControlPlane control(agent_.get(), policies->get(), manager_.get());
    v1::SetVmPolicyRequest r;
    r.set_vm(name);
    r.set_quota_bytes(uint64_t{96} << 20);
    r.set_weight(250);
    r.set_mode(v1::MODE_ALWAYS);
    absl::StatusOr<v1::SetVmPolicyResponse> resp = control.SetVmPolicy(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
  }
  for (const unsigned flags :
       {unsigned{VIR_DOMAIN_AFFECT_LIVE}, unsigned{VIR_DOMAIN_AFFECT_CONFIG}}) {
    std::string xml;
    ASSERT_TRUE(raw_->With(
        name,
        [&](virDomainPtr d) {
          char* m = virDomainGetMetadata(d, VIR_DOMAIN_METADATA_ELEMENT,
                                         std::string(kTmemMetadataUri).c_str(),
                                         flags);
          if (m == nullptr) return -1;
          xml = m;
          free(m);  // NOLINT(cppcoreguidelines-no-malloc)
          return 0;
        },
        &err))
        << "flags " << flags << ": " << err;
    absl::StatusOr<TmemMetadata> m = ParseTmemMetadata(xml);
    ASSERT_TRUE(m.ok()) << m.status() << " " << xml;
    EXPECT_EQ(m->policy.quota_bytes, uint64_t{96} << 20) << xml;
    EXPECT_EQ(m->policy.weight, 250u) << xml;
    EXPECT_EQ(m->policy.mode, ValveMode::kAlways) << xml;
  }
  // The echo (METADATA_CHANGE) changes nothing.
  manager_->Flush();
  EXPECT_EQ(agent_->GetVmPolicy(name)->weight, 250u);

  // A fresh tmemd: new agent, manager and libvirt connection, no state.
  manager_.reset();
  hv_.reset();
  agent_.reset();
  AgentOptions o;
  o.socket_dir = dir_;
  o.socket_gid = qemu_gid_;
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
  manager_ = std::make_unique<DomainManager>(agent_.get(), hv_.get(),
                                             DomainManagerOptions{});
  ASSERT_TRUE(manager_->Start().ok());
  ASSERT_TRUE(agent_->HasVm(name));
  absl::StatusOr<VmPolicy> p = agent_->GetVmPolicy(name);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->quota_bytes, uint64_t{96} << 20);
  EXPECT_EQ(p->weight, 250u);
  EXPECT_EQ(agent_->GetVm(name)->valve.mode, ValveMode::kAlways);
}

TEST_F(LibvirtQemuTest, ReconnectsAfterLibvirtdRestarts) {
  const std::string script =
      std::string(TMEM_SOURCE_DIR) + "/scripts/start-libvirtd.sh --restart";
  const auto t0 = steady_clock::now();
  // NOLINTNEXTLINE(concurrency-mt-unsafe): tests do not call getenv/system
  ASSERT_EQ(std::system(script.c_str()), 0);
  ASSERT_TRUE(WaitFor([&] { return hv_->reconnects() >= 1; }, kTimeout))
      << "tmemd did not reconnect to the restarted libvirtd";
  EXPECT_TRUE(hv_->Connected());
  Log(LogLevel::kInfo, "test_timing", {{"reconnected_s", Seconds(t0)}});
  // Events flow on the new connection: a defined domain gets its channel.
  raw_ = std::make_unique<RawConnection>(kUri);
  ASSERT_NE(raw_->get(), nullptr) << VirError();
  const std::string name = Name("after-restart");
  std::string err;
  ASSERT_TRUE(raw_->Define(DomainXml(name, true, dir_ + "/ar.sock"), &err))
      << err;
  ASSERT_TRUE(WaitFor([&] { return agent_->HasVm(name); }, kTimeout));
}

}  // namespace
}  // namespace tmem
