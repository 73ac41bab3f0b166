#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sys/mman.h>
static double tcpu(){ timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9; }
template<int PF, int ACC> __attribute__((target("avx2"))) uint64_t sum(const unsigned char* p, size_t n){
  __m256i a[ACC]; for(int i=0;i<ACC;++i) a[i]=_mm256_setzero_si256();
  for(size_t i=0;i<n;i+=32*ACC){ if(PF) { _mm_prefetch((const char*)p+i+PF,_MM_HINT_T0); if(ACC*32>64) _mm_prefetch((const char*)p+i+PF+64,_MM_HINT_T0);} for(int k=0;k<ACC;++k) a[k]=_mm256_add_epi64(a[k],_mm256_load_si256((const __m256i*)(p+i+32*k))); }
  for(int i=1;i<ACC;++i) a[0]=_mm256_add_epi64(a[0],a[i]); uint64_t o[4]; _mm256_storeu_si256((__m256i*)o,a[0]); return o[0]+o[1]+o[2]+o[3];
}
int main(){ size_t big=1ull<<30; unsigned char* b=(unsigned char*)mmap(0,big,3,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(b,big,MADV_HUGEPAGE); memset(b,1,big);
 volatile uint64_t s=0; double t;
 for(int r=0;r<2;++r){
#define T(PF,ACC) t=tcpu(); s^=sum<PF,ACC>(b,big); printf("pf %4d acc %d: %.1f GB/s\n",PF,ACC,big/(tcpu()-t)/1e9);
 T(0,2) T(0,4) T(256,2) T(512,4) T(1024,4) T(2048,4) T(4096,4)
 }
}
