// libFuzzer target: the normal path's decompression core (decompress.cpp: pack_latent_panels,
// decompress_items, copy_k_pe, as native_decompress runs them). The op layer checks ranks,
// matching shapes, bf16 and the last-dim contiguity of c_kv / k_pe, returns early for L = 0 or
// H = 0, and passes any row strides (0 included), any weight strides and r, nope, rope, v >= 0.
// Checked here: k [L, H, nope + rope] and v [L, H, v] against the fp64 products (k_pe copied bit
// for bit) where the values are finite; inputs untouched.
#include "fuzz_common.h"
#include "decompress.cpp"

#include <algorithm>

using namespace fz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const bool specials = in.ConsumeIntegralInRange<int>(0, 5) == 0;
  // one call in 8 makes one dimension large
  const int big = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(1, 4) : 0;
  const int64_t L = big == 1 ? in.ConsumeIntegralInRange<int64_t>(1, 1100) : in.ConsumeIntegralInRange<int64_t>(1, 70);
  const int64_t H = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t r = big == 2 ? in.ConsumeIntegralInRange<int64_t>(0, 100) : in.ConsumeIntegralInRange<int64_t>(0, 24);
  const int64_t nope = big == 3 ? in.ConsumeIntegralInRange<int64_t>(0, 70) : in.ConsumeIntegralInRange<int64_t>(0, 20);
  const int64_t rope = in.ConsumeIntegralInRange<int64_t>(0, 16);
  const int64_t vd = big == 4 ? in.ConsumeIntegralInRange<int64_t>(0, 70) : in.ConsumeIntegralInRange<int64_t>(0, 20);
  const int64_t threads = in.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t sc = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : r + in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t sp = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : rope + in.ConsumeIntegralInRange<int64_t>(0, 3);
  auto val = [&] { return f_bf16(specials && g.range(0, 63) == 0 ? special(g) : g.val(2.0f)); };
  std::vector<uint16_t> c_kv(static_cast<size_t>(r == 0 ? 0 : (L - 1) * sc + r)), k_pe(static_cast<size_t>(rope == 0 ? 0 : (L - 1) * sp + rope));
  for (auto& x : c_kv) x = val();
  for (auto& x : k_pe) x = val();
  // a weight [H, a, b]: a dense buffer in a fuzzed dim order (or a dim expanded: stride 0)
  auto weight = [&](int64_t a1, int64_t b1, std::vector<uint16_t>& w, int64_t (&s)[3]) {
    const int64_t n[3] = {H, a1, b1};
    int order[3] = {0, 1, 2};
    for (int i = in.ConsumeIntegralInRange<int>(0, 5); i > 0; --i) std::next_permutation(order, order + 3);
    int64_t st = 1;
    for (int i = 2; i >= 0; --i) s[order[i]] = st, st *= n[order[i]];
    if (in.ConsumeIntegralInRange<int>(0, 7) == 0) s[in.ConsumeIntegralInRange<int>(0, 2)] = 0;
    int64_t ext = 1;
    for (int i = 0; i < 3; ++i) {
      if (n[i] == 0) ext = 0;
    }
    if (ext) for (int i = 0; i < 3; ++i) ext += (n[i] - 1) * s[i];
    w.resize(static_cast<size_t>(ext));
    for (auto& x : w) x = val();
  };
  std::vector<uint16_t> w_uk, w_uv;
  int64_t uk[3], uv[3];
  weight(nope, r, w_uk, uk), weight(r, vd, w_uv, uv);
  Frozen f1, f2, f3, f4;
  f1.take(c_kv.data(), c_kv.size() * 2, "c_kv"), f2.take(k_pe.data(), k_pe.size() * 2, "k_pe");
  f3.take(w_uk.data(), w_uk.size() * 2, "W_UK"), f4.take(w_uv.data(), w_uv.size() * 2, "W_UV");
  std::vector<uint16_t> k(static_cast<size_t>(L * H * (nope + rope))), v(static_cast<size_t>(L * H * vd));
  mla_native::DecompressArgs a{c_kv.data(), sc, k_pe.data(), sp, w_uk.data(), uk[0], uk[1], uk[2],
                               w_uv.data(), uv[0], uv[1], uv[2], L, H, r, nope, rope, vd, k.data(), v.data()};
  const int64_t nlb = mla_core::cdiv(L, mla_core::kCols);
  std::vector<uint16_t> panels(static_cast<size_t>(nlb * mla_core::cdiv(r, 2) * mla_core::kCols * 2));
  for_items(nlb, threads, [&](int64_t b, int64_t e) { mla_native::pack_latent_panels(a, panels.data(), b, e); });
  const int64_t items = 2 * H * mla_core::cdiv(nlb, mla_native::kPanelsPerItem);
  for_items(items, threads, [&](int64_t b, int64_t e) { mla_native::decompress_items(a, panels.data(), b, e); });
  if (rope > 0) for_items(L, threads, [&](int64_t b, int64_t e) { mla_native::copy_k_pe(a, b, e); });
  f1.check(), f2.check(), f3.check(), f4.check();
  if (specials) return 0;
  // tolerance: one bf16 rounding of the fp32 sum of exact products: 2^-8 |sum| + 1e-5 sum |terms|
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < nope + rope + vd; ++d) {
        const bool is_v = d >= nope + rope;
        double want = 0, mag = 0;
        uint16_t have;
        if (!is_v && d >= nope) {
          have = k[(l * H + h) * (nope + rope) + d];
          FZ_CHECK(have == k_pe[l * sp + d - nope], "k[%lld, %lld, %lld] is not k_pe's bits", (long long)l, (long long)h, (long long)d);
          continue;
        }
        for (int64_t x = 0; x < r; ++x) {
          const double c = bf16_f(c_kv[l * sc + x]);
          const double w = is_v ? bf16_f(w_uv[h * uv[0] + x * uv[1] + (d - nope - rope) * uv[2]])
                                : bf16_f(w_uk[h * uk[0] + d * uk[1] + x * uk[2]]);
          want += c * w;
          mag += std::fabs(c * w);
        }
        have = is_v ? v[(l * H + h) * vd + d - nope - rope] : k[(l * H + h) * (nope + rope) + d];
        FZ_CHECK(std::fabs(bf16_f(have) - want) <= std::fabs(want) / 256 + 1e-5 * mag + 1e-30,
                 "%s[%lld, %lld, %lld] = %.7g, reference %.7g (r %lld)", is_v ? "v" : "k", (long long)l, (long long)h,
                 (long long)(is_v ? d - nope - rope : d), bf16_f(have), want, (long long)r);
      }
    }
  return 0;
}
