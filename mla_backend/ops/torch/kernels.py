"""PyTorch implementation of the kernel interface (runs everywhere; the fallback).

Absorbed attention is MQA over the shared latent key: every head of every new token of a
request is one query row against the request's cached rows ``[c_kv ; k_pe]`` (the query row is
``[q_lat ; q_pe]``, so ``q_lat·c_kv + q_pe·k_pe`` comes out of one product over the cache rows as
stored: no per-head or concatenated K copy is ever made), and the value is the first ``r``
columns of the same rows. The KV axis is processed in bounded splits whose partial results are
merged online through their log-sum-exp (flash-decoding), so memory stays bounded at any
context length.

Every call reads its sizes and page ids from the plan's host data (:class:`~mla_backend.plan.
PlanPart`), never from tensors, and the kv scale stays a tensor: no device-to-host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ...cache_layout import CacheLayout
from ...fp8 import FP8_DTYPE, FP8_MAX
from ...merge import merge_attention_states
from ...weights import AbsorbWeights, absorb_q, apply_W_UV

if TYPE_CHECKING:
    from ...dims import MLADims
    from ...plan import PlanPart


class Kernels:
    """The torch implementation of :class:`mla_backend.ops.KernelImpl`.

    Tuning knobs (keyword arguments; the defaults were measured on the project's 2-core CPUs):
        max_tile_elements: bound on one split's fp32 score tile (rows x kv tokens).
        max_group_tokens: bound on the latent rows one decode group gathers (beyond it a
            group's passes stop hitting the caches, and a long context gains nothing from
            batching).
        max_query_rows: query rows (new tokens x heads) of one extend block.
        flash_max_heads: decodes with at most this many heads run torch's fused CPU flash
            kernel (H query rows against the latent rows), which wins where decode is bandwidth-
            and overhead-bound; more heads take the GEMM path.
        flash_split_tokens: KV tokens per flash call of a long decode.
    """

    name = "torch"

    def __init__(
        self,
        *,
        max_tile_elements: int = 1 << 22,
        max_group_tokens: int = 8192,
        max_query_rows: int = 4096,
        flash_max_heads: int = 32,
        flash_split_tokens: int = 16384,
        min_split_tokens: int = 256,
        max_split_tokens: int = 8192,
    ) -> None:
        self.max_tile_elements = max_tile_elements
        self.max_group_tokens = max_group_tokens
        self.max_query_rows = max_query_rows
        self.flash_max_heads = flash_max_heads
        self.flash_split_tokens = flash_split_tokens
        self.min_split_tokens = min_split_tokens
        self.max_split_tokens = max_split_tokens

    def __repr__(self) -> str:
        return f"ops.torch.Kernels({self.__dict__})"

    # -- absorption weights --------------------------------------------------------------
    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        return weights

    def absorb_q(self, q_nope: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        return absorb_q(q_nope, weights)

    def apply_W_UV(self, o_lat: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        return apply_W_UV(o_lat, weights)

    # -- plan time ---------------------------------------------------------------------
    def work_shape(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        device: torch.device,
    ) -> tuple[int, int]:
        """One query block per request, one split (the loops below cut the work themselves)."""
        return max(1, max(new_lens, default=1)), 1

    # -- cache -------------------------------------------------------------------------
    def write_latent(
        self,
        kv_cache: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None,
    ) -> None:
        """Padding slots (< 0) are redirected, without reading the mask on the host, to the
        largest slot of the step with that slot's own row (identical duplicate writes), or,
        when every slot is padding, to the last cache row with its current content."""
        T = c_kv.shape[0]
        if T == 0:
            return
        D = kv_cache.shape[-1]
        flat = kv_cache.view(-1, D)
        slots = slot_mapping[:T].long()
        row = torch.cat([c_kv, k_pe], dim=-1) if k_pe.shape[-1] else c_kv
        if kv_cache.dtype == torch.uint8:  # fp8_ds_mla rows, quantized per token and tile
            layout = CacheLayout.ds_mla(c_kv.shape[-1], k_pe.shape[-1], c_kv.dtype)
            row = layout.pack(c_kv, k_pe)
        elif kv_cache.dtype == FP8_DTYPE:
            if kv_scale is not None:
                row = row.float() / kv_scale.float()
            row = row.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
            flat = flat.view(torch.uint8)
        else:
            row = row.to(kv_cache.dtype)
        n_rows = flat.shape[0]
        valid = slots >= 0
        top = slots.argmax().view(1)
        smax = slots.index_select(0, top)  # [1]; < 0 only if every slot is padding
        target = torch.where(valid, slots, smax) % n_rows  # all padding: the last row
        keep = flat.index_select(0, smax % n_rows)  # that row's current content
        fill = torch.where((smax >= 0)[:, None], row.index_select(0, top), keep)
        src = torch.where(valid[:, None], row, fill)
        flat.index_put_((target,), src)

    def _rows(
        self,
        kv_cache: torch.Tensor,
        part: PlanPart,
        i: int,
        start: int,
        end: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``[start, end)`` of request ``i``'s logical latent sequence, as stored
        ([end - start, D], cache dtype): a view of the cache when the plan's host page ids
        are consecutive, else a copy (into ``out`` when given: a reusable buffer of at least
        ``pages * page_size * D`` elements, which spares a fresh allocation's page faults)."""
        ps, D = kv_cache.shape[1], kv_cache.shape[2]
        p0, p1 = start // ps, (end - 1) // ps + 1
        if part.pages is not None:
            ids = part.pages[i][p0:p1]
            first = ids[0]
            consecutive = ids == tuple(range(first, first + len(ids)))
            if ids[-1] - first == len(ids) - 1 and consecutive:
                rows = kv_cache[first : first + (p1 - p0)].reshape(-1, D)
                return rows[start - p0 * ps : end - p0 * ps]
        pages = part.block_table[i, p0:p1]
        if out is not None:
            dst = out[: (p1 - p0) * ps * D].view(p1 - p0, ps * D)
            torch.index_select(kv_cache.view(kv_cache.shape[0], ps * D), 0, pages, out=dst)
            rows = dst.view(-1, D)
        else:
            rows = kv_cache.index_select(0, pages).view(-1, D)
        return rows[start - p0 * ps : end - p0 * ps]

    def gather_latent(
        self,
        kv_cache: torch.Tensor,
        part: PlanPart,
        i: int,
        start: int,
        end: int,
        dtype: torch.dtype,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        layout = _layout(kv_cache, part, dtype)
        return _dequant(self._rows(kv_cache, part, i, start, end), dtype, kv_scale, layout)

    # -- normal path's decompression ---------------------------------------------------
    def decompress(
        self,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        W_UK: torch.Tensor,
        W_UV: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``torch.mm`` in the weights' dtype (a transient [r, H*v] copy of ``W_UV``)."""
        H, nope, r = W_UK.shape
        v_dim = W_UV.shape[-1]
        L = c_kv.shape[0]
        W_UV_flat = W_UV.transpose(0, 1).reshape(r, H * v_dim)
        k_nope = torch.mm(c_kv, W_UK.reshape(H * nope, r).t()).view(L, H, nope)
        v = torch.mm(c_kv, W_UV_flat).view(L, H, v_dim)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(L, H, k_pe.shape[-1])], dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)

    # -- normal path's attention -------------------------------------------------------
    def attention_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch's fused SDPA (flash on CPU, memory-efficient elsewhere): fp32 accumulation
        of the scores and the softmax."""
        dqk, dv = q.shape[-1], v.shape[-1]
        d = max(dqk, dv)
        if q.device.type != "cpu":  # the GPU kernels take head sizes in multiples of 8
            d = -(-d // 8) * 8
        if dqk < d:  # zero columns do not change q·k
            q, k = F.pad(q, (0, d - dqk)), F.pad(k, (0, d - dqk))
        if dv < d:
            v = F.pad(v, (0, d - dv))
        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if q.device.type == "cpu":
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q4, k4, v4, 0.0, causal, scale=scale
            )[:2]
        else:
            o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q4, k4, v4, None, True, 0.0, causal, scale=scale
            )[:2]
        Lq = q.shape[1]
        return o[0, :, :, :dv], lse[0, :, :Lq].float()

    # -- absorbed path -----------------------------------------------------------------
    def absorbed_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`mla_backend.ops.KernelImpl.absorbed_attention`."""
        T, H, r = q_lat.shape
        rope = q_pe.shape[-1]
        dev, cd = q_lat.device, q_lat.dtype
        layout = _layout(kv_cache, part, cd)
        W = kv_cache.shape[-1]  # row width as stored
        q = torch.cat([q_lat, q_pe.to(cd)], dim=-1) if rope else q_lat  # [T, H, D]
        o_lat = torch.empty(T, H, r, dtype=cd, device=dev)
        lse = torch.empty(T, H, dtype=torch.float32, device=dev)
        if T == 0:
            return o_lat, lse
        score_scale: float | torch.Tensor = softmax_scale
        if kv_scale is not None:
            score_scale = kv_scale.float() * softmax_scale
        ps = kv_cache.shape[1]
        groups, rest = self._decode_groups(part, H)
        if dev.type == "cpu" and H <= self.flash_max_heads:
            for g in groups:
                self._decode_group_flash(
                    q, kv_cache, part, g, softmax_scale, kv_scale, layout, o_lat, lse
                )
            flash_buf = None
            for i in [i for i in rest if part.new_lens[i] == 1]:
                if flash_buf is None:
                    pages = -(-min(self.flash_split_tokens, part.max_kv_len) // ps) + 1
                    flash_buf = torch.empty(pages * ps * W, dtype=kv_cache.dtype, device=dev)
                t0 = part.cu_new[i]
                o, l = self._flash_decode(
                    q[t0 : t0 + 1], kv_cache, part, i, softmax_scale, kv_scale, layout, flash_buf
                )
                o_lat[t0 : t0 + 1] = o[..., :r]
                lse[t0 : t0 + 1] = l
            rest = [i for i in rest if part.new_lens[i] > 1]
        else:
            for g in groups:
                self._decode_group(
                    q, kv_cache, part, g, score_scale, kv_scale, layout, o_lat, lse
                )
        if rest:
            self._extends(q, kv_cache, part, rest, score_scale, kv_scale, layout, o_lat, lse)
        return o_lat, lse

    def _split_tokens(self, rows: int, kv_len: int) -> int:
        """KV tokens per split: as large as the score-tile bound allows, within fixed limits."""
        c = self.max_tile_elements // max(rows, 1)
        return max(self.min_split_tokens, min(self.max_split_tokens, c, kv_len))

    def _decode_groups(self, part: PlanPart, heads: int) -> tuple[list[list[int]], list[int]]:
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
        tile, group_tokens = self.max_tile_elements, self.max_group_tokens
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

    def _gather_group(
        self,
        kv_cache: torch.Tensor,
        part: PlanPart,
        reqs: list[int],
        dtype: torch.dtype,
        layout: CacheLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent rows of single-token requests ``reqs`` in one gather, padded to the
        longest: kv [G, Lmax, D] in ``dtype`` (a copy; rows past each request's length zeroed,
        since never-written cache memory may hold NaN/Inf, e.g. fp8 0x7F, and 0 * NaN would
        poison P·V) and pad [G, Lmax] bool."""
        dev = kv_cache.device
        ps, D = kv_cache.shape[1], kv_cache.shape[2]
        kv_lens = part.kv_lens
        lens_list = [kv_lens[i] for i in reqs]
        lens = torch.tensor(lens_list, device=dev)
        npg = -(-max(lens_list) // ps)
        table = part.block_table.index_select(0, torch.tensor(reqs, device=dev))[:, :npg]
        valid = torch.arange(npg, device=dev)[None, :] * ps < lens[:, None]
        table = torch.where(valid, table, table[:, :1])  # padding columns may hold anything
        flat = kv_cache.view(kv_cache.shape[0], ps * D)
        kv = flat.index_select(0, table.reshape(-1)).view(len(reqs), npg * ps, D)
        if layout.kind == "fp8_ds_mla":
            kv = layout.unpack(kv.view(-1, D), dtype).view(len(reqs), npg * ps, -1)
        elif kv.dtype != dtype:
            kv = kv.to(dtype)
        for g, L in enumerate(lens_list):
            kv[g, L:].zero_()
        pad = torch.arange(npg * ps, device=dev)[None, :] >= lens[:, None]
        return kv, pad

    def _decode_group(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        reqs: list[int],
        score_scale: float | torch.Tensor,
        kv_scale: torch.Tensor | None,
        layout: CacheLayout,
        o_lat: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Single-token requests ``reqs`` in one batched pass: one gather, then bmm / masked
        softmax / bmm for all of them at once (the GEMM path for many heads).

        Scores come from an fp32 GEMM on the upcast tiles (CPU torch has no bf16-in / fp32-out
        matmul: a bf16 GEMM would round every score to bf16 before the softmax); the normalized
        probabilities are rounded to the compute dtype and P·V accumulates in fp32 inside the
        GEMM, with one rounding of the output."""
        r = o_lat.shape[-1]
        kv, pad = self._gather_group(kv_cache, part, reqs, q.dtype, layout)
        rows = torch.tensor([part.cu_new[i] for i in reqs], device=q.device)
        qg = q.index_select(0, rows)  # [G, H, D]
        scores = torch.bmm(kv.float(), qg.float().transpose(1, 2)).mul_(score_scale)
        scores.masked_fill_(pad[:, :, None], float("-inf"))  # [G, Lmax, H]
        m = scores.amax(dim=1, keepdim=True)  # [G, 1, H]
        p = torch.exp_(scores.sub_(m))
        l = p.sum(dim=1, keepdim=True)
        p_n = p.div_(l).to(q.dtype)
        o = torch.bmm(p_n.transpose(1, 2), kv[:, :, :r])  # [G, H, r]
        if kv_scale is not None:
            o = (o.float() * kv_scale.float()).to(q.dtype)
        o_lat[rows] = o
        lse[rows] = (m + torch.log(l)).squeeze(1)

    def _decode_group_flash(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        reqs: list[int],
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
        layout: CacheLayout,
        o_lat: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Single-token requests ``reqs`` in one fused CPU flash call (the few-heads path): one
        gather, the requests as the batch dimension, padding masked out."""
        r = o_lat.shape[-1]
        kv, pad = self._gather_group(kv_cache, part, reqs, q.dtype, layout)
        if kv_scale is not None:
            kv.mul_(kv_scale.to(kv.dtype))
        rows = torch.tensor([part.cu_new[i] for i in reqs], device=q.device)
        G, Lmax, D = kv.shape
        qg = q.index_select(0, rows).unsqueeze(1)  # [G, 1, H, D]
        mask = torch.zeros(G, 1, 1, Lmax, dtype=q.dtype, device=q.device)
        mask.masked_fill_(pad[:, None, None, :], float("-inf"))
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, kv.unsqueeze(1), kv.unsqueeze(1), 0.0, False, attn_mask=mask, scale=softmax_scale
        )[:2]
        o_lat[rows] = o[:, 0, :, :r]
        lse[rows] = l[:, 0]

    def _flash_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        i: int,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
        layout: CacheLayout,
        gather_buf: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode request through the fused CPU flash kernel.

        The flash kernel parallelizes over batch x heads x query blocks; one decode token is a
        single query block, so the KV is cut into equal parts laid out as the batch dimension
        (a view of the gathered rows, no copy) to keep every thread busy, and the parts are
        merged through their LSE (flash-decoding). A context served in one part runs in the
        compute dtype (fp32 scores inside the kernel, one rounding of the output); one cut
        into parts runs in fp32, so no partial output is rounded before the merge.
        q: [1, H, D] (the token's [q_lat ; q_pe] rows). Returns (o [1, H, D] fp32, lse [1, H])."""
        H, D = q.shape[1], q.shape[2]
        L = part.kv_lens[i]
        parts_max = 2 * torch.get_num_threads()
        one_part = L < 2 * self.min_split_tokens or parts_max == 1
        cd = q.dtype if one_part else torch.float32
        qf = q.view(1, 1, H, D).to(cd)
        o = lse = None
        for s in range(0, L, self.flash_split_tokens):
            e = min(L, s + self.flash_split_tokens)
            rows = self._rows(kv_cache, part, i, s, e, out=gather_buf)
            kv = _dequant(rows, cd, kv_scale, layout)
            c = e - s
            n_parts = max(1, min(parts_max, c // self.min_split_tokens))
            size = c // n_parts
            main = n_parts * size
            o_p, lse_p = _flash(
                qf.expand(n_parts, 1, H, D), kv[:main].view(n_parts, 1, size, D), softmax_scale
            )
            if n_parts > 1:
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

    def _extends(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        reqs: list[int],
        score_scale: float | torch.Tensor,
        kv_scale: torch.Tensor | None,
        layout: CacheLayout,
        o_lat: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Requests ``reqs`` one by one, in blocks of new tokens (bounded rows per score tile);
        a block only reads the KV its last token can see, so causal work past it is skipped."""
        dev, cd = q.device, q.dtype
        H, D = q.shape[1], q.shape[2]
        r = o_lat.shape[-1]
        ps = kv_cache.shape[1]
        kv_lens = part.kv_lens
        qb = max(1, self.max_query_rows // H)
        max_rows = min(max(part.new_lens[i] for i in reqs), qb) * H
        split = self._split_tokens(max_rows, max(kv_lens[i] for i in reqs))
        split_pages = -(-split // ps) + 1
        # One workspace, reused by every block and split: large fresh allocations cost page
        # faults on every call on CPU.
        W = kv_cache.shape[-1]
        gather_buf = torch.empty(split_pages * ps * W, dtype=kv_cache.dtype, device=dev)
        conv_buf = torch.empty(split_pages * ps, D, dtype=torch.float32, device=dev)
        f_buf = torch.empty(max_rows * split, dtype=torch.float32, device=dev)
        bufs = (gather_buf, conv_buf, f_buf)
        for i in sorted(reqs):
            P, n, t0 = part.prefix_lens[i], part.new_lens[i], part.cu_new[i]
            for j0 in range(0, n, qb):
                j1 = min(n, j0 + qb)
                rows = (j1 - j0) * H
                qi = q[t0 + j0 : t0 + j1].reshape(rows, D).float()
                out, lse_b = self._attend_block(
                    qi, kv_cache, part, i, P + j0, P + j1, score_scale, r, bufs, split, cd,
                    layout,
                )
                if kv_scale is not None:
                    out.mul_(kv_scale.float())
                o_lat[t0 + j0 : t0 + j1] = out.view(j1 - j0, H, r)
                lse[t0 + j0 : t0 + j1] = lse_b.view(j1 - j0, H)

    def _attend_block(
        self,
        qi: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        i: int,
        first_limit: int,
        kv_end: int,
        score_scale: float | torch.Tensor,
        r: int,
        bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        split: int,
        cd: torch.dtype,
        layout: CacheLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive new tokens of request ``i`` (token k of the block sees kv positions
        ``<= first_limit + k``) against kv rows ``[0, kv_end)``, split along the KV and merged
        online.

        Each KV tile is upcast to fp32 once and serves both GEMMs: the scores are exact fp32
        dot products of the stored values; the probabilities are rounded to the compute dtype
        (``cd``) before P·V, which accumulates in fp32, as a plain bf16 attention does.

        qi: [nb * H, D] fp32 query rows (token-major). Returns (o [nb*H, r] fp32,
        lse [nb*H, 1])."""
        gather_buf, conv_buf, f_buf = bufs
        rows, D = qi.shape
        nb = kv_end - first_limit
        H = rows // nb
        dev = qi.device
        acc = m_acc = l_acc = None
        for s in range(0, kv_end, split):
            e = min(kv_end, s + split)
            c = e - s
            rows_c = self._rows(kv_cache, part, i, s, e, out=gather_buf)
            if layout.kind == "fp8_ds_mla":
                kv = conv_buf[:c].copy_(layout.unpack(rows_c, torch.float32))
            else:
                kv = conv_buf[:c].copy_(rows_c)
            # scores transposed ([c, rows] = kv · q^T) runs faster than q · kv^T
            scores = torch.mm(kv, qi.t(), out=f_buf[: rows * c].view(c, rows)).mul_(score_scale)
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


def _layout(kv_cache: torch.Tensor, part: PlanPart, compute_dtype: torch.dtype) -> CacheLayout:
    d = part.dims
    return CacheLayout.of(kv_cache, d.kv_lora_rank, d.qk_rope_head_dim, compute_dtype)


def _dequant(
    rows: torch.Tensor, dtype: torch.dtype, kv_scale: torch.Tensor | None, layout: CacheLayout
) -> torch.Tensor:
    """Cache rows as stored -> [L, r + rope] in ``dtype``: fp8_ds_mla tiles times their own
    scales, per-tensor fp8 times ``kv_scale`` (a tensor: never read on the host)."""
    if layout.kind == "fp8_ds_mla":
        return layout.unpack(rows, dtype)
    if kv_scale is None:
        return rows if rows.dtype == dtype else rows.to(dtype)
    return (rows.float() * kv_scale.float()).to(dtype)


def _flash(q: torch.Tensor, kv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU flash attention of q [B, 1, M, D] against kv [B, 1, c, D] (K = V = kv).
    Returns (o [B, M, D] fp32, lse [B, M])."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, kv, kv, 0.0, False, scale=scale
    )[:2]
    return o[:, 0].float(), lse[:, 0]
