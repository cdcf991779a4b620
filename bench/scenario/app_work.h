// The scenario guest's application work per page read (a checksum "parse"),
// shared with the driver, which calibrates how many passes make the
// configured microseconds per page on this machine.
#ifndef TMEMD_BENCH_SCENARIO_APP_WORK_H_
#define TMEMD_BENCH_SCENARIO_APP_WORK_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tmem::scenario {

inline constexpr size_t kAppPageSize = 4096;

// `passes` multiply-xor passes over every 8 bytes of the page; each step
// depends on the previous one, so the compiler cannot skip or vectorize it.
inline uint64_t ParsePage(const uint8_t* page, int passes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int p = 0; p < passes; ++p) {
    for (size_t i = 0; i < kAppPageSize; i += 8) {
      uint64_t w;
      std::memcpy(&w, page + i, 8);
      h = (h ^ w) * 0x100000001b3ull;
    }
  }
  return h;
}

}  // namespace tmem::scenario

#endif  // TMEMD_BENCH_SCENARIO_APP_WORK_H_
