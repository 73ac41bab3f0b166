#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>
int main(){ size_t n = 400ul<<20; char* a = aligned_alloc(64, n); memset(a, 1, n);
 for (int th=1; th<=2; ++th) for (int r=0;r<5;++r){ double t=omp_get_wtime(); __m256i acc=_mm256_setzero_si256();
  #pragma omp parallel num_threads(th)
  { __m256i s0=_mm256_setzero_si256(), s1=s0, s2=s0, s3=s0; int id=omp_get_thread_num(); size_t per=n/th; const char* p=a+id*per;
    for(size_t i=0;i<per;i+=128){ s0=_mm256_add_epi8(s0,_mm256_load_si256((const __m256i*)(p+i))); s1=_mm256_add_epi8(s1,_mm256_load_si256((const __m256i*)(p+i+32))); s2=_mm256_add_epi8(s2,_mm256_load_si256((const __m256i*)(p+i+64))); s3=_mm256_add_epi8(s3,_mm256_load_si256((const __m256i*)(p+i+96)));}
     #pragma omp critical
    acc=_mm256_or_si256(acc,_mm256_or_si256(_mm256_or_si256(s0,s1),_mm256_or_si256(s2,s3))); }
  double el=omp_get_wtime()-t; printf("threads %d: %.1f GB/s (%d)\n", th, n/el/1e9, _mm256_extract_epi8(acc,0)); }
}
