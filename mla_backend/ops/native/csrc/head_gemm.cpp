// Per-head GEMM for the absorption weights: q_lat = q_nope · W_UK and o = o_lat · W_UV.
//
//   y[t, h, n] = sum_k x[t, h, k] * w[h, k, n]     x [T, H, K] bf16 (last dim contiguous, any
//                                                  other strides), w [H, K, N] bf16,
//                                                  y [T, H, N] bf16 (new, contiguous)
//
// The weight is packed once per layer (native_pack_heads) into VNNI pairs in blocks of kNB
// output columns: packed[h][nb][k / 2][c][2] = (w[h][k][nb*kNB + c], w[h][k+1][nb*kNB + c]),
// zero-padded to an even K and to whole column blocks, so one work item (head, column block)
// streams a contiguous panel. Each k pair of up to kMR query rows is broadcast as one 32-bit
// pair and multiplied into kMR x (kNB / 16) fp32 accumulators with AVX512-BF16 dot products
// (vdpbf16ps: exact bf16 products, fp32 sums); one rounding to bf16 at the end (nearest even).
// Work items (head, column block) go to at::parallel_for; query rows are looped inside.
// Without AVX512-BF16 the same packed layout is served by a scalar loop (fp32 sums).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "mla_cpu.h"

namespace mla_native {
namespace {

constexpr int64_t kNB = 64;  // output columns per packed block / work item (4 zmm)
constexpr int kMR = 6;       // query rows per register block (24 accumulators)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef MLA_AVX512BF16
// M query rows x kNB columns of one (head, column block): x rows at xs[m] (K bf16 each),
// panel = packed block [Kp / 2][kNB][2], outputs to ys[m] (ncols <= kNB valid columns).
template <int M>
inline void gemm_block(const uint16_t* const* xs, const uint16_t* panel, int64_t K,
                       uint16_t* const* ys, int64_t ncols) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  for (int64_t kp = 0; kp < full; ++kp) {
    const uint16_t* b = panel + kp * kNB * 2;
    __m512bh bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + 32 * j);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, xs[m] + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, bv[j]);
    }
  }
  if (K & 1) {  // last k alone: its pair partner is a zero row of the packed weight
    const uint16_t* b = panel + full * kNB * 2;
    __m512bh bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + 32 * j);
    for (int m = 0; m < M; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[m][K - 1]));
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, bv[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = 16 * j;
    if (c0 >= ncols) break;
    const __mmask16 mask =
        ncols - c0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (ncols - c0)) - 1);
    for (int m = 0; m < M; ++m) {
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[m][j]);
      _mm256_mask_storeu_epi16(ys[m] + c0, mask, v);
    }
  }
}

inline void gemm_rows(int M, const uint16_t* const* xs, const uint16_t* panel, int64_t K,
                      uint16_t* const* ys, int64_t ncols) {
  switch (M) {
    case 1: return gemm_block<1>(xs, panel, K, ys, ncols);
    case 2: return gemm_block<2>(xs, panel, K, ys, ncols);
    case 3: return gemm_block<3>(xs, panel, K, ys, ncols);
    case 4: return gemm_block<4>(xs, panel, K, ys, ncols);
    case 5: return gemm_block<5>(xs, panel, K, ys, ncols);
    default: return gemm_block<6>(xs, panel, K, ys, ncols);
  }
}
#else
inline float bf16_bits_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void gemm_rows(int M, const uint16_t* const* xs, const uint16_t* panel, int64_t K,
                      uint16_t* const* ys, int64_t ncols) {
  for (int m = 0; m < M; ++m) {
    for (int64_t c = 0; c < ncols; ++c) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        s += bf16_bits_to_f32(xs[m][k]) * bf16_bits_to_f32(panel[((k / 2) * kNB + c) * 2 + (k & 1)]);
      ys[m][c] = c10::BFloat16(s).x;
    }
  }
}
#endif

at::Tensor pack_heads(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3, "native_pack_heads: w must be [H, K, N], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "native_pack_heads: w must be bfloat16, got ",
              w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "native_pack_heads: w must be a CPU tensor");
  const int64_t H = w.size(0), K = w.size(1), N = w.size(2);
  const int64_t kp = ceil_div(K, 2), nb = ceil_div(N, kNB);
  auto wc = w.contiguous();
  auto out = at::zeros({H, nb, kp, kNB, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t h = i / nb, blk = i % nb;
      uint16_t* panel = dst + i * kp * kNB * 2;
      const int64_t ncols = std::min(kNB, N - blk * kNB);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < ncols; ++c)
          panel[((k / 2) * kNB + c) * 2 + (k & 1)] = src[(h * K + k) * N + blk * kNB + c];
    }
  });
  return out;
}

at::Tensor head_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 3 && packed.dim() == 5,
              "native_head_gemm: x must be [T, H, K] and packed [H, N / 64, K / 2, 64, 2]; got ",
              x.sizes(), " and ", packed.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "native_head_gemm: bfloat16 only, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "native_head_gemm: CPU tensors");
  TORCH_CHECK(x.stride(2) == 1 || x.size(2) <= 1, "native_head_gemm: x's last dim must be contiguous");
  TORCH_CHECK(packed.is_contiguous(), "native_head_gemm: packed must be contiguous");
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2);
  const int64_t nb = packed.size(1), kp = packed.size(2);
  TORCH_CHECK(packed.size(0) == H && kp == ceil_div(K, 2) && packed.size(3) == kNB &&
                  packed.size(4) == 2 && nb == ceil_div(N, kNB),
              "native_head_gemm: packed ", packed.sizes(), " does not match x ", x.sizes(),
              " and N = ", N);
  auto y = at::empty({T, H, N}, x.options());
  if (T == 0 || N == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t sx0 = x.stride(0), sx1 = x.stride(1);
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) {
    const uint16_t* xs[kMR];
    uint16_t* ys[kMR];
    for (int64_t i = b; i < e; ++i) {
      const int64_t h = i / nb, blk = i % nb;
      const uint16_t* panel = wp + i * kp * kNB * 2;
      const int64_t ncols = std::min(kNB, N - blk * kNB);
      for (int64_t t0 = 0; t0 < T; t0 += kMR) {
        const int M = static_cast<int>(std::min<int64_t>(kMR, T - t0));
        for (int m = 0; m < M; ++m) {
          xs[m] = xp + (t0 + m) * sx0 + h * sx1;
          ys[m] = yp + ((t0 + m) * H + h) * N + blk * kNB;
        }
        gemm_rows(M, xs, panel, K, ys, ncols);
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace mla_native

TORCH_LIBRARY_FRAGMENT(MLA_OPS_NS, m) {
  m.def("native_pack_heads(Tensor w) -> Tensor");
  m.def("native_head_gemm(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(MLA_OPS_NS, CPU, m) {
  m.impl("native_pack_heads", &mla_native::pack_heads);
  m.impl("native_head_gemm", &mla_native::head_gemm);
}
