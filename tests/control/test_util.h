// Helpers for the control-plane tests: child processes run to completion
// (tests/process.h has the process and wait helpers), and a throwaway CA
// with server and client certificates made by the openssl CLI.
#ifndef TMEMD_TESTS_CONTROL_TEST_UTIL_H_
#define TMEMD_TESTS_CONTROL_TEST_UTIL_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/process.h"

namespace tmem::testing {

struct RunResult {
  int code = -1;
  std::string output;  // stdout + stderr
};

// GET `path` from 127.0.0.1:`port` (HTTP/1.0); the whole response, or ""
// if the connection is refused. A read waits at most 10 s.
inline std::string HttpGet(int port, const std::string& path = "/metrics") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fd);
  return out;
}

// The integer after " key=" in the last "event=EVENT" line of a tmemd log;
// -1 if there is none.
inline int64_t LogInt(const std::string& log, const std::string& event,
                      const std::string& key) {
  std::istringstream in(log);
  std::string line;
  int64_t v = -1;
  while (std::getline(in, line)) {
    if (line.find("event=" + event) == std::string::npos) continue;
    const size_t at = line.find(" " + key + "=");
    if (at != std::string::npos) {
      v = std::strtoll(line.c_str() + at + key.size() + 2, nullptr, 10);
    }
  }
  return v;
}

inline RunResult Run(const std::vector<std::string>& argv,
                     const std::string& log_path) {
  Process p(argv, log_path);
  RunResult r;
  r.code = p.Wait();
  r.output = p.Log();
  return r;
}

// A CA, a server certificate for localhost/127.0.0.1, client certificates
// with CN "ops-admin" and "monitor", and "ops-admin" signed by a second CA
// the server does not trust.
struct TestCerts {
  std::string dir;
  std::string ca, server_cert, server_key;
  std::string admin_cert, admin_key, monitor_cert, monitor_key;
  std::string rogue_cert, rogue_key;
  std::string error;  // non-empty if openssl failed
};

inline TestCerts MakeTestCerts(const std::string& dir) {
  TestCerts c;
  c.dir = dir;
  mkdir(dir.c_str(), 0700);
  auto sh = [&](const std::string& cmd) {
    const std::string full =
        "cd '" + dir + "' && " + cmd + " >>openssl.log 2>&1";
    // Called before any test thread exists.
    // NOLINTNEXTLINE(concurrency-mt-unsafe)
    if (c.error.empty() && std::system(full.c_str()) != 0) {
      c.error = "failed: " + cmd + "\n" + ReadFile(dir + "/openssl.log");
    }
  };
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
  std::ofstream(dir + "/server.ext")
      << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
  for (const char* ca : {"ca", "rogue-ca"}) {
    sh(std::string("openssl req -x509 ") + key + " -nodes -keyout " + ca +
       ".key -out " + ca + ".pem -days 2 -subj /CN=tmem-test-" + ca);
  }
  auto leaf = [&](const std::string& name, const std::string& cn,
                  const std::string& ca, const std::string& ext) {
    sh("openssl req " + key + " -nodes -keyout " + name + ".key -out " + name +
       ".csr -subj /CN=" + cn);
    sh("openssl x509 -req -in " + name + ".csr -CA " + ca + ".pem -CAkey " +
       ca + ".key -CAcreateserial -out " + name + ".pem -days 2" +
       (ext.empty() ? "" : " -extfile " + ext));
  };
  leaf("server", "localhost", "ca", "server.ext");
  leaf("admin", "ops-admin", "ca", "");
  leaf("monitor", "monitor", "ca", "");
  leaf("rogue", "ops-admin", "rogue-ca", "");
  c.ca = dir + "/ca.pem";
  c.server_cert = dir + "/server.pem";
  c.server_key = dir + "/server.key";
  c.admin_cert = dir + "/admin.pem";
  c.admin_key = dir + "/admin.key";
  c.monitor_cert = dir + "/monitor.pem";
  c.monitor_key = dir + "/monitor.key";
  c.rogue_cert = dir + "/rogue.pem";
  c.rogue_key = dir + "/rogue.key";
  return c;
}

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_CONTROL_TEST_UTIL_H_
