// GuestDevice: what the tmem guest frontend needs from an ivshmem-doorbell
// device, and nothing more.
//
// The real implementation is IvshmemClient (a UNIX-socket client that plays
// QEMU); tests implement it over a memfd and eventfds of their own, so
// TmemGuest is tested without any socket. The kernel module has the same
// three things: BAR2, the BAR0 doorbell register and an MSI-X vector.
#ifndef TMEMD_GUEST_DRIVER_USERSPACE_GUEST_DEVICE_H_
#define TMEMD_GUEST_DRIVER_USERSPACE_GUEST_DEVICE_H_

#include <cstdint>

namespace tmem {

class GuestDevice {
 public:
  virtual ~GuestDevice() = default;

  // The shared memory (BAR2), mapped read-write, and its size in bytes.
  virtual uint8_t* shm_base() const = 0;
  virtual uint64_t shm_size() const = 0;
  // Rings the host's doorbell vector `vector` (the guest's BAR0 write of
  // (0 << 16) | vector). Must never block; may be called from any thread.
  virtual void Doorbell(int vector) = 0;
  // The same for peer `peer` (ABI v2: the host says which peer it is in
  // host_peer_id; the register value is (peer << 16) | vector).
  virtual void DoorbellPeer(uint32_t peer, int vector) = 0;
  // An fd that polls readable (eventfd semantics: read 8 bytes to clear)
  // when the host raises interrupt vector `vector`, or -1 when the device
  // has no interrupts (the guest then polls the ring).
  virtual int interrupt_fd(int vector) const = 0;
};

}  // namespace tmem

#endif  // TMEMD_GUEST_DRIVER_USERSPACE_GUEST_DEVICE_H_
