#include "bf16_rows.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOEINF_BF16_X86 1
#define MOEINF_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace moeinf {
namespace {

#ifdef MOEINF_BF16_X86

constexpr size_t kRows = 16;   // outputs per group: one float32 lane each
constexpr size_t kChunk = 32;  // k values per step: one 64-byte line of each of the 16 rows

// r[c] <- lane i of r[c] becomes dword c of the old r[i] (a 16x16 transpose of 32-bit values).
MOEINF_AVX512_BF16 inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3
  for (int g = 0; g < 4; ++g) {
    r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // t[c] (rows 0-7) and t[8 + c] (rows 8-15): lanes 0-1 column c, lanes 2-3 column 8 + c for c < 4; columns
  // 4 + c and 12 + c in t[4 + c], t[12 + c]
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
  }
}

// Outputs [n, n + 16): the header's order of sums.
MOEINF_AVX512_BF16 void rows16(const uint32_t* x_pairs, const uint16_t* w, size_t row_stride, size_t K,
                               size_t k_block, uint16_t* out) {
  __m512 total = _mm512_setzero_ps();
  for (size_t block = 0; block < K; block += k_block) {
    const size_t end = std::min(K, block + k_block);
    __m512 acc = _mm512_setzero_ps();
    for (size_t k = block; k < end; k += kChunk) {
      __m512i r[16];
      for (size_t i = 0; i < kRows; ++i) {
        // the next group's line at this k: each group starts 16 short streams (a row of K = 768 is 24 lines)
        // that the hardware prefetcher would find late; into L2 (T1): 1536x2048 and 2048x768 products
        // ~19 -> 25 and ~13 -> 24 GB/s at two threads, ~13 -> 16 and ~9 -> 20 at one
        _mm_prefetch(reinterpret_cast<const char*>(w + (i + kRows) * row_stride + k), _MM_HINT_T1);
        r[i] = _mm512_loadu_si512(w + i * row_stride + k);
      }
      transpose16(r);
      const uint32_t* pairs = x_pairs + k / 2;
      for (size_t j = 0; j < 16; ++j)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)r[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j])));
    }
    total = block == 0 ? acc : _mm512_add_ps(total, acc);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(total));
}

#endif  // MOEINF_BF16_X86

}  // namespace

bool bf16_rows_supported() {
#ifdef MOEINF_BF16_X86
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
#else
  return false;
#endif
}

void bf16_row_product(const uint16_t* x, const uint16_t* w, size_t row_stride, size_t N, size_t K, uint16_t* out,
                      Workers* workers, size_t k_block) {
  if (!bf16_rows_supported()) throw std::runtime_error("bf16_row_product: this CPU lacks AVX-512 BF16");
  if (N % kRows != 0 || K % kChunk != 0 || k_block == 0 || k_block % kChunk != 0 || row_stride < K)
    throw std::invalid_argument("bf16_row_product: N must be a multiple of 16, K and k_block of 32, rows >= K apart");
#ifdef MOEINF_BF16_X86
  // x's values as the pairs (k, k + 1) the instruction takes: bf16 k in the low half, k + 1 in the high one
  std::vector<uint32_t> pairs(K / 2);
  std::memcpy(pairs.data(), x, K * sizeof(uint16_t));
  const uint32_t* x_pairs = pairs.data();
  const size_t groups = N / kRows;
  auto run = [&](size_t first, size_t end) {
    for (size_t g = first; g < end; ++g) rows16(x_pairs, w + g * kRows * row_stride, row_stride, K, k_block, out + g * kRows);
  };
  const size_t parts = workers == nullptr ? 1 : std::min(workers->size(), groups);
  if (parts <= 1) {
    run(0, groups);
    return;
  }
  const size_t each = (groups + parts - 1) / parts;
  workers->run((groups + each - 1) / each, [&](size_t part) { run(part * each, std::min(groups, (part + 1) * each)); });
#else
  (void)x, (void)w, (void)out, (void)workers;
#endif
}

}  // namespace moeinf
