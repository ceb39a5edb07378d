// decode_core.cpp: one thread's CPU time of the torch-free attention core's absorbed decode
// (core::absorbed_attention, bf16 q and page-16 bf16 cache, r 512 + rope 64, shuffled pages, one
// kv split, engine 0 = the fp32 engine), best over `secs` seconds of thread CPU time (a loaded
// machine deschedules the thread; CPU time does not count that). Prints ms and GFLOP/s; compare
// with `dot_throughput --peak <level> --threads 1`. Build per level with that level's flags:
//   FL=$(python3 -c "from mla_backend.ops.native import build; print(' '.join(build.level_flags('avx2')))")
//   g++ $FL -Imla_backend/ops/native/csrc -pthread benchmarks/micro/decode_core.cpp -o dc
//   ./dc H B L [secs]
#define MLA_CORE_ONLY 1
#include "absorbed_attention.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

namespace core = mla_native::core;

static double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static uint16_t to_bf16(float x) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s H B L [secs]\n", argv[0]);
    return 2;
  }
  const int H = std::atoi(argv[1]), B = std::atoi(argv[2]), L = std::atoi(argv[3]);
  const double secs = argc > 4 ? std::atof(argv[4]) : 1.0;
  const int r = 512, rope = 64, D = r + rope, ps = 16;
  const int pages_per = (L + ps - 1) / ps, np = B * pages_per + 1;  // page 0 unused
  std::mt19937 g(0);
  std::normal_distribution<float> nd(0, 0.5);
  std::vector<uint16_t> cache(static_cast<size_t>(np) * ps * D), q(static_cast<size_t>(B) * H * D);
  std::vector<uint16_t> out(static_cast<size_t>(B) * H * r);
  for (auto& x : cache) x = to_bf16(nd(g));
  for (auto& x : q) x = to_bf16(nd(g));
  std::vector<int32_t> perm(np - 1), bt(static_cast<size_t>(B) * pages_per), cu(B + 1), kvl(B, L);
  for (int i = 0; i < np - 1; ++i) perm[i] = i + 1;
  std::shuffle(perm.begin(), perm.end(), g);
  for (int i = 0; i < B * pages_per; ++i) bt[i] = perm[i];
  for (int i = 0; i <= B; ++i) cu[i] = i;
  std::vector<float> lse(static_cast<size_t>(B) * H);
  core::Params P;
  P.H = H, P.r = r, P.rope = rope, P.D = D, P.B = B, P.page_size = ps, P.num_pages = np;
  P.bt = bt.data(), P.bt_s0 = pages_per, P.cu = cu.data(), P.kvl = kvl.data();
  const char* qc = reinterpret_cast<const char*>(q.data());
  P.qlat = qc, P.ql_s0 = H * D * 2, P.ql_s1 = D * 2;
  P.qpe = qc + r * 2, P.qp_s0 = H * D * 2, P.qp_s1 = D * 2;
  P.cache = reinterpret_cast<const char*>(cache.data());
  P.c_s0 = ps * D * 2, P.c_s1 = D * 2, P.row_bytes = D * 2;
  P.score_scale = 0.07f, P.out_scale = 1.0f;
  P.out = reinterpret_cast<char*>(out.data()), P.lse = lse.data();
  const core::Bounds b{B, B, pages_per, -1};
  const core::Parallel one_thread;
  auto run = [&] { return core::absorbed_attention(P, b, core::DType::kBF16, core::kPlain, 1, one_thread, 0); };
  if (std::string err = run(); !err.empty()) {
    std::printf("refused: %s\n", err.c_str());
    return 1;
  }
  double best = 1e9;
  for (const double end = cpu_seconds() + secs; cpu_seconds() < end;) {
    const double t0 = cpu_seconds();
    run();
    best = std::min(best, cpu_seconds() - t0);
  }
  const double flop = 2.0 * H * L * (2 * r + rope) * B;
  double checksum = 0;
  for (int i = 0; i < 64; ++i) checksum += out[i];
  std::printf("H%d B%d L%d: %.3f ms  %.1f GFLOP/s (checksum %g)\n", H, B, L, best * 1e3, flop / best / 1e9, checksum);
  return 0;
}
