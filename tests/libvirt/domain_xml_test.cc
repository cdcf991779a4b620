// The domain XML scanner: the tmem device, hotplug checks, metadata.
#include "host-agent/libvirt/domain_xml.h"

#include <gtest/gtest.h>

#include <string>

namespace tmem {
namespace {

TEST(DomainXmlTest, ShmemXmlRoundTrips) {
  const std::string xml = TmemShmemXml("/run/tmemd/a'b.sock", 2);
  EXPECT_NE(xml.find("<model type='ivshmem-doorbell'/>"), std::string::npos);
  EXPECT_NE(xml.find("vectors='2' ioeventfd='on'"), std::string::npos);
  auto dev = FindTmemDevice("<domain><devices>" + xml + "</devices></domain>");
  ASSERT_TRUE(dev.has_value());
  EXPECT_EQ(dev->server_path, "/run/tmemd/a'b.sock");
}

// Migratable: role='master' says so in libvirt's terms, but libvirt 9.0
// does not pass it to QEMU for ivshmem-doorbell; the user alias lets a
// <qemu:override> set master=on (below), without which QEMU 7.2 blocks
// migration ("peer mode").
TEST(DomainXmlTest, MasterRoleForMigratableDevices) {
  const std::string master = TmemShmemXml("/run/tmemd/a.sock", 1);  // default
  EXPECT_NE(master.find("<shmem name='tmem0' role='master'>"),
            std::string::npos)
      << master;
  auto dev =
      FindTmemDevice("<domain><devices>" + master + "</devices></domain>");
  ASSERT_TRUE(dev.has_value());
  EXPECT_EQ(dev->server_path, "/run/tmemd/a.sock");
  EXPECT_EQ(dev->alias, "ua-tmem0");
  EXPECT_EQ(TmemShmemXml("/run/tmemd/a.sock", 1, false).find("role="),
            std::string::npos);
  EXPECT_EQ(TmemShmemXml("/run/tmemd/a.sock", 1, false).find("<alias"),
            std::string::npos);
}

// The persistent definition as libvirt writes it, with and without other
// QEMU-namespace content.
constexpr char kPlainDomain[] = R"(<domain type='kvm'>
  <name>web1</name>
  <devices>
    <shmem name='tmem0' role='master'><model type='ivshmem-doorbell'/><alias name='ua-tmem0'/></shmem>
  </devices>
</domain>
)";

TEST(DomainXmlTest, MasterOverrideIsAddedOnceAndRemovedAgain) {
  EXPECT_FALSE(HasTmemMasterOverride(kPlainDomain));
  absl::StatusOr<std::string> with = WithTmemMasterOverride(kPlainDomain);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_TRUE(HasTmemMasterOverride(*with)) << *with;
  EXPECT_NE(with->find("<domain type='kvm' xmlns:qemu='"
                       "http://libvirt.org/schemas/domain/qemu/1.0'>"),
            std::string::npos)
      << *with;
  // The override after the devices, inside <domain>.
  EXPECT_LT(with->find("</devices>"), with->find("<qemu:override>"));
  EXPECT_LT(with->find("</qemu:override>"), with->find("</domain>"));
  absl::StatusOr<std::string> again = WithTmemMasterOverride(*with);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *with);
  const std::string without = WithoutTmemMasterOverride(*with);
  EXPECT_FALSE(HasTmemMasterOverride(without));
  EXPECT_EQ(without.find("qemu:override"), std::string::npos) << without;
  EXPECT_EQ(WithoutTmemMasterOverride(kPlainDomain), kPlainDomain);
}

TEST(DomainXmlTest, MasterOverrideKeepsTheOperatorsQemuXml) {
  const std::string xml =
      R"(<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>web1</name>
  <qemu:commandline>
    <qemu:arg value='-trace'/>
  </qemu:commandline>
  <qemu:override>
    <qemu:device alias='ua-net0'>
      <qemu:frontend>
        <qemu:property name='x-txburst' type='unsigned' value='64'/>
      </qemu:frontend>
    </qemu:device>
  </qemu:override>
</domain>
)";
  absl::StatusOr<std::string> with = WithTmemMasterOverride(xml);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_TRUE(HasTmemMasterOverride(*with));
  // One override element, one namespace declaration, theirs kept.
  EXPECT_EQ(with->find("<qemu:override>"), with->rfind("<qemu:override>"));
  EXPECT_EQ(with->find("xmlns:qemu"), with->rfind("xmlns:qemu"));
  EXPECT_NE(with->find("x-txburst"), std::string::npos);
  EXPECT_NE(with->find("<qemu:arg value='-trace'/>"), std::string::npos);
  const std::string without = WithoutTmemMasterOverride(*with);
  EXPECT_EQ(without, xml);
}

TEST(DomainXmlTest, MasterOverrideRefusesWhatItWouldHaveToRewrite) {
  // Prefix qemu bound to something else.
  EXPECT_EQ(WithTmemMasterOverride(
                "<domain type='kvm' xmlns:qemu='urn:other'><name>a</name>"
                "</domain>")
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // The operator overrides ua-tmem0 already, without master=on.
  const std::string theirs =
      "<domain type='kvm' "
      "xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'><name>a</name>"
      "<qemu:override><qemu:device alias='ua-tmem0'><qemu:frontend>"
      "<qemu:property name='master' type='string' value='off'/>"
      "</qemu:frontend></qemu:device></qemu:override></domain>";
  EXPECT_FALSE(HasTmemMasterOverride(theirs));
  absl::StatusOr<std::string> r = WithTmemMasterOverride(theirs);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("by hand"), std::string::npos);
  EXPECT_EQ(WithTmemMasterOverride("<nothing/>").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DomainXmlTest, FindsOnlyTheTmemShmemWithItsAlias) {
  const std::string xml = R"(<domain type="qemu"><name>web1</name>
    <uuid>c7a5fdbd-edaf-9455-926a-d65c16db1809</uuid><devices>
    <shmem name="other"><model type="ivshmem-plain"/><size unit="M">4</size></shmem>
    <shmem name="tmem0">
      <model type="ivshmem-doorbell"/>
      <server path="/run/tmemd/x.sock"/>
      <msi vectors="1" ioeventfd="on"/>
      <alias name="shmem1"/>
      <address type="pci" domain="0x0000" bus="0x00" slot="0x05"/>
    </shmem></devices></domain>)";
  auto dev = FindTmemDevice(xml);
  ASSERT_TRUE(dev.has_value());
  EXPECT_EQ(dev->server_path, "/run/tmemd/x.sock");
  EXPECT_EQ(dev->alias, "shmem1");
  EXPECT_EQ(DomainXmlElement(xml, "name"), "web1");
  EXPECT_EQ(DomainXmlElement(xml, "uuid"),
            "c7a5fdbd-edaf-9455-926a-d65c16db1809");
  EXPECT_FALSE(FindTmemDevice("<domain><devices><shmem name='tmem01'/>"
                              "</devices></domain>")
                   .has_value());
}

// A domain's <metadata> holds whatever its owner wrote: a look-alike shmem
// there (in its own namespace, as libvirt requires) must not choose the
// socket tmemd makes for that domain -- it could name another VM's.
TEST(DomainXmlTest, NamespacedShmemInMetadataIsNotTheDevice) {
  const std::string meta = R"(<domain type='qemu'><name>attacker</name>
    <uuid>11111111-2222-3333-4444-555555555555</uuid>
    <metadata><x:shmem xmlns:x="https://evil.example/x" name="tmem0">
      <x:model type="ivshmem-doorbell"/>
      <x:server path="/run/tmemd/victim.sock"/></x:shmem></metadata>
    <devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices>
    </domain>)";
  EXPECT_FALSE(FindTmemDevice(meta).has_value());
  // The same with the real device as well: the device's path, not the
  // metadata's, in either order.
  const std::string both = R"(<domain type='qemu'><name>a</name>
    <metadata><x:shmem xmlns:x="https://evil.example/x" name="tmem0">
      <x:server path="/run/tmemd/victim.sock"/></x:shmem></metadata>
    <devices><shmem name='tmem0'><model type='ivshmem-doorbell'/>
      <server path='/run/tmemd/a.sock'/></shmem></devices></domain>)";
  auto dev = FindTmemDevice(both);
  ASSERT_TRUE(dev.has_value());
  EXPECT_EQ(dev->server_path, "/run/tmemd/a.sock");
  // No prefix but a default namespace of its own: still not libvirt's.
  EXPECT_FALSE(FindTmemDevice(R"(<domain><metadata><shmem xmlns="https://e/x"
      name="tmem0"><server path="/run/tmemd/victim.sock"/></shmem></metadata>
      <devices/></domain>)")
                   .has_value());
  // A <name> in metadata does not rename the domain.
  EXPECT_EQ(
      DomainXmlElement(R"(<domain><metadata><x:name xmlns:x="u">victim</x:name>
      </metadata><name>attacker</name></domain>)",
                       "name"),
      "attacker");
}

TEST(DomainXmlTest, ShmemOutsideDomainDevicesIsNotTheDevice) {
  const std::string dev =
      "<shmem name='tmem0'><model type='ivshmem-doorbell'/>"
      "<server path='/run/tmemd/victim.sock'/></shmem>";
  // Directly under <domain>, nested a level deeper, in a namespaced
  // <devices>, in a second document root, under a root that is not
  // <domain>, inside a comment or CDATA: none is the device.
  for (const std::string& xml : {
           "<domain><name>a</name>" + dev + "<devices/></domain>",
           "<domain><devices><hub>" + dev + "</hub></devices></domain>",
           "<domain><q:devices xmlns:q='u'>" + dev + "</q:devices></domain>",
           "<domain><devices/></domain><domain><devices>" + dev +
               "</devices></domain>",
           "<other><devices>" + dev + "</devices></other>",
           "<domain><devices><!-- " + dev + " --></devices></domain>",
           "<domain><devices><![CDATA[" + dev + "]]></devices></domain>",
           "<domain><devices>" + dev.substr(0, dev.size() - 3),
       }) {
    EXPECT_FALSE(FindTmemDevice(xml).has_value()) << xml;
  }
  // Where it belongs, after a prolog, comments and a '>' in an attribute.
  auto d = FindTmemDevice(
      "<?xml version='1.0'?><!-- c --><domain type='kvm'><description a='x>y'>"
      "</description><devices><!-- <shmem name='tmem0'/> -->" +
      dev + "</devices></domain>");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->server_path, "/run/tmemd/victim.sock");
}

TEST(DomainXmlTest, HotplugNeedsAcpiOnPcAndABridgeOnQ35) {
  const std::string pc_acpi =
      "<domain><os><type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type>"
      "</os><features><acpi/><apic/></features><devices/></domain>";
  EXPECT_TRUE(CheckPciHotplug(pc_acpi).ok());
  const std::string pc_no_acpi =
      "<domain><os><type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type>"
      "</os><features><apic/></features><devices/></domain>";
  absl::Status s = CheckPciHotplug(pc_no_acpi);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("<acpi/>"), absl::string_view::npos) << s;
  const std::string q35 =
      "<domain><os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>"
      "<features><acpi/></features><devices><controller type='pci' "
      "index='0' model='pcie-root'/></devices></domain>";
  s = CheckPciHotplug(q35);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("pcie-to-pci-bridge"), absl::string_view::npos)
      << s;
  const std::string q35_bridge =
      "<domain><os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>"
      "<features><acpi/></features><devices><controller type='pci' "
      "index='1' model='pcie-to-pci-bridge'><model name='pcie-pci-bridge'/>"
      "</controller></devices></domain>";
  EXPECT_TRUE(CheckPciHotplug(q35_bridge).ok());
}

TEST(DomainXmlTest, ParsesMetadataWithAnyPrefix) {
  absl::StatusOr<TmemMetadata> m = ParseTmemMetadata(
      R"(<tmem:tmem xmlns:tmem="https://tmemd.dev/xmlns/tmem/1">
           <tmem:enabled>true</tmem:enabled>
           <tmem:quota>512MiB</tmem:quota>
           <!-- operator note -->
           <tmem:weight>200</tmem:weight>
           <tmem:mode>always</tmem:mode>
           <tmem:frozen>no</tmem:frozen>
           <tmem:autoattach>yes</tmem:autoattach>
         </tmem:tmem>)");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->policy.quota_bytes, uint64_t{512} << 20);
  EXPECT_EQ(m->policy.weight, 200u);
  EXPECT_EQ(m->policy.mode, ValveMode::kAlways);
  EXPECT_TRUE(m->policy.enabled);
  EXPECT_FALSE(m->policy.frozen);
  EXPECT_TRUE(m->autoattach);
  // What virDomainGetMetadata returns: the default namespace, no prefix.
  m = ParseTmemMetadata(
      "<tmem xmlns=\"https://tmemd.dev/xmlns/tmem/1\"><quota>1GiB</quota>"
      "<enabled>false</enabled></tmem>");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->policy.quota_bytes, uint64_t{1} << 30);
  EXPECT_FALSE(m->policy.enabled);
  EXPECT_EQ(m->policy.weight, 100u);
  EXPECT_FALSE(m->autoattach);
  m = ParseTmemMetadata("<tmem/>");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->policy.quota_bytes, kUnlimitedQuota);
}

TEST(DomainXmlTest, RejectsBadMetadataNamingTheElement) {
  for (const char* bad :
       {"<tmem><quota>lots</quota></tmem>", "<tmem><weight>0</weight></tmem>",
        "<tmem><mode>fast</mode></tmem>",
        "<tmem><enabled>maybe</enabled></tmem>",
        "<tmem><qouta>1MiB</qouta></tmem>", "<other/>"}) {
    absl::StatusOr<TmemMetadata> m = ParseTmemMetadata(bad);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ParseTmemMetadata("<tmem><qouta>1</qouta></tmem>")
                .status()
                .message()
                .find("qouta"),
            absl::string_view::npos);
}

TEST(DomainXmlTest, FormatParsesBack) {
  TmemMetadata m;
  m.policy.quota_bytes = 12345;
  m.policy.weight = 7;
  m.policy.enabled = false;
  m.policy.frozen = true;
  m.policy.mode = ValveMode::kOff;
  m.autoattach = true;
  absl::StatusOr<TmemMetadata> back = ParseTmemMetadata(FormatTmemMetadata(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->policy.quota_bytes, 12345u);
  EXPECT_EQ(back->policy.weight, 7u);
  EXPECT_FALSE(back->policy.enabled);
  EXPECT_TRUE(back->policy.frozen);
  EXPECT_EQ(back->policy.mode, ValveMode::kOff);
  EXPECT_TRUE(back->autoattach);
  back = ParseTmemMetadata(FormatTmemMetadata(TmemMetadata{}));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->policy.quota_bytes, kUnlimitedQuota);
}

}  // namespace
}  // namespace tmem
