// DSA's sparse absorbed attention: each query token attends to the latent rows of its own index
// list (logical positions of its request, -1 = no entry), over every latent layout the dense
// absorbed attention reads (bf16 / fp16 / fp32, per-tensor fp8, fp8_ds_mla).
//
//   o[t, h] = sum_{c in S_t} softmax_c(scale * (q_lat[t, h] . c_kv[c] + q_pe[t, h] . k_pe[c]))
//             * c_kv[c],    lse[t, h] = log sum_c exp(...)    (o = 0, lse = -inf for S_t empty)
//
// Organisation: work items are (query token, block of heads, split of its index list); an item
// compacts the valid entries of its slice into byte offsets of cache rows (page lookups through
// the block table) and streams them, in tiles, through the dense absorbed attention's engines
// (absorbed_attention.h: the fp32 engine at every level, the AVX512-BF16 and AMX engines where the
// build and the call allow them, chosen by the same `engine` bits), which take a tile as a list
// of row offsets: the same inner math (scores, online softmax, P.V) as the dense path, with no
// causal mask (every selected row is visible). Splits are merged through their LSE as the dense
// path's. Every index is checked before anything is read: an entry >= its request's kv length
// or < -1 is refused naming the token, the entry and the range; a position listed twice in a
// token's list counts once (drop_repeats).
#ifndef MLA_CORE_ONLY  // the core test driver includes this file without torch
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "ops.h"
#endif

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absorbed_attention.h"

namespace mla_native {
namespace core {

// The call's index lists: idx [T, K] int32 at row stride idx_s0; token t belongs to request
// tok_req[t] (of P's B requests).
struct SparseIndex {
  const int32_t* idx = nullptr;
  int64_t K = 0, idx_s0 = 0;
  const int32_t* tok_req = nullptr;
};

// "" when every token is one of its request's query tokens (cu_seqlens_q) and every entry is
// -1 or a position of that request, else the first bad one.
inline std::string validate_indices(const Params& P, const SparseIndex& S, int64_t T) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t req = S.tok_req[t];
    if (req < 0 || req >= P.B)
      return detail::cat("token ", t, " belongs to request ", req, ", not one of 0 .. ", P.B - 1);
    if (t < P.cu[req] || t >= P.cu[req + 1])  // (validate() checked only its requests' rows)
      return detail::cat("token ", t, " is not a query token of request ", req, " (its tokens: ", P.cu[req],
                         " .. ", P.cu[req + 1] - 1, ")");
    const int64_t L = P.kvl[req];
    const int32_t* row = S.idx + t * S.idx_s0;
    for (int64_t c = 0; c < S.K; ++c)
      if (row[c] < -1 || row[c] >= L)
        return detail::cat("sparse attention: index out of range: indices[", t, ", ", c, "] = ", row[c],
                           " (valid: -1 for no entry, or 0 .. ", L - 1, " of request ", req, ")");
  }
  return {};
}

// A position listed more than once in a token's list counts once (the rule of
// mla_backend.sparse_absorbed_attention): when some list repeats a position, S is pointed at a
// copy of the lists (`copy`, [T, K]) with every repeat set to -1, its first occurrence kept.
// A list whose valid entries ascend (the indexer's output) is passed over in O(K); another one
// is sorted once.
inline void drop_repeats(SparseIndex& S, int64_t T, std::vector<int32_t>& copy) {
  std::vector<std::pair<int32_t, int32_t>> sorted;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* row = S.idx + t * S.idx_s0;
    int32_t last = -1;
    bool ascending = true;
    for (int64_t c = 0; c < S.K && ascending; ++c) {
      if (row[c] < 0) continue;
      ascending = row[c] > last;
      last = row[c];
    }
    if (ascending) continue;
    sorted.clear();
    for (int64_t c = 0; c < S.K; ++c)
      if (row[c] >= 0) sorted.push_back({row[c], static_cast<int32_t>(c)});
    std::sort(sorted.begin(), sorted.end());
    for (size_t k = 1; k < sorted.size(); ++k) {
      if (sorted[k].first != sorted[k - 1].first) continue;
      if (copy.empty()) {
        copy.resize(static_cast<size_t>(T * S.K));
        for (int64_t u = 0; u < T; ++u)
          std::copy(S.idx + u * S.idx_s0, S.idx + u * S.idx_s0 + S.K, copy.data() + u * S.K);
      }
      copy[static_cast<size_t>(t * S.K + sorted[k].second)] = -1;
    }
  }
  if (!copy.empty()) {
    S.idx = copy.data();
    S.idx_s0 = S.K;
  }
}

template <typename QT, class Engine>
void run_sparse_item(const Params& P, const SparseIndex& S, const Item& it, Engine& E, std::vector<int64_t>& offs,
                     float* mrow, float* lrow, int64_t* lim) {
  const int64_t t = it.req;  // items are per token here
  const int64_t i = S.tok_req[t], H = P.H, ps = P.page_size;
  // the slice's valid entries as byte offsets of their cache rows
  offs.clear();
  const int32_t* row = S.idx + t * S.idx_s0;
  for (int64_t c = it.kv0; c < it.kv1; ++c) {
    const int64_t pos = row[c];
    if (pos < 0) continue;
    offs.push_back(static_cast<int64_t>(P.bt[i * P.bt_s0 + pos / ps]) * P.c_s0 + (pos % ps) * P.c_s1);
  }
  const int64_t nv = static_cast<int64_t>(offs.size());
  constexpr int TN = EngineDims<Engine>::kTile;
  offs.resize(static_cast<size_t>(nv + TN));  // the engines' next-tile cursor may read ahead
  const int rows = it.nrows, rows_pad = E.pad_rows(rows);
  for (int m = 0; m < rows_pad; ++m) {
    if (m < rows) {
      const int64_t h = it.row0 + m;
      E.load_q(m, P.qlat + (t * P.ql_s0 + h * P.ql_s1), P.rope ? P.qpe + (t * P.qp_s0 + h * P.qp_s1) : P.qpe);  // rope 0: q_pe may be null
      lim[m] = nv;  // every selected row is visible
    } else {
      E.zero_q(m);
      lim[m] = 0;
    }
    mrow[m] = -std::numeric_limits<float>::infinity();
    lrow[m] = 0.0f;
  }
  E.start_item(rows_pad);
  for (int64_t t0 = 0; t0 < nv; t0 += TN) {
    const int nt = static_cast<int>(std::min<int64_t>(TN, nv - t0));
    E.load_tile(offs.data() + t0, nt);
    const int64_t t1 = t0 + TN;
    const int nn = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TN, nv - t1)));
    if constexpr (DefersPrefetch<Engine>::value) {
      E.defer_prefetch(offs.data() + t1, nn);
    } else {
      for (int c = 0; c < nn; ++c) prefetch_row(P.cache + offs[t1 + c], P.row_bytes);
    }
    E.compute_tile(rows, nt, t0, lim, P.score_scale, mrow, lrow);
  }
  store_item_rows<QT>(P, it, E, t * H, mrow, lrow);  // one token: its heads are the rows
}

template <typename QT, class Engine>
void run_sparse_items(const Params& P, const SparseIndex& S, const std::vector<Item>& items, const Parallel& par) {
  run_pulled(static_cast<int64_t>(items.size()), par, [&](auto& pull) {
    Engine E(P);
    constexpr int MR = EngineDims<Engine>::kRows;
    std::vector<float> ml(2 * MR);
    std::vector<int64_t> lim(MR), offs;
    for (int64_t k; (k = pull()) >= 0;)
      run_sparse_item<QT, Engine>(P, S, items[k], E, offs, ml.data(), ml.data() + MR, lim.data());
  });
}

template <typename QT>
void run_sparse_engines(const Params& P, const SparseIndex& S, const std::vector<Item>& items,
                        const std::vector<Item>& amx_items, int mode, int engine, const Parallel& par) {
  const bool ds = mode == kDs, fp8 = mode == kFp8;
  if constexpr (std::is_same_v<QT, vec::bf16_t>) {
#ifdef MLA_HAS_AMX
    if (fp8) run_sparse_items<QT, AmxEngine<kFp8>>(P, S, amx_items, par);
    else if (!ds) run_sparse_items<QT, AmxEngine<kPlain>>(P, S, amx_items, par);
#endif
#ifdef MLA_AVX512BF16
    if (engine & kEngineBf16) {
      if (ds) run_sparse_items<QT, Bf16Engine<kDs>>(P, S, items, par);
      else if (fp8) run_sparse_items<QT, Bf16Engine<kFp8>>(P, S, items, par);
      else run_sparse_items<QT, Bf16Engine<kPlain>>(P, S, items, par);
      return;
    }
#endif
  }
  (void)amx_items;
  (void)engine;
  if (ds) run_sparse_items<QT, F32Engine<QT, uint8_t, kDs>>(P, S, items, par);
  else if (fp8) run_sparse_items<QT, F32Engine<QT, uint8_t, kFp8>>(P, S, items, par);
  else run_sparse_items<QT, F32Engine<QT, QT, kPlain>>(P, S, items, par);
}

// The whole call: checks (validate(P, b) for the block table and lengths, then every index),
// plans items (token, block of heads, split of its list: splits where the tokens alone leave
// threads idle), runs them and merges the splits. P.out [T, H, r] (q's dtype) and P.lse [T, H]
// are written. Returns "" on success, else the refusal (nothing read).
inline std::string sparse_attention(Params P, const Bounds& b, const SparseIndex& S_in, DType qdt, int mode,
                                    const Parallel& par, int engine = kEngineDefault) {
  if (std::string err = validate(P, b); !err.empty()) return err;
  if (std::string err = validate_indices(P, S_in, b.T); !err.empty()) return err;
  SparseIndex S = S_in;
  std::vector<int32_t> deduped;
  drop_repeats(S, b.T, deduped);
  const int64_t T = b.T, H = P.H, K = S.K;
  if (T == 0) return {};
  const bool amx = (engine & kEngineAmx) && qdt == DType::kBF16 && mode != kDs && amx_available() &&
                   H >= kAmxMinRows;
  const int64_t rows_per = amx ? kAmxRows : kMaxRows;
  const int64_t nb = ceil_div(H, rows_per), mb = ceil_div(H, nb);
  const int64_t nthreads = std::max<int64_t>(1, par.threads);
  // splits: enough items for the threads, slices of at least 256 entries
  int64_t ns = std::max<int64_t>(1, ceil_div(4 * nthreads, T * nb));
  ns = std::max<int64_t>(1, std::min<int64_t>(ns, K / 256));
  const int64_t len = ceil_div(std::max<int64_t>(K, 1), ns);
  ns = std::max<int64_t>(1, ceil_div(K, len));
  std::vector<Item> items;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t bb = 0; bb < nb; ++bb)
      for (int64_t s = 0; s < ns; ++s) {
        Item it;
        set_split(it, t, s, ns, len, K, t * H * ns);
        it.row0 = static_cast<int32_t>(bb * mb);
        it.nrows = static_cast<int32_t>(std::min(mb, H - bb * mb));
        it.cost = 0;
        items.push_back(it);
      }
  const TokenSplits splits(P, T, ns);
  const std::vector<Item> none;
  const std::vector<Item>& vec_items = amx ? none : items;
  const std::vector<Item>& amx_items = amx ? items : none;
  if (qdt == DType::kBF16) run_sparse_engines<vec::bf16_t>(P, S, vec_items, amx_items, mode, engine, par);
  else if (qdt == DType::kF16) run_sparse_engines<vec::fp16_t>(P, S, vec_items, amx_items, mode, engine, par);
  else run_sparse_engines<float>(P, S, vec_items, amx_items, mode, engine, par);
  TokenSplits::merge(P, T, ns, qdt, par);
  return {};
}

}  // namespace core

#ifndef MLA_CORE_ONLY
// ---- torch layer (declared in ops.h, registered in api.cpp) -----------------------------
void sparse_attention(const at::Tensor& q_lat_in, const at::Tensor& q_pe_in, const at::Tensor& kv_cache,
                      const at::Tensor& block_table_in, const at::Tensor& cu_in, const at::Tensor& kv_lens_in,
                      const at::Tensor& indices_in, const at::Tensor& token_req_in, double softmax_scale,
                      const c10::optional<at::Tensor>& kv_scale, int64_t max_page_id, int64_t engine,
                      const at::Tensor& out, const at::Tensor& lse) {
  LatentArgs a = latent_args("sparse_attention", q_lat_in, q_pe_in, kv_cache, block_table_in, cu_in, kv_lens_in,
                             softmax_scale, kv_scale, engine);
  set_outputs(a, out, lse);
  const int64_t T = a.T;
  at::Tensor treq = int32_arg(token_req_in, "token_req"), idx = int32_arg(indices_in, "indices");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == T && treq.numel() == T, "indices [T, k] and token_req [T] with T = ",
              T, " expected, got ", idx.sizes(), ", ", treq.sizes());
  core::SparseIndex S;
  S.idx = idx.data_ptr<int32_t>(), S.K = idx.size(1), S.idx_s0 = idx.stride(0), S.tok_req = treq.data_ptr<int32_t>();
  const std::string err = core::sparse_attention(a.P, a.bounds(max_page_id), S, dtype_of(a.qdt), a.format,
                                                 torch_parallel(), static_cast<int>(a.engine));
  TORCH_CHECK(err.empty(), err);  // a refused index: nothing was read
}
#endif  // MLA_CORE_ONLY

}  // namespace mla_native
