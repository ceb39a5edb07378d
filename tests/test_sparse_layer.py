"""A DSA layer's routed call (:func:`mla_backend.sparse_layer.sparse_mla_attention`) and the
policy's route per request (:meth:`mla_backend.Policy.dsa_route`): every route against the
float64 oracle (decompressed attention masked to the indexer's selection, which is every
visible position where a context fits ``topk``), in steps the policy splits across routes, with
``out=`` views; the torch path and the native kernels at every ISA level this CPU runs."""

from __future__ import annotations

import pytest
import torch
from test_sparse import _case

import mla_backend as mb
from mla_backend.testing.reference import reference_sparse_mla_attention

#: requests of 5 / 10 / 130 / 3 / 75 kv tokens at topk 12: two fit it, three do not
PREFIX, NEW = [0, 9, 127, 0, 70], [5, 1, 3, 3, 5]


def _layer_case(kernels, policy, dtype=torch.float32, **kw):
    d, _ = _case(kernels, H=4, topk=12, page=16, prefix=PREFIX, new=NEW, dtype=dtype, **kw)
    c = d.case
    plan = mb.plan(c.batch, c.dims, policy, impl=kernels, indexer=d.indexer)
    attn = mb.MLAAttention(c.dims, c.weights, softmax_scale=0.3, chunk_tokens=32)
    return d, plan, attn


@pytest.mark.parametrize(
    "policy,routes",
    [
        ("absorb", {"absorbed", "sparse_absorbed"}),
        ("normal", {"normal", "sparse_masked", "sparse_gather"}),
        ("cost", None),
    ],
)
def test_every_route_matches_the_oracle(kernels, policy, routes):
    d, plan, attn = _layer_case(kernels, mb.Policy(policy))
    got = set(plan.choice.routes)
    fits = [p + n <= 12 for p, n in zip(PREFIX, NEW)]
    assert plan.choice.use_sparse == [not f for f in fits]
    if routes is not None:
        assert got <= routes and {"absorbed", "normal"} & got
    assert plan.dsa_routes is not None and set(plan.dsa_routes) == got
    c = d.case
    idx = mb.indexer_topk(d.q_I, d.weights, d.index_cache, plan, 12)
    T, H = plan.num_tokens, c.dims.num_heads
    buf = torch.full((T, H * 2 * c.dims.v_head_dim), float("nan"))
    view = buf.view(T, H, 2 * c.dims.v_head_dim)[..., : c.dims.v_head_dim]  # strided out=
    o = mb.sparse_mla_attention(attn, c.q_nope, c.q_pe, c.kv_cache, plan, idx, c.kv_scale,
                                out=view)  # fmt: skip
    assert o.data_ptr() == view.data_ptr()
    _check_output(d, o, idx, 0.3)


def _check_output(d, o, idx, scale):
    """The output against the oracle (the LSE is not returned by the layer call)."""
    c = d.case
    ro, _ = reference_sparse_mla_attention(c.q_nope, c.q_pe, c.c_kv, c.k_pe, c.kv_b,
                                           c.dims.qk_nope_head_dim, c.dims.v_head_dim,
                                           c.batch.new_lens, idx, scale)  # fmt: skip
    tol = 2e-5 if o.dtype == torch.float32 else 2.0**-5
    err = (o.double() - ro).abs().max().item()
    assert err <= tol * max(1.0, ro.abs().max().item()), err


def test_bf16_routes_and_dense_step_without_indices(kernels):
    """bf16 in a split step; a step whose every context fits topk runs dense with no indices."""
    d, plan, attn = _layer_case(kernels, mb.Policy("normal"), torch.bfloat16,
                                cache_dtype=torch.bfloat16)  # fmt: skip
    c = d.case
    idx = mb.indexer_topk(d.q_I, d.weights, d.index_cache, plan, 12)
    _check_output(d, mb.sparse_mla_attention(attn, c.q_nope, c.q_pe, c.kv_cache, plan, idx), idx,
                  0.3)  # fmt: skip
    b = mb.MLABatch.build([0, 2], [5, 3], c.batch.block_table[:2], 16)
    dense = mb.plan(b, c.dims, mb.Policy("cost"), impl=kernels, indexer=d.indexer)
    assert dense.choice.sparse_mode == "dense"
    T = dense.num_tokens
    o = mb.sparse_mla_attention(attn, c.q_nope[:T], c.q_pe[:T], c.kv_cache, dense, None)
    ref = attn(c.q_nope[:T], c.q_pe[:T], c.kv_cache, dense)
    assert torch.equal(o, ref)


def test_refusals():
    d, plan, attn = _layer_case("torch", mb.Policy("absorb"))
    c = d.case
    with pytest.raises(ValueError, match="indices=None"):
        mb.sparse_mla_attention(attn, c.q_nope, c.q_pe, c.kv_cache, plan, None)
    with pytest.raises(ValueError, match="indices torch.float32"):
        mb.sparse_mla_attention(attn, c.q_nope, c.q_pe, c.kv_cache, plan,
                                torch.zeros(plan.num_tokens, 3))  # fmt: skip
    plain = mb.plan(c.batch, c.dims, mb.Policy("absorb"), impl="torch")
    with pytest.raises(ValueError, match="indexer=IndexerDims"):
        mb.sparse_mla_attention(attn, c.q_nope, c.q_pe, c.kv_cache, plain, None)
