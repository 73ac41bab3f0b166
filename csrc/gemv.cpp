#include "gemv.hpp"

#include "mla.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "avx2.hpp"

namespace moeinf {
namespace {

#ifdef MOEINF_X86

MOEINF_AVX2 inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

constexpr size_t kInt8Rows = 4;  // rows of q per pass over x: four streams, x's loads shared
// Weights are read once per product, so they are prefetched non-temporally (`_MM_HINT_NTA`): a decoded token
// streams ~100 MB of them at 30B-A3B geometry, and lines fetched for L2/L3 push out what the interpreter and
// torch's dispatch need between products (a torch op between GEMVs took ~10 us where it takes ~2 alone).
// ~0.86-0.94x the CPU time of a token with the prefetches for L1.
constexpr size_t kInt4Ahead = 2048;  // bytes ahead of the int4 stream its prefetch reads
constexpr size_t kQ8Block = 32;  // x values per int8 block (and scale) with `quantise_x`

// Rows [n, n + kInt8Rows) of one x row, K a multiple of 8; prefetches `next` (the following rows' bytes,
// `next_bytes` of them, or nullptr) while it streams its own, so the next block arrives in cache in time.
MOEINF_AVX2 void int8_rows(const float* x, const int8_t* q, size_t K, const int8_t* next, size_t next_bytes,
                           float* sums) {
  __m256 acc[kInt8Rows];
  for (size_t r = 0; r < kInt8Rows; ++r) acc[r] = _mm256_setzero_ps();
  size_t ahead = 0;
  for (size_t k = 0; k < K; k += 8) {
    if (next != nullptr && ahead < next_bytes)
      _mm_prefetch(reinterpret_cast<const char*>(next + ahead), _MM_HINT_NTA);
    ahead += 8 * kInt8Rows;
    __m256 xv = _mm256_loadu_ps(x + k);
    for (size_t r = 0; r < kInt8Rows; ++r) acc[r] = _mm256_fmadd_ps(xv, int8x8(q + r * K + k), acc[r]);
  }
  for (size_t r = 0; r < kInt8Rows; ++r) sums[r] = hsum(acc[r]);
}

// out[n] = x . w[n] for rows [begin, end) of a dense w [N, K] (K a multiple of 8), four rows per pass over x.
// A row's sum does not depend on the rows beside it: any split of the rows gives the same bits.
MOEINF_AVX2 void dense_rows_avx2(const float* x, const void* w, DType type, size_t begin, size_t end, size_t K,
                                 float* out) {
  size_t n = begin;
  for (; n + 4 <= end; n += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t k = 0; k < K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (size_t r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(xv, load8(w, (n + r) * K + k, type), acc[r]);
    }
    for (size_t r = 0; r < 4; ++r) out[n + r] = hsum(acc[r]);
  }
  for (; n < end; ++n) {
    __m256 acc = _mm256_setzero_ps();
    for (size_t k = 0; k < K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w, n * K + k, type), acc);
    out[n] = hsum(acc);
  }
}

// Output rows [begin, end) of every x row; `begin` a multiple of kInt8Rows.
MOEINF_AVX2 void int8_gemv_avx2(const float* x, size_t rows, const int8_t* q, const void* scale, DType type,
                                float* out, size_t N, size_t K, size_t begin, size_t end) {
  const size_t vector_k = K - K % 8, full = end - (end - begin) % kInt8Rows;
  for (size_t m = 0; m < rows; ++m) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    for (size_t n = begin; n < end; n += kInt8Rows) {
      float sums[kInt8Rows] = {};
      size_t count = n < full ? kInt8Rows : end - n;
      if (count == kInt8Rows && vector_k == K) {
        const int8_t* next = n + 2 * kInt8Rows <= end ? q + (n + kInt8Rows) * K : nullptr;
        int8_rows(xm, q + n * K, K, next, kInt8Rows * K, sums);
      } else {
        for (size_t r = 0; r < count; ++r) {
          const int8_t* row = q + (n + r) * K;
          __m256 acc = _mm256_setzero_ps();
          for (size_t k = 0; k < vector_k; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), int8x8(row + k), acc);
          float s = hsum(acc);
          for (size_t k = vector_k; k < K; ++k) s += xm[k] * static_cast<float>(row[k]);
          sums[r] = s;
        }
      }
      for (size_t r = 0; r < count; ++r) om[n + r] = sums[r] * to_float(scale, n + r, type);
    }
  }
}

// The (scale, zero) pairs of rows lo + 4i .. lo + 4i + 3 and hi + 4i .. hi + 4i + 3 of group g (`lo_first` and
// `hi_first` the offsets of rows lo and hi of that group), in the order int4_block's accumulator i holds its rows:
// lo + 4i, hi + 4i, lo + 4i + 1, hi + 4i + 1, ...
MOEINF_AVX2 inline void int4_scales(const void* scale_zero, DType type, size_t lo_first, size_t hi_first, size_t i,
                                    __m256& s, __m256& z) {
  __m256 p = load8(scale_zero, lo_first + 8 * i, type), q = load8(scale_zero, hi_first + 8 * i, type);
  __m256 lo = _mm256_unpacklo_ps(p, q), hi = _mm256_unpackhi_ps(p, q);  // s0 s16 z0 z16 | s2 s18 z2 z18
  s = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
  z = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
}

// Prefetches the (scale, zero) pairs of `rows` consecutive rows from pair `first` (torch's int4 scales
// [groups, N, 2]: pair g * N + n is row n's in group g) into L1.
inline void prefetch_pairs(const void* scale_zero, DType type, size_t first, size_t rows) {
  const size_t bytes = type == DType::Float32 ? 4 : 2;
  const char* at = static_cast<const char*>(scale_zero) + first * 2 * bytes;
  for (size_t line = 0; line < rows * 2 * bytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T0);
}

// 32 rows of torch's int4 packing, as the kernels below read them: for each k, 16 bytes at `block` + k * `stride`
// whose byte j holds row lo + j in its low nibble and row hi + j in its high one. torch packs rows in blocks of
// 32 on AVX2 (one such unit: stride 16, hi = lo + 16) and of 64 on AVX-512 (two units per block, bytes 0-15 and
// 16-31 of each k's 32: stride 32, rows j and 32 + j).
struct Int4Unit {
  const uint8_t* block;
  size_t stride, lo, hi;
};

// Unit u of a packing in blocks of `block_rows` (32 or 64) rows, K inputs.
inline Int4Unit int4_unit(const uint8_t* packed, size_t block_rows, size_t K, size_t u) {
  const size_t halves = block_rows / 32, b = u / halves, h = u % halves;
  const size_t lo = b * block_rows + 16 * h;
  return Int4Unit{packed + b * K * (block_rows / 2) + 16 * h, block_rows / 2, lo, lo + block_rows / 2};
}

// One unit of the int4 layout for one x row; `xsum[g]` the sum of x over group g. The 32-bit word i of a
// k's 16 bytes holds rows lo + 4i, hi + 4i, lo + 4i + 1, hi + 4i + 1, ... in its nibbles from the lowest: shifting
// a broadcast of it by 0, 4, ..., 28 puts them in the lanes of accumulator i, with no byte shuffles (those
// bound the kernel on AVX2). Two sets of accumulators for even and odd k hide the FMA latency.
MOEINF_AVX2 void int4_block(const float* x, const float* xsum, const Int4Unit& unit, const void* scale_zero,
                            DType type, size_t N, size_t K, size_t group, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), nibble = _mm256_set1_epi32(0x0F);
  __m256 total[4];
  for (auto& t : total) t = _mm256_setzero_ps();
  for (size_t g = 0; g < K / group; ++g) {
    __m256 even[4], odd[4];
    for (size_t i = 0; i < 4; ++i) even[i] = odd[i] = _mm256_setzero_ps();
    for (size_t k = g * group; k < (g + 1) * group; k += 2) {
      // k's four words, then k + 1's, each broadcast by a load (an intrinsic's pointer may alias the bytes)
      const float* words = reinterpret_cast<const float*>(unit.block + k * unit.stride);
      const float* words1 = reinterpret_cast<const float*>(unit.block + (k + 1) * unit.stride);
      const __m256 xk = _mm256_broadcast_ss(x + k), xk1 = _mm256_broadcast_ss(x + k + 1);
      for (size_t i = 0; i < 4; ++i) {
        __m256i w = _mm256_castps_si256(_mm256_broadcast_ss(words + i));
        __m256i q = _mm256_and_si256(_mm256_srlv_epi32(w, shifts), nibble);
        even[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), xk, even[i]);
        __m256i w1 = _mm256_castps_si256(_mm256_broadcast_ss(words1 + i));
        __m256i q1 = _mm256_and_si256(_mm256_srlv_epi32(w1, shifts), nibble);
        odd[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), xk1, odd[i]);
      }
    }
    // sum_k x (q - 8) s + z = s * sum_k x q + (z - 8 s) * sum_k x
    const __m256 xs = _mm256_set1_ps(xsum[g]), eight = _mm256_set1_ps(8.0f);
    for (size_t i = 0; i < 4; ++i) {
      __m256 s, z;
      int4_scales(scale_zero, type, (g * N + unit.lo) * 2, (g * N + unit.hi) * 2, i, s, z);
      total[i] = _mm256_fmadd_ps(_mm256_add_ps(even[i], odd[i]), s, total[i]);
      total[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), xs, total[i]);
    }
  }
  for (size_t i = 0; i < 4; ++i) {
    float lanes[8];
    _mm256_storeu_ps(lanes, total[i]);
    for (size_t j = 0; j < 4; ++j) {
      out[unit.lo + 4 * i + j] = lanes[2 * j];
      out[unit.hi + 4 * i + j] = lanes[2 * j + 1];
    }
  }
}

// The last N % block_rows rows of torch's int4 packing (a multiple of 16): byte (k, j) of a [K, rows / 2] array
// holds rows 2j (low nibble) and 2j + 1 of them.
struct Int4Tail {
  const uint8_t* bytes;
  size_t first_row, rows;
  uint8_t nibble(size_t k, size_t j) const {
    const uint8_t byte = bytes[k * (rows / 2) + j / 2];
    return j % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
  }
};

inline Int4Tail int4_tail(const uint8_t* packed, size_t block_rows, size_t N, size_t K) {
  const size_t full = N / block_rows;
  return Int4Tail{packed + full * K * (block_rows / 2), full * block_rows, N % block_rows};
}

// Units [first_unit, end_unit) of every x row (`int4_unit`), and the tail rows if `with_tail`.
MOEINF_AVX2 void int4_gemv_avx2(const float* x, size_t rows, const uint8_t* packed, size_t block_rows,
                                const void* scale_zero, DType type, float* out, size_t N, size_t K, size_t group,
                                size_t first_unit, size_t end_unit, bool with_tail) {
  const size_t groups = K / group;
  const Int4Tail tail = int4_tail(packed, block_rows, N, K);
  std::vector<float> sums(groups);
  for (size_t m = 0; m < rows; ++m) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    for (size_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (size_t k = g * group; k < (g + 1) * group; ++k) s += xm[k];
      sums[g] = s;
    }
    for (size_t u = first_unit; u < end_unit; ++u)
      int4_block(xm, sums.data(), int4_unit(packed, block_rows, K, u), scale_zero, type, N, K, group, om);
    if (!with_tail) continue;
    for (size_t j = 0; j < tail.rows; ++j) {
      float total = 0.0f;
      const size_t n = tail.first_row + j;
      for (size_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (size_t k = g * group; k < (g + 1) * group; ++k) dot += xm[k] * static_cast<float>(tail.nibble(k, j));
        float s = to_float(scale_zero, (g * N + n) * 2, type), z = to_float(scale_zero, (g * N + n) * 2 + 1, type);
        total += s * dot + (z - 8.0f * s) * sums[g];
      }
      om[n] = total;
    }
  }
}


// --- int8 activations (llama.cpp's Q8_0 dot products) ----------------------------------------------------
// An x row rounded to int8 in blocks of kQ8Block values, each with its own scale: the kernels below then
// multiply bytes by bytes (`vpmaddubsw`, 32 products per instruction), where the float path converts every
// weight to float first and is bound by those conversions at one row (not by memory).

// One x row's int8 blocks: `q` [K] and per block its scale `d` and the sum of its `q`.
struct Q8Row {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
};

Q8Row quantise_row(const float* x, size_t K) {
  Q8Row row{std::vector<int8_t>(K), std::vector<float>(K / kQ8Block), std::vector<int32_t>(K / kQ8Block)};
  for (size_t b = 0; b < K / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.0f;
    for (size_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (size_t i = 0; i < kQ8Block; ++i) {
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[i] * inverse)));
      row.q[b * kQ8Block + i] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    row.d[b] = d;
    row.sums[b] = sum;
  }
  return row;
}

// Rows [n, n + kInt8Rows) against one int8 x row: per block, |q| times x with q's signs (unsigned by signed
// bytes), pairs summed to int32, then scaled by the block's d.
MOEINF_AVX2 void int8_rows_q8(const Q8Row& x, const int8_t* q, size_t K, const int8_t* next, size_t next_bytes,
                              float* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kInt8Rows];
  for (size_t r = 0; r < kInt8Rows; ++r) acc[r] = _mm256_setzero_ps();
  size_t ahead = 0;
  for (size_t b = 0; b < K / kQ8Block; ++b) {
    if (next != nullptr && ahead < next_bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(next + ahead), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(next + ahead + 64), _MM_HINT_NTA);
    }
    ahead += kQ8Block * kInt8Rows;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + b * kQ8Block));
    const __m256 d = _mm256_set1_ps(x.d[b]);
    for (size_t r = 0; r < kInt8Rows; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + b * kQ8Block));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), d, acc[r]);
    }
  }
  for (size_t r = 0; r < kInt8Rows; ++r) sums[r] = hsum(acc[r]);
}

MOEINF_AVX2 void int8_gemv_q8(const Q8Row* x, size_t rows, const int8_t* q, const void* scale, DType type, float* out,
                              size_t N, size_t K, size_t begin, size_t end) {
  for (size_t m = 0; m < rows; ++m) {
    float* om = out + m * N;
    for (size_t n = begin; n < end; n += kInt8Rows) {
      float sums[kInt8Rows] = {};
      const size_t count = std::min(kInt8Rows, end - n);
      if (count == kInt8Rows) {
        const int8_t* next = n + 2 * kInt8Rows <= end ? q + (n + kInt8Rows) * K : nullptr;
        int8_rows_q8(x[m], q + n * K, K, next, kInt8Rows * K, sums);
      } else {
        for (size_t r = 0; r < count; ++r) {
          const int8_t* row = q + (n + r) * K;
          for (size_t b = 0; b < K / kQ8Block; ++b) {
            int32_t dot = 0;
            for (size_t i = 0; i < kQ8Block; ++i) dot += int32_t{row[b * kQ8Block + i]} * x[m].q[b * kQ8Block + i];
            sums[r] += x[m].d[b] * static_cast<float>(dot);
          }
        }
      }
      for (size_t r = 0; r < count; ++r) om[n + r] = sums[r] * to_float(scale, n + r, type);
    }
  }
}

// One x row's blocks laid out for int4_block_q8: for each k = 4i, 32 bytes whose low 16 hold the pair
// (x_k, x_{k+2}) eight times and whose high 16 hold (x_{k+1}, x_{k+3}), the bytes `vpmaddubsw` pairs with a
// row's weights at k and k + 2 (low lane) and k + 1 and k + 3 (high lane).
std::vector<uint8_t> quad_pattern(const Q8Row& x, size_t K) {
  std::vector<uint8_t> pattern(K / 4 * 32);
  for (size_t k = 0; k < K; k += 4)
    for (size_t j = 0; j < 8; ++j) {
      uint8_t* p = pattern.data() + k * 8;
      p[2 * j] = static_cast<uint8_t>(x.q[k]);
      p[2 * j + 1] = static_cast<uint8_t>(x.q[k + 2]);
      p[16 + 2 * j] = static_cast<uint8_t>(x.q[k + 1]);
      p[16 + 2 * j + 1] = static_cast<uint8_t>(x.q[k + 3]);
    }
  return pattern;
}

// One unit of the int4 layout against one int8 x row (`pattern` its quad_pattern, `xsum[g]` the sum of the
// rounded x over group g, its d applied). Byte k of row j sits at stride k + j: interleaving the bytes of k,
// k + 1 (one load, or two where the stride is not 16) with those of k + 2, k + 3 puts each row's (k, k + 2) in
// adjacent bytes of the low lane and (k + 1, k + 3) in the high lane, with no lane crossing. Low nibbles
// are rows lo .. lo + 15, high ones hi .. hi + 15. Sums of eight quads (one block of x) fit int16:
// 8 x 2 x 15 x 127.
MOEINF_AVX2 inline __m256i int4_two_ks(const uint8_t* block, size_t stride, size_t k) {
  if (stride == 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + k * 16));
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + k * stride));
  const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (k + 1) * stride));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
}

MOEINF_AVX2 void int4_block_q8(const uint8_t* pattern, const Q8Row& x, const float* xsum, const Int4Unit& unit,
                               const void* scale_zero, DType type, size_t N, size_t K, size_t group, float* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i deinterleave = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 eight = _mm256_set1_ps(8.0f);
  const size_t blocks_per_group = group / kQ8Block;
  __m256 total[4];
  for (auto& t : total) t = _mm256_setzero_ps();
  for (size_t g = 0; g < K / group; ++g) {
    __m256 in_group[4];
    for (auto& t : in_group) t = _mm256_setzero_ps();
    for (size_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m256i acc[4];
      for (auto& a : acc) a = _mm256_setzero_si256();
      for (size_t k = b * kQ8Block; k < (b + 1) * kQ8Block; k += 4) {
        _mm_prefetch(reinterpret_cast<const char*>(unit.block + k * unit.stride + kInt4Ahead), _MM_HINT_NTA);
        const __m256i v = int4_two_ks(unit.block, unit.stride, k);
        const __m256i w = int4_two_ks(unit.block, unit.stride, k + 2);
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pattern + k * 8));
        const __m256i lo = _mm256_unpacklo_epi8(v, w), hi = _mm256_unpackhi_epi8(v, w);
        acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(_mm256_and_si256(lo, nibble), xq));
        acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(_mm256_and_si256(hi, nibble), xq));
        acc[2] = _mm256_add_epi16(acc[2],
                                  _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble), xq));
        acc[3] = _mm256_add_epi16(acc[3],
                                  _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble), xq));
      }
      const __m256 d = _mm256_set1_ps(x.d[b]);
      for (size_t i = 0; i < 4; ++i) {
        // the two lanes hold the same eight rows (k, k + 2 and k + 1, k + 3)
        const __m256i sum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[i])),
                                             _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[i], 1)));
        in_group[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, in_group[i]);
      }
    }
    // sum_k x (q - 8) s + z = s * sum_k x q + (z - 8 s) * sum_k x, for acc[i]'s rows: lo .. lo + 7,
    // lo + 8 .. lo + 15 of the low nibbles, hi .. hi + 7, hi + 8 .. hi + 15 of the high ones
    const __m256 xs = _mm256_set1_ps(xsum[g]);
    if (unit.hi + 48 <= N) {
      // the (scale, zero) pairs of the rows that follow the high ones, a row of pairs away (the next unit's on
      // AVX2's packing): the weights stream in order, these do not (~0.9x the time of the kernel without)
      prefetch_pairs(scale_zero, type, g * N + unit.hi + 16, 32);
    }
    for (size_t i = 0; i < 4; ++i) {
      const size_t first = (g * N + (i < 2 ? unit.lo + 8 * i : unit.hi + 8 * (i - 2))) * 2;
      const __m256 p = _mm256_permutevar8x32_ps(load8(scale_zero, first, type), deinterleave);  // s0-3 z0-3
      const __m256 q = _mm256_permutevar8x32_ps(load8(scale_zero, first + 8, type), deinterleave);
      const __m256 s = _mm256_permute2f128_ps(p, q, 0x20), z = _mm256_permute2f128_ps(p, q, 0x31);
      total[i] = _mm256_fmadd_ps(in_group[i], s, total[i]);
      total[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), xs, total[i]);
    }
  }
  for (size_t i = 0; i < 4; ++i) _mm256_storeu_ps(out + (i < 2 ? unit.lo + 8 * i : unit.hi + 8 * (i - 2)), total[i]);
}

// --- AVX-512 VNNI (int8 products summed straight into int32) ------------------------------------------------
#define MOEINF_AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vnni,avx512vbmi")))

// Whether this CPU runs int4_block_vnni (AVX-512 F/BW/DQ, VNNI and VBMI: Ice Lake, Zen 4 and later).
bool vnni_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vbmi");
  }();
  return supported;
}

// Whether int4 products on int8 rows take int4_block_vnni (where the CPU runs it; `set_int4_avx512`).
std::atomic<bool> int4_vnni{true};

bool use_int4_vnni() { return int4_vnni.load(std::memory_order_relaxed) && vnni_supported(); }

// The (scale, zero) pairs of 16 consecutive rows from `first` (interleaved s, z) as two vectors s and z.
MOEINF_AVX512_VNNI inline void scales16(const void* scale_zero, DType type, size_t first, __m512& s, __m512& z) {
  const __m512 a = _mm512_insertf32x8(_mm512_castps256_ps512(load8(scale_zero, first, type)),
                                      load8(scale_zero, first + 8, type), 1);  // rows 0-7: s0 z0 s1 z1 ...
  const __m512 b = _mm512_insertf32x8(_mm512_castps256_ps512(load8(scale_zero, first + 16, type)),
                                      load8(scale_zero, first + 24, type), 1);  // rows 8-15
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  s = _mm512_permutex2var_ps(a, even, b);
  z = _mm512_permutex2var_ps(a, odd, b);
}

// The byte permutation of four k's 16 bytes (64) into 16 lanes of one row's four bytes each: byte 4j + t of
// the result is byte 16t + j of the input.
alignas(64) constexpr uint8_t kInt4Quads[64] = {
    0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
    6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
    12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};

// int4_block_q8 with AVX-512 VNNI: four k's 16 bytes (64) turned by one byte permutation into 16 lanes of
// one row's four bytes each (`vpermb`), whose low and high nibbles multiply x's four int8 values with their
// sums in int32 (`vpdpbusd`). Its int32 sums are int4_block_q8's, and the float steps after them the same
// in the same order, so the two give the same bits.
MOEINF_AVX512_VNNI void int4_block_vnni(const Q8Row& x, const float* xsum, const Int4Unit& unit,
                                        const void* scale_zero, DType type, size_t N, size_t K, size_t group,
                                        float* out) {
  const __m512i transpose = _mm512_load_si512(kInt4Quads), nibble = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  const size_t blocks_per_group = group / kQ8Block;
  __m512 total_lo = _mm512_setzero_ps(), total_hi = _mm512_setzero_ps();
  for (size_t g = 0; g < K / group; ++g) {
    __m512 in_lo = _mm512_setzero_ps(), in_hi = _mm512_setzero_ps();
    for (size_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512i acc_lo = _mm512_setzero_si512(), acc_hi = _mm512_setzero_si512();
      for (size_t k = b * kQ8Block; k < (b + 1) * kQ8Block; k += 4) {
        const uint8_t* at = unit.block + k * unit.stride;
        _mm_prefetch(reinterpret_cast<const char*>(at + kInt4Ahead), _MM_HINT_NTA);
        __m512i v;
        if (unit.stride == 16) {
          v = _mm512_loadu_si512(at);
        } else {
          v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
          v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + unit.stride)), 1);
          v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 2 * unit.stride)), 2);
          v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 3 * unit.stride)), 3);
        }
        v = _mm512_permutexvar_epi8(transpose, v);
        int32_t quad;
        std::memcpy(&quad, x.q.data() + k, sizeof quad);
        const __m512i xq = _mm512_set1_epi32(quad);
        acc_lo = _mm512_dpbusd_epi32(acc_lo, _mm512_and_si512(v, nibble), xq);
        acc_hi = _mm512_dpbusd_epi32(acc_hi, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), xq);
      }
      const __m512 d = _mm512_set1_ps(x.d[b]);
      in_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_lo), d, in_lo);
      in_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_hi), d, in_hi);
    }
    // sum_k x (q - 8) s + z = s * sum_k x q + (z - 8 s) * sum_k x
    const __m512 xs = _mm512_set1_ps(xsum[g]);
    __m512 s, z;
    scales16(scale_zero, type, (g * N + unit.lo) * 2, s, z);
    total_lo = _mm512_fmadd_ps(in_lo, s, total_lo);
    total_lo = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, s, z), xs, total_lo);
    scales16(scale_zero, type, (g * N + unit.hi) * 2, s, z);
    total_hi = _mm512_fmadd_ps(in_hi, s, total_hi);
    total_hi = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, s, z), xs, total_hi);
  }
  _mm512_storeu_ps(out + unit.lo, total_lo);
  _mm512_storeu_ps(out + unit.hi, total_hi);
}

// Both units of one 64-row block of the AVX-512 packing (stride 32, rows lo .. lo + 63) in one pass over its
// bytes: two 64-byte loads and two lane shuffles per four k's, where int4_block_vnni on each unit takes eight
// 16-byte loads and six inserts (~0.9x the time on experts in cache). Each unit's sums are int4_block_vnni's,
// in the same order: the same bits.
MOEINF_AVX512_VNNI void int4_pair_vnni(const Q8Row& x, const float* xsum, const uint8_t* block, size_t lo,
                                       const void* scale_zero, DType type, size_t N, size_t K, size_t group,
                                       float* out) {
  const __m512i transpose = _mm512_load_si512(kInt4Quads), nibble = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  const size_t blocks_per_group = group / kQ8Block;
  // accumulator i holds rows first[i] .. first[i] + 15: unit 0's low and high nibbles, then unit 1's
  const size_t first[4] = {lo, lo + 32, lo + 16, lo + 48};
  __m512 total[4];
  for (auto& t : total) t = _mm512_setzero_ps();
  for (size_t g = 0; g < K / group; ++g) {
    __m512 in[4];
    for (auto& t : in) t = _mm512_setzero_ps();
    for (size_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512i acc[4];
      for (auto& a : acc) a = _mm512_setzero_si512();
      for (size_t k = b * kQ8Block; k < (b + 1) * kQ8Block; k += 4) {
        const uint8_t* at = block + k * 32;
        _mm_prefetch(reinterpret_cast<const char*>(at + kInt4Ahead), _MM_HINT_NTA);
        _mm_prefetch(reinterpret_cast<const char*>(at + kInt4Ahead + 64), _MM_HINT_NTA);
        // k .. k + 3's 32 bytes each: unit 0's 16 are the low half of each, unit 1's the high half
        const __m512i a = _mm512_loadu_si512(at), c = _mm512_loadu_si512(at + 64);
        const __m512i v0 = _mm512_permutexvar_epi8(transpose, _mm512_shuffle_i64x2(a, c, 0x88));
        const __m512i v1 = _mm512_permutexvar_epi8(transpose, _mm512_shuffle_i64x2(a, c, 0xDD));
        int32_t quad;
        std::memcpy(&quad, x.q.data() + k, sizeof quad);
        const __m512i xq = _mm512_set1_epi32(quad);
        acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_and_si512(v0, nibble), xq);
        acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble), xq);
        acc[2] = _mm512_dpbusd_epi32(acc[2], _mm512_and_si512(v1, nibble), xq);
        acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble), xq);
      }
      const __m512 d = _mm512_set1_ps(x.d[b]);
      for (size_t i = 0; i < 4; ++i) in[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), d, in[i]);
    }
    // sum_k x (q - 8) s + z = s * sum_k x q + (z - 8 s) * sum_k x
    const __m512 xs = _mm512_set1_ps(xsum[g]);
    if (lo + 128 <= N) {
      // the next block's (scale, zero) pairs of group g, a block ahead: torch keeps them [groups, N, 2], so
      // a block's pairs lie a row of pairs apart per group, a stream the hardware does not foresee (the
      // kernel took ~1.25x the time of a cold expert without)
      prefetch_pairs(scale_zero, type, g * N + lo + 64, 64);
    }
    for (size_t i = 0; i < 4; ++i) {
      __m512 s, z;
      scales16(scale_zero, type, (g * N + first[i]) * 2, s, z);
      total[i] = _mm512_fmadd_ps(in[i], s, total[i]);
      total[i] = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, s, z), xs, total[i]);
    }
  }
  for (size_t i = 0; i < 4; ++i) _mm512_storeu_ps(out + first[i], total[i]);
}

// `patterns` (quad_pattern of each x row) for int4_block_q8, or nullptr: int4_block_vnni.
MOEINF_AVX2 void int4_gemv_q8(const Q8Row* x, const std::vector<uint8_t>* patterns, size_t rows,
                              const uint8_t* packed, size_t block_rows, const void* scale_zero, DType type, float* out,
                              size_t N, size_t K, size_t group, size_t first_unit, size_t end_unit, bool with_tail) {
  const size_t groups = K / group, blocks_per_group = group / kQ8Block;
  const Int4Tail tail = int4_tail(packed, block_rows, N, K);
  std::vector<float> sums(groups);
  for (size_t m = 0; m < rows; ++m) {
    const Q8Row& xm = x[m];
    float* om = out + m * N;
    for (size_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (size_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b)
        s += xm.d[b] * static_cast<float>(xm.sums[b]);
      sums[g] = s;
    }
    for (size_t u = first_unit; u < end_unit; ++u) {
      const Int4Unit unit = int4_unit(packed, block_rows, K, u);
      if (patterns == nullptr && block_rows == 64 && u % 2 == 0 && u + 1 < end_unit) {
        int4_pair_vnni(xm, sums.data(), unit.block, unit.lo, scale_zero, type, N, K, group, om);
        ++u;  // the block's second unit too
        continue;
      }
      if (patterns == nullptr)
        int4_block_vnni(xm, sums.data(), unit, scale_zero, type, N, K, group, om);
      else
        int4_block_q8(patterns[m].data(), xm, sums.data(), unit, scale_zero, type, N, K, group, om);
    }
    if (!with_tail) continue;
    for (size_t j = 0; j < tail.rows; ++j) {
      const size_t n = tail.first_row + j;
      float total = 0.0f;
      for (size_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (size_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          int32_t in_block = 0;
          for (size_t k = b * kQ8Block; k < (b + 1) * kQ8Block; ++k) in_block += int32_t{tail.nibble(k, j)} * xm.q[k];
          dot += xm.d[b] * static_cast<float>(in_block);
        }
        const float s = to_float(scale_zero, (g * N + n) * 2, type);
        const float z = to_float(scale_zero, (g * N + n) * 2 + 1, type);
        total += s * dot + (z - 8.0f * s) * sums[g];
      }
      om[n] = total;
    }
  }
}

#endif  // MOEINF_X86

// x as float32: itself, or widened into `wide`.
const float* widened(const void* x, DType type, size_t count, std::vector<float>& wide) {
  if (type == DType::Float32) return static_cast<const float*>(x);
  wide.resize(count);
  for (size_t i = 0; i < count; ++i) wide[i] = to_float(x, i, type);
  return wide.data();
}

// float32 -> bfloat16 or float16, rounding to nearest even (as torch's `.to`).
void narrow(const float* from, DType type, size_t count, void* to) {
  auto* out = static_cast<uint16_t*>(to);
  for (size_t i = 0; i < count; ++i) out[i] = narrow_bits(from[i], type);
}

// Runs `kernel` (float32 in and out) on x and out of `io_type`.
template <typename Kernel>
void in_float32(const void* x, DType io_type, size_t rows, size_t N, size_t K, void* out, Kernel kernel) {
  std::vector<float> wide, result;
  const float* xf = widened(x, io_type, rows * K, wide);
  float* of = io_type == DType::Float32 ? static_cast<float*>(out) : (result.resize(rows * N), result.data());
  kernel(xf, of);
  if (io_type != DType::Float32) narrow(of, io_type, rows * N, out);
}

// Splits `units` units of work into at most `workers`' size parts of whole units and runs
// task(first_unit, end_unit, last) for each; everything on the calling thread without workers.
void split(Workers* workers, size_t units, const std::function<void(size_t, size_t, bool)>& task) {
  size_t parts = workers == nullptr ? 1 : std::min(workers->size(), units);
  if (parts <= 1) {
    task(0, units, true);
    return;
  }
  const size_t each = (units + parts - 1) / parts;
  parts = (units + each - 1) / each;
  workers->run(parts, [&](size_t part) {
    task(part * each, std::min(units, (part + 1) * each), part + 1 == parts);
  });
}

// x rows prepared for the products of one weight: float32, and their int8 blocks (with the int4 kernel's
// byte patterns) where the product rounds them.
struct PreparedRows {
  const float* xf = nullptr;
  size_t rows = 0;
  std::vector<Q8Row> q;
  std::vector<std::vector<uint8_t>> patterns;
};

#ifdef MOEINF_X86
// Adds to `x` what a product with `w` reads beyond float32 rows (nothing where it already has it).
void prepare_for(const RowWeight& w, PreparedRows& x) {
  if (!w.quantise_x || !x.q.empty()) return;
  for (size_t m = 0; m < x.rows; ++m) x.q.push_back(quantise_row(x.xf + m * w.K, w.K));
  if (w.group != 0 && !use_int4_vnni())
    for (const Q8Row& row : x.q) x.patterns.push_back(quad_pattern(row, w.K));
}

// out [rows, N] in float32 = x's rows times `w`, the output rows split among `workers` (`prepare_for` done).
void product_rows(const RowWeight& w, const PreparedRows& x, float* out, Workers* workers) {
  const size_t N = w.N, K = w.K;
  if (w.group == 0) {
    const auto* q = static_cast<const int8_t*>(w.q);
    // parts of whole groups of kInt8Rows output rows
    split(workers, (N + kInt8Rows - 1) / kInt8Rows, [&](size_t first, size_t end, bool) {
      const size_t begin = first * kInt8Rows, stop = std::min(N, end * kInt8Rows);
      if (w.quantise_x)
        int8_gemv_q8(x.q.data(), x.rows, q, w.scales, w.scale_type, out, N, K, begin, stop);
      else
        int8_gemv_avx2(x.xf, x.rows, q, w.scales, w.scale_type, out, N, K, begin, stop);
    });
    return;
  }
  const auto* packed = static_cast<const uint8_t*>(w.q);
  // parts of whole 32-row units; the last part also takes the tail rows
  split(workers, N / w.block_rows * (w.block_rows / 32), [&](size_t first, size_t end, bool last) {
    const bool tail = last && N % w.block_rows != 0;
    if (w.quantise_x)
      // rows prepared without patterns were prepared for int4_block_vnni (`prepare_for`)
      int4_gemv_q8(x.q.data(), x.patterns.empty() ? nullptr : x.patterns.data(), x.rows, packed, w.block_rows,
                   w.scales, w.scale_type, out, N, K, w.group, first, end, tail);
    else
      int4_gemv_avx2(x.xf, x.rows, packed, w.block_rows, w.scales, w.scale_type, out, N, K, w.group, first, end,
                     tail);
  });
}
#endif  // MOEINF_X86

void require_supported(const char* what) {
  if (!gemv_supported()) throw std::runtime_error(std::string(what) + ": this CPU lacks AVX2/FMA/F16C");
}

}  // namespace

bool set_int4_avx512(bool enabled) {
#ifdef MOEINF_X86
  int4_vnni.store(enabled, std::memory_order_relaxed);
  return use_int4_vnni();
#else
  (void)enabled;
  return false;
#endif
}

bool gemv_supported() {
#ifdef MOEINF_X86
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return supported;
#else
  return false;
#endif
}

void RowWeight::check() const {
  const std::string shape = " got N=" + std::to_string(N) + " K=" + std::to_string(K);
  if (group == 0) {
    if (quantise_x && K % kQ8Block != 0)
      throw std::invalid_argument("int8 weight: int8 activations need K a multiple of 32," + shape);
    return;
  }
  if (N % 16 != 0 || group % 2 != 0 || K % group != 0)
    throw std::invalid_argument("int4 weight: N must be a multiple of 16, K of the (even) group size," + shape +
                                " group=" + std::to_string(group));
  if (block_rows != 32 && block_rows != 64)
    throw std::invalid_argument("int4 weight: torch packs rows in blocks of 32 (AVX2) or 64 (AVX-512), got " +
                                std::to_string(block_rows));
  if (quantise_x && group % kQ8Block != 0)
    throw std::invalid_argument("int4 weight: int8 activations need a group size that is a multiple of 32, got group=" +
                                std::to_string(group));
}

void row_weight_product(const void* x, DType io_type, size_t rows, const RowWeight& w, void* out, Workers* workers) {
  require_supported("gemv");
  w.check();
#ifdef MOEINF_X86
  in_float32(x, io_type, rows, w.N, w.K, out, [&](const float* xf, float* of) {
    PreparedRows prepared;
    prepared.xf = xf;
    prepared.rows = rows;
    prepare_for(w, prepared);
    product_rows(w, prepared, of, workers);
  });
#else
  (void)x, (void)io_type, (void)rows, (void)out, (void)workers;
#endif
}

void int8_rowwise_gemv(const void* x, DType io_type, size_t rows, const int8_t* q, const void* scale,
                       DType scale_type, void* out, size_t N, size_t K, Workers* workers, bool quantise_x) {
  row_weight_product(x, io_type, rows, RowWeight{q, scale, scale_type, N, K, 0, quantise_x}, out, workers);
}

void int4_packed_gemv(const void* x, DType io_type, size_t rows, const uint8_t* packed, const void* scale_zero,
                      DType scale_type, void* out, size_t N, size_t K, size_t group, Workers* workers,
                      bool quantise_x, size_t block_rows) {
  if (group == 0) throw std::invalid_argument("int4_packed_gemv: the group size must be positive");
  row_weight_product(x, io_type, rows, RowWeight{packed, scale_zero, scale_type, N, K, group, quantise_x, block_rows},
                     out, workers);
}

void gated_rows(const void* x, DType io_type, const std::vector<GatedExpert>& experts, const void* weights,
                DType weight_type, void* out, DType out_type, Workers* workers) {
  require_supported("gated_rows");
  if (experts.empty()) return;
  const size_t K = experts[0].gate_up.K, H = experts[0].down.N;
  for (const GatedExpert& e : experts) {
    e.gate_up.check();
    e.down.check();
    if (e.gate_up.K != K || e.down.N != H || e.gate_up.N != 2 * e.down.K || e.gate_up.quantise_x != experts[0].gate_up.quantise_x)
      throw std::invalid_argument("gated_rows: every expert's gate_up must be [2I, K] and its down [H, I] for the same "
                                  "K and H, with the same activation rounding");
  }
#ifdef MOEINF_X86
  std::vector<float> wide;
  PreparedRows row;
  row.xf = widened(x, io_type, K, wide);
  row.rows = 1;
  prepare_for(experts[0].gate_up, row);  // x's int8 blocks, once for every expert
  // One expert's chain, its products split among `helpers` (or on this thread alone with nullptr).
  auto expert = [&](const GatedExpert& e, Workers* helpers) {
    const size_t I = e.down.K;
    std::vector<float> h(2 * I);
    product_rows(e.gate_up, row, h.data(), helpers);
    // [gate | up] rounded to io_type as the product's output, then silu(gate) * up in io_type
    std::vector<uint16_t> narrowed;
    const void* typed = h.data();
    if (io_type != DType::Float32) {
      narrowed.resize(2 * I);
      narrow(h.data(), io_type, 2 * I, narrowed.data());
      typed = narrowed.data();
    }
    std::vector<uint8_t> act_typed(I * sizeof(float));
    silu_mul(typed, io_type, 1, I, act_typed.data());
    std::vector<float> act(I);
    for (size_t i = 0; i < I; ++i) act[i] = to_float(act_typed.data(), i, io_type);
    PreparedRows inner;
    inner.xf = act.data();
    inner.rows = 1;
    prepare_for(e.down, inner);
    std::vector<float> y(H);
    product_rows(e.down, inner, y.data(), helpers);
    const float scale = weights == nullptr ? 1.0f : to_float(weights, e.slot, weight_type);
    for (size_t n = 0; n < H; ++n) {
      const float value = rounded(y[n], io_type);
      store(out, e.slot * H + n, weights == nullptr ? value : value * scale, out_type);
    }
  };
  const size_t parts = workers == nullptr ? 1 : workers->size();
  if (parts > 1 && experts.size() % parts == 0) {
    // as many experts for each thread: each runs whole experts on its own, with no hand-off inside them
    // (each expert's values do not depend on the thread that computes them)
    workers->run(parts, [&](size_t part) {
      for (size_t i = part; i < experts.size(); i += parts) expert(experts[i], nullptr);
    });
  } else {
    for (const GatedExpert& e : experts) expert(e, workers);
  }
#else
  (void)x, (void)io_type, (void)weights, (void)weight_type, (void)out, (void)out_type, (void)workers;
#endif
}

void dense_row_product(const void* x, DType x_type, const void* w, DType w_type, size_t N, size_t K, float* out,
                       Workers* workers) {
  require_supported("dense_row_product");
  if (K % 8 != 0) throw std::invalid_argument("dense_row_product: K must be a multiple of 8, got " + std::to_string(K));
#ifdef MOEINF_X86
  std::vector<float> wide;
  const float* xf = widened(x, x_type, K, wide);
  // parts of whole groups of four rows
  split(workers, (N + 3) / 4, [&](size_t first, size_t end, bool) {
    dense_rows_avx2(xf, w, w_type, first * 4, std::min(N, end * 4), K, out);
  });
#else
  (void)x, (void)x_type, (void)w, (void)w_type, (void)N, (void)K, (void)out, (void)workers;
#endif
}

}  // namespace moeinf
