"""DeepSeek Sparse Attention ops (:mod:`mla_backend.sparse`) against the float64 oracle
(:mod:`mla_backend.testing.reference`), on the torch path and the native kernels at every ISA
level this CPU runs (``MLA_BACKEND_TEST_ISAS`` restricts them): the index cache's bytes (vLLM's
page layout and quantization rule), indexer logits, the top-k sets (with near-tie slack; exact
ties by the lower-position rule), the sparse attention against dense attention masked to the
same index set over every latent layout, ragged batches, pages 1 / 16 / 64 shuffled with NaN in
never-written rows, lists shorter than k, -1 padding, out-of-range indices refused, bad input
named, and hypothesis-drawn shapes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.index_cache import IndexCacheLayout
from mla_backend.ops import IndexKeyWrite
from mla_backend.testing.cases import DsaCase, index_fp8_dequantized, make_dsa_case
from mla_backend.testing.dsa_checks import check_logits, check_sparse, check_topk, logit_bound
from mla_backend.testing.native_checks import ATTENTION_DTYPES
from mla_backend.testing.reference import reference_indexer_logits, reference_topk

FP8 = torch.float8_e4m3fn
DIMS = mb.MLADims(4, 40, 8, 8, 8)  # H, r, nope, rope, v: odd r (partial fp8_ds_mla tile)
RAGGED = ([0, 9, 70, 3, 130], [5, 1, 6, 0, 2])  # fresh extend, decodes, an empty request


def _fp32_inputs(k: object) -> bool:
    """Whether an implementation computes the indexer from fp32 inputs as given (the torch
    path); the native GEMM takes its operands as bf16 (exact for e4m3 and bf16 values)."""
    return getattr(k, "name", "") == "torch"


def _case(kern, H=4, Hi=8, Di=64, topk=7, page=16, prefix=RAGGED[0], new=RAGGED[1], **kw):
    dims = mb.MLADims(H, DIMS.kv_lora_rank, 8, DIMS.qk_rope_head_dim, 8)
    d = make_dsa_case(dims, mb.IndexerDims(Hi, Di, topk), list(prefix), list(new), page,
                      impl="torch", **kw)  # fmt: skip
    return d, d.plan(impl=kern)


# ---- the index cache ----------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("Di,block", [(128, 128), (64, 32), (8, 8)])
def test_fp8_index_cache_bytes_follow_vllm(kernels, Di, block, ue8m0):
    """Keys land where vLLM's indexer_k_quant_and_cache puts them: a page holds every token's
    e4m3 values (token j at j * Di), then every token's float32 scales (at page_size * Di +
    4 * j * Di / block); scale = max(amax, 1e-4) / 448 (power of two for ue8m0); padding
    slots and other pages untouched."""
    ps, pages, T = 16, 5, 40
    lay = IndexCacheLayout.named("fp8", Di, block, "ue8m0" if ue8m0 else None)
    cache = torch.randint(0, 256, (pages, ps, lay.width), dtype=torch.uint8)
    before = cache.clone()
    g = torch.Generator().manual_seed(Di)
    k = torch.randn(T, Di, generator=g) * torch.logspace(-6, 3, T)[:, None]
    k[0] = 0.0
    slots = torch.randperm(pages * ps, generator=g)[:T]
    slots[::5] = -1
    kernels.write_index_keys(IndexKeyWrite(cache, lay, k.bfloat16(), slots))
    want = index_fp8_dequantized(k.bfloat16(), block, ue8m0)
    raw = cache.view(pages, ps * lay.width)
    nb = Di // block
    written = set()
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        p, j = divmod(s, ps)
        written.add(s)
        vals = raw[p, j * Di : (j + 1) * Di].view(FP8).float()
        off = ps * Di + 4 * j * nb
        scales = raw[p, off : off + 4 * nb].view(torch.float32)
        got = (vals.view(nb, block) * scales[:, None]).view(Di)
        assert torch.equal(got, want[t]), f"token {t} slot {s}"
        if ue8m0:
            assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    for s in set(range(pages * ps)) - written:  # every byte of every other slot unchanged
        p, j = divmod(s, ps)
        off = ps * Di + 4 * j * nb
        for a, b in ((j * Di, (j + 1) * Di), (off, off + 4 * nb)):
            assert torch.equal(raw[p, a:b], before.view(pages, -1)[p, a:b]), f"slot {s}"


def test_plain_index_cache_write(kernels):
    cache = torch.full((4, 16, 24), float("nan"))
    k = torch.randn(6, 24)
    slots = torch.tensor([3, -1, 17, 63, -1, 0])
    lay = IndexCacheLayout.of(cache, 24)
    kernels.write_index_keys(IndexKeyWrite(cache, lay, k, slots))
    flat = cache.view(-1, 24)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], k[t])
    assert int(torch.isfinite(flat).all(-1).sum()) == 4


def test_index_layout_refusals():
    with pytest.raises(ValueError, match="'fp4' is not supported"):
        IndexCacheLayout.named("fp4", 128)
    with pytest.raises(ValueError, match="not a multiple of quant_block_size 96"):
        IndexCacheLayout.named("fp8", 128, 96)
    with pytest.raises(ValueError, match="float8_e4m3fn is not supported"):
        IndexCacheLayout.of(torch.zeros(2, 16, 128, dtype=FP8), 128)
    with pytest.raises(ValueError, match="is not an fp8 index cache of index_head_dim 128"):
        IndexCacheLayout.of(torch.zeros(2, 16, 130, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="scale_fmt='ue4m3'"):
        IndexCacheLayout.named("fp8", 128, 128, "ue4m3")
    assert IndexCacheLayout.of(torch.zeros(2, 16, 132, dtype=torch.uint8), 128).bytes_per_token \
        == 132
    assert IndexCacheLayout.of(torch.zeros(2, 16, 136, dtype=torch.uint8), 128).quant_block_size \
        == 64


# ---- indexer --------------------------------------------------------------------------------
INDEX_KINDS = [(torch.uint8, torch.bfloat16), (torch.uint8, FP8), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.float32), (torch.float16, torch.float32)]  # fmt: skip


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("index_dtype,q_dtype", INDEX_KINDS, ids=str)
def test_indexer_logits_and_topk(kernels, index_dtype, q_dtype, page):
    d, plan = _case(kernels, page=page, index_dtype=index_dtype, q_dtype=q_dtype, seed=page)
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    lg = mb.indexer_logits(d.q_I, d.weights, d.index_cache, plan)
    exact = _fp32_inputs(kernels) or q_dtype in (torch.bfloat16, FP8) and index_dtype in (
        torch.uint8, torch.bfloat16)  # fmt: skip
    tol = logit_bound(d, not exact)
    check_logits(lg, ref, tol)
    for topk in (1, 7, 40, 300):
        idx = mb.indexer_topk(d.q_I, d.weights, d.index_cache, plan, topk)
        assert idx.dtype == torch.int32 and idx.shape == (plan.num_tokens, topk)
        check_topk(idx, ref, topk, tol)


@pytest.mark.parametrize("topk", [1, 3, 10, 50])
def test_topk_exact_ties_lower_position_wins(kernels, topk):
    """Keys drawn from 3 vectors: logits tie exactly in groups; the cut through a group keeps
    its lowest positions, in every implementation."""
    d, plan = _case(kernels, page=16, index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                    distinct_keys=3, seed=topk)  # fmt: skip
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    idx = mb.indexer_topk(d.q_I, d.weights, d.index_cache, plan, topk)
    assert torch.equal(idx.long(), reference_topk(ref, topk))


def test_topk_negative_zero_ties_and_out_buffer(kernels):
    """Zero weights make every logit +0 or -0: all tie, the lowest positions win; ``out=`` is
    written in place."""
    d, plan = _case(kernels, page=1)
    w = torch.zeros_like(d.weights)
    w[::2] = -0.0
    out = torch.empty(plan.num_tokens, 5, dtype=torch.int32)
    idx = mb.indexer_topk(d.q_I, w, d.index_cache, plan, 5, out=out)
    assert idx.data_ptr() == out.data_ptr()
    pos = plan.sparse.token_pos_t.tolist()
    want = [[p if p <= pt else -1 for p in range(5)] for pt in pos]
    assert idx.tolist() == want


# ---- sparse attention -------------------------------------------------------------------------
def _indices(d: DsaCase, topk: int, seed: int) -> torch.Tensor:
    """Index lists of the oracle's top-k, padded with -1 and shuffled per row (any order)."""
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    idx = reference_topk(ref, topk)
    g = torch.Generator().manual_seed(seed)
    for t in range(idx.shape[0]):
        idx[t] = idx[t, torch.randperm(topk, generator=g)]
    return idx.to(torch.int32)


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("qdt,cdt", ATTENTION_DTYPES, ids=str)
def test_sparse_attention_equals_dense_masked(kernels, qdt, cdt, page):
    d, plan = _case(kernels, H=5, page=page, dtype=qdt, cache_dtype=cdt, seed=page + 3)
    T, H = plan.num_tokens, plan.dims.num_heads
    g = torch.Generator().manual_seed(page)
    q_lat = torch.randn(T, H, DIMS.kv_lora_rank, generator=g).to(qdt)
    q_pe = torch.randn(T, H, DIMS.qk_rope_head_dim, generator=g).to(qdt)
    scale = 1 / math.sqrt(48)
    for topk in (6, 64):
        idx = _indices(d, topk, page)
        o, lse = mb.sparse_absorbed_attention(q_lat, q_pe, d.case.kv_cache, plan, idx, scale,
                                              d.case.kv_scale)  # fmt: skip
        check_sparse(d, o, lse, q_lat, q_pe, idx, scale, qdt)


def test_sparse_attention_all_selected_is_dense(kernels):
    """With every visible position selected, the sparse attention is the dense causal one."""
    d, plan = _case(kernels, H=16, dtype=torch.float32, page=16, seed=9)
    T = plan.num_tokens
    pos = plan.sparse.token_pos_t
    idx = torch.arange(200).expand(T, 200)
    idx = torch.where(idx <= pos[:, None], idx, -1).to(torch.int32)
    g = torch.Generator().manual_seed(2)
    q_lat = torch.randn(T, 16, DIMS.kv_lora_rank, generator=g)
    q_pe = torch.randn(T, 16, DIMS.qk_rope_head_dim, generator=g)
    o, lse = mb.sparse_absorbed_attention(q_lat, q_pe, d.case.kv_cache, plan, idx, 0.2)
    od, lsed = mb.absorbed_attention(q_lat, q_pe, d.case.kv_cache, plan, 0.2)
    assert torch.allclose(o, od, atol=2e-5) and torch.allclose(lse, lsed, atol=2e-5)


def test_sparse_attention_empty_and_out_buffers(kernels):
    d, plan = _case(kernels, dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    T, H, r = plan.num_tokens, plan.dims.num_heads, DIMS.kv_lora_rank
    q_lat = torch.randn(T, H, r).bfloat16()
    q_pe = torch.randn(T, H, DIMS.qk_rope_head_dim).bfloat16()
    idx = torch.full((T, 4), -1, dtype=torch.int32)
    idx[0, 2] = 0  # one token attends to position 0 only
    out, lse = torch.empty(T, H, r, dtype=torch.bfloat16), torch.empty(T, H)
    o, lo = mb.sparse_absorbed_attention(q_lat, q_pe, d.case.kv_cache, plan, idx, 0.1,
                                         out=out, lse=lse)  # fmt: skip
    assert o.data_ptr() == out.data_ptr() and lo.data_ptr() == lse.data_ptr()
    check_sparse(d, o, lo, q_lat, q_pe, idx, 0.1, torch.bfloat16)


@pytest.mark.parametrize("bad", [130, 10**6, -2])
def test_out_of_range_index_refused(kernels, bad):
    """Request 1 has 10 tokens: index 130 is past it (though inside request 2's range)."""
    d, plan = _case(kernels)
    T, H = plan.num_tokens, plan.dims.num_heads
    idx = torch.zeros(T, 3, dtype=torch.int32)
    idx[5, 1] = bad  # token 5 is request 1's only token
    q_lat = torch.randn(T, H, DIMS.kv_lora_rank)
    q_pe = torch.randn(T, H, DIMS.qk_rope_head_dim)
    with pytest.raises(RuntimeError, match="out of range"):
        mb.sparse_absorbed_attention(q_lat, q_pe, d.case.kv_cache, plan, idx, 0.1,
                                     d.case.kv_scale)  # fmt: skip


# ---- shapes drawn by hypothesis -----------------------------------------------------------------
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    H=st.integers(1, 20),
    Hi=st.integers(1, 70),
    Di=st.sampled_from([8, 16, 48, 128]),
    page=st.sampled_from([1, 3, 16, 64]),
    reqs=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 5)), min_size=1, max_size=4),
    topk=st.integers(1, 40),
    fp8=st.booleans(),
    seed=st.integers(0, 999),
)
def test_hypothesis_shapes(kernels, H, Hi, Di, page, reqs, topk, fp8, seed):
    prefix = [max(p, 1 - n) for p, n in reqs]
    new = [n for _, n in reqs]
    new[0] = new[0] or 1
    d, plan = _case(kernels, H=H, Hi=Hi, Di=Di, topk=topk, page=page, prefix=prefix, new=new,
                    index_dtype=torch.uint8 if fp8 else torch.bfloat16, q_dtype=torch.bfloat16,
                    dtype=torch.bfloat16, seed=seed)  # fmt: skip
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    idx = mb.indexer_topk(d.q_I, d.weights, d.index_cache, plan, topk)
    check_topk(idx, ref, topk, logit_bound(d, False))
    T = plan.num_tokens
    q_lat = torch.randn(T, H, DIMS.kv_lora_rank).bfloat16()
    q_pe = torch.randn(T, H, DIMS.qk_rope_head_dim).bfloat16()
    o, lse = mb.sparse_absorbed_attention(q_lat, q_pe, d.case.kv_cache, plan, idx, 0.15)
    check_sparse(d, o, lse, q_lat, q_pe, idx, 0.15, torch.bfloat16)


# ---- the entry points' checks and the plan ---------------------------------------------------
def test_entry_point_refusals():
    d, plan = _case("torch")
    q, w, ic = d.q_I, d.weights, d.index_cache
    with pytest.raises(ValueError, match="topk=0 is not supported"):
        mb.indexer_topk(q, w, ic, plan, 0)
    with pytest.raises(ValueError, match="weights torch.float16"):
        mb.indexer_topk(q, w.half(), ic, plan, 4)
    with pytest.raises(ValueError, match="q_I of shape .*float64"):
        mb.indexer_topk(q.double(), w, ic, plan, 4)
    with pytest.raises(ValueError, match="not an fp8 index cache of index_head_dim 32"):
        mb.indexer_topk(q[..., :32], w, ic, plan, 4)
    plain = mb.plan(d.case.batch, d.case.dims, mb.Policy("absorb"), impl="torch")
    with pytest.raises(ValueError, match="indexer=IndexerDims"):
        mb.indexer_topk(q, w, ic, plain, 4)
    with pytest.raises(ValueError, match=r"out torch.int64 \(14, 4\)"):
        mb.indexer_topk(q, w, ic, plan, 4, out=torch.empty(14, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="k_I of shape"):
        mb.write_index_keys(ic, torch.zeros(3, 64, dtype=torch.int32), torch.zeros(3))
    with pytest.raises(ValueError, match="indices torch.float32"):
        mb.sparse_absorbed_attention(torch.zeros(14, 4, 40), torch.zeros(14, 4, 8),
                                     d.case.kv_cache, plan, torch.zeros(14, 3), 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="indexer topk=0"):
        mb.IndexerDims(64, 128, 0)


def test_plan_sparse_part_and_refresh():
    d, plan = _case("torch")
    b = d.case.batch
    want = [p + j for p, n in zip(b.prefix_lens, b.new_lens) for j in range(n)]
    assert plan.sparse.token_pos_t.tolist() == want
    assert plan.sparse.token_req_t.tolist() == [i for i, n in enumerate(b.new_lens)
                                                for _ in range(n)]  # fmt: skip
    assert plan.sparse.max_kv_len == max(b.kv_lens)
    nxt = mb.MLABatch.build([p + 1 for p in b.prefix_lens], b.new_lens, b.block_table,
                            b.page_size)  # fmt: skip
    addr = plan.sparse.token_pos_t.data_ptr()
    plan.refresh_(nxt)
    assert plan.sparse.token_pos_t.data_ptr() == addr
    assert plan.sparse.token_pos_t.tolist() == [p + 1 for p in want]
