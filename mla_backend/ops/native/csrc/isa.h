// isa.h: the ISA level a build of the attention cores is for, and the level's helpers every
// attention core includes: the level macros checked against the compiler's flags, MLA_OPS_NS,
// the AVX-512 exp and the e4m3 -> bf16 decode of 32 bytes.
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

#ifdef MLA_AVX512
// exp(x) for 16 floats (vec::exp): ~1 ulp on the softmax range; x <= -87 gives exactly 0.
inline __m512 exp512(__m512 x) { return vec::exp(vec::VecF(x)).v; }

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
