"""The Triton absorbed kernel's plan-time split schedule (FlashMLA's scheduler-metadata idea,
built on the host from the plan's ints, so a per-layer call reads nothing back).

Work: every query block ``w`` (``block_q`` new tokens of one request, all heads) must attend to
``kv_need[w] = min(prefix + q0 + block_q, kv_len)`` kv rows, i.e. ``tiles[w] =
ceil(kv_need[w] / block_n)`` kv tiles. Each query block also costs a fixed ``overhead`` (load
Q, write a partial, merge it) counted in tiles, so it costs ``tiles[w] + overhead`` units.
Piece ``k`` is what the ``k``-th program of the grid's first axis computes: a run of
consecutive query blocks, the first and last possibly partial. A query block cut by a piece
boundary is split: each piece writes an fp32 partial and its LSE, and the merge kernel
combines them. A block served whole by one piece writes its final output directly.

The cut (FlashInfer's plan rule, in our units): each piece's budget is ``per = ceil(total /
num_parts)`` units; a query block that fits the budget rounded up (``per + per //``
:data:`KEEP_SLACK`) is never split: it goes whole into the current piece if it fits what that
piece has left of the rounded budget, else it starts the next piece. Longer blocks are cut
into ``per``-unit pieces (the first filling what the current piece has left). So a batch of
about ``num_parts`` equal requests (128 decodes of 4K kv on 132 one-program-per-SM pieces)
splits none and needs no merge, while a long request among few is still cut into many pieces.
Where keeping blocks whole would need more than ``num_parts`` pieces, the line is cut into
``num_parts`` equal pieces instead (the blocks' costs laid end to end), which always fits.
Long requests therefore get more splits than short ones, and every program about the same
number of kv tiles.

Sizes are fixed by (number of query blocks ``W``, ``num_parts``), not by the kv lengths, so
:meth:`mla_backend.MLAPlan.refresh_` can rewrite the schedule in place for a CUDA graph:

- ``part_meta`` [num_parts, 5] int32: per program, (first query block, its first kv row, last
  query block, the end kv row (exclusive) in that last block, global split id of its first
  piece). Rows are tiles times ``block_n`` (any kernel tile can walk them: the kernel clips
  to the block's kv rows). A program with nothing to do has first = W, last = W - 1.
- ``split_base`` [W + 1] int32: a split query block ``w``'s pieces write partial slots
  ``split_base[w] .. split_base[w + 1] - 1`` (two or more); a block served whole by one piece
  has none (``split_base[w + 1] == split_base[w]``) and writes its output directly.

Each of the ``num_parts - 1`` piece boundaries cuts at most one block, so at most
``num_parts - 1`` blocks are split, into at most ``2 * (num_parts - 1)`` pieces: the partial
buffers are bounded by :func:`max_partial_slots`, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...parts import PlanState


@dataclass(frozen=True)
class TritonSchedule(PlanState):
    """The Triton kernel's per-plan state of one part: ``part_meta`` [num_parts, 5] and
    ``split_base`` [W + 1] int32 on the plan's device (see the module doc)."""

    part_meta: torch.Tensor
    split_base: torch.Tensor

    def copy_(self, other: PlanState) -> None:
        if not isinstance(other, TritonSchedule):
            raise TypeError(f"cannot refresh a TritonSchedule from {type(other).__name__}")
        self.part_meta.copy_(other.part_meta)
        self.split_base.copy_(other.split_base)


def query_block_tiles(
    new_lens: Sequence[int], kv_lens: Sequence[int], block_q: int, block_n: int
) -> list[int]:
    """kv tiles each query block needs (request order, then token order): ceil(kv_need / block_n)
    with ``kv_need = min(prefix + q0 + block_q, kv_len)`` (causal: the block's last token)."""
    tiles = []
    for n, kv in zip(new_lens, kv_lens, strict=True):
        prefix = kv - n
        for q0 in range(0, n, block_q):
            need = min(prefix + q0 + block_q, kv)
            tiles.append(-(-need // block_n))
    return tiles


def max_partial_slots(num_parts: int) -> int:
    """Partial-output slots a schedule of ``num_parts`` pieces can use (see the module doc)."""
    return 2 * (num_parts - 1)


#: a query block of at most ``per + per // KEEP_SLACK`` units (the per-piece budget rounded up
#: by an eighth) is kept whole: an eighth more work in one piece costs less than its split's
#: partial writes and merge
KEEP_SLACK = 8


def piece_budget(total: int, num_parts: int, min_units: int = 1) -> tuple[int, int]:
    """(``per``, ``keep``): the units a piece is cut to and the rounded-up budget under which
    a query block is kept whole, for ``total`` units over ``num_parts`` pieces."""
    per = max(-(-total // num_parts), min_units, 1)
    return per, per + per // KEEP_SLACK


#: one piece's shares: (query block, first unit, end unit) on the block's own unit line
_Shares = list[list[tuple[int, int, int]]]


def _keep_whole(units: Sequence[int], num_parts: int, per: int, keep: int) -> _Shares | None:
    """The pieces' shares with every block of at most ``keep`` units whole (see the module
    doc), or None where that needs more than ``num_parts`` pieces."""
    shares: _Shares = [[] for _ in range(num_parts)]
    k = used = 0
    for w, u in enumerate(units):
        if u <= keep and used and used + u > keep:
            k, used = k + 1, 0  # does not fit what is left: starts the next piece
        a = 0
        while True:
            if k >= num_parts:
                return None
            b = u if u <= keep else min(u, a + per - used)
            shares[k].append((w, a, b))
            used += b - a
            a = b
            if used >= per:
                k, used = k + 1, 0
            if a >= u:
                break
    return shares


def _line_cut(units: Sequence[int], num_parts: int, per: int) -> _Shares:
    """The blocks' units laid end to end, cut every ``per`` units (the last piece takes what
    rounding left over)."""
    shares: _Shares = [[] for _ in range(num_parts)]
    start = 0  # first unit of block w on the line
    for w, u in enumerate(units):
        k = start // per
        while k < num_parts and k * per < start + u:
            a = max(k * per, start) - start  # piece k's share of block w, in units
            b = u if k == num_parts - 1 else min((k + 1) * per, start + u) - start
            shares[k].append((w, a, b))
            k += 1
        start += u
    return shares


def build_schedule(
    tiles: Sequence[int], num_parts: int, overhead: int, min_units: int = 1, block_n: int = 1
) -> tuple[list[list[int]], list[int]]:
    """Cut the query blocks' tiles into ``num_parts`` pieces (see the module doc: blocks that
    fit the rounded-up budget whole, longer ones cut into equal pieces).

    Args:
        tiles: kv tiles per query block (each >= 1).
        num_parts: programs along the grid's split axis (>= 1).
        overhead: fixed cost of a query block, in tiles (>= 0).
        min_units: smallest cost a piece is given (fewer, longer pieces for small batches).
        block_n: kv rows per tile (part_meta holds rows: tiles times this).
    Returns:
        (part_meta rows [num_parts][5], split_base [W + 1]) as Python ints (see module doc).
    """
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    W = len(tiles)
    units = [t + overhead for t in tiles]
    per, keep = piece_budget(sum(units), num_parts, min_units)
    shares = _keep_whole(units, num_parts, per, keep) or _line_cut(units, num_parts, per)
    # segments[k]: (w, tile_begin, tile_end) of piece k, non-empty only; a block's overhead
    # is its first units
    segments = [
        [(w, max(a - overhead, 0), max(b - overhead, 0)) for w, a, b in piece
         if max(b - overhead, 0) > max(a - overhead, 0)]
        for piece in shares
    ]
    counts = [0] * W
    first_split = []
    for segs in segments:
        first_split.append(counts[segs[0][0]] if segs else 0)
        for w, _, _ in segs:
            counts[w] += 1
    split_base = [0]  # partial slots go to split blocks only: a whole block takes none
    for c in counts:
        split_base.append(split_base[-1] + (c if c > 1 else 0))
    meta = []
    for segs, fs in zip(segments, first_split, strict=True):
        if not segs:
            meta.append([W, 0, W - 1, 0, 0])
            continue
        (w0, t0, _), (w1, _, t1) = segs[0], segs[-1]
        meta.append([w0, t0 * block_n, w1, t1 * block_n, split_base[w0] + fs])
    return meta, split_base


def schedule_tensors(
    tiles: Sequence[int],
    num_parts: int,
    overhead: int,
    min_units: int,
    block_n: int,
    device: torch.device,
) -> TritonSchedule:
    """The :class:`TritonSchedule` (part_meta [num_parts, 5], split_base [W + 1], int32 on
    ``device``) of :func:`build_schedule`."""
    meta, base = build_schedule(tiles, num_parts, overhead, min_units, block_n)
    return TritonSchedule(
        torch.tensor(meta, dtype=torch.int32, device=device).reshape(num_parts, 5),
        torch.tensor(base, dtype=torch.int32, device=device),
    )
