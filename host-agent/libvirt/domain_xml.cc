#include "host-agent/libvirt/domain_xml.h"

#include <cstddef>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "host-agent/common/setting_ranges.h"
#include "host-agent/config.h"

namespace tmem {
namespace {

bool IsNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' ||
         c == '_' || c == '.';
}

// An element in [begin, end): `open_end` is one past the start tag's '>'.
struct Element {
  size_t begin = std::string_view::npos;
  size_t open_end = 0;
  size_t end = 0;
  bool self_closing = false;
  std::string_view prefix;  // "tmem" of <tmem:quota>, else empty
  std::string_view local;   // "quota" of <tmem:quota> (ChildElements only)
};

// The next element named `name` (any namespace prefix) at or after `from`.
std::optional<Element> FindElement(std::string_view xml, std::string_view name,
                                   size_t from = 0) {
  for (size_t at = xml.find('<', from); at != std::string_view::npos;
       at = xml.find('<', at + 1)) {
    size_t n = at + 1;
    size_t local = n;
    while (n < xml.size() && (IsNameChar(xml[n]) || xml[n] == ':')) {
      if (xml[n] == ':') local = n + 1;
      ++n;
    }
    if (xml.substr(local, n - local) != name) continue;
    if (n < xml.size() && xml[n] != '>' && xml[n] != '/' &&
        !absl::ascii_isspace(static_cast<unsigned char>(xml[n]))) {
      continue;
    }
    const size_t gt = xml.find('>', n);
    if (gt == std::string_view::npos) return std::nullopt;
    Element e;
    e.begin = at;
    e.open_end = gt + 1;
    e.prefix = local > at + 1 ? xml.substr(at + 1, local - at - 2)
                              : std::string_view();
    if (xml[gt - 1] == '/') {
      e.self_closing = true;
      e.end = gt + 1;
      return e;
    }
    // Same-name elements do not nest in what we read.
    const std::string close =
        e.prefix.empty()
            ? absl::StrCat("</", std::string(name))
            : absl::StrCat("</", std::string(e.prefix), ":", std::string(name));
    const size_t c = xml.find(close, gt);
    if (c == std::string_view::npos) return std::nullopt;
    const size_t cgt = xml.find('>', c);
    if (cgt == std::string_view::npos) return std::nullopt;
    e.end = cgt + 1;
    return e;
  }
  return std::nullopt;
}

std::string_view StartTag(std::string_view xml, const Element& e) {
  return xml.substr(e.begin, e.open_end - e.begin);
}

std::string_view Text(std::string_view xml, const Element& e) {
  if (e.self_closing) return {};
  const size_t close = xml.rfind("</", e.end - 1);
  return xml.substr(e.open_end, close - e.open_end);
}

// Attribute value in a start tag (either quote), unescaped for &apos; etc.
std::optional<std::string> Attr(std::string_view tag, std::string_view attr) {
  for (size_t at = tag.find(attr); at != std::string_view::npos;
       at = tag.find(attr, at + 1)) {
    if (at == 0 ||
        !absl::ascii_isspace(static_cast<unsigned char>(tag[at - 1])))
      continue;
    size_t p = at + attr.size();
    while (p < tag.size() &&
           absl::ascii_isspace(static_cast<unsigned char>(tag[p])))
      ++p;
    if (p >= tag.size() || tag[p] != '=') continue;
    ++p;
    while (p < tag.size() &&
           absl::ascii_isspace(static_cast<unsigned char>(tag[p])))
      ++p;
    if (p >= tag.size() || (tag[p] != '\'' && tag[p] != '"')) continue;
    const char q = tag[p];
    const size_t close = tag.find(q, p + 1);
    if (close == std::string_view::npos) return std::nullopt;
    std::string v(tag.substr(p + 1, close - p - 1));
    // The five predefined entities are all libvirt emits in attributes.
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] != '&') {
        out += v[i];
        continue;
      }
      const size_t semi = v.find(';', i);
      const std::string ent = v.substr(i, semi - i + 1);
      if (ent == "&amp;")
        out += '&';
      else if (ent == "&lt;")
        out += '<';
      else if (ent == "&gt;")
        out += '>';
      else if (ent == "&apos;")
        out += '\'';
      else if (ent == "&quot;")
        out += '"';
      else
        out += ent;
      i = semi == std::string::npos ? v.size() : semi;
    }
    return out;
  }
  return std::nullopt;
}

std::string XmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '\'':
        out += "&apos;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

absl::Status ParseBool(std::string_view element, std::string_view text,
                       bool* out) {
  const std::string t = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(absl::string_view(text.data(), text.size())));
  if (t == "true" || t == "yes" || t == "on" || t == "1") {
    *out = true;
  } else if (t == "false" || t == "no" || t == "off" || t == "0") {
    *out = false;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("tmem metadata <",
                                                   std::string(element), ">'",
                                                   t, "': use true or false"));
  }
  return absl::OkStatus();
}

// <quota> and <swap_quota>: "unlimited", empty or 0 mean no limit
// (setting_ranges.h); otherwise a size within `range`.
absl::Status ParseQuotaElement(std::string_view element, std::string_view text,
                               const IntRange& range, uint64_t* out) {
  if (text == "unlimited" || text.empty()) {
    *out = kUnlimitedQuota;
    return absl::OkStatus();
  }
  const std::string where =
      absl::StrCat("tmem metadata <", std::string(element), ">");
  absl::StatusOr<uint64_t> q = ParseSize(text);
  if (!q.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", q.status().message()));
  }
  if (absl::Status s = CheckRange(range, *q, where); !s.ok()) return s;
  *out = QuotaFromSetting(*q);
  return absl::OkStatus();
}

// <mode> and <swap_mode>.
absl::Status ParseModeElement(std::string_view element, std::string_view text,
                              ValveMode* out) {
  if (!ParseValveMode(text, out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tmem metadata <", std::string(element), ">'", std::string(text),
        "': use default, off, always or adaptive"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string TmemShmemXml(std::string_view socket_path, int vectors,
                         bool master) {
  return absl::StrCat(
      "<shmem name='", std::string(kTmemShmemName), "'",
      master ? " role='master'" : "",
      "><model type='ivshmem-doorbell'/><server path='", XmlEscape(socket_path),
      "'/><msi vectors='", vectors, "' ioeventfd='on'/>",
      master
          ? absl::StrCat("<alias name='", std::string(kTmemDeviceAlias), "'/>")
          : "",
      "</shmem>");
}

namespace {

// The <qemu:device alias='ua-tmem0'> element inside <qemu:override>.
std::optional<Element> FindTmemOverrideDevice(std::string_view xml) {
  const std::optional<Element> over = FindElement(xml, "override");
  if (!over || over->self_closing || over->prefix != "qemu") {
    return std::nullopt;
  }
  for (auto d = FindElement(xml, "device", over->open_end);
       d && d->end <= over->end; d = FindElement(xml, "device", d->end)) {
    if (d->prefix == "qemu" &&
        Attr(StartTag(xml, *d), "alias") == std::string(kTmemDeviceAlias)) {
      return d;
    }
  }
  return std::nullopt;
}

// Removes [begin, end) and the blank space before it up to the line start.
void EraseWithIndent(std::string& xml, size_t begin, size_t end) {
  size_t b = begin;
  while (b > 0 && (xml[b - 1] == ' ' || xml[b - 1] == '\t')) --b;
  if (b > 0 && xml[b - 1] == '\n') --b;
  xml.erase(b, end - b);
}

}  // namespace

bool HasTmemMasterOverride(std::string_view xml) {
  const std::optional<Element> dev = FindTmemOverrideDevice(xml);
  if (!dev) return false;
  const std::string_view body = xml.substr(dev->begin, dev->end - dev->begin);
  for (auto p = FindElement(body, "property"); p;
       p = FindElement(body, "property", p->end)) {
    const std::string_view tag = StartTag(body, *p);
    if (Attr(tag, "name") == "master") return Attr(tag, "value") == "on";
  }
  return false;
}

absl::StatusOr<std::string> WithTmemMasterOverride(std::string_view xml) {
  if (HasTmemMasterOverride(xml)) return std::string(xml);
  if (FindTmemOverrideDevice(xml)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the domain's <qemu:override> has a device '",
        std::string(kTmemDeviceAlias),
        "' without master=on: add <qemu:property name='master' "
        "type='string' value='on'/> to its <qemu:frontend> by hand"));
  }
  const std::optional<Element> root = FindElement(xml, "domain");
  if (!root) {
    return absl::InvalidArgumentError("no <domain> element in the domain XML");
  }
  std::string out(xml);
  const std::string block = absl::StrCat(
      "<qemu:device alias='", std::string(kTmemDeviceAlias),
      "'><qemu:frontend><qemu:property name='master' type='string' "
      "value='on'/></qemu:frontend></qemu:device>");
  const std::optional<Element> over = FindElement(xml, "override");
  if (over && over->prefix == "qemu" && !over->self_closing) {
    out.insert(over->open_end, block);
  } else {
    const size_t close = out.rfind("</domain>");
    if (close == std::string::npos) {
      return absl::InvalidArgumentError("the domain XML has no </domain>");
    }
    out.insert(close,
               absl::StrCat("  <qemu:override>", block, "</qemu:override>\n"));
  }
  const std::string_view tag = StartTag(xml, *root);
  const std::optional<std::string> ns = Attr(tag, "xmlns:qemu");
  if (!ns) {
    out.insert(root->open_end - 1,
               absl::StrCat(" xmlns:qemu='", std::string(kQemuXmlnsUri), "'"));
  } else if (*ns != kQemuXmlnsUri) {
    return absl::FailedPreconditionError(
        absl::StrCat("the domain XML binds prefix 'qemu' to '", *ns,
                     "', not libvirt's QEMU namespace"));
  }
  return out;
}

std::string WithoutTmemMasterOverride(std::string_view xml) {
  const std::optional<Element> dev = FindTmemOverrideDevice(xml);
  if (!dev) return std::string(xml);
  std::string out(xml);
  EraseWithIndent(out, dev->begin, dev->end);
  // An override left with nothing in it goes too.
  const std::optional<Element> over = FindElement(out, "override");
  if (over && over->prefix == "qemu" && !over->self_closing) {
    const std::string_view inner = std::string_view(out).substr(
        over->open_end, over->end - over->open_end);
    const size_t close = inner.rfind("</");
    const std::string_view content = inner.substr(0, close);
    bool empty = true;
    for (char c : content) {
      empty = empty && absl::ascii_isspace(static_cast<unsigned char>(c));
    }
    if (empty) {
      EraseWithIndent(out, over->begin, over->end);
    }
  }
  return out;
}

namespace {

// The elements directly inside xml[from, to) -- an element's content, or a
// whole document -- in order, each with its extent; deeper ones, comments,
// processing instructions, CDATA and DOCTYPE are stepped over. Unlike
// FindElement this knows where an element sits, so an element of the same
// name elsewhere (inside <metadata>, say) is never taken for it. Stops at
// the end of the enclosing element or at markup cut short.
std::vector<Element> ChildElements(std::string_view xml, size_t from,
                                   size_t to) {
  std::vector<Element> out;
  int depth = 0;
  size_t at = from;
  while ((at = xml.find('<', at)) != std::string_view::npos && at < to) {
    const std::string_view rest = xml.substr(at, to - at);
    size_t skip_to = std::string_view::npos;
    if (rest.starts_with("<!--")) {
      skip_to = rest.find("-->");
      if (skip_to != std::string_view::npos) skip_to += 3;
    } else if (rest.starts_with("<![CDATA[")) {
      skip_to = rest.find("]]>");
      if (skip_to != std::string_view::npos) skip_to += 3;
    } else if (rest.starts_with("<?")) {
      skip_to = rest.find("?>");
      if (skip_to != std::string_view::npos) skip_to += 2;
    } else if (rest.starts_with("<!")) {
      skip_to = rest.find('>');
      if (skip_to != std::string_view::npos) skip_to += 1;
    } else {
      skip_to = 0;  // a tag
    }
    if (skip_to == std::string_view::npos) break;
    if (skip_to > 0) {
      at += skip_to;
      continue;
    }
    // The tag's '>' (attribute values may hold one).
    size_t gt = at + 1;
    char quote = 0;
    for (; gt < to; ++gt) {
      const char c = xml[gt];
      if (quote != 0) {
        if (c == quote) quote = 0;
      } else if (c == '"' || c == '\'') {
        quote = c;
      } else if (c == '>') {
        break;
      }
    }
    if (gt >= to) break;
    if (xml[at + 1] == '/') {
      if (--depth < 0) break;  // the enclosing element ends
      if (depth == 0 && !out.empty()) out.back().end = gt + 1;
      at = gt + 1;
      continue;
    }
    const bool self_closing = xml[gt - 1] == '/';
    if (depth == 0) {
      Element e;
      e.begin = at;
      e.open_end = gt + 1;
      e.self_closing = self_closing;
      e.end = self_closing ? gt + 1 : std::string_view::npos;
      size_t n = at + 1;
      size_t local = n;
      while (n < gt && (IsNameChar(xml[n]) || xml[n] == ':')) {
        if (xml[n] == ':') local = n + 1;
        ++n;
      }
      e.prefix = local > at + 1 ? xml.substr(at + 1, local - at - 2)
                                : std::string_view();
      e.local = xml.substr(local, n - local);
      out.push_back(e);
    }
    if (!self_closing) ++depth;
    at = gt + 1;
  }
  // An element whose end was not found is cut short: not used.
  std::erase_if(
      out, [](const Element& e) { return e.end == std::string_view::npos; });
  return out;
}

// An element of libvirt's own schema: no prefix and no default namespace
// of its own (libvirt declares none on these), so a look-alike in a
// foreign namespace never matches.
bool InNoNamespace(std::string_view xml, const Element& e) {
  return e.prefix.empty() && !Attr(StartTag(xml, e), "xmlns").has_value();
}

std::vector<Element> ChildrenNamed(std::string_view xml, const Element& parent,
                                   std::string_view name) {
  std::vector<Element> out;
  if (parent.self_closing) return out;
  for (const Element& e : ChildElements(xml, parent.open_end, parent.end)) {
    if (e.local == name && InNoNamespace(xml, e)) out.push_back(e);
  }
  return out;
}

// The document's <domain> element, if it is the root.
std::optional<Element> DomainRoot(std::string_view xml) {
  const std::vector<Element> top = ChildElements(xml, 0, xml.size());
  if (top.empty() || top.front().local != "domain" ||
      !InNoNamespace(xml, top.front())) {
    return std::nullopt;
  }
  return top.front();
}

}  // namespace

std::optional<TmemDevice> FindTmemDevice(std::string_view xml) {
  // Only /domain/devices/shmem: the one QEMU gets. An element of that name
  // anywhere else (a domain's <metadata> holds whatever its owner wrote)
  // must not choose the socket tmemd makes.
  const std::optional<Element> root = DomainRoot(xml);
  if (!root) return std::nullopt;
  for (const Element& devices : ChildrenNamed(xml, *root, "devices")) {
    for (const Element& e : ChildrenNamed(xml, devices, "shmem")) {
      if (Attr(StartTag(xml, e), "name") != std::string(kTmemShmemName)) {
        continue;
      }
      TmemDevice d;
      const std::vector<Element> server = ChildrenNamed(xml, e, "server");
      if (!server.empty()) {
        d.server_path =
            Attr(StartTag(xml, server.front()), "path").value_or("");
      }
      const std::vector<Element> alias = ChildrenNamed(xml, e, "alias");
      if (!alias.empty()) {
        d.alias = Attr(StartTag(xml, alias.front()), "name").value_or("");
      }
      return d;
    }
  }
  return std::nullopt;
}

absl::Status CheckPciHotplug(std::string_view xml) {
  std::string machine;
  if (auto os = FindElement(xml, "os")) {
    const std::string_view body = xml.substr(os->begin, os->end - os->begin);
    if (auto t = FindElement(body, "type")) {
      machine = Attr(StartTag(body, *t), "machine").value_or("");
    }
  }
  if (machine.find("q35") != std::string::npos) {
    for (auto c = FindElement(xml, "controller"); c;
         c = FindElement(xml, "controller", c->end)) {
      if (Attr(StartTag(xml, *c), "model") == "pcie-to-pci-bridge") {
        return absl::OkStatus();
      }
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "machine '", machine,
        "' (q35) cannot hot-plug the ivshmem-doorbell device, a conventional "
        "PCI device, without a PCIe-to-PCI bridge: add <controller "
        "type='pci' model='pcie-to-pci-bridge'/> to the domain (virsh edit), "
        "restart it, then attach again"));
  }
  if (machine.find("pc") != std::string::npos ||
      machine.find("i440fx") != std::string::npos) {
    bool acpi = false;
    if (auto f = FindElement(xml, "features")) {
      acpi = FindElement(xml.substr(f->begin, f->end - f->begin), "acpi")
                 .has_value();
    }
    if (!acpi) {
      return absl::FailedPreconditionError(absl::StrCat(
          "machine '", machine,
          "' has ACPI off, so PCI hot-plug is impossible: add <acpi/> under "
          "<features> (virsh edit), restart the domain, then attach again "
          "(or attach with --persistent and restart)"));
    }
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("machine '", machine,
                   "' is not pc (i440fx) or q35: tmemd only knows how to "
                   "hot-plug ivshmem-doorbell on those"));
}

absl::StatusOr<TmemMetadata> ParseTmemMetadata(std::string_view xml) {
  TmemMetadata m;
  auto root = FindElement(xml, "tmem");
  if (!root) {
    return absl::InvalidArgumentError("tmem metadata has no <tmem> element");
  }
  m.present = true;
  if (root->self_closing) return m;
  size_t at = root->open_end;
  const size_t stop = xml.rfind("</", root->end - 1);
  while (true) {
    const size_t lt = xml.find('<', at);
    if (lt == std::string_view::npos || lt >= stop) break;
    if (xml.substr(lt, 4) == "<!--") {
      const size_t c = xml.find("-->", lt);
      at = c == std::string_view::npos ? stop : c + 3;
      continue;
    }
    size_t n = lt + 1;
    size_t local = n;
    while (n < xml.size() && (IsNameChar(xml[n]) || xml[n] == ':')) {
      if (xml[n] == ':') local = n + 1;
      ++n;
    }
    const std::string name(xml.substr(local, n - local));
    auto e = FindElement(xml, name, lt);
    if (!e || e->begin != lt) {
      return absl::InvalidArgumentError(
          absl::StrCat("tmem metadata: malformed <", name, ">"));
    }
    const std::string_view sv = Text(xml, *e);
    const std::string text(
        absl::StripAsciiWhitespace(absl::string_view(sv.data(), sv.size())));
    absl::Status s;
    if (name == "enabled") {
      s = ParseBool(name, text, &m.policy.enabled);
    } else if (name == "frozen") {
      s = ParseBool(name, text, &m.policy.frozen);
    } else if (name == "autoattach") {
      s = ParseBool(name, text, &m.autoattach);
    } else if (name == "quota") {
      s = ParseQuotaElement(name, text, ranges::kQuota, &m.policy.quota_bytes);
    } else if (name == "swap_quota") {
      s = ParseQuotaElement(name, text, ranges::kSwapQuota,
                            &m.policy.swap_quota_bytes);
    } else if (name == "swap_mode") {
      s = ParseModeElement(name, text, &m.policy.swap_mode);
    } else if (name == "weight") {
      int64_t w = 0;
      if (!absl::SimpleAtoi(text, &w)) {
        s = absl::InvalidArgumentError(absl::StrCat(
            "tmem metadata <weight>'", text, "': use an integer in [",
            ranges::kWeight.lo, ", ", ranges::kWeight.hi, "]"));
      } else if (s = CheckRange(ranges::kWeight, w, "tmem metadata <weight>");
                 s.ok()) {
        m.policy.weight = static_cast<uint32_t>(w);
      }
    } else if (name == "mode") {
      s = ParseModeElement(name, text, &m.policy.mode);
    } else {
      s = absl::InvalidArgumentError(absl::StrCat(
          "tmem metadata: unknown element <", name,
          "> (known: enabled, quota, weight, mode, frozen, autoattach, "
          "swap_quota, swap_mode)"));
    }
    if (!s.ok()) return s;
    at = e->end;
  }
  return m;
}

std::string FormatTmemMetadata(const TmemMetadata& m) {
  const VmPolicy& p = m.policy;
  // The swap fields only when set: a tmemd from before them refuses an
  // element it does not know, and a domain that uses no swap policy must
  // stay readable there.
  std::string swap;
  if (p.swap_quota_bytes != kUnlimitedQuota) {
    absl::StrAppend(&swap, "<swap_quota>", p.swap_quota_bytes, "</swap_quota>");
  }
  if (p.swap_mode != ValveMode::kDefault) {
    absl::StrAppend(&swap, "<swap_mode>",
                    std::string(ValveModeName(p.swap_mode)), "</swap_mode>");
  }
  return absl::StrCat(
      "<tmem><enabled>", p.enabled ? "true" : "false", "</enabled><quota>",
      p.quota_bytes == kUnlimitedQuota ? std::string("unlimited")
                                       : absl::StrCat(p.quota_bytes),
      "</quota><weight>", p.weight, "</weight><mode>",
      std::string(ValveModeName(p.mode)), "</mode><frozen>",
      p.frozen ? "true" : "false", "</frozen><autoattach>",
      m.autoattach ? "true" : "false", "</autoattach>", swap, "</tmem>");
}

absl::StatusOr<TmemMetadata> DomainTmemMetadata(std::string_view domain_xml) {
  auto md = FindElement(domain_xml, "metadata");
  if (!md || md->self_closing) return TmemMetadata{};
  const std::string_view inner =
      domain_xml.substr(md->open_end, md->end - md->open_end);
  for (auto e = FindElement(inner, "tmem"); e;
       e = FindElement(inner, "tmem", e->end)) {
    // Another application's <x:tmem> is not ours: ours names our namespace.
    const std::string_view open =
        inner.substr(e->begin, e->open_end - e->begin);
    if (open.find(kTmemMetadataUri) == std::string_view::npos) continue;
    return ParseTmemMetadata(inner.substr(e->begin, e->end - e->begin));
  }
  return TmemMetadata{};
}

std::string DomainXmlElement(std::string_view xml, std::string_view element) {
  // A child of <domain> itself, for the same reason as FindTmemDevice.
  const std::optional<Element> root = DomainRoot(xml);
  if (!root) return "";
  const std::vector<Element> e = ChildrenNamed(xml, *root, element);
  if (e.empty()) return "";
  const std::string_view t = Text(xml, e.front());
  return std::string(
      absl::StripAsciiWhitespace(absl::string_view(t.data(), t.size())));
}

std::string SwapSocketPath(std::string_view socket_dir, std::string_view name) {
  std::string dir(socket_dir);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return absl::StrCat(dir, "/", std::string(name),
                      std::string(kSwapSocketSuffix));
}

bool IsTmemdSwapSocket(std::string_view path, std::string_view socket_dir) {
  std::string dir(socket_dir);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || !path.starts_with(dir) || path.size() <= dir.size() ||
      (dir != "/" && path[dir.size()] != '/')) {
    return false;
  }
  const std::string_view file =
      path.substr(dir == "/" ? dir.size() : dir.size() + 1);
  return file.find('/') == std::string_view::npos &&
         file.size() > kSwapSocketSuffix.size() &&
         file.ends_with(kSwapSocketSuffix);
}

std::string SwapDiskXml(std::string_view socket_path,
                        std::string_view target_dev) {
  // reconnect: QEMU reconnects (after 1 s) when tmemd restarts, instead of
  // leaving the guest's swap device dead until the next cold boot.
  // queues='1': without it QEMU asks for one queue per vCPU and refuses to
  // start when the device offers fewer (docs/swap-device.md); the device
  // serves all its queues from one thread, so more would not be faster.
  return absl::StrCat(
      "<disk type='vhostuser' device='disk'><driver name='qemu' "
      "type='raw' queues='1'/><source type='unix' path='",
      XmlEscape(socket_path),
      "'><reconnect enabled='yes' timeout='1'/></source><target dev='",
      XmlEscape(target_dev), "' bus='virtio'/></disk>");
}

namespace {

// /domain/devices, the one libvirt reads.
std::optional<Element> DomainDevices(std::string_view xml) {
  const std::optional<Element> root = DomainRoot(xml);
  if (!root) return std::nullopt;
  const std::vector<Element> devices = ChildrenNamed(xml, *root, "devices");
  if (devices.empty()) return std::nullopt;
  return devices.front();
}

// The vhostuser disks under /domain/devices with their source paths.
std::vector<std::pair<Element, std::string>> VhostUserDisks(
    std::string_view xml) {
  std::vector<std::pair<Element, std::string>> out;
  const std::optional<Element> devices = DomainDevices(xml);
  if (!devices) return out;
  for (const Element& disk : ChildrenNamed(xml, *devices, "disk")) {
    if (Attr(StartTag(xml, disk), "type") != "vhostuser") continue;
    const std::vector<Element> source = ChildrenNamed(xml, disk, "source");
    if (source.empty()) continue;
    out.emplace_back(disk,
                     Attr(StartTag(xml, source.front()), "path").value_or(""));
  }
  return out;
}

// libvirt's virtio disk names: vda .. vdz, vdaa .. vdzz, ...
std::string VirtioDiskName(size_t index) {
  std::string letters;
  for (size_t i = index + 1; i > 0; i = (i - 1) / 26) {
    letters.insert(letters.begin(), static_cast<char>('a' + (i - 1) % 26));
  }
  return "vd" + letters;
}

// The index of a virtio disk name (VirtioDiskName's inverse); nullopt for
// any other name.
std::optional<size_t> VirtioDiskIndex(std::string_view dev) {
  if (!dev.starts_with("vd") || dev.size() < 3 || dev.size() > 6) {
    return std::nullopt;
  }
  size_t index = 0;
  for (char c : dev.substr(2)) {
    if (c < 'a' || c > 'z') return std::nullopt;
    index = index * 26 + static_cast<size_t>(c - 'a' + 1);
  }
  return index - 1;
}

constexpr char kSharedMemoryHint[] =
    "a vhost-user swap device needs the guest's memory shared by file "
    "descriptor";

// Replaces [at, at + length) of the domain XML with `text` (the whole
// <memoryBacking>, or what goes inside it); empty text when the memory is
// already shareable.
struct MemoryBackingEdit {
  size_t at = 0;
  size_t length = 0;
  std::string text;
};

absl::StatusOr<MemoryBackingEdit> PlanMemoryBacking(std::string_view xml,
                                                    const Element& root) {
  // A NUMA cell's memAccess overrides <memoryBacking> for its memory.
  for (const Element& cpu : ChildrenNamed(xml, root, "cpu")) {
    for (const Element& numa : ChildrenNamed(xml, cpu, "numa")) {
      for (const Element& cell : ChildrenNamed(xml, numa, "cell")) {
        if (Attr(StartTag(xml, cell), "memAccess") == "private") {
          return absl::FailedPreconditionError(absl::StrCat(
              "the domain's <cpu><numa><cell memAccess='private'> keeps that "
              "memory private, but ",
              kSharedMemoryHint,
              ": change it to memAccess='shared' by hand (virsh edit)"));
        }
      }
    }
  }
  const std::vector<Element> backing =
      ChildrenNamed(xml, root, "memoryBacking");
  if (backing.empty()) {
    // After <currentMemory> (or <memory>), where libvirt writes it.
    size_t at = root.open_end;
    for (std::string_view after : {"memory", "currentMemory"}) {
      const std::vector<Element> e = ChildrenNamed(xml, root, after);
      if (!e.empty()) at = std::max(at, e.front().end);
    }
    return MemoryBackingEdit{
        at, 0,
        "\n  <memoryBacking>\n    <source type='memfd'/>\n    <access "
        "mode='shared'/>\n  </memoryBacking>"};
  }
  const Element& mb = backing.front();
  auto attr_of = [&](std::string_view child,
                     std::string_view attr) -> std::optional<std::string> {
    const std::vector<Element> e = ChildrenNamed(xml, mb, child);
    if (e.empty()) return std::nullopt;
    return Attr(StartTag(xml, e.front()), attr).value_or("");
  };
  const std::optional<std::string> source = attr_of("source", "type");
  const std::optional<std::string> access = attr_of("access", "mode");
  const bool hugepages = !ChildrenNamed(xml, mb, "hugepages").empty();
  if (source == "anonymous") {
    return absl::FailedPreconditionError(absl::StrCat(
        "the domain's <memoryBacking> has <source type='anonymous'/>, which "
        "has no file descriptor to share, but ",
        kSharedMemoryHint,
        ": change it to <source type='memfd'/> with <access mode='shared'/> "
        "by hand (virsh edit)"));
  }
  if (access == "shared") return MemoryBackingEdit{};
  if (access.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the domain's <memoryBacking> has <access mode='", *access, "'/>, but ",
        kSharedMemoryHint,
        ": tmemd does not change an access mode the operator chose; set "
        "<access mode='shared'/> by hand (virsh edit)"));
  }
  if (hugepages || source.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the domain's <memoryBacking> has ",
        hugepages ? "<hugepages/>"
                  : absl::StrCat("<source type='", *source, "'/>"),
        " without <access mode='shared'/>, but ", kSharedMemoryHint,
        ": tmemd does not turn the operator's private memory into shared "
        "memory; add <access mode='shared'/> to <memoryBacking> by hand "
        "(virsh edit)"));
  }
  // Says nothing about source or access (<locked/>, <nosharepages/>, ...):
  // both are added inside it.
  const std::string inner =
      "\n    <source type='memfd'/>\n    <access mode='shared'/>";
  if (mb.self_closing) {  // <memoryBacking/>: rewritten whole
    return MemoryBackingEdit{
        mb.begin, mb.end - mb.begin,
        absl::StrCat("<memoryBacking>", inner, "\n  </memoryBacking>")};
  }
  return MemoryBackingEdit{mb.open_end, 0, inner};
}

}  // namespace

absl::StatusOr<SwapDiskEdit> WithSwapDisk(std::string_view xml,
                                          std::string_view socket_path) {
  const std::optional<Element> root = DomainRoot(xml);
  const std::optional<Element> devices = DomainDevices(xml);
  if (!root || !devices || devices->self_closing) {
    return absl::InvalidArgumentError(
        "the domain XML has no <domain> with a <devices> element");
  }
  SwapDiskEdit edit;
  // After every virtio disk there is, not in a gap: libvirt keeps a bus's
  // disks sorted by name and gives the boot index of <boot dev='hd'/> to
  // the first, so a swap disk named before the system disk would be booted.
  std::optional<size_t> last_virtio;
  size_t disks_end = devices->open_end;
  for (const Element& disk : ChildrenNamed(xml, *devices, "disk")) {
    disks_end = disk.end;
    const std::vector<Element> target = ChildrenNamed(xml, disk, "target");
    const std::string dev =
        target.empty()
            ? ""
            : Attr(StartTag(xml, target.front()), "dev").value_or("");
    if (const std::optional<size_t> i = VirtioDiskIndex(dev)) {
      last_virtio = std::max(last_virtio.value_or(0), *i);
    }
    if (Attr(StartTag(xml, disk), "type") != "vhostuser") continue;
    const std::vector<Element> source = ChildrenNamed(xml, disk, "source");
    if (!source.empty() &&
        Attr(StartTag(xml, source.front()), "path") == socket_path) {
      edit.target_dev = dev;
    }
  }
  absl::StatusOr<MemoryBackingEdit> mb = PlanMemoryBacking(xml, *root);
  if (!mb.ok()) return mb.status();
  std::string disk_text;
  size_t disk_at = disks_end;
  if (edit.target_dev.empty()) {
    edit.target_dev =
        VirtioDiskName(last_virtio.has_value() ? *last_virtio + 1 : 0);
    disk_text =
        absl::StrCat("\n    ", SwapDiskXml(socket_path, edit.target_dev));
    edit.disk_added = true;
  }
  edit.memory_backing_added = !mb->text.empty();
  // Later offset first, so the earlier one stays valid.
  std::string out(xml);
  auto apply_mb = [&] {
    if (!mb->text.empty()) out.replace(mb->at, mb->length, mb->text);
  };
  if (mb->at > disk_at) {
    apply_mb();
    out.insert(disk_at, disk_text);
  } else {
    out.insert(disk_at, disk_text);
    apply_mb();
  }
  edit.xml = std::move(out);
  return edit;
}

SwapDiskRemoval WithoutSwapDisk(std::string_view xml,
                                std::string_view socket_path) {
  SwapDiskRemoval r{std::string(xml), false};
  for (const auto& [disk, path] : VhostUserDisks(xml)) {
    if (path != socket_path) continue;
    EraseWithIndent(r.xml, disk.begin, disk.end);
    r.removed = true;
    return r;
  }
  return r;
}

std::vector<std::string> VhostUserDiskSockets(std::string_view xml) {
  std::vector<std::string> out;
  for (auto& [disk, path] : VhostUserDisks(xml)) out.push_back(path);
  return out;
}

absl::Status CheckMigratableWithSwap(std::string_view xml,
                                     std::string_view socket_dir) {
  for (const std::string& path : VhostUserDiskSockets(xml)) {
    if (!IsTmemdSwapSocket(path, socket_dir)) continue;
    std::string name = DomainXmlElement(xml, "name");
    return absl::FailedPreconditionError(absl::StrCat(
        "domain '", name, "' has a tmemd swap device (vhostuser disk on ", path,
        ") and tmemd cannot migrate swap devices yet: the pages the guest "
        "swapped out are held by the source host's tmemd and would not "
        "follow it. Shut the domain down and start it on the other host, or "
        "remove the swap device first (tmemctl detach --swap ",
        name, ", then a cold boot)"));
  }
  return absl::OkStatus();
}

}  // namespace tmem
