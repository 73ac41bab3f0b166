#pragma once
// AVX2 helpers shared by the kernels module's files (gemv.cpp, mla.cpp): compiled for AVX2/FMA/F16C by
// function attribute, called only where `gemv_supported()` says the CPU has them.
#include <cstddef>
#include <cstdint>

#include "dtypes.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOEINF_X86 1
#define MOEINF_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace moeinf {

MOEINF_AVX2 inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
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

}  // namespace moeinf
#endif  // x86-64
