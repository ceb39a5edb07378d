// libFuzzer target: the per-head GEMM core (head_gemm.cpp: pack_heads_items, head_gemm_items, as
// native_pack_heads and native_head_gemm / native_head_gemm_out run them). The op layer checks
// ranks, bf16, packed's shape against x and N, the last-dim contiguity of x and y, returns early
// for T = 0, H = 0 or N = 0, and passes any other strides of x (0 included) and of y (a view of
// a larger buffer: the padding between its rows is a canary here). Checked here: y against the
// fp64 products where the values are finite, the padding untouched, inputs untouched.
#include "fuzz_common.h"
#include "head_gemm.cpp"

using namespace fz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const bool specials = in.ConsumeIntegralInRange<int>(0, 5) == 0;
  // one call in 8 makes one dimension large
  const int big = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(1, 3) : 0;
  const int64_t T = big == 1 ? in.ConsumeIntegralInRange<int64_t>(1, 70) : in.ConsumeIntegralInRange<int64_t>(1, 6);
  const int64_t H = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t K = big == 2 ? in.ConsumeIntegralInRange<int64_t>(0, 200) : in.ConsumeIntegralInRange<int64_t>(0, 40);
  const int64_t N = big == 3 ? in.ConsumeIntegralInRange<int64_t>(1, 200) : in.ConsumeIntegralInRange<int64_t>(1, 70);
  const int64_t threads = in.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t sx1 = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : K + in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t sx0 = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : std::max<int64_t>(H * sx1, 1) + in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t sy1 = N + in.ConsumeIntegralInRange<int64_t>(0, 3), sy0 = H * sy1 + in.ConsumeIntegralInRange<int64_t>(0, 5);
  auto val = [&] { return f_bf16(specials && g.range(0, 63) == 0 ? special(g) : g.val(2.0f)); };
  std::vector<uint16_t> w(static_cast<size_t>(H * K * N)), x(static_cast<size_t>(K == 0 ? 0 : (T - 1) * sx0 + (H - 1) * sx1 + K));
  for (auto& e : w) e = val();
  for (auto& e : x) e = val();
  Frozen fw, fx;
  fw.take(w.data(), w.size() * 2, "w"), fx.take(x.data(), x.size() * 2, "x");
  const int64_t nb = mla_core::cdiv(N, mla_core::kCols), kp = mla_core::cdiv(K, 2);
  std::vector<uint16_t> packed(static_cast<size_t>(H * nb * kp * mla_core::kCols * 2));
  for_items(H * nb, threads, [&](int64_t b, int64_t e) { mla_native::pack_heads_items(w.data(), K, N, packed.data(), b, e); });
  fw.check();
  const std::vector<uint16_t> packed_copy = packed;
  const size_t ylen = static_cast<size_t>((T - 1) * sy0 + (H - 1) * sy1 + N);
  std::vector<uint16_t> y(ylen, static_cast<uint16_t>(kCanary * 257));
  for_items(H * nb, threads, [&](int64_t b, int64_t e) {
    mla_native::head_gemm_items(x.data(), sx0, sx1, T, H, K, packed.data(), N, y.data(), sy0, sy1, b, e);
  });
  fx.check();
  FZ_CHECK(packed == packed_copy, "head_gemm_items wrote the packed weight");
  for (size_t e = 0; e < ylen; ++e) {
    const int64_t t = static_cast<int64_t>(e) / sy0, h = (static_cast<int64_t>(e) % sy0) / sy1, n = (static_cast<int64_t>(e) % sy0) % sy1;
    const bool inside = t < T && h < H && n < N;
    if (!inside) {
      FZ_CHECK(y[e] == static_cast<uint16_t>(kCanary * 257), "y's padding element %zu (t %lld, h %lld, col %lld) was written", e,
               (long long)t, (long long)h, (long long)n);
      continue;
    }
    if (specials) continue;
    double want = 0, mag = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double p = bf16_f(x[t * sx0 + h * sx1 + k]) * static_cast<double>(bf16_f(w[(h * K + k) * N + n]));
      want += p;
      mag += std::fabs(p);
    }
    FZ_CHECK(std::fabs(bf16_f(y[e]) - want) <= std::fabs(want) / 256 + 1e-5 * mag + 1e-30,
             "y[%lld, %lld, %lld] = %.7g, reference %.7g (K %lld)", (long long)t, (long long)h, (long long)n, bf16_f(y[e]), want,
             (long long)K);
  }
  return 0;
}
