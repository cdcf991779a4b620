// EvictionListener: what the store tells about every page it evicts (not
// invalidates), so the valve can remember the key as a "ghost" and count a
// later get of it as reuse. Its own header so the valve depends on this
// interface, not on the store.
//
// Thread safety: OnEvicted is called with a store shard lock held, from any
// thread that evicts: it must be quick, must not block and must not call
// back into the store.
#ifndef TMEMD_BACKEND_EVICTION_LISTENER_H_
#define TMEMD_BACKEND_EVICTION_LISTENER_H_

#include <cstdint>

#include "backend/types.h"

namespace tmem {

class EvictionListener {
 public:
  virtual ~EvictionListener() = default;
  virtual void OnEvicted(VmId vm, uint64_t key_hash) = 0;
};

}  // namespace tmem

#endif  // TMEMD_BACKEND_EVICTION_LISTENER_H_
