#include "codec.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moeinf {
namespace {

constexpr char kMagic[4] = {'M', 'X', 'C', '1'};
constexpr unsigned kEscape = 15;

size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

// Bytes before the first block: the header and the escape list, padded to a multiple of 32.
size_t blocks_start(size_t escapes) { return round_up(kCodecHeaderBytes + 5 * escapes, 32); }

struct Header {
  uint64_t words = 0;
  uint64_t escapes = 0;
  std::array<uint8_t, 16> table{};
};

Header read_header(const uint8_t* coded, size_t size) {
  if (size < kCodecHeaderBytes || std::memcmp(coded, kMagic, 4) != 0)
    throw std::invalid_argument("not a coded blob (no MXC1 header)");
  Header h;
  std::memcpy(&h.words, coded + 8, 8);
  std::memcpy(&h.escapes, coded + 16, 8);
  std::memcpy(h.table.data(), coded + 24, 16);
  if (h.words % kCodecBlockWords != 0)
    throw std::invalid_argument("coded blob of " + std::to_string(h.words) + " words, not a multiple of 64");
  if (h.escapes > h.words) throw std::invalid_argument("coded blob with more escapes than words");
  const size_t need = blocks_start(h.escapes) + h.words / kCodecBlockWords * kCodecBlockBytes;
  if (size < need)
    throw std::invalid_argument("coded blob of " + std::to_string(size) + " bytes, its header needs " +
                                std::to_string(need));
  return h;
}

// One block: 96 coded bytes at `in` -> 64 words at `out`. Reads all of its input before writing (in place,
// a block's output may overlap its own input).
void decode_block_plain(const uint8_t* in, const uint8_t* table, uint8_t* out) {
  uint8_t block[kCodecBlockBytes];
  std::memcpy(block, in, kCodecBlockBytes);
  const uint8_t* codes = block;
  const uint8_t* sm = block + 32;
  for (size_t i = 0; i < kCodecBlockWords; ++i) {
    const unsigned code = (codes[i / 2] >> (4 * (i & 1))) & 0xF;
    const unsigned e = table[code];
    const unsigned s = sm[i];
    const uint16_t word = static_cast<uint16_t>(((s & 0x80u) << 8) | (e << 7) | (s & 0x7Fu));
    std::memcpy(out + 2 * i, &word, 2);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void decode_block_avx2(const uint8_t* in, __m256i table, uint8_t* out) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  const __m256i sm0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32));
  const __m256i sm1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 64));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i even = _mm256_and_si256(nibbles, low4);                         // words 0, 2, 4, ...
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4);    // words 1, 3, 5, ...
  // unpack works within 128-bit lanes: [0-15 | 32-47] and [16-31 | 48-63], then put the lanes in order
  const __m256i lo = _mm256_unpacklo_epi8(even, odd);
  const __m256i hi = _mm256_unpackhi_epi8(even, odd);
  const __m256i codes0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // words 0-31
  const __m256i codes1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // words 32-63
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i mant = _mm256_set1_epi8(0x7F);
  const __m256i* sms[2] = {&sm0, &sm1};
  const __m256i* codes[2] = {&codes0, &codes1};
  for (int half = 0; half < 2; ++half) {
    const __m256i e = _mm256_shuffle_epi8(table, *codes[half]);
    const __m256i s = *sms[half];
    // high byte: sign | exponent >> 1; low byte: (exponent & 1) << 7 | mantissa (per byte: 16-bit shifts, masked)
    const __m256i high = _mm256_or_si256(_mm256_and_si256(s, sign), _mm256_and_si256(_mm256_srli_epi16(e, 1), mant));
    const __m256i low = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(e, 7), sign), _mm256_and_si256(s, mant));
    const __m256i w0 = _mm256_unpacklo_epi8(low, high);  // words [0-7 | 16-23] of this half
    const __m256i w1 = _mm256_unpackhi_epi8(low, high);  // words [8-15 | 24-31]
    __m256i* dst = reinterpret_cast<__m256i*>(out + 64 * half);
    _mm256_storeu_si256(dst, _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(w0, w1, 0x31));
  }
}

__attribute__((target("avx2"))) void decode_blocks_avx2(const uint8_t* in, size_t first, size_t last,
                                                        const uint8_t* table, uint8_t* out) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  for (size_t j = last; j-- > first;) decode_block_avx2(in + j * kCodecBlockBytes, t, out + j * 128);
}
#endif

bool avx2_allowed = true;

bool use_avx2() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2");
  return has && avx2_allowed;
#else
  return false;
#endif
}

// Blocks [first, last) from `in` (block j's 96 bytes at in + 96 j), last to first.
void decode_blocks(const uint8_t* in, size_t first, size_t last, const uint8_t* table, uint8_t* out) {
#if defined(__x86_64__)
  if (use_avx2()) {
    decode_blocks_avx2(in, first, last, table, out);
    return;
  }
#endif
  for (size_t j = last; j-- > first;) decode_block_plain(in + j * kCodecBlockBytes, table, out + j * 128);
}

}  // namespace

size_t codec_bound(size_t words) { return blocks_start(words) + words / kCodecBlockWords * kCodecBlockBytes; }

size_t codec_encode(const uint16_t* in, size_t words, uint8_t* out) {
  if (words % kCodecBlockWords != 0)
    throw std::invalid_argument("codec_encode: " + std::to_string(words) + " words, not a multiple of 64");
  if (words > (1ull << 32)) throw std::invalid_argument("codec_encode: more than 2^32 words");
  // four tables, so that runs of one exponent do not wait on each other's increments
  std::array<std::array<uint32_t, 256>, 4> partial{};
  size_t i = 0;
  for (; i + 4 <= words; i += 4) {
    ++partial[0][(in[i] >> 7) & 0xFF];
    ++partial[1][(in[i + 1] >> 7) & 0xFF];
    ++partial[2][(in[i + 2] >> 7) & 0xFF];
    ++partial[3][(in[i + 3] >> 7) & 0xFF];
  }
  std::array<uint64_t, 256> counts{};
  for (; i < words; ++i) ++counts[(in[i] >> 7) & 0xFF];
  for (const auto& part : partial)
    for (unsigned e = 0; e < 256; ++e) counts[e] += part[e];
  std::array<unsigned, 256> order;
  for (unsigned e = 0; e < 256; ++e) order[e] = e;
  // the commonest first, ties to the lower exponent: the table is a function of the words alone
  std::stable_sort(order.begin(), order.end(), [&](unsigned a, unsigned b) { return counts[a] > counts[b]; });
  std::array<uint8_t, 256> code;
  code.fill(kEscape);
  std::array<uint8_t, 16> table{};
  for (unsigned c = 0; c < kEscape; ++c) {
    table[c] = static_cast<uint8_t>(order[c]);
    code[order[c]] = static_cast<uint8_t>(c);
  }
  uint64_t escapes = 0;
  for (unsigned e = 0; e < 256; ++e)
    if (code[e] == kEscape) escapes += counts[e];
  const size_t start = blocks_start(escapes);
  std::memset(out, 0, start);
  std::memcpy(out, kMagic, 4);
  const uint64_t w = words;
  std::memcpy(out + 8, &w, 8);
  std::memcpy(out + 16, &escapes, 8);
  std::memcpy(out + 24, table.data(), 16);
  uint8_t* positions = out + kCodecHeaderBytes;
  uint8_t* exponents = positions + 4 * escapes;
  size_t k = 0;
  for (size_t b = 0; b < words / kCodecBlockWords; ++b) {
    const uint16_t* w = in + b * kCodecBlockWords;
    uint8_t* block = out + start + b * kCodecBlockBytes;
    unsigned escaped = 0;
    for (size_t i = 0; i < kCodecBlockWords; i += 2) {
      const unsigned c0 = code[(w[i] >> 7) & 0xFF], c1 = code[(w[i + 1] >> 7) & 0xFF];
      block[i / 2] = static_cast<uint8_t>(c0 | (c1 << 4));
      escaped |= (c0 == kEscape) | (c1 == kEscape);
    }
    for (size_t i = 0; i < kCodecBlockWords; ++i)
      block[32 + i] = static_cast<uint8_t>(((w[i] >> 8) & 0x80) | (w[i] & 0x7F));
    if (escaped) {
      for (size_t i = 0; i < kCodecBlockWords; ++i) {
        const unsigned e = (w[i] >> 7) & 0xFF;
        if (code[e] != kEscape) continue;
        const uint32_t position = static_cast<uint32_t>(b * kCodecBlockWords + i);
        std::memcpy(positions + 4 * k, &position, 4);
        exponents[k++] = static_cast<uint8_t>(e);
      }
    }
  }
  return start + words / kCodecBlockWords * kCodecBlockBytes;
}

size_t codec_words(const uint8_t* coded, size_t size) { return read_header(coded, size).words; }

void codec_decode(uint8_t* buffer, size_t size, size_t capacity) {
  if (size > capacity) throw std::invalid_argument("codec_decode: the coded blob is larger than its buffer");
  Header h = read_header(buffer, size);
  if (h.words > (1ull << 32)) throw std::invalid_argument("coded blob of more than 2^32 words");
  if (2 * h.words > capacity)
    throw std::invalid_argument("codec_decode: " + std::to_string(h.words) + " words do not fit a buffer of " +
                                std::to_string(capacity) + " bytes");
  // everything before the blocks is read out first: the decoded words overwrite it
  std::vector<uint32_t> positions(h.escapes);
  std::vector<uint8_t> exponents(h.escapes);
  std::memcpy(positions.data(), buffer + kCodecHeaderBytes, 4 * h.escapes);
  std::memcpy(exponents.data(), buffer + kCodecHeaderBytes + 4 * h.escapes, h.escapes);
  for (uint32_t p : positions)
    if (p >= h.words) throw std::invalid_argument("coded blob with an escape past its last word");
  h.table[kEscape] = 0;
  const size_t start = blocks_start(h.escapes);
  const size_t blocks = h.words / kCodecBlockWords;
  // Last block to first: block j writes [128 j, 128 j + 128) after the blocks above it are done. Its input
  // and that of the blocks below it start at `start` + 96 j, which is behind its output once 32 j >= start;
  // the blocks below that (a few: start is the header and the escapes) are decoded from a copy.
  const size_t direct = std::min(blocks, round_up(start, 32) / 32);
  thread_local std::vector<uint8_t> low;
  low.assign(buffer + start, buffer + start + direct * kCodecBlockBytes);
  decode_blocks(buffer + start, direct, blocks, h.table.data(), buffer);
  decode_blocks(low.data(), 0, direct, h.table.data(), buffer);
  for (size_t k = 0; k < positions.size(); ++k) {
    uint16_t word;
    std::memcpy(&word, buffer + 2 * positions[k], 2);
    word = static_cast<uint16_t>((word & 0x807Fu) | (static_cast<unsigned>(exponents[k]) << 7));
    std::memcpy(buffer + 2 * positions[k], &word, 2);
  }
}

bool codec_avx2() { return use_avx2(); }

void codec_set_avx2(bool enabled) { avx2_allowed = enabled; }

}  // namespace moeinf
