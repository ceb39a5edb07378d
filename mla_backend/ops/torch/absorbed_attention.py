"""The torch implementation's absorbed attention: MQA over the shared latent key.

Every head of every new token of a request is one query row against the request's cached rows
``[c_kv ; k_pe]`` (the query row is ``[q_lat ; q_pe]``, so ``q_lat·c_kv + q_pe·k_pe`` comes out of
one product over the cache rows as stored: no per-head or concatenated K copy is ever made), and
the value is the first ``r`` columns of the same rows. The KV axis is processed in bounded splits
whose partial results are merged online through their log-sum-exp (flash-decoding), so memory
stays bounded at any context length.

Four strategies, picked per request by :func:`absorbed_attention`: batched decode groups
through torch's fused CPU flash kernel (few heads) or bmm + softmax (many heads), one long
decode through the flash kernel cut into parts, and extends in blocks of new tokens. Each reads
one :class:`_Call` (the call's tensors, plan part, layout and tuning).

Every call reads its sizes and page ids from the plan's host data, never from tensors, and the
kv scale stays a tensor: no device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache_layout import CacheLayout
from ...merge import merge_attention_states
from ...parts import PlanPart
from ..base import AbsorbedCall
from .paged import latent_rows


@dataclass(frozen=True)
class Tuning:
    """The torch implementation's knobs (the defaults were measured on the project's 2-core
    CPUs).

    Attributes:
        max_tile_elements: bound on one split's fp32 score tile (rows x kv tokens).
        max_group_tokens: bound on the latent rows one decode group gathers (beyond it a
            group's passes stop hitting the caches, and a long context gains nothing from
            batching).
        max_query_rows: query rows (new tokens x heads) of one extend block.
        flash_max_heads: decodes with at most this many heads run torch's fused CPU flash
            kernel (H query rows against the latent rows), which wins where decode is bandwidth-
            and overhead-bound; more heads take the GEMM path.
        flash_split_tokens: KV tokens per flash call of a long decode.
        min_split_tokens / max_split_tokens: bounds on one KV split.
    """

    max_tile_elements: int = 1 << 22
    max_group_tokens: int = 8192
    max_query_rows: int = 4096
    flash_max_heads: int = 32
    flash_split_tokens: int = 16384
    min_split_tokens: int = 256
    max_split_tokens: int = 8192

    def split_tokens(self, rows: int, kv_len: int) -> int:
        """KV tokens per split: as large as the score-tile bound allows, within fixed limits."""
        c = self.max_tile_elements // max(rows, 1)
        return max(self.min_split_tokens, min(self.max_split_tokens, c, kv_len))


@dataclass(frozen=True)
class _Call:
    """One absorbed-attention call: q [T, H, D] = ``[q_lat ; q_pe]`` in the compute dtype, the
    cache [pages, page_size, width] in ``layout``, the outputs o_lat [T, H, r] and lse [T, H]
    (filled in place), ``score_scale`` = softmax scale (times ``kv_scale`` for fp8)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    part: PlanPart
    layout: CacheLayout
    softmax_scale: float
    score_scale: float | torch.Tensor
    kv_scale: torch.Tensor | None
    o_lat: torch.Tensor
    lse: torch.Tensor
    tuning: Tuning


def absorbed_attention(ac: AbsorbedCall, tuning: Tuning) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [T, H, r], q_pe [T, H, rope] -> (o_lat [T, H, r] in q's dtype, lse [T, H] float32),
    new tensors (the caller delivers them into ``ac.out`` / ``ac.lse``): see
    :meth:`mla_backend.ops.KernelImpl.absorbed_attention`."""
    q_lat, q_pe, kv_cache, part = ac.q_lat, ac.q_pe, ac.kv_cache, ac.part
    softmax_scale, kv_scale, layout = ac.softmax_scale, ac.kv_scale, ac.layout
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    dev, cd = q_lat.device, q_lat.dtype
    # [T, H, D], the last dim contiguous: torch's CPU flash kernel returns a wrong LSE for a
    # strided one (the output is right)
    q = torch.cat([q_lat, q_pe.to(cd)], dim=-1) if rope else q_lat
    if q.stride(-1) != 1:
        q = q.contiguous()
    o_lat = torch.empty(T, H, r, dtype=cd, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return o_lat, lse
    score_scale: float | torch.Tensor = softmax_scale
    if kv_scale is not None:
        score_scale = kv_scale.float() * softmax_scale
    call = _Call(
        q, kv_cache, part, layout, softmax_scale, score_scale, kv_scale, o_lat, lse, tuning
    )
    groups, rest = decode_groups(part, H, tuning)
    if dev.type == "cpu" and H <= tuning.flash_max_heads:
        for g in groups:
            _decode_group_flash(call, g)
        singles = [i for i in rest if part.new_lens[i] == 1]
        if singles:
            ps, W = kv_cache.shape[1], kv_cache.shape[-1]
            pages = -(-min(tuning.flash_split_tokens, part.max_kv_len) // ps) + 1
            flash_buf = torch.empty(pages * ps * W, dtype=kv_cache.dtype, device=dev)
            for i in singles:
                t0 = part.cu_new[i]
                o, l = _flash_decode(call, i, flash_buf)
                o_lat[t0 : t0 + 1] = o[..., :r]
                lse[t0 : t0 + 1] = l
        rest = [i for i in rest if part.new_lens[i] > 1]
    else:
        for g in groups:
            _decode_group(call, g)
    if rest:
        _extends(call, rest)
    return o_lat, lse


def decode_groups(
    part: PlanPart, heads: int, tuning: Tuning
) -> tuple[list[list[int]], list[int]]:
    """Split requests into groups of single-token (decode) requests served by one batched
    call each, and the rest (served one by one). A group is bounded by the score-tile size
    and keeps padding (to the group's longest context) under a quarter of its work."""
    kv_lens = part.kv_lens
    single = sorted(
        (i for i in range(part.num_reqs) if part.new_lens[i] == 1), key=lambda i: kv_lens[i]
    )
    groups: list[list[int]] = []
    rest = [i for i in range(part.num_reqs) if part.new_lens[i] > 1]
    cur: list[int] = []
    total = 0
    tile, group_tokens = tuning.max_tile_elements, tuning.max_group_tokens
    for i in single:
        L = kv_lens[i]
        if heads * L > tile or 2 * L > group_tokens:
            rest.append(i)
            continue
        n = len(cur) + 1
        too_big = n * heads * L > tile or n * L > group_tokens
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


def _gather_group(call: _Call, reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent rows of single-token requests ``reqs`` in one gather, padded to the
    longest: kv [G, Lmax, D] in the compute dtype (a copy; rows past each request's length
    zeroed, since never-written cache memory may hold NaN/Inf, e.g. fp8 0x7F, and 0 * NaN would
    poison P·V) and pad [G, Lmax] bool."""
    kv_cache, part = call.kv_cache, call.part
    dev, dtype = kv_cache.device, call.q.dtype
    ps, D = kv_cache.shape[1], kv_cache.shape[2]
    lens_list = [part.kv_lens[i] for i in reqs]
    lens = torch.tensor(lens_list, device=dev)
    npg = -(-max(lens_list) // ps)
    table = part.block_table.index_select(0, torch.tensor(reqs, device=dev))[:, :npg]
    valid = torch.arange(npg, device=dev)[None, :] * ps < lens[:, None]
    table = torch.where(valid, table, table[:, :1])  # padding columns may hold anything
    flat = kv_cache.view(kv_cache.shape[0], ps * D)
    kv = flat.index_select(0, table.reshape(-1)).view(len(reqs), npg * ps, D)
    if call.layout.tile_scaled:
        kv = call.layout.decode(kv.view(-1, D), dtype, None).view(len(reqs), npg * ps, -1)
    elif kv.dtype != dtype:
        kv = kv.to(dtype)
    for g, L in enumerate(lens_list):
        kv[g, L:].zero_()
    pad = torch.arange(npg * ps, device=dev)[None, :] >= lens[:, None]
    return kv, pad


def _decode_group(call: _Call, reqs: list[int]) -> None:
    """Single-token requests ``reqs`` in one batched pass: one gather, then bmm / masked
    softmax / bmm for all of them at once (the GEMM path for many heads).

    Scores come from an fp32 GEMM on the upcast tiles (CPU torch has no bf16-in / fp32-out
    matmul: a bf16 GEMM would round every score to bf16 before the softmax); the normalized
    probabilities are rounded to the compute dtype and P·V accumulates in fp32 inside the
    GEMM, with one rounding of the output."""
    q, kv_scale = call.q, call.kv_scale
    r = call.o_lat.shape[-1]
    kv, pad = _gather_group(call, reqs)
    rows = torch.tensor([call.part.cu_new[i] for i in reqs], device=q.device)
    qg = q.index_select(0, rows)  # [G, H, D]
    scores = torch.bmm(kv.float(), qg.float().transpose(1, 2)).mul_(call.score_scale)
    scores.masked_fill_(pad[:, :, None], float("-inf"))  # [G, Lmax, H]
    m = scores.amax(dim=1, keepdim=True)  # [G, 1, H]
    p = torch.exp_(scores.sub_(m))
    l = p.sum(dim=1, keepdim=True)
    p_n = p.div_(l).to(q.dtype)
    o = torch.bmm(p_n.transpose(1, 2), kv[:, :, :r])  # [G, H, r]
    if kv_scale is not None:
        o = (o.float() * kv_scale.float()).to(q.dtype)
    call.o_lat[rows] = o
    call.lse[rows] = (m + torch.log(l)).squeeze(1)


def _decode_group_flash(call: _Call, reqs: list[int]) -> None:
    """Single-token requests ``reqs`` in one fused CPU flash call (the few-heads path): one
    gather, the requests as the batch dimension, padding masked out."""
    q = call.q
    r = call.o_lat.shape[-1]
    kv, pad = _gather_group(call, reqs)
    if call.kv_scale is not None:
        kv.mul_(call.kv_scale.to(kv.dtype))
    rows = torch.tensor([call.part.cu_new[i] for i in reqs], device=q.device)
    G, Lmax, D = kv.shape
    qg = q.index_select(0, rows).unsqueeze(1)  # [G, 1, H, D]
    mask = torch.zeros(G, 1, 1, Lmax, dtype=q.dtype, device=q.device)
    mask.masked_fill_(pad[:, None, None, :], float("-inf"))
    o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, kv.unsqueeze(1), kv.unsqueeze(1), 0.0, False, attn_mask=mask,
        scale=call.softmax_scale,
    )[:2]
    call.o_lat[rows] = o[:, 0, :, :r]
    call.lse[rows] = l[:, 0]


def _flash_decode(
    call: _Call, i: int, gather_buf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode request ``i`` through the fused CPU flash kernel.

    The flash kernel parallelizes over batch x heads x query blocks; one decode token is a
    single query block, so the KV is cut into equal parts laid out as the batch dimension
    (a view of the gathered rows, no copy) to keep every thread busy, and the parts are
    merged through their LSE (flash-decoding). A context served in one part runs in the
    compute dtype (fp32 scores inside the kernel, one rounding of the output); one cut
    into parts runs in fp32, so no partial output is rounded before the merge.
    Returns (o [1, H, D] fp32, lse [1, H])."""
    tuning, scale = call.tuning, call.softmax_scale
    t0 = call.part.cu_new[i]
    q = call.q[t0 : t0 + 1]  # [1, H, D]: the token's [q_lat ; q_pe] rows
    H, D = q.shape[1], q.shape[2]
    L = call.part.kv_lens[i]
    parts_max = 2 * torch.get_num_threads()
    one_part = L < 2 * tuning.min_split_tokens or parts_max == 1
    cd = q.dtype if one_part else torch.float32
    qf = q.view(1, 1, H, D).to(cd)
    o = lse = None
    for s in range(0, L, tuning.flash_split_tokens):
        e = min(L, s + tuning.flash_split_tokens)
        rows = latent_rows(call.kv_cache, call.part, i, s, e, out=gather_buf)
        kv = call.layout.decode(rows, cd, call.kv_scale)
        c = e - s
        n_parts = max(1, min(parts_max, c // tuning.min_split_tokens))
        size = c // n_parts
        main = n_parts * size
        o_p, lse_p = _flash(
            qf.expand(n_parts, 1, H, D), kv[:main].view(n_parts, 1, size, D), scale
        )
        if n_parts > 1:
            lse_c = torch.logsumexp(lse_p, dim=0, keepdim=True)  # [1, H]
            o_c = (o_p * torch.exp(lse_p - lse_c).unsqueeze(-1)).sum(0, keepdim=True)
        else:
            o_c, lse_c = o_p, lse_p
        if main < c:
            o_r, lse_r = _flash(qf, kv[main:].view(1, 1, c - main, D), scale)
            o_c, lse_c = merge_attention_states(o_c, lse_c, o_r, lse_r)
        if o is None:
            o, lse = o_c, lse_c
        else:
            o, lse = merge_attention_states(o, lse, o_c, lse_c)
    return o, lse


@dataclass(frozen=True)
class _Workspace:
    """Buffers one extend call reuses for every block and split (large fresh allocations cost
    page faults on every call on CPU): ``gather`` for cache rows as stored, ``conv`` for them in
    fp32, ``scores`` for one score tile; ``split`` KV tokens per split."""

    gather: torch.Tensor
    conv: torch.Tensor
    scores: torch.Tensor
    split: int


def _extends(call: _Call, reqs: list[int]) -> None:
    """Requests ``reqs`` one by one, in blocks of new tokens (bounded rows per score tile);
    a block only reads the KV its last token can see, so causal work past it is skipped."""
    q, part, kv_cache, tuning = call.q, call.part, call.kv_cache, call.tuning
    dev = q.device
    H, D = q.shape[1], q.shape[2]
    r = call.o_lat.shape[-1]
    ps, W = kv_cache.shape[1], kv_cache.shape[-1]
    kv_lens = part.kv_lens
    qb = max(1, tuning.max_query_rows // H)
    max_rows = min(max(part.new_lens[i] for i in reqs), qb) * H
    split = tuning.split_tokens(max_rows, max(kv_lens[i] for i in reqs))
    split_pages = -(-split // ps) + 1
    ws = _Workspace(
        gather=torch.empty(split_pages * ps * W, dtype=kv_cache.dtype, device=dev),
        conv=torch.empty(split_pages * ps, D, dtype=torch.float32, device=dev),
        scores=torch.empty(max_rows * split, dtype=torch.float32, device=dev),
        split=split,
    )
    for i in sorted(reqs):
        P, n, t0 = part.prefix_lens[i], part.new_lens[i], part.cu_new[i]
        for j0 in range(0, n, qb):
            j1 = min(n, j0 + qb)
            rows = (j1 - j0) * H
            qi = q[t0 + j0 : t0 + j1].reshape(rows, D).float()
            out, lse_b = _attend_block(call, qi, i, P + j0, P + j1, ws)
            if call.kv_scale is not None:
                out.mul_(call.kv_scale.float())
            call.o_lat[t0 + j0 : t0 + j1] = out.view(j1 - j0, H, r)
            call.lse[t0 + j0 : t0 + j1] = lse_b.view(j1 - j0, H)


def _attend_block(
    call: _Call, qi: torch.Tensor, i: int, first_limit: int, kv_end: int, ws: _Workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive new tokens of request ``i`` (token k of the block sees kv positions
    ``<= first_limit + k``) against kv rows ``[0, kv_end)``, split along the KV and merged
    online.

    Each KV tile is upcast to fp32 once and serves both GEMMs: the scores are exact fp32
    dot products of the stored values; the probabilities are rounded to the compute dtype
    before P·V, which accumulates in fp32, as a plain bf16 attention does.

    qi: [nb * H, D] fp32 query rows (token-major). Returns (o [nb*H, r] fp32,
    lse [nb*H, 1])."""
    rows, D = qi.shape
    nb = kv_end - first_limit
    H = rows // nb
    dev, cd = qi.device, call.q.dtype
    r = call.o_lat.shape[-1]
    acc = m_acc = l_acc = None
    for s in range(0, kv_end, ws.split):
        e = min(kv_end, s + ws.split)
        c = e - s
        rows_c = latent_rows(call.kv_cache, call.part, i, s, e, out=ws.gather)
        if call.layout.tile_scaled:
            kv = ws.conv[:c].copy_(call.layout.decode(rows_c, torch.float32, None))
        else:
            kv = ws.conv[:c].copy_(rows_c)
        # scores transposed ([c, rows] = kv · q^T) runs faster than q · kv^T
        scores = torch.mm(kv, qi.t(), out=ws.scores[: rows * c].view(c, rows))
        scores.mul_(call.score_scale)
        if e - 1 > first_limit:  # causal among the new tokens
            pos = torch.arange(s, e, device=dev)
            limit = first_limit + torch.arange(nb, device=dev)
            mask = pos[:, None] > limit[None, :]  # [c, nb]
            scores.view(c, nb, H).masked_fill_(mask[:, :, None], float("-inf"))
        # a column may see no key of this split: clamp keeps exp() at 0 instead of NaN
        m = scores.amax(dim=0, keepdim=True).clamp_(min=-1e30)  # [1, rows]
        p = torch.exp_(scores.sub_(m))
        l = p.sum(dim=0, keepdim=True)
        p = p.to(cd).float()  # probabilities in the compute dtype
        o = torch.mm(p.t(), kv[:, :r])  # [rows, r]
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


def _flash(q: torch.Tensor, kv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU flash attention of q [B, 1, M, D] against kv [B, 1, c, D] (K = V = kv).
    Returns (o [B, M, D] fp32, lse [B, M])."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, kv, kv, 0.0, False, scale=scale
    )[:2]
    return o[:, 0].float(), lse[:, 0]
