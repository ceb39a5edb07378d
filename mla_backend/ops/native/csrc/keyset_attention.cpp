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
// before anything is read: a bad one is refused naming the token, entry and range.
//
// DeepSeek-V4's fp8 rows (format kV4, vLLM's 584-byte layout, mla_backend/v4_cache.py) are read
// in place: per page of page_size rows, row j's 576 data bytes at j * c_s1 (448 e4m3 values, then
// 64 bf16 RoPE values) and its 7 UE8M0 scale bytes (2^(byte - 127) per 64 e4m3 values) at
// page_size * c_s1 + 8 j. Each tile of listed rows is decoded into q's dtype (exact: a power-of-
// two scale of a 4-bit significand) in a per-thread scratch and handed to the kPlain engines.
// v4_slot_attention (below) serves vLLM's op contract -- per token a list of flat slots into a
// window cache and a compressed cache -- as a key-set call: one request over identity block
// tables. The ops are declared in ops.h and registered (with their schemas) in api.cpp.
#ifndef MLA_CORE_ONLY  // the core test driver includes this file without torch
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "ops.h"
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
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

// ---- DeepSeek-V4 rows (kV4, see the file comment) -------------------------------------------
constexpr int64_t kV4Nope = 448, kV4Rope = 64, kV4Tile = 64, kV4Width = kV4Nope + kV4Rope;
constexpr int64_t kV4ScaleBytes = 8;  // a row's scale bytes in its page's scale area (7 used)

// dst[0, 512) = the V4 row (data bytes at `data`, scale bytes at `scales`) in QT: each e4m3 value
// times 2^(its tile's byte - 127) in fp32 (one rounding, as mla_backend.v4_cache.decode_v4_rows),
// the RoPE part widened from bf16; then QT's round to nearest even. tmp: [512] fp32.
template <typename QT>
inline void decode_v4_row(QT* dst, const uint8_t* data, const uint8_t* scales, float* tmp) {
  for (int64_t t = 0; t < kV4Nope / kV4Tile; ++t)  // (v / 256) * 2^(8 + e): v * 2^e, one rounding
    widen_e4m3_row(tmp + t * kV4Tile, data + t * kV4Tile, kV4Tile,
                   std::ldexp(kFp8Unscale, static_cast<int>(scales[t]) - 127));
  widen_row(tmp + kV4Nope, reinterpret_cast<const vec::bf16_t*>(data + kV4Nope), kV4Rope);
  store_row(dst, tmp, kV4Width, 1.0f);
}

// A thread's decoded V4 tile: [kTileN][512] rows of q's dtype and their fp32 staging row.
inline thread_local Buf tl_v4_tile;

template <typename QT, class Engine, bool kV4Rows = false>
void run_keyset_item(const Params& P, const KeySet& S, const KeySetTokens& tk, const Item& it, Engine& E,
                     std::vector<int64_t>& offs, std::vector<int64_t>& soffs, float* mrow, float* lrow,
                     int64_t* lim) {
  const int64_t t = it.req;  // items are per token here
  const int64_t i = tk.req[t], H = P.H;
  // the slice's entries as byte offsets of their rows (the second cache's from P.cache's base);
  // V4 rows: their scale bytes' offsets too, in soffs
  offs.clear();
  soffs.clear();
  const int64_t w = S.range ? tk.pos[t] - tk.start[t] + 1 : 0, k1 = S.idx ? S.K : 0;
  const int64_t delta2 = reinterpret_cast<intptr_t>(S.cache2) - reinterpret_cast<intptr_t>(P.cache);
  auto push = [&](int64_t page_base, int64_t j, int64_t page_size, int64_t s1) {
    offs.push_back(page_base + j * s1);
    if constexpr (kV4Rows) soffs.push_back(page_base + page_size * s1 + j * kV4ScaleBytes);
  };
  for (int64_t c = it.kv0; c < it.kv1; ++c) {
    int64_t pos = -1;
    if (c < w) {
      pos = tk.start[t] + c;
    } else if (c < w + k1) {
      pos = S.idx[t * S.idx_s0 + (c - w)];
    } else {
      const int64_t e = S.idx2[t * S.idx2_s0 + (c - w - k1)];
      if (e < 0) continue;
      const int64_t page = S.bt2[i * S.bt2_s0 + e / S.page_size2];
      push(delta2 + page * S.c2_s0, e % S.page_size2, S.page_size2, S.c2_s1);
      continue;
    }
    if (pos < 0) continue;
    push(P.bt[i * P.bt_s0 + pos / P.page_size] * P.c_s0, pos % P.page_size, P.page_size, P.c_s1);
  }
  const int64_t nv = static_cast<int64_t>(offs.size());
  constexpr int TN = EngineDims<Engine>::kTile;
  offs.resize(static_cast<size_t>(nv + TN));  // the engines' next-tile cursor may read ahead
  QT* v4_rows = nullptr;  // kV4Rows: the decoded tile, its offsets from P.cache, fp32 staging
  int64_t v4_offs[TN];
  float* v4_tmp = nullptr;
  if constexpr (kV4Rows) {
    const int64_t tile_bytes = round_up(static_cast<int64_t>(TN * kV4Width * sizeof(QT)), 64);
    char* buf = tl_v4_tile.get<char>(static_cast<size_t>(tile_bytes + kV4Width * sizeof(float)));
    v4_rows = reinterpret_cast<QT*>(buf);
    v4_tmp = reinterpret_cast<float*>(buf + tile_bytes);
    for (int c = 0; c < TN; ++c)
      v4_offs[c] = reinterpret_cast<intptr_t>(v4_rows + c * kV4Width) - reinterpret_cast<intptr_t>(P.cache);
  }
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
    const int64_t t1 = t0 + TN;
    const int nn = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(TN, nv - t1)));
    if constexpr (kV4Rows) {
      for (int c = 0; c < nt; ++c)
        decode_v4_row(v4_rows + c * kV4Width, reinterpret_cast<const uint8_t*>(P.cache + offs[t0 + c]),
                      reinterpret_cast<const uint8_t*>(P.cache + soffs[t0 + c]), v4_tmp);
      E.load_tile(v4_offs, nt);
      for (int c = 0; c < nn; ++c) {
        prefetch_row(P.cache + offs[t1 + c], P.row_bytes);
        vec::prefetch_l2(P.cache + soffs[t1 + c]);
      }
    } else {
      E.load_tile(offs.data() + t0, nt);
      if constexpr (DefersPrefetch<Engine>::value) {
        E.defer_prefetch(offs.data() + t1, nn);
      } else {
        for (int c = 0; c < nn; ++c) prefetch_row(P.cache + offs[t1 + c], P.row_bytes);
      }
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

template <typename QT, class Engine, bool kV4Rows = false>
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
    std::vector<int64_t> lim(MR), offs, soffs;
    for (int64_t k; (k = next.fetch_add(1)) < nitems;)
      run_keyset_item<QT, Engine, kV4Rows>(P, S, tk, items[k], E, offs, soffs, ml.data(), ml.data() + MR,
                                           lim.data());
  };
  if (nthreads <= 1) worker(0, 1);
  else par.for_range(nthreads, 1, worker);
}

template <typename QT>
void run_keyset_engines(const Params& P, const KeySet& S, const KeySetTokens& tk, const std::vector<Item>& items,
                        bool amx, int mode, int engine, const Parallel& par) {
  const bool ds = mode == kDs, fp8 = mode == kFp8, v4 = mode == kV4;
  if constexpr (std::is_same_v<QT, vec::bf16_t>) {
#ifdef MLA_HAS_AMX
    if (amx) {  // never kV4 (keyset_attention)
      if (fp8) run_keyset_items<QT, AmxEngine<kFp8>>(P, S, tk, items, par);
      else run_keyset_items<QT, AmxEngine<kPlain>>(P, S, tk, items, par);
      return;
    }
#endif
#ifdef MLA_AVX512BF16
    if (engine & kEngineBf16) {
      if (v4) run_keyset_items<QT, Bf16Engine<kPlain>, true>(P, S, tk, items, par);
      else if (ds) run_keyset_items<QT, Bf16Engine<kDs>>(P, S, tk, items, par);
      else if (fp8) run_keyset_items<QT, Bf16Engine<kFp8>>(P, S, tk, items, par);
      else run_keyset_items<QT, Bf16Engine<kPlain>>(P, S, tk, items, par);
      return;
    }
#endif
  }
  (void)amx;
  (void)engine;
  if (v4) run_keyset_items<QT, F32Engine<QT, QT, kPlain>, true>(P, S, tk, items, par);
  else if (ds) run_keyset_items<QT, F32Engine<QT, uint8_t, kDs>>(P, S, tk, items, par);
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
  if (dense && mode != kV4) return absorbed_attention(P, b, qdt, mode, num_kv_splits, par, engine);
  const bool amx = (engine & kEngineAmx) && qdt == DType::kBF16 && mode != kDs && mode != kV4 && amx_available() &&
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

// ---- vLLM's V4 attention contract over the key-set primitive -------------------------------
// One cache of a v4_slot_attention call: num_pages pages of page_bytes bytes, page_stride apart,
// holding page_size V4 rows each; per query token K flat slots page * page_size + offset (row
// stride slots_s0; negative: no row). K = 0: the set is absent.
struct V4Slots {
  const char* cache = nullptr;
  int64_t num_pages = 0, page_bytes = 0, page_stride = 0, page_size = 1;
  const int64_t* slots = nullptr;
  int64_t K = 0, slots_s0 = 0;
};

// o[t, h] (and lse[t, h], the sink included) = attention of q[t, h] (the whole 512-wide row:
// value = key) over the rows token t lists in `win` (the window cache) and `comp` (the compressed
// cache), each distinct row once, with sink[h] (null: none). q / out [T, H, 512] of qdt (q at
// byte strides q_s0 / q_s1, out contiguous), lse [T, H] float32. Served as one request over
// identity block tables: the window cache's slots are positions of the main cache, the
// compressed cache's entries of the second. Returns "" or the refusal (a slot past its cache, a
// page too small for its rows), before anything is read.
inline std::string v4_slot_attention(const char* q, int64_t T, int64_t H, int64_t q_s0, int64_t q_s1, DType qdt,
                                     const V4Slots& win, const V4Slots& comp, const float* sink,
                                     float softmax_scale, int64_t num_kv_splits, char* out, float* lse,
                                     const Parallel& par, int engine = kEngineDefault) {
  using detail::cat;
  const V4Slots* sets[2] = {&win, &comp};
  const char* names[2] = {"window", "compressed"};
  std::vector<int32_t> idx[2], table[2];
  int64_t slots_of[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    const V4Slots& c = *sets[k];
    if (c.page_size < 1) return cat(names[k], " cache page_size ", c.page_size, " must be >= 1");
    if (c.K == 0) continue;
    const int64_t used = c.page_size * (kV4Nope + 2 * kV4Rope + kV4ScaleBytes);  // 584 bytes a row
    if (c.num_pages > 0 && c.page_bytes < used)
      return cat(names[k], " cache pages of ", c.page_bytes, " bytes cannot hold page_size = ", c.page_size,
                 " rows of 584 bytes (", used, ")");
    if (c.num_pages > 1 && c.page_stride < used)
      return cat(names[k], " cache page stride ", c.page_stride, " bytes is smaller than its page_size = ",
                 c.page_size, " rows of 584 bytes (", used, ")");
    const int64_t n = slots_of[k] = c.num_pages * c.page_size;
    if (n > std::numeric_limits<int32_t>::max())
      return cat(names[k], " cache of ", n, " rows is not supported: at most 2^31 - 1");
    idx[k].resize(static_cast<size_t>(T * c.K));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < c.K; ++j) {
        const int64_t v = c.slots[t * c.slots_s0 + j];
        if (v >= n)
          return cat(names[k], "_slots[", t, ", ", j, "] = ", v, " is not a slot of the ", names[k], " cache (0 .. ",
                     n - 1, " for its ", c.num_pages, " pages of ", c.page_size, " rows; negative: none)");
        idx[k][t * c.K + j] = v < 0 ? -1 : static_cast<int32_t>(v);
      }
  }
  // one request: the window cache as the main cache (its kv_len at least T, as a request's is;
  // positions past its slots are never listed), the compressed cache as the second
  const int64_t L = std::max<int64_t>({slots_of[0], T, 1});
  const int64_t ps = win.page_size;
  table[0].resize(static_cast<size_t>(ceil_div(L, ps)));
  for (int64_t p = 0; p < static_cast<int64_t>(table[0].size()); ++p)
    table[0][p] = static_cast<int32_t>(p < win.num_pages ? p : 0);
  const int32_t cu[2] = {0, static_cast<int32_t>(T)};
  const int32_t kvl[1] = {static_cast<int32_t>(L)};
  Params P{};
  P.H = H, P.r = kV4Width, P.rope = 0, P.D = kV4Width, P.B = 1;
  P.page_size = ps, P.num_pages = std::max<int64_t>(win.num_pages, 1);
  P.bt = table[0].data(), P.bt_s0 = static_cast<int64_t>(table[0].size());
  P.cu = cu, P.kvl = kvl;
  P.qlat = q, P.ql_s0 = q_s0, P.ql_s1 = q_s1;
  P.qpe = nullptr, P.qp_s0 = 0, P.qp_s1 = 0;
  // rows are addressed from P.cache: a window cache with no pages (none of its slots is valid)
  // lends the compressed cache's base
  P.cache = win.num_pages > 0 ? win.cache : comp.cache, P.c_s0 = win.page_stride, P.c_s1 = kV4Nope + 2 * kV4Rope;
  P.row_bytes = kV4Nope + 2 * kV4Rope;
  P.score_scale = softmax_scale, P.out_scale = 1.0f;
  P.out = out, P.lse = lse, P.sink = sink;
  KeySet S;
  S.range = false;
  if (win.K > 0) S.idx = idx[0].data(), S.K = win.K, S.idx_s0 = win.K;
  int32_t len2[1] = {static_cast<int32_t>(slots_of[1])};
  if (comp.K > 0) {
    table[1].resize(static_cast<size_t>(std::max<int64_t>(1, comp.num_pages)));
    for (int64_t p = 0; p < static_cast<int64_t>(table[1].size()); ++p) table[1][p] = static_cast<int32_t>(p);
    S.idx2 = idx[1].data(), S.K2 = comp.K, S.idx2_s0 = comp.K;
    S.cache2 = comp.cache, S.c2_s0 = comp.page_stride, S.c2_s1 = P.c_s1;
    S.page_size2 = comp.page_size, S.num_pages2 = comp.num_pages;
    S.bt2 = table[1].data(), S.bt2_s0 = static_cast<int64_t>(table[1].size()), S.bt2_rows = 1;
    S.bt2_width = comp.num_pages, S.len2 = len2;
  }
  if (!S.idx && !S.idx2) {  // nothing listed: o = 0, lse = the sink
    std::fill(out, out + T * H * kV4Width * (qdt == DType::kF32 ? 4 : 2), char(0));
    for (int64_t g = 0; g < T * H; ++g) lse[g] = sink ? sink[g % H] : -std::numeric_limits<float>::infinity();
    return {};
  }
  const Bounds b{T, 1, static_cast<int64_t>(table[0].size()), P.num_pages - 1};
  return keyset_attention(P, b, S, qdt, kV4, num_kv_splits, par, engine);
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

// one V4 cache argument of v4_slot_attention: uint8 [num_pages, page_bytes] (bytes contiguous
// within a page) and its slots [T, k] (int32 copied to int64)
static core::V4Slots v4_slots_arg(const char* name, const at::Tensor& cache, const at::Tensor& slots_in,
                                  int64_t page_size, int64_t T, at::Tensor& keep) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kByte && cache.dim() == 2 &&
                  (cache.stride(1) == 1 || cache.size(1) <= 1),
              name, " cache must be a CPU uint8 [num_pages, page_bytes] tensor with contiguous bytes, got ",
              cache.scalar_type(), " ", cache.sizes(), " strides ", cache.strides());
  TORCH_CHECK(slots_in.device().is_cpu() && slots_in.dim() == 2 && slots_in.size(0) == T &&
                  (slots_in.scalar_type() == at::kLong || slots_in.scalar_type() == at::kInt),
              name, " slots must be a CPU [T = ", T, ", k] int64 / int32 tensor, got ", slots_in.scalar_type(), " ",
              slots_in.sizes());
  keep = slots_in.scalar_type() == at::kLong && slots_in.stride(1) == 1 ? slots_in
                                                                       : slots_in.to(at::kLong).contiguous();
  core::V4Slots c;
  c.cache = static_cast<const char*>(cache.data_ptr());
  c.num_pages = cache.size(0), c.page_bytes = cache.size(1), c.page_stride = cache.stride(0);
  c.page_size = page_size;
  c.slots = keep.data_ptr<int64_t>(), c.K = keep.size(1), c.slots_s0 = keep.stride(0);
  return c;
}

void v4_slot_attention(const at::Tensor& q_in, const at::Tensor& window_cache, const at::Tensor& window_slots,
                       int64_t window_page_size, const c10::optional<at::Tensor>& compressed_cache,
                       const c10::optional<at::Tensor>& compressed_slots, int64_t compressed_page_size,
                       const c10::optional<at::Tensor>& sink_in, double softmax_scale, int64_t num_kv_splits,
                       int64_t engine, const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK(num_kv_splits >= 0, "num_kv_splits=", num_kv_splits, " must be >= 0 (0 = automatic)");
  const auto qdt = q_in.scalar_type();
  TORCH_CHECK(q_in.device().is_cpu() && q_in.dim() == 3 && q_in.size(2) == core::kV4Width &&
                  (qdt == at::kBFloat16 || qdt == at::kHalf || qdt == at::kFloat),
              "q must be a CPU [T, H, 512] bfloat16 / float16 / float32 tensor, got ", qdt, " ", q_in.sizes());
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(H >= 1, "q has ", H, " heads; at least 1 expected");
  TORCH_CHECK(softmax_scale > 0.0 && std::isfinite(softmax_scale), "softmax_scale ", softmax_scale,
              " must be a finite positive number");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == qdt && out.is_contiguous() &&
                  out.numel() == T * H * core::kV4Width && lse.device().is_cpu() && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.numel() == T * H,
              "out [T, H, 512] = [", T, ", ", H, ", 512] in q's dtype ", qdt, " and lse [T, H] float32, contiguous ",
              "CPU tensors, expected; got out ", out.scalar_type(), " ", out.sizes(), ", lse ", lse.scalar_type(), " ",
              lse.sizes());
  if (engine < 0) engine = core::kEngineDefault;
  TORCH_CHECK(engine <= (core::kEngineBf16 | core::kEngineAmx), "engine=", engine,
              " is not supported; use a bit set of 1 (AVX512-BF16 engine) and 2 (AMX: not used for V4 rows)");
#ifndef MLA_AVX512BF16
  TORCH_CHECK(!(engine & core::kEngineBf16), "engine=", engine,
              ": this level's build has no AVX512-BF16 engine (levels avx512_bf16 and amx do)");
#endif
  at::Tensor keep1, keep2, sink;
  const core::V4Slots win = v4_slots_arg("window", window_cache, window_slots, window_page_size, T, keep1);
  core::V4Slots comp;
  comp.page_size = compressed_page_size;
  if (compressed_slots.has_value() && compressed_slots->defined() && compressed_slots->size(-1) > 0) {
    TORCH_CHECK(compressed_cache.has_value() && compressed_cache->defined(),
                "compressed_slots need the compressed cache");
    comp = v4_slots_arg("compressed", *compressed_cache, *compressed_slots, compressed_page_size, T, keep2);
  }
  const float* sp = nullptr;
  if (sink_in.has_value() && sink_in->defined()) {
    sink = sink_in->contiguous();
    TORCH_CHECK(sink.device().is_cpu() && sink.scalar_type() == at::kFloat && sink.dim() == 1 && sink.size(0) == H,
                "sink must be a CPU [H] = [", H, "] float32 tensor, got ", sink.scalar_type(), " ", sink.sizes());
    sp = sink.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h)
      TORCH_CHECK(std::isfinite(sp[h]) || sp[h] == -std::numeric_limits<float>::infinity(), "sink[", h, "] = ",
                  sp[h], " is not supported: a finite logit or -inf (no sink)");
  }
  const int64_t qes = q.element_size();
  const std::string err = core::v4_slot_attention(
      static_cast<const char*>(q.data_ptr()), T, H, q.stride(0) * qes, q.stride(1) * qes, dtype_of(qdt), win, comp, sp,
      static_cast<float>(softmax_scale), num_kv_splits, static_cast<char*>(out.data_ptr()), lse.data_ptr<float>(),
      torch_parallel(), static_cast<int>(engine & core::kEngineBf16));
  TORCH_CHECK(err.empty(), err);  // a refused slot or page: nothing was read
}
#endif  // MLA_CORE_ONLY

}  // namespace mla_native
