// The normal path's decompression of latent rows into per-head keys and values:
//
//   k[l, h, :nope] = W_UK[h] · c_kv[l]      (k_nope = c_kv · W_UK^T)
//   k[l, h, nope:] = k_pe[l]                (shared by the heads)
//   v[l, h, :]     = c_kv[l] · W_UV[h]
//
//   c_kv [L, r], k_pe [L, rope] bf16 (last dims contiguous, any row stride);
//   W_UK [H, nope, r], W_UV [H, r, v] bf16 (any strides);
//   k [L, H, nope + rope], v [L, H, v] bf16 (new, contiguous).
//
// Computed transposed, so that no packed copy of the weights is needed: c_kv^T is packed once
// per call into VNNI panels of 64 tokens ([ceil(r / 2)][64][2] each: L * r bf16 of scratch, the
// size of c_kv itself), and the weights' rows (W_UK[h]'s rows, W_UV[h]'s columns) are the A
// operand of gemm_core.h's engine in blocks of 32 rows, each block converted once per work item
// and used for all of the item's token panels. fp32 sums at every ISA level (AMX tiles where
// the CPU has them), one rounding to bf16. Work items: (k or v, head, 1024 tokens).
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

using mla_core::kCols;
constexpr int64_t kPanelsPerItem = 16;  // 1024 tokens per work item

// ---- torch-free core --------------------------------------------------------------------
struct DecompressArgs {
  const uint16_t* c_kv;
  int64_t sc;  // c_kv row stride
  const uint16_t* k_pe;
  int64_t sp;  // k_pe row stride
  const uint16_t* w_uk;
  int64_t uk0, uk1, uk2;  // W_UK strides
  const uint16_t* w_uv;
  int64_t uv0, uv1, uv2;  // W_UV strides
  int64_t L, H, r, nope, rope, vdim;
  uint16_t* k;  // [L, H, nope + rope]
  uint16_t* v;  // [L, H, vdim]
};

// c_kv^T panels [nlb][ceil(r / 2)][64][2], panels [p0, p1)
void pack_latent_panels(const DecompressArgs& a, uint16_t* panels, int64_t p0, int64_t p1) {
  const int64_t kp = mla_core::cdiv(a.r, 2);
  for (int64_t p = p0; p < p1; ++p)
    mla_core::pack_b(mla_core::at(a.c_kv, p * kCols * a.sc), 1, a.sc, a.r, std::min(kCols, a.L - p * kCols), kCols,
                     panels + p * kp * kCols * 2);
}

// work items [i0, i1) of 2 * H * ceil(nlb / kPanelsPerItem): (k or v, head, token chunk)
void decompress_items(const DecompressArgs& a, const uint16_t* panels, int64_t i0, int64_t i1) {
  const int64_t nlb = mla_core::cdiv(a.L, kCols), nchunk = mla_core::cdiv(nlb, kPanelsPerItem);
  const int64_t kp = mla_core::cdiv(a.r, 2), dk = a.nope + a.rope;
  std::vector<mla_core::AElem> abuf(static_cast<size_t>(mla_core::a_panel_elems(a.r)));
  std::vector<float> cbuf(static_cast<size_t>(mla_core::kMaxRows * kCols));
  for (int64_t i = i0; i < i1; ++i) {
    const bool is_v = i >= a.H * nchunk;
    const int64_t j = is_v ? i - a.H * nchunk : i;
    const int64_t h = j / nchunk, ch = j % nchunk;
    const int64_t rows = is_v ? a.vdim : a.nope;
    // A[d, k]: W_UK[h, d, k] or W_UV[h, k, d]
    const uint16_t* w = is_v ? mla_core::at(a.w_uv, h * a.uv0) : mla_core::at(a.w_uk, h * a.uk0);
    const int64_t sm = is_v ? a.uv2 : a.uk1, sk = is_v ? a.uv1 : a.uk2;
    uint16_t* out = is_v ? a.v + h * a.vdim : a.k + h * dk;
    const int64_t sl = is_v ? a.H * a.vdim : a.H * dk;  // output stride between tokens
    const int64_t pb = ch * kPanelsPerItem, pe = std::min(nlb, pb + kPanelsPerItem);
    for (int64_t d0 = 0; d0 < rows; d0 += mla_core::kMaxRows) {
      const int M = static_cast<int>(std::min<int64_t>(mla_core::kMaxRows, rows - d0));
      const auto A = mla_core::pack_a(mla_core::at(w, d0 * sm), sm, sk, M, a.r, abuf.data());
      for (int64_t p = pb; p < pe; ++p) {
        mla_core::gemm(A, panels + p * kp * kCols * 2, kCols, kCols, cbuf.data(), kCols, false);
        const int64_t n = std::min(kCols, a.L - p * kCols);
        mla_core::store_bf16(cbuf.data(), kCols, M, n, out + p * kCols * sl + d0, 1, sl);
      }
    }
  }
}

// k[l, h, nope:] = k_pe[l] for tokens [l0, l1)
void copy_k_pe(const DecompressArgs& a, int64_t l0, int64_t l1) {
  const int64_t dk = a.nope + a.rope;
  for (int64_t l = l0; l < l1; ++l)
    for (int64_t h = 0; h < a.H; ++h)
      std::memcpy(a.k + (l * a.H + h) * dk + a.nope, a.k_pe + l * a.sp, a.rope * sizeof(uint16_t));
}
}  // namespace

#ifndef MLA_CORE_ONLY
// ---- torch layer (declared in ops.h, registered in api.cpp) -----------------------------
std::tuple<at::Tensor, at::Tensor> decompress(const at::Tensor& c_kv, const at::Tensor& k_pe,
                                              const at::Tensor& W_UK, const at::Tensor& W_UV) {
  TORCH_CHECK(c_kv.dim() == 2 && k_pe.dim() == 2 && W_UK.dim() == 3 && W_UV.dim() == 3,
              "native_decompress: c_kv [L, r], k_pe [L, rope], W_UK [H, nope, r], W_UV [H, r, v] "
              "expected; got ", c_kv.sizes(), ", ", k_pe.sizes(), ", ", W_UK.sizes(), ", ", W_UV.sizes());
  const int64_t L = c_kv.size(0), r = c_kv.size(1), H = W_UK.size(0), nope = W_UK.size(1);
  const int64_t rope = k_pe.size(1), vdim = W_UV.size(2);
  TORCH_CHECK(k_pe.size(0) == L && W_UK.size(2) == r && W_UV.size(0) == H && W_UV.size(1) == r,
              "native_decompress: shapes disagree: c_kv ", c_kv.sizes(), ", k_pe ", k_pe.sizes(),
              ", W_UK ", W_UK.sizes(), ", W_UV ", W_UV.sizes());
  for (const auto* t : {&c_kv, &k_pe, &W_UK, &W_UV}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "native_decompress: bfloat16 only, got ",
                t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), "native_decompress: CPU tensors only");
  }
  TORCH_CHECK((c_kv.stride(1) == 1 || r <= 1) && (k_pe.stride(1) == 1 || rope <= 1),
              "native_decompress: c_kv's and k_pe's last dims must be contiguous");
  auto k = at::empty({L, H, nope + rope}, c_kv.options());
  auto v = at::empty({L, H, vdim}, c_kv.options());
  if (L == 0 || H == 0) return {k, v};
  DecompressArgs a{reinterpret_cast<const uint16_t*>(c_kv.data_ptr<at::BFloat16>()), c_kv.stride(0),
                   reinterpret_cast<const uint16_t*>(k_pe.data_ptr<at::BFloat16>()), k_pe.stride(0),
                   reinterpret_cast<const uint16_t*>(W_UK.data_ptr<at::BFloat16>()), W_UK.stride(0),
                   W_UK.stride(1), W_UK.stride(2),
                   reinterpret_cast<const uint16_t*>(W_UV.data_ptr<at::BFloat16>()), W_UV.stride(0),
                   W_UV.stride(1), W_UV.stride(2), L, H, r, nope, rope, vdim,
                   reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>()),
                   reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>())};
  const int64_t nlb = mla_core::cdiv(L, kCols);
  std::vector<uint16_t> panels(static_cast<size_t>(nlb * mla_core::cdiv(r, 2) * kCols * 2));
  at::parallel_for(0, nlb, 1, [&](int64_t b, int64_t e) { pack_latent_panels(a, panels.data(), b, e); });
  const int64_t items = 2 * H * mla_core::cdiv(nlb, kPanelsPerItem);
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) { decompress_items(a, panels.data(), b, e); });
  if (rope > 0) at::parallel_for(0, L, 64, [&](int64_t b, int64_t e) { copy_k_pe(a, b, e); });
  return {k, v};
}

#endif  // MLA_CORE_ONLY
}  // namespace mla_native
