// The normal path's attention: plain multi-head attention over decompressed keys and values,
// with the log-sum-exp, for bf16 on AVX512-BF16 CPUs.
//
//   o[h, i] = softmax_j(scale * q[h, i] · k[h, j]) · v[h, j],   lse[h, i] = log sum_j exp(...)
//   q [H, Lq, Dqk], k [H, Lk, Dqk], v [H, Lk, Dv] bf16 (last dims contiguous, any other
//   strides), causal = top-left (key j visible to query i iff j <= i);
//   o [H, Lq, Dv] bf16, lse [H, Lq] float32 (natural log; -inf and o = 0 for a row with no key)
//
// Two passes. (1) Keys and values are packed once per (head, block of kBN keys) into VNNI pairs:
// K^T as [Dqk / 2][kBN][2] (pairs along the head dim, for the scores), V as [kBN / 2][Dv'][2]
// (pairs along the keys, for P·V), zero-padded. (2) Work items (head, block of kBM query rows)
// stream the key blocks up to the causal limit: scores in fp32 (vdpbf16ps, kMR rows x kBN keys
// in registers), online softmax in fp32, probabilities rounded to bf16 and multiplied into an fp32
// accumulator of kBM x Dv' (vdpbf16ps again), one division and rounding at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "mla_cpu.h"

namespace mla_native {
namespace {

constexpr int64_t kBN = 64;  // keys per block (4 zmm of scores per row)
constexpr int64_t kBM = 24;  // query rows per work item
constexpr int kMR = 6;       // rows per register block
constexpr int64_t kVC = 64;  // value columns per register block

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef MLA_AVX512BF16
inline __m512bh pair_of(const uint16_t* x, int64_t k2, int64_t K) {
  // x[2 * k2], x[2 * k2 + 1] as one broadcast bf16 pair (the second zero past K)
  uint32_t pair;
  if (2 * k2 + 1 < K) {
    std::memcpy(&pair, x + 2 * k2, 4);
  } else {
    pair = x[2 * k2];
  }
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// S[m][0:kBN] = scale * q_m · K block, M rows, fp32.
template <int M>
inline void scores(const uint16_t* const* qs, const uint16_t* kp, int64_t D, float scale,
                   float* S) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pairs = cdiv(D, 2);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* b = kp + p * kBN * 2;
    __m512bh bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + 32 * j);
    for (int m = 0; m < M; ++m) {
      const __m512bh a = pair_of(qs[m], p, D);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, bv[j]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(S + m * kBN + 16 * j, _mm512_mul_ps(acc[m][j], vs));
}

// O[m][c0:c0+kVC] += P[m] · V block (columns c0..), M rows; P as bf16 pairs (kBN / 2 per row).
template <int M>
inline void pv(const uint32_t* P, const uint16_t* vp, int64_t Dvp, int64_t c0, float* O) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_loadu_ps(O + m * Dvp + c0 + 16 * j);
  for (int64_t p = 0; p < kBN / 2; ++p) {
    const uint16_t* b = vp + (p * Dvp + c0) * 2;
    __m512bh bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + 32 * j);
    for (int m = 0; m < M; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(P[m * (kBN / 2) + p]));
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, bv[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(O + m * Dvp + c0 + 16 * j, acc[m][j]);
}

inline void scores_rows(int M, const uint16_t* const* qs, const uint16_t* kp, int64_t D,
                        float scale, float* S) {
  switch (M) {
    case 1: return scores<1>(qs, kp, D, scale, S);
    case 2: return scores<2>(qs, kp, D, scale, S);
    case 3: return scores<3>(qs, kp, D, scale, S);
    case 4: return scores<4>(qs, kp, D, scale, S);
    case 5: return scores<5>(qs, kp, D, scale, S);
    default: return scores<6>(qs, kp, D, scale, S);
  }
}

inline void pv_rows(int M, const uint32_t* P, const uint16_t* vp, int64_t Dvp, int64_t c0,
                    float* O) {
  switch (M) {
    case 1: return pv<1>(P, vp, Dvp, c0, O);
    case 2: return pv<2>(P, vp, Dvp, c0, O);
    case 3: return pv<3>(P, vp, Dvp, c0, O);
    case 4: return pv<4>(P, vp, Dvp, c0, O);
    case 5: return pv<5>(P, vp, Dvp, c0, O);
    default: return pv<6>(P, vp, Dvp, c0, O);
  }
}

inline uint16_t bf16_rne(float f) { return c10::BFloat16(f).x; }
#endif

std::tuple<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, bool causal,
                                                      double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "native_attention_with_lse: q, k, v must be [H, L, D]; got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t H = q.size(0), Lq = q.size(1), D = q.size(2), Lk = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(0) == H && v.size(0) == H && k.size(2) == D && v.size(1) == Lk,
              "native_attention_with_lse: shapes disagree: q ", q.sizes(), ", k ", k.sizes(),
              ", v ", v.sizes());
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "native_attention_with_lse: bfloat16 only, got ",
                t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), "native_attention_with_lse: CPU tensors only");
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) <= 1,
                "native_attention_with_lse: last dims must be contiguous");
  }
  auto o = at::empty({H, Lq, Dv}, q.options());
  auto lse = at::empty({H, Lq}, q.options().dtype(at::kFloat));
#ifndef MLA_AVX512BF16
  TORCH_CHECK(false, "native_attention_with_lse needs a CPU with AVX512-BF16 (built without it)");
#else
  if (H == 0 || Lq == 0) return {o, lse};
  const int64_t nkb = cdiv(Lk, kBN), pairs = cdiv(D, 2), Dvp = cdiv(std::max<int64_t>(Dv, 1), kVC) * kVC;
  const int64_t kblk = pairs * kBN * 2, vblk = (kBN / 2) * Dvp * 2;  // uint16 per packed block
  std::vector<uint16_t> kpk(static_cast<size_t>(H * nkb * kblk)), vpk(static_cast<size_t>(H * nkb * vblk));
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  // (1) pack K^T and V per (head, key block)
  at::parallel_for(0, H * nkb, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t h = it / nkb, kb = it % nkb;
      uint16_t* kp = kpk.data() + it * kblk;
      uint16_t* vp = vpk.data() + it * vblk;
      std::fill(kp, kp + kblk, uint16_t(0));
      std::fill(vp, vp + vblk, uint16_t(0));
      const int64_t n = std::min(kBN, Lk - kb * kBN);
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* kr = kd + h * ks0 + (kb * kBN + j) * ks1;
        for (int64_t d = 0; d < D; ++d) kp[((d / 2) * kBN + j) * 2 + (d & 1)] = kr[d];
        const uint16_t* vr = vd + h * vs0 + (kb * kBN + j) * vs1;
        uint16_t* vrow = vp + ((j / 2) * Dvp) * 2 + (j & 1);
        for (int64_t c = 0; c < Dv; ++c) vrow[2 * c] = vr[c];
      }
    }
  });
  // (2) query blocks
  const int64_t nqb = cdiv(Lq, kBM);
  uint16_t* od = reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>());
  float* ld = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, H * nqb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> S(kBM * kBN), O(kBM * Dvp), m(kBM), l(kBM);
    std::vector<uint32_t> P(kBM * (kBN / 2));
    std::vector<float> alpha(kBM);
    const uint16_t* qs[kMR];
    for (int64_t it = b; it < e; ++it) {
      const int64_t h = it / nqb, i0 = (it % nqb) * kBM;
      const int64_t M = std::min(kBM, Lq - i0);
      std::fill(O.begin(), O.end(), 0.0f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0f);
      const int64_t kb_end = causal ? std::min(nkb, cdiv(std::min(i0 + M, Lk), kBN)) : nkb;
      for (int64_t kb = 0; kb < kb_end; ++kb) {
        const uint16_t* kp = kpk.data() + (h * nkb + kb) * kblk;
        for (int64_t r0 = 0; r0 < M; r0 += kMR) {
          const int R = static_cast<int>(std::min<int64_t>(kMR, M - r0));
          for (int r = 0; r < R; ++r) qs[r] = qd + h * qs0 + (i0 + r0 + r) * qs1;
          scores_rows(R, qs, kp, D, fscale, S.data() + r0 * kBN);
        }
        const int64_t j0 = kb * kBN;
        bool any_alpha = false;
        std::fill(alpha.begin(), alpha.end(), 1.0f);
        for (int64_t r = 0; r < M; ++r) {
          float* s = S.data() + r * kBN;
          int64_t lim = std::min(kBN, Lk - j0);  // valid keys of this block for row r
          if (causal) lim = std::min(lim, i0 + r - j0 + 1);
          float mx = m[r];
          for (int64_t j = 0; j < lim; ++j) mx = std::max(mx, s[j]);
          uint32_t* prow = P.data() + r * (kBN / 2);
          if (lim <= 0 || mx == kNegInf) {
            std::fill(prow, prow + kBN / 2, 0u);
            continue;
          }
          // the first block a row sees: nothing to rescale (O and l are 0)
          const float a = m[r] == kNegInf ? 1.0f : std::exp(m[r] - mx);
          float sum = 0.0f;
          uint16_t pb[kBN];
          for (int64_t j0v = 0; j0v < kBN; j0v += 16) {
            __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + j0v), _mm512_set1_ps(mx));
            const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, lim - j0v));
            const __mmask16 keep = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
            __m512 p = _mm512_maskz_mov_ps(keep, exp512(x));
            sum += _mm512_reduce_add_ps(p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j0v), (__m256i)_mm512_cvtneps_pbh(p));
          }
          std::memcpy(prow, pb, sizeof(pb));
          l[r] = l[r] * a + sum;
          m[r] = mx;
          alpha[r] = a;
          if (a != 1.0f) any_alpha = true;
        }
        if (any_alpha) {
          for (int64_t r = 0; r < M; ++r) {
            if (alpha[r] == 1.0f) continue;
            float* orow = O.data() + r * Dvp;
            const __m512 va = _mm512_set1_ps(alpha[r]);
            for (int64_t c = 0; c < Dvp; c += 16)
              _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), va));
          }
        }
        const uint16_t* vp = vpk.data() + (h * nkb + kb) * vblk;
        for (int64_t r0 = 0; r0 < M; r0 += kMR) {
          const int R = static_cast<int>(std::min<int64_t>(kMR, M - r0));
          for (int64_t c0 = 0; c0 < Dvp; c0 += kVC)
            pv_rows(R, P.data() + r0 * (kBN / 2), vp, Dvp, c0, O.data() + r0 * Dvp);
        }
      }
      for (int64_t r = 0; r < M; ++r) {
        uint16_t* orow = od + (h * Lq + i0 + r) * Dv;
        const float* acc = O.data() + r * Dvp;
        if (l[r] > 0.0f) {
          const float inv = 1.0f / l[r];
          for (int64_t c = 0; c < Dv; ++c) orow[c] = bf16_rne(acc[c] * inv);
          ld[h * Lq + i0 + r] = m[r] + std::log(l[r]);
        } else {
          std::fill(orow, orow + Dv, uint16_t(0));
          ld[h * Lq + i0 + r] = kNegInf;
        }
      }
    }
  });
#endif
  return {o, lse};
}

}  // namespace
}  // namespace mla_native

TORCH_LIBRARY_FRAGMENT(MLA_OPS_NS, m) {
  m.def(
      "native_attention_with_lse(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(MLA_OPS_NS, CPU, m) {
  m.impl("native_attention_with_lse", &mla_native::attention_with_lse);
}
