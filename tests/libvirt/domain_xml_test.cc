// The domain XML scanner: the tmem device, hotplug checks, metadata.
#include "host-agent/libvirt/domain_xml.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

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

TEST(DomainXmlTest, SwapQuotaAndSwapModeParseAndFormat) {
  absl::StatusOr<TmemMetadata> m = ParseTmemMetadata(
      R"(<tmem:tmem xmlns:tmem="https://tmemd.dev/xmlns/tmem/1">
           <tmem:quota>1GiB</tmem:quota>
           <tmem:swap_quota>256MiB</tmem:swap_quota>
           <tmem:swap_mode>off</tmem:swap_mode>
         </tmem:tmem>)");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->policy.swap_quota_bytes, uint64_t{256} << 20);
  EXPECT_EQ(m->policy.swap_mode, ValveMode::kOff);
  EXPECT_EQ(m->policy.mode, ValveMode::kDefault);  // apart from swap_mode
  for (const char* unlimited : {"unlimited", "0", ""}) {
    m = ParseTmemMetadata(
        absl::StrCat("<tmem><swap_quota>", unlimited, "</swap_quota></tmem>"));
    ASSERT_TRUE(m.ok()) << unlimited << ": " << m.status();
    EXPECT_EQ(m->policy.swap_quota_bytes, kUnlimitedQuota) << unlimited;
  }
  // Absent: unlimited, following the mode.
  m = ParseTmemMetadata("<tmem><mode>always</mode></tmem>");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->policy.swap_quota_bytes, kUnlimitedQuota);
  EXPECT_EQ(m->policy.swap_mode, ValveMode::kDefault);

  TmemMetadata set;
  set.policy.swap_quota_bytes = uint64_t{64} << 20;
  set.policy.swap_mode = ValveMode::kAdaptive;
  absl::StatusOr<TmemMetadata> back =
      ParseTmemMetadata(FormatTmemMetadata(set));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->policy.swap_quota_bytes, uint64_t{64} << 20);
  EXPECT_EQ(back->policy.swap_mode, ValveMode::kAdaptive);
  // Defaults are not written, so a tmemd that predates the swap elements
  // still reads the element of a domain that does not use them.
  const std::string plain = FormatTmemMetadata(TmemMetadata{});
  EXPECT_EQ(plain.find("swap"), std::string::npos) << plain;
}

TEST(DomainXmlTest, BadSwapMetadataNamesTheElement) {
  struct Bad {
    const char* xml;
    const char* reason;
  } bad[] = {
      {"<tmem><swap_quota>lots</swap_quota></tmem>", "<swap_quota>"},
      {"<tmem><swap_quota>2251799813685248</swap_quota></tmem>",
       "<swap_quota>: swap quota (bytes; 0: unlimited) must be in"},
      {"<tmem><swap_mode>fast</swap_mode></tmem>", "<swap_mode>'fast'"},
      {"<tmem><swapquota>1MiB</swapquota></tmem>", "<swapquota>"},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<TmemMetadata> m = ParseTmemMetadata(b.xml);
    ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << b.xml;
    EXPECT_NE(m.status().message().find(b.reason), absl::string_view::npos)
        << b.xml << " -> " << m.status().message();
  }
}

// --- the swap device ------------------------------------------------------

// `virsh dumpxml --inactive` of domains defined on libvirt 9.0 / QEMU 7.2
// (Debian 12): a pc machine with a virtio disk (vda) and an IDE cdrom.
constexpr char kRealPcDomain[] = R"XML(<domain type='qemu'>
  <name>lsw-real1</name>
  <uuid>a323c993-b1c1-40ab-9235-a3ddb4534b3f</uuid>
  <memory unit='KiB'>131072</memory>
  <currentMemory unit='KiB'>131072</currentMemory>
  <vcpu placement='static'>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type>
    <boot dev='hd'/>
  </os>
  <features>
    <acpi/>
  </features>
  <cpu mode='custom' match='exact' check='none'>
    <model fallback='forbid'>qemu64</model>
  </cpu>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/var/lib/libvirt/images/a.img'/>
      <target dev='vda' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0'/>
    </disk>
    <disk type='file' device='cdrom'>
      <driver name='qemu' type='raw'/>
      <source file='/var/lib/libvirt/images/b.iso'/>
      <target dev='hdc' bus='ide'/>
      <readonly/>
      <address type='drive' controller='0' bus='1' target='0' unit='0'/>
    </disk>
    <controller type='usb' index='0' model='piix3-uhci'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x2'/>
    </controller>
    <controller type='pci' index='0' model='pci-root'/>
    <controller type='ide' index='0'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x1'/>
    </controller>
    <input type='mouse' bus='ps2'/>
    <input type='keyboard' bus='ps2'/>
    <audio id='1' type='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
)XML";
// A q35 machine backed by hugepages (private).
constexpr char kRealHugepagesDomain[] = R"XML(<domain type='qemu'>
  <name>lsw-real2</name>
  <uuid>106e3398-03f5-4661-b100-89d377fde0ca</uuid>
  <memory unit='KiB'>131072</memory>
  <currentMemory unit='KiB'>131072</currentMemory>
  <memoryBacking>
    <hugepages/>
  </memoryBacking>
  <vcpu placement='static'>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc-q35-7.2'>hvm</type>
    <boot dev='hd'/>
  </os>
  <cpu mode='custom' match='exact' check='none'>
    <model fallback='forbid'>qemu64</model>
  </cpu>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <controller type='usb' index='0' model='qemu-xhci'>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </controller>
    <controller type='sata' index='0'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x1f' function='0x2'/>
    </controller>
    <controller type='pci' index='0' model='pcie-root'/>
    <controller type='pci' index='1' model='pcie-root-port'>
      <model name='pcie-root-port'/>
      <target chassis='1' port='0x8'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x0' multifunction='on'/>
    </controller>
    <controller type='pci' index='2' model='pcie-root-port'>
      <model name='pcie-root-port'/>
      <target chassis='2' port='0x9'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x1'/>
    </controller>
    <input type='mouse' bus='ps2'/>
    <input type='keyboard' bus='ps2'/>
    <audio id='1' type='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
)XML";
// A domain libvirt accepted with the swap disk and shared memfd memory.
constexpr char kRealSwapDomain[] = R"XML(<domain type='qemu'>
  <name>lsw-real3</name>
  <uuid>26121b20-9c7f-4b71-b46b-36ff96a38854</uuid>
  <memory unit='KiB'>131072</memory>
  <currentMemory unit='KiB'>131072</currentMemory>
  <memoryBacking>
    <source type='memfd'/>
    <access mode='shared'/>
  </memoryBacking>
  <vcpu placement='static'>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type>
    <boot dev='hd'/>
  </os>
  <features>
    <acpi/>
  </features>
  <cpu mode='custom' match='exact' check='none'>
    <model fallback='forbid'>qemu64</model>
  </cpu>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/tmp/lsw/a.img'/>
      <target dev='vda' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0'/>
    </disk>
    <disk type='vhostuser' device='disk' snapshot='no'>
      <driver name='qemu' type='raw'/>
      <source type='unix' path='/run/tmemd/lsw-real3.swap.sock'>
        <reconnect enabled='yes' timeout='1'/>
      </source>
      <target dev='vdb' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x03' function='0x0'/>
    </disk>
    <disk type='file' device='cdrom'>
      <driver name='qemu' type='raw'/>
      <source file='/tmp/lsw/b.iso'/>
      <target dev='hdc' bus='ide'/>
      <readonly/>
      <address type='drive' controller='0' bus='1' target='0' unit='0'/>
    </disk>
    <controller type='usb' index='0' model='piix3-uhci'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x2'/>
    </controller>
    <controller type='pci' index='0' model='pci-root'/>
    <controller type='ide' index='0'>
      <address type='pci' domain='0x0000' bus='0x00' slot='0x01' function='0x1'/>
    </controller>
    <input type='mouse' bus='ps2'/>
    <input type='keyboard' bus='ps2'/>
    <audio id='1' type='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
)XML";

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos;
       at = s.find(what, at + 1)) {
    ++n;
  }
  return n;
}

TEST(SwapDiskXmlTest, SocketPathAndWhatCountsAsTmemdsSwapSocket) {
  EXPECT_EQ(SwapSocketPath("/run/tmemd", "web1"), "/run/tmemd/web1.swap.sock");
  EXPECT_EQ(SwapSocketPath("/run/tmemd/", "web1"), "/run/tmemd/web1.swap.sock");
  EXPECT_TRUE(IsTmemdSwapSocket("/run/tmemd/web1.swap.sock", "/run/tmemd"));
  EXPECT_TRUE(IsTmemdSwapSocket("/run/tmemd/web1.swap.sock", "/run/tmemd/"));
  // Not in the directory itself, another directory, not a swap socket.
  EXPECT_FALSE(IsTmemdSwapSocket("/run/tmemd/x/web1.swap.sock", "/run/tmemd"));
  EXPECT_FALSE(IsTmemdSwapSocket("/run/tmemdx/web1.swap.sock", "/run/tmemd"));
  EXPECT_FALSE(IsTmemdSwapSocket("/var/run/spdk/vhost.0", "/run/tmemd"));
  EXPECT_FALSE(IsTmemdSwapSocket("/run/tmemd/web1.sock", "/run/tmemd"));
  EXPECT_FALSE(IsTmemdSwapSocket("/run/tmemd/.swap.sock", "/run/tmemd"));
}

TEST(SwapDiskXmlTest, AddsDiskAndSharedMemoryToARealDomain) {
  absl::StatusOr<SwapDiskEdit> e =
      WithSwapDisk(kRealPcDomain, "/run/tmemd/lsw-real1.swap.sock");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->disk_added);
  EXPECT_TRUE(e->memory_backing_added);
  // vda is the file disk; hdc (IDE) does not collide with virtio names.
  EXPECT_EQ(e->target_dev, "vdb");
  EXPECT_NE(e->xml.find(SwapDiskXml("/run/tmemd/lsw-real1.swap.sock", "vdb")),
            std::string::npos)
      << e->xml;
  EXPECT_NE(e->xml.find("<reconnect enabled='yes' timeout='1'/>"),
            std::string::npos);
  EXPECT_EQ(VhostUserDiskSockets(e->xml),
            std::vector<std::string>{"/run/tmemd/lsw-real1.swap.sock"});
  // memoryBacking after currentMemory, as libvirt writes it.
  const size_t mb = e->xml.find("<memoryBacking>");
  ASSERT_NE(mb, std::string::npos) << e->xml;
  EXPECT_LT(e->xml.find("</currentMemory>"), mb);
  EXPECT_LT(mb, e->xml.find("<source type='memfd'/>"));
  EXPECT_LT(e->xml.find("<source type='memfd'/>"),
            e->xml.find("<access mode='shared'/>"));
  EXPECT_LT(e->xml.find("<access mode='shared'/>"),
            e->xml.find("</memoryBacking>"));
  EXPECT_LT(e->xml.find("</memoryBacking>"), e->xml.find("<vcpu"));
  // The disk inside <devices>, after the existing disks.
  EXPECT_LT(e->xml.find("/var/lib/libvirt/images/b.iso"),
            e->xml.find("type='vhostuser'"));
  EXPECT_LT(e->xml.find("type='vhostuser'"), e->xml.find("</devices>"));
}

TEST(SwapDiskXmlTest, AttachingTwiceAddsNothing) {
  absl::StatusOr<SwapDiskEdit> once =
      WithSwapDisk(kRealPcDomain, "/run/tmemd/a.swap.sock");
  ASSERT_TRUE(once.ok()) << once.status();
  absl::StatusOr<SwapDiskEdit> twice =
      WithSwapDisk(once->xml, "/run/tmemd/a.swap.sock");
  ASSERT_TRUE(twice.ok()) << twice.status();
  EXPECT_FALSE(twice->changed());
  EXPECT_EQ(twice->xml, once->xml);
  EXPECT_EQ(twice->target_dev, "vdb");
  EXPECT_EQ(Count(twice->xml, "type='vhostuser'"), 1u);
  // libvirt's own rendering of such a domain (address, snapshot='no').
  absl::StatusOr<SwapDiskEdit> real =
      WithSwapDisk(kRealSwapDomain, "/run/tmemd/lsw-real3.swap.sock");
  ASSERT_TRUE(real.ok()) << real.status();
  EXPECT_FALSE(real->changed());
  EXPECT_EQ(real->target_dev, "vdb");
  EXPECT_EQ(real->xml, kRealSwapDomain);
}

TEST(SwapDiskXmlTest, PicksTheVirtioNameAfterTheLastDisk) {
  std::string disks;
  for (char c = 'a'; c <= 'z'; ++c) {
    disks += "<disk type='file' device='disk'><target dev='vd";
    disks += c;
    disks += "' bus='virtio'/></disk>";
  }
  const std::string xml =
      "<domain><name>d</name><devices>" + disks + "</devices></domain>";
  absl::StatusOr<SwapDiskEdit> e = WithSwapDisk(xml, "/run/tmemd/d.swap.sock");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->target_dev, "vdaa");
  // Never in a gap before a system disk: libvirt sorts a bus's disks by
  // name and boots the first (<boot dev='hd'/>).
  absl::StatusOr<SwapDiskEdit> gap = WithSwapDisk(
      "<domain><devices><disk type='file'><target dev='vdc'/></disk>"
      "<disk type='file'><target dev='sda'/></disk></devices></domain>",
      "/run/tmemd/d.swap.sock");
  ASSERT_TRUE(gap.ok()) << gap.status();
  EXPECT_EQ(gap->target_dev, "vdd");
  absl::StatusOr<SwapDiskEdit> none = WithSwapDisk(
      "<domain><devices><disk type='file'><target dev='hda'/></disk>"
      "</devices></domain>",
      "/run/tmemd/d.swap.sock");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->target_dev, "vda");
}

TEST(SwapDiskXmlTest, KeepsOrExtendsACompatibleMemoryBacking) {
  // Already shared (hugepages + shared access): left as it is.
  const std::string shared_huge =
      "<domain><memoryBacking><hugepages/><access mode='shared'/>"
      "</memoryBacking><devices></devices></domain>";
  absl::StatusOr<SwapDiskEdit> e =
      WithSwapDisk(shared_huge, "/run/tmemd/d.swap.sock");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_FALSE(e->memory_backing_added);
  EXPECT_TRUE(e->disk_added);
  EXPECT_EQ(Count(e->xml, "<memoryBacking>"), 1u);
  EXPECT_EQ(e->xml.find("memfd"), std::string::npos) << e->xml;
  // Says nothing about source or access: both added inside, the rest kept.
  absl::StatusOr<SwapDiskEdit> locked = WithSwapDisk(
      "<domain><memoryBacking><locked/></memoryBacking>"
      "<devices></devices></domain>",
      "/run/tmemd/d.swap.sock");
  ASSERT_TRUE(locked.ok()) << locked.status();
  EXPECT_TRUE(locked->memory_backing_added);
  EXPECT_EQ(Count(locked->xml, "<memoryBacking>"), 1u);
  EXPECT_NE(locked->xml.find("<locked/>"), std::string::npos);
  EXPECT_NE(locked->xml.find("<source type='memfd'/>"), std::string::npos);
  EXPECT_NE(locked->xml.find("<access mode='shared'/>"), std::string::npos);
  // <memoryBacking/> (empty, self-closing).
  absl::StatusOr<SwapDiskEdit> empty =
      WithSwapDisk("<domain><memoryBacking/><devices></devices></domain>",
                   "/run/tmemd/d.swap.sock");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(Count(empty->xml, "<memoryBacking"), 1u) << empty->xml;
  EXPECT_NE(empty->xml.find("<access mode='shared'/>"), std::string::npos);
}

TEST(SwapDiskXmlTest, RefusesMemoryBackingItWouldHaveToChange) {
  // Real private hugepages: refused, naming the element and the fix.
  absl::StatusOr<SwapDiskEdit> huge =
      WithSwapDisk(kRealHugepagesDomain, "/run/tmemd/d.swap.sock");
  ASSERT_EQ(huge.status().code(), absl::StatusCode::kFailedPrecondition)
      << huge.status();
  EXPECT_NE(huge.status().message().find("<hugepages/>"), std::string::npos);
  EXPECT_NE(huge.status().message().find("<access mode='shared'/>"),
            std::string::npos);
  for (const char* backing : {
           "<access mode='private'/>",
           "<source type='anonymous'/>",
           "<source type='anonymous'/><access mode='shared'/>",
           "<source type='file'/>",
       }) {
    const std::string xml = std::string("<domain><memoryBacking>") + backing +
                            "</memoryBacking><devices></devices></domain>";
    absl::StatusOr<SwapDiskEdit> e =
        WithSwapDisk(xml, "/run/tmemd/d.swap.sock");
    EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition)
        << backing;
    EXPECT_NE(e.status().message().find("memoryBacking"), std::string::npos)
        << e.status();
  }
  absl::StatusOr<SwapDiskEdit> numa = WithSwapDisk(
      "<domain><cpu><numa><cell id='0' memory='1' memAccess='private'/>"
      "</numa></cpu><devices></devices></domain>",
      "/run/tmemd/d.swap.sock");
  EXPECT_EQ(numa.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(numa.status().message().find("memAccess"), std::string::npos);
  EXPECT_EQ(
      WithSwapDisk("<domain><name>x</name></domain>", "/run/tmemd/d.swap.sock")
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(SwapDiskXmlTest, DetachRemovesOnlyThatDiskAndKeepsMemoryBacking) {
  SwapDiskRemoval r =
      WithoutSwapDisk(kRealSwapDomain, "/run/tmemd/lsw-real3.swap.sock");
  EXPECT_TRUE(r.removed);
  EXPECT_EQ(r.xml.find("vhostuser"), std::string::npos) << r.xml;
  EXPECT_NE(r.xml.find("<access mode='shared'/>"), std::string::npos);
  EXPECT_NE(r.xml.find("/tmp/lsw/a.img"), std::string::npos);
  EXPECT_NE(r.xml.find("<target dev='hdc' bus='ide'/>"), std::string::npos);
  // No blank line left where the disk was.
  EXPECT_EQ(r.xml.find("\n\n"), std::string::npos) << r.xml;
  SwapDiskRemoval none =
      WithoutSwapDisk(kRealSwapDomain, "/run/tmemd/other.swap.sock");
  EXPECT_FALSE(none.removed);
  EXPECT_EQ(none.xml, kRealSwapDomain);
}

TEST(SwapDiskXmlTest, MigrationRefusedOnlyForTmemdsSwapDisk) {
  absl::Status s = CheckMigratableWithSwap(kRealSwapDomain, "/run/tmemd");
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("domain 'lsw-real3'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("/run/tmemd/lsw-real3.swap.sock"),
            std::string::npos);
  EXPECT_NE(s.message().find("cannot migrate"), std::string::npos);
  // Another tmemd's directory, a domain without vhost-user disks, another
  // program's vhost-user disk: migratable.
  EXPECT_TRUE(CheckMigratableWithSwap(kRealSwapDomain, "/run/other").ok());
  EXPECT_TRUE(CheckMigratableWithSwap(kRealPcDomain, "/run/tmemd").ok());
  SwapDiskRemoval spdk =
      WithoutSwapDisk(kRealSwapDomain, "/run/tmemd/lsw-real3.swap.sock");
  absl::StatusOr<SwapDiskEdit> other =
      WithSwapDisk(spdk.xml, "/var/tmp/spdk/vhost.0");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE(CheckMigratableWithSwap(other->xml, "/run/tmemd").ok());
  // A look-alike inside <metadata> is not a disk.
  const std::string lookalike =
      "<domain><name>m</name><metadata><x:disk xmlns:x='urn:x' "
      "type='vhostuser'><x:source path='/run/tmemd/m.swap.sock'/></x:disk>"
      "</metadata><devices></devices></domain>";
  EXPECT_TRUE(VhostUserDiskSockets(lookalike).empty());
  EXPECT_TRUE(CheckMigratableWithSwap(lookalike, "/run/tmemd").ok());
}

}  // namespace
}  // namespace tmem
