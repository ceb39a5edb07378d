"""The Triton kernel's plan-time split schedule (:mod:`mla_backend.ops.triton.schedule`), on
host ints: every kv tile of every query block is computed by exactly one piece, in order; the
split ids and counts are consistent; pieces are balanced; sizes depend only on the number of
query blocks and pieces (so a refreshed plan can rewrite them in place)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_backend.ops.triton.schedule import build_schedule, max_partial_slots, query_block_tiles


def _pieces(meta: list[list[int]], tiles: list[int], block_n: int):
    """Expand part_meta into (piece, w, first row, end row) per query block it touches."""
    W = len(tiles)
    for k, (w0, n0, w1, n1, _) in enumerate(meta):
        assert 0 <= w0 <= W and -1 <= w1 < W
        for w in range(w0, w1 + 1):
            a = n0 if w == w0 else 0
            b = n1 if w == w1 else tiles[w] * block_n
            yield k, w, a, b


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    tiles=st.lists(st.integers(1, 40), min_size=0, max_size=12),
    num_parts=st.integers(1, 20),
    overhead=st.integers(0, 6),
    min_units=st.integers(1, 30),
    block_n=st.sampled_from([1, 16, 64]),
)
def test_schedule_covers_every_tile_once(tiles, num_parts, overhead, min_units, block_n) -> None:
    meta, base = build_schedule(tiles, num_parts, overhead, min_units, block_n)
    W = len(tiles)
    assert len(meta) == num_parts and len(base) == W + 1 and base[0] == 0
    covered = {w: [] for w in range(W)}
    split_ids = {w: [] for w in range(W)}
    for k, w, a, b in _pieces(meta, tiles, block_n):
        assert a < b, f"piece {k} has an empty share of block {w}"
        covered[w].append((a, b))
        first = meta[k][0]
        # the piece's first block starts at its recorded split id; later blocks at their base
        split_ids[w].append(meta[k][4] if w == first else base[w])
    for w in range(W):
        spans = covered[w]
        assert spans[0][0] == 0 and spans[-1][1] == tiles[w] * block_n
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
        n = base[w + 1] - base[w]
        if len(spans) == 1:  # served whole: no partial slot
            assert n == 0
        else:
            assert n == len(spans)
            assert split_ids[w] == list(range(base[w], base[w + 1]))
    assert base[-1] <= max_partial_slots(num_parts)
    # balance: no piece carries more than its share (rounded up) plus one block's overhead
    total = sum(t + overhead for t in tiles)
    per = max(-(-total // num_parts), min_units, 1)
    load = [0] * num_parts
    for k, _, a, b in _pieces(meta, tiles, block_n):
        load[k] += (b - a) // block_n
    assert max(load, default=0) <= per


def test_long_requests_get_more_splits() -> None:
    tiles = query_block_tiles([1, 1, 1], [64 * 64, 64, 64 * 8], 1, 64)
    assert tiles == [64, 1, 8]
    meta, base = build_schedule(tiles, 8, overhead=4, min_units=4, block_n=64)
    splits = [b - a for a, b in zip(base, base[1:], strict=False)]
    assert splits[0] > max(splits[1], splits[2]) and splits[1] == 0  # the short one is whole


def test_query_block_tiles_are_causal() -> None:
    # prefix 10, 5 new tokens in blocks of 2: the blocks see 12, 14, 15 rows
    assert query_block_tiles([5], [15], 2, 4) == [3, 4, 4]
    assert query_block_tiles([0, 3], [0, 3], 4, 16) == [1]


def test_schedule_rejects_no_parts() -> None:
    with pytest.raises(ValueError, match="num_parts=0"):
        build_schedule([3], 0, 1)
