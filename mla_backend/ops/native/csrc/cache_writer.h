// cache_writer.h: the torch-free cache-row writer (write_latent): [c_kv ; k_pe] rows into the
// paged latent cache in every layout (q's dtype, per-tensor e4m3, fp8_ds_mla bit for bit as
// CacheLayout.pack). cache_write.cpp is its torch layer (api.cpp registers the op).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention_params.h"
#include "rows.h"

namespace mla_native {
namespace core {

// n floats -> n values of dtype dt (bf16 / fp16 round to nearest even, as torch's .to()).
inline void store_as(char* dst, const float* src, int64_t n, DType dt) {
  if (dt == DType::kBF16) store_row(reinterpret_cast<vec::bf16_t*>(dst), src, n, 1.0f);
  else if (dt == DType::kF16) store_row(reinterpret_cast<vec::fp16_t*>(dst), src, n, 1.0f);
  else if (n > 0) std::memcpy(dst, src, n * sizeof(float));  // n = 0: src may be null
}

// dst[0, n) = e4m3(clamp(x[0, n) / div, -448, 448)) (NaN passes the clamp, like torch.clamp;
// the same fp32 division as torch's value.float() / scale)
inline void store_e4m3_row(uint8_t* dst, const float* x, int64_t n, float div) {
  const VecF vd = VecF::set1(div);
  for (int64_t j = 0; j < n; j += kW) {
    const int k = static_cast<int>(std::min<int64_t>(kW, n - j));
    vec::clamp_nan_through(load_f32(x + j, k) / vd, -448.0f, 448.0f).store_e4m3_n(dst + j, k);
  }
}

// One fp8_ds_mla row, bit for bit as CacheLayout.pack (and vLLM's concat_and_cache_ds_mla):
// per tile of 128 c_kv values scale = max(amax(|x|) / 448, FLT_MIN) (fp32; NaN propagates like
// torch.amax / clamp), stored = e4m3(clamp(x / scale, -448, 448)), the scale's float32 bytes,
// zero bytes between r and the scales, then k_pe converted to `rope_dt`.
inline void write_ds_row(uint8_t* dst, const float* x, const float* kp, int64_t r, int64_t rope,
                  const DsLayout& L, DType rope_dt) {
  for (int64_t t = 0; t < L.tiles; ++t) {
    const int64_t j0 = t * kDsTile, j1 = std::min<int64_t>(r, j0 + kDsTile);
    VecF vmax = VecF::zero();  // the padding of a partial tile is 0
    bool nan = false;
    for (int64_t j = j0; j < j1; j += kW) {
      const VecF a = vec::abs(load_f32(x + j, static_cast<int>(std::min<int64_t>(kW, j1 - j))));
      nan = nan || vec::any_nan(a);
      vmax = vec::max(vmax, a);
    }
    // torch.amax gives the default NaN, whatever the input's payload
    const float amax = nan ? std::numeric_limits<float>::quiet_NaN() : vec::hmax(vmax);
    float sc = amax / 448.0f;
    if (!std::isnan(sc)) sc = std::max(sc, std::numeric_limits<float>::min());
    store_e4m3_row(dst + j0, x + j0, j1 - j0, sc);
    std::memcpy(dst + L.scale_off + 4 * t, &sc, 4);
  }
  std::memset(dst + r, 0, L.scale_off - r);
  if (rope) store_as(reinterpret_cast<char*>(dst + L.rope_off), kp, rope, rope_dt);
}

// ---- cache-row writer ------------------------------------------------------------------------
// Row slot of the cache (page slot / page_size, row slot % page_size) = [c_kv[t] ; k_pe[t]] for
// t < T with slots[t] >= 0 (negative slots are padding: skipped). c_kv [T, r], k_pe [T, rope]
// float32 contiguous (the values to store, already widened); the cache: num_pages x page_size
// rows (byte strides c_s0, c_s1) in cache_dt (kPlain), e4m3 of value / kv_scale clamped to
// +-448 (kFp8), or fp8_ds_mla rows with k_pe in rope_dt (kDs, DsLayout(r, rope, size of rope_dt)).
struct WriteParams {
  char* cache;
  int64_t c_s0, c_s1, page_size, num_pages;
  int mode;
  DType cache_dt, rope_dt;
  int64_t r, rope, T;
  const float* c_kv;
  const float* k_pe;
  const int64_t* slots;
  float kv_scale = 1.0f;
};

// "" when every slot is padding (< 0) or a row of the cache, else the first bad one.
inline std::string validate_slots(const int64_t* slots, int64_t T, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= num_slots)
      return detail::cat("slot_mapping[", t, "] = ", slots[t], " is outside the cache (", num_slots,
                         " slots)");
  return {};
}

// The tokens whose slot a later token of the write names too (empty when no slot repeats:
// the usual case, checked in O(T) when the slots increase, else by one sort): a slot named
// several times holds its last token's row, whole, whichever threads write the others.
inline std::vector<char> overwritten_tokens(const int64_t* slots, int64_t T) {
  bool increasing = true;
  for (int64_t t = 0, prev = -1; t < T && increasing; ++t)
    if (slots[t] >= 0) increasing = slots[t] > prev, prev = slots[t];
  if (increasing) return {};
  std::vector<std::pair<int64_t, int64_t>> named;  // (slot, token), padding left out
  named.reserve(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) named.emplace_back(slots[t], t);
  std::sort(named.begin(), named.end());
  std::vector<char> skip;
  for (size_t i = 0; i + 1 < named.size(); ++i)
    if (named[i].first == named[i + 1].first) {
      if (skip.empty()) skip.assign(static_cast<size_t>(T), 0);
      skip[static_cast<size_t>(named[i].second)] = 1;
    }
  return skip;
}

// Writes the rows (see WriteParams) after validate_slots; returns its refusal or "". A slot
// named by several tokens holds the last one's row (overwritten_tokens).
inline std::string write_latent(const WriteParams& W, const Parallel& par) {
  if (W.page_size < 1) return detail::cat("page_size ", W.page_size, " must be >= 1");
  const std::string err = validate_slots(W.slots, W.T, W.num_pages * W.page_size);
  if (!err.empty()) return err;
  const int64_t D = W.r + W.rope;
  if (D == 0) return {};  // rows of no bytes: nothing to write (the cache may have no data)
  const DsLayout dsl(W.r, W.rope, W.rope_dt == DType::kF32 ? 4 : 2);
  const std::vector<char> skip = overwritten_tokens(W.slots, W.T);
  par.for_range(W.T, 64, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> row(D);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t slot = W.slots[t];
      if (slot < 0 || (!skip.empty() && skip[static_cast<size_t>(t)])) continue;
      char* dst = W.cache + (slot / W.page_size) * W.c_s0 + (slot % W.page_size) * W.c_s1;
      const float* c = W.c_kv + t * W.r;
      const float* kp = W.k_pe + t * W.rope;
      if (W.mode == kDs) {
        write_ds_row(reinterpret_cast<uint8_t*>(dst), c, kp, W.r, W.rope, dsl, W.rope_dt);
        continue;
      }
      if (W.r) std::memcpy(row.data(), c, W.r * sizeof(float));  // r = 0: c may be null
      if (W.rope) std::memcpy(row.data() + W.r, kp, W.rope * sizeof(float));
      if (W.mode == kFp8)
        store_e4m3_row(reinterpret_cast<uint8_t*>(dst), row.data(), D, W.kv_scale);
      else store_as(dst, row.data(), D, W.cache_dt);
    }
  });
  return {};
}

}  // namespace core
}  // namespace mla_native
