#include "host-agent/libvirt/libvirt_hypervisor.h"

#include <libvirt/virterror.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "host-agent/libvirt/domain_xml.h"
#include "host-agent/log.h"

namespace tmem {
namespace {

// libvirt prints every error to stderr by default; tmemd reports them
// through its own Status values and log instead.
void QuietErrors(void* /*opaque*/, virErrorPtr /*error*/) {}

// One process-wide event loop thread (libvirt's default implementation is
// global and cannot be unregistered).
absl::Status EnsureEventLoop() {
  static std::once_flag once;
  static int rc = 0;
  std::call_once(once, [] {
    virSetErrorFunc(nullptr, QuietErrors);
    if (virInitialize() < 0 || virEventRegisterDefaultImpl() < 0) {
      rc = -1;
      return;
    }
    std::thread([] {
      for (;;) {
        if (virEventRunDefaultImpl() < 0) {
          Log(LogLevel::kError, "libvirt_event_loop_error");
        }
      }
    }).detach();
  });
  if (rc < 0) {
    return absl::InternalError("cannot start libvirt's default event loop");
  }
  return absl::OkStatus();
}

// Live instances. libvirt may still be running one of our callbacks on its
// event thread while an instance is destroyed (deregistering does not wait
// for a callback in flight), so callbacks reach an instance only through
// this set, under its mutex; the destructor leaves the set first.
Mutex& LiveMutex() {
  static Mutex mu;
  return mu;
}
std::set<LibvirtHypervisor*>& LiveSet() {
  static std::set<LibvirtHypervisor*> live;
  return live;
}
void Dispatch(void* opaque, const DomainEvent& event) {
  MutexLock l(&LiveMutex());
  auto* self = static_cast<LibvirtHypervisor*>(opaque);
  if (LiveSet().count(self) != 0) self->Emit(event);
}

std::string LastErrorMessage() {
  virErrorPtr e = virGetLastError();
  return e != nullptr && e->message != nullptr ? e->message
                                               : "unknown libvirt error";
}

absl::Status LastError(std::string_view what) {
  virErrorPtr e = virGetLastError();
  const int code = e != nullptr ? e->code : VIR_ERR_INTERNAL_ERROR;
  std::string msg = absl::StrCat(std::string(what), ": ", LastErrorMessage());
  switch (code) {
    case VIR_ERR_NO_DOMAIN:
      return absl::NotFoundError(msg);
    case VIR_ERR_OPERATION_INVALID:
    case VIR_ERR_CONFIG_UNSUPPORTED:
    case VIR_ERR_OPERATION_UNSUPPORTED:
    case VIR_ERR_OPERATION_FAILED:
      return absl::FailedPreconditionError(msg);
    case VIR_ERR_NO_SUPPORT:
      return absl::UnimplementedError(msg);
    case VIR_ERR_INVALID_CONN:
    case VIR_ERR_RPC:
    case VIR_ERR_SYSTEM_ERROR:
    case VIR_ERR_NO_CONNECT:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

unsigned AffectFlags(bool live, bool config) {
  unsigned f = 0;
  if (live) f |= VIR_DOMAIN_AFFECT_LIVE;
  if (config) f |= VIR_DOMAIN_AFFECT_CONFIG;
  return f;  // 0 == VIR_DOMAIN_AFFECT_CURRENT
}

// RAII for a looked-up domain.
struct DomainHandle {
  virDomainPtr dom = nullptr;
  DomainHandle() = default;
  DomainHandle(const DomainHandle&) = delete;
  DomainHandle& operator=(const DomainHandle&) = delete;
  ~DomainHandle() {
    if (dom != nullptr) virDomainFree(dom);
  }
};

DomainEvent BaseEvent(virDomainPtr dom, DomainEvent::Kind kind) {
  DomainEvent e;
  e.kind = kind;
  const char* name = virDomainGetName(dom);
  e.domain = name != nullptr ? name : "";
  char uuid[VIR_UUID_STRING_BUFLEN] = {};
  if (virDomainGetUUIDString(dom, uuid) == 0) e.uuid = uuid;
  return e;
}

std::string StoppedDetail(int detail) {
  switch (detail) {
    case VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN:
      return "shutdown";
    case VIR_DOMAIN_EVENT_STOPPED_DESTROYED:
      return "destroyed";
    case VIR_DOMAIN_EVENT_STOPPED_CRASHED:
      return "crashed";
    case VIR_DOMAIN_EVENT_STOPPED_MIGRATED:
      return "migrated";
    case VIR_DOMAIN_EVENT_STOPPED_SAVED:
      return "saved";
    case VIR_DOMAIN_EVENT_STOPPED_FAILED:
      return "failed";
    case VIR_DOMAIN_EVENT_STOPPED_FROM_SNAPSHOT:
      return "from_snapshot";
    default:
      return absl::StrCat("detail ", detail);
  }
}

int OnLifecycle(virConnectPtr /*conn*/, virDomainPtr dom, int event, int detail,
                void* opaque) {
  using Kind = DomainEvent::Kind;
  DomainEvent e;
  switch (event) {
    case VIR_DOMAIN_EVENT_DEFINED:
      e = BaseEvent(dom, Kind::kDefined);
      break;
    case VIR_DOMAIN_EVENT_UNDEFINED:
      e = BaseEvent(dom, Kind::kUndefined);
      break;
    case VIR_DOMAIN_EVENT_STARTED:
      e = BaseEvent(dom, Kind::kStarted);
      e.detail = detail == VIR_DOMAIN_EVENT_STARTED_MIGRATED ? "migrated" : "";
      break;
    case VIR_DOMAIN_EVENT_STOPPED:
      e = BaseEvent(dom, Kind::kStopped);
      e.detail = StoppedDetail(detail);
      break;
    default:
      return 0;
  }
  Dispatch(opaque, e);
  return 0;
}

void OnDeviceRemoved(virConnectPtr /*conn*/, virDomainPtr dom,
                     const char* alias, void* opaque) {
  DomainEvent e = BaseEvent(dom, DomainEvent::Kind::kDeviceRemoved);
  e.alias = alias != nullptr ? alias : "";
  Dispatch(opaque, e);
}

void OnDeviceRemovalFailed(virConnectPtr /*conn*/, virDomainPtr dom,
                           const char* alias, void* opaque) {
  DomainEvent e = BaseEvent(dom, DomainEvent::Kind::kDeviceRemovalFailed);
  e.alias = alias != nullptr ? alias : "";
  Dispatch(opaque, e);
}

void OnMetadataChange(virConnectPtr /*conn*/, virDomainPtr dom, int type,
                      const char* nsuri, void* opaque) {
  if (type != VIR_DOMAIN_METADATA_ELEMENT || nsuri == nullptr ||
      std::string_view(nsuri) != kTmemMetadataUri) {
    return;
  }
  Dispatch(opaque, BaseEvent(dom, DomainEvent::Kind::kMetadataChanged));
}

void OnClose(virConnectPtr conn, int reason, void* opaque) {
  MutexLock l(&LiveMutex());
  auto* self = static_cast<LibvirtHypervisor*>(opaque);
  if (LiveSet().count(self) != 0) self->OnClosed(conn, reason);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LibvirtHypervisor>> LibvirtHypervisor::Connect(
    const LibvirtOptions& options) {
  if (absl::Status s = EnsureEventLoop(); !s.ok()) return s;
  std::unique_ptr<LibvirtHypervisor> hv(new LibvirtHypervisor(options));
  {
    MutexLock l(&LiveMutex());
    LiveSet().insert(hv.get());
  }
  if (options.connect_in_background) {
    MutexLock l(&hv->reconnect_mu_);
    hv->lost_ = true;
    hv->never_connected_ = true;
    Log(LogLevel::kInfo, "libvirt_connecting",
        {{"uri", options.uri}, {"in_background", true}});
  } else {
    MutexLock l(&hv->mu_);
    if (absl::Status s = hv->OpenLocked(); !s.ok()) return s;
  }
  hv->reconnect_thread_ = std::thread([p = hv.get()] { p->ReconnectLoop(); });
  return hv;
}

LibvirtHypervisor::LibvirtHypervisor(LibvirtOptions options)
    : options_(std::move(options)) {}

LibvirtHypervisor::~LibvirtHypervisor() {
  {
    MutexLock l(&LiveMutex());
    LiveSet().erase(this);
  }
  SetEventHandler(nullptr);
  {
    MutexLock l(&reconnect_mu_);
    stop_ = true;
  }
  reconnect_cv_.NotifyAll();
  if (reconnect_thread_.joinable()) reconnect_thread_.join();
  MutexLock l(&mu_);
  CloseLocked();
}

void LibvirtHypervisor::SetEventHandler(EventHandler handler) {
  MutexLock l(&handler_mu_);
  handler_ = std::move(handler);
}

void LibvirtHypervisor::Emit(const DomainEvent& event) {
  MutexLock l(&handler_mu_);
  if (handler_) handler_(event);
}

void LibvirtHypervisor::OnClosed(virConnectPtr /*conn*/, int reason) {
  connected_ = false;
  Log(LogLevel::kWarn, "libvirt_closed",
      {{"uri", options_.uri}, {"reason", reason}});
  {
    MutexLock l(&reconnect_mu_);
    lost_ = true;
  }
  reconnect_cv_.NotifyAll();
}

absl::Status LibvirtHypervisor::OpenLocked() {
  conn_ = virConnectOpen(options_.uri.c_str());
  if (conn_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot connect to libvirt at '",
                                               options_.uri,
                                               "': ", LastErrorMessage()));
  }
  // Keepalive needs the event loop; it makes a hung daemon visible.
  virConnectSetKeepAlive(conn_, options_.keepalive_interval_s,
                         options_.keepalive_count);
  virConnectRegisterCloseCallback(conn_, OnClose, this, nullptr);
  struct Reg {
    int id;
    virConnectDomainEventGenericCallback cb;
  };
  const Reg regs[] = {
      {VIR_DOMAIN_EVENT_ID_LIFECYCLE, VIR_DOMAIN_EVENT_CALLBACK(OnLifecycle)},
      {VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED,
       VIR_DOMAIN_EVENT_CALLBACK(OnDeviceRemoved)},
      {VIR_DOMAIN_EVENT_ID_DEVICE_REMOVAL_FAILED,
       VIR_DOMAIN_EVENT_CALLBACK(OnDeviceRemovalFailed)},
      {VIR_DOMAIN_EVENT_ID_METADATA_CHANGE,
       VIR_DOMAIN_EVENT_CALLBACK(OnMetadataChange)},
  };
  for (const Reg& r : regs) {
    const int id = virConnectDomainEventRegisterAny(conn_, nullptr, r.id, r.cb,
                                                    this, nullptr);
    if (id < 0) {
      absl::Status s = LastError("register libvirt domain events");
      CloseLocked();
      return s;
    }
    callback_ids_.push_back(id);
  }
  connected_ = true;
  Log(LogLevel::kInfo, "libvirt_connected", {{"uri", options_.uri}});
  return absl::OkStatus();
}

void LibvirtHypervisor::CloseLocked() {
  connected_ = false;
  if (conn_ == nullptr) return;
  for (int id : callback_ids_) virConnectDomainEventDeregisterAny(conn_, id);
  callback_ids_.clear();
  virConnectUnregisterCloseCallback(conn_, OnClose);
  virConnectClose(conn_);
  conn_ = nullptr;
}

void LibvirtHypervisor::ReconnectLoop() {
  for (;;) {
    bool first = false;
    {
      MutexLock l(&reconnect_mu_);
      while (!stop_ && !lost_) reconnect_cv_.Wait(&reconnect_mu_);
      if (stop_) return;
      lost_ = false;
      first = never_connected_;
    }
    if (!first) {
      DomainEvent lost;
      lost.kind = DomainEvent::Kind::kConnectionLost;
      Emit(lost);
      MutexLock l(&mu_);
      CloseLocked();
    }
    auto backoff = options_.min_backoff;
    for (int attempt = 1;; ++attempt) {
      absl::Status s;
      {
        MutexLock l(&mu_);
        s = OpenLocked();
      }
      if (s.ok()) {
        if (first) {
          MutexLock l(&reconnect_mu_);
          never_connected_ = false;
        } else {
          ++reconnects_;
          Log(LogLevel::kInfo, "libvirt_reconnected",
              {{"uri", options_.uri}, {"attempts", attempt}});
        }
        DomainEvent back;
        back.kind = DomainEvent::Kind::kReconnected;
        Emit(back);
        break;
      }
      Log(LogLevel::kWarn,
          first ? "libvirt_connect_failed" : "libvirt_reconnect_failed",
          {{"uri", options_.uri},
           {"attempt", attempt},
           {"retry_ms", static_cast<int64_t>(backoff.count())},
           {"error", s.message()}});
      const auto retry_at = std::chrono::steady_clock::now() + backoff;
      MutexLock l(&reconnect_mu_);
      while (!stop_ && reconnect_cv_.WaitUntil(&reconnect_mu_, retry_at)) {
      }
      if (stop_) return;
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
  }
}

namespace {

// Between a lost connection and the reconnect every call fails at once.
absl::Status NeedConnection(virConnectPtr conn, const std::string& uri) {
  if (conn != nullptr) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("not connected to libvirt at '", uri, "' (reconnecting)"));
}

// The named domain in `*h`, or why not (no connection, no such domain).
absl::Status LookUp(virConnectPtr conn, const std::string& uri,
                    const std::string& name, DomainHandle* h) {
  if (absl::Status s = NeedConnection(conn, uri); !s.ok()) return s;
  h->dom = virDomainLookupByName(conn, name.c_str());
  if (h->dom == nullptr) return LastError(absl::StrCat("domain '", name, "'"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<DomainSummary>> LibvirtHypervisor::ListDomains() {
  MutexLock l(&mu_);
  if (absl::Status s = NeedConnection(conn_, options_.uri); !s.ok()) return s;
  virDomainPtr* doms = nullptr;
  const int n = virConnectListAllDomains(conn_, &doms, 0);
  if (n < 0) return LastError("list domains");
  std::vector<DomainSummary> out;
  for (int i = 0; i < n; ++i) {
    DomainSummary d;
    const char* name = virDomainGetName(doms[i]);
    d.name = name != nullptr ? name : "";
    char uuid[VIR_UUID_STRING_BUFLEN] = {};
    if (virDomainGetUUIDString(doms[i], uuid) == 0) d.uuid = uuid;
    d.active = virDomainIsActive(doms[i]) == 1;
    d.persistent = virDomainIsPersistent(doms[i]) == 1;
    out.push_back(std::move(d));
    virDomainFree(doms[i]);
  }
  free(doms);  // NOLINT(cppcoreguidelines-no-malloc): libvirt allocates it
  return out;
}

absl::StatusOr<DomainSummary> LibvirtHypervisor::GetDomain(
    const std::string& name) {
  MutexLock l(&mu_);
  DomainHandle h;
  if (absl::Status s = LookUp(conn_, options_.uri, name, &h); !s.ok()) {
    return s;
  }
  DomainSummary d;
  d.name = name;
  char uuid[VIR_UUID_STRING_BUFLEN] = {};
  if (virDomainGetUUIDString(h.dom, uuid) == 0) d.uuid = uuid;
  d.active = virDomainIsActive(h.dom) == 1;
  d.persistent = virDomainIsPersistent(h.dom) == 1;
  return d;
}

absl::StatusOr<std::string> LibvirtHypervisor::GetXml(const std::string& name,
                                                      bool inactive) {
  MutexLock l(&mu_);
  DomainHandle h;
  if (absl::Status s = LookUp(conn_, options_.uri, name, &h); !s.ok()) {
    return s;
  }
  char* xml =
      // SECURE: the persistent XML is what DefineXml writes back (with a
      // tmem change), and without it libvirt leaves out passwords such as
      // a VNC one, which a redefinition would then drop.
      virDomainGetXMLDesc(
          h.dom,
          inactive ? VIR_DOMAIN_XML_INACTIVE | VIR_DOMAIN_XML_SECURE : 0);
  if (xml == nullptr) return LastError(absl::StrCat("XML of '", name, "'"));
  std::string out(xml);
  free(xml);  // NOLINT(cppcoreguidelines-no-malloc)
  return out;
}

absl::StatusOr<std::optional<std::string>> LibvirtHypervisor::GetMetadata(
    const std::string& name, bool inactive) {
  MutexLock l(&mu_);
  DomainHandle h;
  if (absl::Status s = LookUp(conn_, options_.uri, name, &h); !s.ok()) {
    return s;
  }
  const std::string uri(kTmemMetadataUri);
  char* xml = virDomainGetMetadata(
      h.dom, VIR_DOMAIN_METADATA_ELEMENT, uri.c_str(),
      inactive ? VIR_DOMAIN_AFFECT_CONFIG : VIR_DOMAIN_AFFECT_CURRENT);
  if (xml == nullptr) {
    virErrorPtr e = virGetLastError();
    if (e != nullptr && e->code == VIR_ERR_NO_DOMAIN_METADATA) {
      return std::optional<std::string>();
    }
    return LastError(absl::StrCat("metadata of '", name, "'"));
  }
  std::string out(xml);
  free(xml);  // NOLINT(cppcoreguidelines-no-malloc)
  return std::optional<std::string>(std::move(out));
}

absl::Status LibvirtHypervisor::SetMetadata(const std::string& name,
                                            const std::string& xml, bool live,
                                            bool config) {
  MutexLock l(&mu_);
  DomainHandle h;
  if (absl::Status s = LookUp(conn_, options_.uri, name, &h); !s.ok()) {
    return s;
  }
  const std::string uri(kTmemMetadataUri);
  const std::string prefix(kTmemMetadataPrefix);
  if (virDomainSetMetadata(h.dom, VIR_DOMAIN_METADATA_ELEMENT, xml.c_str(),
                           prefix.c_str(), uri.c_str(),
                           AffectFlags(live, config)) < 0) {
    return LastError(absl::StrCat("set metadata of '", name, "'"));
  }
  return absl::OkStatus();
}

absl::Status LibvirtHypervisor::DefineXml(const std::string& xml) {
  MutexLock l(&mu_);
  if (absl::Status s = NeedConnection(conn_, options_.uri); !s.ok()) return s;
  // VALIDATE: libvirt checks the XML against its schema, so a mistake in
  // what tmemd wrote is refused instead of half-understood.
  virDomainPtr dom =
      virDomainDefineXMLFlags(conn_, xml.c_str(), VIR_DOMAIN_DEFINE_VALIDATE);
  if (dom == nullptr) return LastError("define the domain");
  virDomainFree(dom);
  return absl::OkStatus();
}

namespace {

// virDomainAttachDeviceFlags and virDomainDetachDeviceFlags have one shape.
using DeviceCall = int (*)(virDomainPtr, const char*, unsigned int);

}  // namespace

absl::Status LibvirtHypervisor::ChangeDevice(const std::string& name,
                                             const std::string& xml, bool live,
                                             bool config, bool attach) {
  const DeviceCall call =
      attach ? virDomainAttachDeviceFlags : virDomainDetachDeviceFlags;
  MutexLock l(&mu_);
  DomainHandle h;
  if (absl::Status s = LookUp(conn_, options_.uri, name, &h); !s.ok()) {
    return s;
  }
  if (call(h.dom, xml.c_str(), AffectFlags(live, config)) < 0) {
    return LastError(attach ? "virDomainAttachDeviceFlags"
                            : "virDomainDetachDeviceFlags");
  }
  return absl::OkStatus();
}

absl::Status LibvirtHypervisor::AttachDevice(const std::string& name,
                                             const std::string& xml, bool live,
                                             bool config) {
  return ChangeDevice(name, xml, live, config, /*attach=*/true);
}

absl::Status LibvirtHypervisor::DetachDevice(const std::string& name,
                                             const std::string& xml, bool live,
                                             bool config) {
  return ChangeDevice(name, xml, live, config, /*attach=*/false);
}

}  // namespace tmem
