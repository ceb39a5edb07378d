// libFuzzer target: core::indexer (indexer.cpp), the DSA lightning indexer, in both of its
// modes (logits [T, width]; the causal top-k per token, through the histogram and the
// streaming selections and kv splits), every q dtype (bf16 / fp16 / fp32 / e4m3) and index
// cache kind (fp8 pages with 1..64 scales per key, bf16 / fp16 / fp32 keys). The op layer
// checks ranks, dtypes, the cache width, quant_block_size | Di (fp8) and out's shape, and
// passes B = kv_lens' length with cu_seqlens_q [B + 1], weights at any row stride, the block
// table and max_page_id as given; the core checks the rest (validate_indexer). Checked here:
// refusal exactly for malformed calls (outputs untouched); logits within a tolerance of the fp64
// reference at every visible position and -inf elsewhere; top-k lists ascending, distinct,
// visible, min(topk, visible) long, then -1, and (finite values) no unselected key better than
// a selected one beyond the tolerance; inputs untouched. One call in four scores compressed keys
// (ratio 2..5, DeepSeek-V4's CSA indexer: kv_lens count tokens, the token at p sees keys below
// (p + 1) / ratio, a page holds page_size keys of page_size x ratio tokens), sometimes with a key
// count that is not kv_lens / ratio or a ratio < 1 (refused).
#include "fuzz_common.h"
#include "indexer.cpp"

using namespace fz;
namespace core = mla_native::core;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Rng g(in.ConsumeIntegral<uint64_t>());
  const uint32_t mal = in.ConsumeIntegralInRange<int>(0, 2) == 0 ? in.ConsumeIntegral<uint32_t>() : 0;
  const bool specials = in.ConsumeIntegralInRange<int>(0, 5) == 0;
  // mostly small (fast executions); one call in 8 makes one dimension large (heads past one
  // GEMM column block, several scales, long contexts with kv splits, many tokens)
  const int big = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(1, 4) : 0;
  const int qdt = in.ConsumeIntegralInRange<int>(0, 3), kind = in.ConsumeIntegralInRange<int>(0, 3);
  const int64_t Hi = big == 1 ? in.ConsumeIntegralInRange<int64_t>(1, 40) : in.ConsumeIntegralInRange<int64_t>(1, 6);
  int64_t Di = big == 2 ? in.ConsumeIntegralInRange<int64_t>(1, 160) : in.ConsumeIntegralInRange<int64_t>(1, 24);
  // fp8: values per scale, a divisor of Di (one scale per key, or several of an even block)
  int64_t qbs = Di;
  if (kind == core::kIdxFp8 && in.ConsumeBool()) {
    std::vector<int64_t> divs;
    for (int64_t d = 2; d < Di; d += 2)
      if (Di % d == 0 && Di / d <= 64) divs.push_back(d);
    if (!divs.empty()) qbs = divs[in.ConsumeIntegralInRange<size_t>(0, divs.size() - 1)];
  }
  if (mal & 1) qbs = in.ConsumeIntegralInRange<int64_t>(-1, Di + 1);  // maybe not a divisor, odd, or < 1
  if (mal & 2) Di = 0;
  const int64_t nb = kind == core::kIdxFp8 && qbs >= 1 && Di % qbs == 0 ? Di / qbs : 1;
  int64_t ps = in.ConsumeIntegralInRange<int64_t>(1, 20);
  if (mal & 4) ps = 0;
  const int64_t B = in.ConsumeIntegralInRange<int64_t>(0, 4);
  const int64_t R = in.ConsumeIntegralInRange<int>(0, 3) == 0 ? in.ConsumeIntegralInRange<int64_t>(2, 5) : 1;
  const int64_t pt = std::max<int64_t>(ps, 0) * R;  // tokens per block-table page
  std::vector<int32_t> cu(static_cast<size_t>(B + 1), 0), kvl(static_cast<size_t>(B), 0);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = big == 4 ? in.ConsumeIntegralInRange<int64_t>(0, 40) : in.ConsumeIntegralInRange<int64_t>(0, 3);
    kvl[i] = static_cast<int32_t>(n + (big == 3 ? in.ConsumeIntegralInRange<int64_t>(0, 1500) : in.ConsumeIntegralInRange<int64_t>(0, 40)));
    cu[i + 1] = static_cast<int32_t>(cu[i] + n);
  }
  int64_t T = cu[B], need = 0, maxL = 0;
  for (int64_t i = 0; i < B; ++i) {
    need = std::max<int64_t>(need, pt > 0 ? (kvl[i] + pt - 1) / pt : 0);
    if (cu[i + 1] > cu[i]) maxL = std::max<int64_t>(maxL, kvl[i] / R);
  }
  const int64_t width = need + in.ConsumeIntegralInRange<int64_t>(0, 2), bt_s0 = width + in.ConsumeIntegralInRange<int64_t>(0, 2);
  int64_t rows = B + in.ConsumeIntegralInRange<int64_t>(0, 1);
  if ((mal & 8) && rows > 0) rows -= 1;
  const int64_t np = (mal & 16) ? 0 : in.ConsumeIntegralInRange<int64_t>(1, 12);
  std::vector<int32_t> bt(static_cast<size_t>(rows * bt_s0));
  for (auto& e : bt) e = static_cast<int32_t>(g.range(0, std::max<int64_t>(np - 1, 0)));
  if (B > 0) {
    const int64_t i = in.ConsumeIntegralInRange<int64_t>(0, B - 1);
    if (mal & 32) kvl[i] = cu[i + 1] - cu[i] - 1;
    if (mal & 64) kvl[i] = static_cast<int32_t>(width * std::max<int64_t>(ps, 1) + 1);
    if (mal & 128) cu[i + 1] = cu[i] - 1;
    if (mal & 256) cu[0] = 1;
    if ((mal & 512) && width > 0 && i < rows)
      bt[i * bt_s0 + in.ConsumeIntegralInRange<int64_t>(0, width - 1)] =
          in.ConsumeBool() ? static_cast<int32_t>(np) : (in.ConsumeBool() ? -1 : INT32_MIN);
    if (mal & 1024) kvl[i] = in.ConsumeBool() ? INT32_MAX : INT32_MIN;
  }
  if (mal & 2048) T += 1;
  // keys per request: kv_lens itself, or (compressed keys) kv_lens / R, maybe off by one
  std::vector<int32_t> keys(kvl);
  int64_t ratio = R;
  if (R > 1) {
    for (int64_t i = 0; i < B; ++i) keys[i] = static_cast<int32_t>(kvl[i] / R);
    if ((mal & 32768) && B > 0) keys[in.ConsumeIntegralInRange<int64_t>(0, B - 1)] += 1;
    if (mal & 65536) ratio = in.ConsumeIntegralInRange<int64_t>(-1, 0);
  }
  int64_t max_page_id = -1;
  if (in.ConsumeBool()) {  // the caller's bound: >= every used id, all >= 0 (or malformed: >= np)
    int64_t mx = 0;
    bool ok = true;
    for (int64_t i = 0; i < std::min(B, rows); ++i)
      if (cu[i + 1] > cu[i] && pt > 0 && kvl[i] > 0)
        for (int64_t p = 0; p < std::min<int64_t>((static_cast<int64_t>(kvl[i]) + pt - 1) / pt, width); ++p) {
          ok = ok && bt[i * bt_s0 + p] >= 0;
          mx = std::max<int64_t>(mx, bt[i * bt_s0 + p]);
        }
    if (ok) max_page_id = (mal & 4096) ? np : mx;
  }
  const bool topk_mode = in.ConsumeBool();
  int64_t topk = big == 3 ? in.ConsumeIntegralInRange<int64_t>(1, 600) : in.ConsumeIntegralInRange<int64_t>(1, 24);
  if (mal & 8192) topk = in.ConsumeIntegralInRange<int64_t>(-2, 0);
  int64_t lwidth = maxL + in.ConsumeIntegralInRange<int64_t>(0, 3);
  if ((mal & 16384) && maxL > 0) lwidth = maxL - 1;
  const int sel = in.ConsumeIntegralInRange<int>(0, 2);
  const int64_t buf_logits = sel == 0 ? core::kIdxBufLogits : (sel == 1 ? 0 : in.ConsumeIntegralInRange<int64_t>(0, 600));
  const int64_t threads = in.ConsumeIntegralInRange<int64_t>(1, 2);

  // q [T, Hi, Di] at element strides, weights [T, Hi] at row stride w_s0
  const int64_t qes = qdt == core::kIdxQE4M3 ? 1 : (qdt == core::kIdxQF32 ? 4 : 2);
  const int64_t q_s1 = std::max<int64_t>(Di, 0) + in.ConsumeIntegralInRange<int64_t>(0, 2);
  const int64_t q_s0 = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : Hi * q_s1 + in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t w_s0 = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 0 : Hi + in.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t Tq = std::max<int64_t>(T, 0);
  const int64_t qn = Tq == 0 || Di <= 0 ? 0 : (Tq - 1) * q_s0 + (Hi - 1) * q_s1 + Di;
  std::vector<uint8_t> q(static_cast<size_t>(qn * qes));
  auto val = [&](float a) { return specials && g.range(0, 63) == 0 ? special(g) : g.val(a); };
  // q's values: e4m3 bytes, or the dtype's
  for (int64_t e = 0; e < qn; ++e) {
    if (qdt == core::kIdxQE4M3) q[e] = specials && g.range(0, 63) == 0 ? 0x7F : f_e4m3(g.val(4.0f));
    else put(q.data() + e * qes, qdt == core::kIdxQBF16 ? 0 : (qdt == core::kIdxQF16 ? 1 : 2), val(2.0f));
  }
  std::vector<float> w(static_cast<size_t>(Tq == 0 ? 0 : (Tq - 1) * w_s0 + Hi));
  for (auto& x : w) x = val(1.0f);
  // the cache: pages of ps keys (fp8: ps x Di e4m3, then ps x nb float32 scales), padded
  const int64_t kes = kind == core::kIdxFp8 ? 1 : (kind == core::kIdxF32 ? 4 : 2);
  const int64_t Dp = std::max<int64_t>(Di, 0);
  const int64_t page_bytes = kind == core::kIdxFp8 ? ps * (Dp + 4 * nb) : ps * Dp * kes;
  // pages at any byte stride for fp8 (uint8 tensors), at whole elements otherwise (as torch's strides)
  const int64_t c_s0 = page_bytes + in.ConsumeIntegralInRange<int64_t>(0, 9) * (kind == core::kIdxFp8 ? 1 : kes);
  std::vector<uint8_t> cache(static_cast<size_t>(np > 0 ? (np - 1) * c_s0 + page_bytes : 0), 0xFF);
  const int kdt = kind == core::kIdxBF16 ? 0 : (kind == core::kIdxF16 ? 1 : 2);
  auto key_at = [&](int64_t page, int64_t off) { return cache.data() + page * c_s0 + off * Dp * kes; };
  auto scale_at = [&](int64_t page, int64_t off, int64_t blk) {
    return cache.data() + page * c_s0 + ps * Dp + (off * nb + blk) * 4;
  };
  if (Di >= 1 && ps >= 1)
    for (int64_t i = 0; i < std::min(B, rows); ++i) {
      if (cu[i + 1] <= cu[i]) continue;
      for (int64_t pos = 0; pos < std::min<int64_t>(keys[i], width * ps); ++pos) {
        const int64_t page = bt[i * bt_s0 + pos / ps], off = pos % ps;
        if (page < 0 || page >= np) continue;
        uint8_t* k = key_at(page, off);
        for (int64_t d = 0; d < Di; ++d) {
          if (kind == core::kIdxFp8) k[d] = specials && g.range(0, 63) == 0 ? 0x7F : f_e4m3(g.val(300.0f));
          else put(k + d * kes, kdt, val(2.0f));
        }
        if (kind == core::kIdxFp8)
          for (int64_t blk = 0; blk < nb; ++blk) {
            const float sc = specials && g.range(0, 31) == 0 ? special(g) : std::ldexp(1.0f, -static_cast<int>(g.range(5, 8)));
            std::memcpy(scale_at(page, off, blk), &sc, 4);
          }
      }
    }
  Frozen fq, fw, fc, fbt, fcu, fkvl;
  fq.take(q.data(), q.size(), "q"), fw.take(w.data(), w.size() * 4, "weights"), fc.take(cache.data(), cache.size(), "cache");
  fbt.take(bt.data(), bt.size() * 4, "block_table"), fcu.take(cu.data(), cu.size() * 4, "cu_seqlens_q");
  fkvl.take(kvl.data(), kvl.size() * 4, "kv_lens");
  Frozen fkeys;
  fkeys.take(keys.data(), keys.size() * 4, "keys");

  core::IndexParams P;
  P.T = T, P.Hi = Hi, P.Di = Di, P.B = B, P.page_size = ps, P.num_pages = np;
  P.q = reinterpret_cast<const char*>(q.data()), P.q_s0 = q_s0 * qes, P.q_s1 = q_s1 * qes, P.q_dt = qdt;
  P.w = w.data(), P.w_s0 = w_s0, P.cache = cache.data(), P.c_s0 = c_s0, P.kind = kind, P.qbs = qbs;
  P.bt = bt.data(), P.bt_s0 = bt_s0, P.cu = cu.data(), P.kvl = keys.data();
  P.ratio = ratio, P.qkvl = R > 1 ? kvl.data() : nullptr;
  std::vector<int32_t> out;
  std::vector<float> logits;
  if (topk_mode) {
    // (never empty: a null out would read as the logits mode; the op layer refuses topk < 1)
    out.assign(static_cast<size_t>(std::max<int64_t>(Tq * std::max<int64_t>(topk, 0), 1)), -7);
    P.out = out.data(), P.topk = topk, P.buf_logits = buf_logits;
  } else {
    logits.assign(static_cast<size_t>(Tq * lwidth), -kInf);
    P.logits = logits.data(), P.logits_s0 = lwidth, P.width = lwidth;
  }
  const core::Bounds b{T, rows, width, max_page_id};
  const std::string err = core::indexer(P, b, make_parallel<core::Parallel>(threads));
  fq.check(), fw.check(), fc.check(), fbt.check(), fcu.check(), fkvl.check(), fkeys.check();

  // the rules (validate_indexer, validate), read independently
  bool valid = Hi >= 1 && Di >= 1 && ps >= 1;
  if (kind == core::kIdxFp8) valid = valid && qbs >= 1 && Di % qbs == 0 && (qbs == Di || (qbs % 2 == 0 && Di / qbs <= 64));
  if (topk_mode) valid = valid && topk >= 1;
  valid = valid && ratio >= 1 && np >= 0 && rows >= B && (B == 0 || cu[0] == 0);
  for (int64_t i = 0; i < B && valid; ++i) {
    const int64_t n = static_cast<int64_t>(cu[i + 1]) - cu[i];
    valid = n >= 0 && kvl[i] >= n;
    if (!valid || n == 0) continue;
    valid = kvl[i] <= width * pt && (topk_mode || keys[i] <= lwidth);
    for (int64_t p = 0; valid && max_page_id < 0 && p < (kvl[i] + pt - 1) / pt; ++p)
      valid = bt[i * bt_s0 + p] >= 0 && bt[i * bt_s0 + p] < np;
  }
  for (int64_t i = 0; i < B && valid && R > 1; ++i) valid = keys[i] == kvl[i] / R;
  valid = valid && max_page_id < np && (B > 0 ? cu[B] : 0) == T;
  if (!valid) {
    FZ_CHECK(!err.empty(), "a malformed indexer call was accepted (B %lld, T %lld, Hi %lld, Di %lld, qbs %lld, topk %lld)",
             (long long)B, (long long)T, (long long)Hi, (long long)Di, (long long)qbs, (long long)topk);
    for (int32_t x : out) FZ_CHECK(x == -7, "a refused call wrote its top-k: %s", err.c_str());
    for (float x : logits) FZ_CHECK(x == -kInf, "a refused call wrote its logits: %s", err.c_str());
    return 0;
  }
  FZ_CHECK(err.empty(), "a valid indexer call was refused: %s", err.c_str());

  // the fp64 reference logits of token t at position p, and their tolerance: q rounded to bf16
  // (fp16 / fp32 q) and keys to bf16 (fp16 / fp32 keys on the bf16 GEMM levels): 2^-8 of
  // sum_h |w| sum_d |q k| (+ fp32 sums)
  auto ref = [&](int64_t t, int64_t i, int64_t p, double& tol) {
    const int64_t page = bt[i * bt_s0 + p / ps], off = p % ps;
    const uint8_t* k = key_at(page, off);
    double acc = 0, bound = 0;
    for (int64_t h = 0; h < Hi; ++h) {
      const uint8_t* qr = q.data() + (t * q_s0 + h * q_s1) * qes;
      double dot = 0, mag = 0;
      for (int64_t blk = 0; blk < nb; ++blk) {
        double sc = 1.0, part = 0, pm = 0;
        if (kind == core::kIdxFp8) {
          float f;
          std::memcpy(&f, scale_at(page, off, blk), 4);
          sc = f;
        }
        for (int64_t d = blk * (Di / nb); d < (blk + 1) * (Di / nb); ++d) {
          const double qv = qdt == core::kIdxQE4M3 ? e4m3_f(qr[d]) : get(qr + d * qes, qdt == core::kIdxQBF16 ? 0 : (qdt == core::kIdxQF16 ? 1 : 2));
          const double kv = kind == core::kIdxFp8 ? e4m3_f(k[d]) : get(k + d * kes, kdt);
          part += qv * kv;
          pm += std::fabs(qv * kv);
        }
        dot += sc * part;
        mag += std::fabs(sc) * pm;
      }
      acc += w[t * w_s0 + h] * std::max(dot, 0.0);
      bound += std::fabs(w[t * w_s0 + h]) * mag;
    }
    tol = bound * (1.0 / 128) + 1e-30;
    return acc;
  };
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = cu[i + 1] - cu[i], L = kvl[i];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = cu[i] + j, lim = (L - n + j + 1) / R - 1;  // sees keys 0 .. lim
      if (!topk_mode) {
        for (int64_t p = 0; p < lwidth; ++p) {
          const float got = logits[t * lwidth + p];
          if (p > lim) {
            FZ_CHECK(got == -kInf, "logits[%lld, %lld] past the visible %lld written: %g", (long long)t, (long long)p,
                     (long long)lim, got);
            continue;
          }
          if (specials) continue;
          double tol;
          const double want = ref(t, i, p, tol);
          FZ_CHECK(std::fabs(got - want) <= tol, "logits[%lld, %lld] = %.7g, reference %.7g (tol %.3g; qdt %d kind %d nb %lld)",
                   (long long)t, (long long)p, got, want, tol, qdt, kind, (long long)nb);
        }
        continue;
      }
      const int32_t* o = out.data() + t * topk;
      const int64_t cnt = std::min<int64_t>(topk, lim + 1);
      std::vector<char> chosen(static_cast<size_t>(lim + 1), 0);
      for (int64_t c = 0; c < topk; ++c) {
        if (c >= cnt) {
          FZ_CHECK(o[c] == -1, "top-k of token %lld: entry %lld = %d past the %lld selected, expected -1", (long long)t,
                   (long long)c, o[c], (long long)cnt);
          continue;
        }
        FZ_CHECK(o[c] >= 0 && o[c] <= lim && (c == 0 || o[c] > o[c - 1]),
                 "top-k of token %lld: entry %lld = %d is not ascending within 0 .. %lld", (long long)t, (long long)c,
                 o[c], (long long)lim);
        chosen[o[c]] = 1;
      }
      if (specials || cnt == lim + 1) continue;
      double worst_in = INFINITY, best_out = -INFINITY, tin = 0, tout = 0;
      for (int64_t p = 0; p <= lim; ++p) {
        double tol;
        const double v = ref(t, i, p, tol);
        if (chosen[p] && v < worst_in) worst_in = v, tin = tol;
        if (!chosen[p] && v > best_out) best_out = v, tout = tol;
      }
      FZ_CHECK(worst_in >= best_out - tin - tout, "top-k of token %lld: a key of logit %.7g left out, %.7g chosen (tol %.3g)",
               (long long)t, best_out, worst_in, tin + tout);
    }
  }
  return 0;
}
