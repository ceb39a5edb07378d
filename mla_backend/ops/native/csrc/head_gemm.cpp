// Per-head GEMM for the absorption weights: q_lat = q_nope · W_UK and o = o_lat · W_UV.
//
//   y[t, h, n] = sum_k x[t, h, k] * w[h, k, n]     x [T, H, K] bf16 (last dim contiguous, any
//                                                  other strides), w [H, K, N] bf16,
//                                                  y [T, H, N] bf16 (new, contiguous; or
//                                                  the caller's, last dim contiguous)
//
// The weight is packed once per layer (native_pack_heads) into VNNI pairs in blocks of 64
// output columns: packed[h][nb][k / 2][c][2] = (w[h][k][nb*64 + c], w[h][k+1][nb*64 + c]),
// zero-padded to an even K and to whole column blocks (memory: H * ceil(K/2)*2 * ceil(N/64)*64
// bf16, i.e. the weight's own size up to the padding; W_UK and W_UV together 2 * H * r *
// (nope + v) bytes, 4 MiB per layer at H 16, r 512, nope = v = 128), so one work item (head,
// column block) streams a contiguous panel. Rows of x go through gemm_core.h's engine in blocks
// of 32 (fp32 sums at every ISA level; AMX tiles for >= 8 rows where the CPU has them; a row
// block is packed once per head and run against each of its column blocks); one
// rounding to bf16 at the end (nearest even). Work items (head, column block) go to
// at::parallel_for.
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

// ---- torch-free core --------------------------------------------------------------------
// packed [H][ceil(N / 64)][ceil(K / 2)][64][2] from w [H, K, N] contiguous; heads/blocks
// [i0, i1) of the H * nb work items.
void pack_heads_items(const uint16_t* w, int64_t K, int64_t N, uint16_t* packed, int64_t i0,
                      int64_t i1) {
  const int64_t nb = mla_core::cdiv(N, kCols), kp = mla_core::cdiv(K, 2);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t h = i / nb, blk = i % nb;
    mla_core::pack_b(mla_core::at(w, h * K * N + blk * kCols), N, 1, K, std::min(kCols, N - blk * kCols), kCols,
                     packed + i * kp * kCols * 2);
  }
}

// y[t, h, blk*64 ...] for work items (h, blk) in [i0, i1); x rows at x + t * sx0 + h * sx1,
// y rows at y + t * sy0 + h * sy1 (its last dim contiguous).
void head_gemm_items(const uint16_t* x, int64_t sx0, int64_t sx1, int64_t T, int64_t H, int64_t K,
                     const uint16_t* packed, int64_t N, uint16_t* y, int64_t sy0, int64_t sy1,
                     int64_t i0, int64_t i1) {
  const int64_t nb = mla_core::cdiv(N, kCols), kp = mla_core::cdiv(K, 2);
  std::vector<mla_core::AElem> abuf(static_cast<size_t>(mla_core::a_panel_elems(K)));
  std::vector<float> cbuf(static_cast<size_t>(mla_core::kMaxRows * kCols));
  mla_core::APanel a{};
  int64_t packed_h = -1, packed_t0 = -1;  // the row block abuf holds
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t h = i / nb, blk = i % nb;
    const uint16_t* panel = packed + i * kp * kCols * 2;
    const int64_t ncols = std::min(kCols, N - blk * kCols);
    for (int64_t t0 = 0; t0 < T; t0 += mla_core::kMaxRows) {
      const int M = static_cast<int>(std::min<int64_t>(mla_core::kMaxRows, T - t0));
      if (h != packed_h || t0 != packed_t0) {  // T <= 32 (decode): once per head, not per block
        a = mla_core::pack_a(mla_core::at(x, t0 * sx0 + h * sx1), sx0, 1, M, K, abuf.data());
        packed_h = h;
        packed_t0 = t0;
      }
      mla_core::gemm(a, panel, kCols, kCols, cbuf.data(), kCols, false);
      mla_core::store_bf16(cbuf.data(), kCols, M, ncols, y + t0 * sy0 + h * sy1 + blk * kCols, sy0, 1);
    }
  }
}
}  // namespace

#ifndef MLA_CORE_ONLY
// ---- torch layer (declared in ops.h, registered in api.cpp) -----------------------------
namespace {
const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* mbits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }
}  // namespace

at::Tensor pack_heads(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3, "native_pack_heads: w must be [H, K, N], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "native_pack_heads: w must be bfloat16, got ",
              w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "native_pack_heads: w must be a CPU tensor");
  const int64_t H = w.size(0), K = w.size(1), N = w.size(2);
  const int64_t kp = mla_core::cdiv(K, 2), nb = mla_core::cdiv(N, kCols);
  auto wc = w.contiguous();
  auto out = at::empty({H, nb, kp, kCols, 2}, w.options());
  const uint16_t* src = bits(wc);
  uint16_t* dst = mbits(out);
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) { pack_heads_items(src, K, N, dst, b, e); });
  return out;
}

namespace {
// checks x / packed (and y when given: [T, H, N] bf16, last dim contiguous); returns N's blocks
void check_head_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 3 && packed.dim() == 5,
              "native_head_gemm: x must be [T, H, K] and packed [H, N / 64, K / 2, 64, 2]; got ",
              x.sizes(), " and ", packed.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "native_head_gemm: bfloat16 only, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "native_head_gemm: CPU tensors");
  TORCH_CHECK(x.stride(2) == 1 || x.size(2) <= 1, "native_head_gemm: x's last dim must be contiguous");
  TORCH_CHECK(packed.is_contiguous(), "native_head_gemm: packed must be contiguous");
  const int64_t H = x.size(1), K = x.size(2);
  const int64_t nb = packed.size(1), kp = packed.size(2);
  TORCH_CHECK(packed.size(0) == H && kp == mla_core::cdiv(K, 2) && packed.size(3) == kCols &&
                  packed.size(4) == 2 && nb == mla_core::cdiv(N, kCols),
              "native_head_gemm: packed ", packed.sizes(), " does not match x ", x.sizes(),
              " and N = ", N);
}

void run_head_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, at::Tensor& y) {
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2), nb = packed.size(1);
  if (T == 0 || N == 0 || H == 0) return;
  const uint16_t* xp = bits(x);
  const uint16_t* wp = bits(packed);
  uint16_t* yp = mbits(y);
  const int64_t sx0 = x.stride(0), sx1 = x.stride(1), sy0 = y.stride(0), sy1 = y.stride(1);
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) {
    head_gemm_items(xp, sx0, sx1, T, H, K, wp, N, yp, sy0, sy1, b, e);
  });
}
}  // namespace

at::Tensor head_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check_head_gemm(x, packed, N);
  auto y = at::empty({x.size(0), x.size(1), N}, x.options());
  run_head_gemm(x, packed, N, y);
  return y;
}

// into y [T, H, N] bf16 with its last dim contiguous (any other strides: a view of an engine's
// output buffer)
void head_gemm_out(const at::Tensor& x, const at::Tensor& packed, at::Tensor y) {
  TORCH_CHECK(y.dim() == 3 && y.size(0) == x.size(0) && y.size(1) == x.size(1),
              "native_head_gemm_out: y must be [T, H, N] for x ", x.sizes(), ", got ", y.sizes());
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.device().is_cpu(),
              "native_head_gemm_out: y must be a bfloat16 CPU tensor, got ", y.scalar_type());
  TORCH_CHECK(y.stride(2) == 1 || y.size(2) <= 1, "native_head_gemm_out: y's last dim must be contiguous");
  const int64_t N = y.size(2);
  check_head_gemm(x, packed, N);
  run_head_gemm(x, packed, N, y);
}

#endif  // MLA_CORE_ONLY
}  // namespace mla_native
