// The native kernel cores' test driver: one program over the torch-free entry points, built once
// per target (each x86 ISA level natively and with ASan/UBSan, each aarch64 level for qemu) by
// mla_backend/testing/core_driver.py; tests/native_core/test_cores.py writes the cases and
// checks the answers against the fp64 oracle.
//
//   driver CASE...     for each case file CASE: run it, write CASE.out, print one line
//                      ("ok CASE" or "refused CASE: <message>")
//   driver --info      print the build: level, vector width, SVE vector length (aarch64)
//
// Case and output files are records: u32 name length, the name, u64 byte count, the bytes
// (little endian; scalars are one int64 or one float64). Every case has "op":
//   attention   core::absorbed_attention (validate first): q [T, H, r + rope] rows at element
//               strides, the paged cache, bt / cu / kvl int32 -> "out" [T, H, r] (q's dtype),
//               "lse" [T, H] float32, or "error" (the refusal; nothing read)
//   write       core::write_latent: rows into "cache" -> "cache", or "error"
//   head_gemm   pack_heads_items + head_gemm_items (bf16): x [T, H, K] · w [H, K, N] -> "y", "packed"
//   decompress  decompress core (bf16): latent [L, r + rope], W_UK, W_UV -> "k", "v"
//   mha         the normal path's MHA core (bf16): q, k, v -> "o", "lse"
//   indexer     core::indexer (the DSA lightning indexer, csrc/indexer.cpp): q [T, Hi, Di] at
//               element strides, weights, the paged index cache (fp8 pages or plain keys), bt /
//               cu / kvl -> "out" [T, topk] int32 (topk > 0) or "logits" [T, width] float32
//               (-inf where not written), or "error"
//   sparse      core::sparse_attention (csrc/sparse_attention.cpp): the attention case's fields
//               plus "idx" [T, K] int32 and "tok_req" [T] int32 -> "out", "lse", or "error"
//   keyset      core::keyset_attention (csrc/keyset_attention.cpp): the attention case's fields
//               plus "range", "window" [B] (or has_window 0), "K" / "idx" [T, K], "K2" / "idx2"
//               [T, K2] into "cache2" (pages of page_size2, num_pages2; "bt2" [bt2_rows,
//               bt2_width], "len2" [B]), "sink" [H] (or has_sink 0) -> "out", "lse", or "error"
//   widen       vec::VecF::load_bf16 / load_bf16_n: x [N] bf16 bits (N a multiple of the
//               level's W) -> "y" [W][N] fp32 bits: row 0 widened in whole vectors, row n
//               (0 < n < W) in chunks of n lanes, each copied first into a heap buffer of
//               exactly its size; "dirty" int64: lanes past the chunk that did not read +0
//               (load_bf16_n(p, 0) included)
// Buffers are allocated at exactly their size, so a read outside one is a sanitizer report.
#define MLA_CORE_ONLY 1
#include "absorbed_attention.h"
#include "cache_writer.h"
// (after the attention cores: their file-local names must not be visible to its definitions)
#include "decompress.cpp"
#include "head_gemm.cpp"
#include "indexer.cpp"
#include "mha.cpp"
#include "sparse_attention.cpp"
#include "keyset_attention.cpp"

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/prctl.h>
#endif

namespace {

using Bytes = std::vector<char>;
using Records = std::map<std::string, Bytes>;
namespace core = mla_native::core;

Records read_records(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  Records recs;
  for (;;) {
    uint32_t nl;
    if (!f.read(reinterpret_cast<char*>(&nl), 4)) break;
    std::string name(nl, '\0');
    uint64_t nb;
    f.read(name.data(), nl);
    f.read(reinterpret_cast<char*>(&nb), 8);
    Bytes data(nb);
    if (!f.read(data.data(), static_cast<std::streamsize>(nb))) throw std::runtime_error("truncated " + path);
    recs[name] = std::move(data);
  }
  return recs;
}

void write_records(const std::string& path, const Records& recs) {
  std::ofstream f(path, std::ios::binary);
  for (const auto& [name, data] : recs) {
    const uint32_t nl = static_cast<uint32_t>(name.size());
    const uint64_t nb = data.size();
    f.write(reinterpret_cast<const char*>(&nl), 4);
    f.write(name.data(), nl);
    f.write(reinterpret_cast<const char*>(&nb), 8);
    f.write(data.data(), static_cast<std::streamsize>(nb));
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

struct Case {
  Records in, out;
  const Bytes& raw(const std::string& k) const {
    auto it = in.find(k);
    if (it == in.end()) throw std::runtime_error("case has no '" + k + "'");
    return it->second;
  }
  int64_t i(const std::string& k) const {
    int64_t v;
    std::memcpy(&v, raw(k).data(), 8);
    return v;
  }
  double f(const std::string& k) const {
    double v;
    std::memcpy(&v, raw(k).data(), 8);
    return v;
  }
  // k's bytes, checked to hold `elems` elements of T
  template <typename T>
  const T* arr(const std::string& k, int64_t elems) const {
    const Bytes& b = raw(k);
    if (static_cast<int64_t>(b.size()) < elems * static_cast<int64_t>(sizeof(T)))
      throw std::runtime_error("'" + k + "' has " + std::to_string(b.size()) + " bytes, needs " +
                               std::to_string(elems * sizeof(T)));
    return reinterpret_cast<const T*>(b.data());
  }
  template <typename T>
  T* make(const std::string& k, int64_t elems) {
    Bytes& b = out[k];
    b.assign(static_cast<size_t>(elems) * sizeof(T), 0);
    return reinterpret_cast<T*>(b.data());
  }
};

// elements a strided view [sizes] spans: 1 + sum (size - 1) * stride (0 if empty)
int64_t extent(std::initializer_list<std::pair<int64_t, int64_t>> dims) {
  int64_t e = 1;
  for (auto [n, s] : dims) {
    if (n == 0) return 0;
    e += (n - 1) * s;
  }
  return e;
}

// threads > 1: for_range runs its chunks on std::threads (the torch layer uses at::parallel_for)
core::Parallel parallel(int64_t threads) {
  core::Parallel par;
  par.threads = std::max<int64_t>(1, threads);
  if (par.threads > 1) {
    par.for_range = [t = par.threads](int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
      const int64_t k = std::min(t, n);
      std::vector<std::thread> pool;
      for (int64_t c = 1; c < k; ++c) pool.emplace_back(fn, n * c / k, n * (c + 1) / k);
      if (k > 0) fn(0, n / k);
      for (auto& th : pool) th.join();
    };
  }
  return par;
}

int64_t dtype_size(int64_t dt) { return dt == 2 ? 4 : 2; }  // 0 bf16, 1 fp16, 2 fp32
core::DType dtype(int64_t dt) { return dt == 0 ? core::DType::kBF16 : (dt == 1 ? core::DType::kF16 : core::DType::kF32); }

int64_t row_bytes(int64_t mode, int64_t r, int64_t rope, int64_t es) {
  if (mode == core::kPlain) return (r + rope) * es;
  if (mode == core::kFp8) return r + rope;
  return core::DsLayout(r, rope, es).width;
}

// the attention case's Params (q, cache, block table, lengths; out / lse made), and its Bounds
core::Params attention_params(Case& c, core::Bounds& b) {
  const int64_t qdt = c.i("qdt"), mode = c.i("mode"), es = dtype_size(qdt);
  const int64_t H = c.i("H"), r = c.i("r"), rope = c.i("rope"), B = c.i("B"), T = c.i("T");
  const int64_t ps = c.i("page_size"), np = c.i("num_pages"), rows = c.i("bt_rows"), width = c.i("bt_width");
  const int64_t rb = row_bytes(mode, r, rope, es);
  core::Params P;
  P.H = H, P.r = r, P.rope = rope, P.D = r + rope, P.B = B, P.page_size = ps, P.num_pages = np;
  P.bt = c.arr<int32_t>("bt", rows * width), P.bt_s0 = width;
  P.cu = c.arr<int32_t>("cu", B + 1), P.kvl = c.arr<int32_t>("kvl", B);
  const int64_t s0 = c.i("q_s0"), s1 = c.i("q_s1");
  const char* q = c.arr<char>("q", es * extent({{T, s0}, {H, s1}, {r + rope, 1}}));
  P.qlat = q, P.ql_s0 = s0 * es, P.ql_s1 = s1 * es;
  P.qpe = q + r * es, P.qp_s0 = s0 * es, P.qp_s1 = s1 * es;
  P.cache = c.arr<char>("cache", np * ps * rb), P.c_s0 = ps * rb, P.c_s1 = rb, P.row_bytes = rb;
  const double kvs = c.f("kv_scale");
  P.score_scale = static_cast<float>(c.f("scale") * kvs), P.out_scale = static_cast<float>(kvs);
  const core::DsLayout dsl(r, rope, es);
  P.tiles = dsl.tiles, P.ds_scale_off = dsl.scale_off, P.ds_rope_off = dsl.rope_off;
  P.out = c.make<char>("out", std::max<int64_t>(T, 0) * H * r * es);
  P.lse = c.make<float>("lse", std::max<int64_t>(T, 0) * H);
  b = core::Bounds{T, rows, width, c.i("max_page_id")};
  return P;
}

std::string run_attention(Case& c) {
  core::Bounds b;
  const core::Params P = attention_params(c, b);
  return core::absorbed_attention(P, b, dtype(c.i("qdt")), static_cast<int>(c.i("mode")), c.i("splits"),
                                  parallel(c.i("threads")));
}

std::string run_sparse(Case& c) {
  core::Bounds b;
  const core::Params P = attention_params(c, b);
  core::SparseIndex S;
  S.K = c.i("K"), S.idx_s0 = S.K;
  S.idx = c.arr<int32_t>("idx", b.T * S.K), S.tok_req = c.arr<int32_t>("tok_req", b.T);
  return core::sparse_attention(P, b, S, dtype(c.i("qdt")), static_cast<int>(c.i("mode")),
                                parallel(c.i("threads")));
}

std::string run_keyset(Case& c) {
  core::Bounds b;
  core::Params P = attention_params(c, b);
  core::KeySet S;
  S.range = c.i("range") != 0;
  if (c.i("has_window")) S.window = c.arr<int32_t>("window", P.B);
  if ((S.K = c.i("K")) > 0) S.idx = c.arr<int32_t>("idx", b.T * S.K), S.idx_s0 = S.K;
  if ((S.K2 = c.i("K2")) > 0) {
    const int64_t ps2 = c.i("page_size2"), np2 = c.i("num_pages2");
    S.idx2 = c.arr<int32_t>("idx2", b.T * S.K2), S.idx2_s0 = S.K2;
    S.cache2 = c.arr<char>("cache2", np2 * ps2 * P.row_bytes);
    S.c2_s0 = ps2 * P.row_bytes, S.c2_s1 = P.row_bytes, S.page_size2 = ps2, S.num_pages2 = np2;
    S.bt2_rows = c.i("bt2_rows"), S.bt2_width = c.i("bt2_width"), S.bt2_s0 = S.bt2_width;
    S.bt2 = c.arr<int32_t>("bt2", S.bt2_rows * S.bt2_width), S.len2 = c.arr<int32_t>("len2", P.B);
  }
  if (c.i("has_sink")) P.sink = c.arr<float>("sink", P.H);
  return core::keyset_attention(P, b, S, dtype(c.i("qdt")), static_cast<int>(c.i("mode")), c.i("splits"),
                                parallel(c.i("threads")));
}

std::string run_indexer(Case& c) {
  core::IndexParams P;
  const int64_t T = c.i("T"), Hi = c.i("Hi"), Di = c.i("Di"), B = c.i("B");
  const int64_t ps = c.i("page_size"), np = c.i("num_pages"), rows = c.i("bt_rows"), width = c.i("bt_width");
  const int64_t qdt = c.i("q_dt"), kind = c.i("kind"), qbs = c.i("qbs");
  const int64_t qes = qdt == core::kIdxQE4M3 ? 1 : (qdt == core::kIdxQF32 ? 4 : 2);
  const int64_t kes = kind == core::kIdxFp8 ? 1 : (kind == core::kIdxF32 ? 4 : 2);
  const int64_t W = kind == core::kIdxFp8 ? Di + 4 * (Di / std::max<int64_t>(qbs, 1)) : Di;
  const int64_t s0 = c.i("q_s0"), s1 = c.i("q_s1");
  P.T = T, P.Hi = Hi, P.Di = Di, P.B = B, P.page_size = ps, P.num_pages = np;
  P.q = c.arr<char>("q", qes * extent({{T, s0}, {Hi, s1}, {Di, 1}})), P.q_s0 = s0 * qes, P.q_s1 = s1 * qes;
  P.q_dt = static_cast<int>(qdt);
  P.w = c.arr<float>("w", T * Hi), P.w_s0 = Hi;
  P.cache = c.arr<uint8_t>("cache", np * ps * W * kes), P.c_s0 = ps * W * kes;
  P.kind = static_cast<int>(kind), P.qbs = qbs;
  P.bt = c.arr<int32_t>("bt", rows * width), P.bt_s0 = width;
  P.cu = c.arr<int32_t>("cu", B + 1), P.kvl = c.arr<int32_t>("kvl", B);
  const int64_t topk = c.i("topk");
  if (topk > 0) {
    P.out = c.make<int32_t>("out", T * topk), P.topk = topk;
    P.buf_logits = c.i("buf_logits");
  } else {
    const int64_t lw = c.i("width");
    P.logits = c.make<float>("logits", T * lw), P.logits_s0 = lw, P.width = lw;
    std::fill(P.logits, P.logits + T * lw, -std::numeric_limits<float>::infinity());
  }
  const core::Bounds b{T, rows, width, c.i("max_page_id")};
  return core::indexer(P, b, parallel(c.i("threads")));
}

std::string run_write(Case& c) {
  const int64_t mode = c.i("mode"), r = c.i("r"), rope = c.i("rope"), T = c.i("T");
  const int64_t ps = c.i("page_size"), np = c.i("num_pages");
  const int64_t cdt = c.i("cache_dt"), rdt = c.i("rope_dt");
  const int64_t rb = row_bytes(mode, r, rope, mode == core::kPlain ? dtype_size(cdt) : dtype_size(rdt));
  const Bytes& init = c.raw("cache");
  if (static_cast<int64_t>(init.size()) != np * ps * rb) throw std::runtime_error("cache size mismatch");
  char* cache = c.make<char>("cache", np * ps * rb);
  std::memcpy(cache, init.data(), init.size());
  core::WriteParams W;
  W.cache = cache, W.c_s0 = ps * rb, W.c_s1 = rb, W.page_size = ps, W.num_pages = np;
  W.mode = static_cast<int>(mode), W.cache_dt = dtype(cdt), W.rope_dt = dtype(rdt);
  W.r = r, W.rope = rope, W.T = T;
  W.c_kv = c.arr<float>("c_kv", T * r), W.k_pe = c.arr<float>("k_pe", T * rope);
  W.slots = c.arr<int64_t>("slots", T);
  W.kv_scale = static_cast<float>(c.f("kv_scale"));
  std::string err = core::write_latent(W, parallel(c.i("threads")));
  if (!err.empty()) c.out.erase("cache");
  return err;
}

// items [0, n) in `threads` contiguous chunks
void for_items(int64_t n, int64_t threads, const std::function<void(int64_t, int64_t)>& fn) {
  parallel(threads).for_range(n, 1, fn);
}

std::string run_head_gemm(Case& c) {
  const int64_t T = c.i("T"), H = c.i("H"), K = c.i("K"), N = c.i("N"), s0 = c.i("x_s0"), s1 = c.i("x_s1");
  const int64_t nb = mla_core::cdiv(N, mla_core::kCols), kp = mla_core::cdiv(K, 2);
  const auto* w = c.arr<uint16_t>("w", H * K * N);
  const auto* x = c.arr<uint16_t>("x", extent({{T, s0}, {H, s1}, {K, 1}}));
  uint16_t* packed = c.make<uint16_t>("packed", H * nb * kp * mla_core::kCols * 2);
  uint16_t* y = c.make<uint16_t>("y", T * H * N);
  const int64_t th = c.i("threads");
  for_items(H * nb, th, [&](int64_t b, int64_t e) { mla_native::pack_heads_items(w, K, N, packed, b, e); });
  if (T > 0)
    for_items(H * nb, th, [&](int64_t b, int64_t e) {
      mla_native::head_gemm_items(x, s0, s1, T, H, K, packed, N, y, H * N, N, b, e);
    });
  return {};
}

std::string run_decompress(Case& c) {
  const int64_t L = c.i("L"), H = c.i("H"), r = c.i("r"), nope = c.i("nope"), rope = c.i("rope"), vd = c.i("vdim");
  const int64_t w = r + rope;  // c_kv and k_pe: slices of one latent row
  const auto* lat = c.arr<uint16_t>("latent", L * w);
  mla_native::DecompressArgs a{lat, w, lat + r, w,
                               c.arr<uint16_t>("W_UK", H * nope * r), c.i("uk0"), c.i("uk1"), c.i("uk2"),
                               c.arr<uint16_t>("W_UV", H * r * vd), c.i("uv0"), c.i("uv1"), c.i("uv2"),
                               L, H, r, nope, rope, vd,
                               c.make<uint16_t>("k", L * H * (nope + rope)), c.make<uint16_t>("v", L * H * vd)};
  if (L == 0) return {};
  const int64_t nlb = mla_core::cdiv(L, mla_core::kCols), th = c.i("threads");
  std::vector<uint16_t> panels(static_cast<size_t>(nlb * mla_core::cdiv(r, 2) * mla_core::kCols * 2));
  for_items(nlb, th, [&](int64_t b, int64_t e) { mla_native::pack_latent_panels(a, panels.data(), b, e); });
  const int64_t items = 2 * H * mla_core::cdiv(nlb, mla_native::kPanelsPerItem);
  for_items(items, th, [&](int64_t b, int64_t e) { mla_native::decompress_items(a, panels.data(), b, e); });
  if (rope > 0) mla_native::copy_k_pe(a, 0, L);
  return {};
}

std::string run_mha(Case& c) {
  const int64_t H = c.i("H"), Lq = c.i("Lq"), Lk = c.i("Lk"), D = c.i("D"), Dv = c.i("Dv");
  const int64_t qs0 = c.i("q_s0"), qs1 = c.i("q_s1"), ks0 = c.i("k_s0"), ks1 = c.i("k_s1");
  const int64_t vs0 = c.i("v_s0"), vs1 = c.i("v_s1");
  mla_native::MhaArgs a{c.arr<uint16_t>("q", extent({{H, qs0}, {Lq, qs1}, {D, 1}})), qs0, qs1,
                        c.arr<uint16_t>("k", extent({{H, ks0}, {Lk, ks1}, {D, 1}})), ks0, ks1,
                        c.arr<uint16_t>("v", extent({{H, vs0}, {Lk, vs1}, {Dv, 1}})), vs0, vs1,
                        H, Lq, Lk, D, Dv, c.i("causal") != 0, static_cast<float>(c.f("scale")),
                        c.make<uint16_t>("o", H * Lq * Dv), c.make<float>("lse", H * Lq)};
  const int64_t nkb = a.nkb(), th = c.i("threads");
  std::vector<uint16_t> kpk(static_cast<size_t>(H * nkb * a.kblk())), vpk(static_cast<size_t>(H * nkb * a.vblk()));
  for_items(H * nkb, th, [&](int64_t b, int64_t e) { mla_native::mha_pack_items(a, kpk.data(), vpk.data(), b, e); });
  for_items(H * mla_core::cdiv(Lq, mla_native::kBM), th, [&](int64_t b, int64_t e) {
    mla_native::mha_query_items(a, kpk.data(), vpk.data(), b, e);
  });
  return {};
}

std::string run_widen(Case& c) {
  using mla_native::vec::VecF;
  constexpr int W = VecF::W;
  const int64_t N = c.i("N");
  if (N % W != 0) throw std::runtime_error("widen: N = " + std::to_string(N) + " is not a multiple of W");
  const auto* x = c.arr<uint16_t>("x", N);
  float* y = c.make<float>("y", W * N);
  int64_t dirty = 0;
  alignas(64) float lanes[W];
  auto past = [&](int n) {  // lanes [n, W) of `lanes` that are not +0
    for (int l = n; l < W; ++l) {
      uint32_t u;
      std::memcpy(&u, lanes + l, 4);
      dirty += u != 0;
    }
  };
  for (int64_t s = 0; s < N; s += W) VecF::load_bf16(x + s).store(y + s);
  {
    std::unique_ptr<uint16_t[]> none(new uint16_t[1]);
    VecF::load_bf16_n(none.get() + 1, 0).store(lanes);  // one past the end: nothing may be read
    past(0);
  }
  for (int n = 1; n < W; ++n) {
    float* row = y + n * N;
    for (int64_t s = 0; s < N; s += n) {
      const int k = static_cast<int>(std::min<int64_t>(n, N - s));
      std::unique_ptr<uint16_t[]> buf(new uint16_t[k]);  // exactly k: a read past it is reported
      std::memcpy(buf.get(), x + s, static_cast<size_t>(k) * 2);
      VecF::load_bf16_n(buf.get(), k).store(lanes);
      std::memcpy(row + s, lanes, static_cast<size_t>(k) * 4);
      past(k);
    }
  }
  *c.make<int64_t>("dirty", 1) = dirty;
  return {};
}

std::string run_case(Case& c) {
  const Bytes& op = c.raw("op");
  const std::string name(op.begin(), op.end());
  if (name == "attention") return run_attention(c);
  if (name == "sparse") return run_sparse(c);
  if (name == "keyset") return run_keyset(c);
  if (name == "indexer") return run_indexer(c);
  if (name == "write") return run_write(c);
  if (name == "head_gemm") return run_head_gemm(c);
  if (name == "decompress") return run_decompress(c);
  if (name == "mha") return run_mha(c);
  if (name == "widen") return run_widen(c);
  throw std::runtime_error("unknown op '" + name + "'");
}

#define MLA_STR2(x) #x
#define MLA_STR(x) MLA_STR2(x)

void print_info() {
  int64_t sve_bits = 0;
#if defined(__aarch64__) && defined(__linux__) && defined(PR_SVE_GET_VL)
  const int vl = prctl(PR_SVE_GET_VL);
  if (vl >= 0) sve_bits = 8 * (vl & PR_SVE_VL_LEN_MASK);
#endif
  std::printf("info ns=%s vec_w=%d sve_vl_bits=%lld\n", MLA_STR(mla_native), mla_native::vec::VecF::W,
              static_cast<long long>(sve_bits));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--info") {
    print_info();
    return 0;
  }
  for (int a = 1; a < argc; ++a) {
    const std::string path = argv[a];
    try {
      Case c;
      c.in = read_records(path);
      const std::string err = run_case(c);
      if (!err.empty()) {
        c.out.clear();
        c.out["error"] = Bytes(err.begin(), err.end());
        std::printf("refused %s: %s\n", path.c_str(), err.c_str());
      } else {
        std::printf("ok %s\n", path.c_str());
      }
      write_records(path + ".out", c.out);
    } catch (const std::exception& e) {  // a malformed case: the harness's bug, not a refusal
      std::fprintf(stderr, "driver error %s: %s\n", path.c_str(), e.what());
      return 2;
    }
  }
  return 0;
}
