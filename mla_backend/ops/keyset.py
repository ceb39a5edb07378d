"""Absorbed attention over key sets, the one primitive dense MLA, DSA and DeepSeek-V4 are cases
of: its data records (:class:`KeyWindow`, :class:`KeyCache`; the call's record is
:class:`~mla_backend.ops.base.KeySetCall`) and the plain-torch implementation
(:func:`keyset_attention`), shared by the implementations that have no kernel of their own for
it and the reference semantics every kernel follows.

Key set of query token t (request i, logical position p = prefix_i + j), a multiset of cached
rows (an entry listed twice counts twice):

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .paged import gather_latent

if TYPE_CHECKING:
    from ..cache_layout import CacheLayout
    from ..parts import PlanPart

#: fp32 elements of one chunk of scores / gathered rows (bounds the torch path's memory)
CHUNK_ELEMENTS = 1 << 23
OUT_OF_RANGE = (
    "keyset attention: an index is out of range (valid: -1 for no entry, or 0 .. kv_len - 1 of "
    "the query token's request; extra_indices: 0 .. lens[request] - 1 of the second cache)"
)
BAD_SINK = "keyset attention: a sink is +inf or NaN (supported: a finite logit, or -inf for none)"


@dataclass(frozen=True, eq=False)
class KeyWindow:
    """Per-request sliding windows of a step (made by :func:`mla_backend.plan` from its
    ``window`` argument): query token at position p of request i sees the causal range
    ``max(0, p - sizes[i] + 1) .. p``.

    Attributes:
        sizes: per request of the step, the window size (>= 1 tokens; host ints).
        sizes_t: [B] int32 on the plan's device, the same values.
    """

    sizes: tuple[int, ...]
    sizes_t: torch.Tensor

    @staticmethod
    def make(window: int | Sequence[int], num_reqs: int, device: torch.device) -> KeyWindow:
        """Validate ``window`` (one int >= 1 for every request, or one per request) and make
        the record."""
        sizes = [window] * num_reqs if isinstance(window, int) else list(window)
        bad = [w for w in sizes if isinstance(w, bool) or not isinstance(w, int) or w < 1]
        if isinstance(window, bool) or bad or len(sizes) != num_reqs:
            raise ValueError(
                f"window={window!r} is not supported: an int >= 1 (tokens each query token sees, "
                f"itself included) or a sequence of {num_reqs} of them, one per request"
            )
        return KeyWindow(tuple(sizes), torch.tensor(sizes, dtype=torch.int32, device=device))

    def start(self, req: int, pos: torch.Tensor) -> torch.Tensor:
        """First visible position of query tokens at positions ``pos`` of request ``req``."""
        return (pos - self.sizes[req] + 1).clamp(min=0)


@dataclass(frozen=True)
class KeyCache:
    """A second paged cache of a key-set call (V4: the compressed rows), in the main cache's
    row format (same dtype, width and per-tensor kv scale), with its own pages.

    Attributes:
        kv_cache: [num_pages2, page_size2, W] (W, dtype: the main cache's).
        block_table: [B, max_pages2] int32 / int64: physical page of each logical page of the
            step's requests (B = the plan's requests, in its order).
        lens: [B] int32 / int64: entries each request has in this cache.
    """

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    lens: torch.Tensor


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


def keyset_attention(
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
            if rows is not None:
                pos = torch.arange(prefix + j0, prefix + j1, device=dev)
                keys = torch.arange(lo, L, device=dev)
                start = window.start(step_req, pos) if window is not None else 0 * pos
                vis = (keys[None, :] >= start[:, None]) & (keys[None, :] <= pos[:, None])
                s = torch.einsum("mhd,ld->mhl", q, rows) * softmax_scale
                s = s.masked_fill(~vis[:, None, :], float("-inf"))
                parts.append((s, rows[:, :dv]))
            lists = []
            if indices is not None:
                lists.append((kv_cache, part.block_table[i], indices[t0:t1]))
            if extra is not None and extra_indices is not None:
                lists.append((extra.kv_cache, extra.block_table[step_req], extra_indices[t0:t1]))
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
