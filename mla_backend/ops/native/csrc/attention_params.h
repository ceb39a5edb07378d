// attention_params.h: what every torch-free core of the absorbed attention shares: the call's
// parameters (Params, Bounds, Item, DType, the cache formats kPlain / kFp8 / kDs and their row
// layout DsLayout, the engine bits kEngine*), their check (validate), the threads callback
// (Parallel), the per-thread scratch and the kv-row addressing. Plain C++ over raw pointers,
// strides and sizes (vec.h, isa.h; no ATen / c10 includes).
//
// Shapes and dtypes (Params): q_lat [T, H, r] and q_pe [T, H, rope] of q's dtype (bf16 / fp16 /
// fp32, last dim contiguous, byte strides ql_s0/ql_s1, qp_s0/qp_s1); the cache: num_pages pages
// of page_size rows (byte strides c_s0 / c_s1), a row = [c_kv ; k_pe] in q's dtype (kPlain),
// e4m3 bytes with one per-tensor scale (kFp8), or fp8_ds_mla bytes (kDs: e4m3 c_kv tiles of 128,
// float32 tile scales at ds_scale_off, k_pe in q's dtype at ds_rope_off); block table bt
// [B, bt_s0] int32; cu [B + 1], kvl [B] int32; out [T, H, r] contiguous in q's dtype; lse [T, H]
// float32. Every index is checked before anything is read (validate(): page ids < num_pages,
// kv_len <= block-table width x page_size, cu_seqlens monotone ending at T, ...): a call with a
// bad index is refused with a message naming the value and its allowed range.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <type_traits>

#include "isa.h"
#include "vec.h"

namespace mla_native {
namespace core {

enum class DType { kBF16, kF16, kF32 };

// Threads: for_range(n, grain, fn) calls fn(begin, end) over a partition of [0, n), on up to
// `threads` threads (torch's at::parallel_for in the torch layer; a plain loop is fine).
struct Parallel {
  int64_t threads = 1;
  std::function<void(int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)> for_range =
      [](int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
        if (n > 0) fn(0, n);
      };
};

// Runs a call's n work items (sorted costliest first) on min(par.threads, n) threads, each
// pulling the next item index from one shared counter: body(pull) runs once per thread (its
// engine and scratch are its locals) and calls pull() until it returns -1.
template <class Body>
inline void run_pulled(int64_t n, const Parallel& par, Body&& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto pull = [&]() -> int64_t {
    const int64_t k = next.fetch_add(1);
    return k < n ? k : -1;
  };
  auto thread = [&](int64_t, int64_t) { body(pull); };
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, par.threads), n);
  if (threads <= 1) thread(0, 1);
  else par.for_range(threads, 1, thread);
}

constexpr int kTileN = 64;    // kv tokens per tile
constexpr int kMaxRows = 32;  // query rows per work item
constexpr int kDsTile = 128;  // fp8_ds_mla: c_kv values per float32 scale (CacheLayout.FP8_TILE)

// cache formats
constexpr int kPlain = 0;  // q's dtype
constexpr int kFp8 = 1;    // float8_e4m3fn, one per-tensor scale
constexpr int kDs = 2;     // fp8_ds_mla uint8 rows: e4m3 c_kv tiles, float32 tile scales, k_pe
// DeepSeek-V4's fp8 rows (key-set attention only, keyset_attention.cpp: decoded a tile at a time
// into q's dtype, then the kPlain engines): r = 512 (the whole row: value = key), rope = 0
constexpr int kV4 = 3;

// Engines (absorbed_attention's `engine`, a bit set; the torch op passes the one the Python
// rule picks, mla_backend/ops/native/engine.py):
//   0                 F32Engine for every item;
//   kEngineBf16       bf16 q: Bf16Engine (AVX512-BF16 builds) instead of F32Engine;
//   kEngineAmx        bf16 q, bf16 or fp8 cache: AmxEngine (level amx, OS permission granted)
//                     for requests with >= kAmxMinRows query rows, the others as above.
constexpr int kEngineBf16 = 1;
constexpr int kEngineAmx = 2;
// a core caller that names none (the core harness) gets every engine the build has
#if defined(MLA_HAS_AMX)
constexpr int kEngineDefault = kEngineBf16 | kEngineAmx;
#elif defined(MLA_AVX512BF16)
constexpr int kEngineDefault = kEngineBf16;
#else
constexpr int kEngineDefault = 0;
#endif

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Thread-local growable aligned scratch (no page faults after the first call).
struct Buf {
  void* p = nullptr;
  size_t n = 0;
  template <typename T>
  T* get(size_t count) {
    size_t bytes = round_up(static_cast<int64_t>(count * sizeof(T)), 64) + 64;
    if (bytes > n) {
      std::free(p);
      p = std::aligned_alloc(64, bytes);
      if (p == nullptr) throw std::bad_alloc();
      n = bytes;
    }
    return static_cast<T*>(p);
  }
  ~Buf() { std::free(p); }
};

struct Scratch {
  Buf q, k, v, o, s, pb, zero, misc, ml;
};
inline thread_local Scratch tl_scratch;

// ---- problem description ----------------------------------------------------------------
struct Params {
  int64_t H, r, rope, D, B, page_size, num_pages;
  const int32_t* bt;
  int64_t bt_s0;
  const int32_t* cu;
  const int32_t* kvl;
  const char* qlat;
  int64_t ql_s0, ql_s1;
  const char* qpe;
  int64_t qp_s0, qp_s1;
  const char* cache;
  int64_t c_s0, c_s1;  // page / row strides in bytes
  int64_t row_bytes;   // bytes of one cached row
  float score_scale;   // softmax_scale * kv_scale
  float out_scale;     // kv_scale (fp8_ds_mla: 1, its scales are applied per tile)
  // fp8_ds_mla rows (mla_backend.cache_layout): bytes [0, r) e4m3, [ds_scale_off, +4 * tiles)
  // float32 tile scales, [ds_rope_off, ...) k_pe in q's dtype
  int64_t tiles = 0, ds_scale_off = 0, ds_rope_off = 0;
  char* out;           // [T, H, r] contiguous, q dtype
  float* lse;          // [T, H]
  float* part_o;       // [.., r] normalised partial outputs of split requests
  float* part_lse;
  // optional per-head attention sink [H] float32 (finite or -inf; null: none), see apply_sink
  const float* sink = nullptr;
};

struct Item {
  int32_t req, row0, nrows, split, nsplit, kv0, kv1;
  int64_t part_off;  // first partial row of the request
  int64_t cost;
};

// The kv-split fields of a work item (an Item, or the indexer's IdxItem): request (or token)
// req, split s of ns, its keys [s * len, min(L, (s + 1) * len)) and the first partial row of its
// request, part_off.
template <class WorkItem>
inline void set_split(WorkItem& it, int64_t req, int64_t s, int64_t ns, int64_t len, int64_t L,
                      int64_t part_off) {
  using Kv = decltype(it.kv0);
  it.req = static_cast<int32_t>(req);
  it.split = static_cast<int32_t>(s);
  it.nsplit = static_cast<int32_t>(ns);
  it.kv0 = static_cast<Kv>(s * len);
  it.kv1 = static_cast<Kv>(std::min(L, (s + 1) * len));
  it.part_off = part_off;
}

// ---- the call's indices, checked before anything is read -----------------------------------
// Bounds: what P's arrays are checked against. T query tokens; the block table has bt_rows rows
// of bt_width page ids (row stride P.bt_s0 >= bt_width); max_page_id >= 0 is the caller's
// bound on every used page id (a plan's, page ids >= 0 checked there: O(1) here), -1 = unknown
// (every used block-table entry is checked).
struct Bounds {
  int64_t T = 0, bt_rows = 0, bt_width = 0, max_page_id = -1;
};

namespace detail {
inline std::string cat() { return {}; }
template <typename A, typename... Rest>
std::string cat(const A& a, const Rest&... rest) {
  if constexpr (std::is_arithmetic_v<A>) return std::to_string(a) + cat(rest...);
  else return std::string(a) + cat(rest...);
}
}  // namespace detail

// "" when P's sizes and indices are consistent, else why not (the value and its allowed range).
// Checks H, r >= 1, rope >= 0, page_size >= 1; the block table's shape; cu_seqlens_q [B + 1]
// starting at 0, non-decreasing, ending at T; kv_lens[i] >= the request's new tokens; for a
// request with new tokens kv_lens[i] <= bt_width x page_size and its used page ids in
// [0, num_pages) (or max_page_id < num_pages).
inline std::string validate(const Params& P, const Bounds& b) {
  using detail::cat;
  if (P.H < 1) return cat("num heads H=", P.H, " must be >= 1");
  if (P.r < 1) return cat("kv_lora_rank r=", P.r, " must be >= 1");
  if (P.rope < 0) return cat("rope dim ", P.rope, " must be >= 0");
  if (P.page_size < 1) return cat("page_size ", P.page_size, " must be >= 1");
  if (P.B < 0 || b.T < 0 || P.num_pages < 0)
    return cat("B = ", P.B, ", T = ", b.T, ", num_pages = ", P.num_pages, " must be >= 0");
  if (b.bt_rows < P.B) return cat("block_table has ", b.bt_rows, " rows for ", P.B, " requests");
  if (b.bt_width < 0 || P.bt_s0 < b.bt_width)
    return cat("block_table row stride ", P.bt_s0, " is smaller than its width ", b.bt_width);
  const int32_t* cu = P.cu;
  if (P.B > 0 && cu[0] != 0) return cat("cu_seqlens_q[0] = ", cu[0], " must be 0");
  for (int64_t i = 0; i < P.B; ++i) {
    const int64_t n = static_cast<int64_t>(cu[i + 1]) - cu[i], L = P.kvl[i];
    if (n < 0)
      return cat("cu_seqlens_q must be non-decreasing: request ", i, " has ", n, " new tokens");
    if (L < n)
      return cat("kv_lens[", i, "] = ", L, " is smaller than its ", n,
                 " new tokens (kv_len counts prefix + new)");
    if (n == 0) continue;  // nothing of it is read
    if (L > b.bt_width * P.page_size)
      return cat("kv_lens[", i, "] = ", L, " needs more than the ", b.bt_width, " pages x ",
                 P.page_size, " tokens of its block_table row");
    if (b.max_page_id >= 0) continue;  // the caller's bound, checked once below
    for (int64_t p = 0; p < ceil_div(L, P.page_size); ++p) {
      const int64_t page = P.bt[i * P.bt_s0 + p];
      if (page < 0 || page >= P.num_pages)
        return cat("block_table[", i, ", ", p, "] = ", page, " is not a page of the cache (0 .. ",
                   P.num_pages - 1, ")");
    }
  }
  if (b.max_page_id >= P.num_pages)
    return cat("block_table holds page id ", b.max_page_id, " (max_page_id) but the cache has ",
               P.num_pages, " pages (0 .. ", P.num_pages - 1, ")");
  const int64_t last = P.B > 0 ? cu[P.B] : 0;
  if (last != b.T)
    return cat("cu_seqlens_q[-1] = ", last, " must equal the number of query tokens T = ", b.T);
  return {};
}

// The attention sink of head h (P.sink; nothing without one): a logit in the softmax's
// denominator only, i.e. one more key of value 0. Given a row's key-only lse and its output
// factor inv, scales inv by 1 / (1 + exp(sink - lse)) and sets lse = log(exp(lse) + exp(sink)):
// the returned lse includes the sink (sink = -inf: no change; no key: inv = 0, lse = sink).
inline void apply_sink(const Params& P, int64_t h, float& inv, float& lse) {
  if (P.sink == nullptr) return;
  const float s = P.sink[h];
  if (s == -std::numeric_limits<float>::infinity()) return;
  if (lse == -std::numeric_limits<float>::infinity()) {
    inv = 0.0f;
    lse = s;
    return;
  }
  const float m = std::max(lse, s);
  const float tot = m + std::log(std::exp(lse - m) + std::exp(s - m));
  inv *= std::exp(lse - tot);
  lse = tot;
}

// Byte offset of kv position `pos` of request `i` in the cache.
inline int64_t row_offset(const Params& P, int64_t i, int64_t pos) {
  int64_t page = P.bt[i * P.bt_s0 + pos / P.page_size];
  return page * P.c_s0 + (pos % P.page_size) * P.c_s1;
}

inline void prefetch_row(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) vec::prefetch_l2(p + b);
}

// fp8_ds_mla row of r c_kv values and rope k_pe values of `es` bytes each (mla_backend.cache_layout:
// scales at r rounded up to 4, then 4 bytes per tile, then k_pe).
struct DsLayout {
  int64_t tiles, scale_off, rope_off, width;
  DsLayout(int64_t r, int64_t rope, int64_t es)
      : tiles(ceil_div(r, kDsTile)),
        scale_off(round_up(r, 4)),
        rope_off(round_up(r, 4) + 4 * ceil_div(r, kDsTile)),
        width(round_up(r, 4) + 4 * ceil_div(r, kDsTile) + rope * es) {}
};

}  // namespace core
}  // namespace mla_native
