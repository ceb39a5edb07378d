"""The policy on DSA layers (DeepSeek-V3.2 / GLM-5, ``choose(..., indexer=...)``): the sparse
path wherever a request's context exceeds ``index_topk`` (every mode), the dense paths priced
against it where the selection is everything, and the cost model's sparse price."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.cost import CPU_PROFILE, absorbed_cost, normal_cost, sparse_cost
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
        ([0], [3000], mb.Phase.EXTEND, [True], [True], "sparse"),  # a prefill past topk
        ([60000, 10], [1, 1], mb.Phase.DECODE, [True, False], [True, True], "mixed"),
        ([0, 100], [8, 2000], mb.Phase.EXTEND, [False, True], [None, True], "mixed"),
    ],
)
def test_cost_mode_dsa_choices(dims, prefix, new, phase, sparse, absorbed, mode):
    choice = mb.Policy("cost").choose(batch(prefix, new, phase), dims, indexer=INDEXER)
    assert choice.use_sparse == sparse
    assert choice.sparse_mode == mode
    for got, want in zip(choice.use_absorbed, absorbed):
        if want is not None:
            assert got == want
    assert all(a for a, s in zip(choice.use_absorbed, choice.use_sparse) if s)


@pytest.mark.parametrize("mode", ["sglang", "absorb", "normal"])
def test_fixed_modes_go_sparse_only_past_topk(mode):
    b = batch([0, 5000, 100], [300, 1, 1], mb.Phase.MIXED)
    choice = mb.Policy(mode).choose(b, V32, indexer=INDEXER)
    assert choice.use_sparse == [False, True, False]
    assert choice.use_absorbed[1]


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
    assert plan.sparse is not None and plan.sparse.indexer == INDEXER
    assert mb.plan(b, LITE, mb.Policy("cost"), impl="torch").sparse is None
    with pytest.raises(ValueError, match="takes IndexerDims"):
        mb.plan(b, LITE, impl="torch", indexer=(64, 128, 2048))
