#include "backend/clock.h"

namespace tmem {

SteadyClock* SteadyClock::Default() {
  static SteadyClock clock;
  return &clock;
}

}  // namespace tmem
