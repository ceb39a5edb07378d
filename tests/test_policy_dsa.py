"""The policy on DSA layers (DeepSeek-V3.2 / GLM-5, ``choose(..., indexer=...)``): a sparse
route wherever a request's context exceeds ``index_topk`` (every mode), the cheaper of the
sparse absorbed attention and the sparse MHA there, the dense paths priced against both where
the selection is everything, the plan's routes, and the cost model's sparse prices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.cost import (
    CPU_PROFILE,
    absorbed_cost,
    normal_cost,
    sparse_cost,
    sparse_mha_cost,
    sparse_mha_variant,
)
from mla_backend.ops.native.profile import PROFILES

V32 = mb.MLADims(128, 512, 128, 64, 128)  # DeepSeek-V3.2's attention
LITE = mb.MLADims(16, 512, 128, 64, 128)
INDEXER = mb.IndexerDims(64, 128, 2048)


def batch(prefix: list[int], new: list[int], phase: mb.Phase) -> mb.MLABatch:
    pages = max(p + n for p, n in zip(prefix, new))
    return mb.MLABatch.build(
        prefix, new, torch.zeros(len(prefix), pages, dtype=torch.int32), 1, phase
    )


@pytest.mark.parametrize("dims", [V32, LITE], ids=["H128", "H16"])
@pytest.mark.parametrize(
    "prefix,new,phase,sparse,absorbed,mode",
    [
        ([0], [2000], mb.Phase.EXTEND, [False], [False], "dense"),  # fresh prefill <= topk: MHA
        ([2047], [1], mb.Phase.DECODE, [False], [True], "dense"),  # decode at kv = topk
        ([2048], [1], mb.Phase.DECODE, [True], [True], "sparse"),  # one past topk
        ([0], [3000], mb.Phase.EXTEND, [True], [None], "sparse"),  # a prefill past topk
        ([60000, 10], [1, 1], mb.Phase.DECODE, [True, False], [True, True], "mixed"),
        ([0, 100], [8, 2000], mb.Phase.EXTEND, [False, True], [None, None], "mixed"),
    ],
)
def test_cost_mode_dsa_choices(dims, prefix, new, phase, sparse, absorbed, mode):
    choice = mb.Policy("cost").choose(batch(prefix, new, phase), dims, indexer=INDEXER)
    assert choice.use_sparse == sparse
    assert choice.sparse_mode == mode
    for got, want in zip(choice.use_absorbed, absorbed):
        if want is not None:
            assert got == want
    for a, s, r in zip(choice.use_absorbed, choice.use_sparse, choice.routes):
        assert s == r.startswith("sparse") and a == (r in ("absorbed", "sparse_absorbed"))


@pytest.mark.parametrize("mode", ["sglang", "absorb", "normal"])
def test_fixed_modes_go_sparse_only_past_topk(mode):
    b = batch([0, 5000, 100], [300, 1, 1], mb.Phase.MIXED)
    choice = mb.Policy(mode).choose(b, V32, indexer=INDEXER)
    assert choice.use_sparse == [False, True, False]
    mha = mode == "normal"  # the normal mode's sparse route is the sparse MHA
    assert choice.routes[1] in (("sparse_masked", "sparse_gather") if mha else ("sparse_absorbed",))
    assert choice.use_absorbed[1] == (not mha)


@settings(max_examples=60, deadline=None)
@given(prefix=st.integers(0, 70000), new=st.integers(2, 9000),
       profile=st.sampled_from([CPU_PROFILE, *PROFILES.values()]))  # fmt: skip
def test_cost_mode_takes_the_cheaper_sparse_route(prefix, new, profile):
    """Past topk (a prefill or an extend), the route is the cheaper of the sparse absorbed
    attention and the sparse MHA in its cheaper variant; a decode token stays absorbed."""
    if prefix + new <= INDEXER.topk:
        return
    pol = mb.Policy("cost", profile=profile)
    route = pol.choose(batch([prefix], [new], mb.Phase.EXTEND), V32, indexer=INDEXER).routes[0]
    absorbed = sparse_cost(V32, INDEXER, prefix, new, profile)
    m, g = (sparse_mha_cost(V32, INDEXER, prefix, new, profile, v) for v in ("masked", "gather"))
    want = "sparse_absorbed" if absorbed <= min(m, g) else (
        "sparse_masked" if m <= g else "sparse_gather")  # fmt: skip
    assert route == want
    assert pol.choose(batch([prefix + new], [1], mb.Phase.DECODE), V32,
                      indexer=INDEXER).routes == ["sparse_absorbed"]  # fmt: skip


def test_sparse_mha_variants_price_what_they_decompress():
    """The masked variant decompresses the whole context once, the gathered one topk rows per
    token: gathered for a few tokens onto a long prefix, masked for a long prefill."""
    p = PROFILES["avx2"]
    assert sparse_mha_variant(V32, INDEXER, 60000, 4, p) == "gather"
    assert sparse_mha_variant(V32, INDEXER, 0, 8192, p) == "masked"
    # the masked variant's price grows with the context, the gathered one's indexer alone
    g1, g2 = (sparse_mha_cost(V32, INDEXER, P, 4, p, "gather") for P in (16000, 64000))
    m1, m2 = (sparse_mha_cost(V32, INDEXER, P, 4, p, "masked") for P in (16000, 64000))
    assert m2 - m1 > 10 * (g2 - g1) > 0


def test_non_dsa_choice_has_no_sparse():
    choice = mb.Policy("cost").choose(batch([0], [100], mb.Phase.EXTEND), V32)
    assert choice.use_sparse is None and choice.sparse_mode is None


@settings(max_examples=60, deadline=None)
@given(prefix=st.integers(0, 2047), new=st.integers(1, 2048),
       profile=st.sampled_from([CPU_PROFILE, *PROFILES.values()]))  # fmt: skip
def test_dense_wins_where_the_selection_is_everything(prefix, new, profile):
    """At most topk tokens: the sparse path is the same attention plus the indexer, so it
    prices above absorbed; the policy never picks it there."""
    if prefix + new > INDEXER.topk:
        return
    assert sparse_cost(V32, INDEXER, prefix, new, profile) > absorbed_cost(V32, prefix, new,
                                                                           profile)  # fmt: skip
    choice = mb.Policy("cost", profile=profile).choose(
        batch([prefix], [new], mb.Phase.EXTEND), V32, indexer=INDEXER
    )
    assert choice.use_sparse == [False]


@pytest.mark.parametrize("dims", [V32, LITE], ids=["H128", "H16"])
def test_sparse_price_is_flat_in_attention_and_beats_dense_at_64k(dims):
    """Past topk only the indexer grows with the context: the sparse price at 64K decode is
    below the dense absorbed one (11x fewer FLOPs at 128 heads), and its growth from 16K to 64K
    is the indexer's alone."""
    p = PROFILES["avx512_bf16"]
    s16, s64 = (sparse_cost(dims, INDEXER, L - 1, 1, p) for L in (16384, 65536))
    assert s64 < absorbed_cost(dims, 65535, 1, p)
    more = 65536 - 16384  # the indexer's extra work, priced on its own roofline
    flops = 2 * more * INDEXER.n_heads * INDEXER.head_dim
    index = max(flops / (p.peak_flops * p.absorbed_efficiency), more * 132 / p.bandwidth)
    assert s16 < s64 <= s16 + index * (1 + 1e-9)
    assert normal_cost(dims, 65535, 1, p) > s64


def test_plan_carries_the_dsa_choice():
    b = batch([4000, 0], [1, 5], mb.Phase.MIXED)
    plan = mb.plan(b, LITE, mb.Policy("cost"), impl="torch", indexer=INDEXER)
    assert plan.choice.use_sparse == [True, False]
    assert plan.choice.routes == ["sparse_absorbed", "absorbed"]
    (pa, sa), (pd, sd) = plan.dsa_routes["sparse_absorbed"], plan.dsa_routes["absorbed"]
    assert (pa.reqs, pd.reqs) == ((0,), (1,))
    assert sa.token_pos_t.tolist() == [4000] and sd.token_pos_t.tolist() == [0, 1, 2, 3, 4]
    assert sd.token_req_t.tolist() == [0] * 5 and pd.rows.tolist() == [1, 2, 3, 4, 5]
    one = mb.plan(batch([0], [5], mb.Phase.EXTEND), LITE, mb.Policy("cost"), impl="torch",
                  indexer=INDEXER)  # fmt: skip
    assert list(one.dsa_routes) == one.choice.routes and one.dsa_routes[one.choice.routes[0]] == (
        one.step, one.sparse)  # one route: the step's own parts
    assert plan.sparse is not None and plan.sparse.indexer == INDEXER
    assert mb.plan(b, LITE, mb.Policy("cost"), impl="torch").sparse is None
    with pytest.raises(ValueError, match="takes IndexerDims"):
        mb.plan(b, LITE, impl="torch", indexer=(64, 128, 2048))
