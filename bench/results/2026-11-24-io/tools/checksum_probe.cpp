// Microbenchmark: checksum CPU cost (cold/hot/just-read), raw O_DIRECT bandwidth vs reads in flight and chunk size.
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <string>
#include "checksum.hpp"
using namespace std;
static double tcpu(){ timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9; }
static double wall(){ return chrono::duration<double>(chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((target("sse4.2"))) uint64_t crc3(const unsigned char* p, size_t n){
  // 3 interleaved crc32c streams over thirds (not combined: cost only)
  size_t third = n/24*8; uint64_t a=0,b=0,c=0; const uint64_t* w=(const uint64_t*)p; size_t k=third/8;
  for(size_t i=0;i<k;++i){ a=_mm_crc32_u64(a,w[i]); b=_mm_crc32_u64(b,w[i+k]); c=_mm_crc32_u64(c,w[i+2*k]); }
  return a^b^c;
}
__attribute__((target("avx2"))) uint64_t sum_only(const unsigned char* p, size_t n){
  __m256i a0=_mm256_setzero_si256(),a1=a0;
  for(size_t i=0;i<n;i+=64){ a0=_mm256_add_epi64(a0,_mm256_load_si256((const __m256i*)(p+i))); a1=_mm256_add_epi64(a1,_mm256_load_si256((const __m256i*)(p+i+32)));}
  a0=_mm256_add_epi64(a0,a1); uint64_t o[4]; _mm256_storeu_si256((__m256i*)o,a0); return o[0]+o[1]+o[2]+o[3];
}
int main(int argc,char**argv){
  string mode=argv[1]; 
  if(mode=="cpu"){
    size_t big=1ull<<30; unsigned char* buf=(unsigned char*)aligned_alloc(4096,big); for(size_t i=0;i<big;i+=8) *(uint64_t*)(buf+i)=i*0x9E3779B97F4A7C15ULL;
    volatile uint64_t sink=0;
    for(int rep=0;rep<3;++rep){
    double t=tcpu(); sink^=moeinf::checksum(buf,big); double f=tcpu()-t;
    t=tcpu(); sink^=crc3(buf,big); double c=tcpu()-t;
    t=tcpu(); sink^=sum_only(buf,big); double s=tcpu()-t;
    // hot: 2 MiB repeated
    size_t hot=2<<20; int it=256; sink^=moeinf::checksum(buf,hot);
    t=tcpu(); for(int i=0;i<it;++i) sink^=moeinf::checksum(buf,hot); double fh=tcpu()-t;
    t=tcpu(); for(int i=0;i<it;++i) sink^=crc3(buf,hot); double ch=tcpu()-t;
    size_t h2=256<<10; int it2=4096;
    t=tcpu(); for(int i=0;i<it2;++i) sink^=moeinf::checksum(buf,h2); double fh2=tcpu()-t;
    printf("cold 1GiB GB/s per core-second: fletcher64w %.1f crc32c-3way %.1f sum-only %.1f | hot 2MiB: fletcher %.1f crc %.1f | hot 256KiB fletcher %.1f\n",
      big/f/1e9, big/c/1e9, big/s/1e9, hot*it/fh/1e9, hot*it/ch/1e9, h2*it2/fh2/1e9);
    }
    return 0;
  }
  const char* path=argv[2];
  int fd=open(path,O_RDONLY|O_DIRECT); struct stat st; fstat(fd,&st); size_t fsz=st.st_size;
  if(mode=="justread"){ // pread chunk then checksum; cpu of checksum
    size_t chunk=atol(argv[3]); unsigned char* buf=(unsigned char*)aligned_alloc(4096,chunk);
    double cs=0,rd=0; size_t tot=0; volatile uint64_t sink=0;
    for(size_t off=0; off+chunk<=fsz && tot< (1ull<<30); off+=chunk){ double w=wall(); pread(fd,buf,chunk,off); rd+=wall()-w; double t=tcpu(); sink^=moeinf::checksum(buf,chunk); cs+=tcpu()-t; tot+=chunk; }
    printf("chunk %zu KiB: read %.2f GB/s, checksum of just-read chunk %.1f GB/s per core-second\n", chunk>>10, tot/rd/1e9, tot/cs/1e9);
    return 0;
  }
  if(mode=="qd"||mode=="qdv"){ bool v=mode=="qdv"; volatile uint64_t sink=0; atomic<long> cpuns{0}; // N threads, chunk size, random chunk-aligned offsets over the file, 1 GiB total
    int n=atoi(argv[3]); size_t chunk=atol(argv[4]); size_t total=1ull<<30; size_t nchunks=fsz/chunk;
    atomic<size_t> next{0}; vector<thread> th; size_t count=total/chunk;
    vector<size_t> order(count); srand(atoi(argc>5?argv[5]:"1")); for(auto&o:order) o=(size_t)rand()%nchunks;
    double w=wall();
    for(int t=0;t<n;++t) th.emplace_back([&]{ unsigned char* buf=(unsigned char*)aligned_alloc(4096,chunk); for(;;){ size_t i=next++; if(i>=count) break; pread(fd,buf,chunk,order[i]*chunk); if(v){double t=tcpu(); sink^=moeinf::checksum(buf,chunk); cpuns+=(long)((tcpu()-t)*1e9);} } });
    for(auto&t:th) t.join(); double e=wall()-w;
    printf("%s threads %d chunk %zu KiB: %.3f GB/s verify cpu %.4f s/GB\n", mode.c_str(), n, chunk>>10, total/e/1e9, cpuns*1e-9/(total/1e9));
  }
}
