// A/B: O_DIRECT chunk reads landing straight in a pool-sized buffer (then checksummed there) vs landing in
// a chunk-sized bounce buffer, checksummed there while hot, then copied to the pool with streaming stores.
#include <fcntl.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <random>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((target("avx2"))) static uint64_t sum(const unsigned char* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, c0 = a0, c1 = a0;
  for (size_t k = 0; k < n / 64; ++k) {
    auto* q = (const __m256i*)(p + k * 64);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(q)); a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(q + 1));
    c0 = _mm256_add_epi64(c0, a0); c1 = _mm256_add_epi64(c1, a1);
  }
  uint64_t o[16]; _mm256_storeu_si256((__m256i*)o, c0); _mm256_storeu_si256((__m256i*)(o+4), c1);
  _mm256_storeu_si256((__m256i*)(o+8), a0); _mm256_storeu_si256((__m256i*)(o+12), a1);
  uint64_t s = 0; for (auto v : o) s += v; return s;
}
__attribute__((target("avx2"))) static void ntcopy(unsigned char* d, const unsigned char* s, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    __m256i x0 = _mm256_load_si256((const __m256i*)(s + i)), x1 = _mm256_load_si256((const __m256i*)(s + i + 32));
    __m256i x2 = _mm256_load_si256((const __m256i*)(s + i + 64)), x3 = _mm256_load_si256((const __m256i*)(s + i + 96));
    _mm256_stream_si256((__m256i*)(d + i), x0); _mm256_stream_si256((__m256i*)(d + i + 32), x1);
    _mm256_stream_si256((__m256i*)(d + i + 64), x2); _mm256_stream_si256((__m256i*)(d + i + 96), x3);
  }
  _mm_sfence();
}
int main(int argc, char** argv) {
  // usage: b MODE FILE... ; MODE: one (2MiB buffer), pool (land in pool, sum there), bounce (bounce+sum+ntcopy), poolnosum
  std::string mode = argv[1];
  const size_t chunk = 2 << 20, pool = 160ull << 20;
  unsigned char* buf = (unsigned char*)mmap(nullptr, pool, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  madvise(buf, pool, MADV_HUGEPAGE); memset(buf, 0, pool); mlock(buf, pool);
  unsigned char* raw = (unsigned char*)mmap(nullptr, 2 * chunk, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  unsigned char* bounce = (unsigned char*)(((uintptr_t)raw + chunk - 1) / chunk * chunk);
  madvise(bounce, chunk, MADV_HUGEPAGE); memset(bounce, 0, chunk); mlock(bounce, chunk);
  size_t total = 0, pos = 0; uint64_t acc = 0; double t0 = now();
  for (int f = 2; f < argc; ++f) {
    int fd = open(argv[f], O_RDONLY | O_DIRECT);
    off_t size = lseek(fd, 0, SEEK_END) / chunk * chunk;
    for (off_t off = 0; off < size; off += chunk) {
      unsigned char* dst = buf + pos; pos = (pos + chunk) % pool;
      if (mode == "one") { if (pread(fd, bounce, chunk, off) != (ssize_t)chunk) abort(); acc += sum(bounce, chunk); }
      else if (mode == "pool") { if (pread(fd, dst, chunk, off) != (ssize_t)chunk) abort(); acc += sum(dst, chunk); }
      else if (mode == "poolnosum") { if (pread(fd, dst, chunk, off) != (ssize_t)chunk) abort(); }
      else if (mode == "onenosum") { if (pread(fd, bounce, chunk, off) != (ssize_t)chunk) abort(); }
      else if (mode == "bouncenosum") { if (pread(fd, bounce, chunk, off) != (ssize_t)chunk) abort(); ntcopy(dst, bounce, chunk); }
      else { if (pread(fd, bounce, chunk, off) != (ssize_t)chunk) abort(); acc += sum(bounce, chunk); ntcopy(dst, bounce, chunk); }
      total += chunk;
    }
    close(fd);
  }
  double t = now() - t0;
  printf("%s %.2f GB/s (%zu MB) %llu\n", mode.c_str(), total / t / 1e9, total >> 20, (unsigned long long)acc);
}
