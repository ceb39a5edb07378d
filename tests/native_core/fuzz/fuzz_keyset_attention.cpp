// libFuzzer target: core::keyset_attention (keyset_attention.cpp), attention over key sets (the
// causal range of the main cache from a per-request window, index lists into it, entries of a
// second cache through its own block table; an attention sink), on every engine this build
// runs, every q dtype and cache layout, fuzzed kv splits and threads. The op layer checks
// ranks, dtypes, widths and passes the lists and the second cache's table as given; the core
// checks validate()'s rules, then validate_keyset's (windows >= 1, every entry -1 or below its
// request's count, the second table's shape and the pages its entries use). Checked here:
// refusal exactly for malformed calls (outputs untouched); else each (token, head) row against
// the fp64 attention over the token's set, each distinct position of a cache counted once (an
// index repeated, or inside the causal range, adds nothing), with the sink; inputs untouched. The
// second cache is the main cache's pages read through another table (rows of one format).
#include "latent_case.h"
#define MLA_CORE_ONLY 1
#include "keyset_attention.cpp"

#include <set>

using namespace fz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const int engine = fuzz_engines(in);
  const int64_t splits = fuzz_splits(in);
  LatentCall c;
  c.make(in, g, in.ConsumeIntegralInRange<int>(0, 3) == 0);
  const bool mal = in.ConsumeIntegralInRange<int>(0, 3) == 0;
  const bool base_ok = c.valid();
  core::KeySet S;
  S.range = in.ConsumeIntegralInRange<int>(0, 3) != 0;
  // each token's request and position (meaningful where the call is well formed)
  const int64_t T = std::max<int64_t>(c.T, 0);
  std::vector<int32_t> req(static_cast<size_t>(T), 0), pos(static_cast<size_t>(T), 0);
  std::vector<int64_t> lens(static_cast<size_t>(std::max<int64_t>(c.B, 1)), 0);
  if (base_ok)
    for (int64_t i = 0; i < c.B; ++i) {
      lens[i] = c.kvl[i];
      for (int64_t j = 0; j < c.cu[i + 1] - c.cu[i]; ++j)
        req[c.cu[i] + j] = static_cast<int32_t>(i), pos[c.cu[i] + j] = static_cast<int32_t>(c.kvl[i] - (c.cu[i + 1] - c.cu[i]) + j);
    }
  // windows
  std::vector<int32_t> window;
  bool valid = base_ok;
  if (c.B > 0 && in.ConsumeBool()) {
    window.resize(static_cast<size_t>(c.B));
    for (auto& w : window) {
      w = static_cast<int32_t>(in.ConsumeIntegralInRange<int64_t>(1, 16));
      if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0) w = in.ConsumeBool() ? 0 : INT32_MIN;
      valid = valid && w >= 1;
    }
    S.window = window.data();
  }
  // the main cache's index list
  std::vector<int32_t> idx;
  if (in.ConsumeBool() && base_ok) {
    S.K = in.ConsumeIntegralInRange<int64_t>(0, 12);
    idx = index_list(in, g, T, S.K, mal, [&](int64_t t) { return lens[req[t]]; });
    S.idx = idx.data(), S.idx_s0 = S.K;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < S.K; ++k) valid = valid && idx[t * S.K + k] >= -1 && idx[t * S.K + k] < lens[req[t]];
  }
  // the second cache: the main cache's pages through a table of its own
  std::vector<int32_t> bt2, len2, idx2;
  int64_t width2 = 0;
  if (in.ConsumeBool() && base_ok && c.ps >= 1 && c.np >= 1) {
    width2 = in.ConsumeIntegralInRange<int64_t>(0, 4);
    S.bt2_rows = c.B + in.ConsumeIntegralInRange<int64_t>(0, 1);
    S.bt2_width = width2, S.bt2_s0 = width2 + in.ConsumeIntegralInRange<int64_t>(0, 1);
    if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0 && S.bt2_rows > 0) S.bt2_rows -= 1;
    if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0 && width2 > 0) S.bt2_s0 = width2 - 1;
    bt2.assign(static_cast<size_t>(std::max<int64_t>(S.bt2_rows * S.bt2_s0, 1)), 0);
    for (auto& e : bt2) {
      e = static_cast<int32_t>(g.range(0, c.np - 1));
      if (mal && in.ConsumeIntegralInRange<int>(0, 15) == 0) e = in.ConsumeBool() ? static_cast<int32_t>(c.np) : -1;
    }
    len2.assign(static_cast<size_t>(c.B), 0);
    std::vector<int64_t> l2(static_cast<size_t>(std::max<int64_t>(c.B, 1)), 0);
    for (int64_t i = 0; i < c.B; ++i) {
      len2[i] = static_cast<int32_t>(in.ConsumeIntegralInRange<int64_t>(0, width2 * c.ps));
      if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0) len2[i] = in.ConsumeBool() ? static_cast<int32_t>(width2 * c.ps + 1) : -1;
      l2[i] = std::clamp<int64_t>(len2[i], 0, width2 * c.ps);
    }
    S.K2 = in.ConsumeIntegralInRange<int64_t>(0, 8);
    idx2 = index_list(in, g, T, S.K2, mal, [&](int64_t t) { return l2[req[t]]; });
    idx2.reserve(1);  // a list of no columns is still a list: its table is checked
    S.idx2 = idx2.data(), S.idx2_s0 = S.K2, S.bt2 = bt2.data(), S.len2 = len2.data();
    S.cache2 = reinterpret_cast<const char*>(c.cache.data()), S.c2_s0 = c.c_s0, S.c2_s1 = c.c_s1;
    S.page_size2 = c.ps, S.num_pages2 = c.np;
    // the rules, read independently: the table's shape, each request's count, each entry and its page
    valid = valid && S.bt2_rows >= c.B && S.bt2_s0 >= S.bt2_width;
    for (int64_t i = 0; i < c.B && valid; ++i)  // the counts of requests with query tokens
      valid = c.cu[i + 1] == c.cu[i] || (len2[i] >= 0 && len2[i] <= width2 * c.ps);
    for (int64_t t = 0; t < T && valid; ++t)
      for (int64_t k = 0; k < S.K2 && valid; ++k) {
        const int64_t e = idx2[t * S.K2 + k];
        valid = e >= -1 && e < len2[req[t]];
        if (valid && e >= 0) {
          const int32_t page = bt2[req[t] * S.bt2_s0 + e / c.ps];
          valid = page >= 0 && page < c.np;
          if (valid) c.fill_row(page * c.c_s0 + (e % c.ps) * c.c_s1, g, !c.finite);  // the rows it reads
        }
      }
  }
  std::vector<float> sink;
  core::Params P = c.params();
  if (in.ConsumeBool() && c.H > 0) {
    sink.resize(static_cast<size_t>(c.H));
    for (auto& x : sink) x = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? -kInf : g.val(3.0f);
    P.sink = sink.data();
  }
  Frozen f_idx, f_idx2, f_bt2;
  f_idx.take(idx.data(), idx.size() * 4, "indices"), f_idx2.take(idx2.data(), idx2.size() * 4, "extra_indices");
  f_bt2.take(bt2.data(), bt2.size() * 4, "second block_table");
  const core::Bounds b{c.T, c.rows, c.width, c.max_page_id};
  const std::string err = core::keyset_attention(P, b, S, static_cast<core::DType>(c.qdt), c.mode, splits,
                                                 make_parallel<core::Parallel>(c.threads), engine);
  c.check_inputs(), f_idx.check(), f_idx2.check(), f_bt2.check();
  if (!valid) {
    FZ_CHECK(!err.empty(), "a malformed keyset call was accepted (B %lld, T %lld, K %lld, K2 %lld)", (long long)c.B,
             (long long)c.T, (long long)S.K, (long long)S.K2);
    FZ_CHECK(c.outputs_untouched(), "a refused call wrote its outputs: %s", err.c_str());
    return 0;
  }
  FZ_CHECK(err.empty(), "a valid keyset call was refused: %s", err.c_str());
  if (!c.finite) return 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = req[t], p = pos[t];
    std::set<int64_t> main;  // distinct positions of the main cache
    if (S.range)
      for (int64_t q = window.empty() ? 0 : std::max<int64_t>(0, p - window[i] + 1); q <= p; ++q) main.insert(q);
    for (int64_t k = 0; k < S.K; ++k)
      if (idx[t * S.K + k] >= 0) main.insert(idx[t * S.K + k]);
    std::vector<int64_t> list;  // a row per distinct position (two positions may share a page)
    for (int64_t q : main) list.push_back(c.row_off(i, q));
    std::set<int64_t> second;  // distinct entries of the second cache, read through bt2
    for (int64_t k = 0; k < S.K2; ++k) {
      const int64_t e = idx2[t * S.K2 + k];
      if (e >= 0 && second.insert(e).second)
        list.push_back(bt2[i * S.bt2_s0 + e / c.ps] * c.c_s0 + (e % c.ps) * c.c_s1);
    }
    for (int64_t h = 0; h < c.H; ++h) c.check_row(t, h, list, sink.empty() ? -INFINITY : sink[h]);
  }
  return 0;
}
