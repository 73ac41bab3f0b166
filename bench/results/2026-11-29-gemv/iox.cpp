#include <fcntl.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <stdint.h>
#include <chrono>
#include <vector>
#include <algorithm>
#include <immintrin.h>
#include <sys/mman.h>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((target("avx2"))) static uint64_t csum(const unsigned char* b, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, c0 = a0, c1 = a0;
  for (size_t k = 0; k < n / 64; ++k) { auto* p = (const __m256i*)(b + k * 64);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(p)); a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(p + 1));
    c0 = _mm256_add_epi64(c0, a0); c1 = _mm256_add_epi64(c1, a1); }
  uint64_t t[4]; _mm256_storeu_si256((__m256i*)t, _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(c0, c1)));
  return t[0] ^ t[1] ^ t[2] ^ t[3];
}
int main(int argc, char** argv) {
  const char* path = argv[1];
  size_t chunk = 2 << 20, total = (size_t)1 << 30, pool = (size_t)160 << 20;
  int fd = open(path, O_RDONLY | O_DIRECT);
  off_t fsize = lseek(fd, 0, SEEK_END);
  unsigned char *hot, *pl;
  posix_memalign((void**)&hot, 1 << 21, chunk);
  posix_memalign((void**)&pl, 1 << 21, pool);
  madvise(pl, pool, MADV_HUGEPAGE); madvise(hot, chunk, MADV_HUGEPAGE); memset(pl, 1, pool); memset(hot, 1, chunk);
  const char* names[] = {"hot", "pool", "pool+csum", "hot+csum+copy", "hot+copy"};
  std::vector<double> res[5];
  off_t base = 0; uint64_t sink = 0;
  for (int rep = 0; rep < 3; ++rep)
    for (int v = 0; v < 5; ++v) {
      if (base + (off_t)total > fsize) base = 0;
      double t = now(); size_t p = 0;
      for (size_t off = 0; off < total; off += chunk) {
        unsigned char* dst = (v == 1 || v == 2) ? pl + p : hot;
        if (pread(fd, dst, chunk, base + off) != (ssize_t)chunk) { perror("pread"); return 1; }
        if (v == 2 || v == 3) sink += csum(dst, chunk);
        if (v >= 3) memcpy(pl + p, hot, chunk);
        p = (p + chunk) % pool;
      }
      res[v].push_back(total / (now() - t) / 1e9);
      base += total;
    }
  for (int v = 0; v < 5; ++v) { std::sort(res[v].begin(), res[v].end()); printf("%-15s median %.2f GB/s (%.2f..%.2f)\n", names[v], res[v][1], res[v][0], res[v][2]); }
  return (int)(sink & 0);
}
