#include "gemv.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOEINF_X86 1
#endif

namespace moeinf {
namespace {

float to_float(const void* values, size_t i, DType type) {
  switch (type) {
    case DType::Float32:
      return static_cast<const float*>(values)[i];
    case DType::BFloat16: {
      uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(values)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case DType::Float16: {
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
MOEINF_AVX2 inline __m256 load8(const void* values, size_t i, DType type) {
  switch (type) {
    case DType::Float32:
      return _mm256_loadu_ps(static_cast<const float*>(values) + i);
    case DType::BFloat16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::Float16: {
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

// The (scale, zero) pairs of rows n0 + 4i .. n0 + 4i + 3 and n0 + 16 + 4i .. n0 + 16 + 4i + 3 of group g, in
// the order int4_block's accumulator i holds its rows: 4i, 16 + 4i, 4i + 1, 16 + 4i + 1, ...
MOEINF_AVX2 inline void int4_scales(const void* scale_zero, DType type, size_t first, size_t i, __m256& s,
                                    __m256& z) {
  __m256 p = load8(scale_zero, first + 8 * i, type), q = load8(scale_zero, first + 32 + 8 * i, type);
  __m256 lo = _mm256_unpacklo_ps(p, q), hi = _mm256_unpackhi_ps(p, q);  // s0 s16 z0 z16 | s2 s18 z2 z18
  s = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
  z = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
}

// One 32-row block of the int4 layout for one x row; `xsum[g]` the sum of x over group g. The 32-bit word i
// of a k's 16 bytes holds rows 4i, 16 + 4i, 4i + 1, 16 + 4i + 1, ... in its nibbles from the lowest: shifting
// a broadcast of it by 0, 4, ..., 28 puts them in the lanes of accumulator i, with no byte shuffles (those
// bound the kernel on AVX2). Two sets of accumulators for even and odd k hide the FMA latency.
MOEINF_AVX2 void int4_block(const float* x, const float* xsum, const uint8_t* block, const void* scale_zero,
                            DType type, size_t n0, size_t N, size_t K, size_t group, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), nibble = _mm256_set1_epi32(0x0F);
  __m256 total[4];
  for (auto& t : total) t = _mm256_setzero_ps();
  for (size_t g = 0; g < K / group; ++g) {
    __m256 even[4], odd[4];
    for (size_t i = 0; i < 4; ++i) even[i] = odd[i] = _mm256_setzero_ps();
    for (size_t k = g * group; k < (g + 1) * group; k += 2) {
      // k's four words, then k + 1's, each broadcast by a load (an intrinsic's pointer may alias the bytes)
      const float* words = reinterpret_cast<const float*>(block + k * 16);
      const __m256 xk = _mm256_broadcast_ss(x + k), xk1 = _mm256_broadcast_ss(x + k + 1);
      for (size_t i = 0; i < 4; ++i) {
        __m256i w = _mm256_castps_si256(_mm256_broadcast_ss(words + i));
        __m256i q = _mm256_and_si256(_mm256_srlv_epi32(w, shifts), nibble);
        even[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), xk, even[i]);
        __m256i w1 = _mm256_castps_si256(_mm256_broadcast_ss(words + i + 4));
        __m256i q1 = _mm256_and_si256(_mm256_srlv_epi32(w1, shifts), nibble);
        odd[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), xk1, odd[i]);
      }
    }
    // sum_k x (q - 8) s + z = s * sum_k x q + (z - 8 s) * sum_k x
    const __m256 xs = _mm256_set1_ps(xsum[g]), eight = _mm256_set1_ps(8.0f);
    for (size_t i = 0; i < 4; ++i) {
      __m256 s, z;
      int4_scales(scale_zero, type, (g * N + n0) * 2, i, s, z);
      total[i] = _mm256_fmadd_ps(_mm256_add_ps(even[i], odd[i]), s, total[i]);
      total[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), xs, total[i]);
    }
  }
  for (size_t i = 0; i < 4; ++i) {
    float lanes[8];
    _mm256_storeu_ps(lanes, total[i]);
    for (size_t j = 0; j < 4; ++j) {
      out[n0 + 4 * i + j] = lanes[2 * j];
      out[n0 + 16 + 4 * i + j] = lanes[2 * j + 1];
    }
  }
}

// Blocks [first_block, end_block) of every x row, and the 16-row tail block if `with_tail`.
MOEINF_AVX2 void int4_gemv_avx2(const float* x, size_t rows, const uint8_t* packed, const void* scale_zero,
                                DType type, float* out, size_t N, size_t K, size_t group, size_t first_block,
                                size_t end_block, bool with_tail) {
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
    for (size_t b = first_block; b < end_block; ++b)
      int4_block(xm, sums.data(), packed + b * K * 16, scale_zero, type, b * 32, N, K, group, om);
    if (with_tail) {  // the last 16 rows: byte (k, j) holds rows 2j (low nibble) and 2j + 1
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

// float32 -> IEEE half, rounding to nearest even; overflow to infinity, NaN kept NaN.
uint16_t half_bits(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7FFFFFFF;
  if (x > 0x7F800000) return sign | 0x7E00;
  if (x >= 0x477FF000) return sign | 0x7C00;  // >= 65520 rounds to infinity
  if (x < 0x38800000) {                       // below 2^-14: a subnormal half, in units of 2^-24
    float magnitude;
    std::memcpy(&magnitude, &x, sizeof magnitude);
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  x += 0xC8000FFF + ((x >> 13) & 1);  // exponent bias 127 -> 15, and round to nearest even
  return sign | static_cast<uint16_t>(x >> 13);
}

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
  for (size_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &from[i], sizeof bits);
    if (type == DType::BFloat16) {
      bool nan = (bits & 0x7FFFFFFF) > 0x7F800000;
      out[i] = nan ? static_cast<uint16_t>((bits >> 16) | 0x40) : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    } else {
      out[i] = half_bits(from[i]);
    }
  }
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

void int8_rowwise_gemv(const void* x, DType io_type, size_t rows, const int8_t* q, const void* scale,
                       DType scale_type, void* out, size_t N, size_t K, Workers* workers) {
  if (!gemv_supported()) throw std::runtime_error("int8_rowwise_gemv: this CPU lacks AVX2/FMA/F16C");
#ifdef MOEINF_X86
  in_float32(x, io_type, rows, N, K, out, [&](const float* xf, float* of) {
    // parts of whole groups of kInt8Rows output rows
    split(workers, (N + kInt8Rows - 1) / kInt8Rows, [&](size_t first, size_t end, bool) {
      int8_gemv_avx2(xf, rows, q, scale, scale_type, of, N, K, first * kInt8Rows, std::min(N, end * kInt8Rows));
    });
  });
#else
  (void)x, (void)io_type, (void)rows, (void)q, (void)scale, (void)scale_type, (void)out, (void)N, (void)K,
      (void)workers;
#endif
}

void int4_packed_gemv(const void* x, DType io_type, size_t rows, const uint8_t* packed, const void* scale_zero,
                      DType scale_type, void* out, size_t N, size_t K, size_t group, Workers* workers) {
  if (!gemv_supported()) throw std::runtime_error("int4_packed_gemv: this CPU lacks AVX2/FMA/F16C");
  if (N % 16 != 0 || group == 0 || group % 2 != 0 || K % group != 0)
    throw std::invalid_argument("int4_packed_gemv: N must be a multiple of 16, K of the (even) group size, got N=" +
                                std::to_string(N) + " K=" + std::to_string(K) + " group=" + std::to_string(group));
#ifdef MOEINF_X86
  in_float32(x, io_type, rows, N, K, out, [&](const float* xf, float* of) {
    // parts of whole 32-row blocks; the last part also takes a 16-row tail
    split(workers, N / 32, [&](size_t first, size_t end, bool last) {
      int4_gemv_avx2(xf, rows, packed, scale_zero, scale_type, of, N, K, group, first, end, last && N % 32 != 0);
    });
  });
#else
  (void)x, (void)io_type, (void)rows, (void)packed, (void)scale_zero, (void)scale_type, (void)out, (void)N, (void)K,
      (void)group, (void)workers;
#endif
}

}  // namespace moeinf
