// vec.h: the native kernels' thin vector layer (plain C++, no torch includes).
//
// `VecF` is a vector of W fp32 lanes of the build's ISA level (build.py sets the macros):
//   MLA_HAS_AVX512 (AVX-512 F/BW/VL/DQ): W = 16, __m512, masked loads / stores;
//   MLA_HAS_AVX2 (AVX2 + FMA + F16C):    W = 8,  __m256, tail loads through a small buffer;
//   MLA_HAS_SVE (SVE + BF16, -msve-vector-bits=N): W = N / 32 (4 .. 64), a fixed-size
//                                       svfloat32_t, whilelt predicates for partial vectors;
//   MLA_HAS_NEON (Armv8.2-A + fp16):    W = 4,  float32x4_t, tails through a small buffer;
//   none of these (the scalar level, on x86-64 or aarch64): W = 8 plain floats (loops the
//   compiler may auto-vectorise).
// kVecRegs: the level's architectural vector registers (32 on AVX-512 and aarch64, else 16).
// Operations: load / store (full) and load_n / store_n (first n < W lanes, the others read as
// +0 and are not written), set1, zero, add / sub / mul / div / fma / max / abs, exp (~1 ulp
// over the softmax range, x <= -87 gives exactly 0), hsum / hmax / hsum_many (N sums at once),
// keep_first / select_first (lanes >= n set to 0 / a value), and the widening loads
// bf16 / fp16 / e4m3 -> fp32 (load_bf16_pairs: W bf16 pairs -> their even and odd elements,
// the GEMM's packed B operand) and the narrowing stores fp32 -> bf16 / fp16 / e4m3 (round to
// nearest even, bit-identical to c10's conversions for non-NaN values and the default NaN).
//
// e4m3 decode (load_e4m3_div256): a sign-extended e4m3 byte shifted left by 7 and masked with
// 0xBF80 is the fp16 of value / 256 exactly (normal and subnormal bytes; NaN bytes 0x7f / 0xff
// read as +-480 / 256); vcvtph2ps (F16C / AVX-512F) widens it exactly, whatever MXCSR.DAZ says,
// and so does FCVT on aarch64 (NEON vcvt_f32_f16, SVE svcvt_f32_f16 on the low half of each
// 32-bit lane; half -> single conversions ignore FPCR.FZ16). The aarch64 narrowing to fp16 uses
// FPCR's rounding mode, round to nearest even unless a process changed it.
// Callers multiply by 256 (kFp8Unscale), or by 256 x a tile scale (the same real number as
// value x scale, so the same fp32 rounding).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(MLA_ISA_SCALAR) && !defined(MLA_ISA_AVX2) && !defined(MLA_ISA_AVX512) && \
    !defined(MLA_ISA_AVX512BF16) && !defined(MLA_ISA_AMX) && !defined(MLA_ISA_NEON) && \
    !defined(MLA_ISA_NEON_BF16) && !defined(MLA_ISA_SVE)
// a build that names no level (build.py always names one): take what the compiler was told
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MLA_HAS_AVX2)
#define MLA_HAS_AVX2 1
#endif
#if defined(MLA_HAS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__) && !defined(MLA_HAS_AVX512)
#define MLA_HAS_AVX512 1
#endif
#if defined(MLA_HAS_AVX512) && defined(__AVX512BF16__) && !defined(MLA_HAS_AVX512BF16)
#define MLA_HAS_AVX512BF16 1
#endif
#if defined(MLA_HAS_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(MLA_HAS_AMX)
#define MLA_HAS_AMX 1
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC) && !defined(MLA_HAS_NEON)
#define MLA_HAS_NEON 1
#endif
#if defined(MLA_HAS_NEON) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) && !defined(MLA_HAS_NEON_BF16)
#define MLA_HAS_NEON_BF16 1
#endif
#if defined(MLA_HAS_NEON_BF16) && defined(__ARM_FEATURE_SVE) && defined(__ARM_FEATURE_SVE_BITS) && \
    __ARM_FEATURE_SVE_BITS > 0 && !defined(MLA_HAS_SVE)
#define MLA_HAS_SVE 1
#endif
#endif

#if defined(MLA_HAS_AVX2) || defined(MLA_HAS_AVX512)
#include <immintrin.h>
#endif
#if defined(MLA_HAS_AVX512) && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#error "MLA_HAS_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq"
#endif
#if defined(MLA_HAS_AVX2) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "MLA_HAS_AVX2 needs -mavx2 -mfma -mf16c"
#endif
#if defined(MLA_HAS_NEON)
#if !(defined(__aarch64__) && defined(__ARM_FEATURE_FP16_VECTOR_ARITHMETIC))
#error "MLA_HAS_NEON needs an aarch64 compiler and -march=armv8.2-a+fp16"
#endif
#include <arm_neon.h>
#endif
#if defined(MLA_HAS_NEON_BF16) && !(defined(MLA_HAS_NEON) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC))
#error "MLA_HAS_NEON_BF16 needs MLA_HAS_NEON and -march=...+bf16"
#endif
#if defined(MLA_HAS_SVE)
#if !(defined(MLA_HAS_NEON_BF16) && defined(__ARM_FEATURE_SVE) && defined(__ARM_FEATURE_SVE_BITS) && \
      __ARM_FEATURE_SVE_BITS > 0)
#error "MLA_HAS_SVE needs MLA_HAS_NEON_BF16, -march=...+sve+bf16 and -msve-vector-bits=<N>"
#endif
#include <arm_sve.h>
#endif

namespace mla_native {
namespace vec {

constexpr float kFp8Unscale = 256.0f;

// architectural vector registers of the level (the register blocking of the kernels keys on it)
#if defined(MLA_HAS_AVX512) || defined(MLA_HAS_NEON)
constexpr int kVecRegs = 32;
#else
constexpr int kVecRegs = 16;
#endif

// storage types of 16-bit floats (bits only; the torch layer's c10::BFloat16 / c10::Half
// have the same layout)
struct bf16_t {
  uint16_t x;
};
struct fp16_t {
  uint16_t x;
};

// ---- scalar bit conversions (used by every level for odd elements) ------------------------
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN -> 0x7fc0 (as c10)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    float f = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// e4m3fn byte -> float (exact; 0x7f / 0xff are NaN)
inline float e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  float v;
  if (e == 15 && m == 7) v = std::nanf("");
  else if (e == 0) v = std::ldexp(static_cast<float>(m), -9);
  else v = std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}
// float -> e4m3fn bits, round to nearest even, |f| >= 480 or NaN -> 0x7f | sign (as c10's
// fp8e4m3fn_from_fp32_value; callers clamp to +-448 first).
inline uint8_t f32_to_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t res;
  if (u >= (1087u << 20)) {
    res = 0x7f;
  } else if (u < (121u << 23)) {
    float x;
    std::memcpy(&x, &u, 4);
    x += 16384.0f;  // 141 << 23
    std::memcpy(&u, &x, 4);
    res = u - (141u << 23);
  } else {
    const uint32_t odd = (u >> 20) & 1;
    u += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffff;
    u += odd;
    res = u >> 20;
  }
  return static_cast<uint8_t>(res | (sign >> 24));
}

#if defined(MLA_HAS_AVX512)
// =========================================== AVX-512 ======================================
struct VecF {
  static constexpr int W = 16;
  __m512 v;
  VecF() = default;
  explicit VecF(__m512 x) : v(x) {}
  static inline __mmask16 mask(int n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n > 0 ? n : 0)) - 1);
  }
  static VecF zero() { return VecF(_mm512_setzero_ps()); }
  static VecF set1(float x) { return VecF(_mm512_set1_ps(x)); }
  static VecF load(const float* p) { return VecF(_mm512_loadu_ps(p)); }
  static VecF load_n(const float* p, int n) { return VecF(_mm512_maskz_loadu_ps(mask(n), p)); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_n(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  static VecF load_bf16(const uint16_t* p) {
    return VecF(_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
  }
  static VecF load_bf16_n(const uint16_t* p, int n) {
    return VecF(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(n), p)), 16)));
  }
  static VecF load_fp16(const uint16_t* p) {
    return VecF(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = VecF(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    odd = VecF(_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
  }
  static VecF load_fp16_n(const uint16_t* p, int n) {
    return VecF(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p)));
  }
  static VecF e4m3_bits(__m128i bytes) {
    __m256i x = _mm256_cvtepi8_epi16(bytes);
    x = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    return VecF(_mm512_cvtph_ps(x));
  }
  static VecF load_e4m3_div256(const uint8_t* p) {
    return e4m3_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static VecF load_e4m3_div256_n(const uint8_t* p, int n) { return e4m3_bits(_mm_maskz_loadu_epi8(mask(n), p)); }
  // narrowing stores of the first n lanes
  void store_bf16_n(uint16_t* p, int n) const {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(p, mask(n), _mm512_cvtepi32_epi16(r));
  }
  void store_fp16_n(uint16_t* p, int n) const {
    _mm256_mask_storeu_epi16(p, mask(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  void store_e4m3_n(uint8_t* p, int n) const {  // callers clamp to +-448 first
    const __m512i u0 = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(u0, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512i u = _mm512_xor_si512(u0, sign);
    const __mmask16 big = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(1087 << 20));
    const __mmask16 sub = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(121 << 23));
    const __m512i s = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), _mm512_set1_ps(16384.0f))),
        _mm512_set1_epi32(141 << 23));
    __m512i nrm = _mm512_add_epi32(u, _mm512_set1_epi32(static_cast<int>((static_cast<uint32_t>(7 - 127) << 23) + 0x7ffff)));
    nrm = _mm512_srli_epi32(_mm512_add_epi32(nrm, _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1))), 20);
    __m512i r = _mm512_mask_mov_epi32(nrm, sub, s);
    r = _mm512_mask_mov_epi32(r, big, _mm512_set1_epi32(0x7f));
    r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
    _mm_mask_storeu_epi8(p, mask(n), _mm512_cvtepi32_epi8(r));
  }
};
inline VecF operator+(VecF a, VecF b) { return VecF(_mm512_add_ps(a.v, b.v)); }
inline VecF operator-(VecF a, VecF b) { return VecF(_mm512_sub_ps(a.v, b.v)); }
inline VecF operator*(VecF a, VecF b) { return VecF(_mm512_mul_ps(a.v, b.v)); }
inline VecF operator/(VecF a, VecF b) { return VecF(_mm512_div_ps(a.v, b.v)); }
inline VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm512_fmadd_ps(a.v, b.v, c.v)); }
inline VecF max(VecF a, VecF b) { return VecF(_mm512_max_ps(a.v, b.v)); }
inline VecF abs(VecF a) { return VecF(_mm512_abs_ps(a.v)); }
// min(c, x) / max(c, x) that pass a NaN x through (torch.clamp semantics)
inline VecF clamp_nan_through(VecF x, float lo, float hi) {
  return VecF(_mm512_max_ps(_mm512_set1_ps(lo), _mm512_min_ps(_mm512_set1_ps(hi), x.v)));
}
inline bool any_nan(VecF a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
inline float hsum(VecF a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(VecF a) { return _mm512_reduce_max_ps(a.v); }
// lanes >= n set to 0 / to fill
inline VecF keep_first(VecF a, int n) { return VecF(_mm512_maskz_mov_ps(VecF::mask(n), a.v)); }
inline VecF select_first(VecF a, int n, float fill) {
  return VecF(_mm512_mask_mov_ps(_mm512_set1_ps(fill), VecF::mask(n), a.v));
}
// out[k] = hsum(acc[k]) for k < N: one 16 x 16 transpose-and-add per group of 16
template <int N>
inline void hsum_many(const VecF* acc, float* out) {
  for (int g = 0; g < N; g += 16) {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = g + i < N ? acc[g + i].v : _mm512_setzero_ps();
    __m512 s[8];
    for (int i = 0; i < 8; ++i)
      s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    __m512 t[4];
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
      t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_mask_storeu_ps(out + g, VecF::mask(N - g), z);
  }
}
inline VecF exp(VecF a) {
  __m512 x = a.v;
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return VecF(_mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n)));
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#elif defined(MLA_HAS_AVX2)
// =========================================== AVX2 =========================================
struct VecF {
  static constexpr int W = 8;
  __m256 v;
  VecF() = default;
  explicit VecF(__m256 x) : v(x) {}
  static inline __m256i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static VecF zero() { return VecF(_mm256_setzero_ps()); }
  static VecF set1(float x) { return VecF(_mm256_set1_ps(x)); }
  static VecF load(const float* p) { return VecF(_mm256_loadu_ps(p)); }
  static VecF load_n(const float* p, int n) { return VecF(_mm256_maskload_ps(p, lane_mask(n))); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_n(float* p, int n) const { _mm256_maskstore_ps(p, lane_mask(n), v); }
  static __m128i load16_n(const uint16_t* p, int n) {  // n < 8 halfwords, the rest 0
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, static_cast<size_t>(n > 0 ? n : 0) * 2);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  static VecF bf16_bits(__m128i h) { return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))); }
  static VecF load_bf16(const uint16_t* p) { return bf16_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VecF load_bf16_n(const uint16_t* p, int n) { return bf16_bits(load16_n(p, n)); }
  static VecF load_fp16(const uint16_t* p) { return VecF(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = VecF(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
    odd = VecF(_mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))));
  }
  static VecF load_fp16_n(const uint16_t* p, int n) { return VecF(_mm256_cvtph_ps(load16_n(p, n))); }
  static VecF e4m3_bits(__m128i bytes) {
    __m128i x = _mm_cvtepi8_epi16(bytes);
    x = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    return VecF(_mm256_cvtph_ps(x));
  }
  static VecF load_e4m3_div256(const uint8_t* p) {
    return e4m3_bits(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static VecF load_e4m3_div256_n(const uint8_t* p, int n) {
    alignas(16) uint8_t t[16] = {0};
    std::memcpy(t, p, static_cast<size_t>(n > 0 ? n : 0));
    return e4m3_bits(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  static void store16_n(uint16_t* p, __m128i h, int n) {
    if (n >= 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    } else {
      alignas(16) uint16_t t[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
      std::memcpy(p, t, static_cast<size_t>(n > 0 ? n : 0) * 2);
    }
  }
  static __m128i pack32to16(__m256i r) {  // lanes <= 0xffff
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  void store_bf16_n(uint16_t* p, int n) const {
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    store16_n(p, pack32to16(r), n);
  }
  void store_fp16_n(uint16_t* p, int n) const {
    store16_n(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), n);
  }
  void store_e4m3_n(uint8_t* p, int n) const {  // callers clamp to +-448 first
    const __m256i u0 = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(u0, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const __m256i u = _mm256_xor_si256(u0, sign);  // < 2^31: signed compares are unsigned ones
    const __m256i big = _mm256_cmpgt_epi32(u, _mm256_set1_epi32((1087 << 20) - 1));
    const __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), u);
    const __m256i s = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(16384.0f))),
        _mm256_set1_epi32(141 << 23));
    __m256i nrm = _mm256_add_epi32(u, _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(7 - 127) << 23) + 0x7ffff)));
    nrm = _mm256_srli_epi32(_mm256_add_epi32(nrm, _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1))), 20);
    __m256i r = _mm256_blendv_epi8(nrm, s, sub);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), big);
    r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
    const __m128i h = pack32to16(r);
    const __m128i b = _mm_packus_epi16(h, h);
    if (n >= 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b);
    } else {
      alignas(16) uint8_t t[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(t), b);
      std::memcpy(p, t, static_cast<size_t>(n > 0 ? n : 0));
    }
  }
};
inline VecF operator+(VecF a, VecF b) { return VecF(_mm256_add_ps(a.v, b.v)); }
inline VecF operator-(VecF a, VecF b) { return VecF(_mm256_sub_ps(a.v, b.v)); }
inline VecF operator*(VecF a, VecF b) { return VecF(_mm256_mul_ps(a.v, b.v)); }
inline VecF operator/(VecF a, VecF b) { return VecF(_mm256_div_ps(a.v, b.v)); }
inline VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm256_fmadd_ps(a.v, b.v, c.v)); }
inline VecF max(VecF a, VecF b) { return VecF(_mm256_max_ps(a.v, b.v)); }
inline VecF abs(VecF a) {
  return VecF(_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))));
}
inline VecF clamp_nan_through(VecF x, float lo, float hi) {
  return VecF(_mm256_max_ps(_mm256_set1_ps(lo), _mm256_min_ps(_mm256_set1_ps(hi), x.v)));
}
inline bool any_nan(VecF a) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)) != 0; }
inline float hsum(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(VecF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VecF keep_first(VecF a, int n) {
  return VecF(_mm256_and_ps(a.v, _mm256_castsi256_ps(VecF::lane_mask(n))));
}
inline VecF select_first(VecF a, int n, float fill) {
  return VecF(_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, _mm256_castsi256_ps(VecF::lane_mask(n))));
}
// out[k] = hsum(acc[k]) for k < N: horizontal adds per group of 8
template <int N>
inline void hsum_many(const VecF* acc, float* out) {
  for (int g = 0; g < N; g += 8) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) v[i] = g + i < N ? acc[g + i].v : _mm256_setzero_ps();
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    const __m256 z = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    if (N - g >= 8) {
      _mm256_storeu_ps(out + g, z);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, z);
      std::memcpy(out + g, t, static_cast<size_t>(N - g) * 4);
    }
  }
}
inline VecF exp(VecF a) {
  __m256 x = a.v;
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n for n in [-126, 127] (x is clamped to [-87, 88]): the exponent field directly
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return VecF(_mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep));
}
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#elif defined(MLA_HAS_SVE)
// ============================ SVE (fixed vector length per build) ===========================
// ACLE SVE types are sizeless; -msve-vector-bits=N (build.py: the level's VL parameter) gives
// the fixed-size arm_sve_vector_bits(N) types below, which can be struct members and array
// elements. W = N / 32 lanes; every loop steps by W and every partial vector goes through a
// whilelt predicate, so nothing assumes 128-bit vectors. The loader runs a build only in a
// process whose SVE vector length is N.
typedef svfloat32_t mla_svf32 __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
struct VecF {
  static constexpr int W = __ARM_FEATURE_SVE_BITS / 32;
  mla_svf32 v;
  VecF() = default;
  explicit VecF(svfloat32_t x) : v(x) {}
  static svbool_t all() { return svptrue_b32(); }
  static svbool_t mask(int n) { return svwhilelt_b32(0, n > 0 ? n : 0); }
  static VecF zero() { return VecF(svdup_n_f32(0.0f)); }
  static VecF set1(float x) { return VecF(svdup_n_f32(x)); }
  static VecF load(const float* p) { return VecF(svld1_f32(all(), p)); }
  static VecF load_n(const float* p, int n) { return VecF(svld1_f32(mask(n), p)); }
  void store(float* p) const { svst1_f32(all(), p, v); }
  void store_n(float* p, int n) const { svst1_f32(mask(n), p, v); }
  // 16-bit elements zero-extended into the 32-bit lanes (inactive lanes read 0)
  static svuint32_t ld16(svbool_t pg, const uint16_t* p) { return svld1uh_u32(pg, p); }
  static VecF bf16_bits(svuint32_t h) { return VecF(svreinterpret_f32_u32(svlsl_n_u32_x(all(), h, 16))); }
  // fp16 in the low half of each 32-bit lane -> fp32 (exact)
  static VecF fp16_bits(svuint32_t h) { return VecF(svcvt_f32_f16_x(all(), svreinterpret_f16_u32(h))); }
  static VecF load_bf16(const uint16_t* p) { return bf16_bits(ld16(all(), p)); }
  static VecF load_bf16_n(const uint16_t* p, int n) { return bf16_bits(ld16(mask(n), p)); }
  static VecF load_fp16(const uint16_t* p) { return fp16_bits(ld16(all(), p)); }
  static VecF load_fp16_n(const uint16_t* p, int n) { return fp16_bits(ld16(mask(n), p)); }
  static void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    const svuint32_t x = svld1_u32(all(), reinterpret_cast<const uint32_t*>(p));
    even = VecF(svreinterpret_f32_u32(svlsl_n_u32_x(all(), x, 16)));
    odd = VecF(svreinterpret_f32_u32(svand_n_u32_x(all(), x, 0xFFFF0000u)));
  }
  static VecF e4m3_bits(svint32_t sx) {  // sign-extended bytes
    const svuint32_t h = svand_n_u32_x(all(), svlsl_n_u32_x(all(), svreinterpret_u32_s32(sx), 7), 0xBF80u);
    return fp16_bits(h);
  }
  static VecF load_e4m3_div256(const uint8_t* p) {
    return e4m3_bits(svld1sb_s32(all(), reinterpret_cast<const int8_t*>(p)));
  }
  static VecF load_e4m3_div256_n(const uint8_t* p, int n) {
    return e4m3_bits(svld1sb_s32(mask(n), reinterpret_cast<const int8_t*>(p)));
  }
  void store_bf16_n(uint16_t* p, int n) const {
    const svuint32_t u = svreinterpret_u32_f32(v);
    const svuint32_t lsb = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 1u);
    svuint32_t r = svlsr_n_u32_x(all(), svadd_u32_x(all(), u, svadd_n_u32_x(all(), lsb, 0x7fffu)), 16);
    r = svsel_u32(svcmpuo_f32(all(), v, v), svdup_n_u32(0x7fc0u), r);
    svst1h_u32(mask(n), p, r);
  }
  void store_fp16_n(uint16_t* p, int n) const {  // FPCR rounding: nearest even (Linux default)
    svst1h_u32(mask(n), p, svreinterpret_u32_f16(svcvt_f16_f32_x(all(), v)));
  }
  void store_e4m3_n(uint8_t* p, int n) const {  // callers clamp to +-448 first
    const svbool_t pg = all();
    const svuint32_t u0 = svreinterpret_u32_f32(v);
    const svuint32_t sign = svand_n_u32_x(pg, u0, 0x80000000u);
    const svuint32_t u = sveor_u32_x(pg, u0, sign);
    const svbool_t big = svcmpge_n_u32(pg, u, 1087u << 20);
    const svbool_t sub = svcmplt_n_u32(pg, u, 121u << 23);
    const svuint32_t s = svsub_n_u32_x(
        pg, svreinterpret_u32_f32(svadd_n_f32_x(pg, svreinterpret_f32_u32(u), 16384.0f)), 141u << 23);
    svuint32_t nrm = svadd_n_u32_x(pg, u, (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu);
    nrm = svlsr_n_u32_x(pg, svadd_u32_x(pg, nrm, svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 20), 1u)), 20);
    svuint32_t r = svsel_u32(sub, s, nrm);
    r = svsel_u32(big, svdup_n_u32(0x7fu), r);
    r = svorr_u32_x(pg, r, svlsr_n_u32_x(pg, sign, 24));
    svst1b_u32(mask(n), p, r);
  }
};
inline VecF operator+(VecF a, VecF b) { return VecF(svadd_f32_x(VecF::all(), a.v, b.v)); }
inline VecF operator-(VecF a, VecF b) { return VecF(svsub_f32_x(VecF::all(), a.v, b.v)); }
inline VecF operator*(VecF a, VecF b) { return VecF(svmul_f32_x(VecF::all(), a.v, b.v)); }
inline VecF operator/(VecF a, VecF b) { return VecF(svdiv_f32_x(VecF::all(), a.v, b.v)); }
inline VecF fma(VecF a, VecF b, VecF c) { return VecF(svmla_f32_x(VecF::all(), c.v, a.v, b.v)); }
// a > b ? a : b (a NaN in either gives b, as the x86 levels' max)
inline VecF max(VecF a, VecF b) { return VecF(svsel_f32(svcmpgt_f32(VecF::all(), a.v, b.v), a.v, b.v)); }
inline VecF abs(VecF a) { return VecF(svabs_f32_x(VecF::all(), a.v)); }
inline VecF clamp_nan_through(VecF x, float lo, float hi) {  // FMIN / FMAX propagate NaN
  return VecF(svmax_n_f32_x(VecF::all(), svmin_n_f32_x(VecF::all(), x.v, hi), lo));
}
inline bool any_nan(VecF a) { return svptest_any(VecF::all(), svcmpuo_f32(VecF::all(), a.v, a.v)); }
inline float hsum(VecF a) { return svaddv_f32(VecF::all(), a.v); }
inline float hmax(VecF a) { return svmaxv_f32(VecF::all(), a.v); }
inline VecF keep_first(VecF a, int n) { return VecF(svsel_f32(VecF::mask(n), a.v, svdup_n_f32(0.0f))); }
inline VecF select_first(VecF a, int n, float fill) {
  return VecF(svsel_f32(VecF::mask(n), a.v, svdup_n_f32(fill)));
}
template <int N>
inline void hsum_many(const VecF* acc, float* out) {
  for (int k = 0; k < N; ++k) out[k] = hsum(acc[k]);
}
inline VecF exp(VecF a) {
  const svbool_t pg = VecF::all();
  const svfloat32_t x0 = a.v;
  const svfloat32_t x = svmin_n_f32_x(pg, svmax_n_f32_x(pg, x0, -87.0f), 88.0f);
  const svfloat32_t n = svrintn_f32_x(pg, svmul_n_f32_x(pg, x, 1.44269504088896341f));
  svfloat32_t r = svmls_n_f32_x(pg, x, n, 0.693359375f);  // x - n * c
  r = svmls_n_f32_x(pg, r, n, -2.12194440e-4f);
  svfloat32_t p = svdup_n_f32(1.0f / 720.0f);
  p = svmad_n_f32_x(pg, p, r, 1.0f / 120.0f);  // p * r + c
  p = svmad_n_f32_x(pg, p, r, 1.0f / 24.0f);
  p = svmad_n_f32_x(pg, p, r, 1.0f / 6.0f);
  p = svmad_n_f32_x(pg, p, r, 0.5f);
  p = svmad_n_f32_x(pg, p, r, 1.0f);
  p = svmad_n_f32_x(pg, p, r, 1.0f);
  const svfloat32_t e = svscale_f32_x(pg, p, svcvt_s32_f32_x(pg, n));  // p * 2^n
  return VecF(svsel_f32(svcmpgt_n_f32(pg, x0, -87.0f), e, svdup_n_f32(0.0f)));
}
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#elif defined(MLA_HAS_NEON)
// ================================ NEON (Armv8.2-A + fp16) ===================================
struct VecF {
  static constexpr int W = 4;
  float32x4_t v;
  VecF() = default;
  explicit VecF(float32x4_t x) : v(x) {}
  static uint32x4_t lane_mask(int n) {  // lanes < n all ones
    static const uint32_t idx[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(idx), vdupq_n_u32(static_cast<uint32_t>(n > 0 ? n : 0)));
  }
  static VecF zero() { return VecF(vdupq_n_f32(0.0f)); }
  static VecF set1(float x) { return VecF(vdupq_n_f32(x)); }
  static VecF load(const float* p) { return VecF(vld1q_f32(p)); }
  static VecF load_n(const float* p, int n) {  // reads only p[0, n)
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    std::memcpy(t, p, static_cast<size_t>(n > 0 ? n : 0) * 4);
    return VecF(vld1q_f32(t));
  }
  void store(float* p) const { vst1q_f32(p, v); }
  void store_n(float* p, int n) const {
    float t[4];
    vst1q_f32(t, v);
    std::memcpy(p, t, static_cast<size_t>(n > 0 ? n : 0) * 4);
  }
  static uint16x4_t load16_n(const uint16_t* p, int n) {
    uint16_t t[4] = {0, 0, 0, 0};
    std::memcpy(t, p, static_cast<size_t>(n > 0 ? n : 0) * 2);
    return vld1_u16(t);
  }
  static VecF bf16_bits(uint16x4_t h) { return VecF(vreinterpretq_f32_u32(vshll_n_u16(h, 16))); }
  static VecF fp16_bits(uint16x4_t h) { return VecF(vcvt_f32_f16(vreinterpret_f16_u16(h))); }
  static VecF load_bf16(const uint16_t* p) { return bf16_bits(vld1_u16(p)); }
  static VecF load_bf16_n(const uint16_t* p, int n) { return bf16_bits(load16_n(p, n)); }
  static VecF load_fp16(const uint16_t* p) { return fp16_bits(vld1_u16(p)); }
  static VecF load_fp16_n(const uint16_t* p, int n) { return fp16_bits(load16_n(p, n)); }
  static void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    const uint32x4_t x = vreinterpretq_u32_u16(vld1q_u16(p));
    even = VecF(vreinterpretq_f32_u32(vshlq_n_u32(x, 16)));
    odd = VecF(vreinterpretq_f32_u32(vandq_u32(x, vdupq_n_u32(0xFFFF0000u))));
  }
  static VecF e4m3_bits(uint32_t four) {  // 4 bytes, little endian
    const int16x4_t x = vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(four))));
    const int16x4_t h = vand_s16(vshl_n_s16(x, 7), vdup_n_s16(static_cast<int16_t>(0xBF80)));
    return VecF(vcvt_f32_f16(vreinterpret_f16_s16(h)));
  }
  static VecF load_e4m3_div256(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return e4m3_bits(w);
  }
  static VecF load_e4m3_div256_n(const uint8_t* p, int n) {
    uint32_t w = 0;
    std::memcpy(&w, p, static_cast<size_t>(n > 0 ? (n < 4 ? n : 4) : 0));
    return e4m3_bits(w);
  }
  static void store16_n(uint16_t* p, uint16x4_t h, int n) {
    if (n >= 4) {
      vst1_u16(p, h);
    } else {
      uint16_t t[4];
      vst1_u16(t, h);
      std::memcpy(p, t, static_cast<size_t>(n > 0 ? n : 0) * 2);
    }
  }
  void store_bf16_n(uint16_t* p, int n) const {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    r = vbslq_u32(vceqq_f32(v, v), r, vdupq_n_u32(0x7fc0));  // NaN -> 0x7fc0
    store16_n(p, vmovn_u32(r), n);
  }
  void store_fp16_n(uint16_t* p, int n) const {  // FPCR rounding: nearest even (Linux default)
    store16_n(p, vreinterpret_u16_f16(vcvt_f16_f32(v)), n);
  }
  void store_e4m3_n(uint8_t* p, int n) const {  // callers clamp to +-448 first
    const uint32x4_t u0 = vreinterpretq_u32_f32(v);
    const uint32x4_t sign = vandq_u32(u0, vdupq_n_u32(0x80000000u));
    const uint32x4_t u = veorq_u32(u0, sign);
    const uint32x4_t big = vcgeq_u32(u, vdupq_n_u32(1087u << 20));
    const uint32x4_t sub = vcltq_u32(u, vdupq_n_u32(121u << 23));
    const uint32x4_t s = vsubq_u32(
        vreinterpretq_u32_f32(vaddq_f32(vreinterpretq_f32_u32(u), vdupq_n_f32(16384.0f))),
        vdupq_n_u32(141u << 23));
    uint32x4_t nrm = vaddq_u32(u, vdupq_n_u32((static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu));
    nrm = vshrq_n_u32(vaddq_u32(nrm, vandq_u32(vshrq_n_u32(u, 20), vdupq_n_u32(1))), 20);
    uint32x4_t r = vbslq_u32(sub, s, nrm);
    r = vbslq_u32(big, vdupq_n_u32(0x7f), r);
    r = vorrq_u32(r, vshrq_n_u32(sign, 24));
    const uint16x4_t h = vmovn_u32(r);
    const uint8x8_t b = vmovn_u16(vcombine_u16(h, h));
    uint8_t t[8];
    vst1_u8(t, b);
    std::memcpy(p, t, static_cast<size_t>(n > 0 ? (n < 4 ? n : 4) : 0));
  }
};
inline VecF operator+(VecF a, VecF b) { return VecF(vaddq_f32(a.v, b.v)); }
inline VecF operator-(VecF a, VecF b) { return VecF(vsubq_f32(a.v, b.v)); }
inline VecF operator*(VecF a, VecF b) { return VecF(vmulq_f32(a.v, b.v)); }
inline VecF operator/(VecF a, VecF b) { return VecF(vdivq_f32(a.v, b.v)); }
inline VecF fma(VecF a, VecF b, VecF c) { return VecF(vfmaq_f32(c.v, a.v, b.v)); }
// a > b ? a : b (a NaN in either gives b, as the x86 levels' max)
inline VecF max(VecF a, VecF b) { return VecF(vbslq_f32(vcgtq_f32(a.v, b.v), a.v, b.v)); }
inline VecF abs(VecF a) { return VecF(vabsq_f32(a.v)); }
inline VecF clamp_nan_through(VecF x, float lo, float hi) {  // FMIN / FMAX propagate NaN
  return VecF(vmaxq_f32(vdupq_n_f32(lo), vminq_f32(vdupq_n_f32(hi), x.v)));
}
inline bool any_nan(VecF a) { return vminvq_u32(vceqq_f32(a.v, a.v)) == 0; }
inline float hsum(VecF a) { return vaddvq_f32(a.v); }
inline float hmax(VecF a) { return vmaxvq_f32(a.v); }
inline VecF keep_first(VecF a, int n) { return VecF(vbslq_f32(VecF::lane_mask(n), a.v, vdupq_n_f32(0.0f))); }
inline VecF select_first(VecF a, int n, float fill) {
  return VecF(vbslq_f32(VecF::lane_mask(n), a.v, vdupq_n_f32(fill)));
}
// out[k] = hsum(acc[k]) for k < N: two pairwise-add rounds per group of 4
template <int N>
inline void hsum_many(const VecF* acc, float* out) {
  for (int g = 0; g < N; g += 4) {
    float32x4_t v[4];
    for (int i = 0; i < 4; ++i) v[i] = g + i < N ? acc[g + i].v : vdupq_n_f32(0.0f);
    const float32x4_t z = vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
    if (N - g >= 4) {
      vst1q_f32(out + g, z);
    } else {
      float t[4];
      vst1q_f32(t, z);
      std::memcpy(out + g, t, static_cast<size_t>(N - g) * 4);
    }
  }
}
inline VecF exp(VecF a) {
  const float32x4_t x0 = a.v;
  const float32x4_t x = vminq_f32(vmaxq_f32(x0, vdupq_n_f32(-87.0f)), vdupq_n_f32(88.0f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));  // x - n * c
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.0f / 720.0f);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  // 2^n for n in [-126, 127] (x is clamped to [-87, 88]): the exponent field directly
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  const float32x4_t y = vmulq_f32(p, vreinterpretq_f32_s32(e));
  return VecF(vbslq_f32(vcgtq_f32(x0, vdupq_n_f32(-87.0f)), y, vdupq_n_f32(0.0f)));
}
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#else
// ============================== portable (x86-64 baseline and others) =====================
struct VecF {
  static constexpr int W = 8;
  float v[8];
  static VecF zero() { return set1(0.0f); }
  static VecF set1(float x) {
    VecF r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static VecF load(const float* p) {
    VecF r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static VecF load_n(const float* p, int n) {
    VecF r = zero();
    for (int i = 0; i < n && i < W; ++i) r.v[i] = p[i];
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  void store_n(float* p, int n) const {
    for (int i = 0; i < n && i < W; ++i) p[i] = v[i];
  }
  template <class F>
  static VecF gen(int n, F f) {
    VecF r = zero();
    for (int i = 0; i < n && i < W; ++i) r.v[i] = f(i);
    return r;
  }
  static VecF load_bf16(const uint16_t* p) { return load_bf16_n(p, W); }
  static VecF load_bf16_n(const uint16_t* p, int n) { return gen(n, [&](int i) { return bf16_to_f32(p[i]); }); }
  static VecF load_fp16(const uint16_t* p) { return load_fp16_n(p, W); }
  static void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    for (int i = 0; i < W; ++i) even.v[i] = bf16_to_f32(p[2 * i]), odd.v[i] = bf16_to_f32(p[2 * i + 1]);
  }
  static VecF load_fp16_n(const uint16_t* p, int n) { return gen(n, [&](int i) { return fp16_to_f32(p[i]); }); }
  static VecF load_e4m3_div256(const uint8_t* p) { return load_e4m3_div256_n(p, W); }
  static VecF load_e4m3_div256_n(const uint8_t* p, int n) {
    return gen(n, [&](int i) {
      const uint8_t b = p[i];
      const float x = (b & 0x7f) == 0x7f ? ((b & 0x80) ? -480.0f : 480.0f) : e4m3_to_f32(b);
      return x / kFp8Unscale;
    });
  }
  void store_bf16_n(uint16_t* p, int n) const {
    for (int i = 0; i < n && i < W; ++i) p[i] = f32_to_bf16(v[i]);
  }
  void store_fp16_n(uint16_t* p, int n) const;  // defined below (needs the scalar encoder)
  void store_e4m3_n(uint8_t* p, int n) const {
    for (int i = 0; i < n && i < W; ++i) p[i] = f32_to_e4m3(v[i]);
  }
};
// fp32 -> fp16 bits, round to nearest even (as c10::Half)
inline uint16_t f32_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000;
  u &= 0x7fffffff;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00);
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to >= 65536
  if (u < 0x38800000u) {  // fp16 subnormal or zero: add 0.5 (2^-1) to align the mantissa
    float x;
    std::memcpy(&x, &u, 4);
    x += 0.5f;
    std::memcpy(&u, &x, 4);
    return static_cast<uint16_t>(sign | (u - 0x3f000000u));
  }
  const uint32_t odd = (u >> 13) & 1;
  u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff + odd;
  return static_cast<uint16_t>(sign | (u >> 13));
}
inline void VecF::store_fp16_n(uint16_t* p, int n) const {
  for (int i = 0; i < n && i < W; ++i) p[i] = f32_to_fp16(v[i]);
}
#define MLA_VEC_LANEWISE(name, expr)                        \
  inline VecF name(VecF a, VecF b) {                        \
    VecF r;                                                 \
    for (int i = 0; i < VecF::W; ++i) r.v[i] = (expr);      \
    return r;                                               \
  }
MLA_VEC_LANEWISE(operator+, a.v[i] + b.v[i])
MLA_VEC_LANEWISE(operator-, a.v[i] - b.v[i])
MLA_VEC_LANEWISE(operator*, a.v[i] * b.v[i])
MLA_VEC_LANEWISE(operator/, a.v[i] / b.v[i])
MLA_VEC_LANEWISE(max, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
#undef MLA_VEC_LANEWISE
// fused where the target has a hardware FMA; a * b + c otherwise (std::fma would be a libm
// call per lane on the x86-64 baseline)
inline VecF fma(VecF a, VecF b, VecF c) {
  VecF r;
#if defined(__FP_FAST_FMAF)
  for (int i = 0; i < VecF::W; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
#else
  for (int i = 0; i < VecF::W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
#endif
  return r;
}
inline VecF abs(VecF a) {
  VecF r;
  for (int i = 0; i < VecF::W; ++i) r.v[i] = std::fabs(a.v[i]);
  return r;
}
inline VecF clamp_nan_through(VecF x, float lo, float hi) {
  VecF r;
  for (int i = 0; i < VecF::W; ++i) r.v[i] = x.v[i] > hi ? hi : (x.v[i] < lo ? lo : x.v[i]);
  return r;
}
inline bool any_nan(VecF a) {
  for (int i = 0; i < VecF::W; ++i)
    if (std::isnan(a.v[i])) return true;
  return false;
}
inline float hsum(VecF a) {
  float s = 0.0f;
  for (int i = 0; i < VecF::W; ++i) s += a.v[i];
  return s;
}
inline float hmax(VecF a) {
  float s = a.v[0];
  for (int i = 1; i < VecF::W; ++i) s = a.v[i] > s ? a.v[i] : s;
  return s;
}
inline VecF select_first(VecF a, int n, float fill) {
  for (int i = (n > 0 ? n : 0); i < VecF::W; ++i) a.v[i] = fill;
  return a;
}
inline VecF keep_first(VecF a, int n) { return select_first(a, n, 0.0f); }
template <int N>
inline void hsum_many(const VecF* acc, float* out) {
  for (int k = 0; k < N; ++k) out[k] = hsum(acc[k]);
}
inline VecF exp(VecF a) {
  VecF r;
  for (int i = 0; i < VecF::W; ++i) r.v[i] = a.v[i] <= -87.0f ? 0.0f : std::exp(a.v[i]);
  return r;
}
inline void prefetch_l2(const void* p) { (void)p; }
#endif

}  // namespace vec
}  // namespace mla_native
