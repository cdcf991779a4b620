// A real etcd cluster on loopback ports for the fleet tests and the
// propagation benchmark (bench/fleet_propagation_bench.cc): members run
// /usr/bin/etcd (Debian's etcd-server 3.4) with their data on tmpfs
// (/dev/shm when it exists: a loaded shared disk made WAL fsyncs take
// seconds and calls time out), optionally with TLS on the client port and
// client certificates required. Certificates come from the openssl CLI.
//
// Not thread-safe: one owner.
#ifndef TMEMD_TESTS_FLEET_ETCD_CLUSTER_H_
#define TMEMD_TESTS_FLEET_ETCD_CLUSTER_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/process.h"
#include "tests/temp_dir.h"

namespace tmem::testing {

inline constexpr char kEtcdBinary[] = "/usr/bin/etcd";
inline constexpr char kEtcdctlBinary[] = "/usr/bin/etcdctl";

// `count` distinct loopback ports that were free a moment ago. All sockets
// stay bound until every port is chosen: a port closed at once may be handed
// out again by the next bind, and two members on one port make etcd refuse
// the cluster ("has duplicate url").
inline std::vector<int> FreePorts(int count) {
  std::vector<int> fds, ports;
  for (int i = 0; i < count; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      if (fd >= 0) close(fd);
      ports.push_back(-1);
      continue;
    }
    fds.push_back(fd);
    ports.push_back(ntohs(a.sin_port));
  }
  for (int fd : fds) close(fd);
  return ports;
}

inline int FreePort() { return FreePorts(1)[0]; }

// A CA; etcd's server certificate for 127.0.0.1/localhost; a client
// certificate from that CA; and a client certificate from a second CA etcd
// does not trust.
struct EtcdCerts {
  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string rogue_ca, rogue_cert, rogue_key;
  std::string error;  // non-empty if openssl failed
};

inline EtcdCerts MakeEtcdCerts(const std::string& dir) {
  EtcdCerts c;
  auto sh = [&](const std::string& cmd) {
    const std::string full =
        "cd '" + dir + "' && " + cmd + " >>openssl.log 2>&1";
    // Called before the test starts any thread.
    // NOLINTNEXTLINE(concurrency-mt-unsafe)
    if (c.error.empty() && std::system(full.c_str()) != 0) {
      c.error = "failed: " + cmd + "\n" + ReadFile(dir + "/openssl.log");
    }
  };
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
  // etcd 3.4's gateway dials its own gRPC port with the server certificate
  // as a client one, hence clientAuth on it too.
  std::ofstream(dir + "/server.ext")
      << "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
         "extendedKeyUsage=serverAuth,clientAuth\n"
         "keyUsage=critical,digitalSignature\n";
  std::ofstream(dir + "/client.ext") << "extendedKeyUsage=clientAuth\n"
                                        "keyUsage=critical,digitalSignature\n";
  for (const char* ca : {"ca", "rogue-ca"}) {
    sh(std::string("openssl req -x509 ") + key + " -nodes -keyout " + ca +
       ".key -out " + ca + ".pem -days 2 -subj /CN=tmemd-fleet-test-" + ca +
       " -addext basicConstraints=critical,CA:TRUE");
  }
  auto leaf = [&](const std::string& name, const std::string& ca,
                  const std::string& ext) {
    sh("openssl req " + key + " -nodes -keyout " + name + ".key -out " + name +
       ".csr -subj /CN=" + name);
    sh("openssl x509 -req -in " + name + ".csr -CA " + ca + ".pem -CAkey " +
       ca + ".key -CAcreateserial -out " + name + ".pem -days 2 -extfile " +
       ext);
  };
  leaf("server", "ca", "server.ext");
  leaf("client", "ca", "client.ext");
  leaf("rogue", "rogue-ca", "client.ext");
  c.ca = dir + "/ca.pem";
  c.server_cert = dir + "/server.pem";
  c.server_key = dir + "/server.key";
  c.client_cert = dir + "/client.pem";
  c.client_key = dir + "/client.key";
  c.rogue_ca = dir + "/rogue-ca.pem";
  c.rogue_cert = dir + "/rogue.pem";
  c.rogue_key = dir + "/rogue.key";
  return c;
}

class EtcdCluster {
 public:
  // `log_dir` keeps the members' logs; `tls` (may be null) turns on TLS
  // with --client-cert-auth on the client port (peers stay plaintext).
  EtcdCluster(int members, std::string log_dir, const EtcdCerts* tls)
      : log_dir_(std::move(log_dir)), tls_(tls) {
    const std::vector<int> ports = FreePorts(3 * members);
    for (size_t i = 0; i < ports.size(); i += 3) {
      client_ports_.push_back(ports[i]);
      peer_ports_.push_back(ports[i + 1]);
      metrics_ports_.push_back(ports[i + 2]);
    }
    members_.resize(members);
  }

  int size() const { return static_cast<int>(members_.size()); }
  const std::string& data_dir() const { return data_.path(); }
  std::vector<std::string> Endpoints() const {
    std::vector<std::string> e;
    for (int p : client_ports_) e.push_back(absl::StrCat("127.0.0.1:", p));
    return e;
  }
  std::string EndpointList() const { return absl::StrJoin(Endpoints(), ","); }
  // Plain HTTP (also with TLS on): Prometheus text at /metrics.
  int metrics_port(int i) const { return metrics_ports_[i]; }

  void Start(int i) {
    std::vector<std::string> cluster;
    for (int j = 0; j < size(); ++j) {
      cluster.push_back(
          absl::StrCat("m", j, "=http://127.0.0.1:", peer_ports_[j]));
    }
    const std::string scheme = tls_ != nullptr ? "https" : "http";
    const std::string client =
        absl::StrCat(scheme, "://127.0.0.1:", client_ports_[i]);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports_[i]);
    std::vector<std::string> argv = {
        kEtcdBinary, "--name", absl::StrCat("m", i), "--data-dir",
        absl::StrCat(data_.path(), "/m", i), "--listen-client-urls", client,
        // 3.4 checks these against the listen scheme: https with TLS.
        "--advertise-client-urls", client, "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer, "--initial-cluster",
        absl::StrJoin(cluster, ","), "--initial-cluster-token",
        "tmemd-fleet-test", "--initial-cluster-state", "new",
        "--listen-metrics-urls",
        absl::StrCat("http://127.0.0.1:", metrics_ports_[i]),
        // A loaded 2-core machine: slower heartbeats than the default, so
        // a busy moment does not start elections.
        "--heartbeat-interval", "200", "--election-timeout", "2000",
        "--log-level", "warn"};
    if (tls_ != nullptr) {
      argv.insert(argv.end(), {"--client-cert-auth", "--trusted-ca-file",
                               tls_->ca, "--cert-file", tls_->server_cert,
                               "--key-file", tls_->server_key});
    }
    members_[i] = std::make_unique<Process>(
        argv, absl::StrCat(log_dir_, "/etcd", i, "-", ++runs_, ".log"));
  }
  void StartAll() {
    for (int i = 0; i < size(); ++i) Start(i);
  }
  Process& member(int i) { return *members_[i]; }
  void Kill(int i) {
    if (members_[i] && members_[i]->Running()) {
      kill(members_[i]->pid(), SIGKILL);
      members_[i]->Wait();
    }
  }
  void KillAll() {
    for (int i = 0; i < size(); ++i) Kill(i);
  }

 private:
  std::string log_dir_;
  const EtcdCerts* tls_;
  TempDir data_{"tmemd-etcd",
                PathExists("/dev/shm") ? std::string("/dev/shm") : "/tmp"};
  std::vector<int> client_ports_, peer_ports_, metrics_ports_;
  std::vector<std::unique_ptr<Process>> members_;
  int runs_ = 0;
};

}  // namespace tmem::testing

#endif  // TMEMD_TESTS_FLEET_ETCD_CLUSTER_H_
