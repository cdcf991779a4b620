// IvshmemServer against a real QEMU 7.2 ivshmem-doorbell device.
//
// QEMU reads the server's handshake synchronously while it realizes the
// device, so the server runs its accept/handshake loop in a thread (as the
// worker's epoll loop will) while QEMU starts.
//
// DeviceRealizes...: the VM starts paused (-S); over QMP the test checks
// that the device was realized (vendor 1af4, device 1110) and that BAR2 has
// exactly the size of tmemd's region, i.e. QEMU accepted the handshake, the
// sealed memfd and the eventfds. It then lets the firmware map the BARs and
// reads guest-physical memory (HMP xp): BAR2 shows the region header and
// tmemd's writes, BAR0's IVPosition is 1. QEMU is killed: the server must
// notice the hangup and attach a restarted QEMU.
//
// GuestDoorbell...: Debian's QEMU has no qtest accelerator, so a tiny
// multiboot guest (hand-assembled, below) plays the driver: it rings
// doorbells (0 << 16) | v, which must land on doorbell_fd(v); NotifyGuest(v)
// must be consumed by QEMU from the VM's own eventfd v.
//
// Needs qemu-system-x86_64 (Debian package qemu-system-x86); skipped, with
// a message, only when it is not installed. TCG only, never KVM.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "host-agent/channel/channel_metrics.h"
#include "host-agent/channel/ivshmem_server.h"
#include "host-agent/channel/region_layout.h"
#include "host-agent/channel/shared_region.h"
#include "proto/tmem_abi.h"
#include "tests/temp_dir.h"

namespace tmem {
namespace {

// strerror is not thread-safe (clang-tidy concurrency-mt-unsafe).
std::string ErrnoText(int err = errno) {
  char buf[256];
  return strerror_r(err, buf, sizeof(buf));  // GNU: returns the message
}

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr uint64_t kRegionBytes = uint64_t{2} << 20;
constexpr int kVectors = 2;
constexpr uint64_t kIvshmemVendor = 0x1af4;
constexpr uint64_t kIvshmemDevice = 0x1110;
// query-pci's address of a BAR the firmware has not mapped yet.
constexpr uint64_t kUnmappedBar = ~uint64_t{0};
constexpr milliseconds kQemuTimeout{10000};

// ---------------------------------------------------------------------------
// A small JSON reader: enough for QMP replies (objects, arrays, strings,
// numbers, literals). The project has no JSON library, and QMP is the only
// JSON a test reads.
struct Json {
  enum Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = kNull;
  bool boolean = false;
  std::string number;  // as written: QMP's 64-bit addresses exceed a double
  std::string string;
  std::vector<Json> array;
  // Object members, in order: keys[i] names values[i]. (A vector of pairs
  // would need Json complete here; std::vector allows an incomplete type.)
  std::vector<std::string> keys;
  std::vector<Json> values;

  const Json* Find(std::string_view key) const {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return &values[i];
    }
    return nullptr;
  }
  std::optional<uint64_t> Uint(std::string_view key) const {
    const Json* v = Find(key);
    if (v == nullptr || v->type != kNumber) return std::nullopt;
    char* end = nullptr;
    const uint64_t value = std::strtoull(v->number.c_str(), &end, 10);
    if (end != v->number.c_str() + v->number.size()) return std::nullopt;
    return value;
  }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : s_(text) {}

  absl::StatusOr<Json> Parse() {
    Json v;
    if (!Value(&v)) return Error();
    SkipSpace();
    if (pos_ != s_.size()) return Error();
    return v;
  }

 private:
  absl::Status Error() const {
    return absl::InvalidArgumentError(
        absl::StrCat("bad JSON at byte ", pos_, ": ", std::string(s_)));
  }
  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' ||
                                s_[pos_] == '\r' || s_[pos_] == '\n')) {
      ++pos_;
    }
  }
  bool Eat(char c) {
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  bool String(std::string* out) {
    if (!Eat('"')) return false;
    while (pos_ < s_.size()) {
      const char c = s_[pos_++];
      if (c == '"') return true;
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return false;
      const char e = s_[pos_++];
      switch (e) {
        case 'n':
          out->push_back('\n');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'u':  // QMP only escapes control characters; keep a marker
          if (pos_ + 4 > s_.size()) return false;
          pos_ += 4;
          out->push_back('?');
          break;
        default:  // '"', '\\', '/'
          out->push_back(e);
      }
    }
    return false;
  }
  bool Value(Json* v) {
    SkipSpace();
    if (pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '{') {
      ++pos_;
      v->type = Json::kObject;
      if (Eat('}')) return true;
      do {
        std::string key;
        Json member;
        if (!String(&key) || !Eat(':') || !Value(&member)) return false;
        v->keys.push_back(std::move(key));
        v->values.push_back(std::move(member));
      } while (Eat(','));
      return Eat('}');
    }
    if (c == '[') {
      ++pos_;
      v->type = Json::kArray;
      if (Eat(']')) return true;
      do {
        Json element;
        if (!Value(&element)) return false;
        v->array.push_back(std::move(element));
      } while (Eat(','));
      return Eat(']');
    }
    if (c == '"') {
      v->type = Json::kString;
      return String(&v->string);
    }
    if (Literal("true")) {
      v->type = Json::kBool;
      v->boolean = true;
      return true;
    }
    if (Literal("false")) {
      v->type = Json::kBool;
      return true;
    }
    if (Literal("null")) return true;
    const size_t start = pos_;
    while (pos_ < s_.size() &&
           std::strchr("+-0123456789.eE", s_[pos_]) != nullptr) {
      ++pos_;
    }
    if (pos_ == start) return false;
    v->type = Json::kNumber;
    v->number = std::string(s_.substr(start, pos_ - start));
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
};

// ---------------------------------------------------------------------------
// Line-based text over a connected socket (QMP and qtest both are).
class LineChannel {
 public:
  explicit LineChannel(int fd) : fd_(fd) {}
  ~LineChannel() { close(fd_); }
  LineChannel(const LineChannel&) = delete;
  LineChannel& operator=(const LineChannel&) = delete;

  absl::Status Send(const std::string& line) {
    if (send(fd_, line.data(), line.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(line.size())) {
      return absl::ErrnoToStatus(errno, "send to QEMU");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ReadLine(steady_clock::time_point deadline) {
    for (;;) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<milliseconds>(
          deadline - steady_clock::now());
      pollfd pfd{fd_, POLLIN, 0};
      const int ready =
          poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
      if (ready == 0) return absl::DeadlineExceededError("QEMU reply timeout");
      if (ready < 0) {
        if (errno == EINTR) continue;
        return absl::ErrnoToStatus(errno, "poll");
      }
      char chunk[4096];
      const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) return absl::UnavailableError("QEMU closed the connection");
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

 private:
  int fd_;
  std::string buffer_;
};

// QMP over its UNIX socket: one JSON object per line.
class QmpClient {
 public:
  // Connects once QEMU has created the socket; fails early if QEMU exits.
  static absl::StatusOr<std::unique_ptr<QmpClient>> Connect(
      const std::string& path, pid_t qemu, steady_clock::time_point deadline) {
    for (;;) {
      int status = 0;
      if (waitpid(qemu, &status, WNOHANG) == qemu) {
        return absl::AbortedError(absl::StrCat("QEMU exited (status ", status,
                                               ") before opening QMP"));
      }
      const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
      if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) ==
          0) {
        auto client = std::unique_ptr<QmpClient>(new QmpClient(fd));
        // Greeting, then leave capabilities negotiation mode.
        absl::StatusOr<Json> greeting = client->ReadObject(deadline);
        if (!greeting.ok()) return greeting.status();
        if (greeting->Find("QMP") == nullptr) {
          return absl::InternalError("QMP greeting without \"QMP\"");
        }
        absl::StatusOr<Json> caps =
            client->Execute("qmp_capabilities", deadline);
        if (!caps.ok()) return caps.status();
        return client;
      }
      const int err = errno;
      close(fd);
      if (err != ENOENT && err != ECONNREFUSED) {
        return absl::ErrnoToStatus(err, absl::StrCat("connect ", path));
      }
      if (steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("QEMU did not open QMP socket ", path));
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  // Runs a command and returns its "return" value. `arguments` is a JSON
  // object or empty.
  absl::StatusOr<Json> Execute(const std::string& command,
                               steady_clock::time_point deadline,
                               const std::string& arguments = "") {
    std::string request = absl::StrCat(R"({"execute": ")", command, R"(")");
    if (!arguments.empty())
      absl::StrAppend(&request, R"(, "arguments": )", arguments);
    request += "}\n";
    if (absl::Status s = channel_.Send(request); !s.ok()) return s;
    for (;;) {
      absl::StatusOr<Json> reply = ReadObject(deadline);
      if (!reply.ok()) return reply.status();
      if (reply->Find("event") != nullptr) continue;  // asynchronous
      if (const Json* r = reply->Find("return")) return *r;
      return absl::InternalError(
          absl::StrCat("QMP ", command, " failed: ", line_));
    }
  }

 private:
  explicit QmpClient(int fd) : channel_(fd) {}

  absl::StatusOr<Json> ReadObject(steady_clock::time_point deadline) {
    absl::StatusOr<std::string> line = channel_.ReadLine(deadline);
    if (!line.ok()) return line.status();
    line_ = *std::move(line);
    return JsonReader(line_).Parse();
  }

  LineChannel channel_;
  std::string line_;
};

// ---------------------------------------------------------------------------
// The worker's part: accept, handshake, notice hangups -- in its own thread,
// because QEMU blocks on the handshake while it starts.
class ServerThread {
 public:
  explicit ServerThread(IvshmemServer* server)
      : server_(server), stop_(eventfd(0, EFD_CLOEXEC)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~ServerThread() { Stop(); }
  ServerThread(const ServerThread&) = delete;
  ServerThread& operator=(const ServerThread&) = delete;

  void Stop() {
    if (!thread_.joinable()) return;
    const uint64_t one = 1;
    EXPECT_EQ(write(stop_, &one, sizeof(one)), 8);
    thread_.join();
    close(stop_);
  }
  int attaches() const { return attaches_.load(); }
  int drops() const { return drops_.load(); }

 private:
  void Run() {
    for (;;) {
      // A client fd of -1 (none attached) is ignored by poll.
      pollfd fds[3] = {{stop_, POLLIN, 0},
                       {server_->listen_fd(), POLLIN, 0},
                       {server_->client_fd(), POLLIN | POLLRDHUP, 0}};
      if (poll(fds, 3, -1) < 0) {
        if (errno == EINTR) continue;
        ADD_FAILURE() << "poll: " << ErrnoText();
        return;
      }
      if (fds[0].revents != 0) return;
      if (fds[2].revents != 0 && server_->OnClientEvent()) ++drops_;
      if (fds[1].revents != 0 && server_->OnListenReadable()) ++attaches_;
    }
  }

  IvshmemServer* server_;
  int stop_;
  std::atomic<int> attaches_{0};
  std::atomic<int> drops_{0};
  std::thread thread_;
};

bool WaitFor(const std::function<bool()>& done, milliseconds timeout) {
  const auto deadline = steady_clock::now() + timeout;
  while (!done()) {
    if (steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

std::optional<std::string> FindInPath(const std::string& program) {
  // Runs in SetUp, before this test starts any thread.
  const char* path = std::getenv("PATH");  // NOLINT(concurrency-mt-unsafe)
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Starts QEMU with the ivshmem-doorbell device on `socket_path` and the
// machine options `extra`, its output in `log`. The child dies with this
// test (PR_SET_PDEATHSIG), so a failing test leaves no VM behind.
pid_t StartQemu(const std::string& qemu, const std::string& socket_path,
                const std::string& device_options,
                const std::vector<std::string>& extra, const std::string& log) {
  std::vector<std::string> args = {
      qemu,
      "-nodefaults",
      "-no-user-config",
      "-display",
      "none",
      "-m",
      "64",
      "-chardev",
      absl::StrCat("socket,path=", socket_path, ",id=tm0"),
      "-device",
      absl::StrCat("ivshmem-doorbell,chardev=tm0,vectors=", kVectors,
                   ",id=tmem0", device_options),
  };
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    const int out = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int in = open("/dev/null", O_RDONLY);
    if (out < 0 || in < 0) _exit(126);
    dup2(in, 0);
    dup2(out, 1);
    dup2(out, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

struct PciFunction {
  std::string qdev_id;
  uint64_t bar0_address = kUnmappedBar;
  uint64_t bar0_size = 0;
  uint64_t bar2_address = kUnmappedBar;
  uint64_t bar2_size = 0;
};

// Finds the ivshmem device in a query-pci reply.
std::optional<PciFunction> FindIvshmem(const Json& buses) {
  for (const Json& bus : buses.array) {
    const Json* devices = bus.Find("devices");
    if (devices == nullptr) continue;
    for (const Json& dev : devices->array) {
      const Json* id = dev.Find("id");
      if (id == nullptr || id->Uint("vendor") != kIvshmemVendor ||
          id->Uint("device") != kIvshmemDevice) {
        continue;
      }
      PciFunction f;
      if (const Json* q = dev.Find("qdev_id")) f.qdev_id = q->string;
      if (const Json* regions = dev.Find("regions")) {
        for (const Json& r : regions->array) {
          const std::optional<uint64_t> bar = r.Uint("bar");
          const std::optional<uint64_t> size = r.Uint("size");
          const std::optional<uint64_t> address = r.Uint("address");
          if (!bar || !size || !address) continue;
          if (*bar == 0) {
            f.bar0_address = *address;
            f.bar0_size = *size;
          }
          if (*bar == 2) {
            f.bar2_address = *address;
            f.bar2_size = *size;
          }
        }
      }
      return f;
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// A minimal guest: a multiboot image (QEMU's -kernel starts it in 32-bit
// protected mode, flat segments, no paging) that plays tmem_ivshmem.ko's
// part of the device protocol: map the BARs of the ivshmem device at 00:04.0,
// copy IVPosition into the shared memory, ring doorbells, halt.
constexpr uint32_t kGuestLoad = 0x100000;    // multiboot load address
constexpr uint32_t kGuestBar0 = 0xfebf0000;  // free MMIO on pc
constexpr uint32_t kGuestBar2 = 0xfe000000;  // 2 MiB aligned, below BAR0
constexpr uint32_t kGuestReportOffset = kRegionBytes - 8;  // in the region
constexpr uint32_t kGuestPciAddress = 0x80000000u | (4u << 11);  // 00:04.0

class X86Code {
 public:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes_.push_back((v >> (8 * i)) & 0xff);
  }
  void MovEax(uint32_t v) {  // mov eax, imm32
    bytes_.push_back(0xb8);
    U32(v);
  }
  void MovEdx(uint32_t v) {  // mov edx, imm32
    bytes_.push_back(0xba);
    U32(v);
  }
  void OutDxEax() { bytes_.push_back(0xef); }  // out dx, eax
  void LoadEax(uint32_t addr) {                // mov eax, [addr]
    bytes_.push_back(0xa1);
    U32(addr);
  }
  void StoreEax(uint32_t addr) {  // mov [addr], eax
    bytes_.push_back(0xa3);
    U32(addr);
  }
  void Store(uint32_t addr, uint32_t v) {  // mov dword [addr], imm32
    bytes_.push_back(0xc7);
    bytes_.push_back(0x05);
    U32(addr);
    U32(v);
  }
  void HaltForever() {  // cli; hlt; jmp hlt
    for (uint8_t b : {0xfa, 0xf4, 0xeb, 0xfd}) bytes_.push_back(b);
  }
  // PCI configuration mechanism #1 (ports 0xcf8/0xcfc).
  void PciWrite(uint32_t reg, uint32_t v) {
    MovEax(kGuestPciAddress | reg);
    MovEdx(0xcf8);
    OutDxEax();
    MovEax(v);
    MovEdx(0xcfc);
    OutDxEax();
  }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

std::vector<uint8_t> DoorbellGuest() {
  constexpr uint32_t kMagic = 0x1badb002;
  constexpr uint32_t kFlags = 1u << 16;  // load addresses in the header
  constexpr uint32_t kHeaderBytes = 32;
  X86Code image;
  // Multiboot header (file offset 0, loaded at kGuestLoad).
  image.U32(kMagic);
  image.U32(kFlags);
  image.U32(0u - kMagic - kFlags);       // checksum
  image.U32(kGuestLoad);                 // header_addr
  image.U32(kGuestLoad);                 // load_addr
  image.U32(0);                          // load_end_addr: whole file
  image.U32(0);                          // bss_end_addr: none
  image.U32(kGuestLoad + kHeaderBytes);  // entry
  // BAR0 (registers), BAR2 (64-bit shared memory), then memory decoding.
  image.PciWrite(0x10, kGuestBar0);
  image.PciWrite(0x18, kGuestBar2);
  image.PciWrite(0x1c, 0);
  image.PciWrite(0x04, 0x2);
  // IVPosition (BAR0 + 8) into the shared memory, for the host to check.
  image.LoadEax(kGuestBar0 + 8);
  image.StoreEax(kGuestBar2 + kGuestReportOffset);
  // Doorbell (BAR0 + 12) = (peer 0 << 16) | vector: 0 once, 1 twice.
  image.Store(kGuestBar0 + 12, (0u << 16) | 0);
  image.Store(kGuestBar0 + 12, (0u << 16) | 1);
  image.Store(kGuestBar0 + 12, (0u << 16) | 1);
  image.HaltForever();
  return image.bytes();
}

// "0000000000fe800000: 0x4d454d54" (HMP xp /1wx) -> 0x4d454d54.
std::optional<uint32_t> ParseXpWord(const std::string& text) {
  const size_t at = text.find(": 0x");
  if (at == std::string::npos) return std::nullopt;
  return static_cast<uint32_t>(
      std::strtoul(text.c_str() + at + 4, nullptr, 16));
}

class QemuIvshmemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::optional<std::string> qemu = FindInPath("qemu-system-x86_64");
    if (!qemu) {
      GTEST_SKIP() << "qemu-system-x86_64 is not installed (Debian package "
                      "qemu-system-x86; scripts/install-deps.sh installs it)";
    }
    qemu_ = *qemu;
    ASSERT_FALSE(dir_.empty()) << "mkdtemp: " << ErrnoText();
  }

  void TearDown() override {
    for (pid_t pid : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }

  // Starts QEMU (run `n`) while the server thread does the handshake, and
  // checks the device over QMP. Returns QEMU's pid (or -1).
  pid_t StartAndCheck(int n, SharedRegion* region) {
    const std::string qmp_path = absl::StrCat(dir_, "/qmp", n, ".sock");
    const std::string log = absl::StrCat(dir_, "/qemu", n, ".log");
    const pid_t pid =
        StartQemu(qemu_, dir_ + "/vm.sock", "",
                  {"-S", "-machine", "pc,accel=tcg", "-qmp",
                   absl::StrCat("unix:", qmp_path, ",server=on,wait=off")},
                  log);
    EXPECT_GT(pid, 0) << ErrnoText();
    if (pid <= 0) return -1;
    pids_.push_back(pid);

    const auto deadline = steady_clock::now() + kQemuTimeout;
    absl::StatusOr<std::unique_ptr<QmpClient>> qmp =
        QmpClient::Connect(qmp_path, pid, deadline);
    if (!qmp.ok()) {
      ADD_FAILURE() << qmp.status() << "\nQEMU output:\n" << ReadFile(log);
      return pid;
    }
    // Paused (-S): the device exists only if realize, which reads the whole
    // handshake and maps the memfd, succeeded.
    std::optional<PciFunction> dev = QueryIvshmem(qmp->get(), deadline, log);
    if (!dev) return pid;
    EXPECT_EQ(dev->qdev_id, "tmem0");
    EXPECT_EQ(dev->bar0_size, 256u) << "ivshmem register BAR";
    EXPECT_EQ(dev->bar2_size, kRegionBytes)
        << "BAR2 is sized by the memfd QEMU received";

    // Let the firmware run: once it has mapped the BARs, guest-physical
    // BAR2 must be tmemd's memory and BAR0's IVPosition the peer id tmemd
    // assigned to the VM.
    if (absl::StatusOr<Json> r = (*qmp)->Execute("cont", deadline); !r.ok()) {
      ADD_FAILURE() << r.status();
      return pid;
    }
    while (dev && (dev->bar0_address == kUnmappedBar ||
                   dev->bar2_address == kUnmappedBar)) {
      if (steady_clock::now() > deadline) {
        ADD_FAILURE() << "firmware never mapped the ivshmem BARs";
        return pid;
      }
      std::this_thread::sleep_for(milliseconds(20));
      dev = QueryIvshmem(qmp->get(), deadline, log);
    }
    if (!dev) return pid;
    EXPECT_EQ(ReadPhys32(qmp->get(), dev->bar2_address, deadline),
              TMEM_ABI_MAGIC)
        << "BAR2 does not show the region header";
    const uint32_t pattern = 0x600d0000u | static_cast<uint32_t>(n);
    const uint64_t last_word = kRegionBytes - sizeof(uint32_t);
    __atomic_store_n(reinterpret_cast<uint32_t*>(region->base() + last_word),
                     pattern, __ATOMIC_RELEASE);
    EXPECT_EQ(ReadPhys32(qmp->get(), dev->bar2_address + last_word, deadline),
              pattern)
        << "tmemd's writes must be visible to the guest (shared mapping)";
    EXPECT_EQ(ReadPhys32(qmp->get(), dev->bar0_address + 8, deadline), 1u)
        << "IVPosition: the VM is peer 1";
    return pid;
  }

  std::optional<PciFunction> QueryIvshmem(QmpClient* qmp,
                                          steady_clock::time_point deadline,
                                          const std::string& log) {
    absl::StatusOr<Json> pci = qmp->Execute("query-pci", deadline);
    if (!pci.ok()) {
      ADD_FAILURE() << pci.status() << "\nQEMU output:\n" << ReadFile(log);
      return std::nullopt;
    }
    std::optional<PciFunction> dev = FindIvshmem(*pci);
    if (!dev) {
      ADD_FAILURE() << "no 1af4:1110 device in query-pci\nQEMU output:\n"
                    << ReadFile(log);
    }
    return dev;
  }

  // Reads 32 bits of guest-physical memory (MMIO included) through HMP.
  static std::optional<uint32_t> ReadPhys32(QmpClient* qmp, uint64_t address,
                                            steady_clock::time_point deadline) {
    absl::StatusOr<Json> out =
        qmp->Execute("human-monitor-command", deadline,
                     absl::StrCat(R"({"command-line": "xp /1wx 0x)",
                                  absl::Hex(address), R"("})"));
    if (!out.ok()) {
      ADD_FAILURE() << out.status();
      return std::nullopt;
    }
    std::optional<uint32_t> word = ParseXpWord(out->string);
    EXPECT_TRUE(word.has_value()) << "unexpected xp output: " << out->string;
    return word;
  }

  void Kill(pid_t pid) {
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
    std::erase(pids_, pid);
  }

  std::string qemu_;
  tmem::testing::TempDir tmp_{"tmem-qemu"};
  std::string dir_ = tmp_.path();
  std::vector<pid_t> pids_;
};

TEST_F(QemuIvshmemTest, DeviceRealizesWithRegionAndServerSurvivesQemuRestart) {
  absl::StatusOr<RegionLayout> layout = RegionLayout::ForSize(kRegionBytes);
  ASSERT_TRUE(layout.ok()) << layout.status();
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create("tmem-qemu-test", *layout, 1);
  ASSERT_TRUE(region.ok()) << region.status();
  ChannelMetrics metrics;
  IvshmemServerOptions options;
  options.socket_path = dir_ + "/vm.sock";
  options.vectors = kVectors;
  absl::StatusOr<std::unique_ptr<IvshmemServer>> server =
      IvshmemServer::Listen(options, (*region)->fd(), &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  ServerThread loop(server->get());

  // First VM: attaches, device realized on our region.
  const pid_t first = StartAndCheck(1, region->get());
  ASSERT_GT(first, 0);
  EXPECT_EQ(loop.attaches(), 1);
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientsAccepted), 1u);
  const std::string log1 = ReadFile(dir_ + "/qemu1.log");
  EXPECT_EQ(log1.find("ivshmem"), std::string::npos)
      << "QEMU complained about the ivshmem handshake:\n"
      << log1;

  // QEMU dies: the server sees the hangup and is free again.
  Kill(first);
  ASSERT_TRUE(WaitFor([&] { return loop.drops() == 1; }, milliseconds(5000)))
      << "server did not notice QEMU's death";
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientDisconnects), 1u);

  // A restarted VM attaches to the same server, region and eventfds.
  const pid_t second = StartAndCheck(2, region->get());
  ASSERT_GT(second, 0);
  EXPECT_EQ(loop.attaches(), 2);
  Kill(second);
  ASSERT_TRUE(WaitFor([&] { return loop.drops() == 2; }, milliseconds(5000)));

  loop.Stop();
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientsAccepted), 2u);
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientDisconnects), 2u);
  EXPECT_EQ(metrics.Get(ChannelCounter::kHandshakeFailures), 0u);
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientsRejectedBusy), 0u);
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientGarbage), 0u);
  EXPECT_FALSE((*server)->connected());
}

// The doorbell and interrupt paths through the real device, with a guest
// that does what tmem_ivshmem.ko does and nothing else.
TEST_F(QemuIvshmemTest, GuestDoorbellReachesServerAndNotifyReachesDevice) {
  absl::StatusOr<RegionLayout> layout = RegionLayout::ForSize(kRegionBytes);
  ASSERT_TRUE(layout.ok()) << layout.status();
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create("tmem-qemu-test", *layout, 1);
  ASSERT_TRUE(region.ok()) << region.status();
  ChannelMetrics metrics;
  IvshmemServerOptions options;
  options.socket_path = dir_ + "/vm.sock";
  options.vectors = kVectors;
  absl::StatusOr<std::unique_ptr<IvshmemServer>> server_or =
      IvshmemServer::Listen(options, (*region)->fd(), &metrics);
  ASSERT_TRUE(server_or.ok()) << server_or.status();
  IvshmemServer* server = server_or->get();

  const std::string kernel = dir_ + "/guest.bin";
  {
    const std::vector<uint8_t> image = DoorbellGuest();
    std::ofstream f(kernel, std::ios::binary);
    f.write(reinterpret_cast<const char*>(image.data()),
            static_cast<std::streamsize>(image.size()));
    ASSERT_TRUE(f.good());
  }
  const std::string log = dir_ + "/qemu3.log";
  {
    ServerThread loop(server);
    const pid_t pid =
        StartQemu(qemu_, options.socket_path, ",addr=0x4",
                  {"-machine", "pc,accel=tcg", "-kernel", kernel}, log);
    ASSERT_GT(pid, 0) << ErrnoText();
    pids_.push_back(pid);
    ASSERT_TRUE(WaitFor([&] { return loop.attaches() == 1; }, kQemuTimeout))
        << "QEMU never attached\nQEMU output:\n"
        << ReadFile(log);
  }  // from here on this thread drives the server alone

  // The guest rings vector 0 once and vector 1 twice: each doorbell lands
  // on tmemd's eventfd for exactly that vector.
  const uint64_t expected[kVectors] = {1, 2};
  uint64_t rung[kVectors] = {0, 0};
  const auto deadline = steady_clock::now() + kQemuTimeout;
  while ((rung[0] < expected[0] || rung[1] < expected[1]) &&
         steady_clock::now() < deadline) {
    pollfd fds[kVectors] = {{server->doorbell_fd(0), POLLIN, 0},
                            {server->doorbell_fd(1), POLLIN, 0}};
    if (poll(fds, kVectors, 100) <= 0) continue;
    for (int v = 0; v < kVectors; ++v) {
      uint64_t n = 0;
      if ((fds[v].revents & POLLIN) != 0 &&
          read(server->doorbell_fd(v), &n, sizeof(n)) == sizeof(n)) {
        rung[v] += n;
      }
    }
  }
  EXPECT_EQ(rung[0], expected[0]) << "QEMU output:\n" << ReadFile(log);
  EXPECT_EQ(rung[1], expected[1]);
  // Before ringing, the guest copied IVPosition into BAR2: it sees the
  // peer id tmemd assigned, through tmemd's own memory.
  EXPECT_EQ(__atomic_load_n(reinterpret_cast<const uint32_t*>(
                                (*region)->base() + kGuestReportOffset),
                            __ATOMIC_ACQUIRE),
            1u);

  // NotifyGuest(v): QEMU watches the VM's own eventfd v and consumes it.
  // (The guest never enabled MSI-X, so the interrupt itself is dropped:
  // the ring, not the interrupt, is the truth.)
  for (int v = 0; v < kVectors; ++v) {
    server->NotifyGuest(v);
    EXPECT_TRUE(WaitFor(
        [&] {
          pollfd pfd{server->interrupt_fd(v), POLLIN, 0};
          return poll(&pfd, 1, 0) == 0;
        },
        milliseconds(5000)))
        << "QEMU did not consume interrupt " << v;
  }
  EXPECT_EQ(metrics.Get(ChannelCounter::kInterruptsSent), 2u);

  // QEMU dies: the server sees the hangup.
  Kill(pids_.back());
  pollfd hup{server->client_fd(), POLLIN | POLLRDHUP, 0};
  ASSERT_EQ(poll(&hup, 1, 5000), 1);
  EXPECT_TRUE(server->OnClientEvent());
  EXPECT_FALSE(server->connected());
  EXPECT_EQ(metrics.Get(ChannelCounter::kClientDisconnects), 1u);
  EXPECT_EQ(metrics.Get(ChannelCounter::kHandshakeFailures), 0u);
}

}  // namespace
}  // namespace tmem
