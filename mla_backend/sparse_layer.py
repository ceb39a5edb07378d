"""A DSA layer's attention, engine-neutral: each request of the step on the route the plan
carries (``plan.dsa_routes``, the policy's ``PathChoice.routes``, decided once per step), so
that an engine adapter makes one call per layer instead of composing the paths itself::

    idx = indexer_topk(q_I, weights, index_cache, plan, topk)     # unless no request is sparse
    o = sparse_mla_attention(attn, q_nope, q_pe, kv_cache, plan, idx, out=o_view)

Routes (:data:`mla_backend.policy.DSA_ROUTES`): ``absorbed`` / ``normal`` (the dense paths,
where the selection is every visible token: :class:`~mla_backend.attention.MLAAttention`'s
own), ``sparse_absorbed`` (q_lat = q_nope · W_UK, the sparse absorbed attention over the
latent rows of each token's selection, then · W_UV) and ``sparse_masked`` / ``sparse_gather``
(the sparse MHA over decompressed K/V, :mod:`mla_backend.sparse_normal`).
"""

from __future__ import annotations

import torch

from .attention import MLAAttention, _check_normal, _check_out
from .checks import check_devices
from .ops import AbsorbedCall, SparseCall
from .plan import MLAPlan
from .sparse import _sparse_of
from .sparse_normal import sparse_normal_part

__all__ = ["sparse_mla_attention"]


def sparse_mla_attention(
    attn: MLAAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    indices: torch.Tensor | None,
    kv_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One DSA layer's attention for every request of the step, each on its planned route.

    Args:
        attn: the layer's :class:`MLAAttention` (weights, softmax scale, prefix chunking).
        q_nope: [T, H, nope]; q_pe: [T, H, rope]; bf16 / fp16 / fp32; T == plan.num_tokens.
        kv_cache: the latent cache (every layout the dense paths read), the step's new rows
            written.
        plan: the step's plan, made with ``indexer=``.
        indices: [T, k] int32 / int64, the indexer's selection (logical positions of each
            token's request, -1 = none; a position listed twice counts once); may be None when
            no request is sparse (``plan.choice.sparse_mode == "dense"``).
        kv_scale: float32 scalar tensor of a per-tensor fp8 cache.
        out: optional [T, H, v] buffer in q_nope's dtype (any strides with a contiguous last
            dim: a view of the engine's output).
    Returns:
        o [T, H, v] in q_nope's dtype (``out`` when given), before ``o_proj``.
    """
    _sparse_of(plan)  # the plan carries DSA data
    routes = plan.dsa_routes
    assert routes is not None  # every plan made with indexer= has its routes
    layout = _check_normal(q_nope, q_pe, kv_cache, plan, attn.weights, kv_scale,
                           attn.chunk_tokens)  # fmt: skip
    T, H, v = q_nope.shape[0], attn.dims.num_heads, attn.dims.v_head_dim
    _check_out("out", out, (T, H, v), q_nope.dtype, q_nope.device)
    if plan.choice.sparse_mode != "dense":
        if indices is None:
            raise ValueError("indices=None, but the plan sends requests on a sparse route")
        if indices.dim() != 2 or indices.shape[0] != T or indices.dtype not in (torch.int32,
                                                                                  torch.int64):
            raise ValueError(f"indices {indices.dtype} {tuple(indices.shape)} is not supported: "
                             f"[T={T}, k] int32 / int64")  # fmt: skip
        check_devices(kv_cache.device, "the cache", indices=indices)
    cache = (kv_cache, layout)
    impl = plan.impl
    whole = len(routes) == 1
    if out is None:
        out = q_nope.new_empty(T, H, v)
    with torch.no_grad():
        for name, (part, sp) in routes.items():
            rows = part.rows
            qn, qp = (q_nope, q_pe) if rows is None else (q_nope[rows], q_pe[rows])
            idx = indices if rows is None or indices is None else indices[rows]
            dst = out if whole else None
            if name == "absorbed":
                o = attn._absorbed(qn, qp, cache, plan, part, kv_scale, dst)
            elif name == "normal":
                o = attn._normal(qn, qp, cache, plan, part, kv_scale)
            elif name == "sparse_absorbed":
                w = attn._weights_for(impl)
                q_lat = impl.absorb_q(qn, w)
                call = AbsorbedCall(q_lat, qp, *cache, part, attn.softmax_scale, kv_scale)
                o_lat, _ = impl.sparse_absorbed_attention(SparseCall(call, sp, idx))
                o = impl.apply_W_UV(o_lat, w, out=dst)
            else:
                variant = name.removeprefix("sparse_")
                o, _ = sparse_normal_part(qn, qp, *cache, part, sp, idx, attn.weights,
                                          attn.softmax_scale, kv_scale, impl,
                                          [variant] * part.num_reqs, attn.chunk_tokens,
                                          dst)  # fmt: skip
            if rows is None:
                if o.data_ptr() != out.data_ptr():
                    out.copy_(o)
            else:
                out.index_copy_(0, rows, o)
    return out
