"""The DSA lightning indexer in plain torch: the torch implementation's, and the one the others
delegate to for what their kernels do not take (:func:`~mla_backend.ops.torch.torch_default`):
the index-key cache write, the indexer logits and the causal top-k per query token.

Top-k order (every implementation follows it exactly): a query token's candidates are the
positions it sees (``0 .. pos``); they are ranked by logit, larger first, a tie going to the
lower position; ``-0.0`` equals ``+0.0`` and a NaN logit ranks below every number (-inf
included). The ``min(topk, pos + 1)`` best positions are returned in ascending position order,
then ``-1`` padding. The rank is one int64 key per candidate (:func:`rank_keys`): the logit's
order-preserving 32-bit image in the high word, ``2^32 - 1 - pos`` in the low word, so keys are
distinct and "k largest keys" is the rule itself; ``torch.topk`` selects them (a partial
selection, no sort of the row).

Sizes come from the plan's host data; no tensor value is read on the host.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...index_cache import IndexCacheLayout
from ...parts import PlanPart
from ..base import IndexerCall, IndexKeyWrite
from .slots import write_targets

#: the rank key of a position a query token does not see
INVISIBLE = -(2**63)
_INT32_MIN = -(2**31)
_LOW = 2**32 - 1
#: fp32 elements of one chunk of scores (query rows x heads x keys) in :func:`indexer_logits`
CHUNK_ELEMENTS = 1 << 24


def write_index_keys(w: IndexKeyWrite) -> None:
    """Write keys k_I [T, Di] to ``slot_mapping`` [>= T] (< 0 skipped) of ``index_cache``
    [pages, page_size, W] in ``layout``, in place (the fields of ``w``).

    Slots are in range (refused at the entry point, :func:`mla_backend.checks.check_slots`);
    the index never wraps. A slot named by several tokens holds the last one's key and padding
    (< 0) writes nothing (:func:`~.slots.write_targets`: no host read of the mask)."""
    index_cache, layout, k_I, slot_mapping = w.index_cache, w.layout, w.k_I, w.slot_mapping
    T = k_I.shape[0]
    ps = index_cache.shape[1]
    n_slots = index_cache.shape[0] * ps
    if T == 0 or n_slots == 0:  # no cache slots: every slot is padding (the entry point checked)
        return
    values, scales = layout.page_views(index_cache)
    vals, sc = layout.encode(k_I)
    to = write_targets(slot_mapping[:T].long(), n_slots)
    page, off = to.target // ps, to.target % ps
    for view, rows in ((values, vals.view(values.dtype)), (scales, sc)):
        if view is None:
            continue
        keep = view[page[:1], off[:1]]  # [1, X]: all padding: that slot's current content
        src = torch.where(to.any_valid[:, None], rows.index_select(0, to.source), keep)
        view.index_put_((page, off), src)


def request_keys(
    index_cache: torch.Tensor, layout: IndexCacheLayout, part: PlanPart, i: int, L: int
) -> torch.Tensor:
    """The first ``L`` keys of request ``i`` of ``part``, read through its block table and
    dequantized: float32 [L, Di]."""
    ps = index_cache.shape[1]
    pages = part.block_table[i, : -(-L // ps)].long()
    values, scales = layout.page_views(index_cache)
    v = values.index_select(0, pages).reshape(-1, layout.index_head_dim)[:L]
    s = None
    if scales is not None:
        s = scales.index_select(0, pages).reshape(-1, scales.shape[-1])[:L]
    return layout.decode(v, s)


def indexer_logits(c: IndexerCall) -> torch.Tensor:
    """The seam's ``indexer_logits``: :func:`logits` over the step, [T, sparse.max_kv_len]."""
    s = c.sparse
    return logits(c.q_I, c.weights, c.index_cache, c.layout, c.part, s.max_kv_len, c.out, s.ratio)


def logits(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    layout: IndexCacheLayout,
    part: PlanPart,
    width: int,
    out: torch.Tensor | None = None,
    ratio: int = 1,
) -> torch.Tensor:
    """``I[s, t] = sum_h weights[s, h] * relu(q_I[s, h] . k_I[t])`` for keys t the token s sees
    (``t <= pos(s)``; with ``ratio`` tokens per key, ``t < (pos(s) + 1) // ratio``), -inf
    elsewhere (positions past the request's keys included): q_I [T, Hi, Di] (bf16 / fp16 /
    fp32 / e4m3 values), weights [T, Hi] float32 -> float32 [T, width] (``out`` when given;
    width >= the part's most keys). fp32 throughout."""
    T, Hi, Di = q_I.shape
    res = out if out is not None else torch.empty(T, width, dtype=torch.float32, device=q_I.device)
    res.fill_(float("-inf"))
    w = weights.float()
    for i, (P, n) in enumerate(zip(part.prefix_lens, part.new_lens, strict=True)):
        if n == 0:
            continue
        L, t0 = (P + n) // ratio, part.cu_new[i]
        keys = request_keys(index_cache, layout, part, i, L)  # [L, Di]
        step = max(1, CHUNK_ELEMENTS // max(1, Hi * L))
        for j0 in range(0, n, step):
            j1 = min(n, j0 + step)
            q = q_I[t0 + j0 : t0 + j1].float()
            s = torch.relu(torch.einsum("nhd,ld->nhl", q, keys))
            lg = torch.einsum("nhl,nh->nl", s, w[t0 + j0 : t0 + j1])
            pos = torch.arange(L, device=q.device)
            lim = (P + torch.arange(j0, j1, device=q.device) + 1) // ratio - 1
            lg.masked_fill_(pos[None, :] > lim[:, None], float("-inf"))
            res[t0 + j0 : t0 + j1, :L] = lg
    return res


def rank_keys(logits: torch.Tensor, token_pos: torch.Tensor) -> torch.Tensor:
    """The int64 rank key of every candidate (module docstring): logits [T, W] float32,
    token_pos [T] (the last position each row sees) -> [T, W] int64; positions a row does not
    see get :data:`INVISIBLE`."""
    f = logits.float() + 0.0  # -0.0 -> +0.0
    bits = f.view(torch.int32).long()
    k32 = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    k32 = torch.where(torch.isnan(f), _INT32_MIN, k32)
    pos = torch.arange(f.shape[1], device=f.device)
    key = k32 * 2**32 + (_LOW - pos)
    visible = pos[None, :] <= token_pos.long()[:, None]
    return torch.where(visible, key, INVISIBLE)


def topk_positions(
    logits: torch.Tensor, token_pos: torch.Tensor, topk: int, out: torch.Tensor
) -> torch.Tensor:
    """The top-k rule (module docstring) over logits [T, W] for rows seeing positions
    ``0 .. token_pos[t]``: out [T, topk] int32 = the selected positions ascending, -1 padded."""
    T, W = logits.shape
    k = min(topk, W)
    if T == 0:
        return out
    out.fill_(-1)
    if k == 0:
        return out
    vals, idx = torch.topk(rank_keys(logits, token_pos), k, dim=1, sorted=False)
    big = torch.iinfo(torch.int64).max
    sel = torch.where(vals != INVISIBLE, idx, big).sort(dim=1).values
    out[:, :k] = torch.where(sel != big, sel, -1).to(torch.int32)
    return out


def indexer_topk(c: IndexerCall) -> torch.Tensor:
    """The causal top-k per query token: [T, topk] int32 (``out`` when given), the rule of the
    module docstring, over :func:`logits` (one request at a time, so the logits never exceed
    one request's rows x its keys)."""
    q_I, weights, index_cache, layout, part = c.q_I, c.weights, c.index_cache, c.layout, c.part
    sparse, topk, out = c.sparse, c.topk, c.out
    T, R = q_I.shape[0], sparse.ratio
    res = out if out is not None else torch.empty(T, topk, dtype=torch.int32, device=q_I.device)
    for i, (P, n) in enumerate(zip(part.prefix_lens, part.new_lens, strict=True)):
        if n == 0:
            continue
        t0 = part.cu_new[i]
        one = _one_request(part, i)
        lg = logits(q_I[t0 : t0 + n], weights[t0 : t0 + n], index_cache, layout, one,
                    (P + n) // R, ratio=R)  # fmt: skip
        topk_positions(lg, sparse.token_last_t[t0 : t0 + n], topk, res[t0 : t0 + n])
    return res


def _one_request(part: PlanPart, i: int) -> PlanPart:
    """Request ``i`` of ``part`` as a part of its own (host data and block-table row)."""
    n = part.new_lens[i]
    return replace(
        part,
        reqs=(part.reqs[i],),
        prefix_lens=(part.prefix_lens[i],),
        new_lens=(n,),
        cu_new=(0, n),
        pages=None if part.pages is None else (part.pages[i],),
        block_table=part.block_table[i : i + 1],
    )

