#include "checksum.hpp"

#include <cstring>
#include <stdexcept>

namespace moeinf {

uint64_t checksum(const void* data, size_t size) {
  if (size % 8 != 0) throw std::invalid_argument("checksum: size must be a multiple of 8 bytes");
  const auto* bytes = static_cast<const unsigned char*>(data);
  const size_t n = size / 8;
  uint64_t s1 = 0, s2 = 0;
  for (size_t i = 0; i < n; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + i * 8, 8);
    s1 += w;
    s2 += static_cast<uint64_t>(i + 1) * w;
  }
  return s1 ^ (s2 * 0x9E3779B97F4A7C15ULL);
}

}  // namespace moeinf
