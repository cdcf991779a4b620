// TurnScheduler: the order in which one worker serves its VMs' rings.
//
// Contract (a VM that floods slows only itself). Every ring is
// either light (its last turn emptied it, or stopped at an entry its guest
// waits on) or backlogged (its last turn ended with entries left and its
// quantum spent). A round serves every light ring once (up to
// `light_quantum` entries; a ring with no entries too, since its drain is
// where flush requests, guest restarts and impossible ring indices are
// noticed), then gives each backlogged ring a turn of up to
// `batch` entries; while any other ring is light, a backlogged turn is cut
// into chunks of `chunk` entries and after each chunk every light ring with
// entries is served again. Hence, for a light ring that posts an entry:
//   - at most `chunk` entries of one backlogged ring, plus `light_quantum`
//     entries of each other light ring, run before it is served;
//   - a guest cannot buy priority: a ring that stays light takes at most
//     `light_quantum` entries per pass, the same as every other light ring,
//     and one that fills its quantum is backlogged and waits for its turn;
//   - backlogged rings share the rest in equal turns of `batch` entries.
// The cost of an entry (a compressed put ~7 us, an empty-pool invalidate
// well under one) is bounded by the store, not here; what the scheduler
// bounds is how many of another VM's entries stand in front of a light
// ring's. The CPU each turn costs is charged by the caller (Rings::Serve).
//
// Not thread-safe: one worker thread owns it.
#ifndef TMEMD_HOST_AGENT_TURN_SCHEDULER_H_
#define TMEMD_HOST_AGENT_TURN_SCHEDULER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "host-agent/channel/ring_consumer.h"

namespace tmem {

struct TurnOptions {
  uint32_t batch = 64;         // a backlogged ring's entries per round
  uint32_t chunk = 1;          // ... between looks at the light rings
  uint32_t light_quantum = 8;  // a light ring's entries per pass
};

class TurnScheduler {
 public:
  // What the scheduler drives: the worker's connected rings, by index.
  class Rings {
   public:
    virtual ~Rings() = default;
    virtual size_t size() const = 0;
    // True if ring `i` has entries the host has not consumed yet.
    virtual bool Pending(size_t i) = 0;
    // Drains up to `max_entries` (>= 1) entries of ring `i` (maybe none).
    // others_light: ring i is backlogged and another ring is light, so
    // its entries' cost stands in front of a VM that may be waiting: work
    // that can wait (compression) should be left for later.
    virtual RingConsumer::DrainResult Serve(size_t i, uint32_t max_entries,
                                            bool others_light) = 0;
  };

  // Every field >= 1 (the worker's configuration is range-checked).
  explicit TurnScheduler(const TurnOptions& options);

  // One round over `rings`; returns how many entries were consumed.
  uint64_t Round(Rings& rings);

  // The set of rings changed (a channel came or went): every ring is light
  // again until its next turn says otherwise.
  void Forget() {
    backlogged_.clear();
    backlogged_count_ = 0;
  }

  // For tests: ring `i` was backlogged at its last turn.
  bool backlogged(size_t i) const {
    return i < backlogged_.size() && backlogged_[i] != 0;
  }

 private:
  // Serves ring `i` and records what its turn says about it.
  RingConsumer::DrainResult Serve(Rings& rings, size_t i, uint32_t quantum,
                                  bool others_light = false);
  // Serves every light ring with entries except `skip` once.
  void LightPass(Rings& rings, size_t skip);
  // True if a ring other than backlogged ring `i` is light.
  bool OtherLight() const { return backlogged_count_ < backlogged_.size(); }

  const TurnOptions options_;
  std::vector<uint8_t> backlogged_;  // per ring index: 1 if backlogged
  size_t backlogged_count_ = 0;      // of backlogged_, the 1s
  uint64_t consumed_ = 0;            // this round
};

}  // namespace tmem

#endif  // TMEMD_HOST_AGENT_TURN_SCHEDULER_H_
