"""DeepSeek-V4 attention over flat slots of caches in V4's 584-byte fp8 page layout, in plain
torch: the torch implementation's, the one Triton / FlashInfer delegate to, and the semantics
every kernel follows (the contract of vLLM's CPU op ``flash_mla_with_kvcache_cpu``; the record:
:class:`~mla_backend.ops.base.V4SlotCall`).

Query token t lists, per cache, flat slots ``page * page_size + offset`` (negative: none). Its
key set is the distinct rows it lists in each cache (a slot listed twice counts once), each row
as :func:`mla_backend.v4_cache.read_v4_rows` decodes it in fp32 (e4m3 times its tile's power of
two; the RoPE part's bf16). Per head h, with ``s_k = softmax_scale * q[t, h] . row_k``::

    o[t, h] = sum_k exp(s_k) row_k / (sum_k exp(s_k) + exp(sink[h]))

(the sink a logit of the denominator only; -inf: none). A token that lists no row gets 0.
Scores, softmax and P·V are fp32 (o rounded once to q's dtype). Slots past their cache are
refused by the reader (``torch._assert_async``). Tokens go in chunks, so the gathered rows take
at most about :data:`CHUNK_ROWS` x 512 floats at a time.
"""

from __future__ import annotations

import torch

from ...v4_cache import read_v4_rows
from ..base import V4SlotCall

#: gathered rows per chunk of tokens (tokens x listed slots)
CHUNK_ROWS = 1 << 16


def _distinct(slots: torch.Tensor) -> torch.Tensor:
    """[T, k] bool: slot >= 0 and not an earlier column's slot of the same token."""
    s = slots.long()
    order = torch.sort(s, dim=1, stable=True)
    srt = order.values
    first = torch.ones_like(srt, dtype=torch.bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    keep = torch.zeros_like(first)
    keep.scatter_(1, order.indices, first)
    return keep & (s >= 0)


def v4_slot_attention(call: V4SlotCall) -> torch.Tensor:
    """o [T, H, 512] in q's dtype (into ``call.out`` when given); see the module doc."""
    q = call.q
    T, H, _ = q.shape
    out = call.out if call.out is not None else torch.empty_like(q)
    k_all = sum(int(slots.shape[1]) for _, slots, _ in call.sets)
    step = max(1, CHUNK_ROWS // max(1, k_all))
    sink = call.sink.float().view(1, H, 1)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows, live = [], []
        for cache, slots, page_size in call.sets:
            s = slots[t0:t1]
            rows.append(read_v4_rows(cache, page_size, s, torch.float32))  # [n, k, 512]
            live.append(_distinct(s))
        k, m = torch.cat(rows, 1), torch.cat(live, 1)  # [n, K, 512], [n, K]
        s = torch.einsum("thd,tkd->thk", q[t0:t1].float(), k) * call.softmax_scale
        s = s.masked_fill(~m.unsqueeze(1), float("-inf"))
        mx = torch.maximum(s.amax(-1, keepdim=True), sink).clamp_min(torch.finfo(torch.float32).min)
        p = torch.exp(s - mx)
        # no row and no sink: p = 0 and den = 0, so o = 0
        den = (p.sum(-1, keepdim=True) + torch.exp(sink - mx)).clamp_min(1e-38)
        o = torch.einsum("thk,tkd->thd", p / den, k)
        out[t0:t1] = o.to(q.dtype)
    return out
