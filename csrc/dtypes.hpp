#pragma once
// The activation and scale dtypes of the kernels module, element by element: plain C++, no torch.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace moeinf {

enum class DType : int { Float32 = 0, BFloat16 = 1, Float16 = 2 };

// Element i of `values` (of `type`) as float32.
inline float to_float(const void* values, size_t i, DType type) {
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

// float32 -> IEEE half, rounding to nearest even; overflow to infinity, NaN kept NaN.
inline uint16_t half_bits(float value) {
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

// float32 -> the bits of a bfloat16 or float16, rounding to nearest even (as torch's `.to`).
inline uint16_t narrow_bits(float value, DType type) {
  if (type != DType::BFloat16) return half_bits(value);
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFF) > 0x7F800000;
  return nan ? static_cast<uint16_t>((bits >> 16) | 0x40) : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// `value` rounded to `type` (what a torch op computing in float32 and returning `type` stores).
inline float rounded(float value, DType type) {
  if (type == DType::Float32) return value;
  const uint16_t bits = narrow_bits(value, type);
  return to_float(&bits, 0, type);
}

// Stores `value` as element i of `values` (of `type`), rounding to nearest even.
inline void store(void* values, size_t i, float value, DType type) {
  if (type == DType::Float32)
    static_cast<float*>(values)[i] = value;
  else
    static_cast<uint16_t*>(values)[i] = narrow_bits(value, type);
}

}  // namespace moeinf
