// Torch-free cores of the native MLA CPU kernels: absorbed attention (decode / extend /
// speculative verify over a paged latent cache, every cache layout) and the cache-row writers.
// Plain C++ over raw pointers, strides and sizes (vec.h, mla_cpu.h; no ATen / c10 includes);
// threading through a callback (Parallel). mla_cpu.cpp checks the tensors, fills Params and
// registers the torch.library ops; a core can be built and tested outside torch.
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
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mla_cpu.h"
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


constexpr int kTileN = 64;    // kv tokens per tile
constexpr int kMaxRows = 32;  // query rows per work item
constexpr int kDsTile = 128;  // fp8_ds_mla: c_kv values per float32 scale (CacheLayout.FP8_TILE)

// cache formats
constexpr int kPlain = 0;  // q's dtype
constexpr int kFp8 = 1;    // float8_e4m3fn, one per-tensor scale
constexpr int kDs = 2;     // fp8_ds_mla uint8 rows: e4m3 c_kv tiles, float32 tile scales, k_pe

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
};

struct Item {
  int32_t req, row0, nrows, split, nsplit, kv0, kv1;
  int64_t part_off;  // first partial row of the request
  int64_t cost;
};

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

// Byte offset of kv position `pos` of request `i` in the cache.
inline int64_t row_offset(const Params& P, int64_t i, int64_t pos) {
  int64_t page = P.bt[i * P.bt_s0 + pos / P.page_size];
  return page * P.c_s0 + (pos % P.page_size) * P.c_s1;
}

inline void prefetch_row(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) vec::prefetch_l2(p + b);
}

// ---- fp32 <-> storage dtype rows, through the vector layer --------------------------------
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

// ---- softmax over one score tile (the fp32 engine's) --------------------------------------
// S [rows][kTileN] raw dot products -> probabilities (fp32, unnormalised, 0 where masked).
inline void softmax_tile(float* S, int rows, int nt, int ntp, const int64_t* lim, int64_t t0,
                         float sc, float* mrow, float* lrow, float* alpha) {
  const VecF vsc = VecF::set1(sc);
  for (int m = 0; m < rows; ++m) {
    float* row = S + static_cast<int64_t>(m) * kTileN;
    const int vc = static_cast<int>(std::min<int64_t>(std::max<int64_t>(lim[m] - t0, 0), nt));
    if (vc == 0) {
      std::fill(row, row + ntp, 0.0f);
      alpha[m] = 1.0f;
      continue;
    }
    VecF vmx = VecF::set1(kNegInf);
    for (int c = 0; c < vc; c += kW) {
      const int k = std::min(kW, vc - c);
      // the row is kTileN long: whole vectors are readable (lanes past vc are masked)
      vmx = vec::max(vmx, vec::select_first(VecF::load(row + c) * vsc, k, kNegInf));
    }
    const float mx = vec::hmax(vmx);
    const float mnew = std::max(mrow[m], mx);
    const float a = (mrow[m] == kNegInf) ? 0.0f : std::exp(mrow[m] - mnew);
    const VecF vm = VecF::set1(mnew);
    VecF vs = VecF::zero();
    for (int c = 0; c < ntp; c += kW) {
      const VecF p = vec::keep_first(vec::exp(vec::fma(VecF::load(row + c), vsc, VecF::zero() - vm)), vc - c);
      vs = vs + p;
      p.store(row + c);
    }
    lrow[m] = lrow[m] * a + vec::hsum(vs);
    mrow[m] = mnew;
    alpha[m] = a;
  }
}

// Blocking of n items into blocks of at most b (b <= 4): full blocks up to tail_start(n, b),
// then tail blocks of tail_width(left, b) each. A remainder of 1 after a full block is taken
// as two narrower blocks (b + 1 = 2 + 2 or 3 + 2): a one-wide block has too few independent
// FMA chains.
inline int tail_start(int n, int b) {
  const int full = n / b * b;
  return (n - full == 1 && full >= b) ? full - b : full;
}
inline int tail_width(int left, int b) { return left > b ? (left + 1) / 2 : left; }

// ---- fp32 engine (any dtype and level; over the vector layer) ----------------------------
// kMode: kPlain (cache of CT = q's dtype), kFp8 (e4m3 rows, per-tensor scale folded into
// score_scale / out_scale) or kDs (fp8_ds_mla rows: each tile times its own scale, k_pe as QT).
// The tile is widened to fp32 in an L1 scratch whose rows are zero padded to Dk (a multiple
// of the P.V column block), q rows likewise: the hot loops read whole vectors only.
template <typename QT, typename CT, int kMode>
struct F32Engine {
  // Register blocking: scores NQ query rows x NK kv rows of W-lane accumulators; P.V MR rows x
  // NC vectors (kCB = NC x W output columns per block). 32 registers (avx512 W = 16; aarch64
  // neon / neon_bf16 W = 4, sve W = VL / 32): 4 x 4 and 6 x 4 (neon: 16 P.V columns per block,
  // sve at VL 256: 32); 16 registers (avx2 W = 8, scalar): 4 x 3 and 4 x 3.
#if defined(MLA_HAS_AVX512) || defined(MLA_HAS_NEON)
  static constexpr int NQ = 4, NK = 4, MR = 6, NC = 4;  // 32 zmm / v / z registers
#else
  static constexpr int NQ = 4, NK = 3, MR = 4, NC = 3;  // 16 ymm registers
#endif
  static constexpr int kCB = NC * kW;  // P.V output columns per block
  const Params& P;
  int64_t D, r, Dk, rp;
  float* Q;     // [kMaxRows][Dk]
  float* K;     // [kTileN + NK][Dk] this tile's rows
  float* Kn;    // [kTileN + NK][Dk] the next tile's rows, widened while this one computes
  float* O;     // [kMaxRows][rp]
  float* zrow;  // [Dk] zeros
  // The next tile (run_item's offsets, valid until the next load_tile): its rows are
  // prefetched into L2 a row or so per score block while this tile computes (a burst of a
  // whole tile's prefetches stalls on the fill buffers). With AVX-512 (kPipelined) a cursor
  // kAhead rows behind the prefetches also widens them into Kn, so the widening overlaps this
  // tile's FMAs instead of being a pass of its own (load_tile then swaps the buffers); with
  // AVX2 that costs more than the pass (measured: its shifts share the FMA ports).
#if defined(MLA_HAS_AVX512)
  static constexpr bool kPipelined = true;
#else
  static constexpr bool kPipelined = false;
#endif
  static constexpr int kAhead = 4;
  const int64_t* nx_offs = nullptr;
  int nx_n = 0, nx_pf = 0, nx_done = 0, nx_step = 0;

  explicit F32Engine(const Params& p) : P(p), D(p.D), r(p.r) {
    rp = round_up(r, kW);
    Dk = round_up(D, kW);
    const int64_t tile = (kTileN + NK) * Dk;
    Q = tl_scratch.q.get<float>(kMaxRows * Dk);
    K = tl_scratch.k.get<float>(2 * tile + Dk);
    Kn = K + tile;
    O = tl_scratch.o.get<float>(kMaxRows * rp);
    zrow = K + 2 * tile;
    std::fill(zrow, zrow + Dk, 0.0f);
    for (int c = 0; c < 2 * (kTileN + NK); ++c) std::fill(K + c * Dk + D, K + (c + 1) * Dk, 0.0f);
  }
  int pad_rows(int rows) { return rows; }

  // run_item hands over the next tile's row offsets (n = 0: no next tile in this item)
  void defer_prefetch(const int64_t* offs, int n) {
    nx_offs = offs;
    nx_n = n;
    nx_pf = 0;
    nx_done = 0;
    prefetch_next(std::min(n, kAhead));
  }
  inline void prefetch_next(int upto) {
    for (; nx_pf < upto; ++nx_pf) prefetch_row(P.cache + nx_offs[nx_pf], P.row_bytes);
  }
  // rows of the next tile still to handle (to widen, or to prefetch)
  int next_left() const { return nx_n - (kPipelined ? nx_done : nx_pf); }
  // up to `k` more rows of the next tile: widened (prefetching kAhead rows ahead), or
  // prefetched
  inline void advance_next(int k) {
    if constexpr (kPipelined) {
      const int end = std::min(nx_n, nx_done + k);
      prefetch_next(std::min(nx_n, end + kAhead));
      for (; nx_done < end; ++nx_done)
        widen_cache_row(Kn + static_cast<int64_t>(nx_done) * Dk, nx_offs[nx_done]);
    } else {
      prefetch_next(std::min(nx_n, nx_pf + k));
    }
  }
  void load_q(int m, const char* ql, const char* qp) {
    float* dst = Q + m * Dk;
    widen_row(dst, reinterpret_cast<const QT*>(ql), r);
    widen_row(dst + r, reinterpret_cast<const QT*>(qp), P.rope);
    std::fill(dst + D, dst + Dk, 0.0f);
  }
  void zero_q(int m) { std::fill(Q + m * Dk, Q + (m + 1) * Dk, 0.0f); }
  void start_item(int rows) { std::fill(O, O + rows * rp, 0.0f); }
  const float* orow(int m) const { return O + m * rp; }

  void compute_tile(int rows, int nt, int64_t t0, const int64_t* lim, float sc, float* mrow,
                    float* lrow) {
    float* S = tl_scratch.s.get<float>(kMaxRows * kTileN + kMaxRows);
    float* alpha = S + kMaxRows * kTileN;
    scores(rows, nt, S);
    softmax_tile(S, rows, nt, static_cast<int>(round_up(nt, kW)), lim, t0, sc, mrow, lrow, alpha);
    pv(rows, nt, S, alpha);
  }

  // dst[0, D) = the cached row at byte offset off, in fp32
  void widen_cache_row(float* dst, int64_t off) {
    const char* src = P.cache + off;
    if constexpr (kMode == kFp8) {
      widen_e4m3_row(dst, reinterpret_cast<const uint8_t*>(src), D, kFp8Unscale);
    } else if constexpr (kMode == kDs) {  // value * tile scale: fp32's rounding of v * s
      const uint8_t* s8 = reinterpret_cast<const uint8_t*>(src);
      for (int64_t t = 0; t < P.tiles; ++t) {
        float st;
        std::memcpy(&st, src + P.ds_scale_off + 4 * t, 4);
        const int64_t d0 = t * kDsTile, d1 = std::min<int64_t>(r, d0 + kDsTile);
        // (v / 256) * (256 s) is the same real number as v * s, so the same fp32 rounding
        widen_e4m3_row(dst + d0, s8 + d0, d1 - d0, st * kFp8Unscale);
      }
      widen_row(dst + r, reinterpret_cast<const QT*>(src + P.ds_rope_off), P.rope);
    } else {
      widen_row(dst, reinterpret_cast<const CT*>(src), D);
    }
  }

  void load_tile(const int64_t* offs, int nt) {
    if (kPipelined && nx_offs == offs && nx_n == nt && nx_done == nt && nt > 0) {  // widened ahead
      std::swap(K, Kn);
      nx_n = nx_done = 0;
      return;
    }
    nx_n = nx_done = 0;
    for (int c = 0; c < nt; ++c) widen_cache_row(K + static_cast<int64_t>(c) * Dk, offs[c]);
  }

  // NQ query rows x NKa kv rows: fp32 FMAs over the (padded) rows, one reduction per score.
  template <int NKa>
  inline void score_block(int m0, int c0, int rows, float* S) {
    alignas(64) float tmp[NQ * NK + kW];
    const float* q[NQ];
    for (int i = 0; i < NQ; ++i) q[i] = m0 + i < rows ? Q + (m0 + i) * Dk : zrow;
    const float* k[NKa];
    for (int j = 0; j < NKa; ++j) k[j] = K + static_cast<int64_t>(c0 + j) * Dk;
    VecF acc[NQ * NKa];
    for (int x = 0; x < NQ * NKa; ++x) acc[x] = VecF::zero();
    for (int64_t d = 0; d < Dk; d += kW) {
      VecF kv[NKa];
      for (int j = 0; j < NKa; ++j) kv[j] = VecF::load(k[j] + d);
      for (int i = 0; i < NQ; ++i) {
        const VecF qv = VecF::load(q[i] + d);
        for (int j = 0; j < NKa; ++j) acc[i * NKa + j] = vec::fma(qv, kv[j], acc[i * NKa + j]);
      }
    }
    advance_next(nx_step);
    vec::hsum_many<NQ * NKa>(acc, tmp);
    for (int i = 0; i < NQ && m0 + i < rows; ++i)
      for (int j = 0; j < NKa; ++j) S[(m0 + i) * kTileN + c0 + j] = tmp[i * NKa + j];
  }

  // S [rows][kTileN] = Q . K^T over the tile's nt rows (kv blocks of NK, the last one exact)
  void scores(int rows, int nt, float* S) {
    const int64_t nblocks = ceil_div(rows, NQ) * ceil_div(nt, NK);
    nx_step = static_cast<int>(ceil_div(next_left(), nblocks));
    const int nfull = tail_start(nt, NK);
    for (int m0 = 0; m0 < rows; m0 += NQ) {
      for (int c0 = 0; c0 < nfull; c0 += NK) score_block<NK>(m0, c0, rows, S);
      for (int c0 = nfull; c0 < nt;) {
        const int w = tail_width(nt - c0, NK);
        switch (w) {
          case 3: score_block<3>(m0, c0, rows, S); break;
          case 2: score_block<2>(m0, c0, rows, S); break;
          default: score_block<1>(m0, c0, rows, S); break;
        }
        c0 += w;
      }
    }
    advance_next(nx_n);  // the rest, if any
  }

  // rows m0 .. m0 + M of O [.., c0 .. c0 + NCa * kW) = alpha * O + P . V
  template <int M, int NCa>
  void pv_kernel(int m0, int64_t c0, int nt, const float* Pm, const float* alpha) {
    VecF acc[M][NCa];
    for (int i = 0; i < M; ++i) {
      const VecF a = VecF::set1(alpha[m0 + i]);
      for (int j = 0; j < NCa; ++j) acc[i][j] = VecF::load(O + (m0 + i) * rp + c0 + kW * j) * a;
    }
    for (int n = 0; n < nt; ++n) {
      const float* v = K + static_cast<int64_t>(n) * Dk + c0;
      VecF vv[NCa];
      for (int j = 0; j < NCa; ++j) vv[j] = VecF::load(v + kW * j);
      for (int i = 0; i < M; ++i) {
        const VecF p = VecF::set1(Pm[(m0 + i) * kTileN + n]);
        for (int j = 0; j < NCa; ++j) acc[i][j] = vec::fma(p, vv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NCa; ++j) acc[i][j].store(O + (m0 + i) * rp + c0 + kW * j);
  }

  template <int NCa>
  void pv_cols(int rows, int64_t c0, int nt, const float* Pm, const float* alpha) {
    int m0 = 0;
    for (; m0 + MR <= rows; m0 += MR) pv_kernel<MR, NCa>(m0, c0, nt, Pm, alpha);
    switch (rows - m0) {
      case 5: pv_kernel<5, NCa>(m0, c0, nt, Pm, alpha); break;
      case 4: pv_kernel<4, NCa>(m0, c0, nt, Pm, alpha); break;
      case 3: pv_kernel<3, NCa>(m0, c0, nt, Pm, alpha); break;
      case 2: pv_kernel<2, NCa>(m0, c0, nt, Pm, alpha); break;
      case 1: pv_kernel<1, NCa>(m0, c0, nt, Pm, alpha); break;
      default: break;
    }
  }

  // O = alpha * O + P . V over rp columns: blocks of NC vectors, the last one exact
  void pv(int rows, int nt, const float* Pm, const float* alpha) {
    const int nv = static_cast<int>(rp / kW), nfull = tail_start(nv, NC);
    for (int v0 = 0; v0 < nfull; v0 += NC) pv_cols<NC>(rows, int64_t{v0} * kW, nt, Pm, alpha);
    for (int v0 = nfull; v0 < nv;) {
      const int w = tail_width(nv - v0, NC);
      switch (w) {
        case 3: pv_cols<3>(rows, int64_t{v0} * kW, nt, Pm, alpha); break;
        case 2: pv_cols<2>(rows, int64_t{v0} * kW, nt, Pm, alpha); break;
        default: pv_cols<1>(rows, int64_t{v0} * kW, nt, Pm, alpha); break;
      }
      v0 += w;
    }
  }
};
#ifdef MLA_AVX512BF16
// ---- AVX512-BF16 engine (q bf16; cache bf16, fp8 or fp8_ds_mla) -------------------------
// Query rows live in SIMD lanes (16 rows per vector, one or two vectors per item): q is
// packed once per item as bf16 pairs [D/2][rows] and each kv row's bf16 pair is broadcast,
// so the scores come out as [kv][rows] with no horizontal reduction, the online softmax is
// vertical (one max / exp / sum per kv row for 16 query rows), and the probabilities are
// interleaved pairwise per row for P.V against the VNNI-packed tile.
//
// fp8 rows are decoded to their exact bf16 values (Fp8Bf16Table: byte shuffles only, so the
// FP pipes stay with vdpbf16ps). fp8_ds_mla rows likewise, with the scales applied in registers:
// the scores sum, per kv row, scale_t * (q_tile . fp8_tile) over the 128-value tiles plus
// q_pe . k_pe (k_pe copied as stored); for P.V each probability is multiplied by its kv row's
// tile scale before the bf16 rounding, one probability array per tile (a 64-column block of
// the output lies in one tile). For fp8_ds_mla an odd r is padded to r2 = r + 1 with a zero
// in both q and the decoded row, so that no bf16 pair mixes c_kv (scaled) with k_pe.
// V tile -> VNNI pairs: Vp[(k * rp + c) * 2 + e] = rows[2k + e][c] for c < r (bf16), zeros
// for c in [r, rp) and for the odd row past nt; k < ceil(nt / 2). rp: a multiple of 16.
inline void pack_v_pairs(const uint16_t* const* rows, int nt, const uint16_t* zero, int64_t r,
                         int64_t rp, uint16_t* Vp) {
  const int npairs = (nt + 1) / 2;
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5,
                                                  37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i vlo = _mm512_load_si512(lo_idx), vhi = _mm512_load_si512(hi_idx);
  for (int k = 0; k < npairs; ++k) {
    const uint16_t* a = rows[2 * k];
    const uint16_t* b = (2 * k + 1 < nt) ? rows[2 * k + 1] : zero;
    uint16_t* dst = Vp + static_cast<int64_t>(k) * 2 * rp;
    for (int64_t c = 0; c < rp; c += 32) {
      int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(32, r - c));
      __mmask32 msk = cnt >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << cnt) - 1);
      __m512i va = _mm512_maskz_loadu_epi16(msk, a + c);
      __m512i vb = _mm512_maskz_loadu_epi16(msk, b + c);
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(va, vlo, vb));
      if (c + 16 < rp) _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(va, vhi, vb));
    }
  }
}

// The online-softmax bookkeeping of 16 query rows held in lanes (the engines whose scores come
// out as S^T [kv][R]): St points at the rows' column in S^T (row stride R floats), lim at their
// causal limits. The constructor finds the valid kv count per row in the tile (vlim), the new
// running max (mnew) and the rescale factor alpha = exp(m_old - m_new) (1 for rows without a
// valid column: their m / l do not change); finish() stores l = l alpha + sum, m and alpha.
struct ColSoftmax {
  __m512i vlim;
  __m512 mold, mnew, a;
  __mmask16 any;
  ColSoftmax(const float* St, int64_t R, int nt, const int64_t* lim, int64_t t0, __m512 vsc,
             const float* mrow) {
    alignas(64) int32_t limv[16];
    for (int m = 0; m < 16; ++m)
      limv[m] = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(lim[m] - t0, 0), nt));
    vlim = _mm512_load_si512(limv);
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int n = 0; n < nt; ++n) {
      const __mmask16 valid = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(n));
      mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_mul_ps(_mm512_loadu_ps(St + n * R), vsc));
    }
    mold = _mm512_loadu_ps(mrow);
    mnew = _mm512_max_ps(mold, mx);
    any = _mm512_cmpgt_epi32_mask(vlim, _mm512_setzero_si512());
    a = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), any, exp512(_mm512_sub_ps(mold, mnew)));
  }
  void finish(__m512 sum, float* mrow, float* lrow, float* alpha) const {
    _mm512_storeu_ps(lrow, _mm512_fmadd_ps(_mm512_loadu_ps(lrow), a, sum));
    _mm512_storeu_ps(mrow, _mm512_mask_mov_ps(mold, any, mnew));
    _mm512_storeu_ps(alpha, a);
  }
};

template <int kMode>
struct Bf16Engine {
  static constexpr bool kDecode = kMode != kPlain;  // rows go through the Kd scratch tile
  const Params& P;
  int64_t D, r, r2, Dq, D2, Dp, rp, tiles;
  int MV = 1;      // row vectors (16 rows each) of the current item
  uint16_t* Q;     // [kMaxRows][Dp] rows as loaded (zero padded)
  uint32_t* Qp;    // [Dp / 2][kMaxRows] bf16 pairs, rows in lanes
  uint16_t* Kd;    // [kTileN][Dp] decoded fp8 tile
  float* scl;      // fp8_ds_mla: [kTileN + 8][tiles] tile scale per kv row (0: padding)
  uint16_t* Vp;    // [kTileN / 2][2 * rp] VNNI-packed V
  uint32_t* PP;    // [tiles][kTileN / 2][kMaxRows] bf16 probability pairs per row
  float* St;       // [kTileN][kMaxRows] scores, rows in lanes
  uint16_t* zero;  // one zero row of Dp
  float* O;        // [kMaxRows][rp]
  float* alpha;    // [kMaxRows]
  const uint16_t* rows[kTileN + 16];

  explicit Bf16Engine(const Params& p) : P(p), D(p.D), r(p.r) {
    static_assert(kMaxRows == 32, "two row vectors");
    r2 = kMode == kDs ? round_up(r, 2) : r;
    Dq = r2 + p.rope;
    D2 = (Dq + 1) / 2;
    Dp = round_up(Dq, kDecode ? 64 : 32);  // the decode writes whole 64-value blocks
    rp = round_up(r, 16);
    tiles = kMode == kDs ? p.tiles : 1;
    Q = tl_scratch.q.get<uint16_t>(kMaxRows * Dp + (Dp / 2) * kMaxRows * 2);
    Qp = reinterpret_cast<uint32_t*>(Q + kMaxRows * Dp);
    Kd = kDecode ? tl_scratch.k.get<uint16_t>(kTileN * Dp) : nullptr;
    Vp = tl_scratch.v.get<uint16_t>(kTileN * rp);
    PP = tl_scratch.pb.get<uint32_t>(tiles * (kTileN / 2) * kMaxRows);
    St = tl_scratch.s.get<float>(kTileN * kMaxRows + kMaxRows + (kTileN + 8) * tiles);
    alpha = St + kTileN * kMaxRows;
    scl = alpha + kMaxRows;
    zero = tl_scratch.zero.get<uint16_t>(Dp);
    std::memset(zero, 0, Dp * sizeof(uint16_t));
    O = tl_scratch.o.get<float>(kMaxRows * rp);
  }
  int pad_rows(int rows) {
    MV = rows > 16 ? 2 : 1;
    return 16 * MV;
  }
  const float* orow(int m) const { return O + m * rp; }

  void load_q(int m, const char* ql, const char* qp) {
    uint16_t* dst = Q + m * Dp;
    std::memcpy(dst, ql, r * 2);
    if (r2 > r) dst[r] = 0;
    if (P.rope) std::memcpy(dst + r2, qp, P.rope * 2);
    std::memset(dst + Dq, 0, (Dp - Dq) * 2);
  }
  void zero_q(int m) { std::memset(Q + m * Dp, 0, Dp * 2); }
  void start_item(int rows_pad) {
    std::fill(O, O + rows_pad * rp, 0.0f);
    const int R = 16 * MV;
    for (int64_t d2 = 0; d2 < D2; ++d2)
      for (int m = 0; m < R; ++m)
        Qp[d2 * R + m] = reinterpret_cast<const uint32_t*>(Q + m * Dp)[d2];
  }

  // fp8 bytes [0, n) of a row -> dst[0, round_up(n, 64)) exact bf16 (zeros past n)
  static inline void decode(uint16_t* dst, const uint8_t* s8, int64_t n) {
#ifdef MLA_FP8_TABLE
    static const Fp8Bf16Table tab;
    tab.decode(dst, s8, n);
#else
    for (int64_t d = 0; d < round_up(n, 64); d += 32) {
      const int64_t left = std::max<int64_t>(0, n - d);
      const __mmask32 msk = left >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << left) - 1);
      _mm512_storeu_si512(dst + d, fp8x32_to_bf16(s8 + d, msk));
    }
#endif
  }

  void load_tile(const int64_t* offs, int nt) {
    for (int c = 0; c < nt; ++c) {
      const char* src = P.cache + offs[c];
      if constexpr (kMode == kFp8) {
        uint16_t* dst = Kd + static_cast<int64_t>(c) * Dp;
        decode(dst, reinterpret_cast<const uint8_t*>(src), D);
        rows[c] = dst;
      } else if constexpr (kMode == kDs) {
        uint16_t* dst = Kd + static_cast<int64_t>(c) * Dp;
        decode(dst, reinterpret_cast<const uint8_t*>(src), r);  // zeros r .. round_up(r, 64)
        if (P.rope) std::memcpy(dst + r2, src + P.ds_rope_off, P.rope * 2);
        std::memset(dst + Dq, 0, (Dp - Dq) * 2);
        for (int64_t t = 0; t < tiles; ++t) {
          float st;
          std::memcpy(&st, src + P.ds_scale_off + 4 * t, 4);
          scl[c * tiles + t] = st;
        }
        rows[c] = dst;
      } else {
        rows[c] = reinterpret_cast<const uint16_t*>(src);
      }
    }
    for (int c = nt; c < round_up(nt, 8); ++c) {
      rows[c] = zero;
      if constexpr (kMode == kDs)
        for (int64_t t = 0; t < tiles; ++t) scl[c * tiles + t] = 0.0f;
    }
  }

  // kv pair d2 of row k, as a 32-bit broadcast (an odd D's last pair is zero-extended: the
  // element after the row may be anything, even NaN).
  inline __m512i kpair(const uint16_t* k, int64_t d2) const {
    int32_t v;
    if (2 * d2 + 1 < D) std::memcpy(&v, k + 2 * d2, 4);
    else v = k[2 * d2];
    return _mm512_set1_epi32(v);
  }

  template <int NR, int NV>
  static inline void dot_pairs(__m512 (&acc)[NR][NV], const uint32_t* Qp, const uint16_t* const* k,
                               int64_t p0, int64_t p1) {
    constexpr int R = 16 * NV;
    for (int64_t d2 = p0; d2 < p1; ++d2) {
      __m512i q[NV];
      for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_si512(Qp + d2 * R + 16 * v);
      for (int i = 0; i < NR; ++i) {
        int32_t kv;
        std::memcpy(&kv, k[i] + 2 * d2, 4);
        __m512bh kb = (__m512bh)_mm512_set1_epi32(kv);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], kb, (__m512bh)q[v]);
      }
    }
  }

  template <int NR, int NV>
  void scores_kernel(int n0) {
    constexpr int R = 16 * NV;
    __m512 acc[NR][NV];
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    const uint16_t* k[NR];
    for (int i = 0; i < NR; ++i) k[i] = rows[n0 + i];
    if constexpr (kMode == kDs) {
      // Kd rows and q rows are zero padded to Dp: every pair can be read whole
      for (int64_t t = 0; t < tiles; ++t) {
        __m512 acc_t[NR][NV];
        for (int i = 0; i < NR; ++i)
          for (int v = 0; v < NV; ++v) acc_t[i][v] = _mm512_setzero_ps();
        dot_pairs<NR, NV>(acc_t, Qp, k, t * (kDsTile / 2), std::min<int64_t>((t + 1) * (kDsTile / 2), r2 / 2));
        for (int i = 0; i < NR; ++i) {
          const __m512 s = _mm512_set1_ps(scl[(n0 + i) * tiles + t]);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(acc_t[i][v], s, acc[i][v]);
        }
      }
      dot_pairs<NR, NV>(acc, Qp, k, r2 / 2, D2);  // q_pe . k_pe
    } else {
      const int64_t D2f = D / 2;  // full pairs
      dot_pairs<NR, NV>(acc, Qp, k, 0, D2f);
      if (D2f < D2) {
        __m512i q[NV];
        for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_si512(Qp + D2f * R + 16 * v);
        for (int i = 0; i < NR; ++i) {
          __m512bh kb = (__m512bh)kpair(k[i], D2f);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], kb, (__m512bh)q[v]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(St + (n0 + i) * R + 16 * v, acc[i][v]);
  }

  void pack_v(int nt) { pack_v_pairs(rows, nt, zero, r, rp, Vp); }

  template <int MR, int NC>
  void pv_kernel(int m0, int64_t c0, int npairs, const uint32_t* PPt) {
    const int R = 16 * MV;
    __m512 acc[MR][NC];
    for (int i = 0; i < MR; ++i) {
      __m512 a = _mm512_set1_ps(alpha[m0 + i]);
      for (int j = 0; j < NC; ++j)
        acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(O + (m0 + i) * rp + c0 + 16 * j), a);
    }
    for (int k = 0; k < npairs; ++k) {
      const uint16_t* vk = Vp + static_cast<int64_t>(k) * 2 * rp + 2 * c0;
      __m512i vb[NC];
      for (int j = 0; j < NC; ++j) vb[j] = _mm512_loadu_si512(vk + 32 * j);
      const uint32_t* pk = PPt + k * R + m0;
      for (int i = 0; i < MR; ++i) {
        __m512bh pa = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pk[i]));
        for (int j = 0; j < NC; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pa, (__m512bh)vb[j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) _mm512_storeu_ps(O + (m0 + i) * rp + c0 + 16 * j, acc[i][j]);
  }

  template <int NC>
  void pv_cols(int rows, int64_t c0, int npairs, const uint32_t* PPt) {
    int m0 = 0;
    for (; m0 + 6 <= rows; m0 += 6) pv_kernel<6, NC>(m0, c0, npairs, PPt);
    switch (rows - m0) {
      case 5: pv_kernel<5, NC>(m0, c0, npairs, PPt); break;
      case 4: pv_kernel<4, NC>(m0, c0, npairs, PPt); break;
      case 3: pv_kernel<3, NC>(m0, c0, npairs, PPt); break;
      case 2: pv_kernel<2, NC>(m0, c0, npairs, PPt); break;
      case 1: pv_kernel<1, NC>(m0, c0, npairs, PPt); break;
      default: break;
    }
  }

  // scores -> online softmax (rows in lanes) -> P.V for one tile.
  void compute_tile(int rows, int nt, int64_t t0, const int64_t* lim, float sc, float* mrow,
                    float* lrow) {
    const int R = 16 * MV;
    const int ntp = static_cast<int>(round_up(nt, 8));
    for (int n0 = 0; n0 < ntp; n0 += 8) {
      if (MV == 1) scores_kernel<8, 1>(n0);
      else scores_kernel<4, 2>(n0), scores_kernel<4, 2>(n0 + 4);
    }
    const int npairs = (nt + 1) / 2;
    const __m512 vsc = _mm512_set1_ps(sc);
    alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                      21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                      11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pidx = _mm512_load_si512(pair_idx);
    for (int v = 0; v < MV; ++v) {
      const ColSoftmax cs(St + 16 * v, R, nt, lim + 16 * v, t0, vsc, mrow + 16 * v);
      const __m512i vlim = cs.vlim;
      const __m512 mnew = cs.mnew;
      __m512 sum = _mm512_setzero_ps();
      for (int k = 0; k < npairs; ++k) {
        __m512 p2[2];
        for (int e = 0; e < 2; ++e) {
          const int n = 2 * k + e;
          __mmask16 valid = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(n));
          p2[e] = _mm512_maskz_mov_ps(
              valid, exp512(_mm512_fmsub_ps(_mm512_load_ps(St + n * R + 16 * v), vsc, mnew)));
          sum = _mm512_add_ps(sum, p2[e]);
        }
        // [p(2k) rows 0..15 | p(2k+1) rows 0..15] -> per row (p(2k), p(2k+1)) bf16 pairs
        if constexpr (kMode == kDs) {  // one array per tile: p times the kv row's tile scale
          for (int64_t t = 0; t < tiles; ++t) {
            const __m512 s0 = _mm512_set1_ps(scl[(2 * k) * tiles + t]);
            const __m512 s1 = _mm512_set1_ps(scl[(2 * k + 1) * tiles + t]);
            __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(p2[1], s1), _mm512_mul_ps(p2[0], s0));
            _mm512_storeu_si512(PP + (t * (kTileN / 2) + k) * R + 16 * v, _mm512_permutexvar_epi16(pidx, h));
          }
        } else {
          __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p2[1], p2[0]);
          _mm512_storeu_si512(PP + k * R + 16 * v, _mm512_permutexvar_epi16(pidx, h));
        }
      }
      cs.finish(sum, mrow + 16 * v, lrow + 16 * v, alpha + 16 * v);
    }
    pack_v(nt);
    for (int64_t c0 = 0; c0 < rp; c0 += 64) {
      // a 64-column block lies in one 128-value tile (fp8_ds_mla)
      const uint32_t* PPt = kMode == kDs ? PP + (c0 / kDsTile) * (kTileN / 2) * R : PP;
      int nc = static_cast<int>(std::min<int64_t>(4, (rp - c0) / 16));
      switch (nc) {
        case 4: pv_cols<4>(rows, c0, npairs, PPt); break;
        case 3: pv_cols<3>(rows, c0, npairs, PPt); break;
        case 2: pv_cols<2>(rows, c0, npairs, PPt); break;
        default: pv_cols<1>(rows, c0, npairs, PPt); break;
      }
    }
  }
};
#endif  // MLA_AVX512BF16

}  // namespace core
}  // namespace mla_native
#include "amx_attention.h"  // AmxEngine (level amx): uses the definitions above
namespace mla_native {
namespace core {

// Whether the AMX engine can run here: compiled in (level amx) and tiles granted by the OS.
inline bool amx_available() {
#ifdef MLA_HAS_AMX
  return mla_amx::amx_request_permission();
#else
  return false;
#endif
}

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
      E.load_q(m, P.qlat + (t * P.ql_s0 + h * P.ql_s1), P.qpe + (t * P.qp_s0 + h * P.qp_s1));
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
  const int64_t r = P.r;
  for (int m = 0; m < rows; ++m) {
    const int64_t R = it.row0 + m;
    float inv = 0.0f, lse = kNegInf;
    if (lrow[m] > 0.0f) {
      inv = P.out_scale / lrow[m];
      lse = mrow[m] + std::log(lrow[m]);
    }
    const float* o = E.orow(m);
    if (it.nsplit == 1) {
      const int64_t g = P.cu[i] * H + R;  // flat [T*H] row
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
void run_items(const Params& P, const std::vector<Item>& items, const Parallel& par) {
  std::atomic<int64_t> next{0};
  const int64_t nitems = static_cast<int64_t>(items.size());
  if (nitems == 0) return;
  const int64_t nthreads = std::min<int64_t>(par.threads, nitems);
  auto worker = [&](int64_t, int64_t) {
    Engine E(P);
    constexpr int TN = EngineDims<Engine>::kTile, MR = EngineDims<Engine>::kRows;
    float* mrow = tl_scratch.ml.get<float>(2 * MR);
    float* lrow = mrow + MR;
    int64_t* scratch = tl_scratch.misc.get<int64_t>(TN + MR);
    int64_t* offs = scratch;
    int64_t* lim = scratch + TN;
    for (int64_t k; (k = next.fetch_add(1)) < nitems;)
      run_item<QT, Engine>(P, items[k], E, offs, mrow, lrow, lim);
  };
  if (nthreads <= 1) {
    worker(0, 1);
  } else {
    par.for_range(nthreads, 1, worker);
  }
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
      store_row(reinterpret_cast<QT*>(P.out) + g * r, acc.data(), r, inv);
      P.lse[g] = wsum > 0.0f ? mx + std::log(wsum) : kNegInf;
    }
  });
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
        it.req = static_cast<int32_t>(i);
        it.row0 = static_cast<int32_t>(row0);
        it.nrows = static_cast<int32_t>(nr);
        it.split = static_cast<int32_t>(s);
        it.nsplit = static_cast<int32_t>(ns);
        it.kv0 = static_cast<int32_t>(s * len);
        it.kv1 = static_cast<int32_t>(std::min(L, (s + 1) * len));
        it.part_off = poff;
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

// n floats -> n values of dtype dt (bf16 / fp16 round to nearest even, as torch's .to()).
inline void store_as(char* dst, const float* src, int64_t n, DType dt) {
  if (dt == DType::kBF16) store_row(reinterpret_cast<vec::bf16_t*>(dst), src, n, 1.0f);
  else if (dt == DType::kF16) store_row(reinterpret_cast<vec::fp16_t*>(dst), src, n, 1.0f);
  else std::memcpy(dst, src, n * sizeof(float));
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

// Writes the rows (see WriteParams) after validate_slots; returns its refusal or "".
inline std::string write_latent(const WriteParams& W, const Parallel& par) {
  if (W.page_size < 1) return detail::cat("page_size ", W.page_size, " must be >= 1");
  const std::string err = validate_slots(W.slots, W.T, W.num_pages * W.page_size);
  if (!err.empty()) return err;
  const int64_t D = W.r + W.rope;
  const DsLayout dsl(W.r, W.rope, W.rope_dt == DType::kF32 ? 4 : 2);
  par.for_range(W.T, 64, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> row(D);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t slot = W.slots[t];
      if (slot < 0) continue;
      char* dst = W.cache + (slot / W.page_size) * W.c_s0 + (slot % W.page_size) * W.c_s1;
      const float* c = W.c_kv + t * W.r;
      const float* kp = W.k_pe + t * W.rope;
      if (W.mode == kDs) {
        write_ds_row(reinterpret_cast<uint8_t*>(dst), c, kp, W.r, W.rope, dsl, W.rope_dt);
        continue;
      }
      std::memcpy(row.data(), c, W.r * sizeof(float));
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
