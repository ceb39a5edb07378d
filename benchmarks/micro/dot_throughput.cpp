// dot_throughput.cpp: why the fp32 engine beats the AVX512-BF16 engine on some CPUs.
// Throughput (12 independent accumulators) and latency (one dependent chain) of
// vfmadd231ps zmm (16 fp32 FMAs = 32 FLOP) and vdpbf16ps zmm (32 bf16 pair products summed
// into 16 fp32 = 64 FLOP), plus both fed by a broadcast from memory, the inner-loop shape of
// the attention engines (one broadcast, two dot products). The clock is estimated from a
// dependent integer add chain (1 add per cycle). No torch; build and run:
//   g++ -O2 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 dot_throughput.cpp -o dot && ./dot
// The engine rule that uses the result: mla_backend/ops/native/engine.py.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
// throughput: 12 independent chains
__attribute__((noinline)) __m512 fma_tp(long n, __m512 a, __m512 b){
  __m512 c[12]; for(int i=0;i<12;++i) c[i]=_mm512_set1_ps(i);
  for(long k=0;k<n;++k){
#pragma GCC unroll 12
    for(int i=0;i<12;++i) c[i]=_mm512_fmadd_ps(a,b,c[i]);
    asm volatile("" : "+v"(a));
  }
  __m512 s=c[0]; for(int i=1;i<12;++i) s=_mm512_add_ps(s,c[i]); return s;}
__attribute__((noinline)) __m512 dp_tp(long n, __m512 a, __m512 b){
  __m512 c[12]; for(int i=0;i<12;++i) c[i]=_mm512_set1_ps(i);
  for(long k=0;k<n;++k){
#pragma GCC unroll 12
    for(int i=0;i<12;++i) c[i]=_mm512_dpbf16_ps(c[i],(__m512bh)a,(__m512bh)b);
    asm volatile("" : "+v"(a));
  }
  __m512 s=c[0]; for(int i=1;i<12;++i) s=_mm512_add_ps(s,c[i]); return s;}
__attribute__((noinline)) __m512 fma_lat(long n, __m512 a, __m512 b){
  __m512 c=_mm512_set1_ps(1); for(long k=0;k<n;++k) c=_mm512_fmadd_ps(a,b,c); return c;}
__attribute__((noinline)) __m512 dp_lat(long n, __m512 a, __m512 b){
  __m512 c=_mm512_set1_ps(1); for(long k=0;k<n;++k) c=_mm512_dpbf16_ps(c,(__m512bh)a,(__m512bh)b); return c;}
// dp with broadcast from memory (the engine's inner loop shape: 1 broadcast feeds 2 dp)
__attribute__((noinline)) __m512 dp_bcast(long n, const int32_t* p, __m512 b0, __m512 b1){
  __m512 c[12]; for(int i=0;i<12;++i) c[i]=_mm512_set1_ps(i);
  for(long k=0;k<n;++k){
#pragma GCC unroll 6
    for(int i=0;i<6;++i){ __m512i a=_mm512_set1_epi32(p[(k*6+i)&63]);
      c[2*i]=_mm512_dpbf16_ps(c[2*i],(__m512bh)a,(__m512bh)b0);
      c[2*i+1]=_mm512_dpbf16_ps(c[2*i+1],(__m512bh)a,(__m512bh)b1);}
  }
  __m512 s=c[0]; for(int i=1;i<12;++i) s=_mm512_add_ps(s,c[i]); return s;}
__attribute__((noinline)) __m512 fma_bcast(long n, const float* p, __m512 b0, __m512 b1){
  __m512 c[12]; for(int i=0;i<12;++i) c[i]=_mm512_set1_ps(i);
  for(long k=0;k<n;++k){
#pragma GCC unroll 6
    for(int i=0;i<6;++i){ __m512 a=_mm512_set1_ps(p[(k*6+i)&63]);
      c[2*i]=_mm512_fmadd_ps(a,b0,c[2*i]);
      c[2*i+1]=_mm512_fmadd_ps(a,b1,c[2*i+1]);}
  }
  __m512 s=c[0]; for(int i=1;i<12;++i) s=_mm512_add_ps(s,c[i]); return s;}
// ghz estimate: dependent integer add chain
__attribute__((noinline)) long addchain(long n){ long x=0; for(long k=0;k<n;++k){ x+=k; asm volatile("":"+r"(x));} return x;}
int main(){
  __m512 a=_mm512_set1_ps(1.0001f), b=_mm512_set1_ps(0.9999f); float s=0;
  alignas(64) int32_t pi[64]; alignas(64) float pf[64]; for(int i=0;i<64;++i){pi[i]=0x3f803f80; pf[i]=1.0f;}
  long n=20000000; 
  for(int rep=0;rep<3;++rep){
  double t0=now(); addchain(n*4); double tg=now()-t0; double ghz=n*4/tg/1e9;
  t0=now(); s+=_mm512_reduce_add_ps(fma_tp(n,a,b)); double t1=now()-t0;
  t0=now(); s+=_mm512_reduce_add_ps(dp_tp(n,a,b)); double t2=now()-t0;
  t0=now(); s+=_mm512_reduce_add_ps(fma_lat(n,a,b)); double t3=now()-t0;
  t0=now(); s+=_mm512_reduce_add_ps(dp_lat(n,a,b)); double t4=now()-t0;
  t0=now(); s+=_mm512_reduce_add_ps(fma_bcast(n,pf,a,b)); double t5=now()-t0;
  t0=now(); s+=_mm512_reduce_add_ps(dp_bcast(n,pi,a,b)); double t6=now()-t0;
  double ins=12.0*n;
  printf("clock~%.2f GHz (1 add/cycle)\n", ghz);
  printf("vfmadd231ps zmm: %.3f ns/instr thr (%.2f/cycle) -> %.1f GFLOP/s/core; latency %.2f ns (%.1f cyc)\n", t1/ins*1e9, ins/t1/1e9/ghz, ins*32/t1/1e9, t3/n*1e9, t3/n*1e9*ghz);
  printf("vdpbf16ps  zmm: %.3f ns/instr thr (%.2f/cycle) -> %.1f GFLOP/s/core; latency %.2f ns (%.1f cyc)\n", t2/ins*1e9, ins/t2/1e9/ghz, ins*64/t2/1e9, t4/n*1e9, t4/n*1e9*ghz);
  printf("fma+bcast(1 bcast:2 fma): %.1f GFLOP/s; dp+bcast: %.1f GFLOP/s\n", ins*32/t5/1e9, ins*64/t6/1e9);
  }
  return s==12345;
}
