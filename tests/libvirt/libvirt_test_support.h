// Helpers shared by the tests against real libvirt: a temporary directory,
// an Agent serving it, polling, and a raw libvirt connection the test
// drives domains with (define, start, destroy: tmemd's Hypervisor has no
// such calls on purpose).
#ifndef TMEMD_TESTS_LIBVIRT_LIBVIRT_TEST_SUPPORT_H_
#define TMEMD_TESTS_LIBVIRT_LIBVIRT_TEST_SUPPORT_H_

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

namespace tmem {

// Polls `pred` every 20 ms until it holds or `timeout` passes.
inline bool WaitFor(const std::function<bool()>& pred,
                    std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

inline std::string VirError() {
  virErrorPtr e = virGetLastError();
  return e != nullptr && e->message != nullptr ? e->message : "(no error)";
}

// A raw connection for driving domains; closes on destruction.
class RawConnection {
 public:
  explicit RawConnection(const std::string& uri)
      : conn_(virConnectOpen(uri.c_str())) {}
  ~RawConnection() {
    if (conn_ != nullptr) virConnectClose(conn_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  virConnectPtr get() const { return conn_; }

  // Runs f on the named domain; false (with libvirt's error) if absent.
  bool With(const std::string& name, const std::function<int(virDomainPtr)>& f,
            std::string* error = nullptr) {
    virDomainPtr d = virDomainLookupByName(conn_, name.c_str());
    if (d == nullptr) {
      if (error != nullptr) *error = VirError();
      return false;
    }
    const int rc = f(d);
    if (rc < 0 && error != nullptr) *error = VirError();
    virDomainFree(d);
    return rc >= 0;
  }
  bool Define(const std::string& xml, std::string* error = nullptr) {
    virDomainPtr d = virDomainDefineXML(conn_, xml.c_str());
    if (d == nullptr) {
      if (error != nullptr) *error = VirError();
      return false;
    }
    virDomainFree(d);
    return true;
  }
  // Destroys (if running) and undefines; quiet when the domain is absent.
  void Remove(const std::string& name) {
    With(name, [](virDomainPtr d) {
      if (virDomainIsActive(d) == 1) virDomainDestroy(d);
      if (virDomainIsPersistent(d) == 1) virDomainUndefine(d);
      return 0;
    });
  }

 private:
  virConnectPtr conn_;
};

}  // namespace tmem

#endif  // TMEMD_TESTS_LIBVIRT_LIBVIRT_TEST_SUPPORT_H_
