// Engine harness without Python: harness FILE ROUNDS CONFIG... ; CONFIG = v|nv <threads> e.g. v4 nv4 base
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>
#include <fcntl.h>
#include <unistd.h>

#include "engine.hpp"

using namespace moeinf;
static const size_t kBlob = 9437184;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void thp(const char* when) {
  FILE* f = fopen("/proc/self/smaps_rollup", "r"); char line[256];
  while (fgets(line, sizeof line, f)) if (strncmp(line, "AnonHugePages", 13) == 0 || strncmp(line, "Anonymous:", 10) == 0) fprintf(stdout, "%s %s", when, line);
  fclose(f);
}
int main(int argc, char** argv) {
  std::string path = argv[1];
  int rounds = atoi(argv[2]);
  int fd = open(path.c_str(), O_RDONLY);
  size_t n = lseek(fd, 0, SEEK_END) / kBlob;
  close(fd);
  std::vector<uint64_t> sums;
  { FILE* f = fopen("/tmp/iow/sums.txt", "r"); unsigned long long x; while (fscanf(f, "%llu", &x) == 1) sums.push_back(x); fclose(f); }
  std::vector<std::string> cfgs(argv + 3, argv + argc);
  std::mt19937 g(1);
  std::vector<std::unique_ptr<Engine>> engines(cfgs.size());
  for (size_t i = 0; i < cfgs.size(); ++i) {
    if (cfgs[i] == "base") continue;
    EngineOptions o;
    o.slot_bytes = kBlob;
    o.num_slots = 16;
    o.verify = cfgs[i][0] == 'v';
    o.io_threads = atoi(cfgs[i].c_str() + (o.verify ? 1 : 2));
    engines[i] = std::make_unique<Engine>(std::vector<std::string>{path}, o);
    for (size_t k = 0; k < n; ++k) engines[i]->add(0, k, BlobRef{0, k * kBlob, kBlob, sums[k]});
  }
  thp("start"); fflush(stdout);
  std::vector<std::vector<double>> res(cfgs.size());
  for (int r = 0; r < rounds; ++r) {
    std::vector<size_t> idx(cfgs.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), g);
    for (size_t i : idx) {
      double t0 = now();
      if (!engines[i]) {
        raw_read(path, {{0, n * kBlob}}, 2 << 20, true);
      } else {
        Engine& e = *engines[i];
        std::vector<size_t> o(n);
        for (size_t k = 0; k < n; ++k) o[k] = k;
        std::shuffle(o.begin(), o.end(), g);
        for (size_t k = 0; k < n; ++k) e.submit(0, o[k], 1.0 - double(k) / n);
        for (size_t k = 0; k < n; ++k) {
          e.wait(0, o[k], -1, {});
          e.release(0, o[k]);
        }
      }
      res[i].push_back(n * kBlob / (now() - t0) / 1e9);
    }
  }
  size_t b = std::find(cfgs.begin(), cfgs.end(), "base") - cfgs.begin();
  for (size_t i = 0; i < cfgs.size(); ++i) {
    std::vector<double> rel, v = res[i];
    for (int r = 0; r < rounds; ++r) rel.push_back(res[i][r] / res[b][r]);
    std::sort(v.begin(), v.end());
    std::sort(rel.begin(), rel.end());
    printf("%-6s median %.3f GB/s paired/base %.3f [", cfgs[i].c_str(), v[v.size() / 2], rel[rel.size() / 2]);
    for (double x : res[i]) printf(" %.2f", x);
    printf(" ]\n");
  }
}
