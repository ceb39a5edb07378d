// Self-test of the torch-free attention core (mla_backend/ops/native/csrc/attention_core.h),
// built without torch (tests/test_native_core.py compiles it once per ISA level with that
// level's flags, no torch include path). A random batch (decode, extend, an empty request) over
// a shuffled paged cache, q and cache in bf16 / fp16 / fp32, e4m3 with a per-tensor scale and
// fp8_ds_mla; the output and LSE against a double-precision reference over the same stored
// values. Prints one line per case; exit status 1 on any mismatch.
#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "attention_core.h"

using namespace mla_native;
using namespace mla_native::core;

namespace {

std::mt19937 rng(1234);

uint16_t to_bits(vec::bf16_t*, float f) { return vec::f32_to_bf16(f); }
uint16_t to_bits(vec::fp16_t*, float f) {
  vec::VecF v = vec::VecF::set1(f);
  uint16_t out[vec::VecF::W];
  v.store_fp16_n(out, 1);
  return out[0];
}
float from_bits(vec::bf16_t*, uint16_t b) { return vec::bf16_to_f32(b); }
float from_bits(vec::fp16_t*, uint16_t b) { return vec::fp16_to_f32(b); }

// one case: q / cache element type QT (bf16_t, fp16_t or float), mode kPlain / kFp8 / kDs
template <typename QT>
bool run_case(const char* name, DType qdt, int mode, int64_t H, int64_t r, int64_t rope, int64_t ps,
              int64_t splits) {
  constexpr bool f32 = std::is_same<QT, float>::value;
  const int64_t es = f32 ? 4 : 2, D = r + rope;
  const std::vector<int> prefix = {37, 0, 130, 5}, nnew = {1, 9, 3, 0};
  const int64_t B = prefix.size();
  std::vector<int32_t> cu(B + 1, 0), kvl(B);
  for (int64_t i = 0; i < B; ++i) cu[i + 1] = cu[i] + nnew[i], kvl[i] = prefix[i] + nnew[i];
  const int64_t T = cu[B];
  int64_t maxp = 0;
  for (auto L : kvl) maxp = std::max<int64_t>(maxp, (L + ps - 1) / ps);
  const int64_t npages = B * maxp + 1;
  std::vector<int32_t> perm(npages - 1);
  for (int64_t p = 0; p < npages - 1; ++p) perm[p] = p + 1;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt(B * maxp);
  for (int64_t i = 0; i < B * maxp; ++i) bt[i] = perm[i];
  // rows
  const int64_t tiles = (r + 127) / 128, soff = (r + 3) / 4 * 4, roff = soff + 4 * tiles;
  const int64_t row_bytes = mode == kPlain ? D * es : (mode == kFp8 ? D : roff + rope * es);
  std::vector<uint8_t> cache(npages * ps * row_bytes, 0xff);  // never-written rows: NaN
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float kvs = 0.01f;
  // the value each stored row stands for (c_kv and k_pe), as the kernel reads it
  std::vector<double> val(npages * ps * D, NAN);
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t t = 0; t < kvl[i]; ++t) {
      const int64_t slot = bt[i * maxp + t / ps] * ps + t % ps;
      uint8_t* row = cache.data() + slot * row_bytes;
      double* v = val.data() + slot * D;
      std::vector<float> x(D);
      for (auto& e : x) e = nd(rng);
      if (mode == kPlain) {
        for (int64_t d = 0; d < D; ++d) {
          if constexpr (f32) {
            std::memcpy(row + 4 * d, &x[d], 4);
            v[d] = x[d];
          } else {
            const uint16_t b = to_bits(static_cast<QT*>(nullptr), x[d]);
            std::memcpy(row + 2 * d, &b, 2);
            v[d] = from_bits(static_cast<QT*>(nullptr), b);
          }
        }
      } else if (mode == kFp8) {
        for (int64_t d = 0; d < D; ++d) {
          row[d] = vec::f32_to_e4m3(std::max(-448.0f, std::min(448.0f, x[d] / kvs)));
          v[d] = static_cast<double>(vec::e4m3_to_f32(row[d])) * kvs;
        }
      } else {
        for (int64_t tl = 0; tl < tiles; ++tl) {
          const float sc = 0.02f * (tl + 1);
          std::memcpy(row + soff + 4 * tl, &sc, 4);
          for (int64_t d = tl * 128; d < std::min<int64_t>(r, (tl + 1) * 128); ++d) {
            row[d] = vec::f32_to_e4m3(std::max(-448.0f, std::min(448.0f, x[d] / sc)));
            v[d] = static_cast<float>(vec::e4m3_to_f32(row[d]) * sc);
          }
        }
        for (int64_t d = 0; d < rope; ++d) {
          if constexpr (f32) {
            std::memcpy(row + roff + 4 * d, &x[r + d], 4);
            v[r + d] = x[r + d];
          } else {
            const uint16_t b = to_bits(static_cast<QT*>(nullptr), x[r + d]);
            std::memcpy(row + roff + 2 * d, &b, 2);
            v[r + d] = from_bits(static_cast<QT*>(nullptr), b);
          }
        }
      }
    }
  }
  // q
  std::vector<uint8_t> q(T * H * D * es);
  std::vector<double> qv(T * H * D);
  for (int64_t k = 0; k < T * H * D; ++k) {
    const float x = nd(rng);
    if constexpr (f32) {
      std::memcpy(q.data() + 4 * k, &x, 4);
      qv[k] = x;
    } else {
      const uint16_t b = to_bits(static_cast<QT*>(nullptr), x);
      std::memcpy(q.data() + 2 * k, &b, 2);
      qv[k] = from_bits(static_cast<QT*>(nullptr), b);
    }
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<uint8_t> out(T * H * r * es);
  std::vector<float> lse(T * H);
  Params P;
  P.H = H, P.r = r, P.rope = rope, P.D = D, P.B = B, P.page_size = ps, P.num_pages = npages;
  P.bt = bt.data(), P.bt_s0 = maxp, P.cu = cu.data(), P.kvl = kvl.data();
  P.qlat = reinterpret_cast<const char*>(q.data()), P.ql_s0 = H * D * es, P.ql_s1 = D * es;
  P.qpe = P.qlat + r * es, P.qp_s0 = P.ql_s0, P.qp_s1 = P.ql_s1;
  P.cache = reinterpret_cast<const char*>(cache.data()), P.c_s0 = ps * row_bytes, P.c_s1 = row_bytes;
  P.row_bytes = row_bytes;
  const float k = mode == kFp8 ? kvs : 1.0f;
  P.score_scale = static_cast<float>(scale) * k, P.out_scale = k;
  P.tiles = tiles, P.ds_scale_off = soff, P.ds_rope_off = roff;
  P.out = reinterpret_cast<char*>(out.data()), P.lse = lse.data();
  Parallel par;  // serial
  absorbed_attention(P, qdt, mode, splits, par);
  // reference
  double err = 0.0, lerr = 0.0;
  const double tol = f32 ? 2e-5 : (std::is_same<QT, vec::bf16_t>::value ? 2e-2 : 4e-3);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = nnew[i], L = kvl[i];
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t t = cu[i] + j, lim = L - n + j + 1;
        const double* qq = qv.data() + (t * H + h) * D;
        std::vector<double> s(lim);
        double mx = -INFINITY;
        for (int64_t p = 0; p < lim; ++p) {
          const double* v = val.data() + (bt[i * maxp + p / ps] * ps + p % ps) * D;
          double acc = 0.0;
          for (int64_t d = 0; d < D; ++d) acc += qq[d] * v[d];
          s[p] = acc * scale;
          mx = std::max(mx, s[p]);
        }
        double l = 0.0;
        for (auto& e : s) l += (e = std::exp(e - mx));
        lerr = std::max(lerr, std::fabs(mx + std::log(l) - lse[t * H + h]));
        for (int64_t d = 0; d < r; ++d) {
          double o = 0.0;
          for (int64_t p = 0; p < lim; ++p)
            o += s[p] * val[(bt[i * maxp + p / ps] * ps + p % ps) * D + d];
          o /= l;
          double got;
          if constexpr (f32) {
            float g;
            std::memcpy(&g, out.data() + 4 * ((t * H + h) * r + d), 4);
            got = g;
          } else {
            uint16_t b;
            std::memcpy(&b, out.data() + 2 * ((t * H + h) * r + d), 2);
            got = from_bits(static_cast<QT*>(nullptr), b);
          }
          err = std::max(err, std::fabs(got - o) / std::max(1.0, std::fabs(o)));
        }
      }
    }
  }
  const bool ok = err <= tol && lerr <= 1e-3 && std::isfinite(err);
  std::printf("%-5s %-12s H=%-3lld r=%-3lld rope=%-2lld page=%-2lld splits=%lld: err %.2e lse err %.2e %s\n",
              ok ? "ok" : "FAIL", name, (long long)H, (long long)r, (long long)rope, (long long)ps,
              (long long)splits, err, lerr, ok ? "" : "<--");
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  for (int64_t H : {1, 16, 33}) {
    for (auto [r, rope] : {std::pair<int64_t, int64_t>{64, 16}, {33, 0}, {200, 32}}) {
      for (int64_t ps : {1, 16}) {
        const int64_t sp = H == 16 ? 3 : 0;
        ok &= run_case<vec::bf16_t>("bf16", DType::kBF16, kPlain, H, r, rope, ps, sp);
        ok &= run_case<vec::fp16_t>("fp16", DType::kF16, kPlain, H, r, rope, ps, sp);
        ok &= run_case<float>("fp32", DType::kF32, kPlain, H, r, rope, ps, sp);
        ok &= run_case<vec::bf16_t>("bf16/fp8", DType::kBF16, kFp8, H, r, rope, ps, sp);
        ok &= run_case<float>("fp32/fp8", DType::kF32, kFp8, H, r, rope, ps, sp);
        ok &= run_case<vec::bf16_t>("bf16/ds_mla", DType::kBF16, kDs, H, r, rope, ps, sp);
        ok &= run_case<float>("fp32/ds_mla", DType::kF32, kDs, H, r, rope, ps, sp);
      }
    }
  }
  std::printf("%s\n", ok ? "ALL OK" : "FAILURES");
  return ok ? 0 : 1;
}
