// Torch-free GEMM core of the native CPU kernels' GEMM-shaped work: the per-head absorption
// GEMMs (head_gemm.cpp), the normal path's decompression (decompress.cpp) and its MHA
// (mha_prefill.cpp). Plain C++ over raw pointers, strides and sizes; one source, compiled once
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
// Per level (the ISA-specific parts are the three inner kernels below, nothing else):
//   scalar      plain loops (the fallback of non-x86 builds);
//   avx2        8-lane fp32 FMA: B's bf16 pairs widened in registers (a 16-bit shift for the
//               even k, a mask for the odd k), 4 rows x 16 columns per register block;
//   avx512      the same over 16 lanes, 4 rows x 64 columns;
//   avx512_bf16 vdpbf16ps on A's bf16 pairs (exact products, fp32 sums), 6 rows x 64 columns;
//   amx         AMX-BF16 tiles (16 x 32 A, 16 pairs x 16 B, 16 x 16 fp32 C) for row blocks of
//               >= kAmxMinRows rows and whole chunks of 32 k; the k tail as avx512_bf16.
// fp32 sums everywhere; bf16 outputs are rounded once (nearest even).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if !defined(MLA_ISA_SCALAR) && !defined(MLA_ISA_AVX2) && !defined(MLA_ISA_AVX512) && \
    !defined(MLA_ISA_AVX512BF16) && !defined(MLA_ISA_AMX)
// a build that names no level: take what the compiler was told
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MLA_HAS_AVX2 1
#endif
#if defined(MLA_HAS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define MLA_HAS_AVX512 1
#endif
#if defined(MLA_HAS_AVX512) && defined(__AVX512BF16__)
#define MLA_HAS_AVX512BF16 1
#endif
#if defined(MLA_HAS_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MLA_HAS_AMX 1
#endif
#endif

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

// ---- scalar bf16 <-> fp32 -------------------------------------------------------------
inline float bf16_to_f32(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ---- the vector type: W fp32 lanes ---------------------------------------------------
#if defined(MLA_HAS_AVX512)
struct VF {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2i(T n) {  // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static T zero_where_le(T v, T x, float lo) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GT_OQ), v);
  }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
  static float hmax(T v) { return _mm512_reduce_max_ps(v); }
  // W bf16 pairs (2W uint16) -> the even and the odd element of each pair as fp32
  static void widen_pairs(const uint16_t* p, T& even, T& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store_bf16(uint16_t* p, T v) {
#if defined(MLA_HAS_AVX512BF16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
};
#elif defined(MLA_HAS_AVX2)
struct VF {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2i(T n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static T zero_where_le(T v, T x, float lo) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GT_OQ));
  }
  static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(T v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static void widen_pairs(const uint16_t* p, T& even, T& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store_bf16(uint16_t* p, T v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};
#else
struct VF {  // one lane: the portable build
  using T = float;
  static constexpr int W = 1;
  static T zero() { return 0.0f; }
  static T set1(float x) { return x; }
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T max(T a, T b) { return a > b ? a : b; }
  static T min(T a, T b) { return a < b ? a : b; }
  static T fma(T a, T b, T c) { return a * b + c; }  // std::fma is a libm call without FMA
  static T round(T x) { return std::nearbyint(x); }
  static T pow2i(T n) { return std::ldexp(1.0f, static_cast<int>(n)); }
  static T zero_where_le(T v, T x, float lo) { return x > lo ? v : 0.0f; }
  static float hsum(T v) { return v; }
  static float hmax(T v) { return v; }
  static void widen_pairs(const uint16_t* p, T& even, T& odd) {
    even = bf16_to_f32(p[0]);
    odd = bf16_to_f32(p[1]);
  }
  static void store_bf16(uint16_t* p, T v) { *p = f32_to_bf16(v); }
};
#endif

// exp(x), ~1 ulp on the softmax range; x <= -87 (and -inf) gives exactly 0.
inline VF::T vexp(VF::T x) {
  constexpr float kCoef[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  const VF::T y = VF::min(VF::max(x, VF::set1(-87.0f)), VF::set1(88.0f));
  const VF::T n = VF::round(VF::mul(y, VF::set1(1.44269504088896341f)));
  VF::T r = VF::fma(n, VF::set1(-0.693359375f), y);
  r = VF::fma(n, VF::set1(2.12194440e-4f), r);
  VF::T p = VF::set1(kCoef[0]);
  for (int i = 1; i < 7; ++i) p = VF::fma(p, r, VF::set1(kCoef[i]));
  return VF::zero_where_le(VF::mul(p, VF::pow2i(n)), x, -87.0f);
}

// ---- A operand ------------------------------------------------------------------------
#if defined(MLA_HAS_AVX512BF16)
using AElem = uint16_t;  // bf16 rows (vdpbf16ps / AMX)
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

inline int64_t a_panel_elems(int64_t K) { return round_up(kMaxRows, 16) * round_up(std::max<int64_t>(K, 1), kKAlign); }

// A[m, k] = src[m * sm + k * sk] (bf16), m < M, k < K; zero padding.
inline APanel pack_a(const uint16_t* src, int64_t sm, int64_t sk, int M, int64_t K, AElem* buf) {
  const int64_t lda = round_up(std::max<int64_t>(K, 1), kKAlign);
  const int rows = static_cast<int>(round_up(M, kRowAlign));
  for (int m = 0; m < rows; ++m) {
    AElem* d = buf + m * lda;
    int64_t k = 0;
    if (m < M) {
      const uint16_t* s = src + m * sm;
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
  const int rows = static_cast<int>(round_up(M, kRowAlign));
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
  std::memset(dst, 0, static_cast<size_t>(kp * ldb * 2) * sizeof(uint16_t));
  for (int64_t k = 0; k < K; ++k) {
    uint16_t* d = dst + (k / 2) * ldb * 2 + (k & 1);
    const uint16_t* s = src + k * sk;
    for (int64_t n = 0; n < N; ++n) d[2 * n] = s[n * sn];
  }
}

// ---- inner kernels --------------------------------------------------------------------
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
#else
// M rows x NV vectors of columns, fp32 FMA; B's bf16 pairs widened in registers.
constexpr int kNV = VF::W >= 16 ? 4 : (VF::W >= 8 ? 2 : 1);
template <int M>
inline void kernel_widen(const AElem* a, int64_t lda, int64_t kp0, int64_t kp1, const uint16_t* b,
                         int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int W = VF::W;
  for (int64_t n0 = 0; n0 < kCols; n0 += kNV * W) {
    typename VF::T acc[M][kNV];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kNV; ++j) acc[m][j] = accumulate ? VF::load(c + m * ldc + n0 + j * W) : VF::zero();
    for (int64_t kp = kp0; kp < kp1; ++kp) {
      const uint16_t* bp = b + (kp * ldb + n0) * 2;
      typename VF::T ev[kNV], od[kNV];
      for (int j = 0; j < kNV; ++j) VF::widen_pairs(bp + 2 * W * j, ev[j], od[j]);
      for (int m = 0; m < M; ++m) {
        const typename VF::T a0 = VF::set1(a[m * lda + 2 * kp]);
        const typename VF::T a1 = VF::set1(a[m * lda + 2 * kp + 1]);
        for (int j = 0; j < kNV; ++j) acc[m][j] = VF::fma(a1, od[j], VF::fma(a0, ev[j], acc[m][j]));
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kNV; ++j) VF::store(c + m * ldc + n0 + j * W, acc[m][j]);
  }
}
constexpr int kMR = 4;
#define MLA_INNER kernel_widen
#endif

// rows m0.. of A (at most kMR), pairs [kp0, kp1), 64 columns at b / c.
inline void inner_rows(int M, const AElem* a, int64_t lda, int64_t kp0, int64_t kp1,
                       const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  switch (M) {
    case 1: return MLA_INNER<1>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    case 2: return MLA_INNER<2>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    case 3: return MLA_INNER<3>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#if defined(MLA_HAS_AVX512BF16)
    case 4: return MLA_INNER<4>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    case 5: return MLA_INNER<5>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
    default: return MLA_INNER<6>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#else
    default: return MLA_INNER<4>(a, lda, kp0, kp1, b, ldb, c, ldc, accumulate);
#endif
  }
}
#undef MLA_INNER

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
    int64_t n = 0;
    for (; n + VF::W <= N; n += VF::W) VF::store_bf16(d + n, VF::load(cr + n));
    for (; n < N; ++n) d[n] = f32_to_bf16(cr[n]);
  }
  if (direct) return;
  for (int64_t n = 0; n < N; ++n) {
    uint16_t* d = dst + n * dcol;
    for (int m = 0; m < M; ++m) d[m * drow] = tile[m * kCols + n];
  }
}

}  // namespace
}  // namespace mla_core
