"""The lightning indexer over query rows that each carry their own key count and block-table
row: the contract of engines' paged indexer ops (vLLM's ``fp8_paged_mqa_logits`` and
``topk_transform``, where a prefill token and a decode request alike are one row ``b`` seeing
keys ``0 .. key_lens[b] - 1`` through ``page_table[b]``). DeepSeek-V4's CSA indexer calls it
over its compressed keys (``key_lens`` = ``(pos + 1) // 4``).

The rows are planned as requests, so the logits come from the plan's kernels
(:func:`mla_backend.indexer_logits`: native at every ISA level, Triton, torch) and the top-k
follows the core's rule (:mod:`mla_backend.sparse`): larger logit first, a tie to the lower
key, a NaN below every number; the ``min(topk, key_lens[b])`` best in ascending key order,
then -1. A prefill's rows (consecutive rows of one block-table row whose key counts grow as
``(p + 1) // m`` over consecutive positions ``p``: vLLM's prefill chunk, one row per token) are
one request of as many query tokens at compress ratio ``m``, so its kernels read each key once
per block of tokens (a GEMM) rather than once per token; any other row is a request of one
token whose context is its keys.
"""

from __future__ import annotations

import torch

from .batch import MLABatch, Phase
from .index_cache import IndexCacheLayout, IndexerDims
from .ops import KernelImpl
from .ops.torch.indexer import topk_positions
from .plan import plan
from .policy import Policy
from .sparse import indexer_logits
from .v4_layer import v4_dims

__all__ = ["group_rows", "indexer_logits_rows", "topk_rows"]


def _key_lens(key_lens: torch.Tensor, B: int) -> list[int]:
    if key_lens.dim() != 1 or key_lens.shape[0] != B or key_lens.dtype not in (
        torch.int32, torch.int64
    ):  # fmt: skip
        raise ValueError(
            f"key_lens {key_lens.dtype} {tuple(key_lens.shape)} is not supported: [B={B}] "
            "int32 / int64"
        )
    lens = key_lens.tolist()  # the one host read: the plan's lengths
    bad = [v for v in lens if v < 0]
    if bad:
        raise ValueError(f"key_lens holds negative lengths {bad[:4]}")
    return lens


def _first_position(lens: list[int], m: int) -> int | None:
    """The position p0 such that the row j of ``lens`` sees ``(p0 + j + 1) // m`` keys, every
    row a key or more (None where no p0 does)."""
    l0 = lens[0]
    up = next((j for j, n in enumerate(lens) if n != l0), None)  # the first row seeing more
    p0 = m * l0 - 1 if up is None else m * (l0 + 1) - up - 1
    if p0 < 0 or any((p0 + j + 1) // m != n for j, n in enumerate(lens)):
        return None
    return p0


def group_rows(
    lens: list[int], table: torch.Tensor, page: int
) -> tuple[int, list[tuple[int, int, int]]]:
    """The requests the rows are planned as: ``(ratio, [(j0, j1, p0), ...])``, rows ``j0 ..
    j1 - 1`` one request at compress ratio ``ratio`` whose tokens sit at positions ``p0 ..``
    (row j0 + j sees ``(p0 + j + 1) // ratio`` keys, ``lens[j0 + j]``).

    Runs are consecutive rows (each seeing a key or more) of one ``table`` row (CPU [rows,
    max_pages]) whose key counts grow by at most one a row. The ratio is the one the runs
    show (the rows between two increments; else the longest run's length, which fits every
    run with one increment or none). A request's tokens stay on the pages its keys use (a
    page of ``page`` keys is ``page x ratio`` tokens; a table's further entries may be stale),
    so the last rows of a run whose positions pass them, and every row of a run that does not
    fit the ratio, are one-row requests (p0 = ratio x its keys - 1: any ratio fits one row)."""
    n = len(lens)
    same = (table[1:] == table[:-1]).all(dim=1).tolist() if n > 1 else []
    runs, j0 = [], 0
    for j in range(1, n + 1):
        if j == n or not same[j - 1] or not 0 <= lens[j] - lens[j - 1] <= 1:
            runs.append((j0, j))
            j0 = j
    ratio = None
    for a, b in runs:
        ups = [j for j in range(a + 1, b) if lens[j] != lens[j - 1]]
        if len(ups) >= 2:
            ratio = ups[1] - ups[0]
            break
    if ratio is None:
        ratio = max(b - a for a, b in runs)

    def on_key_pages(tokens: int, keys: int) -> bool:
        return -(-tokens // (page * ratio)) <= -(-keys // page)

    reqs = []
    for a, b in runs:
        p0 = _first_position(lens[a:b], ratio) if b - a > 1 else None
        end = a
        if p0 is not None:
            end = b
            while end - a > 1 and not on_key_pages(p0 + end - a, lens[end - 1]):
                end -= 1
            if end - a > 1:
                reqs.append((a, end, p0))
            else:
                end = a
        reqs += [(j, j + 1, ratio * lens[j] - 1) for j in range(end, b)]
    return ratio, reqs


def indexer_logits_rows(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    key_lens: torch.Tensor,
    page_table: torch.Tensor,
    layout: IndexCacheLayout,
    width: int,
    impl: str | KernelImpl | None = None,
) -> torch.Tensor:
    """``I[b, t] = sum_h weights[b, h] * relu(q_I[b, h] . k_I[t])`` for each row's keys.

    Args:
        q_I: [B, Hi, Di] bf16 / fp16 / fp32 / float8_e4m3fn (e4m3: its scale folded into
            ``weights``).
        weights: [B, Hi] float32.
        index_cache: [pages, page_size, W] the paged index cache in ``layout`` (each page
            contiguous, any page stride: a view into an engine's pooled allocation).
        key_lens: [B] int32 / int64 keys row b sees (0 allowed; read on the host once).
        page_table: [>= B, max_pages] int32 / int64, row b's pages.
        layout: the cache's layout (:class:`~mla_backend.index_cache.IndexCacheLayout`).
        width: columns of the result (>= every ``key_lens[b]``).
        impl: kernel implementation override (default: the device's).
    Returns:
        float32 [B, width]: the logits at ``t < key_lens[b]``, -inf elsewhere.
    """
    if q_I.dim() != 3:
        raise ValueError(f"q_I {tuple(q_I.shape)} is not supported: [B, Hi, Di]")
    B, Hi, Di = q_I.shape
    lens = _key_lens(key_lens, B)
    if isinstance(width, bool) or not isinstance(width, int) or width < max(lens, default=0):
        raise ValueError(f"width={width!r} is below the longest row ({max(lens, default=0)} keys)")
    out = torch.full((B, width), float("-inf"), dtype=torch.float32, device=q_I.device)
    rows = [b for b, n in enumerate(lens) if n > 0]
    if not rows:
        return out
    sel = torch.tensor(rows, device=q_I.device)
    rows_table = page_table.index_select(0, sel.to(page_table.device))
    host = rows_table if rows_table.device.type == "cpu" else rows_table.cpu()
    page = index_cache.shape[1]
    ratio, reqs = group_rows([lens[b] for b in rows], host, page)
    firsts = torch.tensor([j0 for j0, _, _ in reqs])
    table = rows_table.index_select(0, firsts.to(rows_table.device))
    table_host = None if table.device.type == "cpu" else host.index_select(0, firsts)
    phase = Phase.DECODE if len(reqs) == len(rows) else Phase.EXTEND
    batch = MLABatch.build([p0 for _, _, p0 in reqs], [j1 - j0 for j0, j1, _ in reqs], table,
                           page * ratio, phase, block_table_host=table_host)  # fmt: skip
    step = plan(batch, v4_dims(1), Policy("absorb"), device=q_I.device, impl=impl,
                indexer=IndexerDims(Hi, Di, 1, ratio))  # fmt: skip
    lg = indexer_logits(q_I.index_select(0, sel), weights.index_select(0, sel), index_cache,
                        step, layout)  # fmt: skip
    out[sel, : lg.shape[1]] = lg
    return out


def topk_rows(
    scores: torch.Tensor, key_lens: torch.Tensor, topk: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The top-k rule (module docstring) over scores [B, S] float32 for rows seeing keys
    ``0 .. min(key_lens[b], S) - 1`` (columns past them are never read).

    Returns:
        out [B, topk] int32 (``out`` when given): selected keys ascending, then -1.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r} is not supported: it must be an int >= 1")
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores {scores.dtype} {tuple(scores.shape)}: expected [B, S] float32")
    B, S = scores.shape
    if key_lens.dim() != 1 or key_lens.shape[0] != B:
        raise ValueError(f"key_lens {tuple(key_lens.shape)}: expected [B={B}]")
    if out is None:
        out = torch.empty((B, topk), dtype=torch.int32, device=scores.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (B, topk):
        raise ValueError(f"out {out.dtype} {tuple(out.shape)}: expected [B={B}, {topk}] int32")
    last = key_lens.long().clamp(max=S) - 1
    return topk_positions(scores, last, topk, out)
