"""The lightning indexer over rows with their own key counts and block-table rows
(``mla_backend.indexer_rows``: the contract of vLLM's paged indexer ops, DeepSeek-V4's CSA
indexer over compressed keys) against references written here: the logits in float64 from the
keys as the fp8 layout's reader returns them, row by row through shuffled pages of a pooled
(strided) cache, rows seeing no key, e4m3 and bf16 queries, the torch implementation and the
native one at every ISA level the host runs; the top-k by sorting (larger score first, a tie to
the lower key, NaN below every number) with ties, NaN and rows that fit."""

from __future__ import annotations

import math

import pytest
import torch

import mla_backend as mb
from mla_backend.index_cache import IndexCacheLayout
from mla_backend.indexer_rows import group_rows, indexer_logits_rows, topk_rows

LAYOUT = IndexCacheLayout.named("fp8", 128, scale_fmt="ue8m0")


def _pooled_cache(pages: int, page_size: int, g: torch.Generator) -> torch.Tensor:
    """An index cache whose pages sit in a wider pool (vLLM's per-layer view), keys written."""
    pool = torch.zeros(pages, page_size * LAYOUT.width + 52, dtype=torch.uint8)
    cache = pool[:, : page_size * LAYOUT.width].view(pages, page_size, LAYOUT.width)
    keys = torch.randn(pages * page_size, 128, generator=g)
    mb.write_index_keys(cache, keys.to(torch.bfloat16), torch.arange(pages * page_size),
                        layout=LAYOUT)  # fmt: skip
    return cache


def _keys(cache: torch.Tensor) -> torch.Tensor:
    """Every slot's key as the layout's reader returns it: float64 [slots, 128]."""
    values, scales = LAYOUT.page_views(cache)
    return LAYOUT.decode(values.reshape(-1, 128), scales.reshape(-1, scales.shape[-1])).double()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_logits_match_float64(kernels, page_size: int, q_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(page_size)
    pages, Hi = max(4, 200 // page_size), 4
    cache = _pooled_cache(pages, page_size, g)
    lens = torch.tensor([0, 1, 7, 130, 9, 0, page_size * 3 + 1], dtype=torch.int32)
    B = lens.shape[0]
    table = torch.stack([torch.randperm(pages, generator=g) for _ in range(B)]).int()
    q = torch.randn(B, Hi, 128, generator=g).to(q_dtype)
    w = torch.rand(B, Hi, generator=g)
    width = int(lens.max()) + 5
    got = indexer_logits_rows(q, w, cache, lens, table, LAYOUT, width, impl=kernels)
    assert got.shape == (B, width) and got.dtype == torch.float32
    _check_rows(got, q, w, cache, lens, table)


def _check_rows(got, q, w, cache, lens, table) -> None:
    """Each row's logits against float64 over its own keys (through its page-table row), -inf
    past them."""
    keys, page_size = _keys(cache), cache.shape[1]
    for b in range(lens.shape[0]):
        n = int(lens[b])
        slots = (table[b].long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        want = (torch.relu(q[b].double() @ keys[slots].T) * w[b].double()[:, None]).sum(0)
        torch.testing.assert_close(got[b, :n].double(), want, rtol=1e-5, atol=1e-4)
        assert torch.isneginf(got[b, n:]).all()


#: a page id no cache holds: the entries of a table row past its request's pages (stale in an
#: engine's block table), never read
STALE = 10**6


def _prefill_rows(ratio: int, page_size: int, pages: int, g: torch.Generator):
    """Rows as vLLM's prefill chunk gives them (one per token, each its request's page-table
    row and ``(pos + 1) // ratio`` keys) for four requests (a fresh prompt, a chunk onto a
    cached prefix, one ending just past a page of keys, a decode) plus a row that breaks its
    run's pattern; each table row's entries past its request's pages are stale."""
    lens, rows = [], []
    for p0, n in [(0, 23), (37, 18), (50, 16), (60, 1)]:
        row = torch.randperm(pages, generator=g)
        row[-(-((p0 + n) // ratio) // page_size) :] = STALE
        lens += [(p0 + j + 1) // ratio for j in range(n)]
        rows += [row] * n
    lens[30] += 2  # a row of the second request that no position of its run explains
    return torch.tensor(lens, dtype=torch.int32), torch.stack(rows).int()


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_rows_match_float64(kernels, ratio: int, page_size: int) -> None:
    """A prefill's rows go through one request per run (its keys read once per block of
    tokens), the rest row by row: every row's logits as its own keys give them."""
    g = torch.Generator().manual_seed(ratio * 100 + page_size)
    pages, Hi = max(6, 96 // page_size), 4
    cache = _pooled_cache(pages, page_size, g)
    lens, table = _prefill_rows(ratio, page_size, pages, g)
    B = lens.shape[0]
    q = torch.randn(B, Hi, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(B, Hi, generator=g)
    width = int(lens.max()) + 3
    got = indexer_logits_rows(q, w, cache, lens, table, LAYOUT, width, impl=kernels)
    _check_rows(got, q, w, cache, lens, table)


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
@pytest.mark.parametrize("seed", range(6))
def test_group_rows_plans_each_row_as_it_sees(ratio: int, seed: int) -> None:
    """Every request group_rows forms holds consecutive rows of one table row that see
    ``(p0 + j + 1) // ratio`` keys within the row's pages, the requests cover the rows in
    order, and a prefill's clean run is one request."""
    g = torch.Generator().manual_seed(seed)
    page, cols = 16, 8
    lens, table, clean = [], [], []
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        row = torch.randint(0, 50, (cols,), generator=g)
        n = int(torch.randint(1, 40, (1,), generator=g))
        p0 = ratio - 1 + int(torch.randint(0, 80, (1,), generator=g))  # within the pages
        start = len(lens)
        lens += [(p0 + j + 1) // ratio for j in range(n)]
        table += [row] * n
        clean.append((start, start + n))
    if seed % 2:  # a row whose count no run explains (its run is split into single rows)
        lens[len(lens) // 2] += 3
        clean = []
    got_ratio, reqs = group_rows(lens, torch.stack(table), page)
    assert [j for a, b, _ in reqs for j in range(a, b)] == list(range(len(lens)))
    for a, b, p0 in reqs:
        assert all(torch.equal(table[j], table[a]) for j in range(a, b))
        assert [(p0 + j + 1) // got_ratio for j in range(b - a)] == lens[a:b]
        # the tokens stay on the pages of the keys (further table entries may be stale)
        assert p0 >= 0 and -(-(p0 + b - a) // (page * got_ratio)) <= -(-lens[b - 1] // page)
    for a, b in clean:
        if b - a > 2 * ratio:  # two increments show the ratio: one request (less the rows
            # past the keys' last page, at most ratio - 1)
            assert any(x == a and b - ratio < y <= b for x, y, _ in reqs), (a, b, reqs)


def _reference_topk(row: list[float], n: int, k: int) -> list[int]:
    """The k best of row[:n] (larger first, a tie to the lower key, NaN last), ascending."""
    order = sorted(range(n), key=lambda t: (math.isnan(row[t]), -row[t], t))
    return sorted(order[:k]) + [-1] * (k - min(k, n))


@pytest.mark.parametrize("k", [1, 4, 16])
def test_topk_matches_sorting(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    B, S = 6, 40
    scores = torch.randn(B, S, generator=g).round(decimals=1)  # plenty of ties
    scores[1, 3] = float("nan")
    scores[2, :5] = float("-inf")
    scores[3, 2] = -0.0
    scores[3, 5] = 0.0
    lens = torch.tensor([S, 9, 30, 12, k, 0])
    scores[4, k:] = float("nan")  # never read: past the row's keys
    got = topk_rows(scores, lens, k)
    for b in range(B):
        want = _reference_topk(scores[b].tolist(), int(lens[b]), k)
        assert got[b].tolist() == want, (b, got[b].tolist(), want)


def test_bad_input_is_named() -> None:
    g = torch.Generator().manual_seed(0)
    cache = _pooled_cache(2, 4, g)
    q, w, table = torch.zeros(2, 1, 128), torch.zeros(2, 1), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"key_lens torch.float32"):
        indexer_logits_rows(q, w, cache, torch.zeros(2), table, LAYOUT, 8)
    with pytest.raises(ValueError, match=r"negative lengths \[-1\]"):
        indexer_logits_rows(q, w, cache, torch.tensor([1, -1]), table, LAYOUT, 8)
    with pytest.raises(ValueError, match=r"width=4 is below the longest row \(5 keys\)"):
        indexer_logits_rows(q, w, cache, torch.tensor([5, 1]), table, LAYOUT, 4)
    with pytest.raises(ValueError, match=r"topk=0"):
        topk_rows(torch.zeros(2, 3), torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match=r"scores torch.float64"):
        topk_rows(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([1, 2]), 2)
