// EtcdTlsFiles -> gRPC channel credentials for etcd, checked before use.
//
// Two TLS setups are accepted: the CA alone (the server is verified, no
// client identity: etcd with user auth or without --client-cert-auth), or
// the CA with a client certificate and its key (etcd's
// --client-cert-auth). A key without a certificate, or either without the
// CA, is refused. Each file is read and parsed with OpenSSL here, so a bad
// file is refused at startup with the setting it came from ("[fleet]
// tls_cert", "--etcd-cert") instead of surfacing later as an anonymous
// handshake failure:
// - the CA bundle: one or more PEM certificates, each a CA (basic
//   constraints CA:TRUE, or a v1 self-signed root);
// - the client certificate: PEM, valid now (not expired, not before its
//   start), allowed for TLS client authentication (extended key usage, if
//   it has one, includes clientAuth: etcd refuses it otherwise);
// - the key: a PEM private key matching the certificate.
// The hostname check is gRPC's: the endpoint's host must be in the
// server certificate's subject alternative names (IP or DNS).
//
// gRPC reports a refused client certificate as a plain UNAVAILABLE
// ("Endpoint read failed": under TLS 1.3 the server's alert comes after the
// client's side of the handshake is done), and a plaintext client at a TLS
// port as "Socket closed". DiagnoseEtcdTls redoes the connection with
// OpenSSL (or a plain socket) to say which it was.
#ifndef TMEMD_HOST_AGENT_FLEET_ETCD_TLS_H_
#define TMEMD_HOST_AGENT_FLEET_ETCD_TLS_H_

#include <grpcpp/security/credentials.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tmem {

struct EtcdTlsFiles {
  std::string cert;  // PEM paths; "" = not set
  std::string key;
  std::string ca;
  // Where each path came from, for errors.
  std::string cert_source = "tls_cert";
  std::string key_source = "tls_key";
  std::string ca_source = "tls_ca";

  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// INVALID_ARGUMENT naming the setting and the file for anything above.
absl::StatusOr<grpc::SslCredentialsOptions> LoadEtcdTls(
    const EtcdTlsFiles& files);

// After a failed call to `endpoint` ("host:port"): connects once (with
// `ssl` when set, else plaintext), waits at most `timeout` for the server's
// first bytes, and says what TLS problem it found -- the server refused
// our certificate (with its alert), our CA does not verify the server's
// certificate or name, the server wants TLS and we spoke plaintext, or we
// asked for TLS and the server speaks plaintext. "" when it found none
// (etcd down, network, or the TLS exchange went fine).
std::string DiagnoseEtcdTls(const std::string& endpoint,
                            const grpc::SslCredentialsOptions* ssl,
                            std::chrono::milliseconds timeout);

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_FLEET_ETCD_TLS_H_
