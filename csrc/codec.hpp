#pragma once
#include <cstddef>
#include <cstdint>

namespace moeinf {

// A lossless code for blobs of bf16 words that cuts what a read-bound expert fetch moves from the drive by a
// quarter. A bf16 word is sign (1 bit), exponent (8) and mantissa (7). Weights, trained or random, are
// spread over a few powers of two: the exponent carries about 2.8 bits of information, and the blob's 15
// commonest exponents cover all but about 1 word in 2,000 (docs/benchmarks.md, "Coded stores"). So each word
// is stored as its sign|mantissa byte plus a 4-bit code: code c < 15 is the blob's c-th exponent, code 15
// says "look in the escape list", which holds (position, exponent) of the rare others. 12 bits a word
// instead of 16, decoded with byte shuffles at memory speed, bit for bit the same words.
//
// Layout of a coded blob (little-endian):
//   header (64 bytes): magic "MXC1", u32 0, u64 words, u64 escapes, u8 table[16] (table[15] unused), 24 zero
//   escapes x u32 position, escapes x u8 exponent, zero bytes up to a multiple of 32
//   blocks of 64 words, each 96 bytes: 32 bytes of codes (word 2i in the low nibble of byte i, word 2i + 1 in
//   the high nibble), then the 64 sign|mantissa bytes (bit 7 the sign, bits 0-6 the mantissa)
// `words` must be a multiple of 64 (expert blobs are 4 KiB-aligned: 2,048 words).
//
// The coded blob is read into the front of a buffer that holds the decoded words, and decoded in place
// (`codec_decode`), so a fetch needs no second buffer.

constexpr size_t kCodecHeaderBytes = 64;
constexpr size_t kCodecBlockWords = 64;
constexpr size_t kCodecBlockBytes = 96;

// The most bytes `codec_encode` writes for `words` words (every word an escape).
size_t codec_bound(size_t words);

// Codes `words` bf16 words (a multiple of 64) into `out` (at least codec_bound(words) bytes); returns the bytes
// written.
size_t codec_encode(const uint16_t* in, size_t words, uint8_t* out);

// The number of words a coded blob decodes to (its header); throws std::invalid_argument if `coded` is not a
// coded blob of `size` bytes.
size_t codec_words(const uint8_t* coded, size_t size);

// Decodes the coded blob at the front of `buffer` (its first `size` bytes) in place: afterwards `buffer` holds
// codec_words(...) bf16 words. `capacity` is the buffer's size in bytes and must hold them. Throws
// std::invalid_argument on a malformed blob (a bad header, a size that does not match it, an escape out of
// range), before writing anything.
void codec_decode(uint8_t* buffer, size_t size, size_t capacity);

// Whether decoding takes the AVX2 path on this CPU (the portable path gives the same words).
bool codec_avx2();
// For tests: force the portable path (false) or let the CPU decide (true).
void codec_set_avx2(bool enabled);

}  // namespace moeinf
