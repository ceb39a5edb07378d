// The latent cache write's torch layer:
//
//   mla_backend::native_write_latent   [c_kv ; k_pe] rows into the paged cache, in place
//                                      (bf16/fp16/fp32, fp8 e4m3fn + per-tensor scale, fp8_ds_mla
//                                      uint8 rows bit-identical to the torch writer
//                                      CacheLayout.pack)
//
// Argument checks and WriteParams from the tensors (the op is declared in ops.h and registered
// in api.cpp); the math is in cache_writer.h (torch-free).
#include <ATen/ATen.h>

#include <string>

#include "cache_writer.h"
#include "ops.h"

namespace mla_native {
using namespace core;
void write_latent(const at::Tensor& kv_cache, const at::Tensor& c_kv_in, const at::Tensor& k_pe_in,
                  const at::Tensor& slot_mapping_in, const c10::optional<at::Tensor>& kv_scale) {
  TORCH_CHECK(kv_cache.device().is_cpu() && c_kv_in.device().is_cpu() && k_pe_in.device().is_cpu() &&
                  slot_mapping_in.device().is_cpu(),
              "mla native write_latent: tensors must be on the CPU");
  TORCH_CHECK(kv_cache.dim() == 3, "kv_cache must be [num_pages, page_size, r + rope], got shape ",
              kv_cache.sizes());
  TORCH_CHECK(kv_cache.stride(2) == 1, "kv_cache last dim must be contiguous");
  TORCH_CHECK(c_kv_in.dim() == 2 && k_pe_in.dim() == 2, "c_kv must be [T, r] and k_pe [T, rope], got ",
              c_kv_in.sizes(), " and ", k_pe_in.sizes());
  const int64_t T = c_kv_in.size(0), r = c_kv_in.size(1), rope = k_pe_in.size(1);
  TORCH_CHECK(k_pe_in.size(0) == T, "k_pe has ", k_pe_in.size(0), " rows, c_kv has ", T);
  const auto cdt = kv_cache.scalar_type();
  const bool fp8 = cdt == at::kFloat8_e4m3fn;
  const bool ds = cdt == at::kByte;  // fp8_ds_mla: k_pe is stored in c_kv's dtype
  const DsLayout dsl(r, rope, c_kv_in.element_size());
  if (ds) {
    TORCH_CHECK(kv_cache.size(2) == dsl.width, "fp8_ds_mla kv_cache last dim ", kv_cache.size(2),
                " != the row width ", dsl.width, " bytes for r = ", r, ", rope = ", rope,
                " with k_pe in ", c_kv_in.scalar_type());
  } else {
    TORCH_CHECK(kv_cache.size(2) == r + rope, "kv_cache last dim ", kv_cache.size(2),
                " != r + rope = ", r, " + ", rope);
  }
  TORCH_CHECK(slot_mapping_in.dim() == 1 && slot_mapping_in.numel() >= T, "slot_mapping must be [>= ",
              T, "], got shape ", slot_mapping_in.sizes());
  TORCH_CHECK(slot_mapping_in.scalar_type() == at::kInt || slot_mapping_in.scalar_type() == at::kLong,
              "slot_mapping dtype ", slot_mapping_in.scalar_type(), " is not supported; use int32/int64");
  TORCH_CHECK(ds || fp8 || cdt == at::kBFloat16 || cdt == at::kHalf || cdt == at::kFloat, "kv_cache dtype ",
              cdt, " is not supported; use one of ", dtype_list);
  for (const auto* t : {&c_kv_in, &k_pe_in}) {
    auto dt = t->scalar_type();
    TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat, "c_kv/k_pe dtype ", dt,
                " is not supported; use bfloat16, float16 or float32");
  }
  if (T == 0) return;
  at::Tensor c_kv = c_kv_in.to(at::kFloat).contiguous();
  at::Tensor k_pe = k_pe_in.to(at::kFloat).contiguous();
  at::Tensor slots = slot_mapping_in.slice(0, 0, T).to(at::kLong).contiguous();
  float kvs = 1.0f;
  if (fp8 && kv_scale.has_value() && kv_scale->defined()) {
    TORCH_CHECK(kv_scale->numel() == 1, "kv_scale must be a 0-d tensor, got shape ", kv_scale->sizes());
    kvs = kv_scale->to(at::kCPU).to(at::kFloat).item<float>();
  }
  const int64_t es = kv_cache.element_size();
  WriteParams W;
  W.cache = static_cast<char*>(kv_cache.data_ptr());
  W.c_s0 = kv_cache.stride(0) * es;
  W.c_s1 = kv_cache.stride(1) * es;
  W.page_size = kv_cache.size(1);
  W.num_pages = kv_cache.size(0);
  W.mode = ds ? kDs : (fp8 ? kFp8 : kPlain);
  W.cache_dt = dtype_of(cdt);
  W.rope_dt = dtype_of(c_kv_in.scalar_type());
  W.r = r;
  W.rope = rope;
  W.T = T;
  W.c_kv = c_kv.data_ptr<float>();
  W.k_pe = k_pe.data_ptr<float>();
  W.slots = slots.data_ptr<int64_t>();
  W.kv_scale = kvs;
  const std::string err = core::write_latent(W, torch_parallel());
  TORCH_CHECK(err.empty(), err);  // a refused slot: nothing was written
}

}  // namespace mla_native
