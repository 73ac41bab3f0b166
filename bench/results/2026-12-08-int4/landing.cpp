// Where an O_DIRECT read lands, on this VM: one reused chunk buffer ("raw"), successive places of a pool of
// SPAN_MB (default TOTAL_MB; "pool"), or the reused buffer then a non-temporal copy into the pool ("bounce");
// both 2 MiB-page hinted and touched first. g++ -O2 -mavx2 -o landing landing.cpp -lpthread;
// ./landing STORE/experts.bin raw|pool|bounce CHUNK_MB TOTAL_MB THREADS [OFFSET_MB [SPAN_MB]]
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <atomic>
static void nt_copy(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_load_si256((const __m256i*)(src + i)), b = _mm256_load_si256((const __m256i*)(src + i + 32));
    _mm256_stream_si256((__m256i*)(dst + i), a); _mm256_stream_si256((__m256i*)(dst + i + 32), b);
  }
  _mm_sfence();
}
int main(int argc, char** argv) {
  const char* path = argv[1]; const char* mode = argv[2];
  size_t chunk = atol(argv[3]) << 20, total = atol(argv[4]) << 20; int threads = atoi(argv[5]);
  size_t offset0 = argc > 6 ? (size_t)atol(argv[6]) << 20 : 0;
  size_t span = argc > 7 ? (size_t)atol(argv[7]) << 20 : total;
  int fd = open(path, O_RDONLY | O_DIRECT);
  char* pool = (char*)mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(pool, span, MADV_HUGEPAGE); memset(pool, 1, span);
  std::atomic<size_t> next{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back([&] {
    char* bounce = (char*)mmap(nullptr, chunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); madvise(bounce, chunk, MADV_HUGEPAGE); memset(bounce, 0, chunk);
    for (;;) {
      size_t i = next.fetch_add(1); size_t off = i * chunk; if (off >= total) break;
      char* dst = strcmp(mode, "raw") == 0 ? bounce : (strcmp(mode, "pool") == 0 ? pool + off % span : bounce);
      size_t done = 0; while (done < chunk) { ssize_t r = pread(fd, dst + done, chunk - done, offset0 + off + done); if (r <= 0) { perror("pread"); exit(1);} done += r; }
      if (strcmp(mode, "bounce") == 0) nt_copy(pool + off, bounce, chunk);
      if (strcmp(mode, "bouncec") == 0) memcpy(pool + off, bounce, chunk);
    }
  });
  for (auto& t : ts) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("%s chunk %zu MB threads %d: %.2f GB/s\n", mode, chunk >> 20, threads, total / s / 1e9);
}
