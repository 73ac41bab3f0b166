#include "checksum.hpp"

#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdexcept>

namespace moeinf {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr size_t kLanes = 8;

// Per lane l: a[l] = sum of its words, c[l] = sum of its running sums, over the first m blocks of kLanes
// words. Plain C++ (the compiler's SSE2 code) runs at about half of one core's memory bandwidth; AVX2, two
// 4-lane registers per sum, at about all of it (bench/README.md, "Engine I/O"), which halves the CPU that
// verifying every read costs.
void lane_sums_plain(const unsigned char* bytes, size_t m, uint64_t* a, uint64_t* c) {
  for (size_t k = 0; k < m; ++k) {
    uint64_t w[kLanes];
    std::memcpy(w, bytes + k * kLanes * 8, sizeof(w));
    for (size_t l = 0; l < kLanes; ++l) {
      a[l] += w[l];
      c[l] += a[l];
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void lane_sums_avx2(const unsigned char* bytes, size_t m, uint64_t* a,
                                                    uint64_t* c) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, c0 = a0, c1 = a0;
  for (size_t k = 0; k < m; ++k) {
    const auto* p = reinterpret_cast<const __m256i*>(bytes + k * kLanes * 8);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(p));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(p + 1));
    c0 = _mm256_add_epi64(c0, a0);
    c1 = _mm256_add_epi64(c1, a1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 4), a1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 4), c1);
}
#endif

void lane_sums(const unsigned char* bytes, size_t m, uint64_t* a, uint64_t* c) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return lane_sums_avx2(bytes, m, a, c);
#endif
  lane_sums_plain(bytes, m, a, c);
}

}  // namespace

// Lane l of kLanes takes words l, l + kLanes, ...; per lane a running sum a and a sum of running sums c
// give sum_k (m - k) w_k = c, hence sum_k k w_k = m a - c: the weighted sum without a multiply per word,
// which the compiler vectorises with plain adds (about memory speed instead of ~3 GB/s).
void ChecksumParts::add(const void* data, size_t size, uint64_t first_word) {
  if (size % 8 != 0) throw std::invalid_argument("checksum: size must be a multiple of 8 bytes");
  const auto* bytes = static_cast<const unsigned char*>(data);
  const size_t n = size / 8;
  const size_t m = n / kLanes;
  uint64_t a[kLanes] = {}, c[kLanes] = {};
  lane_sums(bytes, m, a, c);
  for (size_t l = 0; l < kLanes; ++l) {
    // Word k of lane l is word first_word + l + kLanes k of the blob; its weight is that index + 1.
    const uint64_t sum_kw = static_cast<uint64_t>(m) * a[l] - c[l];
    s1 += a[l];
    s2 += (first_word + l + 1) * a[l] + kLanes * sum_kw;
  }
  for (size_t i = m * kLanes; i < n; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + i * 8, 8);
    s1 += w;
    s2 += (first_word + i + 1) * w;
  }
}

uint64_t ChecksumParts::finish() const { return s1 ^ (s2 * kGolden); }

uint64_t checksum(const void* data, size_t size) {
  ChecksumParts parts;
  parts.add(data, size, 0);
  return parts.finish();
}

}  // namespace moeinf
