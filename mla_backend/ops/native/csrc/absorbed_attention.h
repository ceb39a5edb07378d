// absorbed_attention.h: the torch-free absorbed attention (decode / extend / speculative verify
// over a paged latent cache, every cache layout): the call's work items (request, block of query
// rows, kv split), their run over the engines (f32_attention.h, bf16_attention.h,
// amx_attention.h) and the merge of kv splits through their LSE. absorbed_attention.cpp checks
// the tensors and fills Params (api.cpp registers the torch.library op); the core can be built
// and tested outside torch (tests/native_core/driver.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_attention.h"
#include "attention_params.h"
#include "bf16_attention.h"
#include "f32_attention.h"
#include "rows.h"

namespace mla_native {
namespace core {

// An engine's kv tile and rows per item: its kTile / kRows where it declares them, else
// kTileN / kMaxRows.
template <class E, class = void>
struct EngineDims {
  static constexpr int kTile = kTileN, kRows = kMaxRows;
};
template <class E>
struct EngineDims<E, std::void_t<decltype(E::kTile), decltype(E::kRows)>> {
  static constexpr int kTile = E::kTile, kRows = E::kRows;
};

// ---- one work item -----------------------------------------------------------------------
// Engines with defer_prefetch(offs, n) spread the next tile's prefetches over their compute.
template <class E, class = void>
struct DefersPrefetch : std::false_type {};
template <class E>
struct DefersPrefetch<E, std::void_t<decltype(std::declval<E&>().defer_prefetch(nullptr, 0))>>
    : std::true_type {};

// The work item's epilogue: each of its it.nrows rows (row R = it.row0 + m of its request, flat
// [T*H] output row out_row0 + R) normalised by its softmax sum lrow[m] (times P.out_scale) with
// its LSE mrow[m] + log lrow[m] (0 and -inf for a row that saw no key), stored into P.out /
// P.lse when the item is its request's only kv split, else into the split's partial row
// (P.part_o / P.part_lse, merged after by merge_splits, which applies the sink then). The
// attention sink (apply_sink, P.sink) is applied to a row stored whole: head R % P.H.
template <typename QT, class Engine>
inline void store_item_rows(const Params& P, const Item& it, const Engine& E, int64_t out_row0,
                            const float* mrow, const float* lrow) {
  const int64_t r = P.r;
  for (int m = 0; m < it.nrows; ++m) {
    const int64_t R = it.row0 + m;
    float inv = 0.0f, lse = kNegInf;
    if (lrow[m] > 0.0f) {
      inv = P.out_scale / lrow[m];
      lse = mrow[m] + std::log(lrow[m]);
    }
    const float* o = E.orow(m);
    if (it.nsplit == 1) {
      apply_sink(P, R % P.H, inv, lse);
      const int64_t g = out_row0 + R;
      store_row(reinterpret_cast<QT*>(P.out) + g * r, o, r, inv);
      P.lse[g] = lse;
    } else {
      const int64_t pr = it.part_off + R * it.nsplit + it.split;
      store_row(P.part_o + pr * r, o, r, inv);
      P.part_lse[pr] = lse;
    }
  }
}

template <typename QT, class Engine>
void run_item(const Params& P, const Item& it, Engine& E, int64_t* offs, float* mrow, float* lrow,
              int64_t* lim) {
  const int64_t i = it.req;
  const int64_t n = P.cu[i + 1] - P.cu[i];
  const int64_t L = P.kvl[i];
  const int64_t H = P.H;
  const int rows = it.nrows;
  const int rows_pad = E.pad_rows(rows);
  int64_t lim_max = 0, lim_min = INT64_MAX;
  for (int m = 0; m < rows_pad; ++m) {
    if (m < rows) {
      int64_t R = it.row0 + m;
      int64_t j = R / H, h = R % H;
      int64_t t = P.cu[i] + j;
      E.load_q(m, P.qlat + (t * P.ql_s0 + h * P.ql_s1), P.rope ? P.qpe + (t * P.qp_s0 + h * P.qp_s1) : P.qpe);  // rope 0: q_pe may be null
      lim[m] = L - n + j + 1;
      lim_max = std::max(lim_max, lim[m]);
      lim_min = std::min(lim_min, lim[m]);
    } else {
      E.zero_q(m);
      lim[m] = 0;  // padding rows: fully masked
    }
    mrow[m] = kNegInf;
    lrow[m] = 0.0f;
  }
  E.start_item(rows_pad);
  constexpr int TN = EngineDims<Engine>::kTile;
  const int64_t kend = std::min<int64_t>(it.kv1, lim_max);
  for (int64_t t0 = it.kv0; t0 < kend; t0 += TN) {
    const int nt = static_cast<int>(std::min<int64_t>(TN, kend - t0));
    if (t0 == it.kv0)
      for (int c = 0; c < nt; ++c) offs[c] = row_offset(P, i, t0 + c);
    E.load_tile(offs, nt);
    // the next tile's rows: offsets now, a prefetch into L2 while this tile computes
    const int64_t t1 = t0 + TN;
    const int nn = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TN, kend - t1)));
    for (int c = 0; c < nn; ++c) offs[c] = row_offset(P, i, t1 + c);
    if constexpr (DefersPrefetch<Engine>::value) {
      E.defer_prefetch(offs, nn);
    } else {
      for (int c = 0; c < nn; ++c) prefetch_row(P.cache + offs[c], P.row_bytes);
    }
    E.compute_tile(rows, nt, t0, lim, P.score_scale, mrow, lrow);
  }
  store_item_rows<QT>(P, it, E, P.cu[i] * H, mrow, lrow);
}

template <typename QT, class Engine>
void run_items(const Params& P, const std::vector<Item>& items, const Parallel& par) {
  run_pulled(static_cast<int64_t>(items.size()), par, [&](auto& pull) {
    Engine E(P);
    constexpr int TN = EngineDims<Engine>::kTile, MR = EngineDims<Engine>::kRows;
    float* mrow = tl_scratch.ml.get<float>(2 * MR);
    float* lrow = mrow + MR;
    int64_t* scratch = tl_scratch.misc.get<int64_t>(TN + MR);
    int64_t* offs = scratch;
    int64_t* lim = scratch + TN;
    for (int64_t k; (k = pull()) >= 0;) run_item<QT, Engine>(P, items[k], E, offs, mrow, lrow, lim);
  });
}

template <typename QT>
void merge_splits(const Params& P, const std::vector<std::pair<int64_t, int64_t>>& reqs,
                  const Parallel& par) {
  // reqs: (request, nsplit) of split requests with their partial offsets in part_off order
  struct Job {
    int64_t req, nsplit, off, nrows;
  };
  std::vector<Job> jobs;
  int64_t off = 0, total = 0;
  for (auto& rs : reqs) {
    int64_t n = P.cu[rs.first + 1] - P.cu[rs.first];
    jobs.push_back({rs.first, rs.second, off, n * P.H});
    off += n * P.H * rs.second;
    total += n * P.H;
  }
  if (jobs.empty()) return;
  std::vector<int64_t> starts;  // row prefix over jobs
  starts.push_back(0);
  for (auto& j : jobs) starts.push_back(starts.back() + j.nrows);
  const int64_t r = P.r;
  par.for_range(total, 16, [&](int64_t b, int64_t e) {
    std::vector<float> acc(r);
    for (int64_t x = b; x < e; ++x) {
      int64_t ji = std::upper_bound(starts.begin(), starts.end(), x) - starts.begin() - 1;
      const Job& jb = jobs[ji];
      const int64_t R = x - starts[ji];
      const float* lses = P.part_lse + jb.off + R * jb.nsplit;
      const float* os = P.part_o + (jb.off + R * jb.nsplit) * r;
      float mx = kNegInf;
      for (int64_t s = 0; s < jb.nsplit; ++s) mx = std::max(mx, lses[s]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float wsum = 0.0f;
      if (mx != kNegInf) {
        for (int64_t s = 0; s < jb.nsplit; ++s) {
          if (lses[s] == kNegInf) continue;
          float w = std::exp(lses[s] - mx);
          wsum += w;
          const float* o = os + s * r;
          for (int64_t d = 0; d < r; ++d) acc[d] += w * o[d];
        }
      }
      const int64_t g = P.cu[jb.req] * P.H + R;
      float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
      float lse = wsum > 0.0f ? mx + std::log(wsum) : kNegInf;
      apply_sink(P, R % P.H, inv, lse);
      store_row(reinterpret_cast<QT*>(P.out) + g * r, acc.data(), r, inv);
      P.lse[g] = lse;
    }
  });
}

// The per-token kv splits of the sparse and key-set calls (T tokens x H heads, ns splits each):
// their partials' storage (sized and pointed to by P when ns > 1), then the merge, each token
// as a request of one query token.
struct TokenSplits {
  std::vector<float> part;
  TokenSplits(Params& P, int64_t T, int64_t ns) {
    if (ns <= 1) return;
    part.resize(static_cast<size_t>(T * P.H * ns * (P.r + 1)));
    P.part_o = part.data();
    P.part_lse = part.data() + T * P.H * ns * P.r;
  }
  static void merge(const Params& P, int64_t T, int64_t ns, DType qdt, const Parallel& par) {
    if (ns <= 1) return;
    std::vector<int32_t> ident(static_cast<size_t>(T + 1));
    for (int64_t t = 0; t <= T; ++t) ident[t] = static_cast<int32_t>(t);
    Params M = P;
    M.cu = ident.data();
    std::vector<std::pair<int64_t, int64_t>> reqs;
    for (int64_t t = 0; t < T; ++t) reqs.push_back({t, ns});
    if (qdt == DType::kBF16) merge_splits<vec::bf16_t>(M, reqs, par);
    else if (qdt == DType::kF16) merge_splits<vec::fp16_t>(M, reqs, par);
    else merge_splits<float>(M, reqs, par);
  }
};

// ---- the whole call ------------------------------------------------------------------------
// Checks P against b (validate: a refusal returns its message, nothing read or written), then
// plans the work items of P's batch (request, block of <= kMaxRows query rows -- kAmxRows for
// AMX requests --, kv split), runs them over par on the engines `engine` names (kEngine*) and
// merges the splits. P.out [T, H, r] (q's dtype) and P.lse [T, H] are written; P.part_o /
// P.part_lse are set here (a thread-local buffer). The caller has checked that the build has
// the engines it names (amx_available()). Returns "" on success.
inline std::string absorbed_attention(Params P, const Bounds& b, DType qdt, int mode,
                                      int64_t num_kv_splits, const Parallel& par,
                                      int engine = kEngineDefault) {
  if (std::string err = validate(P, b); !err.empty()) return err;
  if (b.T == 0) return {};
  const int64_t B = P.B, r = P.r;
  const bool ds = mode == kDs, fp8 = mode == kFp8;
  const bool amx = (engine & kEngineAmx) && qdt == DType::kBF16 && !ds && amx_available();
  // query rows per item of a request with `rows` rows
  auto block_rows = [amx](int64_t rows) -> int64_t {
    return amx && rows >= kAmxMinRows ? kAmxRows : kMaxRows;
  };
  // ---- work items ----
  const int64_t nthreads = std::max<int64_t>(1, par.threads);
  int64_t total_work = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = P.cu[i + 1] - P.cu[i];
    if (n == 0) continue;
    const int64_t nb = ceil_div(n * P.H, block_rows(n * P.H));
    total_work += nb * P.kvl[i];
  }
  const int64_t chunk = std::max<int64_t>(256, ceil_div(total_work, 4 * nthreads));
  std::vector<Item> items, amx_items;
  std::vector<std::pair<int64_t, int64_t>> split_reqs;
  int64_t part_rows = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = P.cu[i + 1] - P.cu[i];
    if (n == 0) continue;
    const int64_t L = P.kvl[i];
    const int64_t rows = n * P.H;
    const int64_t nb = ceil_div(rows, block_rows(rows));
    std::vector<Item>& dst = amx && rows >= kAmxMinRows ? amx_items : items;
    const int64_t mb = ceil_div(rows, nb);
    int64_t ns = num_kv_splits > 0 ? num_kv_splits : ceil_div(L, chunk);
    ns = std::max<int64_t>(1, std::min<int64_t>({ns, ceil_div(L, kTileN), 256}));
    const int64_t len = round_up(ceil_div(L, ns), kTileN);
    ns = ceil_div(L, len);
    const int64_t poff = part_rows;
    if (ns > 1) {
      split_reqs.push_back({i, ns});
      part_rows += rows * ns;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t row0 = b * mb;
      const int64_t nr = std::min(mb, rows - row0);
      for (int64_t s = 0; s < ns; ++s) {
        Item it;
        set_split(it, i, s, ns, len, L, poff);
        it.row0 = static_cast<int32_t>(row0);
        it.nrows = static_cast<int32_t>(nr);
        it.cost = (it.kv1 - it.kv0) * nr;
        dst.push_back(it);
      }
    }
  }
  for (auto* v : {&items, &amx_items})
    std::stable_sort(v->begin(), v->end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  thread_local std::vector<float> part_buf;
  const size_t part_need = static_cast<size_t>(part_rows) * (r + 1);
  if (part_buf.size() < part_need) part_buf.resize(part_need);
  P.part_o = part_buf.data();
  P.part_lse = part_buf.data() + static_cast<size_t>(part_rows) * r;

  if (qdt == DType::kBF16) {
    using QT = vec::bf16_t;
#ifdef MLA_HAS_AMX
    if (fp8) run_items<QT, AmxEngine<kFp8>>(P, amx_items, par);
    else run_items<QT, AmxEngine<kPlain>>(P, amx_items, par);
#endif
#ifdef MLA_AVX512BF16
    if (engine & kEngineBf16) {
      if (ds) run_items<QT, Bf16Engine<kDs>>(P, items, par);
      else if (fp8) run_items<QT, Bf16Engine<kFp8>>(P, items, par);
      else run_items<QT, Bf16Engine<kPlain>>(P, items, par);
      merge_splits<QT>(P, split_reqs, par);
      return {};
    }
#endif
    if (ds) run_items<QT, F32Engine<QT, uint8_t, kDs>>(P, items, par);
    else if (fp8) run_items<QT, F32Engine<QT, uint8_t, kFp8>>(P, items, par);
    else run_items<QT, F32Engine<QT, QT, kPlain>>(P, items, par);
    merge_splits<QT>(P, split_reqs, par);
  } else if (qdt == DType::kF16) {
    using QT = vec::fp16_t;
    if (ds) run_items<QT, F32Engine<QT, uint8_t, kDs>>(P, items, par);
    else if (fp8) run_items<QT, F32Engine<QT, uint8_t, kFp8>>(P, items, par);
    else run_items<QT, F32Engine<QT, QT, kPlain>>(P, items, par);
    merge_splits<QT>(P, split_reqs, par);
  } else {
    using QT = float;
    if (ds) run_items<QT, F32Engine<QT, uint8_t, kDs>>(P, items, par);
    else if (fp8) run_items<QT, F32Engine<QT, uint8_t, kFp8>>(P, items, par);
    else run_items<QT, F32Engine<QT, QT, kPlain>>(P, items, par);
    merge_splits<QT>(P, split_reqs, par);
  }
  return {};
}

}  // namespace core
}  // namespace mla_native
