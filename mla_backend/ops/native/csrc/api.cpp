// api.cpp: the extension's one registration. Every op, its schema and its CPU kernel (declared in
// ops.h, defined one file per op) under MLA_OPS_NS (mla_backend_<level>: one build per ISA level,
// -DMLA_OPS_NS from mla_backend/ops/native/isa.py). The fake (meta) functions of these schemas
// are in mla_backend/ops/native/build.py (FAKES), checked against the schemas registered here
// when a build loads; the Python wrappers (mla_backend/ops/native/ops.py) fill the arguments from
// the seam's records.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(MLA_OPS_NS, m) {
  // absorbed_attention.cpp
  m.def(
      "native_absorbed_attention(Tensor q_lat, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_lens, float softmax_scale, Tensor? kv_scale=None, "
      "int num_kv_splits=0, int max_page_id=-1, int engine=-1) -> (Tensor, Tensor)");
  m.def("native_fp8_decode(Tensor bytes, bool bf16) -> Tensor");
  m.def("native_simd_info() -> int", &mla_native::simd_info);
  // cache_write.cpp
  m.def(
      "native_write_latent(Tensor(a!) kv_cache, Tensor c_kv, Tensor k_pe, Tensor slot_mapping, "
      "Tensor? kv_scale=None) -> ()");
  // head_gemm.cpp
  m.def("native_pack_heads(Tensor w) -> Tensor");
  m.def("native_head_gemm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("native_head_gemm_out(Tensor x, Tensor packed, Tensor(a!) y) -> ()");
  // mha.cpp
  m.def("native_attention_with_lse(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)");
  // decompress.cpp
  m.def("native_decompress(Tensor c_kv, Tensor k_pe, Tensor W_UK, Tensor W_UV) -> (Tensor, Tensor)");
  // indexer.cpp
  m.def(
      "native_indexer_topk(Tensor q_I, Tensor weights, Tensor index_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_lens, int quant_block_size, int topk, int max_page_id, "
      "Tensor(a!) out, int ratio=1) -> ()");
  m.def(
      "native_indexer_logits(Tensor q_I, Tensor weights, Tensor index_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_lens, int quant_block_size, int width, int max_page_id, "
      "int ratio=1) -> Tensor");
  // sparse_attention.cpp
  m.def(
      "native_sparse_attention(Tensor q_lat, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_lens, Tensor indices, Tensor token_req, float softmax_scale, "
      "Tensor? kv_scale, int max_page_id, int engine, Tensor(a!) out, Tensor(b!) lse) -> ()");
  // sparse_mha.cpp
  m.def(
      "native_masked_attention_with_lse(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> "
      "(Tensor, Tensor)");
  // keyset_attention.cpp
  m.def(
      "native_keyset_attention(Tensor q_lat, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
      "Tensor cu_seqlens_q, Tensor kv_lens, bool range, Tensor? window, Tensor? indices, Tensor? cache2, "
      "Tensor? block_table2, Tensor? lens2, Tensor? indices2, Tensor? sink, float softmax_scale, "
      "Tensor? kv_scale, int max_page_id, int num_kv_splits, int engine, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def(
      "native_v4_slot_attention(Tensor q, Tensor window_cache, Tensor window_slots, int window_page_size, "
      "Tensor? compressed_cache, Tensor? compressed_slots, int compressed_page_size, Tensor? sink, "
      "float softmax_scale, int num_kv_splits, int engine, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(MLA_OPS_NS, CPU, m) {
  m.impl("native_absorbed_attention", &mla_native::absorbed_attention);
  m.impl("native_fp8_decode", &mla_native::fp8_decode);
  m.impl("native_write_latent", &mla_native::write_latent);
  m.impl("native_pack_heads", &mla_native::pack_heads);
  m.impl("native_head_gemm", &mla_native::head_gemm);
  m.impl("native_head_gemm_out", &mla_native::head_gemm_out);
  m.impl("native_attention_with_lse", &mla_native::attention_with_lse);
  m.impl("native_decompress", &mla_native::decompress);
  m.impl("native_indexer_topk", &mla_native::indexer_topk);
  m.impl("native_indexer_logits", &mla_native::indexer_logits);
  m.impl("native_sparse_attention", &mla_native::sparse_attention);
  m.impl("native_masked_attention_with_lse", &mla_native::masked_attention_with_lse);
  m.impl("native_keyset_attention", &mla_native::keyset_attention);
  m.impl("native_v4_slot_attention", &mla_native::v4_slot_attention);
}
