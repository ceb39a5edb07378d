// libFuzzer target: core::absorbed_attention (absorbed_attention.h) on every engine this build
// runs (the fp32 engine everywhere; the AVX512-BF16 engine at avx512_bf16 / amx; the AMX engine
// where the CPU grants it), every q dtype and cache layout, fuzzed kv splits and threads. The
// op layer (absorbed_attention.cpp) checks ranks, dtypes, widths, softmax_scale, kv_scale and the engine
// bits, and passes num_kv_splits >= 0, B = kv_lens' length with cu_seqlens_q [B + 1], the block
// table's shape and max_page_id as given (the plan's bound, or -1); the core checks the rest
// (validate()). Checked here: refusal exactly when latent_case.h's reading of those rules says
// so (outputs untouched), else every (token, head) row against the fp64 reference over its
// visible positions 0 .. kv_len - n + j; inputs untouched.
#include "latent_case.h"

using namespace fz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const int engine = fuzz_engines(in);
  const int64_t splits = fuzz_splits(in);
  LatentCall c;
  c.make(in, g, true);
  core::Params P = c.params();
  const core::Bounds b{c.T, c.rows, c.width, c.max_page_id};
  const bool valid = c.valid();
  const std::string err = core::absorbed_attention(P, b, static_cast<core::DType>(c.qdt), c.mode, splits,
                                                   make_parallel<core::Parallel>(c.threads), engine);
  c.check_inputs();
  if (!valid) {
    FZ_CHECK(!err.empty(), "a malformed call was accepted (B %lld, T %lld, H %lld, r %lld, ps %lld, pages %lld)",
             (long long)c.B, (long long)c.T, (long long)c.H, (long long)c.r, (long long)c.ps, (long long)c.np);
    FZ_CHECK(c.outputs_untouched(), "a refused call wrote its outputs: %s", err.c_str());
    return 0;
  }
  FZ_CHECK(err.empty(), "a valid call was refused: %s", err.c_str());
  if (!c.finite) return 0;
  std::vector<int64_t> offs;
  for (int64_t i = 0; i < c.B; ++i) {
    const int64_t n = c.cu[i + 1] - c.cu[i], L = c.kvl[i];
    for (int64_t j = 0; j < n; ++j) {
      offs.clear();
      for (int64_t pos = 0; pos <= L - n + j; ++pos) offs.push_back(c.row_off(i, pos));
      for (int64_t h = 0; h < c.H; ++h) c.check_row(c.cu[i] + j, h, offs);
    }
  }
  return 0;
}
