// The normal path's attention: plain multi-head attention over decompressed keys and values,
// with the log-sum-exp, for bf16 at every ISA level.
//
//   o[h, i] = softmax_j(scale * q[h, i] · k[h, j]) · v[h, j],   lse[h, i] = log sum_j exp(...)
//   q [H, Lq, Dqk], k [H, Lk, Dqk], v [H, Lk, Dv] bf16 (last dims contiguous, any other
//   strides), causal = top-left (key j visible to query i iff j <= i);
//   o [H, Lq, Dv] bf16, lse [H, Lq] float32 (natural log; -inf and o = 0 for a row with no key)
//
// Two passes. (1) Keys and values are packed once per (head, block of 64 keys) into the VNNI
// pairs of gemm_core.h: K^T as [ceil(Dqk / 2)][64][2] (pairs along the head dim, for the
// scores), V as [32][Dv'][2] (pairs along the keys, for P·V; Dv' = Dv rounded up to 64),
// zero-padded (scratch: H * Lk' * (Dqk' + Dv') bf16, about the size of k and v). (2) Work items
// (head, block of 32 query rows) convert their queries once and stream the key blocks up to the
// causal limit: scores in fp32 (the engine: widened fp32 FMA, vdpbf16ps or AMX tiles by ISA
// level), online softmax in fp32, P·V into an fp32 accumulator of 32 x Dv' (probabilities
// rounded to bf16 on the bf16 levels, fp32 on the others), one division and rounding at the end.
#ifndef MLA_CORE_ONLY  // the core test driver includes this file without torch
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#endif

#include <vector>

#include "gemm_core.h"
#ifndef MLA_CORE_ONLY
#include "ops.h"
#endif

namespace mla_native {
namespace {

using mla_core::cdiv;
using mla_core::kCols;  // keys per block
using mla_core::VecF;
constexpr int64_t kBM = mla_core::kMaxRows;  // query rows per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- torch-free core --------------------------------------------------------------------
struct MhaArgs {
  const uint16_t* q;
  int64_t qs0, qs1;
  const uint16_t* k;
  int64_t ks0, ks1;
  const uint16_t* v;
  int64_t vs0, vs1;
  int64_t H, Lq, Lk, D, Dv;
  bool causal;
  float scale;
  uint16_t* o;  // [H, Lq, Dv]
  float* lse;   // [H, Lq]
  int64_t nkb() const { return cdiv(Lk, kCols); }
  int64_t dvp() const { return mla_core::round_up(std::max<int64_t>(Dv, 1), kCols); }
  int64_t kblk() const { return cdiv(D, 2) * kCols * 2; }  // uint16 per packed K block
  int64_t vblk() const { return (kCols / 2) * dvp() * 2; }  // uint16 per packed V block
};

// pack K^T and V of (head, key block) items [i0, i1)
void mha_pack_items(const MhaArgs& a, uint16_t* kpk, uint16_t* vpk, int64_t i0, int64_t i1) {
  const int64_t nkb = a.nkb();
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t h = it / nkb, kb = it % nkb, n = std::min(kCols, a.Lk - kb * kCols);
    mla_core::pack_b(mla_core::at(a.k, h * a.ks0 + kb * kCols * a.ks1), 1, a.ks1, a.D, n, kCols, kpk + it * a.kblk());
    uint16_t* vp = vpk + it * a.vblk();
    std::memset(vp, 0, static_cast<size_t>(a.vblk()) * sizeof(uint16_t));
    mla_core::pack_b(mla_core::at(a.v, h * a.vs0 + kb * kCols * a.vs1), a.vs1, 1, n, a.Dv, a.dvp(), vp);
  }
}

// One row's block of scores s[0:64) (raw q·k) -> probabilities in place, online-softmax state
// (m, l) updated; keys >= lim are masked. Returns the factor for the row's old accumulator.
float softmax_block(float* s, int64_t lim, float scale, float& m, float& l) {
  if (lim <= 0) {
    std::fill(s, s + kCols, 0.0f);
    return 1.0f;
  }
  for (int64_t j = lim; j < kCols; ++j) s[j] = kNegInf;
  const VecF vs = VecF::set1(scale);
  VecF vmax = VecF::set1(kNegInf);
  for (int64_t j = 0; j < kCols; j += VecF::W) {
    const VecF x = VecF::load(s + j) * vs;
    x.store(s + j);
    vmax = vec::max(vmax, x);
  }
  const float mx = std::max(m, vec::hmax(vmax));
  if (mx == kNegInf) {  // every visible score is -inf: nothing to add
    std::fill(s, s + kCols, 0.0f);
    return 1.0f;
  }
  const VecF vmx = VecF::set1(mx);
  VecF vsum = VecF::zero();
  for (int64_t j = 0; j < kCols; j += VecF::W) {
    const VecF p = vec::exp(VecF::load(s + j) - vmx);
    p.store(s + j);
    vsum = vsum + p;
  }
  const float alpha = m == kNegInf ? 1.0f : std::exp(m - mx);
  l = l * alpha + vec::hsum(vsum);
  m = mx;
  return alpha;
}

// The keys a query block sees: the causal (or full) range. Any other set of visible keys is a
// type with the same three members (sparse_mha.cpp's mask):
//   end(q0, M)  -- key blocks [0, end) to stream for rows [q0, q0 + M)
//   skip(qb, kb) -- whether no row of query block qb sees a key of block kb
//   limit(q0 + r, j0, s) -- row q0 + r's visible keys of the block starting at j0: the count
//       of leading keys it may see (softmax_block masks the rest), after setting the scores s
//       of any others among them to -inf
struct CausalKeys {
  const MhaArgs& a;
  int64_t end(int64_t q0, int M) const {
    return a.causal ? std::min(a.nkb(), cdiv(std::min<int64_t>(q0 + M, a.Lk), kCols)) : a.nkb();
  }
  bool skip(int64_t, int64_t) const { return false; }
  int64_t limit(int64_t i, int64_t j0, float*) const {
    const int64_t lim = std::min(kCols, a.Lk - j0);
    return a.causal ? std::min(lim, i - j0 + 1) : lim;
  }
};

// query blocks (head, block of kBM rows) [i0, i1) over the keys `keys` lets each row see
template <class Keys>
void mha_query_items(const MhaArgs& a, const uint16_t* kpk, const uint16_t* vpk, int64_t i0,
                     int64_t i1, const Keys& keys) {
  const int64_t nkb = a.nkb(), nqb = cdiv(a.Lq, kBM), Dvp = a.dvp();
  std::vector<mla_core::AElem> aq(static_cast<size_t>(mla_core::a_panel_elems(a.D)));
  std::vector<mla_core::AElem> ap(static_cast<size_t>(mla_core::a_panel_elems(kCols)));
  std::vector<float> S(static_cast<size_t>(kBM * kCols)), O(static_cast<size_t>(kBM * Dvp));
  float m[kBM], l[kBM], alpha[kBM];
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t h = it / nqb, qb = it % nqb, q0 = qb * kBM;
    const int M = static_cast<int>(std::min(kBM, a.Lq - q0));
    std::fill(O.begin(), O.end(), 0.0f);
    std::fill(m, m + kBM, kNegInf);
    std::fill(l, l + kBM, 0.0f);
    const auto Aq = mla_core::pack_a(mla_core::at(a.q, h * a.qs0 + q0 * a.qs1), a.qs1, 1, M, a.D, aq.data());
    const int64_t kb_end = keys.end(q0, M);
    for (int64_t kb = 0; kb < kb_end; ++kb) {
      if (keys.skip(qb, kb)) continue;
      mla_core::gemm(Aq, kpk + (h * nkb + kb) * a.kblk(), kCols, kCols, S.data(), kCols, false);
      const int64_t j0 = kb * kCols;
      bool rescale = false;
      for (int r = 0; r < M; ++r) {
        float* s = S.data() + r * kCols;
        alpha[r] = softmax_block(s, keys.limit(q0 + r, j0, s), a.scale, m[r], l[r]);
        rescale |= alpha[r] != 1.0f;
      }
      if (rescale) {
        for (int r = 0; r < M; ++r) {
          if (alpha[r] == 1.0f) continue;
          const VecF va = VecF::set1(alpha[r]);
          float* orow = O.data() + r * Dvp;
          for (int64_t c = 0; c < Dvp; c += VecF::W) (VecF::load(orow + c) * va).store(orow + c);
        }
      }
      const auto Ap = mla_core::pack_a_f32(S.data(), kCols, M, kCols, ap.data());
      mla_core::gemm(Ap, vpk + (h * nkb + kb) * a.vblk(), Dvp, Dvp, O.data(), Dvp, true);
    }
    for (int r = 0; r < M; ++r) {
      uint16_t* orow = a.o + (h * a.Lq + q0 + r) * a.Dv;
      float* acc = O.data() + r * Dvp;
      if (l[r] > 0.0f) {
        const VecF inv = VecF::set1(1.0f / l[r]);
        for (int64_t c = 0; c < Dvp; c += VecF::W) (VecF::load(acc + c) * inv).store(acc + c);
        mla_core::store_bf16(acc, Dvp, 1, a.Dv, orow, 0, 1);
        a.lse[h * a.Lq + q0 + r] = m[r] + std::log(l[r]);
      } else {
        std::fill(orow, orow + a.Dv, uint16_t(0));
        a.lse[h * a.Lq + q0 + r] = kNegInf;
      }
    }
  }
}

// the causal (or full) attention's query blocks [i0, i1)
void mha_query_items(const MhaArgs& a, const uint16_t* kpk, const uint16_t* vpk, int64_t i0, int64_t i1) {
  mha_query_items(a, kpk, vpk, i0, i1, CausalKeys{a});
}
}  // namespace

#ifndef MLA_CORE_ONLY
// ---- torch layer (declared in ops.h, registered in api.cpp) -----------------------------
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
  if (H == 0 || Lq == 0) return {o, lse};
  MhaArgs a{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0), q.stride(1),
            reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()), k.stride(0), k.stride(1),
            reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), v.stride(0), v.stride(1),
            H, Lq, Lk, D, Dv, causal, static_cast<float>(scale),
            reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>()), lse.data_ptr<float>()};
  const int64_t nkb = a.nkb();
  std::vector<uint16_t> kpk(static_cast<size_t>(H * nkb * a.kblk())), vpk(static_cast<size_t>(H * nkb * a.vblk()));
  at::parallel_for(0, H * nkb, 1, [&](int64_t b, int64_t e) { mha_pack_items(a, kpk.data(), vpk.data(), b, e); });
  at::parallel_for(0, H * cdiv(Lq, kBM), 1, [&](int64_t b, int64_t e) {
    mha_query_items(a, kpk.data(), vpk.data(), b, e);
  });
  return {o, lse};
}

#endif  // MLA_CORE_ONLY
}  // namespace mla_native
