#include "gemv.hpp"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOEINF_X86 1
#endif

namespace moeinf {
namespace {

float to_float(const void* values, size_t i, ScaleType type) {
  switch (type) {
    case ScaleType::Float32:
      return static_cast<const float*>(values)[i];
    case ScaleType::BFloat16: {
      uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(values)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case ScaleType::Float16: {
      // IEEE half -> float, including subnormals, infinities and NaNs.
      uint16_t h = static_cast<const uint16_t*>(values)[i];
      uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
      uint32_t bits;
      if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (mant << 13);
      } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
      } else if (mant == 0) {
        bits = sign;
      } else {
        exp = 113;
        while (!(mant & 0x400)) {
          mant <<= 1;
          --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
      }
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
  }
  return 0.0f;
}

#ifdef MOEINF_X86

#define MOEINF_AVX2 __attribute__((target("avx2,fma,f16c")))

MOEINF_AVX2 inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

MOEINF_AVX2 inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Eight consecutive values of `values` from index i as float32.
MOEINF_AVX2 inline __m256 load8(const void* values, size_t i, ScaleType type) {
  switch (type) {
    case ScaleType::Float32:
      return _mm256_loadu_ps(static_cast<const float*>(values) + i);
    case ScaleType::BFloat16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case ScaleType::Float16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + i));
      return _mm256_cvtph_ps(h);
    }
  }
  return _mm256_setzero_ps();
}

constexpr size_t kInt8Rows = 4;  // rows of q per pass over x: four streams, x's loads shared

// Rows [n, n + kInt8Rows) of one x row, K a multiple of 8; prefetches `next` (the following rows' bytes,
// `next_bytes` of them, or nullptr) while it streams its own, so the next block arrives in cache in time.
MOEINF_AVX2 void int8_rows(const float* x, const int8_t* q, size_t K, const int8_t* next, size_t next_bytes,
                           float* sums) {
  __m256 acc[kInt8Rows];
  for (size_t r = 0; r < kInt8Rows; ++r) acc[r] = _mm256_setzero_ps();
  size_t ahead = 0;
  for (size_t k = 0; k < K; k += 8) {
    if (next != nullptr && ahead < next_bytes) _mm_prefetch(reinterpret_cast<const char*>(next + ahead), _MM_HINT_T0);
    ahead += 8 * kInt8Rows;
    __m256 xv = _mm256_loadu_ps(x + k);
    for (size_t r = 0; r < kInt8Rows; ++r) acc[r] = _mm256_fmadd_ps(xv, int8x8(q + r * K + k), acc[r]);
  }
  for (size_t r = 0; r < kInt8Rows; ++r) sums[r] = hsum(acc[r]);
}

MOEINF_AVX2 void int8_gemv_avx2(const float* x, size_t rows, const int8_t* q, const void* scale, ScaleType type,
                                float* out, size_t N, size_t K) {
  const size_t vector_k = K - K % 8, full = N - N % kInt8Rows;
  for (size_t m = 0; m < rows; ++m) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    for (size_t n = 0; n < N; n += kInt8Rows) {
      float sums[kInt8Rows] = {};
      size_t count = n < full ? kInt8Rows : N - n;
      if (count == kInt8Rows && vector_k == K) {
        const int8_t* next = n + 2 * kInt8Rows <= N ? q + (n + kInt8Rows) * K : nullptr;
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

// One 32-row block of the int4 layout for one x row; `xsum[g]` the sum of x over group g.
MOEINF_AVX2 void int4_block(const float* x, const float* xsum, const uint8_t* block, const void* scale_zero,
                            ScaleType type, size_t n0, size_t N, size_t K, size_t group, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 total[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (size_t g = 0; g < K / group; ++g) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t k = g * group; k < (g + 1) * group; ++k) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + k * 16));
      __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
      __m256 xv = _mm256_broadcast_ss(x + k);
      acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), xv, acc[0]);
      acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), xv, acc[1]);
      acc[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), xv, acc[2]);
      acc[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), xv, acc[3]);
    }
    // sum_k x (q - 8) s + z = s * sum_k x q + (z - 8 s) * sum_k x; (s, z) pairs of rows n0.. interleaved.
    const __m256 xs = _mm256_set1_ps(xsum[g]), eight = _mm256_set1_ps(8.0f);
    size_t base = (g * N + n0) * 2;
    for (size_t i = 0; i < 4; ++i) {
      __m256 a = load8(scale_zero, base + 16 * i, type), b = load8(scale_zero, base + 16 * i + 8, type);
      // a = s0 z0 s1 z1 s2 z2 s3 z3, b = s4 z4 ... : gather s and z of 8 rows in row order.
      __m256 s = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), z = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), _MM_SHUFFLE(3, 1, 2, 0)));
      z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(z), _MM_SHUFFLE(3, 1, 2, 0)));
      total[i] = _mm256_fmadd_ps(acc[i], s, total[i]);
      total[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), xs, total[i]);
    }
  }
  for (size_t i = 0; i < 4; ++i) _mm256_storeu_ps(out + n0 + 8 * i, total[i]);
}

MOEINF_AVX2 void int4_gemv_avx2(const float* x, size_t rows, const uint8_t* packed, const void* scale_zero,
                                ScaleType type, float* out, size_t N, size_t K, size_t group) {
  const size_t groups = K / group, full_blocks = N / 32;
  std::vector<float> sums(groups);
  for (size_t m = 0; m < rows; ++m) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    for (size_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (size_t k = g * group; k < (g + 1) * group; ++k) s += xm[k];
      sums[g] = s;
    }
    for (size_t b = 0; b < full_blocks; ++b)
      int4_block(xm, sums.data(), packed + b * K * 16, scale_zero, type, b * 32, N, K, group, om);
    if (N % 32 != 0) {  // the last 16 rows: byte (k, j) holds rows 2j (low nibble) and 2j + 1
      const uint8_t* tail = packed + full_blocks * K * 16;
      const size_t n0 = full_blocks * 32;
      for (size_t j = 0; j < 16; ++j) {
        float total = 0.0f;
        const size_t n = n0 + j;
        for (size_t g = 0; g < groups; ++g) {
          float dot = 0.0f;
          for (size_t k = g * group; k < (g + 1) * group; ++k) {
            uint8_t byte = tail[k * 8 + j / 2];
            dot += xm[k] * static_cast<float>(j % 2 == 0 ? (byte & 0x0F) : (byte >> 4));
          }
          float s = to_float(scale_zero, (g * N + n) * 2, type), z = to_float(scale_zero, (g * N + n) * 2 + 1, type);
          total += s * dot + (z - 8.0f * s) * sums[g];
        }
        om[n] = total;
      }
    }
  }
}

#endif  // MOEINF_X86

}  // namespace

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

void int8_rowwise_gemv(const float* x, size_t rows, const int8_t* q, const void* scale, ScaleType scale_type,
                       float* out, size_t N, size_t K) {
  if (!gemv_supported()) throw std::runtime_error("int8_rowwise_gemv: this CPU lacks AVX2/FMA/F16C");
#ifdef MOEINF_X86
  int8_gemv_avx2(x, rows, q, scale, scale_type, out, N, K);
#else
  (void)x, (void)rows, (void)q, (void)scale, (void)scale_type, (void)out, (void)N, (void)K;
#endif
}

void int4_packed_gemv(const float* x, size_t rows, const uint8_t* packed, const void* scale_zero,
                      ScaleType scale_type, float* out, size_t N, size_t K, size_t group) {
  if (!gemv_supported()) throw std::runtime_error("int4_packed_gemv: this CPU lacks AVX2/FMA/F16C");
  if (N % 16 != 0 || group == 0 || K % group != 0)
    throw std::invalid_argument("int4_packed_gemv: N must be a multiple of 16 and K of the group size, got N=" +
                                std::to_string(N) + " K=" + std::to_string(K) + " group=" + std::to_string(group));
#ifdef MOEINF_X86
  int4_gemv_avx2(x, rows, packed, scale_zero, scale_type, out, N, K, group);
#else
  (void)x, (void)rows, (void)packed, (void)scale_zero, (void)scale_type, (void)out, (void)N, (void)K, (void)group;
#endif
}

}  // namespace moeinf
