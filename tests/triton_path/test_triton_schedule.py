"""The Triton kernel's plan-time split schedule (:mod:`mla_backend.ops.triton.schedule`), on
host ints: every kv tile of every query block is computed by exactly one piece, in order; the
split ids and counts are consistent; pieces are balanced (within the budget rounded up by an
eighth); sizes depend only on the number of query blocks and pieces (so a refreshed plan can
rewrite them in place); a batch of requests that fit the rounded-up budget is not split (128
decodes of 4K / 8K kv on an H100's / H200's 132 SMs, one program per SM), while a long request
among few still is."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.ops.triton.jit import heuristics as hx
from mla_backend.ops.triton.schedule import build_schedule, max_partial_slots, query_block_tiles

SMS = 132  # H100 SXM / H200
OVERHEAD, MIN_UNITS = hx.OVERHEAD_KV_ROWS // 64, hx.MIN_KV_ROWS_PER_PART // 64  # 64-row tiles


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
    # balance: no piece carries more than its share, rounded up by an eighth (a block kept
    # whole); a block longer than that is cut into pieces of at most the share
    total = sum(t + overhead for t in tiles)
    per = max(-(-total // num_parts), min_units, 1)
    load = [0] * num_parts
    for k, w, a, b in _pieces(meta, tiles, block_n):
        load[k] += (b - a) // block_n
        if tiles[w] + overhead > per + per // 8:
            assert (b - a) // block_n <= per
    assert max(load, default=0) <= per + per // 8


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


def _splits(base: list[int]) -> list[int]:
    return [b - a for a, b in zip(base, base[1:], strict=False)]


@pytest.mark.parametrize("kv,q_len", [(4096, 1), (8192, 1), (4096, 2), (4000, 1)])
def test_a_batch_that_fits_the_budget_is_not_split(kv, q_len) -> None:
    """128 requests on 132 pieces (one program per SM): each fits the rounded-up budget, so
    none is split (no partials, no merge) and each piece serves at most one request."""
    tiles = query_block_tiles([q_len] * 128, [kv] * 128, q_len, 64)
    meta, base = build_schedule(tiles, SMS, OVERHEAD, MIN_UNITS, 64)
    assert base[-1] == 0
    pieces = [(w0, w1) for w0, _, w1, _, _ in meta if w0 <= w1]
    assert len(pieces) == 128 and all(w0 == w1 for w0, w1 in pieces)
    assert all(n0 == 0 and n1 == tiles[w0] * 64 for w0, n0, w1, n1, _ in meta if w0 <= w1)


@pytest.mark.parametrize("long,short", [([65536], []), ([65536] * 2, [512] * 64),
                                        ([32768] * 4, [2048] * 60)])
def test_long_context_is_still_split(long, short) -> None:
    """Long requests among few or short ones on 132 pieces: each long one is cut into many
    pieces of at most the per-piece share; the short ones (under the budget) stay whole."""
    kv = long + short
    tiles = query_block_tiles([1] * len(kv), kv, 1, 64)
    meta, base = build_schedule(tiles, SMS, OVERHEAD, MIN_UNITS, 64)
    splits = _splits(base)
    per = -(-sum(t + OVERHEAD for t in tiles) // SMS)
    assert all(n >= (tiles[0] + OVERHEAD) // per for n in splits[: len(long)])
    assert not any(splits[len(long):])


@pytest.mark.parametrize(
    "heads,knobs", [(128, {}), (16, {"pad_rows": True}), (32, {"pad_rows": True})]
)
def test_plan_of_128_decodes_on_132_sms_splits_nothing(monkeypatch, heads, knobs) -> None:
    """Through the Triton implementation's plan (one program per SM: 64-row tiles, 8 warps):
    128 decodes of 4K kv on 132 SMs have a schedule with no split block."""
    from mla_backend.ops.triton import Kernels

    monkeypatch.setattr(hx, "sm_count", lambda device: SMS)
    kv, page = 4096, 64
    table = torch.arange(128 * kv // page, dtype=torch.int32).view(128, kv // page)
    batch = mb.MLABatch.build([kv - 1] * 128, [1] * 128, table, page, mb.Phase.DECODE,
                              block_table_host=table)
    plan = mb.plan(batch, mb.MLADims(heads, 512, 128, 64, 512), mb.Policy("absorb"),
                   device=torch.device("cpu"), impl=Kernels(**knobs))
    state = plan.step.work.state
    assert int(state.split_base[-1]) == 0
    assert state.part_meta.shape[0] * -(-heads // 64) >= SMS  # one wave of programs per SM
