// libFuzzer target: core::write_latent (cache_writer.h), every cache layout (q's dtype,
// per-tensor e4m3, fp8_ds_mla). The op layer (cache_write.cpp, write_latent) checks the tensors'
// ranks, dtypes and row width and passes c_kv / k_pe widened to float32, slots as int64, a
// cache with any row / page strides (last dim contiguous) and any kv_scale; the core checks
// page_size and every slot (< 0: padding, >= the cache's rows: refused). Checked here: refusal
// exactly for a slot past the cache or page_size 0 (then nothing written), every written row bit
// for bit against this file's encoder (NaN as any NaN) -- a slot named by several tokens holds
// the last one's row, whole, on any number of threads --, every other byte (unwritten rows,
// padding between rows and pages) unchanged, the inputs untouched.
#include "fuzz_common.h"
#include "cache_writer.h"

namespace core = mla_native::core;
using namespace fz;

namespace {

// The expected bytes of one row (row_bytes long) for values c [r], kp [rope].
void encode_row(uint8_t* dst, const float* c, const float* kp, int64_t r, int64_t rope, int mode, int cdt,
                int rdt, float kvs) {
  if (mode == core::kPlain) {
    const int64_t es = dt_size(cdt);
    for (int64_t j = 0; j < r; ++j) put(dst + j * es, cdt, c[j]);
    for (int64_t j = 0; j < rope; ++j) put(dst + (r + j) * es, cdt, kp[j]);
  } else if (mode == core::kFp8) {
    auto enc = [&](float x) {
      const float y = x / kvs;
      return f_e4m3(std::isnan(y) ? y : std::fmin(std::fmax(y, -448.0f), 448.0f));
    };
    for (int64_t j = 0; j < r; ++j) dst[j] = enc(c[j]);
    for (int64_t j = 0; j < rope; ++j) dst[r + j] = enc(kp[j]);
  } else {
    const int64_t tiles = (r + 127) / 128, soff = (r + 3) / 4 * 4, roff = soff + 4 * tiles;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t j0 = t * 128, j1 = std::min<int64_t>(r, j0 + 128);
      float amax = 0.0f;
      bool nan = false;
      for (int64_t j = j0; j < j1; ++j) {
        nan = nan || std::isnan(c[j]);
        amax = std::fmax(amax, std::fabs(c[j]));
      }
      float sc = nan ? kNaN : amax / 448.0f;
      if (!std::isnan(sc)) sc = std::fmax(sc, std::numeric_limits<float>::min());
      for (int64_t j = j0; j < j1; ++j) {
        const float y = c[j] / sc;
        dst[j] = f_e4m3(std::isnan(y) ? y : std::fmin(std::fmax(y, -448.0f), 448.0f));
      }
      std::memcpy(dst + soff + 4 * t, &sc, 4);
    }
    if (soff > r) std::memset(dst + r, 0, soff - r);
    for (int64_t j = 0; j < rope; ++j) put(dst + roff + j * dt_size(rdt), rdt, kp[j]);
  }
}

// Byte `b` of a row: whether the written and expected bytes agree (NaN matches any NaN of the
// field's type).
bool same_field(const uint8_t* got, const uint8_t* want, int64_t off, int64_t r, int64_t rope, int mode, int cdt,
                int rdt, int64_t& step) {
  auto nan_eq = [&](int dt) {
    const double a = get(got + off, dt), b = get(want + off, dt);
    return std::isnan(a) ? std::isnan(b) : std::memcmp(got + off, want + off, step) == 0;
  };
  if (mode == core::kPlain) {
    step = dt_size(cdt);
    return nan_eq(cdt);
  }
  if (mode == core::kFp8 || off < r) {
    step = 1;
    const bool na = (got[off] & 0x7F) == 0x7F, nb = (want[off] & 0x7F) == 0x7F;
    return na || nb ? na == nb : got[off] == want[off];
  }
  const int64_t tiles = (r + 127) / 128, soff = (r + 3) / 4 * 4, roff = soff + 4 * tiles;
  if (off < soff) {
    step = 1;
    return got[off] == want[off];
  }
  if (off < roff) {
    step = 4;
    return nan_eq(2);
  }
  (void)rope;
  step = dt_size(rdt);
  return nan_eq(rdt);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int mode = in.ConsumeIntegralInRange<int>(0, 2);
  const int cdt = in.ConsumeIntegralInRange<int>(0, 2);  // plain cache dtype
  const int rdt = in.ConsumeIntegralInRange<int>(0, 2);  // c_kv's dtype: fp8_ds_mla's k_pe
  const int64_t r = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 300) : in.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t rope = in.ConsumeIntegralInRange<int64_t>(0, 20);
  const int64_t ps = in.ConsumeIntegralInRange<int64_t>(in.ConsumeIntegralInRange<int>(0, 15) == 0 ? 0 : 1, 17);
  const int64_t np = in.ConsumeIntegralInRange<int64_t>(0, 9);
  const int64_t T = in.ConsumeIntegralInRange<int64_t>(0, 24);
  const int64_t row_pad = in.ConsumeIntegralInRange<int64_t>(0, 3), page_pad = in.ConsumeIntegralInRange<int64_t>(0, 9);
  const int64_t threads = in.ConsumeIntegralInRange<int64_t>(1, 2);
  const bool specials = in.ConsumeIntegralInRange<int>(0, 3) == 0;
  Rng sg(size);  // any kv_scale: the op layer passes it unchecked
  const float kvs = in.ConsumeIntegralInRange<int>(0, 15) == 0 ? (in.ConsumeBool() ? 0.0f : special(sg))
                                                              : 0.25f * in.ConsumeIntegralInRange<int>(1, 16);
  const int64_t nrows = np * ps;
  std::vector<int64_t> slots(static_cast<size_t>(T));
  for (auto& s : slots) {
    const int kind = in.ConsumeIntegralInRange<int>(0, 15);
    if (kind == 0) s = -in.ConsumeIntegralInRange<int64_t>(1, 3);                       // padding
    else if (kind == 1) s = nrows + in.ConsumeIntegralInRange<int64_t>(0, 2);           // past the cache
    else if (kind == 2) s = in.ConsumeBool() ? INT64_MAX : INT64_MIN;                  // extreme
    else s = nrows > 0 ? in.ConsumeIntegralInRange<int64_t>(0, nrows - 1) : -1;
  }
  Rng g(in.ConsumeIntegral<uint64_t>());

  const int64_t es = mode == core::kPlain ? dt_size(cdt) : 1;
  const int64_t rb = mode == core::kPlain ? (r + rope) * es
                   : mode == core::kFp8   ? r + rope
                                          : core::DsLayout(r, rope, dt_size(rdt)).width;
  // padding in whole elements (plain: torch strides), 4 bytes for fp8_ds_mla rows (its float32
  // scales and k_pe: an odd uint8 stride would misalign them)
  const int64_t al = mode == core::kPlain ? es : (mode == core::kFp8 ? 1 : 4);
  const int64_t c_s1 = rb + al * row_pad, c_s0 = ps * c_s1 + al * page_pad;
  const int64_t bytes = np > 0 ? (np - 1) * c_s0 + ps * c_s1 : 0;
  std::vector<uint8_t> cache(static_cast<size_t>(bytes));
  for (auto& b : cache) b = static_cast<uint8_t>(g.next());
  const std::vector<uint8_t> before = cache;
  // values as the op layer passes them: c_kv's dtype widened to float32
  auto value = [&](float) {
    const float x = specials && g.range(0, 15) == 0 ? special(g) : g.val(rdt == 2 ? 300.0f : 8.0f);
    uint8_t tmp[4];
    put(tmp, rdt, x);
    return static_cast<float>(get(tmp, rdt));
  };
  std::vector<float> c_kv(static_cast<size_t>(T * r)), k_pe(static_cast<size_t>(T * rope));
  for (auto& x : c_kv) x = value(0);
  for (auto& x : k_pe) x = value(0);
  Frozen f_c, f_k, f_s;
  f_c.take(c_kv.data(), c_kv.size() * 4, "c_kv");
  f_k.take(k_pe.data(), k_pe.size() * 4, "k_pe");
  f_s.take(slots.data(), slots.size() * 8, "slot_mapping");

  core::WriteParams W;
  W.cache = reinterpret_cast<char*>(cache.data()), W.c_s0 = c_s0, W.c_s1 = c_s1, W.page_size = ps, W.num_pages = np;
  W.mode = mode, W.cache_dt = static_cast<core::DType>(cdt), W.rope_dt = static_cast<core::DType>(rdt);
  W.r = r, W.rope = rope, W.T = T, W.c_kv = c_kv.data(), W.k_pe = k_pe.data(), W.slots = slots.data();
  W.kv_scale = kvs;
  const std::string err = core::write_latent(W, make_parallel<core::Parallel>(threads));
  f_c.check(), f_k.check(), f_s.check();

  bool bad = ps < 1;
  for (int64_t t = 0; t < T && !bad; ++t) bad = slots[t] >= nrows;
  if (bad) {
    FZ_CHECK(!err.empty(), "a slot past the cache (%lld rows) or page_size %lld was accepted", (long long)nrows,
             (long long)ps);
    FZ_CHECK(cache == before, "a refused write changed the cache: %s", err.c_str());
    return 0;
  }
  FZ_CHECK(err.empty(), "valid write refused: %s", err.c_str());
  // expected cache: each slot holds the row of the last token naming it, whole (any threads)
  std::vector<uint8_t> want = before;
  std::vector<int64_t> last(static_cast<size_t>(nrows), -1);
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) last[slots[t]] = t;
  std::vector<uint8_t> row(static_cast<size_t>(rb));
  for (int64_t s = 0; s < nrows; ++s) {
    const int64_t off = (s / ps) * c_s0 + (s % ps) * c_s1;
    const int64_t t = last[s];
    if (t < 0) continue;
    encode_row(row.data(), c_kv.data() + t * r, k_pe.data() + t * rope, r, rope, mode, cdt, rdt, kvs);
    int64_t b = 0, step = 1;
    for (; b < rb; b += step)
      if (!same_field(cache.data() + off, row.data(), b, r, rope, mode, cdt, rdt, step)) break;
    if (b < rb)
      fail("slot %lld (mode %d, cache dt %d, rope dt %d, r %lld, rope %lld, token %lld of %lld, %lld threads): "
           "byte %lld is 0x%02x, expected 0x%02x",
           (long long)s, mode, cdt, rdt, (long long)r, (long long)rope, (long long)t, (long long)T,
           (long long)threads, (long long)b, cache[off + b], row[b]);
    if (rb) std::memcpy(want.data() + off, cache.data() + off, rb);  // checked above
  }
  for (int64_t b = 0; b < bytes; ++b)
    FZ_CHECK(cache[b] == want[b], "byte %lld of the cache (outside every written row) changed", (long long)b);
  return 0;
}
