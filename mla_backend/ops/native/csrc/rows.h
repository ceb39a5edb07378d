// rows.h: fp32 <-> storage dtype rows (bf16 / fp16 / fp32, e4m3) through the vector layer,
// shared by the fp32 engine, the split merge and the cache writers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace mla_native {
namespace core {

using vec::VecF;
constexpr int kW = VecF::W;

inline VecF load_f32(const float* p, int n) { return n >= kW ? VecF::load(p) : VecF::load_n(p, n); }
inline VecF load_f32(const vec::bf16_t* p, int n) {
  const auto* u = reinterpret_cast<const uint16_t*>(p);
  return n >= kW ? VecF::load_bf16(u) : VecF::load_bf16_n(u, n);
}
inline VecF load_f32(const vec::fp16_t* p, int n) {
  const auto* u = reinterpret_cast<const uint16_t*>(p);
  return n >= kW ? VecF::load_fp16(u) : VecF::load_fp16_n(u, n);
}
inline void store_f32(float* p, VecF v, int n) {
  if (n >= kW) v.store(p);
  else v.store_n(p, n);
}
inline void store_f32(vec::bf16_t* p, VecF v, int n) {
  v.store_bf16_n(reinterpret_cast<uint16_t*>(p), n);
}
inline void store_f32(vec::fp16_t* p, VecF v, int n) { v.store_fp16_n(reinterpret_cast<uint16_t*>(p), n); }

// dst[0, n) = float(src[0, n))
template <typename T>
inline void widen_row(float* dst, const T* src, int64_t n) {
  for (int64_t d = 0; d < n; d += kW) {
    const int k = static_cast<int>(std::min<int64_t>(kW, n - d));
    store_f32(dst + d, load_f32(src + d, k), k);
  }
}

// dst[0, n) = T(src[0, n) * mul), rounded to nearest even
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n, float mul) {
  const VecF m = VecF::set1(mul);
  for (int64_t d = 0; d < n; d += kW) {
    const int k = static_cast<int>(std::min<int64_t>(kW, n - d));
    store_f32(dst + d, load_f32(src + d, k) * m, k);
  }
}

// dst[0, n) = e4m3(src[0, n)) * mul (mul = 256 x scale: e4m3 / 256 is exact)
inline void widen_e4m3_row(float* dst, const uint8_t* src, int64_t n, float mul) {
  const VecF m = VecF::set1(mul);
  for (int64_t d = 0; d < n; d += kW) {
    const int k = static_cast<int>(std::min<int64_t>(kW, n - d));
    const VecF x = k >= kW ? VecF::load_e4m3_div256(src + d) : VecF::load_e4m3_div256_n(src + d, k);
    store_f32(dst + d, x * m, k);
  }
}

}  // namespace core
}  // namespace mla_native
