// ops.h: the torch layer's one header. Every op the extension registers is declared here, with
// the file that defines it (one file per op, each over its torch-free core); api.cpp registers
// them all, with their schemas, under MLA_OPS_NS. Also the helpers every torch-layer file
// shares (threads through at::parallel_for, the storage dtype of a tensor, int32 index tensors,
// the checked arguments of the ops over the absorbed attention's engines).
// Not part of the torch-free cores: the core test driver never includes it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <tuple>

#include "attention_params.h"

namespace mla_native {

// ---- the ops (schemas in api.cpp) ----------------------------------------------------------
// absorbed_attention.cpp: the absorbed MLA attention over the paged latent cache; the kernels'
// e4m3 decode (for its exactness test); whether the AVX512-BF16 engine is compiled in
std::tuple<at::Tensor, at::Tensor> absorbed_attention(
    const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv_cache, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens, double softmax_scale,
    const c10::optional<at::Tensor>& kv_scale, int64_t num_kv_splits, int64_t max_page_id, int64_t engine);
at::Tensor fp8_decode(const at::Tensor& bytes, bool bf16);
int64_t simd_info();

// cache_write.cpp: [c_kv ; k_pe] rows into the paged latent cache, in place
void write_latent(const at::Tensor& kv_cache, const at::Tensor& c_kv, const at::Tensor& k_pe,
                  const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& kv_scale);

// head_gemm.cpp: the per-head absorption GEMMs over packed bf16 weights
at::Tensor pack_heads(const at::Tensor& w);
at::Tensor head_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n);
void head_gemm_out(const at::Tensor& x, const at::Tensor& packed, at::Tensor y);

// mha.cpp: the normal path's MHA with its log-sum-exp (bf16)
std::tuple<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, bool causal, double scale);

// decompress.cpp: the normal path's c_kv · W_UK^T / c_kv · W_UV (bf16)
std::tuple<at::Tensor, at::Tensor> decompress(const at::Tensor& c_kv, const at::Tensor& k_pe,
                                              const at::Tensor& W_UK, const at::Tensor& W_UV);

// indexer.cpp: DSA's lightning indexer, its causal top-k (into out) or its logits; ratio > 1:
// over compressed keys (one per ratio tokens, DeepSeek-V4), kv_lens still counting tokens
void indexer_topk(const at::Tensor& q_I, const at::Tensor& weights, const at::Tensor& index_cache,
                  const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                  int64_t quant_block_size, int64_t topk, int64_t max_page_id, const at::Tensor& out,
                  int64_t ratio);
at::Tensor indexer_logits(const at::Tensor& q_I, const at::Tensor& weights, const at::Tensor& index_cache,
                          const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                          int64_t quant_block_size, int64_t width, int64_t max_page_id, int64_t ratio);

// sparse_attention.cpp: DSA's sparse absorbed attention (into out / lse)
void sparse_attention(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                      const at::Tensor& indices, const at::Tensor& token_req, double softmax_scale,
                      const c10::optional<at::Tensor>& kv_scale, int64_t max_page_id, int64_t engine,
                      const at::Tensor& out, const at::Tensor& lse);

// sparse_mha.cpp: DSA's sparse MHA, the normal path's MHA under a per-query-row mask (bf16)
std::tuple<at::Tensor, at::Tensor> masked_attention_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& mask,
                                                             double scale);
// keyset_attention.cpp: absorbed attention over key sets (causal range with a window, index
// lists into the main and a second cache, per-head sink; into out / lse)
void keyset_attention(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                      bool range, const c10::optional<at::Tensor>& window, const c10::optional<at::Tensor>& indices,
                      const c10::optional<at::Tensor>& cache2, const c10::optional<at::Tensor>& block_table2,
                      const c10::optional<at::Tensor>& lens2, const c10::optional<at::Tensor>& indices2,
                      const c10::optional<at::Tensor>& sink, double softmax_scale,
                      const c10::optional<at::Tensor>& kv_scale, int64_t max_page_id, int64_t num_kv_splits,
                      int64_t engine, const at::Tensor& out, const at::Tensor& lse);
// keyset_attention.cpp: DeepSeek-V4 attention over flat slots of a window and a compressed cache
// in V4's 584-byte fp8 page layout, read in place (vLLM's flash_mla_with_kvcache_cpu contract)
void v4_slot_attention(const at::Tensor& q, const at::Tensor& window_cache, const at::Tensor& window_slots,
                       int64_t window_page_size, const c10::optional<at::Tensor>& compressed_cache,
                       const c10::optional<at::Tensor>& compressed_slots, int64_t compressed_page_size,
                       const c10::optional<at::Tensor>& sink, double softmax_scale, int64_t num_kv_splits,
                       int64_t engine, const at::Tensor& out, const at::Tensor& lse);

// ---- shared by the torch layer -------------------------------------------------------------
// the latent dtypes the absorbed attention and the cache write take (their errors name them)
inline constexpr const char* dtype_list =
    "bfloat16, float16, float32 (cache also float8_e4m3fn, uint8 fp8_ds_mla)";

// the cores' threads: torch's at::parallel_for over torch.get_num_threads() workers
inline core::Parallel torch_parallel() {
  core::Parallel par;
  par.threads = std::max<int64_t>(1, at::get_num_threads());
  par.for_range = [](int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    at::parallel_for(0, n, grain, fn);
  };
  return par;
}

// the cores' storage dtype of a bf16 / fp16 / fp32 tensor (callers checked it is one of them)
inline core::DType dtype_of(at::ScalarType t) {
  return t == at::kBFloat16 ? core::DType::kBF16 : (t == at::kHalf ? core::DType::kF16 : core::DType::kF32);
}

// an index / length argument as the cores read it: a CPU int32 or int64 tensor, as contiguous
// int32 (a copy unless it already is one)
inline at::Tensor int32_arg(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " dtype ", t.scalar_type(),
              " is not supported; use int32");
  return t.to(at::kInt).contiguous();
}

// The arguments every op over the absorbed attention's engines takes alike (absorbed, sparse and
// key-set attention), checked once by latent_args (absorbed_attention.cpp; `op` names the op in
// the device error): q_lat [T, H, r] / q_pe [T, H, rope] in bf16 / fp16 / fp32 (last dim made
// contiguous), kv_cache [pages, page_size, W] in q's dtype, float8_e4m3fn or uint8 fp8_ds_mla
// rows, block_table [B, pages] / cu_seqlens_q [B + 1] / kv_lens [B] as int32, softmax_scale > 0,
// kv_scale (a one-element tensor, not applied to fp8_ds_mla rows), engine (-1: the level's
// default). Holds the tensors P points into; P is filled but for out / lse (set_outputs: out
// [T, H, r] in q's dtype and lse [T, H] float32, contiguous) and an op's own fields.
struct LatentArgs {
  at::Tensor q_lat, q_pe, bt, cu, kvl;
  core::Params P;
  at::ScalarType qdt = at::kFloat;
  int format = core::kPlain;  // core::kPlain / kFp8 / kDs
  int64_t T = 0, engine = 0;
  core::Bounds bounds(int64_t max_page_id) const { return {T, bt.size(0), bt.size(1), max_page_id}; }
};
LatentArgs latent_args(const char* op, const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                       double softmax_scale, const c10::optional<at::Tensor>& kv_scale, int64_t engine);
void set_outputs(LatentArgs& a, const at::Tensor& out, const at::Tensor& lse);

}  // namespace mla_native
