// Page codecs: how a 4096-byte page becomes something smaller, and back.
//
// Pure functions, no state, safe from any thread. Zero-filled and same-filled
// pages (one 64-bit word repeated, 10-20% of stored pages per zswap's
// experience) become an 8-byte "fill word" and no blob at all. Everything else
// is LZ4-compressed; a page whose LZ4 block is larger than the threshold is
// "poorly compressible", and the store's policy keeps it raw or refuses it.
#ifndef TMEMD_BACKEND_PAGE_CODEC_H_
#define TMEMD_BACKEND_PAGE_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "backend/types.h"

namespace tmem {

using ConstPage = std::span<const uint8_t, kPageSize>;
using MutablePage = std::span<uint8_t, kPageSize>;

// Largest LZ4 block a page can produce (LZ4_COMPRESSBOUND(4096)).
inline constexpr size_t kMaxCompressedPage = kPageSize + kPageSize / 255 + 16;

// If every 64-bit word of `page` equals the first, stores it in `*word` and
// returns true. Zero pages are the word 0.
bool DetectSameFilled(ConstPage page, uint64_t* word);

// Fills `out` with `word` repeated.
void FillPage(uint64_t word, MutablePage out);

// LZ4-compresses `page` into `out` (at least kMaxCompressedPage bytes).
// Returns the block size; never fails for a 4096-byte input.
size_t CompressPage(ConstPage page, std::span<uint8_t> out);

// Decompresses an LZ4 block that must expand to exactly one page. Returns
// false on a corrupt block or a wrong decoded size (never reads or writes out
// of bounds).
bool DecompressPage(std::span<const uint8_t> block, MutablePage out);

}  // namespace tmem

#endif  // TMEMD_BACKEND_PAGE_CODEC_H_
