// Native CPU kernels for DeepSeek MLA in its absorbed form (MQA over the shared latent rows).
//
//   mla_backend::native_absorbed_attention  paged decode / extend / speculative verify
//   mla_backend::native_fp8_decode          the e4m3 decodes, exposed for their exactness test
//   mla_backend::native_simd_info           whether the AVX512-BF16 engine is compiled in
// (the cache write, native_write_latent, is cache_write.cpp's)
//
// Organisation of the attention kernel
// ------------------------------------
// Work items are (request, block of query rows, kv split). A request's query rows are its
// new tokens x heads, row R = j * H + h; every row of a request reads the same latent rows,
// so one item loads each kv tile (kTileN tokens, through the block table, in place) once and
// uses it for all of its rows, both as K (scores over r + rope: q_lat.c_kv + q_pe.k_pe, the
// stored row as is) and as V (its first r columns). Scores stay fp32 from the dot products
// through the online softmax; row j of a request is causal to kv position kv_len - n + j.
// Long contexts / small batches are cut into kv splits whose normalised partial outputs and
// LSEs are merged by a second pass. Items are scheduled dynamically (largest first) over
// torch.get_num_threads() workers.
//
// Three compute engines (the op's `engine` bit set picks; mla_backend/ops/native/engine.py
// holds the rule that chooses it per CPU and level):
//   * AmxEngine (level amx; q bf16, cache bf16 or fp8; requests of >= kAmxMinRows query rows):
//     AMX-BF16 tiles for both matmuls, items of up to kAmxRows rows (amx_attention.h).
//   * Bf16Engine (AVX512-BF16; q bf16, cache bf16 or fp8): scores with vdpbf16ps over the
//     row dimension (4 query rows x 4 kv rows register block, tree reduction), P.V with the
//     tile repacked pairwise (VNNI) and probabilities rounded to bf16, fp32 accumulators.
//     fp8 rows are decoded to bf16 exactly (e4m3 fits in bf16) and the scale is folded into
//     the score scale and the output, so no precision is lost to dequantisation.
//   * F32Engine (fp16/fp32 q, and bf16 q where the rule prefers it: CPUs whose vdpbf16ps
//     gives fewer FLOPs than their fp32 FMA): the tile converted to fp32, fp32 dot products
//     and fp32 P.V.
// fp8_ds_mla rows (uint8: e4m3 c_kv in tiles of 128, a float32 scale per tile, k_pe in q's
// dtype) are read in place: the bf16 engine sums scale_t * (q_tile . e4m3_tile) + q_pe . k_pe
// and multiplies each probability by its row's tile scale before P.V (per 128-column tile);
// the fp32 engine forms e4m3 x scale in its L1 tile (fp32's rounding of the product, as the
// reference dequantization). No dequantized copy of the cache is made.
//
// This file is the torch layer of the attention: argument checks, Params from the tensors (the
// ops are declared in ops.h and registered in api.cpp); the math is in absorbed_attention.h
// (torch-free).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "absorbed_attention.h"
#include "ops.h"

namespace mla_native {
using namespace core;

// ---- the arguments every op over the attention's engines takes (declared in ops.h) --------
LatentArgs latent_args(const char* op, const at::Tensor& q_lat_in, const at::Tensor& q_pe_in,
                       const at::Tensor& kv_cache, const at::Tensor& block_table_in, const at::Tensor& cu_in,
                       const at::Tensor& kv_lens_in, double softmax_scale,
                       const c10::optional<at::Tensor>& kv_scale, int64_t engine) {
  TORCH_CHECK(q_lat_in.device().is_cpu() && q_pe_in.device().is_cpu() && kv_cache.device().is_cpu(),
              "mla native ", op, ": tensors must be on the CPU, got q_lat on ", q_lat_in.device(),
              ", kv_cache on ", kv_cache.device());
  TORCH_CHECK(q_lat_in.dim() == 3, "q_lat must be [T, H, r], got shape ", q_lat_in.sizes());
  TORCH_CHECK(q_pe_in.dim() == 3, "q_pe must be [T, H, rope], got shape ", q_pe_in.sizes());
  TORCH_CHECK(kv_cache.dim() == 3, "kv_cache must be [num_pages, page_size, r + rope], got shape ",
              kv_cache.sizes());
  LatentArgs a;
  const auto qdt = a.qdt = q_lat_in.scalar_type();
  TORCH_CHECK(qdt == at::kBFloat16 || qdt == at::kHalf || qdt == at::kFloat,
              "q_lat dtype ", qdt, " is not supported; use one of ", dtype_list);
  TORCH_CHECK(q_pe_in.scalar_type() == qdt, "q_pe dtype ", q_pe_in.scalar_type(),
              " differs from q_lat dtype ", qdt);
  const auto cdt = kv_cache.scalar_type();
  const bool fp8 = cdt == at::kFloat8_e4m3fn;
  const bool ds = cdt == at::kByte;  // fp8_ds_mla rows
  TORCH_CHECK(cdt == qdt || fp8 || ds, "kv_cache dtype ", cdt, " is not supported with q dtype ",
              qdt, "; the cache must have q's dtype, be float8_e4m3fn, or uint8 (fp8_ds_mla)");
  a.format = ds ? kDs : (fp8 ? kFp8 : kPlain);
  const int64_t T = a.T = q_lat_in.size(0), H = q_lat_in.size(1), r = q_lat_in.size(2);
  const int64_t rope = q_pe_in.size(2);
  TORCH_CHECK(q_pe_in.size(0) == T && q_pe_in.size(1) == H, "q_pe shape ", q_pe_in.sizes(),
              " does not match q_lat shape ", q_lat_in.sizes());
  const DsLayout dsl(r, rope, q_lat_in.element_size());
  if (ds) {
    TORCH_CHECK(kv_cache.size(2) == dsl.width, "fp8_ds_mla kv_cache last dim ", kv_cache.size(2),
                " != the row width ", dsl.width, " bytes for r = ", r, ", rope = ", rope, " in ",
                qdt);
  } else {
    TORCH_CHECK(kv_cache.size(2) == r + rope, "kv_cache last dim ", kv_cache.size(2),
                " != r + rope = ", r, " + ", rope);
  }
  TORCH_CHECK(kv_cache.stride(2) == 1, "kv_cache last dim must be contiguous, got strides ",
              kv_cache.strides());
  TORCH_CHECK(softmax_scale > 0.0 && std::isfinite(softmax_scale), "softmax_scale ", softmax_scale,
              " must be a finite positive number");
  if (engine < 0) engine = kEngineDefault;
  TORCH_CHECK(engine <= (kEngineBf16 | kEngineAmx), "engine=", engine,
              " is not supported; use a bit set of 1 (AVX512-BF16 engine) and 2 (AMX engine)");
#ifndef MLA_AVX512BF16
  TORCH_CHECK(!(engine & kEngineBf16), "engine=", engine,
              ": this level's build has no AVX512-BF16 engine (levels avx512_bf16 and amx do)");
#endif
  TORCH_CHECK(!(engine & kEngineAmx) || amx_available(), "engine=", engine,
              ": the AMX engine needs level amx and the OS's permission to use AMX tiles");
  a.engine = engine;
  a.q_lat = q_lat_in.stride(2) == 1 ? q_lat_in : q_lat_in.contiguous();
  a.q_pe = (q_pe_in.stride(2) == 1 || rope == 0) ? q_pe_in : q_pe_in.contiguous();

  at::Tensor bt = block_table_in;
  TORCH_CHECK(bt.dim() == 2, "block_table must be [B, max_pages], got shape ", bt.sizes());
  TORCH_CHECK(bt.device().is_cpu(), "block_table must be a CPU tensor, got ", bt.device());
  TORCH_CHECK(bt.scalar_type() == at::kInt || bt.scalar_type() == at::kLong, "block_table dtype ",
              bt.scalar_type(), " is not supported; use int32");
  if (bt.scalar_type() != at::kInt || bt.stride(1) != 1) bt = bt.to(at::kInt).contiguous();
  a.bt = bt;
  a.cu = int32_arg(cu_in, "cu_seqlens_q");
  a.kvl = int32_arg(kv_lens_in, "kv_lens");
  const int64_t B = a.kvl.numel();
  TORCH_CHECK(a.kvl.dim() == 1, "kv_lens must be [B], got shape ", a.kvl.sizes());
  TORCH_CHECK(a.cu.dim() == 1 && a.cu.numel() == B + 1, "cu_seqlens_q must be [B + 1] = [", B + 1,
              "], got shape ", a.cu.sizes());
  float kvs = 1.0f;  // fp8_ds_mla rows hold their own scales: kv_scale is not applied to them
  if (kv_scale.has_value() && kv_scale->defined()) {
    TORCH_CHECK(kv_scale->numel() == 1, "kv_scale must be a 0-d (one element) tensor, got shape ",
                kv_scale->sizes());
    kvs = kv_scale->to(at::kCPU).to(at::kFloat).item<float>();
    TORCH_CHECK(std::isfinite(kvs) && kvs > 0.0f, "kv_scale = ", kvs, " must be finite and > 0");
  }
  if (ds) kvs = 1.0f;

  Params& P = a.P;
  P.H = H, P.r = r, P.rope = rope, P.D = r + rope, P.B = B;
  P.page_size = kv_cache.size(1), P.num_pages = kv_cache.size(0);
  P.bt = bt.data_ptr<int32_t>(), P.bt_s0 = bt.stride(0);
  P.cu = a.cu.data_ptr<int32_t>(), P.kvl = a.kvl.data_ptr<int32_t>();
  const int64_t qes = a.q_lat.element_size();
  P.qlat = static_cast<const char*>(a.q_lat.data_ptr());
  P.ql_s0 = a.q_lat.stride(0) * qes, P.ql_s1 = a.q_lat.stride(1) * qes;
  P.qpe = static_cast<const char*>(a.q_pe.data_ptr());
  P.qp_s0 = a.q_pe.stride(0) * qes, P.qp_s1 = a.q_pe.stride(1) * qes;
  const int64_t ces = kv_cache.element_size();
  P.cache = static_cast<const char*>(kv_cache.data_ptr());
  P.c_s0 = kv_cache.stride(0) * ces, P.c_s1 = kv_cache.stride(1) * ces;
  P.row_bytes = kv_cache.size(2) * ces;
  P.score_scale = static_cast<float>(softmax_scale) * kvs;
  P.out_scale = kvs;
  P.tiles = dsl.tiles, P.ds_scale_off = dsl.scale_off, P.ds_rope_off = dsl.rope_off;
  return a;
}

void set_outputs(LatentArgs& a, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t T = a.T, H = a.P.H, r = a.P.r;
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == a.qdt && out.is_contiguous() &&
                  out.numel() == T * H * r && lse.device().is_cpu() && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.numel() == T * H,
              "out [T, H, r] = [", T, ", ", H, ", ", r, "] in q's dtype ", a.qdt, " and lse [T, H] float32, ",
              "contiguous CPU tensors, expected; got out ", out.scalar_type(), " ", out.sizes(), ", lse ",
              lse.scalar_type(), " ", lse.sizes());
  a.P.out = static_cast<char*>(out.data_ptr());
  a.P.lse = lse.data_ptr<float>();
}

// ---- op: absorbed attention --------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> absorbed_attention(
    const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv_cache,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
    double softmax_scale, const c10::optional<at::Tensor>& kv_scale, int64_t num_kv_splits,
    int64_t max_page_id, int64_t engine) {
  TORCH_CHECK(num_kv_splits >= 0, "num_kv_splits=", num_kv_splits, " must be >= 0 (0 = automatic)");
  LatentArgs a = latent_args("absorbed_attention", q_lat, q_pe, kv_cache, block_table, cu_seqlens_q,
                             kv_lens, softmax_scale, kv_scale, engine);
  at::Tensor out = at::empty({a.T, a.P.H, a.P.r}, a.q_lat.options());
  at::Tensor lse = at::empty({a.T, a.P.H}, a.q_lat.options().dtype(at::kFloat));
  set_outputs(a, out, lse);
  const std::string err = core::absorbed_attention(a.P, a.bounds(max_page_id), dtype_of(a.qdt), a.format,
                                                   num_kv_splits, torch_parallel(), static_cast<int>(a.engine));
  TORCH_CHECK(err.empty(), err);  // a refused index: nothing was read
  return {out, lse};
}

// The kernels' e4m3 decode, exposed for its exactness test: uint8 [N] -> float32 [N] through
// the fp32 engine's path (bf16 = false: value / 256 via the fp16 bit trick, times 256 here) or
// the bf16 engine's (bf16 = true, where compiled in: the byte tables). NaN bytes (0x7f, 0xff)
// read as +-480.
at::Tensor fp8_decode(const at::Tensor& bytes_in, bool bf16) {
  TORCH_CHECK(bytes_in.scalar_type() == at::kByte && bytes_in.device().is_cpu(),
              "fp8_decode takes a CPU uint8 tensor, got ", bytes_in.scalar_type());
  at::Tensor bytes = bytes_in.contiguous().view(-1);
  const int64_t n = bytes.numel();
  at::Tensor out = at::empty({n}, bytes.options().dtype(at::kFloat));
  const uint8_t* src = bytes.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  int64_t d = 0;
#ifdef MLA_AVX512BF16
  if (bf16 && n > 0) {
    std::vector<uint16_t> tmp(round_up(n, 64));
    Bf16Engine<kFp8>::decode(tmp.data(), src, n);
    for (; d < n; ++d) dst[d] = static_cast<float>(c10::BFloat16(tmp[d], c10::BFloat16::from_bits()));
  }
#endif
  widen_e4m3_row(dst + d, src + d, n - d, kFp8Unscale);  // the fp32 engine's decode
  (void)bf16;
  return out;
}

// 1 when the AVX512-BF16 engine was compiled in (bf16 q with bf16/fp8 caches use it).
int64_t simd_info() {
#ifdef MLA_AVX512BF16
  return 1;
#else
  return 0;
#endif
}

}  // namespace mla_native

