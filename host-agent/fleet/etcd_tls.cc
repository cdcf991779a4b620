#include "host-agent/fleet/etcd_tls.h"

#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tmem {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxFree>;
using SslPtr = std::unique_ptr<SSL, SslFree>;

// OpenSSL's most recent error, then the queue emptied (it is per thread).
std::string OpenSslError() {
  const unsigned long code = ERR_peek_last_error();  // NOLINT(runtime/int)
  ERR_clear_error();
  if (code == 0) return "no PEM block found";
  char text[256] = {};
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

absl::Status Refuse(const std::string& source, const std::string& path,
                    const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("etcd TLS: ", source, " '", path, "': ", why));
}

absl::StatusOr<std::string> ReadFile(const std::string& source,
                                     const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Refuse(source, path, "cannot read it");
  std::stringstream buf;
  buf << in.rdbuf();
  if (buf.str().empty()) return Refuse(source, path, "empty file");
  return buf.str();
}

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

absl::Status CheckCaBundle(const std::string& source, const std::string& path,
                           const std::string& pem) {
  BioPtr bio = MemBio(pem);
  int count = 0;
  for (;;) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (!cert) break;
    ++count;
    if (X509_check_ca(cert.get()) == 0) {
      return Refuse(source, path,
                    absl::StrCat("certificate ", count,
                                 " is not a CA certificate (no basic "
                                 "constraints CA:TRUE)"));
    }
  }
  // The loop ends on "no start line" after the last certificate; anything
  // else is a broken one.
  const unsigned long last = ERR_peek_last_error();  // NOLINT(runtime/int)
  if (last != 0 && ERR_GET_REASON(last) != PEM_R_NO_START_LINE) {
    return Refuse(source, path,
                  absl::StrCat("certificate ", count + 1,
                               " does not parse: ", OpenSslError()));
  }
  ERR_clear_error();
  if (count == 0) {
    return Refuse(source, path, "no PEM certificate in it");
  }
  return absl::OkStatus();
}

absl::StatusOr<X509Ptr> CheckClientCert(const std::string& source,
                                        const std::string& path,
                                        const std::string& pem) {
  BioPtr bio = MemBio(pem);
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (!cert) {
    return Refuse(source, path,
                  absl::StrCat("not a PEM certificate: ", OpenSslError()));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) >= 0) {
    return Refuse(source, path, "not valid yet (notBefore is in the future)");
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) <= 0) {
    return Refuse(source, path, "expired (notAfter is in the past)");
  }
  if (X509_check_purpose(cert.get(), X509_PURPOSE_SSL_CLIENT, 0) != 1) {
    ERR_clear_error();
    return Refuse(source, path,
                  "not allowed for TLS client authentication (its extended "
                  "key usage lacks clientAuth, or its key usage forbids "
                  "signing)");
  }
  return cert;
}

absl::Status CheckKey(const std::string& source, const std::string& path,
                      const std::string& pem, X509* cert,
                      const std::string& cert_source) {
  BioPtr bio = MemBio(pem);
  KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (!key) {
    return Refuse(
        source, path,
        absl::StrCat("not an unencrypted PEM private key: ", OpenSslError()));
  }
  if (X509_check_private_key(cert, key.get()) != 1) {
    ERR_clear_error();
    return Refuse(
        source, path,
        absl::StrCat("does not match the certificate of ", cert_source));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<grpc::SslCredentialsOptions> LoadEtcdTls(
    const EtcdTlsFiles& files) {
  if (files.ca.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd TLS: ", files.cert.empty() ? files.key_source : files.cert_source,
        " needs ", files.ca_source,
        " (the CA that signed etcd's certificate)"));
  }
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd TLS: ", files.cert_source, " and ", files.key_source,
                     " go together (a client certificate and its key)"));
  }
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca = ReadFile(files.ca_source, files.ca);
  if (!ca.ok()) return ca.status();
  if (absl::Status s = CheckCaBundle(files.ca_source, files.ca, *ca); !s.ok()) {
    return s;
  }
  ssl.pem_root_certs = *ca;
  if (files.cert.empty()) return ssl;
  absl::StatusOr<std::string> cert = ReadFile(files.cert_source, files.cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(files.key_source, files.key);
  if (!key.ok()) return key.status();
  absl::StatusOr<X509Ptr> parsed =
      CheckClientCert(files.cert_source, files.cert, *cert);
  if (!parsed.ok()) return parsed.status();
  if (absl::Status s = CheckKey(files.key_source, files.key, *key,
                                parsed->get(), files.cert_source);
      !s.ok()) {
    return s;
  }
  ssl.pem_cert_chain = *cert;
  ssl.pem_private_key = *key;
  return ssl;
}

namespace {

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// "host:port" or "[v6]:port" -> connected socket with send/receive
// timeouts; -1 if that fails (etcd down is not a TLS problem).
int ConnectTo(const std::string& endpoint, std::chrono::milliseconds timeout,
              std::string* host) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos) return -1;
  *host = endpoint.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  const std::string port = endpoint.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host->c_str(), port.c_str(), &hints, &found) != 0) return -1;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // Linux bounds connect() by the send timeout.
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  return fd;
}

std::string DiagnosePlaintext(int fd) {
  // What gRPC sends first. A gRPC server answers with its SETTINGS frame;
  // a TLS server drops the connection (or sends an alert record, 0x15).
  static constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  if (send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL) < 0) return "";
  unsigned char first = 0;
  const ssize_t n = recv(fd, &first, 1, 0);
  if (n == 0 || (n == 1 && first == 0x15)) {
    return "etcd closed a plaintext connection at once: it serves TLS "
           "(https client URLs); give it etcd's CA, and a client "
           "certificate and key if it checks them";
  }
  return "";
}

std::string AlertHint(const grpc::SslCredentialsOptions& ssl) {
  return ssl.pem_cert_chain.empty()
             ? "we sent no client certificate and it requires one "
               "(--client-cert-auth): set a client certificate and key"
             : "it does not accept our client certificate (signed by a CA "
               "it does not trust, or not for client authentication)";
}

}  // namespace

std::string DiagnoseEtcdTls(const std::string& endpoint,
                            const grpc::SslCredentialsOptions* ssl,
                            std::chrono::milliseconds timeout) {
  std::string host;
  Socket sock(ConnectTo(endpoint, timeout, &host));
  if (sock.fd() < 0) return "";
  if (ssl == nullptr) return DiagnosePlaintext(sock.fd());

  ERR_clear_error();
  SslCtxPtr ctx(SSL_CTX_new(TLS_client_method()));
  if (!ctx) return "";
  X509_STORE* store = SSL_CTX_get_cert_store(ctx.get());
  {
    BioPtr bio = MemBio(ssl->pem_root_certs);
    for (;;) {
      X509Ptr ca(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
      if (!ca) break;
      X509_STORE_add_cert(store, ca.get());
    }
  }
  if (!ssl->pem_cert_chain.empty()) {
    BioPtr cert_bio = MemBio(ssl->pem_cert_chain);
    X509Ptr cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
    BioPtr key_bio = MemBio(ssl->pem_private_key);
    KeyPtr key(
        PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
    if (!cert || !key || SSL_CTX_use_certificate(ctx.get(), cert.get()) != 1 ||
        SSL_CTX_use_PrivateKey(ctx.get(), key.get()) != 1) {
      ERR_clear_error();
      return "";
    }
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  static constexpr unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_CTX_set_alpn_protos(ctx.get(), kAlpn, sizeof(kAlpn));
  SslPtr conn(SSL_new(ctx.get()));
  if (!conn) return "";
  X509_VERIFY_PARAM* param = SSL_get0_param(conn.get());
  if (X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) != 1) {
    ERR_clear_error();
    SSL_set_tlsext_host_name(conn.get(), host.c_str());
    X509_VERIFY_PARAM_set1_host(param, host.c_str(), 0);
  }
  SSL_set_fd(conn.get(), sock.fd());
  if (SSL_connect(conn.get()) != 1) {
    const long verify = SSL_get_verify_result(conn.get());  // NOLINT
    const unsigned long err = ERR_peek_last_error();  // NOLINT(runtime/int)
    const std::string reason = OpenSslError();
    if (verify != X509_V_OK) {
      return absl::StrCat(
          "etcd's certificate does not verify against our CA "
          "for '",
          host, "': ", X509_verify_cert_error_string(verify));
    }
    if (ERR_GET_LIB(err) == ERR_LIB_SSL &&
        (ERR_GET_REASON(err) == SSL_R_WRONG_VERSION_NUMBER ||
         ERR_GET_REASON(err) == SSL_R_PACKET_LENGTH_TOO_LONG ||
         ERR_GET_REASON(err) == SSL_R_RECORD_LENGTH_MISMATCH)) {
      return "etcd does not speak TLS here (http client URLs) but we were "
             "given TLS settings";
    }
    if (err != 0) {
      return absl::StrCat("TLS handshake with etcd failed (", reason,
                          "): ", AlertHint(*ssl));
    }
    return "";
  }
  // TLS 1.3: the server checks our certificate after our side is done; its
  // verdict is an alert instead of its first HTTP/2 frame.
  char byte = 0;
  if (SSL_read(conn.get(), &byte, 1) > 0) return "";  // accepted
  const unsigned long err = ERR_peek_last_error();    // NOLINT(runtime/int)
  const std::string reason = OpenSslError();
  if (err != 0 && ERR_GET_LIB(err) == ERR_LIB_SSL) {
    return absl::StrCat("etcd refused the TLS session (", reason,
                        "): ", AlertHint(*ssl));
  }
  return "";
}

}  // namespace tmem
