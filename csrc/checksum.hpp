#pragma once
#include <cstddef>
#include <cstdint>

namespace moeinf {

// Position-weighted 64-bit word sum ("fletcher64w"): s1 = sum(w_i), s2 = sum((i + 1) * w_i), both mod 2^64,
// over little-endian uint64 words; result = s1 ^ (s2 * 0x9E3779B97F4A7C15). Cheap enough to verify every
// read at SSD speed, and order-sensitive. `size` must be a multiple of 8 (expert blobs are 4 KiB-aligned).
// moeinf/store/checksum.py computes the same value with numpy.
uint64_t checksum(const void* data, size_t size);

// The two sums of a blob, accumulated piece by piece: both are plain sums over words, so the pieces of one
// blob (e.g. the chunks of a read) can be added in any order, each knowing the index of its first word.
struct ChecksumParts {
  uint64_t s1 = 0;
  uint64_t s2 = 0;

  // Adds the words of `data` (size a multiple of 8), whose first word is word `first_word` of the blob.
  void add(const void* data, size_t size, uint64_t first_word);
  void merge(const ChecksumParts& other) {
    s1 += other.s1;
    s2 += other.s2;
  }
  uint64_t finish() const;
};

}  // namespace moeinf
