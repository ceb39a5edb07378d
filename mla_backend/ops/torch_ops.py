"""PyTorch implementation of the paged-latent-cache kernels (the CPU path, and the fallback).

Absorbed attention is MQA over the shared latent key: every head of every new token of a
request is one row of a single GEMM against the request's cached rows ``[c_kv ; k_pe]``
(the query row is ``[q_lat ; q_pe]``, so ``q_lat·c_kv + q_pe·k_pe`` comes out of one matmul
over the cache rows as stored: no per-head or concatenated K copy is ever made), and the value
is the first ``r`` columns of the same rows. The KV axis is processed in bounded splits whose
partial results are merged online through their log-sum-exp (flash-decoding), so memory stays
bounded at any context length.
"""

from __future__ import annotations

import torch

from ..batch import MLABatch
from ..fp8 import FP8_DTYPE, FP8_MAX
from ..merge import merge_attention_states

# Bound on one split's fp32 score tile (rows x kv tokens): 4M elements = 16 MiB.
_MAX_TILE_ELEMENTS = 1 << 22
# Bound on the latent rows one decode group gathers (~9 MiB in bf16 at 576 wide): beyond
# that the group's two passes over its rows stop hitting the caches and a long context gains
# nothing from batching (its own matmuls are large enough).
_MAX_GROUP_TOKENS = 8192
_MIN_SPLIT_TOKENS = 256
# Query rows (new tokens x heads) of one extend block.
_MAX_QUERY_ROWS = 4096
# Decode with at most this many heads runs torch's fused CPU flash kernel as single-head
# attention of H query rows against the latent rows (value = the same rows, whose first r
# output columns are kept): one fused pass instead of matmul + softmax ops, which wins where
# decode is bandwidth- and overhead-bound (few heads). Larger H keeps the GEMM path.
FLASH_DECODE_MAX_HEADS = 32
_FLASH_SPLIT_TOKENS = 16384
_FLASH_MIN_PART_TOKENS = 256
_MAX_SPLIT_TOKENS = 8192


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write new tokens' latents into the paged cache.

    Args:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn (in place).
        c_kv: [T, r] normalized latent; k_pe: [T, rope] rotated shared rope key.
        slot_mapping: [T] int; token t goes to page slot // page_size, row slot % page_size;
            slots < 0 are padding and are not written.
        kv_scale: float32 scalar for an fp8 cache (stored = value / scale).
    """
    T = c_kv.shape[0]
    if T == 0:
        return
    D = kv_cache.shape[-1]
    flat = kv_cache.view(-1, D)
    slots = slot_mapping[:T].long()
    row = torch.cat([c_kv, k_pe], dim=-1) if k_pe.shape[-1] else c_kv
    if kv_cache.dtype == FP8_DTYPE:
        s = kv_scale.float() if kv_scale is not None else torch.ones((), device=row.device)
        row = (row.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
        flat = flat.view(torch.uint8)
    else:
        row = row.to(kv_cache.dtype)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, row = slots[valid], row[valid]
    flat.index_copy_(0, slots, row)


def gather_latent(
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    start: int,
    end: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[start, end)`` of one request's logical latent sequence.

    Args:
        kv_cache: [num_pages, page_size, D].
        block_row: [max_pages] int physical page per logical page.
        out: optional reusable buffer with at least ``pages * page_size * D`` elements of the
            cache dtype (avoids a fresh allocation, and its page faults, per call).
    Returns:
        [end - start, D] in the cache dtype: a view of the cache when the pages are physically
        consecutive, else a copy (into ``out`` when given).
    """
    ps, D = kv_cache.shape[1], kv_cache.shape[2]
    p0, p1 = start // ps, (end - 1) // ps + 1
    pages = block_row[p0:p1]
    ids = pages.tolist()  # host list: cheaper than tensor ops for a handful of page ids
    first = ids[0]
    if ids[-1] - first == len(ids) - 1 and ids == list(range(first, first + len(ids))):
        rows = kv_cache[first : first + (p1 - p0)].reshape(-1, D)
    elif out is not None:
        dst = out[: (p1 - p0) * ps * D].view(p1 - p0, ps * D)
        torch.index_select(kv_cache.view(kv_cache.shape[0], ps * D), 0, pages, out=dst)
        rows = dst.view(-1, D)
    else:
        rows = kv_cache.index_select(0, pages.long()).view(-1, D)
    return rows[start - p0 * ps : end - p0 * ps]


def _split_tokens(rows: int, kv_len: int) -> int:
    """KV tokens per split: as large as the score-tile bound allows, within fixed limits."""
    c = _MAX_TILE_ELEMENTS // max(rows, 1)
    return max(_MIN_SPLIT_TOKENS, min(_MAX_SPLIT_TOKENS, c, kv_len))


def _decode_groups(batch: MLABatch, heads: int) -> tuple[list[list[int]], list[int]]:
    """Split requests into groups of single-token (decode) requests served by one batched
    matmul each, and the rest (served one by one). A group is bounded by the score-tile size
    and keeps padding (to the group's longest context) under a quarter of its work."""
    single = sorted(
        (i for i in range(batch.num_reqs) if batch.new_lens[i] == 1),
        key=lambda i: batch.kv_lens[i],
    )
    groups: list[list[int]] = []
    rest = [i for i in range(batch.num_reqs) if batch.new_lens[i] > 1]
    cur: list[int] = []
    total = 0
    for i in single:
        L = batch.kv_lens[i]
        if heads * L > _MAX_TILE_ELEMENTS or 2 * L > _MAX_GROUP_TOKENS:
            rest.append(i)
            continue
        n = len(cur) + 1
        too_big = n * heads * L > _MAX_TILE_ELEMENTS or n * L > _MAX_GROUP_TOKENS
        if cur and (too_big or total + L < 0.75 * n * L):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += L
    if cur:
        groups.append(cur)
    for g in [g for g in groups if len(g) == 1]:  # a lone request gains nothing from bmm
        groups.remove(g)
        rest.extend(g)
    return groups, rest


def _gather_group(
    kv_cache: torch.Tensor, batch: MLABatch, reqs: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent rows of single-token requests ``reqs`` in one gather, padded to the longest:
    kv [G, Lmax, D] in ``dtype`` (a copy; rows past each request's length zeroed, since
    never-written cache memory may hold NaN/Inf, e.g. fp8 0x7F, and 0 * NaN would poison
    P·V) and pad [G, Lmax] bool."""
    dev = kv_cache.device
    ps, D = kv_cache.shape[1], kv_cache.shape[2]
    lens_list = [batch.kv_lens[i] for i in reqs]
    lens = torch.tensor(lens_list, device=dev)
    npg = -(-max(lens_list) // ps)
    table = batch.block_table.index_select(0, torch.tensor(reqs, device=dev))[:, :npg]
    valid = torch.arange(npg, device=dev)[None, :] * ps < lens[:, None]
    table = torch.where(valid, table, table[:, :1])  # padding columns may hold anything
    flat = kv_cache.view(kv_cache.shape[0], ps * D)
    kv = flat.index_select(0, table.reshape(-1)).view(len(reqs), npg * ps, D)
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    for g, L in enumerate(lens_list):
        kv[g, L:].zero_()
    pad = torch.arange(npg * ps, device=dev)[None, :] >= lens[:, None]
    return kv, pad


def _decode_group(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    reqs: list[int],
    score_scale: float,
    kv_mult: float,
    o_lat: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Single-token requests ``reqs`` in one batched pass: one gather, then bmm / masked
    softmax / bmm for all of them at once (the GEMM path for many heads)."""
    r = o_lat.shape[-1]
    kv, pad = _gather_group(kv_cache, batch, reqs, q.dtype)
    rows = torch.tensor([batch.cu_new[i] for i in reqs], device=q.device)
    qg = q.index_select(0, rows)  # [G, H, D]
    scores = torch.bmm(kv, qg.transpose(1, 2)).float().mul_(score_scale)  # [G, Lmax, H]
    scores.masked_fill_(pad[:, :, None], float("-inf"))
    m = scores.amax(dim=1, keepdim=True)  # [G, 1, H]
    p = torch.exp_(scores.sub_(m))
    l = p.sum(dim=1, keepdim=True)
    m, l = m.transpose(1, 2), l.transpose(1, 2)  # [G, H, 1]
    o = torch.bmm(p.to(q.dtype).transpose(1, 2), kv[:, :, :r]).float().div_(l)  # [G, H, r]
    if kv_mult != 1.0:
        o.mul_(kv_mult)
    o_lat[rows] = o.to(q.dtype)
    lse[rows] = (m + torch.log(l)).squeeze(-1)


def _decode_group_flash(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    reqs: list[int],
    softmax_scale: float,
    kv_scale: torch.Tensor | None,
    o_lat: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Single-token requests ``reqs`` in one fused CPU flash call (the few-heads path): one
    gather, the requests as the batch dimension, padding masked out."""
    r = o_lat.shape[-1]
    kv, pad = _gather_group(kv_cache, batch, reqs, q.dtype)
    if kv_scale is not None:
        kv.mul_(kv_scale.to(kv.dtype))
    rows = torch.tensor([batch.cu_new[i] for i in reqs], device=q.device)
    G, Lmax, D = kv.shape
    qg = q.index_select(0, rows).unsqueeze(1)  # [G, 1, H, D]
    mask = torch.zeros(G, 1, 1, Lmax, dtype=q.dtype, device=q.device)
    mask.masked_fill_(pad[:, None, None, :], float("-inf"))
    o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, kv.unsqueeze(1), kv.unsqueeze(1), 0.0, False, attn_mask=mask, scale=softmax_scale
    )[:2]
    o_lat[rows] = o[:, 0, :, :r]
    lse[rows] = l[:, 0]


def _flash(q: torch.Tensor, kv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU flash attention of q [B, 1, M, D] against kv [B, 1, c, D] (K = V = kv).
    Returns (o [B, M, D] fp32, lse [B, M])."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, kv, kv, 0.0, False, scale=scale
    )[:2]
    return o[:, 0].float(), lse[:, 0]


def _flash_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    i: int,
    softmax_scale: float,
    kv_scale: torch.Tensor | None,
    gather_buf: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode request through the fused CPU flash kernel.

    The flash kernel parallelizes over batch x heads x query blocks; one decode token is a
    single query block, so the KV is cut into equal parts laid out as the batch dimension
    (a view of the gathered rows, no copy) to keep every thread busy, and the parts are
    merged through their LSE (flash-decoding). q: [1, H, D] (the token's [q_lat ; q_pe]
    rows). Returns (o [1, H, D] fp32, lse [1, H])."""
    cd = q.dtype
    H, D = q.shape[1], q.shape[2]
    L = batch.kv_lens[i]
    qf = q.view(1, 1, H, D)
    parts_max = 2 * torch.get_num_threads()
    o = lse = None
    for s in range(0, L, _FLASH_SPLIT_TOKENS):
        e = min(L, s + _FLASH_SPLIT_TOKENS)
        kv = gather_latent(kv_cache, batch.block_table[i], s, e, out=gather_buf)
        if kv.dtype != cd:
            kv = kv.to(cd) if kv_scale is None else (kv.float() * kv_scale.float()).to(cd)
        c = e - s
        parts = max(1, min(parts_max, c // _FLASH_MIN_PART_TOKENS))
        size = c // parts
        main = parts * size
        o_p, lse_p = _flash(
            qf.expand(parts, 1, H, D), kv[:main].view(parts, 1, size, D), softmax_scale
        )
        if parts > 1:
            lse_c = torch.logsumexp(lse_p, dim=0, keepdim=True)  # [1, H]
            o_c = (o_p * torch.exp(lse_p - lse_c).unsqueeze(-1)).sum(0, keepdim=True)
        else:
            o_c, lse_c = o_p, lse_p
        if main < c:
            o_r, lse_r = _flash(qf, kv[main:].view(1, 1, c - main, D), softmax_scale)
            o_c, lse_c = merge_attention_states(o_c, lse_c, o_r, lse_r)
        if o is None:
            o, lse = o_c, lse_c
        else:
            o, lse = merge_attention_states(o, lse, o_c, lse_c)
    return o, lse


def _attend_block(
    qi: torch.Tensor,
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    first_limit: int,
    kv_end: int,
    score_scale: float,
    r: int,
    bufs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
    split: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive new tokens of one request (token k of the block sees kv positions
    ``<= first_limit + k``) against kv rows ``[0, kv_end)``, split along the KV and merged
    online.

    qi: [nb * H, D] query rows (token-major). Returns (o [nb*H, r] fp32, lse [nb*H, 1])."""
    gather_buf, conv_buf, s_buf, f_buf = bufs
    rows, D = qi.shape
    nb = kv_end - first_limit
    H = rows // nb
    dev = qi.device
    acc = m_acc = l_acc = None
    for s in range(0, kv_end, split):
        e = min(kv_end, s + split)
        c = e - s
        kv = gather_latent(kv_cache, block_row, s, e, out=gather_buf)
        if conv_buf is not None:
            kv = conv_buf[:c].copy_(kv)
        # scores transposed ([c, rows] = kv · q^T) runs faster in oneDNN than q · kv^T
        sc = torch.mm(kv, qi.t(), out=s_buf[: rows * c].view(c, rows))
        scores = f_buf[: rows * c].view(c, rows).copy_(sc).mul_(score_scale)
        if e - 1 > first_limit:  # causal among the new tokens
            pos = torch.arange(s, e, device=dev)
            limit = first_limit + torch.arange(nb, device=dev)
            mask = pos[:, None] > limit[None, :]  # [c, nb]
            scores.view(c, nb, H).masked_fill_(mask[:, :, None], float("-inf"))
        # a column may see no key of this split: clamp keeps exp() at 0 instead of NaN
        m = scores.amax(dim=0, keepdim=True).clamp_(min=-1e30)  # [1, rows]
        p = torch.exp_(scores.sub_(m))
        l = p.sum(dim=0, keepdim=True)
        o = torch.mm(sc.copy_(p).t(), kv[:, :r]).float()  # [rows, r]
        m, l = m.t(), l.t()  # [rows, 1]
        if acc is None:
            acc, m_acc, l_acc = o, m, l
        else:
            m_new = torch.maximum(m_acc, m)
            a, b = torch.exp(m_acc - m_new), torch.exp(m - m_new)
            acc = acc.mul_(a).add_(o.mul_(b))
            l_acc = l_acc.mul_(a).add_(l.mul_(b))
            m_acc = m_new
    return acc.div_(l_acc), m_acc + torch.log(l_acc)


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the paged latent cache (decode and extend).

    Args:
        q_lat: [T, H, r] absorbed query (``q_nope · W_UK``), bf16/fp16/fp32.
        q_pe: [T, H, rope] rotated rope query (rope may be 0).
        kv_cache: [num_pages, page_size, r + rope]; must already hold every request's
            ``prefix_lens[i] + new_lens[i]`` tokens.
        batch: the step's :class:`MLABatch` (T == batch.num_tokens).
        softmax_scale: applied to ``q·k``.
        kv_scale: float32 scalar scale of an fp8 cache.
    Returns:
        o_lat: [T, H, r] in q_lat's dtype; lse: [T, H] float32 (natural log of the sum of
        exp(scaled scores)).
    """
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    D = r + rope
    if kv_cache.shape[-1] != D:
        raise ValueError(
            f"kv_cache row width {kv_cache.shape[-1]} != kv_lora_rank + rope = {r} + {rope}"
        )
    dev, cd = q_lat.device, q_lat.dtype
    q = torch.cat([q_lat, q_pe.to(cd)], dim=-1) if rope else q_lat  # [T, H, D]: query only
    o_lat = torch.empty(T, H, r, dtype=cd, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return o_lat, lse
    kv_mult = float(kv_scale) if kv_scale is not None else 1.0
    score_scale = softmax_scale * kv_mult
    ps = kv_cache.shape[1]
    groups, rest = _decode_groups(batch, H)
    if dev.type == "cpu" and H <= FLASH_DECODE_MAX_HEADS:
        for g in groups:
            _decode_group_flash(q, kv_cache, batch, g, softmax_scale, kv_scale, o_lat, lse)
        flash_buf = None
        for i in [i for i in rest if batch.new_lens[i] == 1]:
            if flash_buf is None:
                pages = -(-min(_FLASH_SPLIT_TOKENS, batch.max_kv_len) // ps) + 1
                flash_buf = torch.empty(pages * ps * D, dtype=kv_cache.dtype, device=dev)
            t0 = batch.cu_new[i]
            o, l = _flash_decode(
                q[t0 : t0 + 1], kv_cache, batch, i, softmax_scale, kv_scale, flash_buf
            )
            o_lat[t0 : t0 + 1] = o[..., :r]
            lse[t0 : t0 + 1] = l
        rest = [i for i in rest if batch.new_lens[i] > 1]
    else:
        for g in groups:
            _decode_group(q, kv_cache, batch, g, score_scale, kv_mult, o_lat, lse)
    if not rest:
        return o_lat, lse
    # Extends are processed in blocks of new tokens (bounded rows per score tile); a block
    # only reads the KV its last token can see, so causal work past it is skipped.
    qb = max(1, _MAX_QUERY_ROWS // H)
    max_rows = min(max(batch.new_lens[i] for i in rest), qb) * H
    split = _split_tokens(max_rows, max(batch.kv_lens[i] for i in rest))
    split_pages = -(-split // ps) + 1
    # One workspace, reused by every block and split: large fresh allocations cost page
    # faults on every call on CPU.
    gather_buf = torch.empty(split_pages * ps * D, dtype=kv_cache.dtype, device=dev)
    conv_buf = (
        torch.empty(split_pages * ps, D, dtype=cd, device=dev) if kv_cache.dtype != cd else None
    )
    s_buf = torch.empty(max_rows * split, dtype=cd, device=dev)
    f_buf = torch.empty(max_rows * split, dtype=torch.float32, device=dev)
    for i in sorted(rest):
        P, n, t0 = batch.prefix_lens[i], batch.new_lens[i], batch.cu_new[i]
        block_row = batch.block_table[i]
        for j0 in range(0, n, qb):
            j1 = min(n, j0 + qb)
            rows = (j1 - j0) * H
            qi = q[t0 + j0 : t0 + j1].reshape(rows, D)
            out, lse_b = _attend_block(
                qi,
                kv_cache,
                block_row,
                P + j0,
                P + j1,
                score_scale,
                r,
                (gather_buf, conv_buf, s_buf, f_buf),
                split,
            )
            if kv_mult != 1.0:
                out.mul_(kv_mult)
            o_lat[t0 + j0 : t0 + j1] = out.view(j1 - j0, H, r)
            lse[t0 + j0 : t0 + j1] = lse_b.view(j1 - j0, H)
    return o_lat, lse
