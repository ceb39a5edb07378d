"""Absorbed attention over key sets, the one primitive dense MLA, DSA and DeepSeek-V4 are cases
of, in plain torch: the torch implementation's, the one the others delegate to for what their
kernels do not take (:func:`~mla_backend.ops.torch.torch_default`), and the reference semantics
every kernel follows. Its records (:class:`~mla_backend.ops.base.KeySetCall`,
:class:`~mla_backend.ops.base.KeyWindow`, :class:`~mla_backend.ops.base.KeyCache`) live at the
seam.

Key set of query token t (request i, logical position p = prefix_i + j), a *set* of cached rows
per cache -- each distinct position of a cache counts once, the rule of sparse attention
(:mod:`.sparse_attention`): a position repeated in an index list, or a main-cache index inside
the token's causal range, adds nothing (:func:`distinct_indices`) -- the union of:

- the causal range (``causal_range``): positions ``start .. p`` of the main cache, ``start =
  max(0, p - window_i + 1)`` with the plan's per-request window (:class:`KeyWindow`; none: 0);
- ``indices`` [T, k]: positions of the main cache (``-1`` = no entry, each ``< kv_len_i``);
- ``extra_indices`` [T, k2]: entries of a second cache with its own block table and entry
  counts (:class:`KeyCache`; V4's compressed rows), ``-1`` = no entry, each ``< lens[i]``.

Per head h, with ``s_k = softmax_scale * (q_lat . c_kv_k + q_pe . k_pe_k)``::

    lse[t, h] = log(sum_k exp(s_k) + exp(sink[h]))      (no sink / sink = -inf: the keys alone)
    o[t, h]   = sum_k exp(s_k - lse[t, h]) * v_k

i.e. the sink is one more key of value 0: o is the sink-free attention scaled by
``1 / (1 + exp(sink - lse_keys))``, and the returned lse *includes* the sink (merging (o, lse)
with another partial by LSE stays exact as long as only one partial carries the sink). A token
with no key gets o = 0 and lse = sink[h] (-inf without a sink). ``v_k``: the first r columns of
the row (MLA: c_kv), or the whole row when ``value_is_key`` (V4: the 512-wide row is both; o is
then [T, H, r + rope]). Scores, softmax and P·V are fp32 here (o rounded once to q's dtype).

Bad indices (< -1 or past their request's rows) and a sink of +inf / NaN are refused with
``torch._assert_async`` (no host read: on the CPU it raises in the call). Never-written cache
rows (NaN) are never read into a result: rows outside a key set are masked before P·V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..base import KeyCache, KeySetCall, KeyWindow
from .paged import gather_latent
from .sparse_attention import first_occurrences

if TYPE_CHECKING:
    from ...cache_layout import CacheLayout
    from ...parts import PlanPart

#: fp32 elements of one chunk of scores / gathered rows (bounds the torch path's memory)
CHUNK_ELEMENTS = 1 << 23
OUT_OF_RANGE = (
    "keyset attention: an index is out of range (valid: -1 for no entry, or 0 .. kv_len - 1 of "
    "the query token's request; extra_indices: 0 .. lens[request] - 1 of the second cache)"
)
BAD_SINK = "keyset attention: a sink is +inf or NaN (supported: a finite logit, or -inf for none)"


def check_keyset_indices(
    part: PlanPart,
    indices: torch.Tensor | None,
    extra: KeyCache | None,
    extra_indices: torch.Tensor | None,
    sink: torch.Tensor | None,
) -> None:
    """Refuse out-of-range indices and bad sinks with no host read (``torch._assert_async``)."""
    dev = part.kv_lens_t.device
    req = torch.repeat_interleave(
        torch.arange(part.num_reqs, device=dev), part.new_lens_t.long(),
        output_size=part.num_tokens,
    )  # fmt: skip
    ok = torch.ones((), dtype=torch.bool, device=dev)
    if indices is not None:
        kvl = part.kv_lens_t.long()[req][:, None]
        idx = indices.long()
        ok = ok & ((idx >= -1) & (idx < kvl)).all()
    if extra_indices is not None and extra is not None:
        lens = extra.lens.long()[req][:, None]
        e = extra_indices.long()
        ok = ok & ((e >= -1) & (e < lens)).all()
    torch._assert_async(ok, OUT_OF_RANGE)
    if sink is not None:
        torch._assert_async(~(torch.isnan(sink) | torch.isposinf(sink)).any(), BAD_SINK)


def window_start(window: KeyWindow, req: int, pos: torch.Tensor) -> torch.Tensor:
    """First visible position of query tokens at positions ``pos`` of request ``req``."""
    return (pos - window.sizes[req] + 1).clamp(min=0)


def distinct_indices(
    idx: torch.Tensor, start: torch.Tensor | None = None, pos: torch.Tensor | None = None
) -> torch.Tensor:
    """``idx`` [m, k] (-1 = no entry) with every repeat of a position in its row set to -1
    (its first occurrence kept), and, given the rows' causal ranges ``start`` / ``pos`` [m],
    every entry inside its row's range ``start .. pos`` set to -1 too (the range holds it)."""
    idx = idx.long()
    if start is not None and pos is not None:
        inside = (idx >= start[:, None]) & (idx <= pos[:, None])
        idx = idx.masked_fill(inside, -1)
    return idx.masked_fill(~first_occurrences(idx), -1)


def _indexed_rows(
    cache: torch.Tensor, table_row: torch.Tensor, idx: torch.Tensor, layout: CacheLayout,
    kv_scale: torch.Tensor | None, D: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rows of ``cache`` at logical positions ``idx`` [n, k] through one request's block-table
    row, dequantized to fp32 [n, k, D] (0 where idx < 0), and the validity mask [n, k]."""
    ps, W = cache.shape[1], cache.shape[2]
    valid = idx >= 0
    safe = torch.where(valid, idx.long(), 0)
    page = table_row.long()[safe // ps]
    rows = cache.reshape(-1, W).index_select(0, (page * ps + safe % ps).reshape(-1))
    kv = layout.decode(rows, torch.float32, kv_scale).view(*idx.shape, D)
    return torch.where(valid[..., None], kv, 0.0), valid  # never-written rows may hold NaN


def keyset_attention(call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The seam method on the record's fields (see :func:`keyset_attention_on`), delivered into
    ``call.attn.out`` / ``call.attn.lse`` when given."""
    a = call.attn
    o, lse = keyset_attention_on(
        a.q_lat, a.q_pe, a.kv_cache, a.layout, a.part, a.softmax_scale, a.kv_scale,
        call.window, call.causal_range, call.indices, call.extra, call.extra_indices,
        call.sink, call.value_is_key,
    )  # fmt: skip
    return a.deliver(o, lse)


def keyset_attention_on(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    part: PlanPart,
    softmax_scale: float,
    kv_scale: torch.Tensor | None,
    window: KeyWindow | None,
    causal_range: bool = True,
    indices: torch.Tensor | None = None,
    extra: KeyCache | None = None,
    extra_indices: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    value_is_key: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [T, H, r], q_pe [T, H, rope] over the key sets of the module docstring (``part``:
    the plan's whole step) -> (o [T, H, dv] in q's dtype, lse [T, H] float32, the sink
    included), request by request, queries in chunks; dv = r, or r + rope when
    ``value_is_key``."""
    T, H, r = q_lat.shape
    D = r + q_pe.shape[-1]
    dv = D if value_is_key else r
    dev, cd = q_lat.device, q_lat.dtype
    o_all = torch.empty(T, H, dv, dtype=cd, device=dev)
    lse_all = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return o_all, lse_all
    check_keyset_indices(part, indices, extra, extra_indices, sink)
    sink = sink.float() if sink is not None else None
    for i in range(part.num_reqs):
        n, prefix = part.new_lens[i], part.prefix_lens[i]
        if n == 0:
            continue
        L, t_base, step_req = prefix + n, part.cu_new[i], part.reqs[i]
        rows = None
        lo = 0
        if causal_range:
            if window is not None:  # rows before the first token's window are never read
                lo = max(0, prefix - window.sizes[step_req] + 1)
            rows = gather_latent(kv_cache, layout, part, i, lo, L, torch.float32, kv_scale)
        width = (L - lo) + sum(x.shape[1] for x in (indices, extra_indices) if x is not None)
        chunk = max(1, CHUNK_ELEMENTS // max(1, H * width + width * D))
        for j0 in range(0, n, chunk):
            j1 = min(n, j0 + chunk)
            t0, t1 = t_base + j0, t_base + j1
            q = torch.cat([q_lat[t0:t1], q_pe[t0:t1]], -1).float()  # [m, H, D]
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scores [m, H, k], values)
            pos = torch.arange(prefix + j0, prefix + j1, device=dev)
            start = window_start(window, step_req, pos) if window is not None else 0 * pos
            if rows is not None:
                keys = torch.arange(lo, L, device=dev)
                vis = (keys[None, :] >= start[:, None]) & (keys[None, :] <= pos[:, None])
                s = torch.einsum("mhd,ld->mhl", q, rows) * softmax_scale
                s = s.masked_fill(~vis[:, None, :], float("-inf"))
                parts.append((s, rows[:, :dv]))
            lists = []
            if indices is not None:
                own = (start, pos) if rows is not None else (None, None)  # the range holds those
                idx = distinct_indices(indices[t0:t1], *own)
                lists.append((kv_cache, part.block_table[i], idx))
            if extra is not None and extra_indices is not None:
                e = distinct_indices(extra_indices[t0:t1])
                lists.append((extra.kv_cache, extra.block_table[step_req], e))
            for cache, table_row, idx in lists:
                kv, valid = _indexed_rows(cache, table_row, idx, layout, kv_scale, D)
                s = torch.einsum("mhd,mkd->mhk", q, kv) * softmax_scale
                s = s.masked_fill(~valid[:, None, :], float("-inf"))
                parts.append((s, kv[..., :dv]))
            m = torch.full((j1 - j0, H, 1), float("-inf"), device=dev)
            for s, _ in parts:
                m = torch.maximum(m, s.amax(-1, keepdim=True))
            if sink is not None:
                m = torch.maximum(m, sink[None, :, None])
            m = torch.where(torch.isneginf(m), 0.0, m)  # no key and no sink: p = 0, lse = -inf
            lsum = torch.zeros_like(m)
            o = torch.zeros(j1 - j0, H, dv, device=dev)
            for s, v in parts:
                p = torch.exp(s - m)
                lsum = lsum + p.sum(-1, keepdim=True)
                eq = "mhl,ld->mhd" if v.dim() == 2 else "mhk,mkd->mhd"
                o = o + torch.einsum(eq, p, v)
            if sink is not None:
                lsum = lsum + torch.exp(sink[None, :, None] - m)
            o_all[t0:t1] = torch.where(lsum > 0, o / lsum, 0.0).to(cd)
            lse_all[t0:t1] = torch.where(lsum > 0, m + torch.log(lsum), float("-inf")).squeeze(-1)
    return o_all, lse_all
