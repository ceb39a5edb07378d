// latent_case.h: the absorbed and sparse attention targets' call (fuzz_absorbed_attention.cpp,
// fuzz_sparse_attention.cpp): q_lat / q_pe at fuzzed strides, a paged latent cache in any
// layout with padded rows and pages, block table, cu_seqlens_q, kv_lens, max_page_id (valid or
// malformed), the harness's own reading of validate()'s rules, and the fp64 reference of one
// query row over a list of cache rows.
#pragma once

#include "fuzz_common.h"
#include "absorbed_attention.h"

#include <map>

namespace fz {
namespace core = mla_native::core;

// The engines a call may use: a subset of the build's (kEngineDefault), AMX only where the OS
// grants it.
inline int fuzz_engines(FuzzedDataProvider& in) {
  int engine = in.ConsumeIntegralInRange<int>(0, 3) & core::kEngineDefault;
  if ((engine & core::kEngineAmx) && !core::amx_available()) engine &= ~core::kEngineAmx;
  return engine;
}

// The kv splits a call asks for: 0 (the core's choice) three calls in four, else 1 .. 9.
inline int64_t fuzz_splits(FuzzedDataProvider& in) {
  return in.ConsumeIntegralInRange<int>(0, 3) == 0 ? in.ConsumeIntegralInRange<int64_t>(1, 9) : 0;
}

// An index list [T, K]: token t's entries -1 or below len_of(t), and where mal, malformed ones
// (len_of(t), -2, INT32_MAX, INT32_MIN).
template <typename LenOf>
std::vector<int32_t> index_list(FuzzedDataProvider& in, Rng& g, int64_t T, int64_t K, bool mal, LenOf len_of) {
  std::vector<int32_t> idx(static_cast<size_t>(T * K), -1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t L = len_of(t);
    for (int64_t k = 0; k < K; ++k) {
      const int kind = in.ConsumeIntegralInRange<int>(0, 15);
      int32_t& e = idx[t * K + k];
      if (kind == 0) e = -1;
      else if (mal && kind == 1) e = static_cast<int32_t>(in.ConsumeBool() ? L : -2);
      else if (mal && kind == 2) e = in.ConsumeBool() ? INT32_MAX : INT32_MIN;
      else if (L > 0) e = static_cast<int32_t>(g.range(0, std::min<int64_t>(L, INT32_MAX) - 1));
    }
  }
  return idx;
}

struct LatentCall {
  int qdt = 0, mode = 0;
  int64_t H = 0, r = 0, rope = 0, B = 0, T = 0, ps = 1, np = 0, width = 0, rows = 0, bt_s0 = 0;
  int64_t max_page_id = -1, threads = 1;
  std::vector<int32_t> bt, cu, kvl;
  std::vector<uint8_t> qlat, qpe, cache;  // exact sizes
  int64_t ql_s0 = 0, ql_s1 = 0, qp_s0 = 0, qp_s1 = 0;  // elements
  int64_t rb = 0, c_s1 = 0, c_s0 = 0;                  // bytes
  float scale = 1.0f, kvs = 1.0f;
  bool finite = true;  // every value the call reads is finite (the reference applies)
  std::vector<uint8_t> out;
  std::vector<float> lse;
  Frozen f_ql, f_qp, f_cache, f_bt, f_cu, f_kvl;
  mutable std::map<int64_t, std::vector<double>> decoded_;  // the reference's decoded rows

  const std::vector<double>& decoded(int64_t off) const {
    auto it = decoded_.find(off);
    if (it != decoded_.end()) return it->second;
    std::vector<double> kv(static_cast<size_t>(r + rope));
    decode_row(off, kv.data());
    return decoded_.emplace(off, std::move(kv)).first->second;
  }

  // the documented rules (attention_params.h validate), read independently
  bool valid() const {
    if (H < 1 || r < 1 || rope < 0 || ps < 1 || B < 0 || T < 0 || np < 0) return false;
    if (rows < B || width < 0 || bt_s0 < width) return false;
    if (B > 0 && cu[0] != 0) return false;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t n = static_cast<int64_t>(cu[i + 1]) - cu[i];
      if (n < 0 || kvl[i] < n) return false;
      if (n == 0) continue;
      if (kvl[i] > width * ps) return false;
      for (int64_t p = 0; p < (kvl[i] + ps - 1) / ps; ++p) {
        const int64_t page = bt[i * bt_s0 + p];
        if (page < 0 || page >= np) return false;
      }
    }
    if (max_page_id >= np) return false;
    return (B > 0 ? cu[B] : 0) == T;
  }

  int64_t row_off(int64_t req, int64_t pos) const {
    return static_cast<int64_t>(bt[req * bt_s0 + pos / ps]) * c_s0 + (pos % ps) * c_s1;
  }
  // the stored row at byte offset off, decoded: kv [r + rope] as the kernels' math reads it
  // (fp8: e4m3 x kv_scale; fp8_ds_mla: e4m3 x tile scale, k_pe in q's dtype)
  void decode_row(int64_t off, double* kv) const {
    const uint8_t* p = cache.data() + off;
    if (mode == core::kPlain) {
      for (int64_t d = 0; d < r + rope; ++d) kv[d] = get(p + d * dt_size(qdt), qdt) * kvs;
    } else if (mode == core::kFp8) {
      for (int64_t d = 0; d < r + rope; ++d) kv[d] = static_cast<double>(e4m3_f(p[d])) * kvs;
    } else {
      const core::DsLayout L(r, rope, dt_size(qdt));
      for (int64_t d = 0; d < r; ++d) {
        float sc;
        std::memcpy(&sc, p + L.scale_off + 4 * (d / 128), 4);
        kv[d] = static_cast<double>(e4m3_f(p[d]) * sc) * kvs;  // fp32's product, as the reference
      }
      for (int64_t d = 0; d < rope; ++d) kv[r + d] = get(p + L.rope_off + d * dt_size(qdt), qdt) * kvs;
    }
  }
  // writes finite (or special) values into the row at off
  void fill_row(int64_t off, Rng& g, bool specials) {
    uint8_t* p = cache.data() + off;
    auto v = [&](float a) { return specials && g.range(0, 31) == 0 ? special(g) : g.val(a); };
    if (mode == core::kPlain) {
      for (int64_t d = 0; d < r + rope; ++d) put(p + d * dt_size(qdt), qdt, v(2.0f));
    } else if (mode == core::kFp8) {
      for (int64_t d = 0; d < r + rope; ++d) p[d] = specials && g.range(0, 31) == 0 ? 0x7F : f_e4m3(v(6.0f));
    } else {
      const core::DsLayout L(r, rope, dt_size(qdt));
      for (int64_t d = 0; d < r; ++d) p[d] = f_e4m3(g.val(400.0f));
      for (int64_t t = 0; t < L.tiles; ++t) {
        const float sc = specials && g.range(0, 15) == 0 ? special(g) : std::ldexp(1.0f, -static_cast<int>(g.range(6, 9)));
        std::memcpy(p + L.scale_off + 4 * t, &sc, 4);
      }
      for (int64_t d = 0; d < rope; ++d) put(p + L.rope_off + d * dt_size(qdt), qdt, v(2.0f));
    }
  }
  bool row_finite(int64_t off) const {
    std::vector<double> kv(static_cast<size_t>(r + rope));
    decode_row(off, kv.data());
    for (double x : kv)
      if (!std::isfinite(x)) return false;
    return true;
  }

  // Decodes everything but the per-request lengths' values from `in`; mal: bit set of the
  // malformations to try. The cache rows the valid positions name are filled from g.
  void make(FuzzedDataProvider& in, Rng& g, bool allow_mal) {
    const uint32_t mal = allow_mal && in.ConsumeIntegralInRange<int>(0, 2) == 0 ? in.ConsumeIntegral<uint32_t>() : 0;
    const bool specials = in.ConsumeIntegralInRange<int>(0, 5) == 0;
    qdt = in.ConsumeIntegralInRange<int>(0, 2);
    mode = in.ConsumeIntegralInRange<int>(0, 2);
    // mostly small (fast executions); the larger shapes one call in 8, one dimension at a time
    // (32+ rows per item, several 128-value tiles, long contexts with kv splits, many tokens)
    const int big = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(1, 4) : 0;
    H = big == 1 ? in.ConsumeIntegralInRange<int64_t>(1, 40) : in.ConsumeIntegralInRange<int64_t>(1, 4);
    r = big == 2 ? in.ConsumeIntegralInRange<int64_t>(1, 288) : in.ConsumeIntegralInRange<int64_t>(1, 24);
    rope = in.ConsumeIntegralInRange<int64_t>(0, 16);
    if (mal & 1) H = 0;
    if (mal & 2) r = 0;
    ps = in.ConsumeIntegralInRange<int64_t>(1, 20);
    if (mal & 4) ps = 0;
    B = in.ConsumeIntegralInRange<int64_t>(0, 4);
    std::vector<int64_t> n(static_cast<size_t>(B)), L(static_cast<size_t>(B));
    for (int64_t i = 0; i < B; ++i) {
      n[i] = big == 4 ? in.ConsumeIntegralInRange<int64_t>(0, 40) : in.ConsumeIntegralInRange<int64_t>(0, 3);
      L[i] = n[i] + (big == 3 ? in.ConsumeIntegralInRange<int64_t>(0, 200) : in.ConsumeIntegralInRange<int64_t>(0, 12));
    }
    int64_t need = 0;
    for (int64_t i = 0; i < B; ++i) need = std::max(need, ps > 0 ? (L[i] + ps - 1) / ps : 0);
    width = need + in.ConsumeIntegralInRange<int64_t>(0, 2);
    bt_s0 = width + in.ConsumeIntegralInRange<int64_t>(0, 2);
    rows = B + in.ConsumeIntegralInRange<int64_t>(0, 1);
    if ((mal & 8) && rows > 0) rows -= 1;
    if ((mal & 16) && width > 0) bt_s0 = width - 1;
    np = in.ConsumeIntegralInRange<int64_t>(1, 12);
    if (mal & 32) np = 0;
    bt.assign(static_cast<size_t>(rows * bt_s0), 0);
    for (auto& e : bt) e = static_cast<int32_t>(g.range(0, std::max<int64_t>(np - 1, 0)));
    // lengths: kv_lens, cu_seqlens_q
    kvl.assign(static_cast<size_t>(B), 0);
    cu.assign(static_cast<size_t>(B + 1), 0);
    for (int64_t i = 0; i < B; ++i) {
      kvl[i] = static_cast<int32_t>(L[i]);
      cu[i + 1] = static_cast<int32_t>(cu[i] + n[i]);
    }
    T = cu[B];
    if (B > 0) {
      const int64_t i = in.ConsumeIntegralInRange<int64_t>(0, B - 1);
      if (mal & 64) kvl[i] = static_cast<int32_t>(n[i] - 1);                     // fewer than its new tokens
      if (mal & 128) kvl[i] = static_cast<int32_t>(width * std::max<int64_t>(ps, 1) + 1);  // past its row
      if (mal & 256) cu[0] = 1;
      if (mal & 512) cu[i + 1] = cu[i] - 1;                                      // decreasing
      if (mal & 1024) cu[B] += 1;                                                // != T
      if (mal & 2048) kvl[i] = in.ConsumeBool() ? INT32_MAX : INT32_MIN;
      if ((mal & 4096) && std::min(width, bt_s0) > 0 && i < rows) {  // a page id out of range (or far out)
        const int64_t p = in.ConsumeIntegralInRange<int64_t>(0, std::min(width, bt_s0) - 1);
        bt[i * bt_s0 + p] = in.ConsumeBool() ? static_cast<int32_t>(np + in.ConsumeIntegralInRange<int>(0, 2))
                                             : (in.ConsumeBool() ? -1 : INT32_MAX);
      }
      if (mal & 8192) cu[i + 1] = INT32_MAX;
    }
    if (mal & 16384) T += 1;
    // max_page_id: unknown, or the caller's bound (>= every used page id; a malformed one >= np)
    const int kind = in.ConsumeIntegralInRange<int>(0, 3);
    max_page_id = -1;
    if (kind >= 2) {
      int64_t mx = 0;
      bool ok = true;  // a bound only where every used id is >= 0 (the plan's check)
      for (int64_t i = 0; i < std::min(B, rows); ++i)
        if (cu[i + 1] > cu[i] && ps > 0 && kvl[i] > 0)
          for (int64_t p = 0; p < std::min<int64_t>((static_cast<int64_t>(kvl[i]) + ps - 1) / ps, std::min(width, bt_s0)); ++p) {
            ok = ok && bt[i * bt_s0 + p] >= 0;
            mx = std::max<int64_t>(mx, bt[i * bt_s0 + p]);
          }
      if (ok) max_page_id = kind == 3 && (mal & 32768) ? np + in.ConsumeIntegralInRange<int64_t>(0, 3) : mx;
    }
    threads = in.ConsumeIntegralInRange<int64_t>(1, 2);
    scale = static_cast<float>(in.ConsumeIntegralInRange<int>(1, 64)) / 32.0f / std::sqrt(static_cast<float>(std::max<int64_t>(r + rope, 1)));
    kvs = mode == core::kDs ? 1.0f : 0.5f * in.ConsumeIntegralInRange<int>(1, 4);
    // q: T x H rows at element strides >= their extent (last dim contiguous)
    const int64_t qes = dt_size(qdt);
    const int64_t Tq = std::max<int64_t>(T, 0), Hq = std::max<int64_t>(H, 0);
    ql_s1 = std::max<int64_t>(r, 0) + in.ConsumeIntegralInRange<int64_t>(0, 3);
    ql_s0 = Hq * ql_s1 + in.ConsumeIntegralInRange<int64_t>(0, 5);
    qp_s1 = rope + in.ConsumeIntegralInRange<int64_t>(0, 3);
    qp_s0 = Hq * qp_s1 + in.ConsumeIntegralInRange<int64_t>(0, 5);
    if (in.ConsumeIntegralInRange<int>(0, 7) == 0) ql_s0 = 0;  // every token's q the same row (expand)
    auto extent = [](int64_t n0, int64_t s0, int64_t n1, int64_t s1, int64_t n2) {
      return n0 == 0 || n1 == 0 || n2 == 0 ? 0 : (n0 - 1) * s0 + (n1 - 1) * s1 + n2;
    };
    qlat.assign(static_cast<size_t>(extent(Tq, ql_s0, Hq, ql_s1, std::max<int64_t>(r, 0)) * qes), 0);
    qpe.assign(static_cast<size_t>(extent(Tq, qp_s0, Hq, qp_s1, rope) * qes), 0);
    finite = !specials;
    for (size_t b = 0; b < qlat.size(); b += qes) put(qlat.data() + b, qdt, specials && g.range(0, 63) == 0 ? special(g) : g.val(2.0f));
    for (size_t b = 0; b < qpe.size(); b += qes) put(qpe.data() + b, qdt, specials && g.range(0, 63) == 0 ? special(g) : g.val(2.0f));
    // the cache: garbage everywhere (NaN-ish for unread rows), values in the rows valid positions name
    rb = mode == core::kPlain ? std::max<int64_t>(r + rope, 0) * qes
       : mode == core::kFp8   ? std::max<int64_t>(r + rope, 0)
                              : core::DsLayout(std::max<int64_t>(r, 0), rope, qes).width;
    // padding in whole elements of the cache's dtype (torch strides; fp8_ds_mla: 4 bytes, its
    // scales' and k_pe's alignment -- see the report on odd uint8 strides)
    const int64_t al = mode == core::kPlain ? qes : (mode == core::kFp8 ? 1 : 4);
    c_s1 = rb + al * in.ConsumeIntegralInRange<int64_t>(0, 3);
    c_s0 = std::max<int64_t>(ps, 0) * c_s1 + al * in.ConsumeIntegralInRange<int64_t>(0, 7);
    cache.assign(static_cast<size_t>(np > 0 ? (np - 1) * c_s0 + std::max<int64_t>(ps, 0) * c_s1 : 0), 0xFF);
    if (r >= 1 && ps >= 1)
      for (int64_t i = 0; i < std::min(B, rows); ++i) {
        if (cu[i + 1] <= cu[i]) continue;
        const int64_t Li = std::min<int64_t>(kvl[i], std::min(width, bt_s0) * ps);  // (a malformed bt_s0 < width)
        for (int64_t pos = 0; pos < Li; ++pos) {
          const int64_t page = bt[i * bt_s0 + pos / ps];
          if (page >= 0 && page < np) fill_row(row_off(i, pos), g, specials);
        }
      }
  }

  core::Params params() {
    core::Params P;
    P.H = H, P.r = r, P.rope = rope, P.D = r + rope, P.B = B, P.page_size = ps, P.num_pages = np;
    P.bt = bt.data(), P.bt_s0 = bt_s0, P.cu = cu.data(), P.kvl = kvl.data();
    const int64_t qes = dt_size(qdt);
    P.qlat = reinterpret_cast<const char*>(qlat.data()), P.ql_s0 = ql_s0 * qes, P.ql_s1 = ql_s1 * qes;
    P.qpe = reinterpret_cast<const char*>(qpe.data()), P.qp_s0 = qp_s0 * qes, P.qp_s1 = qp_s1 * qes;
    P.cache = reinterpret_cast<const char*>(cache.data()), P.c_s0 = c_s0, P.c_s1 = c_s1, P.row_bytes = rb;
    P.score_scale = scale * kvs, P.out_scale = kvs;
    const core::DsLayout dsl(std::max<int64_t>(r, 0), rope, qes);
    P.tiles = dsl.tiles, P.ds_scale_off = dsl.scale_off, P.ds_rope_off = dsl.rope_off;
    const int64_t nout = std::max<int64_t>(T, 0) * std::max<int64_t>(H, 0) * std::max<int64_t>(r, 0);
    out.assign(static_cast<size_t>(nout * qes), kCanary);
    lse.assign(static_cast<size_t>(std::max<int64_t>(T, 0) * std::max<int64_t>(H, 0)), kNaN);
    P.out = reinterpret_cast<char*>(out.data()), P.lse = lse.data();
    f_ql.take(qlat.data(), qlat.size(), "q_lat"), f_qp.take(qpe.data(), qpe.size(), "q_pe");
    f_cache.take(cache.data(), cache.size(), "kv_cache"), f_bt.take(bt.data(), bt.size() * 4, "block_table");
    f_cu.take(cu.data(), cu.size() * 4, "cu_seqlens_q"), f_kvl.take(kvl.data(), kvl.size() * 4, "kv_lens");
    return P;
  }
  void check_inputs() const {
    f_ql.check(), f_qp.check(), f_cache.check(), f_bt.check(), f_cu.check(), f_kvl.check();
  }
  bool outputs_untouched() const {
    for (uint8_t b : out)
      if (b != kCanary) return false;
    for (float x : lse)
      if (!std::isnan(x)) return false;
    return true;
  }

  // Checks row (t, h) of out / lse against the fp64 attention over the cache rows at offs
  // (offsets from the cache's base), with an attention sink (a logit with no value; -inf:
  // none). Tolerances: lse 1e-3 absolute + 1e-5 relative (fp32 scores of exact products); out
  // (q's dtype, fp32 sums; the bf16 engine rounds probabilities to bf16) 2 x the dtype's
  // rounding (bf16 1/256) of the largest |v| it averages, + 1e-5 of it.
  void check_row(int64_t t, int64_t h, const std::vector<int64_t>& offs, double sink = -INFINITY) const {
    const int64_t qes = dt_size(qdt), D = r + rope;
    std::vector<double> q(static_cast<size_t>(D)), o(static_cast<size_t>(r), 0.0);
    for (int64_t d = 0; d < r; ++d) q[d] = get(qlat.data() + (t * ql_s0 + h * ql_s1 + d) * qes, qdt);
    for (int64_t d = 0; d < rope; ++d) q[r + d] = get(qpe.data() + (t * qp_s0 + h * qp_s1 + d) * qes, qdt);
    const float got_lse = lse[t * H + h];
    const uint8_t* got = out.data() + (t * H + h) * r * qes;
    if (offs.empty()) {
      FZ_CHECK(got_lse == static_cast<float>(sink), "row (%lld, %lld) has no keys: lse %g, expected the sink %g",
               (long long)t, (long long)h, got_lse, sink);
      for (int64_t d = 0; d < r; ++d)
        FZ_CHECK(get(got + d * qes, qdt) == 0.0, "row (%lld, %lld) has no keys: out[%lld] != 0", (long long)t, (long long)h, (long long)d);
      return;
    }
    std::vector<double> s(offs.size());
    double mx = -INFINITY, vmax = 0;
    for (size_t c = 0; c < offs.size(); ++c) {
      const std::vector<double>& kv = decoded(offs[c]);
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += q[d] * kv[d];
      s[c] = dot * scale;  // kv_scale is in kv (decode_row)
      mx = std::max(mx, s[c]);
      for (int64_t d = 0; d < r; ++d) vmax = std::max(vmax, std::fabs(kv[d]));
    }
    double sum = 0;
    for (size_t c = 0; c < offs.size(); ++c) {
      const double p = std::exp(s[c] - mx);
      sum += p;
      const std::vector<double>& kv = decoded(offs[c]);
      for (int64_t d = 0; d < r; ++d) o[d] += p * kv[d];
    }
    if (sink > -INFINITY) {  // the sink's term, in the max's scale
      const double top = std::max(mx, sink);
      for (int64_t d = 0; d < r; ++d) o[d] *= std::exp(mx - top);
      sum = sum * std::exp(mx - top) + std::exp(sink - top);
      mx = top;
    }
    const double ref_lse = mx + std::log(sum);
    FZ_CHECK(std::fabs(got_lse - ref_lse) <= 1e-3 + 1e-5 * std::fabs(ref_lse),
             "row (%lld, %lld) of %zu keys: lse %.7g, reference %.7g (qdt %d, mode %d)", (long long)t, (long long)h,
             offs.size(), got_lse, ref_lse, qdt, mode);
    const double tol = (2 * dt_eps(qdt) + 1e-5) * vmax + 1e-30;
    for (int64_t d = 0; d < r; ++d) {
      const double want = o[d] / sum, have = get(got + d * qes, qdt);
      FZ_CHECK(std::fabs(have - want) <= tol, "row (%lld, %lld) of %zu keys: out[%lld] = %.7g, reference %.7g (tol %.3g, qdt %d, mode %d)",
               (long long)t, (long long)h, offs.size(), (long long)d, have, want, tol, qdt, mode);
    }
  }
};

}  // namespace fz
