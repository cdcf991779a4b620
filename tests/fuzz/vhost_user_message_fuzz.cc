// libFuzzer target for the vhost-user message parser and the session that
// applies parsed messages (host-agent/swap/vhost_user_message.h,
// vhost_user_session.h).
//
// The front-end controls every byte of a message and how many descriptors
// come with it; tmemd must never crash, read past a message or trip
// ASan/UBSan. The input is a sequence of messages:
//
//   byte 0      descriptor count for this message (mod 10: up to one more
//               than the protocol allows)
//   bytes 1-2   length n of this message (little-endian, capped by input)
//   n bytes     the message as it arrived (header + payload)
//
// Each message goes through ParseVhostUserHeaderSize and
// ParseVhostUserMessage; a parsed one is applied to one session (as the
// device would), with descriptors that are closed pipes' numbers replaced
// by -1 (no real fd: memory tables fail at fstat, which is a refusal path
// the session must survive). Checked: a parsed memory table never has more
// than the limit of regions, parsed config data is exactly its size, and a
// refused message is never answered.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "host-agent/swap/memory_swap_backing.h"
#include "host-agent/swap/swap_metrics.h"
#include "host-agent/swap/vhost_user_message.h"
#include "host-agent/swap/vhost_user_session.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tmem::swap;
  static MemorySwapBacking backing(64);
  SwapMetrics metrics;
  BlkDeviceConfig config;
  config.capacity_sectors = 64 * kSectorsPerPage;
  config.num_queues = 2;
  VhostUserBlkSession session(config, &backing, &metrics);

  size_t pos = 0;
  while (pos + 3 <= size) {
    const size_t fd_count = data[pos] % 10;
    size_t n = data[pos + 1] | (size_t{data[pos + 2]} << 8);
    pos += 3;
    if (n > size - pos) n = size - pos;
    const std::span<const uint8_t> msg(data + pos, n);
    pos += n;

    if (n >= kVhostUserHeaderSize) {
      auto hsize = ParseVhostUserHeaderSize(msg.first(kVhostUserHeaderSize));
      if (hsize.ok() && *hsize > kVhostUserMaxPayload) abort();
    }
    auto parsed = ParseVhostUserMessage(msg, fd_count);
    if (!parsed.ok()) continue;
    if (parsed->regions.size() > kVhostUserMaxRegions) abort();
    if (parsed->request == VhostUserRequest::kSetConfig &&
        parsed->config.data.size() != parsed->config.size) {
      abort();
    }
    std::vector<int> fds(fd_count, -1);
    auto reply = session.HandleMessage(*parsed, std::move(fds));
    if (!reply.ok()) break;  // the device drops the connection here
  }
  return 0;
}
