#pragma once
#include <cstddef>
#include <cstdint>

namespace moeinf {

// Position-weighted 64-bit word sum ("fletcher64w"): s1 = sum(w_i), s2 = sum((i + 1) * w_i), both mod 2^64,
// over little-endian uint64 words; result = s1 ^ (s2 * 0x9E3779B97F4A7C15). Cheap enough to verify every
// read at SSD speed, and order-sensitive. `size` must be a multiple of 8 (expert blobs are 4 KiB-aligned).
// moeinf/store/checksum.py computes the same value with numpy.
uint64_t checksum(const void* data, size_t size);

}  // namespace moeinf
