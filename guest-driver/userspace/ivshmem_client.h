// IvshmemClient: the client side of QEMU 7.2's ivshmem-doorbell server
// protocol, so a userspace program can stand where QEMU stands.
//
// Connect() connects to a UNIX socket and reads the handshake exactly in
// the order tmemd's IvshmemServer (and QEMU's contrib ivshmem-server) sends
// it; each message is one little-endian int64, optionally with one fd
// (SCM_RIGHTS):
//   1. version 0, no fd (any other version is refused, as QEMU does);
//   2. our own peer id (0..65535), no fd;
//   3. -1 with the shared-memory fd;
//   4. per other peer, that peer's id once per vector, each with one
//      eventfd (the peer's doorbells), a peer's messages contiguous;
//   5. our own id once per vector, each with one of our eventfds.
// The handshake is complete after our `vectors`-th own eventfd. tmemd is the
// other of peers {0, 1}: peer 1 when we are peer 0 (tmemd's default, which a
// migratable master=on device needs), else peer 0; it must send exactly
// `vectors` eventfds before ours (a guest doorbell (host << 16) | v lands on
// its eventfd v), so a short host peer is refused.
// Anything else (a wrong value, an fd where none belongs or none where one
// does, more than one fd, a truncated message, EOF, a stall past the
// timeout, more eventfds than vectors) fails Connect with a message that
// says which message was wrong; nothing leaks.
//
// The shared memory is mapped read-write with its size from fstat, which
// must be a non-zero power of two (QEMU asserts that for BAR2).
//
// After the handshake the client never writes to the socket (QEMU never
// does; tmemd drops a client that does) and keeps it open: closing it is how
// the server learns the "VM" went away. PollServer() reads later peer
// connect/disconnect messages without blocking.
//
// Thread safety: Doorbell() and the accessors may be called from any thread
// concurrently; PollServer() and destruction need exclusive access.
#ifndef TMEMD_GUEST_DRIVER_USERSPACE_IVSHMEM_CLIENT_H_
#define TMEMD_GUEST_DRIVER_USERSPACE_IVSHMEM_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "guest-driver/userspace/guest_device.h"
#include "guest-driver/userspace/unique_fd.h"

namespace tmem {

struct IvshmemClientOptions {
  // The device's vectors= (QEMU's -device ivshmem-doorbell,vectors=N).
  int vectors = 1;
  // For connecting and the whole handshake. QEMU itself reads the
  // handshake synchronously and waits forever; a test tool should not.
  std::chrono::milliseconds timeout{5000};
};

class IvshmemClient final : public GuestDevice {
 public:
  // The ivshmem server's peer id for tmemd (the peer guests ring): 1 when
  // our own id is 0, else 0. Valid after Connect.
  int64_t host_peer_id() const { return host_peer_id_; }
  static constexpr int64_t kMaxPeerId = 65535;  // QEMU's IVSHMEM_MAX_PEERS
  static constexpr int kMaxVectors = 64;

  static absl::StatusOr<std::unique_ptr<IvshmemClient>> Connect(
      const std::string& socket_path, const IvshmemClientOptions& options);
  ~IvshmemClient() override;  // unmaps, closes every fd (disconnects)
  IvshmemClient(const IvshmemClient&) = delete;
  IvshmemClient& operator=(const IvshmemClient&) = delete;

  // GuestDevice.
  uint8_t* shm_base() const override { return base_; }
  uint64_t shm_size() const override { return size_; }
  // Writes 1 to peer 0's eventfd for `vector` (what QEMU's ioeventfd does
  // for a BAR0 doorbell write of (0 << 16) | vector). A vector without an
  // eventfd is silently dropped, as QEMU drops it.
  void Doorbell(int vector) override;
  void DoorbellPeer(uint32_t peer, int vector) override;
  int interrupt_fd(int vector) const override;

  int64_t own_id() const { return own_id_; }
  int vectors() const { return vectors_; }
  int socket_fd() const { return socket_.get(); }
  int shm_fd() const { return shm_fd_.get(); }
  // Peer ids with at least one eventfd, ascending (excludes ourselves).
  std::vector<int64_t> peer_ids() const;
  int peer_eventfd_count(int64_t peer) const;

  // Reads whatever the server sent since (peer connected: id + fd; peer
  // gone: id alone), without blocking. UNAVAILABLE once the server hung up;
  // DATA_LOSS on a malformed message.
  absl::Status PollServer();

 private:
  IvshmemClient() = default;

  UniqueFd socket_;
  UniqueFd shm_fd_;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  int64_t own_id_ = -1;
  int vectors_ = 0;
  std::vector<UniqueFd> own_eventfds_;
  std::map<int64_t, std::vector<UniqueFd>> peers_;
  int64_t host_peer_id_ = 0;
  // Bytes of a message PollServer has only partly received (and its fd).
  uint8_t partial_[8] = {};
  size_t partial_len_ = 0;
  UniqueFd partial_fd_;

  friend class IvshmemHandshake;
};

}  // namespace tmem

#endif  // TMEMD_GUEST_DRIVER_USERSPACE_IVSHMEM_CLIENT_H_
