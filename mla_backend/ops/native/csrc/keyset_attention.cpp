// Absorbed attention over key sets: the one primitive dense MLA, DSA and DeepSeek-V4 are cases
// of. Every head of query token t (request i, position p = kv_len_i - n_i + j) attends to the
// set S_t of cached rows (each distinct position of a cache counted once: an index repeated in
// its list, or one inside the token's causal range, adds nothing; drop_keyset_repeats)
//
//   range    positions start_t .. p of the main cache (start_t = max(0, p - window_i + 1);
//            window null: 0), when `range` is set;
//   idx      positions idx[t, :] of the main cache (-1 = no entry; each < kv_len_i);
//   idx2     entries idx2[t, :] of a second cache with its own block table, page size and
//            per-request entry counts len2 (-1 = no entry; each < len2[i]): V4's compressed rows.
//
//   o[t, h] = sum_{k in S_t} exp(s_k - lse) * v_k,   s_k = scale * (q_lat . c_kv_k + q_pe . k_pe_k)
//   lse[t, h] = log(sum_k exp(s_k) + exp(sink[h]))   (no sink: the keys alone)
//
// with v_k the first r columns of the row (MLA; value = key is the caller's rope = 0 with q the
// whole row), o = 0 and lse = sink (-inf without one) where S_t is empty. Both caches hold rows
// of one format (the cache mode, row bytes, kv_scale).
//
// Organisation: a call whose key sets are the plain causal ranges (range set, every window
// covering its request, no index list) runs the dense absorbed attention (absorbed_attention.h)
// as it is, the sink applied in its final store. Any other call runs work items (query token,
// block of heads, split of its key list), each compacting its slice of the token's list
// [range ; idx ; idx2] into byte offsets of cache rows (the second cache's offsets relative to
// the main cache's base) and streaming them through the same engines as DSA's sparse attention
// (sparse_attention.cpp): no mask, every listed row is visible; splits are merged through their
// LSE (merge_splits, which applies the sink). Every window, index and used page id is checked
// before anything is read: a bad one is refused naming the token, entry and range. The op is
// declared in ops.h and registered (with its schema) in api.cpp.
#ifndef MLA_CORE_ONLY  // the core test driver includes this file without torch
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "ops.h"
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absorbed_attention.h"

namespace mla_native {
namespace core {

// The call's key sets beyond P (see the file comment). Arrays are int32; null = absent.
struct KeySet {
  bool range = true;                 // the causal range of the main cache
  const int32_t* window = nullptr;   // [B] window sizes (>= 1), or null: the range starts at 0
  const int32_t* idx = nullptr;      // [T, K] positions of the main cache, row stride idx_s0
  int64_t K = 0, idx_s0 = 0;
  const int32_t* idx2 = nullptr;     // [T, K2] entries of the second cache, row stride idx2_s0
  int64_t K2 = 0, idx2_s0 = 0;
  // the second cache: pages of page_size2 rows at byte strides c2_s0 / c2_s1 (rows as P's)
  const char* cache2 = nullptr;
  int64_t c2_s0 = 0, c2_s1 = 0, page_size2 = 1, num_pages2 = 0;
  const int32_t* bt2 = nullptr;      // [B, bt2_width] at row stride bt2_s0
  int64_t bt2_s0 = 0, bt2_rows = 0, bt2_width = 0;
  const int32_t* len2 = nullptr;     // [B] entries of each request in the second cache
};

// Per query token: its request, position and range start (host arrays of the call).
struct KeySetTokens {
  std::vector<int32_t> req, pos, start;
};

inline KeySetTokens keyset_tokens(const Params& P, const KeySet& S, int64_t T) {
  KeySetTokens tk;
  tk.req.resize(T), tk.pos.resize(T), tk.start.resize(T);
  for (int64_t i = 0; i < P.B; ++i) {
    const int64_t n = P.cu[i + 1] - P.cu[i], L = P.kvl[i];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = P.cu[i] + j, p = L - n + j;
      tk.req[t] = static_cast<int32_t>(i), tk.pos[t] = static_cast<int32_t>(p);
      tk.start[t] = S.window ? static_cast<int32_t>(std::max<int64_t>(0, p - S.window[i] + 1)) : 0;
    }
  }
  return tk;
}

// "" when the windows, index lists and the second cache's used pages are valid, else the first
// bad value (after validate(P, b): cu and kv_lens are consistent).
inline std::string validate_keyset(const Params& P, const KeySet& S, const KeySetTokens& tk, int64_t T) {
  using detail::cat;
  if (S.window)
    for (int64_t i = 0; i < P.B; ++i)
      if (S.window[i] < 1) return cat("window[", i, "] = ", S.window[i], " must be >= 1");
  if (S.idx2) {
    if (S.page_size2 < 1) return cat("second cache page_size ", S.page_size2, " must be >= 1");
    if (S.bt2_rows < P.B) return cat("second block_table has ", S.bt2_rows, " rows for ", P.B, " requests");
    if (S.bt2_width < 0 || S.bt2_s0 < S.bt2_width)
      return cat("second block_table row stride ", S.bt2_s0, " is smaller than its width ", S.bt2_width);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = tk.req[t], L = P.kvl[i];
    if (S.idx) {
      const int32_t* row = S.idx + t * S.idx_s0;
      for (int64_t c = 0; c < S.K; ++c)
        if (row[c] < -1 || row[c] >= L)
          return cat("keyset attention: index out of range: indices[", t, ", ", c, "] = ", row[c],
                     " (valid: -1 for no entry, or 0 .. ", L - 1, " of request ", i, ")");
    }
    if (S.idx2) {
      const int64_t L2 = S.len2[i];
      if (L2 < 0 || L2 > S.bt2_width * S.page_size2)
        return cat("second cache: lens[", i, "] = ", L2, " is not in 0 .. ", S.bt2_width * S.page_size2,
                   " (its block_table row's pages x page_size)");
      const int32_t* row = S.idx2 + t * S.idx2_s0;
      for (int64_t c = 0; c < S.K2; ++c) {
        const int64_t e = row[c];
        if (e < -1 || e >= L2)
          return cat("keyset attention: index out of range: extra_indices[", t, ", ", c, "] = ", e,
                     " (valid: -1 for no entry, or 0 .. ", L2 - 1, " of request ", i, "'s second cache)");
        if (e < 0) continue;
        const int64_t page = S.bt2[i * S.bt2_s0 + e / S.page_size2];
        if (page < 0 || page >= S.num_pages2)
          return cat("second block_table[", i, ", ", e / S.page_size2, "] = ", page,
                     " is not a page of the second cache (0 .. ", S.num_pages2 - 1, ")");
      }
    }
  }
  return {};
}

// Each distinct position of a cache counts once (the rule of sparse attention's drop_repeats,
// mla_backend.keyset_attention): S is pointed at copies of its lists (`copy1` [T, K], `copy2`
// [T, K2]) in which an index repeated in its token's list (all but its first occurrence), and a
// main-cache index inside the token's causal range (when S.range), are set to -1.
inline void drop_keyset_repeats(KeySet& S, const KeySetTokens& tk, int64_t T, std::vector<int32_t>& copy1,
                                std::vector<int32_t>& copy2) {
  std::vector<std::pair<int32_t, int32_t>> sorted;
  auto dedup = [&](const int32_t*& idx, int64_t& s0, int64_t K, bool in_range, std::vector<int32_t>& copy) {
    if (!idx || K == 0) return;
    copy.resize(static_cast<size_t>(T * K));
    for (int64_t t = 0; t < T; ++t) {
      int32_t* row = copy.data() + t * K;
      std::copy(idx + t * s0, idx + t * s0 + K, row);
      sorted.clear();
      for (int64_t c = 0; c < K; ++c) {
        if (row[c] < 0) continue;
        if (in_range && row[c] >= tk.start[t] && row[c] <= tk.pos[t]) row[c] = -1;
        else sorted.push_back({row[c], static_cast<int32_t>(c)});
      }
      std::sort(sorted.begin(), sorted.end());
      for (size_t k = 1; k < sorted.size(); ++k)
        if (sorted[k].first == sorted[k - 1].first) row[sorted[k].second] = -1;
    }
    idx = copy.data();
    s0 = K;
  };
  dedup(S.idx, S.idx_s0, S.K, S.range, copy1);
  dedup(S.idx2, S.idx2_s0, S.K2, false, copy2);
}

// Length of token t's key list [range ; idx ; idx2] (-1 entries included).
inline int64_t keyset_list_len(const KeySet& S, const KeySetTokens& tk, int64_t t) {
  const int64_t w = S.range ? tk.pos[t] - tk.start[t] + 1 : 0;
  return w + (S.idx ? S.K : 0) + (S.idx2 ? S.K2 : 0);
}

template <typename QT, class Engine>
void run_keyset_item(const Params& P, const KeySet& S, const KeySetTokens& tk, const Item& it, Engine& E,
                     std::vector<int64_t>& offs, float* mrow, float* lrow, int64_t* lim) {
  const int64_t t = it.req;  // items are per token here
  const int64_t i = tk.req[t], H = P.H;
  // the slice's entries as byte offsets of their rows (the second cache's from P.cache's base)
  offs.clear();
  const int64_t w = S.range ? tk.pos[t] - tk.start[t] + 1 : 0, k1 = S.idx ? S.K : 0;
  const int64_t delta2 = reinterpret_cast<intptr_t>(S.cache2) - reinterpret_cast<intptr_t>(P.cache);
  for (int64_t c = it.kv0; c < it.kv1; ++c) {
    if (c < w) {
      offs.push_back(row_offset(P, i, tk.start[t] + c));
    } else if (c < w + k1) {
      const int64_t pos = S.idx[t * S.idx_s0 + (c - w)];
      if (pos >= 0) offs.push_back(row_offset(P, i, pos));
    } else {
      const int64_t e = S.idx2[t * S.idx2_s0 + (c - w - k1)];
      if (e < 0) continue;
      const int64_t page = S.bt2[i * S.bt2_s0 + e / S.page_size2];
      offs.push_back(delta2 + page * S.c2_s0 + (e % S.page_size2) * S.c2_s1);
    }
  }
  const int64_t nv = static_cast<int64_t>(offs.size());
  constexpr int TN = EngineDims<Engine>::kTile;
  offs.resize(static_cast<size_t>(nv + TN));  // the engines' next-tile cursor may read ahead
  const int rows = it.nrows, rows_pad = E.pad_rows(rows);
  for (int m = 0; m < rows_pad; ++m) {
    if (m < rows) {
      const int64_t h = it.row0 + m;
      E.load_q(m, P.qlat + (t * P.ql_s0 + h * P.ql_s1), P.rope ? P.qpe + (t * P.qp_s0 + h * P.qp_s1) : P.qpe);  // rope 0 (V4: value = key): q_pe may be null
      lim[m] = nv;  // every listed row is visible
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
  const int64_t r = P.r;
  for (int m = 0; m < rows; ++m) {
    const int64_t h = it.row0 + m;
    float inv = 0.0f, lse = -std::numeric_limits<float>::infinity();
    if (lrow[m] > 0.0f) {
      inv = P.out_scale / lrow[m];
      lse = mrow[m] + std::log(lrow[m]);
    }
    const float* o = E.orow(m);
    if (it.nsplit == 1) {
      apply_sink(P, h, inv, lse);
      const int64_t g = t * H + h;
      store_row(reinterpret_cast<QT*>(P.out) + g * r, o, r, inv);
      P.lse[g] = lse;
    } else {
      const int64_t pr = it.part_off + h * it.nsplit + it.split;
      store_row(P.part_o + pr * r, o, r, inv);
      P.part_lse[pr] = lse;
    }
  }
}

template <typename QT, class Engine>
void run_keyset_items(const Params& P, const KeySet& S, const KeySetTokens& tk, const std::vector<Item>& items,
                      const Parallel& par) {
  std::atomic<int64_t> next{0};
  const int64_t nitems = static_cast<int64_t>(items.size());
  if (nitems == 0) return;
  const int64_t nthreads = std::min<int64_t>(par.threads, nitems);
  auto worker = [&](int64_t, int64_t) {
    Engine E(P);
    constexpr int MR = EngineDims<Engine>::kRows;
    std::vector<float> ml(2 * MR);
    std::vector<int64_t> lim(MR), offs;
    for (int64_t k; (k = next.fetch_add(1)) < nitems;)
      run_keyset_item<QT, Engine>(P, S, tk, items[k], E, offs, ml.data(), ml.data() + MR, lim.data());
  };
  if (nthreads <= 1) worker(0, 1);
  else par.for_range(nthreads, 1, worker);
}

template <typename QT>
void run_keyset_engines(const Params& P, const KeySet& S, const KeySetTokens& tk, const std::vector<Item>& items,
                        bool amx, int mode, int engine, const Parallel& par) {
  const bool ds = mode == kDs, fp8 = mode == kFp8;
  if constexpr (std::is_same_v<QT, vec::bf16_t>) {
#ifdef MLA_HAS_AMX
    if (amx) {
      if (fp8) run_keyset_items<QT, AmxEngine<kFp8>>(P, S, tk, items, par);
      else run_keyset_items<QT, AmxEngine<kPlain>>(P, S, tk, items, par);
      return;
    }
#endif
#ifdef MLA_AVX512BF16
    if (engine & kEngineBf16) {
      if (ds) run_keyset_items<QT, Bf16Engine<kDs>>(P, S, tk, items, par);
      else if (fp8) run_keyset_items<QT, Bf16Engine<kFp8>>(P, S, tk, items, par);
      else run_keyset_items<QT, Bf16Engine<kPlain>>(P, S, tk, items, par);
      return;
    }
#endif
  }
  (void)amx;
  (void)engine;
  if (ds) run_keyset_items<QT, F32Engine<QT, uint8_t, kDs>>(P, S, tk, items, par);
  else if (fp8) run_keyset_items<QT, F32Engine<QT, uint8_t, kFp8>>(P, S, tk, items, par);
  else run_keyset_items<QT, F32Engine<QT, QT, kPlain>>(P, S, tk, items, par);
}

// The whole call: checks (validate(P, b), then the key sets), then the dense absorbed attention
// where every key set is a plain causal range, else the per-token items and their merge.
// P.out [T, H, r] (q's dtype) and P.lse [T, H] are written (P.sink applied). Returns "" on
// success, else the refusal (nothing read).
inline std::string keyset_attention(Params P, const Bounds& b, const KeySet& S_in, DType qdt, int mode,
                                    int64_t num_kv_splits, const Parallel& par, int engine = kEngineDefault) {
  if (std::string err = validate(P, b); !err.empty()) return err;
  const KeySetTokens tk = keyset_tokens(P, S_in, b.T);
  if (std::string err = validate_keyset(P, S_in, tk, b.T); !err.empty()) return err;
  KeySet S = S_in;
  std::vector<int32_t> copy1, copy2;
  drop_keyset_repeats(S, tk, b.T, copy1, copy2);
  const int64_t T = b.T, H = P.H;
  if (T == 0) return {};
  bool dense = S.range && !S.idx && !S.idx2;
  for (int64_t t = 0; dense && t < T; ++t) dense = tk.start[t] == 0;
  if (dense) return absorbed_attention(P, b, qdt, mode, num_kv_splits, par, engine);
  const bool amx = (engine & kEngineAmx) && qdt == DType::kBF16 && mode != kDs && amx_available() &&
                   H >= kAmxMinRows;
  const int64_t rows_per = amx ? kAmxRows : kMaxRows;
  const int64_t nb = ceil_div(H, rows_per), mb = ceil_div(H, nb);
  int64_t K = 0;  // the longest key list
  for (int64_t t = 0; t < T; ++t) K = std::max(K, keyset_list_len(S, tk, t));
  const int64_t nthreads = std::max<int64_t>(1, par.threads);
  // splits: enough items for the threads, slices of at least 256 entries
  int64_t ns = num_kv_splits > 0 ? num_kv_splits : std::max<int64_t>(1, ceil_div(4 * nthreads, T * nb));
  ns = std::max<int64_t>(1, std::min<int64_t>(ns, num_kv_splits > 0 ? std::max<int64_t>(K, 1) : K / 256));
  const int64_t len = ceil_div(std::max<int64_t>(K, 1), ns);
  ns = std::max<int64_t>(1, ceil_div(K, len));
  std::vector<Item> items;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t Kt = keyset_list_len(S, tk, t);
    for (int64_t bb = 0; bb < nb; ++bb)
      for (int64_t s = 0; s < ns; ++s) {
        Item it;
        it.req = static_cast<int32_t>(t);
        it.row0 = static_cast<int32_t>(bb * mb);
        it.nrows = static_cast<int32_t>(std::min(mb, H - bb * mb));
        it.split = static_cast<int32_t>(s);
        it.nsplit = static_cast<int32_t>(ns);
        it.kv0 = static_cast<int32_t>(std::min(Kt, s * len));
        it.kv1 = static_cast<int32_t>(std::min(Kt, (s + 1) * len));
        it.part_off = t * H * ns;
        it.cost = (it.kv1 - it.kv0) * it.nrows;
        items.push_back(it);
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& c) { return a.cost > c.cost; });
  const TokenSplits splits(P, T, ns);
  if (qdt == DType::kBF16) run_keyset_engines<vec::bf16_t>(P, S, tk, items, amx, mode, engine, par);
  else if (qdt == DType::kF16) run_keyset_engines<vec::fp16_t>(P, S, tk, items, amx, mode, engine, par);
  else run_keyset_engines<float>(P, S, tk, items, amx, mode, engine, par);
  TokenSplits::merge(P, T, ns, qdt, par);
  return {};
}

}  // namespace core

#ifndef MLA_CORE_ONLY
// ---- torch layer (declared in ops.h, registered in api.cpp) -----------------------------
void keyset_attention(const at::Tensor& q_lat_in, const at::Tensor& q_pe_in, const at::Tensor& kv_cache,
                      const at::Tensor& block_table_in, const at::Tensor& cu_in, const at::Tensor& kv_lens_in,
                      bool range, const c10::optional<at::Tensor>& window_in,
                      const c10::optional<at::Tensor>& indices_in, const c10::optional<at::Tensor>& cache2,
                      const c10::optional<at::Tensor>& block_table2_in, const c10::optional<at::Tensor>& lens2_in,
                      const c10::optional<at::Tensor>& indices2_in, const c10::optional<at::Tensor>& sink_in,
                      double softmax_scale, const c10::optional<at::Tensor>& kv_scale, int64_t max_page_id,
                      int64_t num_kv_splits, int64_t engine, const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK(num_kv_splits >= 0, "num_kv_splits=", num_kv_splits, " must be >= 0 (0 = automatic)");
  LatentArgs a = latent_args("keyset_attention", q_lat_in, q_pe_in, kv_cache, block_table_in, cu_in, kv_lens_in,
                             softmax_scale, kv_scale, engine);
  set_outputs(a, out, lse);
  const int64_t T = a.T, H = a.P.H, B = a.P.B;
  const auto cdt = kv_cache.scalar_type();
  core::KeySet S;
  S.range = range;
  at::Tensor window, idx, bt2, len2, idx2, sink;
  if (window_in.has_value() && window_in->defined()) {
    window = int32_arg(*window_in, "window");
    TORCH_CHECK(window.numel() == B, "window must be [B] = [", B, "], got ", window.sizes());
    S.window = window.data_ptr<int32_t>();
  }
  if (indices_in.has_value() && indices_in->defined()) {
    idx = int32_arg(*indices_in, "indices");
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == T, "indices [T, k] expected, got ", idx.sizes());
    S.idx = idx.data_ptr<int32_t>(), S.K = idx.size(1), S.idx_s0 = idx.stride(0);
  }
  if (indices2_in.has_value() && indices2_in->defined()) {
    TORCH_CHECK(cache2.has_value() && block_table2_in.has_value() && lens2_in.has_value(),
                "extra indices need the second cache, its block_table and lens");
    const at::Tensor& c2 = *cache2;
    TORCH_CHECK(c2.device().is_cpu() && c2.scalar_type() == cdt && c2.dim() == 3 && c2.size(2) == kv_cache.size(2) &&
                    c2.stride(2) == 1,
                "the second cache must be a CPU [pages, page_size, ", kv_cache.size(2), "] ", cdt,
                " tensor (the main cache's rows), got ", c2.scalar_type(), " ", c2.sizes());
    idx2 = int32_arg(*indices2_in, "extra_indices");
    TORCH_CHECK(idx2.dim() == 2 && idx2.size(0) == T, "extra_indices [T, k] expected, got ", idx2.sizes());
    bt2 = int32_arg(*block_table2_in, "second block_table");
    len2 = int32_arg(*lens2_in, "second lens");
    TORCH_CHECK(bt2.dim() == 2 && len2.numel() == B, "second block_table [B, pages] and lens [B] expected, got ",
                bt2.sizes(), ", ", len2.sizes());
    const int64_t ces = c2.element_size();
    S.idx2 = idx2.data_ptr<int32_t>(), S.K2 = idx2.size(1), S.idx2_s0 = idx2.stride(0);
    S.cache2 = static_cast<const char*>(c2.data_ptr());
    S.c2_s0 = c2.stride(0) * ces, S.c2_s1 = c2.stride(1) * ces, S.page_size2 = c2.size(1), S.num_pages2 = c2.size(0);
    S.bt2 = bt2.data_ptr<int32_t>(), S.bt2_s0 = bt2.stride(0), S.bt2_rows = bt2.size(0), S.bt2_width = bt2.size(1);
    S.len2 = len2.data_ptr<int32_t>();
  }
  if (sink_in.has_value() && sink_in->defined()) {
    sink = *sink_in;
    TORCH_CHECK(sink.device().is_cpu() && sink.scalar_type() == at::kFloat && sink.dim() == 1 && sink.size(0) == H,
                "sink must be a CPU [H] = [", H, "] float32 tensor, got ", sink.scalar_type(), " ", sink.sizes());
    sink = sink.contiguous();
    const float* sp = sink.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h)
      TORCH_CHECK(std::isfinite(sp[h]) || sp[h] == -std::numeric_limits<float>::infinity(), "sink[", h, "] = ",
                  sp[h], " is not supported: a finite logit or -inf (no sink)");
    a.P.sink = sp;
  }
  const std::string err = core::keyset_attention(a.P, a.bounds(max_page_id), S, dtype_of(a.qdt), a.format,
                                                 num_kv_splits, torch_parallel(), static_cast<int>(a.engine));
  TORCH_CHECK(err.empty(), err);  // a refused window, index or page: nothing was read
}
#endif  // MLA_CORE_ONLY

}  // namespace mla_native
