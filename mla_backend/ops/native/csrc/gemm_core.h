// Torch-free GEMM core of the native CPU kernels' GEMM-shaped work: the per-head absorption
// GEMMs (head_gemm.cpp), the normal path's decompression (decompress.cpp) and its MHA
// (mha.cpp). Plain C++ over raw pointers, strides and sizes; one source, compiled once
// per ISA level (the build's MLA_HAS_* macros; derived from the compiler's own macros when the
// build defines no MLA_ISA_* level).
//
// The one operation everything is built from:
//
//   C[m, n] (+)= sum_k A[m, k] * B[k, n]     m < M (<= kMaxRows), n < ncols (a multiple of 64)
//
//   B  bf16 packed "VNNI pairs": B[k, n] at b[((k / 2) * ldb + n) * 2 + (k & 1)], kpairs =
//      ceil(K / 2) pair rows of ldb columns (zero-padded: odd K, columns past N);
//   A  a row block in the level's operand form (APanel, filled by pack_a / pack_a_f32):
//      fp32 rows where the CPU has no bf16 dot product, bf16 rows otherwise, row length lda =
//      round_up(K, 32), zero-padded (and zero rows up to a multiple of 16 for AMX tiles);
//   C  fp32, row stride ldc; with AMX the buffer must hold round_up(M, 16) rows.
//
// Vectors come from vec.h (VecF, W fp32 lanes of the level; load_bf16_pairs widens B's pairs).
// Per level (the ISA-specific parts are the inner kernels below, nothing else):
//   scalar      vec.h's portable 8-lane VecF in plain loops, 4 rows x 16 columns per block;
//   avx2        8-lane fp32 FMA: B's bf16 pairs widened in registers (a 16-bit shift for the
//               even k, a mask for the odd k), 4 rows x 16 columns per register block;
//   avx512      the same over 16 lanes, 4 rows x 64 columns;
//   neon        the avx2 scheme over 4-lane float32x4 (32 registers): 4 rows x 16 columns
//               (16 accumulators, 8 widened B vectors, 2 broadcasts);
//   neon_bf16   BFDOT (vbfdotq_f32) on A's bf16 pairs, broadcast, against 4 B vectors of 4
//               columns' pairs: 6 rows x 16 columns per register block (24 accumulators),
//               4 blocks per 64 columns. (BFMMLA would need B packed in k-quads x column
//               pairs, a different packed layout than the one every level shares; not used.)
//   sve         SVE BFDOT (svbfdot_f32), the neon_bf16 scheme over W = VL / 32 lanes:
//               6 rows x kNVD vectors, kNVD = min(4, 64 / W) (VL 128: 16 columns per block,
//               256: 32, 512: 64, 1024: 2 vectors of 32, 2048: 1 of 64); the VL is the build's
//               (-msve-vector-bits), every loop steps by W;
//   avx512_bf16 vdpbf16ps on A's bf16 pairs (exact products, fp32 sums), 6 rows x 64 columns;
//   amx         AMX-BF16 tiles (16 x 32 A, 16 pairs x 16 B, 16 x 16 fp32 C) for row blocks of
//               >= kAmxMinRows rows and whole chunks of 32 k; the k tail as avx512_bf16.
// Decode's 1-2 rows at the fp32 FMA levels (scalar, avx2, avx512, neon): kernel_widen_small, all
// 64 columns per pass where the registers allow (avx2 1 row: 8 vectors), even and odd k in
// accumulators of their own where twice as many fit (avx512, neon), so neither FMA latency nor
// strided passes bound it; every kernel prefetches B's row kp + 16 in its first pass (the
// panels come from memory at decode). A row block with fewer than kAmxMinRows rows is not
// padded for tiles.
// fp32 sums everywhere; bf16 outputs are rounded once (nearest even).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"  // the vector layer (and the level macros of a build that names none)

#if defined(MLA_HAS_AVX2)
#include <immintrin.h>
#endif
#include "amx_tiles.h"

#ifndef MLA_OPS_NS
#define MLA_OPS_NS mla_backend  // the torch.library namespace of a build that names no level
#endif

namespace mla_core {
namespace {

constexpr int64_t kCols = 64;      // columns per packed B block (and per C tile row)
constexpr int64_t kMaxRows = 32;   // rows per A panel
constexpr int64_t kKAlign = 32;    // A row length multiple (one AMX A tile row)
constexpr int kAmxMinRows = 8;     // fewer rows than this: the vector kernel, not tiles

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }
// p + n, where p may be the null data of an empty operand (nothing is read through it then;
// null + n would be undefined)
template <typename T>
inline T* at(T* p, int64_t n) { return p ? p + n : p; }

using mla_native::vec::VecF;
using mla_native::vec::bf16_to_f32;
using mla_native::vec::f32_to_bf16;  // nearest even; NaN -> 0x7fc0 (as c10)

// ---- A operand ------------------------------------------------------------------------
#if defined(MLA_HAS_AVX512BF16) || defined(MLA_HAS_NEON_BF16)
#define MLA_GEMM_BF16 1  // a bf16 dot-product inner kernel: A in bf16
#endif
#if defined(MLA_GEMM_BF16)
using AElem = uint16_t;  // bf16 rows (vdpbf16ps / AMX / BFDOT)
inline AElem a_from_bf16(uint16_t v) { return v; }
inline AElem a_from_f32(float v) { return f32_to_bf16(v); }
#else
using AElem = float;  // fp32 rows (bf16 widened once here)
inline AElem a_from_bf16(uint16_t v) { return bf16_to_f32(v); }
inline AElem a_from_f32(float v) { return v; }
#endif

#if defined(MLA_HAS_AMX)
constexpr int64_t kRowAlign = 16;
#else
constexpr int64_t kRowAlign = 1;
#endif

// A row block in operand form: buf holds round_up(kMaxRows, 16) x lda elements.
struct APanel {
  AElem* buf;
  int64_t lda;  // row length: round_up(K, kKAlign)
  int rows;     // M
  int64_t kpairs;
};

// One spare row past the panel: the fp32 kernels' compiled code (kernel_widen<4> at the scalar
// level, seen under valgrind in the indexer's GEMM) loads a pair from the row after the last one
// its block uses; nothing read there reaches C, but at the end of an allocation that ends on a
// page boundary the load faulted (an intermittent segfault at scalar).
inline int64_t a_panel_elems(int64_t K) {
  return (round_up(kMaxRows, 16) + 1) * round_up(std::max<int64_t>(K, 1), kKAlign);
}

// A[m, k] = src[m * sm + k * sk] (bf16), m < M, k < K; zero padding.
// Rows past M are zeroed up to a whole AMX tile only where gemm() takes the tiles (M >=
// kAmxMinRows): a decode panel of 1..7 rows costs no padding.
inline int padded_rows(int M) { return M >= kAmxMinRows ? static_cast<int>(round_up(M, kRowAlign)) : M; }

inline APanel pack_a(const uint16_t* src, int64_t sm, int64_t sk, int M, int64_t K, AElem* buf) {
  const int64_t lda = round_up(std::max<int64_t>(K, 1), kKAlign);
  const int rows = padded_rows(M);
  for (int m = 0; m < rows; ++m) {
    AElem* d = buf + m * lda;
    int64_t k = 0;
    if (m < M) {
      const uint16_t* s = at(src, m * sm);
      if (sk == 1) {
        for (; k < K; ++k) d[k] = a_from_bf16(s[k]);
      } else {
        for (; k < K; ++k) d[k] = a_from_bf16(s[k * sk]);
      }
    }
    for (; k < lda; ++k) d[k] = AElem(0);
  }
  return {buf, lda, M, cdiv(K, 2)};
}

// A[m, k] = src[m * sm + k] (fp32, e.g. probabilities), rounded to bf16 on bf16 levels.
inline APanel pack_a_f32(const float* src, int64_t sm, int M, int64_t K, AElem* buf) {
  const int64_t lda = round_up(std::max<int64_t>(K, 1), kKAlign);
  const int rows = padded_rows(M);
  for (int m = 0; m < rows; ++m) {
    AElem* d = buf + m * lda;
    int64_t k = 0;
    if (m < M)
      for (; k < K; ++k) d[k] = a_from_f32(src[m * sm + k]);
    for (; k < lda; ++k) d[k] = AElem(0);
  }
  return {buf, lda, M, cdiv(K, 2)};
}

// ---- B operand: pack once -------------------------------------------------------------
// dst[((k / 2) * ldb + n) * 2 + (k & 1)] = src[k * sk + n * sn] for k < K, n < N; zeros for
// the odd-K pad row and columns N..ldb. dst holds ceil(K / 2) * ldb * 2 elements.
inline void pack_b(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t ldb,
                   uint16_t* dst) {
  const int64_t kp = cdiv(K, 2);
  if (kp == 0) return;  // K = 0: nothing to pack (dst may be null)
  std::memset(dst, 0, static_cast<size_t>(kp * ldb * 2) * sizeof(uint16_t));
  for (int64_t k = 0; k < K; ++k) {
    uint16_t* d = dst + (k / 2) * ldb * 2 + (k & 1);
    const uint16_t* s = at(src, k * sk);
    for (int64_t n = 0; n < N; ++n) d[2 * n] = s[n * sn];
  }
}

// ---- inner kernels --------------------------------------------------------------------
// Software prefetch of B's pair row kp + kPrefetchRows (its 4 cache lines of 64 columns) while
// row kp is used, in the first pass over a panel: at decode the panels come from memory, and
// the kernels' column passes (16 columns of each 256-byte row at avx2) would otherwise touch a
// new line every few cycles with little memory-level parallelism. Past the panel's end it
// prefetches the next panel (head_gemm's panels are contiguous); prefetches never fault.
constexpr int64_t kPrefetchRows = 16;
inline void prefetch_b_row(const uint16_t* b, int64_t ldb, int64_t kp) {
  const uint16_t* p = b + (kp + kPrefetchRows) * ldb * 2;
  for (int l = 0; l < 4; ++l) mla_native::vec::prefetch_l2(p + 32 * l);
}

#if defined(MLA_HAS_AVX512BF16)
// M rows x 64 columns, vdpbf16ps on A's bf16 pairs.
template <int M>
inline void kernel_dot(const AElem* a, int64_t lda, int64_t kp0, int64_t kp1, const uint16_t* b,
                       int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = accumulate ? _mm512_loadu_ps(c + m * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const uint16_t* bp = b + kp * ldb * 2;
    prefetch_b_row(b, ldb, kp);
    __m512bh bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bp + 32 * j);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * kp, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, bv[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(c + m * ldc + 16 * j, acc[m][j]);
}
constexpr int kMR = 6;
#define MLA_INNER kernel_dot
#elif defined(MLA_HAS_SVE)
// M rows x kNVD vectors of W columns per pass (64 / (kNVD W) passes per 64 columns), SVE BFDOT:
// each fp32 lane += the dot product of its column's bf16 pair with A's pair, broadcast.
typedef svbfloat16_t mla_svbf16 __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
constexpr int kNVD = VecF::W >= kCols ? 1 : std::min<int>(4, kCols / VecF::W);
template <int M>
inline void kernel_dot(const AElem* a, int64_t lda, int64_t kp0, int64_t kp1, const uint16_t* b,
                       int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int W = VecF::W;
  const svbool_t all16 = svptrue_b16();
  for (int64_t n0 = 0; n0 < kCols; n0 += kNVD * W) {
    VecF acc[M][kNVD];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kNVD; ++j) acc[m][j] = accumulate ? VecF::load(c + m * ldc + n0 + j * W) : VecF::zero();
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const uint16_t* bp = b + (kp * ldb + n0) * 2;
      mla_svbf16 bv[kNVD];
      for (int j = 0; j < kNVD; ++j) bv[j] = svreinterpret_bf16_u16(svld1_u16(all16, bp + 2 * W * j));
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, a + m * lda + 2 * kp, 4);
        const svbfloat16_t av = svreinterpret_bf16_u32(svdup_n_u32(pair));
        for (int j = 0; j < kNVD; ++j) acc[m][j] = VecF(svbfdot_f32(acc[m][j].v, bv[j], av));
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kNVD; ++j) acc[m][j].store(c + m * ldc + n0 + j * W);
  }
}
constexpr int kMR = 6;
#define MLA_INNER kernel_dot
#elif defined(MLA_HAS_NEON_BF16)
// M rows x 16 columns (4 float32x4) per pass, 4 passes per 64 columns, BFDOT (vbfdotq_f32):
// each fp32 lane += the dot product of its column's bf16 pair with A's pair, broadcast.
template <int M>
inline void kernel_dot(const AElem* a, int64_t lda, int64_t kp0, int64_t kp1, const uint16_t* b,
                       int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < kCols; n0 += 16) {
    float32x4_t acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = accumulate ? vld1q_f32(c + m * ldc + n0 + 4 * j) : vdupq_n_f32(0.0f);
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const uint16_t* bp = b + (kp * ldb + n0) * 2;
      bfloat16x8_t bv[4];
      for (int j = 0; j < 4; ++j) bv[j] = vreinterpretq_bf16_u16(vld1q_u16(bp + 8 * j));
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, a + m * lda + 2 * kp, 4);
        const bfloat16x8_t av = vreinterpretq_bf16_u32(vdupq_n_u32(pair));
        for (int j = 0; j < 4; ++j) acc[m][j] = vbfdotq_f32(acc[m][j], bv[j], av);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) vst1q_f32(c + m * ldc + n0 + 4 * j, acc[m][j]);
  }
}
constexpr int kMR = 6;
#define MLA_INNER kernel_dot
#else
// M rows x kNV vectors of columns, fp32 FMA; B's bf16 pairs widened in registers.
// (32 registers: up to 4 vectors, 64 columns; 16 registers: 64 / 16 / 8 columns for W = 16 / 8 / 1)
constexpr int kNV = mla_native::vec::kVecRegs >= 32 ? std::min<int>(4, kCols / VecF::W)
                                                     : (VecF::W >= 16 ? 4 : (VecF::W >= 8 ? 2 : 1));
template <int M>
inline void kernel_widen(const AElem* a, int64_t lda, int64_t kp0, int64_t kp1, const uint16_t* b,
                         int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int W = VecF::W;
  for (int64_t n0 = 0; n0 < kCols; n0 += kNV * W) {
    VecF acc[M][kNV];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kNV; ++j) acc[m][j] = accumulate ? VecF::load(c + m * ldc + n0 + j * W) : VecF::zero();
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const uint16_t* bp = b + (kp * ldb + n0) * 2;
      if (n0 == 0) prefetch_b_row(b, ldb, kp);
      VecF ev[kNV], od[kNV];
      for (int j = 0; j < kNV; ++j) VecF::load_bf16_pairs(bp + 2 * W * j, ev[j], od[j]);
      for (int m = 0; m < M; ++m) {
        const VecF a0 = VecF::set1(a[m * lda + 2 * kp]);
        const VecF a1 = VecF::set1(a[m * lda + 2 * kp + 1]);
        for (int j = 0; j < kNV; ++j) acc[m][j] = mla_native::vec::fma(a1, od[j], mla_native::vec::fma(a0, ev[j], acc[m][j]));
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kNV; ++j) acc[m][j].store(c + m * ldc + n0 + j * W);
  }
}
constexpr int kMR = 4;
#define MLA_INNER kernel_widen

// Decode rows (M <= 2): kernel_widen's 16 columns per pass would leave 2 M accumulators, each a
// chain of 2 dependent FMAs per k pair (FMA-latency bound, and 64 / 16 strided passes over the
// panel). Here a pass spans kSmallNV<M> vectors (all 64 columns where the registers allow, so
// each k pair's 256 bytes are read once, in order) with the broadcasts hoisted per k pair, and
// where twice the accumulators still fit, the odd k go to accumulators of their own (added once
// at the end: still fp32 sums). Registers: M * NV (x 2 when split) accumulators + 2 M broadcasts
// + 2 widened B vectors.
constexpr int kColVecs = kCols / VecF::W;
template <int M>
constexpr int small_nv() {
  int nv = kColVecs;
  while (nv > 1 && M * nv + 2 * M + 2 > mla_native::vec::kVecRegs) nv /= 2;
  return nv;
}
template <int M>
constexpr bool small_split() {
  return 2 * M * small_nv<M>() + 2 * M + 2 <= mla_native::vec::kVecRegs;
}

template <int M>
inline void kernel_widen_small(const AElem* a, int64_t lda, int64_t kp0, int64_t kp1,
                               const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                               bool accumulate) {
  constexpr int W = VecF::W, NV = small_nv<M>();
  constexpr bool kSplit = small_split<M>();
  constexpr int NO = kSplit ? NV : 1;
  for (int64_t n0 = 0; n0 < kCols; n0 += NV * W) {
    VecF acc[M][NV], aco[M][NO];
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < NV; ++j) acc[m][j] = accumulate ? VecF::load(c + m * ldc + n0 + j * W) : VecF::zero();
      for (int j = 0; j < NO; ++j) aco[m][j] = VecF::zero();
    }
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const uint16_t* bp = b + (kp * ldb + n0) * 2;
      if (n0 == 0) prefetch_b_row(b, ldb, kp);
      VecF a0[M], a1[M];
      for (int m = 0; m < M; ++m) {
        a0[m] = VecF::set1(a[m * lda + 2 * kp]);
        a1[m] = VecF::set1(a[m * lda + 2 * kp + 1]);
      }
      for (int j = 0; j < NV; ++j) {
        VecF ev, od;
        VecF::load_bf16_pairs(bp + 2 * W * j, ev, od);
        for (int m = 0; m < M; ++m) {
          if constexpr (kSplit) {
            acc[m][j] = mla_native::vec::fma(a0[m], ev, acc[m][j]);
            aco[m][j] = mla_native::vec::fma(a1[m], od, aco[m][j]);
          } else {
            acc[m][j] = mla_native::vec::fma(a1[m], od, mla_native::vec::fma(a0[m], ev, acc[m][j]));
          }
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NV; ++j) {
        if constexpr (kSplit) acc[m][j] = acc[m][j] + aco[m][j];
        acc[m][j].store(c + m * ldc + n0 + j * W);
      }
  }
}
#define MLA_INNER_SMALL kernel_widen_small
#endif

// rows m0.. of A (at most kMR), pairs [kp0, kp1), 64 columns at b / c.
inline void inner_rows(int M, const AElem* a, int64_t lda, int64_t kp0, int64_t kp1,
                       const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  switch (M) {
#if defined(MLA_INNER_SMALL)
    case 1: return MLA_INNER_SMALL<1>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    case 2: return MLA_INNER_SMALL<2>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#else
    case 1: return MLA_INNER<1>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    case 2: return MLA_INNER<2>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#endif
    case 3: return MLA_INNER<3>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#if defined(MLA_GEMM_BF16)
    case 4: return MLA_INNER<4>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    case 5: return MLA_INNER<5>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    default: return MLA_INNER<6>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#else
    default: return MLA_INNER<4>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#endif
  }
}
#undef MLA_INNER
#undef MLA_INNER_SMALL

#if defined(MLA_HAS_AMX)
// ---- AMX tiles (configuration and OS permission: amx_tiles.h) --------------------------
using mla_amx::amx_configure;
using mla_amx::amx_request_permission;

// Every tile 16 rows x 64 bytes: tmm0-3 C (fp32 16 x 16), tmm4-5 A (bf16 16 x 32), tmm6-7 B
// (16 bf16 pairs x 16 columns).
// C rows [0, round_up(M, 16)) x ncols (+)= A x B over pairs [0, 16 * kchunks).
inline void amx_gemm(const APanel& a, int64_t kchunks, const uint16_t* b, int64_t ldb,
                     int64_t ncols, float* c, int64_t ldc, bool accumulate) {
  amx_configure();
  const int64_t sa = a.lda * 2, sb = ldb * 4, sc = ldc * 4;
  for (int m0 = 0; m0 < a.rows; m0 += 32) {
    const bool two = m0 + 16 < a.rows;
    const AElem* a0 = a.buf + m0 * a.lda;
    const AElem* a1 = a0 + 16 * a.lda;
    for (int64_t n0 = 0; n0 < ncols; n0 += 32) {
      float* c00 = c + m0 * ldc + n0;
      float* c10 = c00 + 16 * ldc;
      if (accumulate) {
        _tile_loadd(0, c00, sc);
        _tile_loadd(1, c00 + 16, sc);
        if (two) {
          _tile_loadd(2, c10, sc);
          _tile_loadd(3, c10 + 16, sc);
        }
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t kc = 0; kc < kchunks; ++kc) {
        const uint16_t* bp = b + (kc * 16 * ldb + n0) * 2;
        _tile_loadd(4, a0 + kc * 32, sa);
        _tile_loadd(6, bp, sb);
        _tile_loadd(7, bp + 32, sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a1 + kc * 32, sa);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c00, sc);
      _tile_stored(1, c00 + 16, sc);
      if (two) {
        _tile_stored(2, c10, sc);
        _tile_stored(3, c10 + 16, sc);
      }
    }
  }
}
#endif

// C[0:M, 0:ncols) (+)= A · B (see the header comment). ncols: a multiple of 64; ldc >= ncols.
inline void gemm(const APanel& a, const uint16_t* b, int64_t ldb, int64_t ncols, float* c,
                 int64_t ldc, bool accumulate) {
  int64_t kp0 = 0;
#if defined(MLA_HAS_AMX)
  if (a.rows >= kAmxMinRows && a.kpairs >= 16 && amx_request_permission()) {
    const int64_t kchunks = a.kpairs / 16;
    amx_gemm(a, kchunks, b, ldb, ncols, c, ldc, accumulate);
    kp0 = kchunks * 16;
    accumulate = true;
    if (kp0 == a.kpairs) return;
  }
#endif
  for (int m0 = 0; m0 < a.rows; m0 += kMR) {
    const int M = std::min(kMR, a.rows - m0);
    for (int64_t n0 = 0; n0 < ncols; n0 += kCols)
      inner_rows(M, a.buf + m0 * a.lda, a.lda, kp0, a.kpairs, b + n0 * 2, ldb, c + m0 * ldc + n0, ldc,
                 accumulate);
  }
}

// dst[m * drow + n * dcol] = bf16(C[m, n]) for m < M, n < N. Rows are rounded with vector
// stores; a transposed destination (dcol != 1: M <= kMaxRows, N <= kCols) goes through a bf16
// tile copied column by column.
inline void store_bf16(const float* c, int64_t ldc, int M, int64_t N, uint16_t* dst, int64_t drow,
                       int64_t dcol) {
  uint16_t tile[kMaxRows * kCols];
  const bool direct = dcol == 1;
  for (int m = 0; m < M; ++m) {
    const float* cr = c + m * ldc;
    uint16_t* d = direct ? dst + m * drow : tile + m * kCols;
    for (int64_t n = 0; n < N; n += VecF::W) {
      const int k = static_cast<int>(std::min<int64_t>(VecF::W, N - n));
      (k == VecF::W ? VecF::load(cr + n) : VecF::load_n(cr + n, k)).store_bf16_n(d + n, k);
    }
  }
  if (direct) return;
  for (int64_t n = 0; n < N; ++n) {
    uint16_t* d = dst + n * dcol;
    for (int m = 0; m < M; ++m) d[m * drow] = tile[m * kCols + n];
  }
}

}  // namespace
}  // namespace mla_core
