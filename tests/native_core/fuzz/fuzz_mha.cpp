// libFuzzer target: the normal path's MHA core (mha.cpp: mha_pack_items then
// mha_query_items, as attention_with_lse runs them). The op layer checks ranks, shapes, bf16 and
// last-dim contiguity, returns early for H = 0 or Lq = 0, and passes any other strides (0
// included), any Lk, D, Dv >= 0 and any scale. Checked here: o and lse against the fp64
// attention (causal: key j visible to query i iff j <= i; no visible key: o = 0, lse = -inf)
// where the values and scale are finite; inputs untouched.
#include "fuzz_common.h"
#include "mha.cpp"

using namespace fz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const bool specials = in.ConsumeIntegralInRange<int>(0, 5) == 0;
  // one call in 8 makes one dimension large
  const int big = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(1, 4) : 0;
  const int64_t H = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Lq = big == 1 ? in.ConsumeIntegralInRange<int64_t>(1, 100) : in.ConsumeIntegralInRange<int64_t>(1, 20);
  const int64_t Lk = big == 2 ? in.ConsumeIntegralInRange<int64_t>(0, 150) : in.ConsumeIntegralInRange<int64_t>(0, 40);
  const int64_t D = big == 3 ? in.ConsumeIntegralInRange<int64_t>(0, 200) : in.ConsumeIntegralInRange<int64_t>(0, 20);
  const int64_t Dv = big == 4 ? in.ConsumeIntegralInRange<int64_t>(0, 200) : in.ConsumeIntegralInRange<int64_t>(0, 20);
  const bool causal = in.ConsumeBool();
  float scale = static_cast<float>(in.ConsumeIntegralInRange<int>(1, 64)) / 32.0f / std::sqrt(static_cast<float>(std::max<int64_t>(D, 1)));
  if (specials && in.ConsumeBool()) scale = in.ConsumeBool() ? special(g) : (in.ConsumeBool() ? 0.0f : -scale);
  const int64_t threads = in.ConsumeIntegralInRange<int64_t>(1, 2);
  // strides of [H, L, D] views: dense with padding, or 0 (an expanded dim)
  auto strides = [&](int64_t L, int64_t d, int64_t& s0, int64_t& s1) {
    s1 = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : d + in.ConsumeIntegralInRange<int64_t>(0, 2);
    s0 = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : std::max<int64_t>(L * s1, 1) + in.ConsumeIntegralInRange<int64_t>(0, 3);
  };
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;
  strides(Lq, D, qs0, qs1), strides(Lk, D, ks0, ks1), strides(Lk, Dv, vs0, vs1);
  auto extent = [](int64_t n0, int64_t s0, int64_t n1, int64_t s1, int64_t n2) {
    return n0 == 0 || n1 == 0 || n2 == 0 ? 0 : (n0 - 1) * s0 + (n1 - 1) * s1 + n2;
  };
  auto fill = [&](std::vector<uint16_t>& v, int64_t n) {
    v.resize(static_cast<size_t>(n));
    for (auto& x : v) x = f_bf16(specials && g.range(0, 63) == 0 ? special(g) : g.val(2.0f));
  };
  std::vector<uint16_t> q, k, v;
  fill(q, extent(H, qs0, Lq, qs1, D)), fill(k, extent(H, ks0, Lk, ks1, D)), fill(v, extent(H, vs0, Lk, vs1, Dv));
  Frozen fq, fk, fv;
  fq.take(q.data(), q.size() * 2, "q"), fk.take(k.data(), k.size() * 2, "k"), fv.take(v.data(), v.size() * 2, "v");
  std::vector<uint16_t> o(static_cast<size_t>(H * Lq * Dv));
  std::vector<float> lse(static_cast<size_t>(H * Lq));
  mla_native::MhaArgs a{q.data(), qs0, qs1, k.data(), ks0, ks1, v.data(), vs0, vs1, H, Lq, Lk, D, Dv, causal, scale,
                        o.data(), lse.data()};
  const int64_t nkb = a.nkb();
  std::vector<uint16_t> kpk(static_cast<size_t>(H * nkb * a.kblk())), vpk(static_cast<size_t>(H * nkb * a.vblk()));
  for_items(H * nkb, threads, [&](int64_t b, int64_t e) { mla_native::mha_pack_items(a, kpk.data(), vpk.data(), b, e); });
  for_items(H * mla_core::cdiv(Lq, mla_native::kBM), threads,
            [&](int64_t b, int64_t e) { mla_native::mha_query_items(a, kpk.data(), vpk.data(), b, e); });
  fq.check(), fk.check(), fv.check();
  if (specials) return 0;
  // reference; tolerances: lse 1e-3 + 1e-5 |lse| + fp32 dot products; o 2 x bf16's rounding
  // (the bf16 levels round probabilities too) of the largest |v| averaged
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < Lq; ++i) {
      const int64_t nv = causal ? std::min(i + 1, Lk) : Lk;
      const float gl = lse[h * Lq + i];
      const uint16_t* orow = o.data() + (h * Lq + i) * Dv;
      if (nv == 0) {
        FZ_CHECK(gl == -kInf, "row (%lld, %lld) has no key: lse %g", (long long)h, (long long)i, gl);
        for (int64_t d = 0; d < Dv; ++d) FZ_CHECK(bf16_f(orow[d]) == 0.0f, "row (%lld, %lld) has no key: o != 0", (long long)h, (long long)i);
        continue;
      }
      std::vector<double> s(static_cast<size_t>(nv));
      double mx = -INFINITY, mag = 0, vmax = 0;
      for (int64_t j = 0; j < nv; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) {
          const double p = bf16_f(q[h * qs0 + i * qs1 + d]) * static_cast<double>(bf16_f(k[h * ks0 + j * ks1 + d]));
          dot += p;
          mag += std::fabs(p);
        }
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
        for (int64_t d = 0; d < Dv; ++d) vmax = std::max<double>(vmax, std::fabs(bf16_f(v[h * vs0 + j * vs1 + d])));
      }
      double sum = 0;
      for (int64_t j = 0; j < nv; ++j) sum += std::exp(s[j] - mx);
      const double ref_lse = mx + std::log(sum);
      FZ_CHECK(std::fabs(gl - ref_lse) <= 1e-3 + 1e-5 * std::fabs(ref_lse) + 1e-6 * scale * mag,
               "row (%lld, %lld): lse %.7g, reference %.7g", (long long)h, (long long)i, gl, ref_lse);
      for (int64_t d = 0; d < Dv; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < nv; ++j) acc += std::exp(s[j] - mx) * bf16_f(v[h * vs0 + j * vs1 + d]);
        const double want = acc / sum, have = bf16_f(orow[d]);
        FZ_CHECK(std::fabs(have - want) <= (2.0 / 256 + 1e-5) * vmax + 1e-30,
                 "o[%lld, %lld, %lld] = %.7g, reference %.7g", (long long)h, (long long)i, (long long)d, have, want);
      }
    }
  return 0;
}
