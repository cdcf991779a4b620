#include "host-agent/turn_scheduler.h"

#include <algorithm>

namespace tmem {

TurnScheduler::TurnScheduler(const TurnOptions& options) : options_(options) {}

RingConsumer::DrainResult TurnScheduler::Serve(Rings& rings, size_t i,
                                               uint32_t quantum,
                                               bool others_light) {
  const RingConsumer::DrainResult r = rings.Serve(i, quantum, others_light);
  consumed_ += r.consumed;
  // Backlogged: the quantum was spent and entries are left. A turn that
  // stopped early (ring empty, CQ full, an entry its guest waits on) is
  // light, whatever it consumed.
  const uint8_t now = r.more && r.consumed >= quantum ? 1 : 0;
  if (now != backlogged_[i]) {
    backlogged_count_ += now != 0 ? 1 : -1;
    backlogged_[i] = now;
  }
  return r;
}

void TurnScheduler::LightPass(Rings& rings, size_t skip) {
  for (size_t i = 0; i < backlogged_.size(); ++i) {
    if (i == skip || backlogged_[i] != 0 || !rings.Pending(i)) continue;
    Serve(rings, i, options_.light_quantum);
  }
}

uint64_t TurnScheduler::Round(Rings& rings) {
  const size_t n = rings.size();
  if (n != backlogged_.size()) {
    Forget();
    backlogged_.assign(n, 0);
  }
  consumed_ = 0;
  // Every light ring is served once a round, entries or not: its drain is
  // also where a flush request, a guest restart or impossible indices are
  // noticed, none of which shows as pending entries.
  for (size_t i = 0; i < n; ++i) {
    if (backlogged_[i] == 0) Serve(rings, i, options_.light_quantum);
  }
  for (size_t i = 0; i < n; ++i) {
    // Only rings backlogged when their turn comes; one that turned light
    // was served by the light passes.
    if (backlogged_[i] == 0) continue;
    uint32_t left = options_.batch;
    while (left > 0) {
      // Chunks only while someone is light: with every ring backlogged
      // there is nobody to look at between them.
      const bool others_light = OtherLight();
      const uint32_t quantum =
          others_light ? std::min(options_.chunk, left) : left;
      const RingConsumer::DrainResult r =
          Serve(rings, i, quantum, others_light);
      left -= std::min(r.consumed, left);
      if (others_light) LightPass(rings, i);
      if (backlogged_[i] == 0 || r.consumed == 0) break;
    }
  }
  return consumed_;
}

}  // namespace tmem
