// amx_attention.h: the AMX-BF16 engine of the absorbed attention (level amx; q bf16, cache bf16
// or per-tensor fp8), and whether it can run here (amx_available). It shares pack_v_pairs,
// ColSoftmax and Bf16Engine<kFp8>::decode with the AVX512-BF16 engine (bf16_attention.h);
// absorbed_attention.h gives it the work items of >= kAmxMinRows query rows.
//
// The absorbed attention is MQA over the latent: per item, R query rows (heads x new tokens of
// one request, up to kAmxRows) against kv tiles of kAmxTileN latent rows [c_kv ; k_pe] (D =
// r + rope bf16 values). Per tile, on 16 x 16 AMX tiles (amx_tiles.h: tmm0-3 C, tmm4-5 A,
// tmm6-7 B):
//   scores, transposed:  S^T [kv][R] fp32 = K [kv][D] . Q^T, with K's rows read in place from
//       the cache as the A operand (16 consecutive rows of a page are one strided tile; other
//       rows, a D that is not a multiple of 32 and fp8 rows go through a zero-padded bf16
//       scratch tile, fp8 decoded exactly) and Q^T as the B operand: q packed once per item
//       into VNNI pairs Qp [Dp / 2][R] (uint32 = the bf16 pair (q[2d], q[2d+1]) of one row);
//   online softmax: vertical, as the AVX512-BF16 engine's (16 rows per vector, fp32), the
//       probabilities rounded to bf16 and transposed in registers (16 x 16 32-bit blocks of
//       kv pairs) into the A operand Pa [R][kAmxTileN];
//   P.V: O [R][rp] fp32 (kept in memory across tiles, rescaled by the softmax's alpha where it
//       is not 1) += Pa . V, V being the tile's first r columns repacked once per tile into
//       VNNI pairs Vp [kAmxTileN / 2][2 rp] (row-pair interleave, pack_v_pairs).
// Every operand of a tile is repacked (V) or read (K) once per tile and used by all R rows of
// the item. Scores and softmax are fp32, products of bf16 values are exact (fp32 sums), P is
// rounded to bf16: the same numerics as the AVX512-BF16 engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "attention_params.h"
#include "bf16_attention.h"

namespace mla_native {
namespace core {

constexpr int kAmxRows = 128;    // query rows per AMX work item (at most)
constexpr int kAmxTileN = 128;   // kv rows per AMX tile
constexpr int kAmxMinRows = 16;  // requests with fewer query rows stay on the vector engines

#if defined(MLA_HAS_AMX)

// r[i] (16 lanes of 32 bits each) -> r[j] lane i = old r[i] lane j.
inline void transpose16_epi32(__m512i (&x)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // x[4a + b] 128-bit lane L = column 4L + b of rows 4a..4a+3
    x[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    x[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    x[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    x[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int b = 0; b < 4; ++b) {  // 4 x 4 transpose of 128-bit lanes over x[4a + b]
    const __m512i u0 = _mm512_shuffle_i32x4(x[b], x[4 + b], 0x44);
    const __m512i u1 = _mm512_shuffle_i32x4(x[b], x[4 + b], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(x[8 + b], x[12 + b], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(x[8 + b], x[12 + b], 0xEE);
    t[b] = _mm512_shuffle_i32x4(u0, u2, 0x88);  // column 4 L + b: lane L's of the four
    t[4 + b] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + b] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + b] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) x[i] = t[i];
}

template <int kMode>
struct AmxEngine {
  static_assert(kMode == kPlain || kMode == kFp8, "AMX engine: bf16 or per-tensor fp8 caches");
  static constexpr int kTile = kAmxTileN;  // run_item's kv tile
  static constexpr int kRows = kAmxRows;   // run_item's rows per item
  static constexpr int kGroups = kAmxTileN / 16;
  const Params& P;
  int64_t D, r, Dp, KC, rp;
  int R = 16;           // padded rows of the current item
  uint16_t* Q;          // [kRows][Dp] rows as loaded (zero padded)
  uint32_t* Qp;         // [Dp / 2][R] q pairs, rows in columns (B operand of S^T)
  uint16_t* Kg;         // [kTile][Dp] gathered / decoded rows (zero padded)
  uint16_t* Vp;         // [kTile / 2][2 rp] VNNI V
  float* St;            // [kTile][kRows] S^T
  uint16_t* Pa;         // [kRows][kTile] bf16 probabilities (A operand of P.V)
  float* O;             // [kRows][rp]
  float* alpha;         // [kRows]
  uint16_t* zero;       // [Dp]
  const uint16_t* grp[kGroups];  // A operand of each 16-row kv group
  int64_t gstride[kGroups];      // its row stride in bytes
  const uint16_t* rows[kTile + 32];

  explicit AmxEngine(const Params& p) : P(p), D(p.D), r(p.r) {
    Dp = round_up(D, 32);
    KC = Dp / 32;
    rp = round_up(r, 16);
    Q = tl_scratch.q.get<uint16_t>(kRows * Dp + (Dp / 2) * kRows * 2);
    Qp = reinterpret_cast<uint32_t*>(Q + kRows * Dp);
    Kg = tl_scratch.k.get<uint16_t>(kTile * Dp);
    Vp = tl_scratch.v.get<uint16_t>(kTile * rp);
    St = tl_scratch.s.get<float>(kTile * kRows + kRows);
    alpha = St + kTile * kRows;
    Pa = tl_scratch.pb.get<uint16_t>(kRows * kTile);
    O = tl_scratch.o.get<float>(kRows * rp);
    zero = tl_scratch.zero.get<uint16_t>(Dp);
    std::memset(zero, 0, Dp * sizeof(uint16_t));
  }
  int pad_rows(int rows) {
    R = static_cast<int>(round_up(rows, 16));
    return R;
  }
  const float* orow(int m) const { return O + m * rp; }

  void load_q(int m, const char* ql, const char* qp) {
    uint16_t* dst = Q + m * Dp;
    std::memcpy(dst, ql, r * 2);
    if (P.rope) std::memcpy(dst + r, qp, P.rope * 2);
    std::memset(dst + D, 0, (Dp - D) * 2);
  }
  void zero_q(int m) { std::memset(Q + m * Dp, 0, Dp * 2); }

  // O = 0; Qp[d2][m] = pair d2 of row m (16 x 16 transposes of the rows' 32-bit pairs)
  void start_item(int rows_pad) {
    std::fill(O, O + rows_pad * rp, 0.0f);
    const int64_t D2 = Dp / 2;
    for (int m0 = 0; m0 < R; m0 += 16)
      for (int64_t d0 = 0; d0 < D2; d0 += 16) {
        __m512i x[16];
        for (int i = 0; i < 16; ++i)
          x[i] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(Q + (m0 + i) * Dp) + d0);
        transpose16_epi32(x);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(Qp + (d0 + j) * R + m0, x[j]);
      }
  }

  // one cached row -> Kg row c (exact bf16, zero padded to Dp)
  void gather_row(int c, const char* src) {
    uint16_t* dst = Kg + static_cast<int64_t>(c) * Dp;
    if constexpr (kMode == kFp8) {
      Bf16Engine<kFp8>::decode(dst, reinterpret_cast<const uint8_t*>(src), D);  // zeros past D
    } else {
      std::memcpy(dst, src, D * 2);
      std::memset(dst + D, 0, (Dp - D) * 2);
    }
  }

  void load_tile(const int64_t* offs, int nt) {
    const int ng = static_cast<int>(ceil_div(nt, 16));
    for (int g = 0; g < ng; ++g) {
      const int c0 = 16 * g;
      bool direct = kMode == kPlain && D % 32 == 0 && c0 + 16 <= nt;
      for (int i = 1; direct && i < 16; ++i) direct = offs[c0 + i] == offs[c0] + i * P.c_s1;
      if (direct) {  // 16 consecutive rows of a page: read in place
        grp[g] = reinterpret_cast<const uint16_t*>(P.cache + offs[c0]);
        gstride[g] = P.c_s1;
        for (int i = 0; i < 16; ++i) rows[c0 + i] = reinterpret_cast<const uint16_t*>(P.cache + offs[c0 + i]);
        continue;
      }
      for (int c = c0; c < c0 + 16; ++c) {
        if (c < nt) {
          gather_row(c, P.cache + offs[c]);
        } else {
          std::memset(Kg + static_cast<int64_t>(c) * Dp, 0, Dp * 2);
        }
        rows[c] = Kg + static_cast<int64_t>(c) * Dp;
      }
      grp[g] = Kg + static_cast<int64_t>(c0) * Dp;
      gstride[g] = Dp * 2;
    }
    pack_v_pairs(rows, nt, zero, r, rp, Vp);
    // pairs up to a multiple of 32 kv rows: zero (the last A / B chunk of P.V reads them)
    const int np = (nt + 1) / 2, npp = static_cast<int>(round_up(nt, 32)) / 2;
    if (npp > np) std::memset(Vp + np * 2 * rp, 0, (npp - np) * 2 * rp * sizeof(uint16_t));
  }

  // S^T [16 ng][R] = K . Q^T
  void scores(int ng) {
    const int64_t sq = R * 4, sc = R * 4;
    for (int g = 0; g < ng; g += 2) {
      const bool g2 = g + 1 < ng;
      for (int b = 0; b < R / 16; b += 2) {
        const bool b2 = b + 1 < R / 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < KC; ++kc) {
          const uint32_t* bq = Qp + kc * 16 * R + 16 * b;
          _tile_loadd(4, grp[g] + kc * 32, gstride[g]);
          _tile_loadd(6, bq, sq);
          _tile_dpbf16ps(0, 4, 6);
          if (b2) {
            _tile_loadd(7, bq + 16, sq);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (g2) {
            _tile_loadd(5, grp[g + 1] + kc * 32, gstride[g + 1]);
            _tile_dpbf16ps(2, 5, 6);
            if (b2) _tile_dpbf16ps(3, 5, 7);
          }
        }
        float* c00 = St + (16 * g) * R + 16 * b;
        _tile_stored(0, c00, sc);
        if (b2) _tile_stored(1, c00 + 16, sc);
        if (g2) {
          _tile_stored(2, c00 + 16 * R, sc);
          if (b2) _tile_stored(3, c00 + 16 * R + 16, sc);
        }
      }
    }
  }

  // online softmax over S^T (rows in lanes); Pa [R][round_up(nt, 32)] bf16, alpha [R]
  void softmax(int nt, int64_t t0, const int64_t* lim, float sc, float* mrow, float* lrow) {
    const __m512 vsc = _mm512_set1_ps(sc);
    alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                      21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                      11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pidx = _mm512_load_si512(pair_idx);
    const int nblk = static_cast<int>(round_up(nt, 32)) / 32;  // blocks of 16 kv pairs
    for (int v = 0; v < R / 16; ++v) {
      const ColSoftmax cs(St + 16 * v, R, nt, lim + 16 * v, t0, vsc, mrow + 16 * v);
      const __m512i vlim = cs.vlim;
      const __m512 mnew = cs.mnew;
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < nblk; ++j) {
        __m512i x[16];
        for (int k = 0; k < 16; ++k) {
          __m512 p2[2];
          for (int e = 0; e < 2; ++e) {
            const int n = 32 * j + 2 * k + e;
            const __mmask16 valid = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(n));
            // rows past nt may hold anything (masked; never read when n >= 16 ceil(nt / 16))
            const __m512 s = n < nt ? _mm512_loadu_ps(St + n * R + 16 * v) : _mm512_setzero_ps();
            p2[e] = _mm512_maskz_mov_ps(valid, exp512(_mm512_fmsub_ps(s, vsc, mnew)));
            sum = _mm512_add_ps(sum, p2[e]);
          }
          // [p(n) rows 0..15 | p(n+1) rows 0..15] -> per row the bf16 pair (p(n), p(n+1))
          x[k] = _mm512_permutexvar_epi16(pidx, (__m512i)_mm512_cvtne2ps_pbh(p2[1], p2[0]));
        }
        transpose16_epi32(x);  // x[i]: row 16 v + i, kv pairs 16 j .. 16 j + 15
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(Pa + (16 * v + i) * kTile + 32 * j, x[i]);
      }
      cs.finish(sum, mrow + 16 * v, lrow + 16 * v, alpha + 16 * v);
    }
  }

  // O = alpha O + Pa . Vp over kc chunks of 32 kv rows
  void pv(int nkc) {
    for (int m = 0; m < R; ++m) {
      if (alpha[m] == 1.0f) continue;
      const __m512 a = _mm512_set1_ps(alpha[m]);
      float* o = O + m * rp;
      for (int64_t c = 0; c < rp; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), a));
    }
    const int64_t so = rp * 4, sp = kTile * 2, sv = rp * 4;
    const int64_t ncb = rp / 16;
    for (int b = 0; b < R / 16; b += 2) {
      const bool b2 = b + 1 < R / 16;
      for (int64_t cb = 0; cb < ncb; cb += 2) {
        const bool c2 = cb + 1 < ncb;
        float* c00 = O + (16 * b) * rp + 16 * cb;
        _tile_loadd(0, c00, so);
        if (c2) _tile_loadd(1, c00 + 16, so);
        if (b2) {
          _tile_loadd(2, c00 + 16 * rp, so);
          if (c2) _tile_loadd(3, c00 + 16 * rp + 16, so);
        }
        for (int kc = 0; kc < nkc; ++kc) {
          const uint16_t* bv = Vp + (kc * 16) * 2 * rp + 2 * 16 * cb;
          _tile_loadd(4, Pa + (16 * b) * kTile + 32 * kc, sp);
          _tile_loadd(6, bv, sv);
          _tile_dpbf16ps(0, 4, 6);
          if (c2) {
            _tile_loadd(7, bv + 32, sv);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (b2) {
            _tile_loadd(5, Pa + (16 * b + 16) * kTile + 32 * kc, sp);
            _tile_dpbf16ps(2, 5, 6);
            if (c2) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c00, so);
        if (c2) _tile_stored(1, c00 + 16, so);
        if (b2) {
          _tile_stored(2, c00 + 16 * rp, so);
          if (c2) _tile_stored(3, c00 + 16 * rp + 16, so);
        }
      }
    }
  }

  void compute_tile(int rows, int nt, int64_t t0, const int64_t* lim, float sc, float* mrow,
                    float* lrow) {
    (void)rows;
    mla_amx::amx_configure();
    scores(static_cast<int>(ceil_div(nt, 16)));
    softmax(nt, t0, lim, sc, mrow, lrow);
    pv(static_cast<int>(ceil_div(nt, 32)));
  }
};

#endif  // MLA_HAS_AMX

// Whether the AMX engine can run here: compiled in (level amx) and tiles granted by the OS.
inline bool amx_available() {
#ifdef MLA_HAS_AMX
  return mla_amx::amx_request_permission();
#else
  return false;
#endif
}

}  // namespace core
}  // namespace mla_native
