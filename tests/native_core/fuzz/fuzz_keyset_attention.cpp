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
//
// One input in four runs core::v4_slot_attention instead (fuzz_v4: DeepSeek-V4's 584-byte fp8
// rows read in place, vLLM's per-token flat slots into a window and a compressed cache): fuzzed
// page sizes, page bytes and strides (pooled pages, some too small), slots past their cache,
// repeated and negative ones; refusal exactly for malformed calls, else every row against the
// fp64 attention over the distinct rows each token lists, decoded here from the bytes.
#include "latent_case.h"
#define MLA_CORE_ONLY 1
#include "keyset_attention.cpp"

#include <set>

using namespace fz;

// One V4 cache of fuzz_v4: its pages (exact bytes: the last page ends at page_bytes), slots.
struct V4Cache {
  int64_t ps = 1, np = 0, page_bytes = 0, stride = 0, K = 0;
  std::vector<uint8_t> bytes;
  std::vector<int64_t> slots;  // [T, K]
  // the row at slot s decoded in fp64: e4m3 x 2^(scale byte - 127), then the bf16 RoPE part
  std::vector<double> row(int64_t s) const {
    const uint8_t* page = bytes.data() + (s / ps) * stride;
    const uint8_t* d = page + (s % ps) * 576;
    const uint8_t* sc = page + ps * 576 + (s % ps) * 8;
    std::vector<double> v(512);
    for (int64_t j = 0; j < 448; ++j) v[j] = std::ldexp(static_cast<double>(e4m3_f(d[j])), sc[j / 64] - 127);
    for (int64_t j = 0; j < 64; ++j) {
      uint16_t h;
      std::memcpy(&h, d + 448 + 2 * j, 2);
      v[448 + j] = bf16_f(h);
    }
    return v;
  }
};

static int fuzz_v4(FuzzedDataProvider& in, Rng& g, int engine, int64_t splits) {
  constexpr float kScale = 0.0625f;  // softmax scale
  const bool mal = in.ConsumeIntegralInRange<int>(0, 3) == 0;
  const int qdt = in.ConsumeIntegralInRange<int>(0, 2);
  const int64_t T = in.ConsumeIntegralInRange<int64_t>(0, 3), H = in.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t threads = in.ConsumeIntegralInRange<int64_t>(1, 3);
  bool valid = true;
  V4Cache cs[2];
  for (int k = 0; k < 2; ++k) {
    V4Cache& c = cs[k];
    c.ps = in.ConsumeIntegralInRange<int64_t>(1, 6);
    c.np = in.ConsumeIntegralInRange<int64_t>(0, 3);
    c.K = in.ConsumeIntegralInRange<int64_t>(0, k == 0 ? 9 : 5);
    const int64_t used = c.ps * 584;
    c.page_bytes = used + in.ConsumeIntegralInRange<int64_t>(0, 1) * 8;
    c.stride = c.page_bytes + in.ConsumeIntegralInRange<int64_t>(0, 2) * 100;
    if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0) c.page_bytes = used - 1, c.stride = std::max(c.stride, used);
    if (mal && in.ConsumeIntegralInRange<int>(0, 7) == 0) c.stride = used - 8;
    if (mal && in.ConsumeIntegralInRange<int>(0, 15) == 0) c.ps = 0;
    if (c.ps >= 1 && c.K > 0) {
      if (c.np > 0 && c.page_bytes < used) valid = false;
      if (c.np > 1 && c.stride < used) valid = false;
    }
    if (c.ps < 1) valid = false;
    const int64_t n = c.np * std::max<int64_t>(c.ps, 1);
    c.bytes.assign(static_cast<size_t>(c.np > 0 ? (c.np - 1) * c.stride + c.page_bytes : 0), 0);
    for (auto& b : c.bytes) b = static_cast<uint8_t>(g.next());  // padding and unlisted rows: anything
    c.slots.assign(static_cast<size_t>(T * c.K), -1);
    for (auto& s : c.slots) {
      const int kind = in.ConsumeIntegralInRange<int>(0, 15);
      if (kind == 0) s = -1;
      else if (kind == 1) s = -static_cast<int64_t>(g.range(2, 1 << 20));
      else if (mal && kind == 2) s = in.ConsumeBool() ? n : INT64_MAX;
      else if (n > 0) s = g.range(0, n - 1);
      if (s >= n) valid = false;
    }
    if (c.ps < 1 || c.page_bytes < used) continue;
    for (int64_t s : c.slots) {  // the rows read: finite e4m3 values, scales near 1, finite bf16
      if (s < 0 || s >= n) continue;
      uint8_t* page = c.bytes.data() + (s / c.ps) * c.stride;
      uint8_t* d = page + (s % c.ps) * 576;
      for (int64_t j = 0; j < 448; ++j) d[j] = f_e4m3(g.val(2.0f));
      for (int64_t j = 0; j < 64; ++j) {
        const uint16_t h = f_bf16(g.val(2.0f));
        std::memcpy(d + 448 + 2 * j, &h, 2);
      }
      for (int64_t j = 0; j < 7; ++j) page[c.ps * 576 + (s % c.ps) * 8 + j] = static_cast<uint8_t>(g.range(121, 130));
    }
  }
  const int64_t qes = dt_size(qdt), q_s1 = 512 + in.ConsumeIntegralInRange<int64_t>(0, 1) * 16;
  std::vector<uint8_t> q(static_cast<size_t>(std::max<int64_t>(T * H * q_s1 * qes, 1)));
  for (int64_t e = 0; e < T * H * q_s1; ++e) put(q.data() + e * qes, qdt, g.val(0.1f));
  std::vector<float> sink;
  if (in.ConsumeBool()) {
    sink.resize(static_cast<size_t>(H));
    for (auto& x : sink) x = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? -kInf : g.val(3.0f);
  }
  std::vector<uint8_t> out(static_cast<size_t>(T * H * 512 * qes), kCanary);
  std::vector<float> lse(static_cast<size_t>(T * H), kNaN);
  core::V4Slots vs[2];
  for (int k = 0; k < 2; ++k) {
    const V4Cache& c = cs[k];
    vs[k].cache = reinterpret_cast<const char*>(c.bytes.data());
    vs[k].num_pages = c.np, vs[k].page_bytes = c.page_bytes, vs[k].page_stride = c.stride, vs[k].page_size = c.ps;
    vs[k].slots = c.slots.data(), vs[k].K = c.K, vs[k].slots_s0 = c.K;
  }
  Frozen fq, fc0, fc1, fs0, fs1;
  fq.take(q.data(), q.size(), "q"), fc0.take(cs[0].bytes.data(), cs[0].bytes.size(), "window cache");
  fc1.take(cs[1].bytes.data(), cs[1].bytes.size(), "compressed cache");
  fs0.take(cs[0].slots.data(), cs[0].slots.size() * 8, "window slots");
  fs1.take(cs[1].slots.data(), cs[1].slots.size() * 8, "compressed slots");
  const std::string err = core::v4_slot_attention(
      reinterpret_cast<const char*>(q.data()), T, H, H * q_s1 * qes, q_s1 * qes, static_cast<core::DType>(qdt), vs[0],
      vs[1], sink.empty() ? nullptr : sink.data(), kScale, splits, reinterpret_cast<char*>(out.data()),
      lse.data(), make_parallel<core::Parallel>(threads), engine & core::kEngineBf16);
  fq.check(), fc0.check(), fc1.check(), fs0.check(), fs1.check();
  if (!valid) {
    FZ_CHECK(!err.empty(), "a malformed v4 slot call was accepted (T %lld, K %lld / %lld)", (long long)T,
             (long long)cs[0].K, (long long)cs[1].K);
    for (uint8_t b : out) FZ_CHECK(b == kCanary, "a refused v4 slot call wrote out: %s", err.c_str());
    return 0;
  }
  FZ_CHECK(err.empty(), "a valid v4 slot call was refused: %s", err.c_str());
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::vector<double>> rows;  // the distinct rows token t lists, per cache
    for (const V4Cache& c : cs) {
      std::set<int64_t> seen;
      for (int64_t j = 0; j < c.K; ++j)
        if (c.slots[t * c.K + j] >= 0 && seen.insert(c.slots[t * c.K + j]).second) rows.push_back(c.row(c.slots[t * c.K + j]));
    }
    for (int64_t h = 0; h < H; ++h) {
      const double sk = sink.empty() ? -INFINITY : sink[h];
      const uint8_t* qr = q.data() + (t * H * q_s1 + h * q_s1) * qes;
      std::vector<double> s(rows.size()), o(512, 0.0);
      double mx = sk, vmax = 0;
      for (size_t c = 0; c < rows.size(); ++c) {
        double dot = 0;
        for (int64_t d = 0; d < 512; ++d) dot += get(qr + d * qes, qdt) * rows[c][d], vmax = std::max(vmax, std::fabs(rows[c][d]));
        s[c] = dot * kScale;
        mx = std::max(mx, s[c]);
      }
      double sum = sk > -INFINITY ? std::exp(sk - mx) : 0.0;
      for (size_t c = 0; c < rows.size(); ++c) {
        const double p = std::exp(s[c] - mx);
        sum += p;
        for (int64_t d = 0; d < 512; ++d) o[d] += p * rows[c][d];
      }
      const double ref_lse = rows.empty() && sk == -INFINITY ? -INFINITY : mx + std::log(sum);
      const float got_lse = lse[t * H + h];
      FZ_CHECK(ref_lse == -INFINITY ? got_lse == -INFINITY : std::fabs(got_lse - ref_lse) <= 1e-3 + 1e-5 * std::fabs(ref_lse),
               "v4 row (%lld, %lld) of %zu rows: lse %.7g, reference %.7g", (long long)t, (long long)h, rows.size(),
               got_lse, ref_lse);
      const double tol = (2 * dt_eps(qdt) + 1e-5) * vmax + 1e-30;
      for (int64_t d = 0; d < 512; ++d) {
        const double want = rows.empty() ? 0.0 : o[d] / sum, have = get(out.data() + ((t * H + h) * 512 + d) * qes, qdt);
        FZ_CHECK(std::fabs(have - want) <= tol, "v4 row (%lld, %lld) of %zu rows: out[%lld] = %.7g, reference %.7g (qdt %d)",
                 (long long)t, (long long)h, rows.size(), (long long)d, have, want, qdt);
      }
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const int engine = fuzz_engines(in);
  const int64_t splits = fuzz_splits(in);
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) return fuzz_v4(in, g, engine, splits);
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
