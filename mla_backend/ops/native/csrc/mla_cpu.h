// Small SIMD helpers shared by the native MLA CPU kernels (mla_cpu.cpp, head_gemm.cpp,
// mha_prefill.cpp), and the ISA level's macros.
//
// build.py compiles every source once per ISA level with explicit flags and the macros
// MLA_ISA_<LEVEL> (exactly one of SCALAR / AVX2 / AVX512 / AVX512BF16 / AMX), the cumulative
// MLA_HAS_AVX2 / MLA_HAS_AVX512 / MLA_HAS_AVX512BF16 / MLA_HAS_AMX, and MLA_OPS_NS, the
// torch.library namespace of the level's ops (mla_backend_<level>). The C++ namespace
// mla_native is renamed per level on the command line, so levels load side by side.
// Code below keys on MLA_AVX512 (AVX-512 F/BW/VL/DQ) and MLA_AVX512BF16; the vector layer
// (vec.h) covers AVX2 and the portable build.
#pragma once

#ifndef MLA_OPS_NS
#define MLA_OPS_NS mla_backend_scalar  // a build outside build.py: the portable level
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"

#if defined(MLA_HAS_AVX512)
#include <immintrin.h>
#define MLA_AVX512 1
#endif
#if defined(MLA_HAS_AVX512BF16)
#if !defined(MLA_HAS_AVX512) || !defined(__AVX512BF16__)
#error "MLA_HAS_AVX512BF16 needs MLA_HAS_AVX512 and -mavx512bf16"
#endif
#define MLA_AVX512BF16 1
#endif
#if defined(MLA_HAS_AMX) && !(defined(MLA_HAS_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__))
#error "MLA_HAS_AMX needs MLA_HAS_AVX512BF16 and -mamx-tile -mamx-bf16"
#endif

namespace mla_native {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
using vec::kFp8Unscale;

// ---- scalar conversions -----------------------------------------------------------------
template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}
// float8_e4m3fn stored as raw bytes: exact decode (subnormals included).
inline float fp8_to_f32(uint8_t b) {
  return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
}

#ifdef MLA_AVX512
// exp(x) for 16 floats; ~1 ulp on the softmax range; x <= -87 gives exactly 0.
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ);
  x = _mm512_max_ps(x, lo);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
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
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

// 16 accumulators -> one vector whose lane k is the sum of v[k]'s lanes.
inline __m512 reduce16(const __m512* v) {
  __m512 s[8];
  for (int i = 0; i < 8; ++i) {
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 t[4];
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The cheap e4m3 -> fp32 decode: a sign-extended e4m3 byte shifted left by 7 and masked with
// 0xBF80 is the fp16 whose sign is the byte's sign, whose 5-bit exponent field is the byte's
// 4-bit one and whose top 3 mantissa bits are the byte's: for a normal byte (exponent e >= 1)
// that is 2^(e-15) * 1.m = value * 2^-8, for a subnormal one (e = 0) the fp16 subnormal
// m * 2^-17 = value * 2^-8 as well. So every e4m3 value (NaN bytes 0x7f/0xff excepted: they
// read as +-480 * 2^-8) becomes exactly value / 256 in fp16, and vcvtph2ps (AVX-512F; exact for
// fp16 subnormals whatever MXCSR.DAZ says) widens it to fp32. The fp32 engine multiplies by 256
// (per-tensor fp8) or by 256 x the tile scale (fp8_ds_mla: the same real number as value x
// scale, so the same fp32 rounding).

// 16 e4m3 bytes (mask selects the bytes read; the others decode as +0) -> 16 floats =
// value / 256 exactly.
inline __m512 fp8x16_to_f32_div256(const uint8_t* p, __mmask16 mask) {
  __m256i x = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(mask, p));
  x = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return _mm512_cvtph_ps(x);
}

// 32 fp8 e4m3fn bytes -> 32 exact bf16 (as uint16 lanes). `mask` selects the bytes to read
// (the others decode as +0).
inline __m512i fp8x32_to_bf16(const uint8_t* p, __mmask32 mask) {
  __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, p));
  __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
  __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
  // normal: exponent bias 7 -> 127, 3 mantissa bits -> the top of bf16's 7
  __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  // subnormal (exponent 0): m * 2^-9 for m = 0..7, from a table
  const __m512i sub_tbl = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      /*7*/ 0x3C60, /*6*/ 0x3C40, /*5*/ 0x3C20, /*4*/ 0x3C00, /*3*/ 0x3BC0, /*2*/ 0x3B80,
      /*1*/ 0x3B00, /*0*/ 0x0000);
  __m512i sub = _mm512_permutexvar_epi16(mag, sub_tbl);
  __mmask32 is_sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  return _mm512_or_si512(_mm512_mask_mov_epi16(normal, is_sub, sub), sign);
}
#endif

}  // namespace mla_native
