// DSA's sparse MHA (mla_backend/sparse_normal.py, the masked variant): the normal path's MHA
// (mha.cpp) with a per-query-row mask shared by the heads, for bf16 at every ISA level.
//
//   o[h, i] = softmax_{j : mask[i, j]}(scale * q[h, i] · k[h, j]) · v[h, j]
//   q [H, Lq, Dqk], k [H, Lk, Dqk], v [H, Lk, Dv] bf16 (last dims contiguous, any other
//   strides), mask [Lq, Lk] bool (contiguous); o [H, Lq, Dv] bf16, lse [H, Lq] float32
//   (natural log; -inf and o = 0 for a row whose mask is empty)
//
// The same two passes as mha.cpp, whose packing, query-block loop and GEMM engine it
// reuses: keys and values packed once per (head, block of 64 keys); work items (head, block of
// 32 query rows) stream the key blocks, skipping every (32 rows x 64 keys) tile that no row of
// the item selected (the tile flags are computed once per call, shared by the heads); the
// scores of unselected keys are -inf before the online softmax.
// The op is declared in ops.h and registered, with its schema, in api.cpp.
#define MLA_CORE_ONLY 1
#include "mha.cpp"  // its torch-free core: MhaArgs, mha_pack_items, mha_query_items
#undef MLA_CORE_ONLY

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"

namespace mla_native {
namespace {

// tile flags [nqb][nkb] for query blocks [b0, b1): 1 where any row of the block selects a key of
// the key block
void mask_tiles(const uint8_t* mask, int64_t Lq, int64_t Lk, uint8_t* tiles, int64_t b0, int64_t b1) {
  const int64_t nkb = cdiv(Lk, kCols);
  for (int64_t qb = b0; qb < b1; ++qb) {
    uint8_t* t = tiles + qb * nkb;
    std::fill(t, t + nkb, uint8_t(0));
    for (int64_t i = qb * kBM; i < std::min(Lq, (qb + 1) * kBM); ++i) {
      const uint8_t* row = mask + i * Lk;
      for (int64_t j = 0; j < Lk; ++j) t[j / kCols] |= row[j];
    }
  }
}

// The keys a row sees (mha_query_items' Keys): the ones its mask row selects; a tile no row of
// the query block selected is skipped.
struct MaskedKeys {
  const uint8_t* mask;   // [Lq, Lk]
  const uint8_t* tiles;  // [nqb, nkb] (mask_tiles)
  int64_t Lk, nkb;
  int64_t end(int64_t, int) const { return nkb; }
  bool skip(int64_t qb, int64_t kb) const { return !tiles[qb * nkb + kb]; }
  int64_t limit(int64_t i, int64_t j0, float* s) const {
    const int64_t lim = std::min(kCols, Lk - j0);
    const uint8_t* sel = mask + i * Lk + j0;
    for (int64_t j = 0; j < lim; ++j)
      if (!sel[j]) s[j] = kNegInf;
    return lim;
  }
};

}  // namespace

// ---- torch layer ------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> masked_attention_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& mask,
                                                             double scale) {
  const char* name = "native_masked_attention_with_lse";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && mask.dim() == 2, name,
              ": q, k, v must be [H, L, D] and mask [Lq, Lk]; got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes(), ", ", mask.sizes());
  const int64_t H = q.size(0), Lq = q.size(1), D = q.size(2), Lk = k.size(1), Dv = v.size(2);
  TORCH_CHECK(k.size(0) == H && v.size(0) == H && k.size(2) == D && v.size(1) == Lk &&
                  mask.size(0) == Lq && mask.size(1) == Lk,
              name, ": shapes disagree: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", mask ",
              mask.sizes());
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, name, ": bfloat16 only, got ", t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), name, ": CPU tensors only");
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) <= 1, name, ": last dims must be contiguous");
  }
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.device().is_cpu(), name,
              ": mask must be a contiguous CPU bool tensor, got ", mask.scalar_type());
  TORCH_CHECK(scale > 0.0, name, ": scale must be > 0, got ", scale);
  auto o = at::empty({H, Lq, Dv}, q.options());
  auto lse = at::empty({H, Lq}, q.options().dtype(at::kFloat));
  if (H == 0 || Lq == 0) return {o, lse};
  if (Lk == 0) {
    o.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {o, lse};
  }
  MhaArgs a{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0), q.stride(1),
            reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()), k.stride(0), k.stride(1),
            reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), v.stride(0), v.stride(1),
            H, Lq, Lk, D, Dv, false, static_cast<float>(scale),
            reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>()), lse.data_ptr<float>()};
  const int64_t nkb = a.nkb(), nqb = cdiv(Lq, kBM);
  const auto* mk = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  std::vector<uint8_t> tiles(static_cast<size_t>(nqb * nkb));
  at::parallel_for(0, nqb, 1, [&](int64_t b, int64_t e) { mask_tiles(mk, Lq, Lk, tiles.data(), b, e); });
  std::vector<uint16_t> kpk(static_cast<size_t>(H * nkb * a.kblk())), vpk(static_cast<size_t>(H * nkb * a.vblk()));
  at::parallel_for(0, H * nkb, 1, [&](int64_t b, int64_t e) { mha_pack_items(a, kpk.data(), vpk.data(), b, e); });
  at::parallel_for(0, H * nqb, 1, [&](int64_t b, int64_t e) {
    mha_query_items(a, kpk.data(), vpk.data(), b, e, MaskedKeys{mk, tiles.data(), Lk, nkb});
  });
  return {o, lse};
}

}  // namespace mla_native
