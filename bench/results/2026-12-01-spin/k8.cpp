#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cstdint>
static inline float hsum(__m256 v){__m128 t=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1));t=_mm_add_ps(t,_mm_movehl_ps(t,t));t=_mm_add_ss(t,_mm_movehdup_ps(t));return _mm_cvtss_f32(t);}
static inline __m256 i8x8(const int8_t*p){return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));}
// A: 4 rows interleaved, NTA prefetch of next 4-row block
void kA(const float*x,const int8_t*q,float*out,size_t b,size_t e,size_t K){
  for(size_t n=b;n<e;n+=4){__m256 a[4]={_mm256_setzero_ps(),_mm256_setzero_ps(),_mm256_setzero_ps(),_mm256_setzero_ps()};
    const int8_t* next = n+8<=e? q+(n+4)*K : nullptr; size_t ahead=0;
    for(size_t k=0;k<K;k+=8){ if(next&&ahead<4*K)_mm_prefetch((const char*)next+ahead,_MM_HINT_NTA); ahead+=32;
      __m256 xv=_mm256_loadu_ps(x+k); for(int r=0;r<4;++r)a[r]=_mm256_fmadd_ps(xv,i8x8(q+(n+r)*K+k),a[r]);}
    for(int r=0;r<4;++r)out[n+r]=hsum(a[r]);}}
// B: row at a time, 4 accumulators, prefetch mode pf: 0 none, 1 NTA dist, 2 T0 dist
template<int PF> void kB(const float*x,const int8_t*q,float*out,size_t b,size_t e,size_t K,size_t dist){
  for(size_t n=b;n<e;++n){const int8_t*row=q+n*K;__m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(size_t k=0;k<K;k+=32){ if(PF==1)_mm_prefetch((const char*)row+k+dist,_MM_HINT_NTA); if(PF==2)_mm_prefetch((const char*)row+k+dist,_MM_HINT_T0);
      a0=_mm256_fmadd_ps(_mm256_loadu_ps(x+k),i8x8(row+k),a0);a1=_mm256_fmadd_ps(_mm256_loadu_ps(x+k+8),i8x8(row+k+8),a1);
      a2=_mm256_fmadd_ps(_mm256_loadu_ps(x+k+16),i8x8(row+k+16),a2);a3=_mm256_fmadd_ps(_mm256_loadu_ps(x+k+24),i8x8(row+k+24),a3);}
    out[n]=hsum(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)));}}
// C: 2 rows interleaved, 2 acc each
int main(int argc,char**argv){ const size_t E=48; size_t N1=1536,K1=2048,N2=2048,K2=768;
  std::vector<int8_t*> w1(E),w2(E); for(size_t i=0;i<E;++i){w1[i]=(int8_t*)aligned_alloc(64,N1*K1);w2[i]=(int8_t*)aligned_alloc(64,N2*K2);memset(w1[i],i,N1*K1);memset(w2[i],i+1,N2*K2);}
  std::vector<float> x(2048,0.5f), o(2048); double bytes=E*(N1*K1+N2*K2);
  const char* names[]={"A 4rows NTA-next","B row none","B row NTA+512","B row NTA+1024","B row NTA+2048","B row T0+1024"};
  for(int th=1;th<=2;++th){ std::vector<std::vector<double>> res(6);
   for(int rnd=0;rnd<7;++rnd) for(int v=0;v<6;++v){ double t=omp_get_wtime();
    for(size_t i=0;i<E;++i) for(int m=0;m<2;++m){ size_t N=m?N2:N1,K=m?K2:K1; const int8_t*q=m?w2[i]:w1[i];
      #pragma omp parallel num_threads(th)
      { int id=omp_get_thread_num(); size_t per=N/th, b=id*per, e=b+per;
        switch(v){case 0:kA(x.data(),q,o.data(),b,e,K);break;case 1:kB<0>(x.data(),q,o.data(),b,e,K,0);break;case 2:kB<1>(x.data(),q,o.data(),b,e,K,512);break;
          case 3:kB<1>(x.data(),q,o.data(),b,e,K,1024);break;case 4:kB<1>(x.data(),q,o.data(),b,e,K,2048);break;case 5:kB<2>(x.data(),q,o.data(),b,e,K,1024);break;} } }
    res[v].push_back(bytes/(omp_get_wtime()-t)/1e9);}
   for(int v=0;v<6;++v){std::sort(res[v].begin(),res[v].end()); printf("threads %d %-18s median %.1f GB/s (min %.1f max %.1f)\n",th,names[v],res[v][3],res[v][0],res[v][6]);} }
}
