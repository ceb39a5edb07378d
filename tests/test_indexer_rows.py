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
from mla_backend.indexer_rows import indexer_logits_rows, topk_rows

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
    keys = _keys(cache)
    assert got.shape == (B, width) and got.dtype == torch.float32
    for b in range(B):
        n = int(lens[b])
        slots = (table[b].long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        want = (torch.relu(q[b].double() @ keys[slots].T) * w[b].double()[:, None]).sum(0)
        torch.testing.assert_close(got[b, :n].double(), want, rtol=1e-5, atol=1e-4)
        assert torch.isneginf(got[b, n:]).all()


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
