// Probe: read patterns over one store file, O_DIRECT. usage: probe FILE ROUNDS PATTERN...
// base          sync 2MiB sequential, one buffer (raw_read)
// basepool      sync 2MiB, random blob order, into rotating 9MiB slots
// blobT         T threads, each takes the next blob (random order) and reads it sequentially in 2MiB chunks
// seqT          chunkT in file order (sequential, T reads in flight)
// chunkT        T threads, each takes the next chunk (random blob order; chunks of a blob in parallel)
// uringQ        io_uring, Q 2MiB reads in flight, random blob order
// blobT+v       same with checksum pass (sum of words) after each chunk
#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <condition_variable>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include "checksum.hpp"

static const size_t kBlob = 9437184, kSlots = 16;
static size_t kChunk = getenv("CHUNK") ? atol(getenv("CHUNK")) : (2 << 20);
static int fd;
static size_t nblobs;
static unsigned char* pool;
static size_t kStride = getenv("STRIDE") ? atol(getenv("STRIDE")) : kBlob;
static std::atomic<uint64_t> sink{0};

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static void rd(void* dst, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    ssize_t g = pread(fd, (char*)dst + done, n - done, off + done);
    if (g <= 0) { perror("pread"); exit(1); }
    done += g;
  }
}
static bool engine_sum = false;
static void sum(const unsigned char* p, size_t n) {
  if (engine_sum) { moeinf::ChecksumParts c; c.add(p, n, 0); sink += c.finish(); return; }
  uint64_t a = 0;
  const uint64_t* w = (const uint64_t*)p;
  for (size_t i = 0; i < n / 8; ++i) a += w[i];
  sink += a;
}

static std::vector<size_t> order(std::mt19937& g) {
  std::vector<size_t> o(nblobs);
  for (size_t i = 0; i < nblobs; ++i) o[i] = i;
  std::shuffle(o.begin(), o.end(), g);
  return o;
}

static double run(const std::string& p, std::mt19937& g) {
  auto o = order(g);
  double t0 = now();
  bool verify = p.find("+v") != std::string::npos || p.find("+c") != std::string::npos;
  engine_sum = p.find("+c") != std::string::npos;
  std::string p0 = p.substr(0, p.find('+'));
  if (p == "base" || p == "base4k") {
    static unsigned char* hbuf = [] { auto* b = (unsigned char*)mmap(0, kChunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); madvise(b, kChunk, MADV_HUGEPAGE); memset(b, 0, kChunk); return b; }();
    static unsigned char* sbuf = (unsigned char*)aligned_alloc(4096, kChunk);
    unsigned char* buf = p == "base" ? hbuf : sbuf;
    for (uint64_t off = 0; off < nblobs * kBlob; off += kChunk) rd(buf, std::min(kChunk, nblobs * kBlob - off), off);
  } else if (p.rfind("rot", 0) == 0) {
    size_t mib = atol(p.c_str() + 3);
    static unsigned char* big = [] { size_t b = 256ul << 20; auto* m = (unsigned char*)mmap(0, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); madvise(m, b, MADV_HUGEPAGE); memset(m, 0, b); return m; }();
    size_t span = mib << 20, pos = 0;
    for (uint64_t off = 0; off < nblobs * kBlob; off += kChunk) {
      rd(big + pos, std::min(kChunk, nblobs * kBlob - off), off);
      pos += kChunk; if (pos + kChunk > span) pos = 0;
    }
  } else if (p0.rfind("stage", 0) == 0) {
    // T threads, each reads a chunk into its own cache-resident 2 MiB buffer, then copies it into the pool
    int T = atoi(p.c_str() + 5);
    const bool nocopy = p.find("nc") != std::string::npos;
    const size_t per = (kBlob + kChunk - 1) / kChunk;
    std::atomic<size_t> next{0};
    std::vector<std::thread> th;
    for (int t = 0; t < T; ++t)
      th.emplace_back([&] {
        static thread_local unsigned char* st = [] { auto* b = (unsigned char*)mmap(0, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); b = (unsigned char*)(((uintptr_t)b + (2 << 20) - 1) & ~((uintptr_t)(2 << 20) - 1)); madvise(b, 2 << 20, MADV_HUGEPAGE); memset(b, 0, 2 << 20); return b; }();
        for (;;) {
          size_t i = next++;
          if (i >= nblobs * per) return;
          size_t k = i / per, c = (i % per) * kChunk;
          size_t n = std::min(kChunk, kBlob - c);
          unsigned char* dst = pool + (k % kSlots) * kStride;
          rd(st, n, o[k] * kBlob + c);
          if (verify) sum(st, n);
          if (!nocopy) memcpy(dst + c, st, n); else sink += dst[c];
        }
      });
    for (auto& t : th) t.join();
  } else if (p == "basepool") {
    for (size_t k = 0; k < nblobs; ++k) {
      unsigned char* dst = pool + (k % kSlots) * kStride;
      for (size_t c = 0; c < kBlob; c += kChunk) rd(dst + c, std::min(kChunk, kBlob - c), o[k] * kBlob + c);
    }
  } else if (p0.rfind("blob", 0) == 0) {
    int T = atoi(p.c_str() + 4);
    std::atomic<size_t> next{0};
    std::vector<std::thread> th;
    for (int t = 0; t < T; ++t)
      th.emplace_back([&, t] {
        for (;;) {
          size_t k = next++;
          if (k >= nblobs) return;
          unsigned char* dst = pool + (k % kSlots) * kStride;
          for (size_t c = 0; c < kBlob; c += kChunk) {
            size_t n = std::min(kChunk, kBlob - c);
            rd(dst + c, n, o[k] * kBlob + c);
            if (verify) sum(dst + c, n);
          }
        }
      });
    for (auto& t : th) t.join();
  } else if (p0.rfind("chunk", 0) == 0 || p0.rfind("seq", 0) == 0) {
    const bool seq = p0[0] == 's';
    int T = atoi(p.c_str() + (seq ? 3 : 5));
    if (seq) for (size_t k = 0; k < nblobs; ++k) o[k] = k;
    const size_t per = (kBlob + kChunk - 1) / kChunk;
    std::atomic<size_t> next{0};
    std::vector<std::thread> th;
    for (int t = 0; t < T; ++t)
      th.emplace_back([&] {
        for (;;) {
          size_t i = next++;
          if (i >= nblobs * per) return;
          size_t k = i / per, c = (i % per) * kChunk;
          size_t n = std::min(kChunk, kBlob - c);
          unsigned char* dst = pool + (k % kSlots) * kStride;
          rd(dst + c, n, o[k] * kBlob + c);
          if (verify) sum(dst + c, n);
        }
      });
    for (auto& t : th) t.join();
  } else if (p0.rfind("uring", 0) == 0) {
    unsigned Q = atoi(p.c_str() + 5);
    io_uring_params prm{};
    int ring = syscall(__NR_io_uring_setup, Q, &prm);
    if (ring < 0) { perror("io_uring_setup"); exit(1); }
    size_t sqsz = prm.sq_off.array + prm.sq_entries * sizeof(unsigned);
    size_t cqsz = prm.cq_off.cqes + prm.cq_entries * sizeof(io_uring_cqe);
    char* sq = (char*)mmap(0, sqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_SQ_RING);
    char* cq = (char*)mmap(0, cqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_CQ_RING);
    io_uring_sqe* sqes = (io_uring_sqe*)mmap(0, prm.sq_entries * sizeof(io_uring_sqe), PROT_READ | PROT_WRITE,
                                            MAP_SHARED | MAP_POPULATE, ring, IORING_OFF_SQES);
    auto* sq_tail = (std::atomic<unsigned>*)(sq + prm.sq_off.tail);
    unsigned sq_mask = *(unsigned*)(sq + prm.sq_off.ring_mask);
    unsigned* sq_array = (unsigned*)(sq + prm.sq_off.array);
    auto* cq_head = (std::atomic<unsigned>*)(cq + prm.cq_off.head);
    auto* cq_tail = (std::atomic<unsigned>*)(cq + prm.cq_off.tail);
    unsigned cq_mask = *(unsigned*)(cq + prm.cq_off.ring_mask);
    io_uring_cqe* cqes = (io_uring_cqe*)(cq + prm.cq_off.cqes);
    const size_t per = (kBlob + kChunk - 1) / kChunk;
    size_t next = 0, total = nblobs * per, done = 0;
    unsigned inflight = 0;
    bool wthread = p.find("+w") != std::string::npos; engine_sum = wthread;
    std::mutex wm; std::condition_variable wcv; std::vector<std::pair<size_t,size_t>> wq; bool wstop = false;
    std::thread wt; if (wthread) wt = std::thread([&]{ std::unique_lock<std::mutex> l(wm); for(;;){ wcv.wait(l,[&]{return wstop||!wq.empty();}); if (wq.empty()) return; auto v = wq; wq.clear(); l.unlock(); for (auto [i,n]: v){ size_t k = i / per, cc = (i % per) * kChunk; sum(pool + (k % kSlots) * kStride + cc, n);} l.lock(); } });
    while (done < total) {
      unsigned tail = sq_tail->load(std::memory_order_relaxed);
      unsigned added = 0;
      while (inflight < Q && next < total) {
        size_t k = next / per, c = (next % per) * kChunk;
        io_uring_sqe* s = &sqes[(tail + added) & sq_mask];
        memset(s, 0, sizeof(*s));
        s->opcode = IORING_OP_READ;
        s->fd = fd;
        s->addr = (uint64_t)(pool + (k % kSlots) * kStride + c);
        s->len = std::min(kChunk, kBlob - c);
        s->off = o[k] * kBlob + c;
        s->user_data = next;
        sq_array[(tail + added) & sq_mask] = (tail + added) & sq_mask;
        ++added; ++inflight; ++next;
      }
      sq_tail->store(tail + added, std::memory_order_release);
      int r = syscall(__NR_io_uring_enter, ring, added, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
      if (r < 0) { perror("io_uring_enter"); exit(1); }
      unsigned h = cq_head->load(std::memory_order_relaxed);
      unsigned t = cq_tail->load(std::memory_order_acquire);
      for (; h != t; ++h) {
        io_uring_cqe* c = &cqes[h & cq_mask];
        if (c->res <= 0) { fprintf(stderr, "cqe res %d\n", c->res); exit(1); }
        if (verify && !wthread) {
          size_t i = c->user_data, k = i / per, cc = (i % per) * kChunk;
          sum(pool + (k % kSlots) * kStride + cc, c->res);
        } else if (wthread) { std::lock_guard<std::mutex> l(wm); wq.push_back({c->user_data, (size_t)c->res}); wcv.notify_one(); }
        --inflight; ++done;
      }
      cq_head->store(h, std::memory_order_release);
    }
    if (wthread) { { std::lock_guard<std::mutex> l(wm); wstop = true; } wcv.notify_one(); wt.join(); }
    close(ring);
  } else {
    fprintf(stderr, "unknown %s\n", p.c_str());
    exit(2);
  }
  return nblobs * kBlob / (now() - t0) / 1e9;
}

static void thp(const char* when) {
  FILE* f = fopen("/proc/self/smaps_rollup", "r"); char line[256];
  while (fgets(line, sizeof line, f)) if (strncmp(line, "AnonHugePages", 13) == 0 || strncmp(line, "Anonymous:", 10) == 0) fprintf(stdout, "%s %s", when, line);
  fclose(f);
}
int main(int argc, char** argv) {
  fd = open(argv[1], O_RDONLY | O_DIRECT);
  if (fd < 0) { perror("open"); return 1; }
  nblobs = lseek(fd, 0, SEEK_END) / kBlob;
  int rounds = atoi(argv[2]);
  pool = (unsigned char*)mmap(0, kSlots * kStride, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(pool, kSlots * kStride, MADV_HUGEPAGE);
  memset(pool, 1, kSlots * kStride);
  std::mt19937 g(1);
  std::vector<std::string> pats(argv + 3, argv + argc);
  thp("start"); fflush(stdout);
  std::vector<std::vector<double>> res(pats.size());
  for (int r = 0; r < rounds; ++r) {
    std::vector<size_t> idx(pats.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), g);
    for (size_t i : idx) res[i].push_back(run(pats[i], g));
    fprintf(stderr, "round %d done\n", r);
  }
  size_t b = std::find(pats.begin(), pats.end(), "base") - pats.begin();
  for (size_t i = 0; i < pats.size(); ++i) {
    std::vector<double> rel;
    for (int r = 0; r < rounds; ++r) rel.push_back(b < pats.size() ? res[i][r] / res[b][r] : 0);
    auto v = res[i];
    std::sort(v.begin(), v.end());
    std::sort(rel.begin(), rel.end());
    printf("%-10s median %.3f GB/s  paired/base median %.3f  [", pats[i].c_str(), v[v.size() / 2], rel[rel.size() / 2]);
    for (double x : res[i]) printf(" %.2f", x);
    printf(" ]\n");
  }
}
