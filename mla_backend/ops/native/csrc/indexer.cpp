// The DSA lightning indexer (DeepSeek-V3.2, GLM-5): scores of every visible cached key for each
// query token and the causal top-k per token, over a paged index-key cache.
//
//   I[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t])     q [T, Hi, Di] bf16 / fp16 / fp32 / e4m3
//                                                      w [T, Hi] float32 (every scale folded in)
//   k[t] = the cache's key at logical position t of the token's request (t <= its position):
//     fp8 cache (vLLM's DeepseekV32IndexerCache, uint8 pages): per page first page_size x Di
//       e4m3 values (token j at j * Di), then page_size x (Di / qbs) float32 scales (token j's
//       at page_size * Di + 4 j Di / qbs); k = e4m3 x the scale of its block of qbs values;
//     plain cache: [pages, page_size, Di] bf16 / fp16 / fp32.
//
// Organisation: a GEMM per work item (request, block of query tokens, kv split). The item's
// queries (tokens x Hi heads) are packed once as the B operand of gemm_core.h (bf16 VNNI pairs,
// one column per (token, head)); keys stream through it as the A operand in panels of kKeyRows
// rows, each key widened once from the cache (e4m3 decoded exactly to bf16 / fp32, bf16 copied,
// fp16 / fp32 rounded to bf16 on the levels whose GEMM takes bf16 rows). C [key][token, head]
// comes out fp32; per key and token the epilogue sums w * max(C, 0) over the heads (vectorized)
// and multiplies by the key's scale (several scales per key: one GEMM per block of qbs values,
// summed with their scales before the relu). Then either the logit is stored (logits mode) or
// it enters the token's streaming top-k: a candidate buffer of int64 rank keys (the logit's
// order-preserving 32-bit image, then 2^32 - 1 - position: distinct keys, ties to the lower
// position; -0 == +0; NaN below every number) filtered by the current k-th best and cut back to
// k by nth_element when full (an item whose tokens x keys fit buf_logits keeps its logits
// instead and selects by a histogram of their top bits: the same keys, the same rule); a
// token's splits are merged the same way; the selected positions
// are written ascending, then -1 (mla_backend/ops/torch/indexer.py holds the same rule in torch).
// Work items go to the caller's Parallel (at::parallel_for in the torch layer); every index is
// checked before anything is read.
#ifndef MLA_CORE_ONLY  // the core test driver includes this file without torch
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "ops.h"
#endif

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_params.h"
#include "rows.h"
#include "gemm_core.h"

namespace mla_native {
namespace core {

// query dtypes (IndexParams::q_dt) and cache kinds (IndexParams::kind)
constexpr int kIdxQBF16 = 0, kIdxQF16 = 1, kIdxQF32 = 2, kIdxQE4M3 = 3;
constexpr int kIdxFp8 = 0, kIdxBF16 = 1, kIdxF16 = 2, kIdxF32 = 3;

// keys per A panel: whole register blocks of the level's GEMM kernel (6 rows on the bf16
// dot-product levels, 4 on the fp32 ones, 16-row tiles with AMX)
#if defined(MLA_HAS_AMX) || !defined(MLA_GEMM_BF16)
constexpr int kKeyRows = 32;
#else
constexpr int kKeyRows = 30;
#endif
// Query columns (tokens x heads) per item, at least Hi. On the fp32 FMA levels 64: the item's
// packed queries (Di x 64 bf16 pairs, 16 KB at Di 128) stay in L1 beside the key panel and C
// (on AVX2, 64 index heads: one token an item ran faster than four; 8 index heads: 8 tokens as
// fast as 32). The bf16 dot-product and AMX levels keep 256 (not measured with fewer).
#if defined(MLA_GEMM_BF16)
constexpr int64_t kIdxMaxCols = 256;
#else
constexpr int64_t kIdxMaxCols = 64;
#endif

// Logits per item kept whole for a histogram selection when the item's tokens x keys fit here
// (a decode step's splits, short prefills); larger items stream through TopK.
constexpr int64_t kIdxBufLogits = int64_t{1} << 18;

struct IndexParams {
  int64_t T = 0, Hi = 0, Di = 0, B = 0, page_size = 0, num_pages = 0;
  const char* q = nullptr;  // [T, Hi, Di], byte strides q_s0 / q_s1, last dim contiguous
  int64_t q_s0 = 0, q_s1 = 0;
  int q_dt = kIdxQBF16;
  const float* w = nullptr;  // [T, Hi], row stride w_s0 (elements)
  int64_t w_s0 = 0;
  const uint8_t* cache = nullptr;  // pages at byte stride c_s0, each contiguous
  int64_t c_s0 = 0;
  int kind = kIdxFp8;
  int64_t qbs = 0;  // fp8: values per scale
  const int32_t* bt = nullptr;
  int64_t bt_s0 = 0;
  const int32_t* cu = nullptr;   // [B + 1]
  const int32_t* kvl = nullptr;  // [B] keys per request
  // Keys over tokens (DeepSeek-V4's compressed keys: one per `ratio` tokens; 1 = DSA, a key per
  // token). With ratio > 1, qkvl [B] holds the requests' token lengths, kvl[i] = qkvl[i] / ratio,
  // the token at position p sees keys 0 .. (p + 1) / ratio - 1, and a block-table page holds
  // page_size keys = page_size x ratio tokens (vLLM's compressed caches).
  int64_t ratio = 1;
  const int32_t* qkvl = nullptr;
  // outputs: logits [T, width] at row stride logits_s0 (visible positions written), or the
  // top-k [T, topk] int32
  float* logits = nullptr;
  int64_t logits_s0 = 0, width = 0;
  int32_t* out = nullptr;
  int64_t topk = 0;
  int64_t buf_logits = kIdxBufLogits;  // the histogram selection's limit (tests force 0: streaming)
};

inline int64_t key_bytes(const IndexParams& P) {
  return P.kind == kIdxFp8 || P.kind == kIdxBF16 ? (P.kind == kIdxFp8 ? P.Di : 2 * P.Di)
                                                  : (P.kind == kIdxF16 ? 2 * P.Di : 4 * P.Di);
}

// "" when P's sizes and indices are consistent (b: the block table's shape and the caller's
// bound on page ids, as the attention's validate), else why not.
inline std::string validate_indexer(const IndexParams& P, const Bounds& b) {
  using detail::cat;
  if (P.Hi < 1 || P.Di < 1) return cat("index heads ", P.Hi, " and head dim ", P.Di, " must be >= 1");
  if (P.page_size < 1) return cat("page_size ", P.page_size, " must be >= 1");
  if (P.kind == kIdxFp8 && (P.qbs < 1 || P.Di % P.qbs))
    return cat("quant_block_size ", P.qbs, " must divide index_head_dim ", P.Di);
  if (P.kind == kIdxFp8 && P.qbs != P.Di && (P.qbs % 2 || P.Di / P.qbs > 64))
    return cat("quant_block_size ", P.qbs, " must be even and at least index_head_dim / 64 when a ",
               "key has several scales (index_head_dim ", P.Di, ")");
  if (P.out != nullptr && P.topk < 1) return cat("topk ", P.topk, " must be >= 1");
  if (P.ratio < 1 || (P.ratio > 1 && P.B > 0 && P.qkvl == nullptr))
    return cat("ratio ", P.ratio, " must be >= 1, with the requests' token lengths when > 1");
  Params A;  // the attention's checks of the same indices (over tokens: pages of ratio x keys)
  A.H = 1, A.r = 1, A.rope = 0, A.B = P.B, A.page_size = P.page_size * P.ratio, A.num_pages = P.num_pages;
  A.bt = P.bt, A.bt_s0 = P.bt_s0, A.cu = P.cu, A.kvl = P.qkvl != nullptr ? P.qkvl : P.kvl;
  if (std::string err = validate(A, b); !err.empty()) return err;
  if (P.qkvl != nullptr)
    for (int64_t i = 0; i < P.B; ++i)
      if (P.kvl[i] != P.qkvl[i] / P.ratio)
        return cat("keys[", i, "] = ", P.kvl[i], " != kv_lens[", i, "] / ratio = ", P.qkvl[i] / P.ratio);
  if (P.out == nullptr)  // the logits mode (whatever the buffer: a null one of width 0 included)
    for (int64_t i = 0; i < P.B; ++i)
      if (P.cu[i + 1] > P.cu[i] && P.kvl[i] > P.width)
        return cat("kv_lens[", i, "] = ", P.kvl[i], " exceeds the logits' width ", P.width);
  return {};
}

// The logit's order-preserving unsigned 32-bit image: -0 as +0, NaN (0) below every number.
inline uint32_t logit_image(float f) {
  f = f + 0.0f;  // -0 -> +0
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The int64 rank key of a logit at a position (mla_backend/ops/torch/indexer.py, rank_keys): the
// image less 2^31 in the high word, 2^32 - 1 - position in the low one.
inline int64_t rank_key(float f, int64_t pos) {
  return (static_cast<int64_t>(logit_image(f)) - 2147483648LL) * 4294967296LL + (4294967295LL - pos);
}
inline int64_t key_pos(int64_t key) { return 4294967295LL - (key & 0xFFFFFFFFLL); }

// A streaming top-k over rank keys: keys at most the current k-th best are dropped; the buffer
// is cut back to the k best whenever it fills.
struct TopK {
  std::vector<int64_t> v;
  int64_t thr = INT64_MIN;
  // a logit below fthr (the float whose image is thr's high word) has a key below thr
  float fthr = -std::numeric_limits<float>::infinity();
  size_t k = 1, cap = 2;
  void reset(int64_t k_) {
    k = static_cast<size_t>(k_);
    cap = std::max<size_t>(2 * k, k + 256);
    v.clear();
    v.reserve(cap);
    thr = INT64_MIN;
    fthr = -std::numeric_limits<float>::infinity();
  }
  // the logit at a position (a float compare drops most once the buffer has been cut)
  void offer(float logit, int64_t pos) {
    if (logit < fthr) return;
    push(rank_key(logit, pos));
  }
  void push(int64_t key) {
    if (key <= thr) return;
    v.push_back(key);
    if (v.size() >= cap) cut();
  }
  void cut() {
    if (v.size() <= k) return;
    std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<int64_t>());
    v.resize(k);
    thr = v[k - 1];
    const int64_t k32 = thr >> 32;  // INT32_MIN: a NaN logit, which bounds nothing
    if (k32 > INT32_MIN) {
      const int32_t bits = static_cast<int32_t>(k32 >= 0 ? k32 : (k32 ^ 0x7FFFFFFF));
      std::memcpy(&fthr, &bits, 4);
    }
  }
};

// out[0, topk) = the positions (all < L) of the k best keys of v, ascending (a bitmap of the
// positions, no sort), then -1. bits: scratch.
inline void write_selection(std::vector<int64_t>& v, int64_t topk, int64_t L, std::vector<uint64_t>& bits,
                            int32_t* out) {
  const size_t k = static_cast<size_t>(topk);
  if (v.size() > k) {
    std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<int64_t>());
    v.resize(k);
  }
  const int64_t words = ceil_div(L, 64);
  bits.assign(static_cast<size_t>(words), 0);
  for (const int64_t key : v) {
    const int64_t p = key_pos(key);
    bits[p >> 6] |= 1ull << (p & 63);
  }
  int64_t c = 0;
  for (int64_t w = 0; w < words; ++w)
    for (uint64_t b = bits[w]; b != 0; b &= b - 1) out[c++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(b));
  for (; c < topk; ++c) out[c] = -1;
}

// v = the rank keys of the k best of n logits lg[0, n) at positions pos0 + j (all of them when
// n <= k), in no order: a histogram of the images' top 11 bits finds the bin holding the k-th
// best; the bins above it are taken whole and that bin's keys by nth_element (cand: scratch).
inline void select_best(const float* lg, int64_t n, int64_t pos0, int64_t k, std::vector<int64_t>& v,
                        std::vector<int64_t>& cand) {
  v.clear();
  if (n <= k) {
    for (int64_t j = 0; j < n; ++j) v.push_back(rank_key(lg[j], pos0 + j));
    return;
  }
  constexpr int kBits = 11;
  uint32_t hist[1 << kBits] = {};
  for (int64_t j = 0; j < n; ++j) ++hist[logit_image(lg[j]) >> (32 - kBits)];
  int64_t above = 0;
  uint32_t b = (1u << kBits) - 1;
  for (; b > 0 && above + hist[b] < k; --b) above += hist[b];
  cand.clear();
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bin = logit_image(lg[j]) >> (32 - kBits);
    if (bin > b) v.push_back(rank_key(lg[j], pos0 + j));
    else if (bin == b) cand.push_back(rank_key(lg[j], pos0 + j));
  }
  const size_t r = static_cast<size_t>(k - above);
  if (cand.size() > r) std::nth_element(cand.begin(), cand.begin() + (r - 1), cand.end(), std::greater<int64_t>());
  v.insert(v.end(), cand.begin(), cand.begin() + std::min(r, cand.size()));
}

using mla_core::AElem;

// The shared e4m3 decodes read the NaN bytes 0x7f / 0xff as +-480; the indexer's rule (a NaN
// logit ranks below every number) needs them NaN: dst[d] = NaN where src[d] is a NaN byte.
template <typename T>
inline void e4m3_nans(T* dst, const uint8_t* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d)
    if ((src[d] & 0x7f) == 0x7f) {
      if constexpr (std::is_same_v<T, float>) dst[d] = std::numeric_limits<float>::quiet_NaN();
      else dst[d] = T(vec::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()));
    }
}

// dst[0, lda) = the key at src (its values; zero padded) in the GEMM's A operand form.
inline void load_key(AElem* dst, const uint8_t* src, const IndexParams& P, int64_t lda) {
  const int64_t Di = P.Di;
#if defined(MLA_GEMM_BF16)
  if (P.kind == kIdxBF16) {
    std::memcpy(dst, src, Di * 2);
  } else if (P.kind == kIdxFp8) {
#if defined(MLA_AVX512)
    for (int64_t d = 0; d < Di; d += 32) {
      const int64_t left = std::min<int64_t>(32, Di - d);
      const __mmask32 msk = left >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << left) - 1);
      _mm512_mask_storeu_epi16(dst + d, msk, fp8x32_to_bf16(src + d, msk));
    }
#else
    for (int64_t d = 0; d < Di; d += kW) {  // e4m3 / 256 exact in fp32, x 256 exact, bf16 exact
      const int k = static_cast<int>(std::min<int64_t>(kW, Di - d));
      (VecF::load_e4m3_div256_n(src + d, k) * VecF::set1(kFp8Unscale)).store_bf16_n(dst + d, k);
    }
#endif
    e4m3_nans(dst, src, Di);
  } else {
    for (int64_t d = 0; d < Di; d += kW) {
      const int k = static_cast<int>(std::min<int64_t>(kW, Di - d));
      const VecF x = P.kind == kIdxF16 ? load_f32(reinterpret_cast<const vec::fp16_t*>(src) + d, k)
                                       : load_f32(reinterpret_cast<const float*>(src) + d, k);
      x.store_bf16_n(dst + d, k);
    }
  }
#else
  if (P.kind == kIdxFp8) {
    widen_e4m3_row(dst, src, Di, kFp8Unscale);
    e4m3_nans(dst, src, Di);
  } else if (P.kind == kIdxBF16) widen_row(dst, reinterpret_cast<const vec::bf16_t*>(src), Di);
  else if (P.kind == kIdxF16) widen_row(dst, reinterpret_cast<const vec::fp16_t*>(src), Di);
  else std::memcpy(dst, src, Di * 4);
#endif
  std::fill(dst + Di, dst + lda, AElem(0));
}

// q row (Di values of dtype q_dt) -> bf16 bits (e4m3 and bf16 exact; fp16 / fp32 rounded).
inline void q_to_bf16(uint16_t* dst, const char* src, const IndexParams& P, float* tmp) {
  const int64_t Di = P.Di;
  if (P.q_dt == kIdxQBF16) {
    std::memcpy(dst, src, Di * 2);
    return;
  }
  if (P.q_dt == kIdxQE4M3) {
    widen_e4m3_row(tmp, reinterpret_cast<const uint8_t*>(src), Di, kFp8Unscale);
    e4m3_nans(tmp, reinterpret_cast<const uint8_t*>(src), Di);
  } else if (P.q_dt == kIdxQF16) widen_row(tmp, reinterpret_cast<const vec::fp16_t*>(src), Di);
  else std::memcpy(tmp, src, Di * 4);
  for (int64_t d = 0; d < Di; ++d) dst[d] = vec::f32_to_bf16(tmp[d]);
}

struct IdxItem {
  int32_t req, j0, j1, split, nsplit;
  int64_t kv0, kv1, part_off, cost;
};

// Thread scratch of the indexer.
struct IdxScratch {
  std::vector<uint16_t> qb, bp;
  std::vector<AElem> a;
  std::vector<float> c, cb, tmp;
  std::vector<TopK> tk;
  std::vector<uint64_t> bits;
  std::vector<float> lb;        // the item's logits [token, key] (histogram selection)
  std::vector<int64_t> cand;
};

inline void run_indexer_item(const IndexParams& P, const IdxItem& it, IdxScratch& S,
                             int64_t* pcand, int32_t* pcnt) {
  const int64_t i = it.req, Hi = P.Hi, Di = P.Di, ps = P.page_size;
  const int64_t n = P.cu[i + 1] - P.cu[i], L = P.kvl[i];
  const int64_t P0 = (P.qkvl != nullptr ? P.qkvl[i] : L) - n;  // the block's tokens sit at P0 + j
  const int64_t R = P.ratio;
  auto seen = [R](int64_t pos) { return (pos + 1) / R; };  // keys the token at pos sees
  const int TB = it.j1 - it.j0;
  const int64_t ncols = mla_core::round_up(TB * Hi, mla_core::kCols);
  const int64_t kp = mla_core::cdiv(Di, 2), lda = mla_core::round_up(Di, mla_core::kKAlign);
  const bool fp8 = P.kind == kIdxFp8;
  const int64_t nb = fp8 ? Di / P.qbs : 1;
  // B: the block's queries as bf16 VNNI pairs, one column per (token, head)
  S.qb.assign(static_cast<size_t>(ncols * Di), 0);
  S.tmp.resize(static_cast<size_t>(Di));
  for (int tau = 0; tau < TB; ++tau)
    for (int64_t h = 0; h < Hi; ++h) {
      const char* src = P.q + (P.cu[i] + it.j0 + tau) * P.q_s0 + h * P.q_s1;
      q_to_bf16(S.qb.data() + (tau * Hi + h) * Di, src, P, S.tmp.data());
    }
  S.bp.resize(static_cast<size_t>(kp * ncols * 2));
  mla_core::pack_b(S.qb.data(), 1, Di, Di, ncols, ncols, S.bp.data());
  S.a.resize(static_cast<size_t>(mla_core::a_panel_elems(Di)));
  const int64_t crow = mla_core::round_up(kKeyRows, 16);
  S.c.resize(static_cast<size_t>(crow * ncols));
  if (nb > 1) S.cb.resize(static_cast<size_t>(crow * ncols));
  const bool topk = P.out != nullptr;
  const int64_t span = it.kv1 - it.kv0;
  const bool whole = topk && TB * span <= P.buf_logits;  // histogram selection at the end
  if (topk) {
    if (S.tk.size() < static_cast<size_t>(TB)) S.tk.resize(TB);
    for (int tau = 0; tau < TB; ++tau) S.tk[tau].reset(P.topk);
    if (whole) S.lb.resize(static_cast<size_t>(TB * span));
  }
  float kscale[kKeyRows * 64];  // per key row and block
  const int64_t kend = std::min<int64_t>(it.kv1, seen(P0 + it.j1 - 1));  // the block's last token sees < this
  for (int64_t p0 = it.kv0; p0 < kend; p0 += kKeyRows) {
    const int M = static_cast<int>(std::min<int64_t>(kKeyRows, kend - p0));
    const int rows = mla_core::padded_rows(M);
    for (int m = 0; m < rows; ++m) {
      AElem* dst = S.a.data() + m * lda;
      if (m >= M) {
        std::fill(dst, dst + lda, AElem(0));
        continue;
      }
      const int64_t p = p0 + m;
      const uint8_t* page = P.cache + static_cast<int64_t>(P.bt[i * P.bt_s0 + p / ps]) * P.c_s0;
      const int64_t off = p % ps;
      if (fp8) {
        load_key(dst, page + off * Di, P, lda);
        std::memcpy(kscale + m * nb, page + ps * Di + off * nb * 4, nb * 4);
      } else {
        load_key(dst, page + off * key_bytes(P), P, lda);
        kscale[m] = 1.0f;
      }
    }
    // the next panel's keys (and their scales' line) into L2 while this one computes
    const int64_t pn = p0 + kKeyRows, mn = std::min<int64_t>(kKeyRows, kend - pn);
    for (int64_t m = 0; m < mn; ++m) {
      const int64_t p = pn + m;
      const uint8_t* page = P.cache + static_cast<int64_t>(P.bt[i * P.bt_s0 + p / ps]) * P.c_s0;
      const int64_t off = p % ps;
      prefetch_row(reinterpret_cast<const char*>(page + off * key_bytes(P)), key_bytes(P));
      if (fp8 && (off == 0 || m == 0)) vec::prefetch_l2(page + ps * Di + off * nb * 4);
    }
    float* C = S.c.data();
    if (nb == 1) {
      const mla_core::APanel a{S.a.data(), lda, M, kp};
      mla_core::gemm(a, S.bp.data(), ncols, ncols, C, ncols, false);
    } else {  // one GEMM per block of qbs values, summed with the blocks' scales
      const int64_t bk = P.qbs / 2;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const mla_core::APanel a{S.a.data() + blk * P.qbs, lda, M, bk};
        mla_core::gemm(a, S.bp.data() + blk * bk * ncols * 2, ncols, ncols, S.cb.data(), ncols, false);
        for (int m = 0; m < M; ++m) {
          const VecF s = VecF::set1(kscale[m * nb + blk]);
          float* cr = C + m * ncols;
          const float* br = S.cb.data() + m * ncols;
          for (int64_t c = 0; c < ncols; c += kW) {
            const VecF x = VecF::load(br + c) * s;
            (blk == 0 ? x : VecF::load(cr + c) + x).store(cr + c);
          }
        }
      }
    }
    // epilogue: per key and token, sum_h w * max(C, 0) (x the key's scale)
    for (int tau = 0; tau < TB; ++tau) {
      const int64_t t = P.cu[i] + it.j0 + tau, lim = seen(P0 + it.j0 + tau) - 1;  // sees keys <= lim
      const float* w = P.w + t * P.w_s0;
      const int mv = static_cast<int>(std::min<int64_t>(M, lim - p0 + 1));
      for (int m = 0; m < mv; ++m) {
        const float* cr = C + m * ncols + tau * Hi;
        VecF acc = VecF::zero();
        for (int64_t h = 0; h < Hi; h += kW) {
          const int k = static_cast<int>(std::min<int64_t>(kW, Hi - h));
          const VecF x = vec::max(VecF::zero(), load_f32(cr + h, k));  // NaN stays NaN
          acc = vec::fma(load_f32(w + h, k), x, acc);
        }
        const float logit = vec::hsum(acc) * (nb == 1 ? kscale[m] : 1.0f);
        if (whole) S.lb[tau * span + p0 + m - it.kv0] = logit;
        else if (topk) S.tk[tau].offer(logit, p0 + m);
        else P.logits[t * P.logits_s0 + p0 + m] = logit;
      }
    }
  }
  if (!topk) return;
  for (int tau = 0; tau < TB; ++tau) {
    std::vector<int64_t>& v = S.tk[tau].v;
    const int64_t t = P.cu[i] + it.j0 + tau;
    if (whole) {  // the token's visible keys of the item: positions kv0 .. min(kv1, lim + 1)
      const int64_t nv = std::max<int64_t>(0, std::min(it.kv1, seen(P0 + it.j0 + tau)) - it.kv0);
      select_best(S.lb.data() + tau * span, nv, it.kv0, P.topk, v, S.cand);
    }
    if (it.nsplit == 1) {
      write_selection(v, P.topk, L, S.bits, P.out + t * P.topk);
      continue;
    }
    S.tk[tau].cut();
    const int64_t slot = it.part_off + (it.j0 + tau) * it.nsplit + it.split;
    std::copy(v.begin(), v.end(), pcand + slot * P.topk);
    pcnt[slot] = static_cast<int32_t>(v.size());
  }
}

// The whole call (logits or top-k, whichever output P names): checks P against b (a refusal
// returns its message; nothing read or written), plans the items, runs them over par and
// merges the splits. Returns "" on success.
inline std::string indexer(const IndexParams& P, const Bounds& b, const Parallel& par) {
  if (std::string err = validate_indexer(P, b); !err.empty()) return err;
  const int64_t Hi = P.Hi;
  const int64_t tb = std::max<int64_t>(1, kIdxMaxCols / Hi);
  int64_t total = 0;
  for (int64_t i = 0; i < P.B; ++i) total += (P.cu[i + 1] - P.cu[i]) > 0 ? P.kvl[i] : 0;
  const int64_t nthreads = std::max<int64_t>(1, par.threads);
  const int64_t chunk = round_up(std::max<int64_t>(1024, ceil_div(total, 4 * nthreads)), kKeyRows);
  // a request's kv is split (its tokens' candidates merged after) only when the blocks of query
  // tokens alone cannot keep the threads busy (a decode step); a prefill's blocks are enough
  int64_t blocks = 0;
  for (int64_t i = 0; i < P.B; ++i) blocks += ceil_div(P.cu[i + 1] - P.cu[i], tb);
  const bool split = blocks < 2 * nthreads;
  std::vector<IdxItem> items;
  int64_t slots = 0;
  for (int64_t i = 0; i < P.B; ++i) {
    const int64_t n = P.cu[i + 1] - P.cu[i], L = P.kvl[i];
    if (n == 0) continue;
    if (L == 0) {  // no key yet (compressed keys before the first is complete): nothing selected
      if (P.out != nullptr) std::fill(P.out + P.cu[i] * P.topk, P.out + P.cu[i + 1] * P.topk, -1);
      continue;
    }
    const int64_t ns = P.out != nullptr && split ? std::max<int64_t>(1, ceil_div(L, chunk)) : 1;
    const int64_t len = round_up(ceil_div(L, ns), kKeyRows);
    const int64_t poff = ns > 1 ? slots : 0;
    if (ns > 1) slots += n * ns;
    for (int64_t j0 = 0; j0 < n; j0 += tb) {
      const int64_t j1 = std::min(n, j0 + tb);
      for (int64_t s = 0; s < ns; ++s) {
        IdxItem it;
        set_split(it, i, s, ns, len, L, poff);
        it.j0 = static_cast<int32_t>(j0);
        it.j1 = static_cast<int32_t>(j1);
        it.cost = (it.kv1 - it.kv0) * (j1 - j0);
        if (it.kv0 < it.kv1) items.push_back(it);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const IdxItem& a, const IdxItem& c) { return a.cost > c.cost; });
  std::vector<int64_t> pcand(static_cast<size_t>(slots * std::max<int64_t>(P.topk, 1)));
  std::vector<int32_t> pcnt(static_cast<size_t>(slots), 0);
  run_pulled(static_cast<int64_t>(items.size()), par, [&](auto& pull) {
    IdxScratch S;
    for (int64_t k; (k = pull()) >= 0;) run_indexer_item(P, items[k], S, pcand.data(), pcnt.data());
  });
  if (slots == 0) return {};
  // merge each split token's candidates
  struct Tok {
    int64_t t, slot0, ns, L;
  };
  std::vector<Tok> toks;
  for (const IdxItem& it : items)
    if (it.nsplit > 1 && it.split == 0)
      for (int64_t j = it.j0; j < it.j1; ++j)
        toks.push_back({P.cu[it.req] + j, it.part_off + j * it.nsplit, it.nsplit, P.kvl[it.req]});
  par.for_range(static_cast<int64_t>(toks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> v;
    std::vector<uint64_t> bits;
    for (int64_t x = b0; x < b1; ++x) {
      const Tok& tk = toks[x];
      v.clear();
      for (int64_t s = 0; s < tk.ns; ++s) {
        const int64_t* c = pcand.data() + (tk.slot0 + s) * P.topk;
        v.insert(v.end(), c, c + pcnt[tk.slot0 + s]);
      }
      write_selection(v, P.topk, tk.L, bits, P.out + tk.t * P.topk);
    }
  });
  return {};
}

}  // namespace core

#ifndef MLA_CORE_ONLY
// ---- torch layer (declared in ops.h, registered in api.cpp) -----------------------------
namespace {

at::Tensor i32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " dtype ",
              t.scalar_type(), " is not supported; use int32");
  return t.to(at::kInt).contiguous();
}

// IndexParams from the tensors (checked); keeps the converted index tensors alive in `keep`.
core::IndexParams index_params(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                               const at::Tensor& block_table, const at::Tensor& cu_in,
                               const at::Tensor& kvl_in, int64_t quant_block_size,
                               std::vector<at::Tensor>& keep, core::Bounds& b, int64_t max_page_id,
                               int64_t ratio) {
  TORCH_CHECK(q.device().is_cpu() && weights.device().is_cpu() && cache.device().is_cpu(),
              "mla native indexer: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q_I must be [T, Hi, Di] with a contiguous last dim, got ",
              q.sizes(), " strides ", q.strides());
  const auto qdt = q.scalar_type();
  TORCH_CHECK(qdt == at::kBFloat16 || qdt == at::kHalf || qdt == at::kFloat || qdt == at::kFloat8_e4m3fn,
              "q_I dtype ", qdt, " is not supported; use bfloat16, float16, float32 or float8_e4m3fn");
  const int64_t T = q.size(0), Hi = q.size(1), Di = q.size(2);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 2 && weights.size(0) == T &&
                  weights.size(1) == Hi && (weights.stride(1) == 1 || Hi <= 1),
              "weights must be [T, Hi] float32 with a contiguous last dim, got ", weights.scalar_type(), " ",
              weights.sizes(), " strides ", weights.strides());
  TORCH_CHECK(cache.dim() == 3 && cache.stride(2) == 1 && cache.stride(1) == cache.size(2),
              "index cache must be [num_pages, page_size, W] with contiguous pages, got ", cache.sizes(),
              " strides ", cache.strides());
  const auto cdt = cache.scalar_type();
  core::IndexParams P;
  if (cdt == at::kByte) {
    TORCH_CHECK(quant_block_size >= 1 && Di % quant_block_size == 0, "quant_block_size ", quant_block_size,
                " must divide index_head_dim ", Di);
    TORCH_CHECK(cache.size(2) == Di + 4 * (Di / quant_block_size), "fp8 index cache width ", cache.size(2),
                " != Di + 4 Di / quant_block_size = ", Di + 4 * (Di / quant_block_size));
    P.kind = core::kIdxFp8;
  } else {
    TORCH_CHECK(cdt == at::kBFloat16 || cdt == at::kHalf || cdt == at::kFloat, "index cache dtype ", cdt,
                " is not supported; use uint8 (fp8 pages), bfloat16, float16 or float32");
    TORCH_CHECK(cache.size(2) == Di, "plain index cache width ", cache.size(2), " != index_head_dim ", Di);
    P.kind = cdt == at::kBFloat16 ? core::kIdxBF16 : (cdt == at::kHalf ? core::kIdxF16 : core::kIdxF32);
  }
  at::Tensor bt = block_table;
  TORCH_CHECK(bt.dim() == 2, "block_table must be [B, max_pages], got ", bt.sizes());
  bt = i32(bt, "block_table");
  at::Tensor cu = i32(cu_in, "cu_seqlens_q"), kvl = i32(kvl_in, "kv_lens");
  TORCH_CHECK(ratio >= 1, "ratio ", ratio, " must be >= 1 (tokens per key)");
  at::Tensor keys = ratio > 1 ? at::floor_divide(kvl, ratio).contiguous() : kvl;  // keys per request
  keep = {bt, cu, kvl, keys};
  const int64_t es = cache.element_size();
  P.T = T, P.Hi = Hi, P.Di = Di, P.B = kvl.numel(), P.page_size = cache.size(1), P.num_pages = cache.size(0);
  TORCH_CHECK(cu.numel() == P.B + 1, "cu_seqlens_q must be [B + 1] = [", P.B + 1, "], got ", cu.sizes());
  const int64_t qes = q.element_size();
  P.q = static_cast<const char*>(q.data_ptr()), P.q_s0 = q.stride(0) * qes, P.q_s1 = q.stride(1) * qes;
  P.q_dt = qdt == at::kBFloat16 ? core::kIdxQBF16
                                : (qdt == at::kHalf ? core::kIdxQF16 : (qdt == at::kFloat ? core::kIdxQF32 : core::kIdxQE4M3));
  P.w = weights.data_ptr<float>(), P.w_s0 = weights.stride(0);
  P.cache = static_cast<const uint8_t*>(cache.data_ptr()), P.c_s0 = cache.stride(0) * es;
  P.qbs = quant_block_size;
  P.bt = bt.data_ptr<int32_t>(), P.bt_s0 = bt.stride(0);
  P.cu = cu.data_ptr<int32_t>(), P.kvl = keys.data_ptr<int32_t>();
  P.ratio = ratio, P.qkvl = ratio > 1 ? kvl.data_ptr<int32_t>() : nullptr;
  b = core::Bounds{T, bt.size(0), bt.size(1), max_page_id};
  return P;
}

}  // namespace

void indexer_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                  const at::Tensor& block_table, const at::Tensor& cu, const at::Tensor& kv_lens,
                  int64_t quant_block_size, int64_t topk, int64_t max_page_id, const at::Tensor& out,
                  int64_t ratio) {
  std::vector<at::Tensor> keep;
  core::Bounds b;
  core::IndexParams P =
      index_params(q, weights, cache, block_table, cu, kv_lens, quant_block_size, keep, b, max_page_id, ratio);
  TORCH_CHECK(out.scalar_type() == at::kInt && out.is_contiguous() && out.dim() == 2 && out.size(0) == P.T &&
                  out.size(1) == topk,
              "out must be [T, topk] = [", P.T, ", ", topk, "] int32 contiguous, got ", out.scalar_type(), " ",
              out.sizes());
  TORCH_CHECK(topk >= 1, "topk ", topk, " must be >= 1");  // (an empty out reads as logits mode)
  P.out = out.data_ptr<int32_t>();
  P.topk = topk;
  const std::string err = core::indexer(P, b, torch_parallel());
  TORCH_CHECK(err.empty(), err);
}

at::Tensor indexer_logits(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                          const at::Tensor& block_table, const at::Tensor& cu, const at::Tensor& kv_lens,
                          int64_t quant_block_size, int64_t width, int64_t max_page_id, int64_t ratio) {
  std::vector<at::Tensor> keep;
  core::Bounds b;
  core::IndexParams P =
      index_params(q, weights, cache, block_table, cu, kv_lens, quant_block_size, keep, b, max_page_id, ratio);
  at::Tensor logits = at::full({P.T, width}, -std::numeric_limits<float>::infinity(), weights.options());
  P.logits = logits.data_ptr<float>();
  P.logits_s0 = width;
  P.width = width;
  const std::string err = core::indexer(P, b, torch_parallel());
  TORCH_CHECK(err.empty(), err);
  return logits;
}
#endif  // MLA_CORE_ONLY

}  // namespace mla_native
