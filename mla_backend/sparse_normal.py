"""DSA's sparse MHA path (DeepSeek-V3.2's "MHA mode" for sparse layers): keys and values
decompressed per head as the normal path does (:mod:`mla_backend.normal`), each query token
attending over its own selected positions only. Two ways to compute it, both exact and
host-sync free, chosen per request (:data:`VARIANTS`; the cost model prices both,
:func:`mla_backend.cost.sparse_mha_cost`):

- ``masked``: per request, its kv rows in chunks of ``chunk_tokens`` decompressed once for all
  its new tokens, then a masked MHA (query row i sees key j iff the token selected j: a mask
  [n, chunk] scattered from the index lists on the device), the chunks merged through the
  log-sum-exp. The native kernel skips each (32 query rows x 64 keys) tile none of its rows
  selected (:meth:`~mla_backend.ops.KernelImpl.masked_attention_with_lse`). Pays the normal
  path's decompression of the whole context; wins for prefill, where many tokens share it.
- ``gather``: per query token, its selected latent rows gathered, decompressed and attended
  (a token's own K/V only: no masked work, but ``topk`` rows decompressed per token). Wins
  where few tokens attend to a long context (decode, short extends onto long prefixes).

Per layer, after ``indexer_topk``::

    o, lse = sparse_normal_attention(q_nope, q_pe, kv_cache, plan, weights, indices, scale)

The layer-level call that routes each request of a DSA step to its path (absorbed / normal
when the selection is everything, sparse absorbed, sparse MHA) is
:func:`mla_backend.sparse_layer.sparse_mla_attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .checks import check_devices, check_scale, check_step
from .cost import sparse_mha_variant
from .merge import merge_attention_states
from .normal import DEFAULT_CHUNK_TOKENS, decompress
from .ops import KernelImpl, MaskedMHACall
from .ops.torch.sparse_attention import checked_indices
from .plan import MLAPlan
from .sparse import _sparse_of
from .weights import AbsorbWeights

if TYPE_CHECKING:
    from .cache_layout import CacheLayout
    from .parts import PlanPart, SparsePart

__all__ = ["VARIANTS", "sparse_normal_attention", "sparse_normal_part"]

#: the two ways to compute the sparse MHA (module docstring)
VARIANTS = ("masked", "gather")
#: decompressed K/V elements (rows x heads x (nope + rope + v)) per gathered token chunk
GATHER_ELEMENTS = 1 << 23


def _gather(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    part: PlanPart,
    sparse: SparsePart,
    idx: torch.Tensor,
    t0: int,
    weights: AbsorbWeights,
    scale: float,
    kv_scale: torch.Tensor | None,
    impl: KernelImpl,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens t0 .. t0 + c of the part: q [c, H, D], idx [c, K] -> (o [c, H, v] float32,
    lse [c, H]): each token's K latent rows gathered, decompressed, attended (-1: none)."""
    c, K = idx.shape
    ps, W = kv_cache.shape[1], kv_cache.shape[2]
    cd = q.dtype
    valid = idx >= 0
    safe = torch.where(valid, idx.long(), 0)  # row 0 of the request: written, never NaN
    req = sparse.token_req_t[t0 : t0 + c].long()
    page = part.block_table.long()[req[:, None], safe // ps]  # [c, K]
    rows = kv_cache.view(-1, W).index_select(0, (page * ps + safe % ps).reshape(-1))
    k, v = decompress(layout.decode(rows, cd, kv_scale), weights, cd, impl)  # [H, cK, .]
    H = k.shape[0]
    k = k.transpose(0, 1).reshape(c, K, H, -1)
    v = v.transpose(0, 1).reshape(c, K, H, -1)
    s = torch.einsum("chd,ckhd->chk", q.float(), k.float()) * scale
    s.masked_fill_(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)
    p = torch.exp(s - m)
    lsum = p.sum(-1, keepdim=True)
    o = torch.einsum("chk,ckhv->chv", p.to(cd).float(), v.float())
    o = torch.where(lsum > 0, o / lsum, 0.0)
    return o, (m + torch.log(lsum)).squeeze(-1)


def _masked_request(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    part: PlanPart,
    i: int,
    idx: torch.Tensor,
    weights: AbsorbWeights,
    scale: float,
    kv_scale: torch.Tensor | None,
    impl: KernelImpl,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i of the part: q [n, H, D], idx [n, K] -> (o [n, H, v] float32, lse [n, H]):
    its kv rows decompressed chunk by chunk, a masked MHA per chunk, merged by LSE."""
    n = q.shape[0]
    kv = part.prefix_lens[i] + part.new_lens[i]
    cd = q.dtype
    qh = q.transpose(0, 1)  # [H, n, D]
    idx = idx.long()
    o = lse = None
    for s in range(0, kv, chunk_tokens):
        e = min(kv, s + chunk_tokens)
        latent = impl.gather_latent(kv_cache, layout, part, i, s, e, cd, kv_scale)
        k, v = decompress(latent, weights, cd, impl)
        sel = (idx >= s) & (idx < e)
        mask = torch.zeros(n, e - s + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(1, torch.where(sel, idx - s, e - s), True)  # column e - s: not selected
        mask = mask[:, : e - s].contiguous()
        o_c, lse_c = impl.masked_attention_with_lse(MaskedMHACall(qh, k, v, mask, scale))
        o_c, lse_c = o_c.transpose(0, 1).float(), lse_c.transpose(0, 1)
        if o is None:
            o, lse = o_c, lse_c
        else:
            o, lse = merge_attention_states(o, lse, o_c, lse_c)
    assert o is not None and lse is not None
    return o, lse


def sparse_normal_part(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    part: PlanPart,
    sparse: SparsePart,
    indices: torch.Tensor,
    weights: AbsorbWeights,
    softmax_scale: float,
    kv_scale: torch.Tensor | None,
    impl: KernelImpl,
    variants: Sequence[str],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse MHA of the requests of ``part`` (inputs validated by the caller).

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope]; T == part.num_tokens, rows in the part's
            request order.
        kv_cache / layout: the latent cache holding every request's rows, and its layout.
        part / sparse: the requests and their per-token data (``sparse.token_req_t`` indexes
            ``part``'s requests).
        indices: [T, k] int32 / int64 logical positions of each token's request, -1 = none.
        weights: the layer's ``W_UK`` / ``W_UV``.
        variants: per request of the part, ``"masked"`` or ``"gather"``.
        chunk_tokens: kv rows decompressed at a time (``masked``).
        out / lse: optional [T, H, v] (q's dtype) / [T, H] float32 outputs.
    Returns:
        (o [T, H, v] in q_nope's dtype, lse [T, H] float32); a token with no index: o = 0,
        lse = -inf.
    """
    T, H = q_nope.shape[:2]
    v_dim = weights.W_UV.shape[-1]
    dev, cd = q_nope.device, q_nope.dtype
    o_out = out if out is not None else torch.empty(T, H, v_dim, dtype=cd, device=dev)
    lse_out = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return o_out, lse_out
    indices = checked_indices(indices, part, sparse)  # refused out of range; repeats once
    q = torch.cat([q_nope, q_pe.to(cd)], -1)  # [T, H, nope + rope]
    K = indices.shape[1]
    D = q.shape[-1]
    per_token = max(1, K * H * (D + v_dim))
    for i in range(part.num_reqs):
        n, t0 = part.new_lens[i], part.cu_new[i]
        if n == 0:
            continue
        if variants[i] == "masked":
            o, ls = _masked_request(q[t0 : t0 + n], kv_cache, layout, part, i,
                                    indices[t0 : t0 + n], weights, softmax_scale, kv_scale, impl,
                                    chunk_tokens)  # fmt: skip
            o_out[t0 : t0 + n] = o
            lse_out[t0 : t0 + n] = ls
            continue
        step = max(1, GATHER_ELEMENTS // per_token)
        for a in range(t0, t0 + n, step):
            b = min(t0 + n, a + step)
            o, ls = _gather(q[a:b], kv_cache, layout, part, sparse, indices[a:b], a, weights,
                            softmax_scale, kv_scale, impl)  # fmt: skip
            o_out[a:b] = o
            lse_out[a:b] = ls
    return o_out, lse_out


def sparse_normal_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    weights: AbsorbWeights,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    variant: str | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSA's sparse MHA for every request of the step: decompressed per-head K/V, each query
    token attending over its index list only (prefix rows included: chunked prefill, prefix
    hits).

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope]; bf16 / fp16 / fp32; T == plan.num_tokens.
        kv_cache: the latent cache (every layout the dense paths read), holding every
            request's rows (new tokens written).
        plan: the step's plan, made with ``indexer=``.
        weights: the layer's :class:`AbsorbWeights` (``W_UK`` / ``W_UV``).
        indices: [T, k] int32 / int64 logical positions of each token's request (any order;
            a position listed twice counts once), -1 = none; out-of-range entries are refused
            as by :func:`mla_backend.sparse.sparse_absorbed_attention`.
        softmax_scale: scale of ``q·k``, a finite float > 0.
        kv_scale: float32 scalar tensor of a per-tensor fp8 cache.
        variant: ``"masked"`` / ``"gather"`` for every request, or None: per request, the
            cheaper on the plan's cost profile (:func:`mla_backend.cost.sparse_mha_variant`).
        chunk_tokens: kv rows decompressed at a time (the masked variant).
        out / lse: optional [T, H, v] (q's dtype) / [T, H] float32 contiguous outputs.
    Returns:
        (o [T, H, v] in q_nope's dtype, lse [T, H] float32, natural log).
    """
    sparse = _sparse_of(plan)
    H, nope, r = weights.W_UK.shape
    layout = check_step(q_nope, q_pe, kv_cache, plan, r + q_pe.shape[-1], kv_scale)
    T = q_nope.shape[0]
    if tuple(q_nope.shape[1:]) != (H, nope):
        raise ValueError(f"q_nope shape {tuple(q_nope.shape)} does not match the weights' "
                         f"[T, H={H}, nope={nope}]")  # fmt: skip
    if indices.dim() != 2 or indices.shape[0] != T or indices.dtype not in (torch.int32,
                                                                              torch.int64):
        raise ValueError(f"indices {indices.dtype} {tuple(indices.shape)} is not supported: "
                         f"[T={T}, k] int32 / int64")  # fmt: skip
    check_scale(softmax_scale)
    check_devices(kv_cache.device, "the cache", indices=indices, out=out, lse=lse)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; use one of {VARIANTS} or None")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an int >= 1")
    v_dim = weights.W_UV.shape[-1]
    for name, t, shape, dt in (("out", out, (T, H, v_dim), q_nope.dtype),
                               ("lse", lse, (T, H), torch.float32)):  # fmt: skip
        if t is not None and (tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous()):
            raise ValueError(f"{name} {t.dtype} {tuple(t.shape)}: expected {list(shape)} {dt}, "
                             "contiguous")  # fmt: skip
    step = plan.step
    if variant is None:
        prof = plan.impl.cost_profile(plan.device)
        variants = [sparse_mha_variant(plan.dims, sparse.indexer, p, n, prof)
                    for p, n in zip(step.prefix_lens, step.new_lens, strict=True)]  # fmt: skip
    else:
        variants = [variant] * step.num_reqs
    with torch.no_grad():
        return sparse_normal_part(q_nope, q_pe, kv_cache, layout, step, sparse, indices, weights,
                                  softmax_scale, kv_scale, plan.impl, variants, chunk_tokens,
                                  out, lse)  # fmt: skip
