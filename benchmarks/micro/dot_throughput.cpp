// dot_throughput.cpp: this CPU's compute and read-bandwidth ceilings, measured with our own
// loops (no torch), for the benchmarks' roofline (benchmarks/roofline.py) and for the engine
// rule (mla_backend/ops/native/engine.py: why the fp32 engine beats the AVX512-BF16 engine on
// some CPUs). One source, each loop compiled for its ISA through target attributes, so the
// binary runs on any x86-64 CPU and measures only what the CPU has.
//
//   g++ -O2 -pthread dot_throughput.cpp -o dot
//   ./dot                      the AVX-512 report: throughput (12 independent accumulators) and
//                              latency (one dependent chain) of vfmadd231ps zmm (16 fp32 FMAs =
//                              32 FLOP) and vdpbf16ps zmm (32 bf16 pair products into 16 fp32 =
//                              64 FLOP), both fed by a broadcast from memory (the engines' inner
//                              loop shape), clock estimated from a dependent integer add chain
//   ./dot --peak avx2,avx512,avx512_bf16 --threads N
//                              one line "peak <level> <FLOP/s>" per level: N threads each running
//                              12 independent FMA chains (avx2: vfmadd231ps ymm, 16 FLOP;
//                              avx512: zmm, 32 FLOP; avx512_bf16: the better of zmm FMA and
//                              vdpbf16ps zmm, 64 FLOP), best of 5 repeats of the wall time of all
//                              threads together (a level the CPU lacks prints "peak <level> 0")
//   ./dot --stream MiB --threads N
//                              "stream <bytes/s>": N threads summing their share of a MiB buffer
//                              (32-byte loads, 4 accumulators), best of 3 passes after a warm one
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#define AVX2 __attribute__((target("avx2,fma"), noinline))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), noinline))
#define AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), noinline))

// ---- peak loops: n iterations of 12 independent chains; return a sum so nothing is dropped --
AVX2 float fma_tp_ymm(long n) {
  __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f), c[12];
  for (int i = 0; i < 12; ++i) c[i] = _mm256_set1_ps(static_cast<float>(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) c[i] = _mm256_fmadd_ps(a, b, c[i]);
    asm volatile("" : "+x"(a));
  }
  for (int i = 1; i < 12; ++i) c[0] = _mm256_add_ps(c[0], c[i]);
  alignas(32) float o[8];
  _mm256_store_ps(o, c[0]);
  return o[0];
}
// n iterations of 12 independent zmm chains c[i] = STEP(c[i], a, b), summed at the end
#define ZMM_THROUGHPUT(STEP)                                                        \
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f), c[12];          \
  for (int i = 0; i < 12; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));       \
  for (long k = 0; k < n; ++k) {                                                   \
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) c[i] = STEP(c[i], a, b); \
    asm volatile("" : "+v"(a));                                                    \
  }                                                                                \
  for (int i = 1; i < 12; ++i) c[0] = _mm512_add_ps(c[0], c[i]);                   \
  return _mm512_reduce_add_ps(c[0]);
#define FMA_STEP(c, a, b) _mm512_fmadd_ps(a, b, c)
#define DP_STEP(c, a, b) _mm512_dpbf16_ps(c, (__m512bh)(a), (__m512bh)(b))
AVX512 float fma_tp_zmm(long n) { ZMM_THROUGHPUT(FMA_STEP) }
AVX512BF16 float dp_tp_zmm(long n) { ZMM_THROUGHPUT(DP_STEP) }
AVX512 float fma_lat(long n) {
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1);
  for (long k = 0; k < n; ++k) c = _mm512_fmadd_ps(a, b, c);
  return _mm512_reduce_add_ps(c);
}
AVX512BF16 float dp_lat(long n) {
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1);
  for (long k = 0; k < n; ++k) c = _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
  return _mm512_reduce_add_ps(c);
}
// the engines' inner loop shape: one broadcast from memory feeds two dot products
AVX512 float fma_bcast(long n, const float* p) {
  __m512 b0 = _mm512_set1_ps(1.0001f), b1 = _mm512_set1_ps(0.9999f), c[12];
  for (int i = 0; i < 12; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      __m512 a = _mm512_set1_ps(p[(k * 6 + i) & 63]);
      c[2 * i] = _mm512_fmadd_ps(a, b0, c[2 * i]);
      c[2 * i + 1] = _mm512_fmadd_ps(a, b1, c[2 * i + 1]);
    }
  }
  for (int i = 1; i < 12; ++i) c[0] = _mm512_add_ps(c[0], c[i]);
  return _mm512_reduce_add_ps(c[0]);
}
AVX512BF16 float dp_bcast(long n, const int32_t* p) {
  __m512 b0 = _mm512_set1_ps(1.0001f), b1 = _mm512_set1_ps(0.9999f), c[12];
  for (int i = 0; i < 12; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      __m512i a = _mm512_set1_epi32(p[(k * 6 + i) & 63]);
      c[2 * i] = _mm512_dpbf16_ps(c[2 * i], (__m512bh)a, (__m512bh)b0);
      c[2 * i + 1] = _mm512_dpbf16_ps(c[2 * i + 1], (__m512bh)a, (__m512bh)b1);
    }
  }
  for (int i = 1; i < 12; ++i) c[0] = _mm512_add_ps(c[0], c[i]);
  return _mm512_reduce_add_ps(c[0]);
}
// clock estimate: a dependent integer add chain (1 add per cycle)
__attribute__((noinline)) long addchain(long n) {
  long x = 0;
  for (long k = 0; k < n; ++k) {
    x += k;
    asm volatile("" : "+r"(x));
  }
  return x;
}

// ---- streaming read: sum of 32-byte words over [p, p + bytes) -------------------------------
AVX2 long stream_sum(const char* p, size_t bytes) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 128 <= bytes; i += 128) {
    s0 = _mm256_add_epi32(s0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    s1 = _mm256_add_epi32(s1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    s2 = _mm256_add_epi32(s2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    s3 = _mm256_add_epi32(s3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  s0 = _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
  alignas(32) int32_t o[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(o), s0);
  return o[0];
}

// wall seconds of `threads` threads running fn(t) together (started by one flag)
static double run_threads(int threads, const std::function<void(int)>& fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      fn(t);
    });
  while (ready.load() < threads) {
  }
  const double t0 = now();
  go.store(true);
  for (auto& th : pool) th.join();
  return now() - t0;
}

static volatile float g_sink;

// FLOP/s of `threads` threads each running loop(n) of `flop` FLOP per iteration: best of 5
static double peak_of(float (*loop)(long), double flop, int threads) {
  long n = 1000000;  // ~5-20 ms per repeat at 1-4 GHz
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double dt = run_threads(threads, [&](int) { g_sink = g_sink + loop(n); });
    best = std::max(best, flop * n * threads / dt);
  }
  return best;
}

static bool has(const char* feature) {
  __builtin_cpu_init();
  if (!std::strcmp(feature, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (!std::strcmp(feature, "avx512"))
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!std::strcmp(feature, "avx512_bf16")) return has("avx512") && __builtin_cpu_supports("avx512bf16");
  return false;
}

// FLOP/s of one level's best FMA-class loop on `threads` threads; 0 where the CPU lacks it
static double level_peak(const std::string& isa, int threads) {
  if (isa == "avx2") return has("avx2") ? peak_of(fma_tp_ymm, 12.0 * 16, threads) : 0;
  if (isa == "avx512") return has("avx512") ? peak_of(fma_tp_zmm, 12.0 * 32, threads) : 0;
  if (isa == "avx512_bf16" || isa == "amx")
    return has("avx512_bf16") ? std::max(peak_of(fma_tp_zmm, 12.0 * 32, threads),
                                         peak_of(dp_tp_zmm, 12.0 * 64, threads))
                              : 0;
  return 0;  // scalar: no loop of ours (the benchmarks use torch's capped GEMM)
}

// bytes/s of `threads` threads reading their share of a `mib` MiB buffer: best of 3
static double stream(size_t mib, int threads) {
  if (!has("avx2")) return 0;
  const size_t bytes = mib << 20, share = bytes / threads / 128 * 128;
  char* buf = static_cast<char*>(std::aligned_alloc(64, bytes));
  if (buf == nullptr) return 0;
  run_threads(threads, [&](int t) { std::memset(buf + t * share, 1, share); });  // first touch
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const double dt = run_threads(threads, [&](int t) { g_sink = g_sink + stream_sum(buf + t * share, share); });
    if (rep > 0) best = std::max(best, static_cast<double>(share) * threads / dt);
  }
  std::free(buf);
  return best;
}

AVX512BF16 static void report() {
  alignas(64) int32_t pi[64];
  alignas(64) float pf[64];
  for (int i = 0; i < 64; ++i) {
    pi[i] = 0x3f803f80;
    pf[i] = 1.0f;
  }
  const long n = 20000000;
  float s = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = now();
    addchain(n * 4);
    const double ghz = n * 4 / (now() - t0) / 1e9;
    double t[6];
    float (*loops[4])(long) = {fma_tp_zmm, dp_tp_zmm, fma_lat, dp_lat};
    for (int i = 0; i < 4; ++i) {
      t0 = now();
      s += loops[i](n);
      t[i] = now() - t0;
    }
    t0 = now();
    s += fma_bcast(n, pf);
    t[4] = now() - t0;
    t0 = now();
    s += dp_bcast(n, pi);
    t[5] = now() - t0;
    const double ins = 12.0 * n;
    std::printf("clock~%.2f GHz (1 add/cycle)\n", ghz);
    std::printf("vfmadd231ps zmm: %.3f ns/instr thr (%.2f/cycle) -> %.1f GFLOP/s/core; latency %.2f ns (%.1f cyc)\n",
                t[0] / ins * 1e9, ins / t[0] / 1e9 / ghz, ins * 32 / t[0] / 1e9, t[2] / n * 1e9, t[2] / n * 1e9 * ghz);
    std::printf("vdpbf16ps  zmm: %.3f ns/instr thr (%.2f/cycle) -> %.1f GFLOP/s/core; latency %.2f ns (%.1f cyc)\n",
                t[1] / ins * 1e9, ins / t[1] / 1e9 / ghz, ins * 64 / t[1] / 1e9, t[3] / n * 1e9, t[3] / n * 1e9 * ghz);
    std::printf("fma+bcast(1 bcast:2 fma): %.1f GFLOP/s; dp+bcast: %.1f GFLOP/s\n", ins * 32 / t[4] / 1e9,
                ins * 64 / t[5] / 1e9);
  }
  g_sink = s;
}

int main(int argc, char** argv) {
  int threads = 1;
  std::string peaks;
  size_t mib = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--threads") threads = std::max(1, std::atoi(argv[i + 1]));
    else if (k == "--peak") peaks = argv[i + 1];
    else if (k == "--stream") mib = static_cast<size_t>(std::atol(argv[i + 1]));
    else {
      std::fprintf(stderr, "unknown option %s (--peak LEVELS, --stream MiB, --threads N)\n", argv[i]);
      return 2;
    }
  }
  if (peaks.empty() && mib == 0) {
    if (!has("avx512_bf16")) {
      std::printf("this CPU has no AVX512-BF16: the report needs it (--peak / --stream run anywhere)\n");
      return 0;
    }
    report();
    return 0;
  }
  for (size_t a = 0; a < peaks.size();) {
    size_t b = peaks.find(',', a);
    if (b == std::string::npos) b = peaks.size();
    const std::string isa = peaks.substr(a, b - a);
    std::printf("peak %s %.6g\n", isa.c_str(), level_peak(isa, threads));
    a = b + 1;
  }
  if (mib > 0) std::printf("stream %.6g\n", stream(mib, threads));
  return 0;
}
