"""DSA's sparse MHA path (:mod:`mla_backend.sparse_normal`) against the float64 oracle (the
decompressed attention masked to each token's index set, :func:`mla_backend.testing.reference.
reference_sparse_mla_attention`), on the torch path and the native kernels at every ISA level
this CPU runs (``MLA_BACKEND_TEST_ISAS`` restricts them), both variants (masked tiles,
gathered rows): ragged batches with cached prefixes, pages 1 / 16 / 64 shuffled with NaN in
never-written rows, every latent layout, lists shorter than k and -1 padding, exact ties in the
indexer's selection, prefix chunks merged by LSE, empty lists, out-of-range indices and bad
input refused; and the masked MHA seam op itself against a float64 softmax."""

from __future__ import annotations

import math

import pytest
import torch
from test_sparse import _case, _indices

import mla_backend as mb
from mla_backend.ops import MaskedMHACall
from mla_backend.sparse_normal import sparse_normal_attention
from mla_backend.testing.dsa_checks import check_sparse_mha
from mla_backend.testing.native_checks import ATTENTION_DTYPES

VARIANTS = ["masked", "gather"]


def _run(d, plan, idx, variant, scale, **kw):
    c = d.case
    return sparse_normal_attention(c.q_nope, c.q_pe, c.kv_cache, plan, c.weights, idx, scale,
                                   c.kv_scale, variant=variant, **kw)  # fmt: skip


#: the CI grid: each page size with one latent layout (bf16; fp32 over per-tensor fp8; fp16 over
#: fp8_ds_mla); every layout at every page size under -m slow
FAST = [(1, *ATTENTION_DTYPES[0]), (16, *ATTENTION_DTYPES[4]), (64, *ATTENTION_DTYPES[6])]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page,qdt,cdt", FAST, ids=str)
def test_sparse_mha_equals_dense_masked(kernels, qdt, cdt, page, variant):
    """Ragged batch (fresh extend, decodes onto prefixes, an empty request), index lists of
    the oracle's top-k shuffled per row (k 6: short; k 64: longer than most contexts, -1
    padded); prefix chunks of 32 rows merged by LSE."""
    _check_grid_case(kernels, qdt, cdt, page, variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("qdt,cdt", ATTENTION_DTYPES, ids=str)
def test_sparse_mha_every_layout(kernels, qdt, cdt, page, variant):
    _check_grid_case(kernels, qdt, cdt, page, variant)


def _check_grid_case(kernels, qdt, cdt, page, variant):
    d, plan = _case(kernels, H=5, page=page, dtype=qdt, cache_dtype=cdt, seed=page + 3)
    scale = 1 / math.sqrt(16)
    for topk in (6, 64):
        idx = _indices(d, topk, page)
        o, lse = _run(d, plan, idx, variant, scale, chunk_tokens=32)
        check_sparse_mha(d, o, lse, idx, scale)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sparse_mha_exact_ties_and_long_prefix(kernels, variant):
    """Keys from a palette of 3 vectors (exact ties between positions): the indexer's own
    selection (lower position wins a tie), over a prefix of 300 rows in chunks of 64."""
    d, plan = _case(kernels, H=3, page=16, prefix=[300, 0], new=[4, 9], dtype=torch.bfloat16,
                    distinct_keys=3, seed=5)  # fmt: skip
    idx = mb.indexer_topk(d.q_I, d.weights, d.index_cache, plan, 7)
    o, lse = _run(d, plan, idx, variant, 0.2, chunk_tokens=64)
    check_sparse_mha(d, o, lse, idx, 0.2)


def test_variants_agree_and_default_picks_one(kernels):
    """Both variants compute the same attention; ``variant=None`` (the cost model's pick per
    request) matches them; out= / lse= buffers are written and returned."""
    d, plan = _case(kernels, H=4, page=16, dtype=torch.float32, seed=11)
    idx = _indices(d, 9, 1)
    om, lm = _run(d, plan, idx, "masked", 0.3)
    og, lg = _run(d, plan, idx, "gather", 0.3)
    T, H = om.shape[:2]
    out, lse = torch.empty_like(om), torch.empty(T, H)
    od, ld = _run(d, plan, idx, None, 0.3, out=out, lse=lse)
    assert od.data_ptr() == out.data_ptr() and ld.data_ptr() == lse.data_ptr()
    for o, ls in ((og, lg), (od, ld)):
        assert torch.allclose(o, om, atol=1e-5) and torch.allclose(ls, lm, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_selected_is_the_normal_path(kernels, variant):
    """Every visible position selected: the sparse MHA is the dense normal path."""
    d, plan = _case(kernels, H=4, page=16, dtype=torch.float32, seed=9)
    T = plan.num_tokens
    pos = plan.sparse.token_pos_t
    idx = torch.arange(200).expand(T, 200)
    idx = torch.where(idx <= pos[:, None], idx, -1).to(torch.int32)
    c = d.case
    o, lse = _run(d, plan, idx, variant, 0.25)
    on, ln = mb.normal_attention(c.q_nope, c.q_pe, c.kv_cache, plan, c.weights, 0.25,
                                 c.kv_scale)  # fmt: skip
    assert torch.allclose(o, on, atol=2e-5) and torch.allclose(lse, ln, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_lists(kernels, variant):
    d, plan = _case(kernels, dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    T = plan.num_tokens
    idx = torch.full((T, 4), -1, dtype=torch.int32)
    idx[0, 2] = 0  # one token attends to position 0 only
    o, lse = _run(d, plan, idx, variant, 0.1)
    check_sparse_mha(d, o, lse, idx, 0.1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_repeated_positions_count_once(kernels, variant):
    """A position listed more than once in a token's list counts once (the rule of
    :func:`mla_backend.sparse.sparse_absorbed_attention`): the oracle over the set."""
    d, plan = _case(kernels, H=3, page=16, dtype=torch.float32, seed=4)
    idx = _indices(d, 5, 2)
    twice = torch.cat([idx, idx.flip(1), idx[:, :2]], 1)
    o, lse = _run(d, plan, twice, variant, 0.2)
    check_sparse_mha(d, o, lse, idx, 0.2)


@pytest.mark.parametrize("bad", [130, -2])
def test_out_of_range_index_refused(kernels, bad):
    d, plan = _case(kernels)
    idx = torch.zeros(plan.num_tokens, 3, dtype=torch.int32)
    idx[5, 1] = bad  # token 5 is request 1's only token (10 rows)
    with pytest.raises(RuntimeError, match="out of range"):
        _run(d, plan, idx, "masked", 0.1)


def test_refusals():
    d, plan = _case("torch")
    idx = torch.zeros(plan.num_tokens, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="variant='dense' is not supported"):
        _run(d, plan, idx, "dense", 0.1)
    with pytest.raises(ValueError, match="indices torch.float32"):
        _run(d, plan, idx.float(), "masked", 0.1)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        _run(d, plan, idx, "masked", 0.1, chunk_tokens=0)
    with pytest.raises(ValueError, match="softmax_scale=nan"):
        _run(d, plan, idx, "masked", float("nan"))
    with pytest.raises(ValueError, match="indices is on meta"):
        _run(d, plan, idx.to("meta"), "masked", 0.1)
    plain = mb.plan(d.case.batch, d.case.dims, mb.Policy("absorb"), impl="torch")
    with pytest.raises(ValueError, match="indexer=IndexerDims"):
        _run(d, plain, idx, "masked", 0.1)


# ---- the seam op ----------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (5, 70), (33, 64), (70, 130)])
def test_masked_attention_op(kernels, dt, Lq, Lk):
    """The seam's masked MHA against float64: sparse random masks (whole 32 x 64 tiles empty,
    rows empty), heads sharing the mask."""
    g = torch.Generator().manual_seed(Lq * Lk)
    H, D, Dv = 3, 24, 20
    q = torch.randn(H, Lq, D, generator=g).to(dt)
    k = torch.randn(H, Lk, D, generator=g).to(dt)
    v = torch.randn(H, Lk, Dv, generator=g).to(dt)
    mask = torch.rand(Lq, Lk, generator=g) < 0.1
    mask[:, Lk // 2 :] &= torch.arange(Lq)[:, None] % 3 == 0
    mask[0, 0] = True
    if Lq > 1:
        mask[Lq // 2] = False  # a row that selects nothing
    o, lse = kernels.masked_attention_with_lse(MaskedMHACall(q, k, v, mask, 0.3))
    s = torch.einsum("hid,hjd->hij", q.double(), k.double()) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    rl = torch.logsumexp(s, -1)
    ro = torch.nan_to_num(torch.softmax(s, -1)) @ v.double()
    none = ~mask.any(1)
    assert o.dtype == dt and torch.equal(torch.isneginf(lse), none[None].expand_as(lse))
    assert (o[:, none] == 0).all()
    tol = 2e-5 if dt == torch.float32 else 2.0**-6
    assert (o.double() - ro).abs().max() <= tol * max(1.0, ro.abs().max().item())
    fin = ~none[None].expand_as(lse)
    assert (lse[fin].double() - rl[fin]).abs().max() <= (1e-4 if dt == torch.float32 else 2e-2)
