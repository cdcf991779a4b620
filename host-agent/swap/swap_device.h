// SwapDevice: one VM's vhost-user-blk swap device. A listening UNIX socket
// (bound through PrivateSocketDir: private directory, mode and owner set
// before the path appears), one front-end connection at a time, and one
// thread running an epoll loop over the listener, the connection and the
// queues' kick eventfds.
//
// Contract:
//  * Start binds and listens before it returns (QEMU never retries a
//    refused connection), then serves until Stop or destruction.
//  * A second connection while one is served is closed at once (counted).
//  * Every message is read whole (header, then exactly the payload it
//    announces, at most kVhostUserMaxPayload) with its descriptors, parsed
//    and handled by the VhostUserBlkSession. A malformed or refused message
//    drops the connection: the session is reset (memory unmapped, eventfds
//    closed), counted, and logged with the reason; the backing keeps every
//    page, so a reconnecting front-end finds the same disk.
//  * A front-end that stalls mid-message is dropped after
//    kMessageTimeout; the loop never waits on it longer.
//  * Kicks run the queue to empty on the loop thread: control messages and
//    requests never run concurrently, so a memory table is never replaced
//    under a request.
// Thread-safe: Start/Stop from one owner thread; metrics() and
// connected() from any thread.
#ifndef TMEMD_HOST_AGENT_SWAP_SWAP_DEVICE_H_
#define TMEMD_HOST_AGENT_SWAP_SWAP_DEVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/statusor.h"
#include "host-agent/channel/socket_file.h"
#include "host-agent/swap/swap_backing.h"
#include "host-agent/swap/swap_metrics.h"
#include "host-agent/swap/virtio_blk.h"

namespace tmem::swap {

struct SwapDeviceOptions {
  std::string socket_path;
  SocketFileMode socket_mode;
  BlkDeviceConfig blk;  // capacity_sectors is taken from the backing
  // Called on the loop thread for every dropped connection and refused
  // client, with a short event name and the reason (tmemd logs it). May be
  // empty.
  std::function<void(std::string_view event, std::string_view reason)> on_event;
  // Called on the loop thread after each pass over a queue with the CPU
  // that pass took (CLOCK_THREAD_CPUTIME_ID: ring walking, copies,
  // compression, the completion interrupt; not the time blocked in disk
  // I/O), so tmemd charges the VM's swap work to its CPU budget as it does
  // its ring work. May be empty.
  std::function<void(int64_t cpu_nanos)> charge_cpu;
};

inline constexpr std::chrono::seconds kMessageTimeout{5};

class SwapDevice {
 public:
  // `backing` must outlive the device.
  static absl::StatusOr<std::unique_ptr<SwapDevice>> Start(
      SwapDeviceOptions options, SwapBacking* backing);
  ~SwapDevice();
  SwapDevice(const SwapDevice&) = delete;
  SwapDevice& operator=(const SwapDevice&) = delete;

  // Stops serving: the connection is closed and the socket stops
  // listening (a connect is refused; the path stays until destruction).
  void Stop();
  const SwapMetrics& metrics() const { return metrics_; }
  bool connected() const { return connected_.load(); }
  const std::string& socket_path() const { return options_.socket_path; }

 private:
  SwapDevice(SwapDeviceOptions options, SwapBacking* backing);
  void Loop();

  SwapDeviceOptions options_;
  SwapBacking* const backing_;
  SwapMetrics metrics_;
  int listen_fd_ = -1;
  bool published_ = false;  // the socket path is ours
  int stop_fd_ = -1;        // eventfd: wakes the loop to exit
  std::atomic<bool> connected_{false};
  std::thread thread_;
};

}  // namespace tmem::swap

#endif  // TMEMD_HOST_AGENT_SWAP_SWAP_DEVICE_H_
