// libFuzzer target: core::sparse_attention (sparse_attention.cpp), DSA's sparse absorbed
// attention, on every engine this build runs, every q dtype and cache layout. The op layer
// checks ranks, dtypes, widths and the engine bits, passes indices [T, K] and token_req [T]
// int32 contiguous (any values), cu_seqlens_q [B + 1] and the block table as given; the core
// checks validate()'s rules, token_req and every index (-1 = no entry, else < its request's
// kv length). Checked here: refusal exactly for malformed calls (outputs untouched); else each
// (token, head) row against the fp64 attention over its valid entries (o = 0, lse = -inf for
// none); a list with a repeated entry is either refused or has each distinct position counted
// once (the project's rule for repeated indices); inputs untouched.
#include "latent_case.h"
#define MLA_CORE_ONLY 1
#include "sparse_attention.cpp"

#include <set>

using namespace fz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const int engine = fuzz_engines(in);
  LatentCall c;
  c.make(in, g, in.ConsumeIntegralInRange<int>(0, 3) == 0);
  const int64_t T = c.T;
  const int64_t K = in.ConsumeIntegralInRange<int>(0, 15) == 0 ? in.ConsumeIntegralInRange<int64_t>(0, 600)
                                                               : in.ConsumeIntegralInRange<int64_t>(0, 12);
  const bool mal = in.ConsumeIntegralInRange<int>(0, 3) == 0;
  // token_req: each token's request by cu_seqlens_q (the plan's), or a malformed one
  std::vector<int32_t> treq(static_cast<size_t>(T), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < c.B; ++i)
      if (c.cu[i] <= t && t < c.cu[i + 1]) treq[t] = static_cast<int32_t>(i);
    if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0)
      treq[t] = in.ConsumeBool() ? static_cast<int32_t>(in.ConsumeIntegralInRange<int64_t>(-1, c.B))
                                 : (in.ConsumeBool() ? INT32_MAX : INT32_MIN);
  }
  std::vector<int32_t> idx = index_list(in, g, T, K, mal, [&](int64_t t) -> int64_t {
    return treq[t] >= 0 && treq[t] < c.B ? c.kvl[treq[t]] : 0;
  });
  Frozen f_idx, f_treq;
  f_idx.take(idx.data(), idx.size() * 4, "indices");
  f_treq.take(treq.data(), treq.size() * 4, "token_req");
  core::Params P = c.params();
  const core::Bounds b{c.T, c.rows, c.width, c.max_page_id};
  core::SparseIndex S;
  S.idx = idx.data(), S.K = K, S.idx_s0 = K, S.tok_req = treq.data();
  // the rules: validate()'s, then each token's request (the one whose cu_seqlens_q range holds
  // it) and each entry
  bool valid = c.valid(), dups = false;
  for (int64_t t = 0; t < T && valid; ++t) {
    const int64_t req = treq[t];
    valid = req >= 0 && req < c.B && c.cu[req] <= t && t < c.cu[req + 1];
    std::set<int32_t> seen;
    for (int64_t k = 0; k < K && valid; ++k) {
      const int32_t e = idx[t * K + k];
      valid = e >= -1 && e < c.kvl[req];
      if (e >= 0) dups = dups || !seen.insert(e).second;
    }
  }
  const std::string err = core::sparse_attention(P, b, S, static_cast<core::DType>(c.qdt), c.mode,
                                                 make_parallel<core::Parallel>(c.threads), engine);
  c.check_inputs(), f_idx.check(), f_treq.check();
  if (!valid || (dups && !err.empty())) {
    FZ_CHECK(!err.empty(), "a malformed sparse call was accepted (B %lld, T %lld, K %lld)", (long long)c.B,
             (long long)T, (long long)K);
    FZ_CHECK(c.outputs_untouched(), "a refused call wrote its outputs: %s", err.c_str());
    return 0;
  }
  FZ_CHECK(err.empty(), "a valid sparse call was refused: %s", err.c_str());
  if (!c.finite) return 0;
  std::vector<int64_t> offs;
  for (int64_t t = 0; t < T; ++t) {
    offs.clear();
    std::set<int32_t> distinct;
    for (int64_t k = 0; k < K; ++k)
      if (idx[t * K + k] >= 0 && distinct.insert(idx[t * K + k]).second)
        offs.push_back(c.row_off(treq[t], idx[t * K + k]));
    for (int64_t h = 0; h < c.H; ++h) c.check_row(t, h, offs);
  }
  return 0;
}
