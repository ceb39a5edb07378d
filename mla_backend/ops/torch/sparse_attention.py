"""DSA's sparse absorbed attention in plain torch: the torch implementation's, and the one the
others delegate to for what their kernels do not take
(:func:`~mla_backend.ops.torch.torch_default`).

Each query token attends to the latent rows of its own index list: logical positions of its
request (``-1`` = no entry), mapped to physical rows through the plan's block table, gathered
once into a [tokens, k, width] tile and dequantized by the cache layout. Scores, softmax and
P·V are fp32 (the output rounded once to q's dtype); a token with no valid index gets o = 0 and
lse = -inf. Out-of-range indices (>= the request's kv length, or < -1) are refused with
``torch._assert_async``: no host read (on a GPU a device-side assert, which surfaces at the
next synchronization; on the CPU it raises in the call). A position listed more than once in a
token's list counts once (:func:`checked_indices` drops the repeats: the rule of
:func:`mla_backend.sparse.sparse_absorbed_attention`, which the native kernel follows too).
"""

from __future__ import annotations

import torch

from ...parts import PlanPart, SparsePart
from ..base import SparseCall

#: fp32 elements of one chunk of gathered rows (tokens x k x width)
CHUNK_ELEMENTS = 1 << 23
OUT_OF_RANGE = (
    "sparse attention: an index is out of range (valid: -1 for no entry, or 0 .. kv_len - 1 of "
    "the query token's request)"
)


def checked_indices(indices: torch.Tensor, part: PlanPart, sparse: SparsePart) -> torch.Tensor:
    """Refuse indices outside ``-1 .. kv_len - 1`` of each token's request, with no host read
    (``torch._assert_async``), and return them as int64 [T, k] with every repeat of a position
    within a token's list set to -1 (its first occurrence kept)."""
    kvl = part.kv_lens_t.long().index_select(0, sparse.token_req_t.long())  # [T]
    idx = indices.long()
    ok = ((idx >= -1) & (idx < kvl[:, None])).all()
    torch._assert_async(ok, OUT_OF_RANGE)
    if idx.shape[1] < 2:
        return idx
    return idx.masked_fill(~first_occurrences(idx), -1)


def first_occurrences(idx: torch.Tensor) -> torch.Tensor:
    """[m, k] bool: False where ``idx`` [m, k] (int, -1 = no entry) repeats a valid position
    listed earlier in its row, True elsewhere (the one dedup rule of sparse and key-set
    attention)."""
    keep = torch.ones_like(idx, dtype=torch.bool)
    if idx.shape[1] < 2:
        return keep
    srt, order = idx.sort(dim=1, stable=True)  # a repeat sorts right after its first occurrence
    rep = torch.zeros_like(srt, dtype=torch.bool)
    rep[:, 1:] = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    return keep.scatter_(1, order, ~rep)


def sparse_absorbed_attention(call: SparseCall) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [T, H, r], q_pe [T, H, rope], indices [T, k] int32 (logical positions, -1 = none)
    -> (o_lat [T, H, r] in q's dtype, lse [T, H] float32; ``out`` / ``lse`` when given): the
    fields of ``call`` and its ``attn``."""
    a, sparse, indices = call.attn, call.sparse, call.indices
    q_lat, q_pe, kv_cache, layout, part = a.q_lat, a.q_pe, a.kv_cache, a.layout, a.part
    softmax_scale, kv_scale, out, lse = a.softmax_scale, a.kv_scale, a.out, a.lse
    T, H, r = q_lat.shape
    dev, cd = q_lat.device, q_lat.dtype
    o_lat = out if out is not None else torch.empty(T, H, r, dtype=cd, device=dev)
    lse_o = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return o_lat, lse_o
    indices = checked_indices(indices, part, sparse)
    K = indices.shape[1]
    if K == 0:  # no entry for any token
        o_lat.zero_()
        lse_o.fill_(float("-inf"))
        return o_lat, lse_o
    ps, W = kv_cache.shape[1], kv_cache.shape[2]
    D = r + q_pe.shape[-1]
    flat = kv_cache.view(-1, W)
    step = max(1, CHUNK_ELEMENTS // max(1, K * W))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        idx = indices[t0:t1].long()
        valid = idx >= 0
        safe = torch.where(valid, idx, 0)
        req = sparse.token_req_t[t0:t1].long()
        page = part.block_table.long()[req[:, None], safe // ps]  # [n, K]
        rows = flat.index_select(0, (page * ps + safe % ps).reshape(-1))
        kv = layout.decode(rows, torch.float32, kv_scale).view(t1 - t0, K, D)
        kv = torch.where(valid[..., None], kv, 0.0)  # never-written rows may hold NaN
        q = torch.cat([q_lat[t0:t1], q_pe[t0:t1]], -1).float()  # [n, H, D]
        s = torch.einsum("nhd,nkd->nhk", q, kv) * softmax_scale
        s.masked_fill_(~valid[:, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), 0.0, m)  # rows with no entry: p = 0, lse = -inf
        p = torch.exp(s - m)
        lsum = p.sum(-1, keepdim=True)
        o = torch.einsum("nhk,nkr->nhr", p, kv[..., :r])
        o = torch.where(lsum > 0, o / lsum, 0.0)
        o_lat[t0:t1] = o.to(cd)
        lse_o[t0:t1] = (m + torch.log(lsum)).squeeze(-1)
    return o_lat, lse_o
