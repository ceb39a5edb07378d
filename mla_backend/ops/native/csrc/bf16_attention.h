// bf16_attention.h: the AVX512-BF16 engine of the absorbed attention (levels avx512_bf16 and
// amx; q bf16, cache bf16, fp8 or fp8_ds_mla), and the pieces the AMX engine shares with it
// (pack_v_pairs, ColSoftmax, Bf16Engine<kFp8>::decode). absorbed_attention.h runs it per work
// item (run_item). Empty below avx512_bf16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_params.h"

namespace mla_native {
namespace core {

#ifdef MLA_AVX512BF16
// ---- AVX512-BF16 engine (q bf16; cache bf16, fp8 or fp8_ds_mla) -------------------------
// Query rows live in SIMD lanes (16 rows per vector, one or two vectors per item): q is
// packed once per item as bf16 pairs [D/2][rows] and each kv row's bf16 pair is broadcast,
// so the scores come out as [kv][rows] with no horizontal reduction, the online softmax is
// vertical (one max / exp / sum per kv row for 16 query rows), and the probabilities are
// interleaved pairwise per row for P.V against the VNNI-packed tile.
//
// fp8 rows are decoded to their exact bf16 values (isa.h's fp8x32_to_bf16: integer shuffles
// only, so the FP pipes stay with vdpbf16ps). fp8_ds_mla rows likewise, with the scales applied
// in registers:
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
    for (int64_t d = 0; d < round_up(n, 64); d += 32) {
      const int64_t left = std::max<int64_t>(0, n - d);
      const __mmask32 msk = left >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << left) - 1);
      _mm512_storeu_si512(dst + d, fp8x32_to_bf16(s8 + d, msk));
    }
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
