#include "backend/page_codec.h"

#include <lz4.h>

#include <cstring>

namespace tmem {

bool DetectSameFilled(ConstPage page, uint64_t* word) {
  // A page is one repeated 64-bit word exactly when it equals itself shifted
  // by 8 bytes. memcmp is glibc's vectorized compare, and data pages (the
  // common case) differ within the first bytes, so it exits at once.
  if (std::memcmp(page.data(), page.data() + sizeof(uint64_t),
                  kPageSize - sizeof(uint64_t)) != 0) {
    return false;
  }
  std::memcpy(word, page.data(), sizeof(*word));
  return true;
}

void FillPage(uint64_t word, MutablePage out) {
  if (word == 0) {
    std::memset(out.data(), 0, kPageSize);
    return;
  }
  for (size_t off = 0; off < kPageSize; off += sizeof(word)) {
    std::memcpy(out.data() + off, &word, sizeof(word));
  }
}

size_t CompressPage(ConstPage page, std::span<uint8_t> out) {
  static_assert(kMaxCompressedPage >=
                static_cast<size_t>(LZ4_COMPRESSBOUND(kPageSize)));
  int n = LZ4_compress_default(reinterpret_cast<const char*>(page.data()),
                               reinterpret_cast<char*>(out.data()),
                               static_cast<int>(kPageSize),
                               static_cast<int>(out.size()));
  return n > 0 ? static_cast<size_t>(n) : 0;
}

bool DecompressPage(std::span<const uint8_t> block, MutablePage out) {
  int n = LZ4_decompress_safe(reinterpret_cast<const char*>(block.data()),
                              reinterpret_cast<char*>(out.data()),
                              static_cast<int>(block.size()),
                              static_cast<int>(kPageSize));
  return n == static_cast<int>(kPageSize);
}

}  // namespace tmem
