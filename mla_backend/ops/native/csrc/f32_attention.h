// f32_attention.h: the fp32 engine of the absorbed attention (every level and dtype, over the
// vector layer vec.h): the tile widened to fp32 in L1, fp32 dot products, softmax and P.V.
// absorbed_attention.h runs it per work item (run_item).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_params.h"
#include "rows.h"

namespace mla_native {
namespace core {

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

}  // namespace core
}  // namespace mla_native
