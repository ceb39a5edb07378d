"""V4 attention over flat-slot key lists of caches in V4's fp8 page layout
(``mla_backend.v4_layer.v4_attention_slots``, the contract of vLLM's CPU V4 attention op) against
a float64 reference written here: per token, one softmax over the distinct rows it lists in
each cache (the rows as the layout's reader returns them) and the per-head sink, the row being
key and value. Ragged lists with -1 and repeated slots, a second cache or none, tokens that list
nothing, page sizes 1..64, bf16 and fp32 queries; the torch implementation and the native one at
every ISA level the host runs."""

from __future__ import annotations

import pytest
import torch

from mla_backend.v4_cache import V4_HEAD_DIM, read_v4_rows, v4_page_bytes, write_v4_rows
from mla_backend.v4_layer import v4_attention_slots


def _cache(pages: int, page_size: int, g: torch.Generator) -> torch.Tensor:
    cache = torch.zeros(pages, v4_page_bytes(page_size), dtype=torch.uint8)
    rows = torch.randn(pages * page_size, V4_HEAD_DIM, generator=g) * 0.5
    write_v4_rows(cache, page_size, torch.arange(pages * page_size), rows)
    return cache


def _slots(T: int, k: int, n: int, g: torch.Generator) -> torch.Tensor:
    s = torch.randint(0, n, (T, k), generator=g)
    s[torch.rand(T, k, generator=g) < 0.2] = -1
    if T > 1:
        s[1] = -1  # a token that lists nothing here
    if k > 1:
        s[:, 1] = s[:, 0]  # repeated slots count once
    return s


def _reference(q, sets, sink, scale):
    T, H, _ = q.shape
    out = torch.zeros(T, H, V4_HEAD_DIM, dtype=torch.float64)
    for t in range(T):
        rows = []
        for cache, slots, ps in sets:
            live = sorted({int(x) for x in slots[t] if x >= 0})
            if live:
                rows.append(read_v4_rows(cache, ps, torch.tensor(live), torch.float32).double())
        if not rows:
            continue
        k = torch.cat(rows)  # [n, 512]
        s = q[t].double() @ k.T * scale  # [H, n]
        logits = torch.cat([s, sink.double().unsqueeze(1)], 1)
        p = torch.softmax(logits, 1)[:, :-1]
        out[t] = p @ k
    return out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("two_caches", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(kernels, page_size, two_caches, dtype) -> None:
    g = torch.Generator().manual_seed(page_size * 7 + two_caches)
    T, H = 9, 4
    win = _cache(6, page_size, g)
    sets = [(win, _slots(T, 24, 6 * page_size, g), page_size)]
    if two_caches:
        comp = _cache(3, page_size, g)
        sets.append((comp, _slots(T, 5, 3 * page_size, g), page_size))
    q = (torch.randn(T, H, V4_HEAD_DIM, generator=g) * 0.3).to(dtype)
    sink = torch.randn(H, generator=g)
    scale = V4_HEAD_DIM**-0.5
    got = v4_attention_slots(q, sets, sink, scale, impl=kernels)
    want = _reference(q.float(), sets, sink, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert got.dtype == dtype
    assert torch.equal(got[1], torch.zeros_like(got[1])) or two_caches  # nothing listed: 0


def test_out_buffer_and_bad_input_named() -> None:
    g = torch.Generator().manual_seed(0)
    win = _cache(2, 4, g)
    q = torch.randn(3, 2, V4_HEAD_DIM, generator=g)
    slots = torch.tensor([[0, 1], [2, -1], [-1, -1]])
    out = torch.full((3, 2, V4_HEAD_DIM), float("nan"))
    got = v4_attention_slots(q, [(win, slots, 4)], torch.zeros(2), 0.1, out=out)
    assert got is out and torch.isfinite(out).all() and torch.equal(out[2], torch.zeros(2, 512))
    with pytest.raises(ValueError, match=r"q torch.float32 \(3, 2, 256\)"):
        v4_attention_slots(q[..., :256], [(win, slots, 4)], torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match=r"slots torch.float32"):
        v4_attention_slots(q, [(win, slots.float(), 4)], torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match="uint8"):
        v4_attention_slots(q, [(win.float(), slots, 4)], torch.zeros(2), 0.1)


@pytest.mark.parametrize(("T", "H", "k"), [(1, 40, 300), (3, 33, 130), (2, 128, 700)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_lists_many_heads_pooled_pages(kernels, T, H, k, dtype) -> None:
    """Lists of several kv tiles (and kv splits), head counts across blocks of 32 and a partial
    one, pages pooled at a stride past their bytes (vLLM's unified page size), a sink of -inf
    on some heads: against the float64 reference."""
    g = torch.Generator().manual_seed(T * 1000 + H + k)
    page_size, pages = 16, 64
    pooled = torch.zeros(pages, v4_page_bytes(page_size) + 3 * 576, dtype=torch.uint8)
    win = pooled[:, : v4_page_bytes(page_size)]  # stride(0) > its bytes
    write_v4_rows(win, page_size, torch.arange(pages * page_size),
                  torch.randn(pages * page_size, V4_HEAD_DIM, generator=g))  # fmt: skip
    comp = _cache(8, page_size, g)
    sets = [
        (win, torch.randint(-1, pages * page_size, (T, k), generator=g), page_size),
        (comp, torch.randint(-1, 8 * page_size, (T, 40), generator=g), page_size),
    ]
    q = (torch.randn(T, H, V4_HEAD_DIM, generator=g) * 0.2).to(dtype)
    sink = torch.randn(H, generator=g)
    sink[::3] = float("-inf")
    scale = V4_HEAD_DIM**-0.5
    got = v4_attention_slots(q, sets, sink, scale, impl=kernels)
    want = _reference(q.float(), sets, sink, scale)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_slot_past_its_cache_refused_naming_it(kernels) -> None:
    g = torch.Generator().manual_seed(1)
    win, comp = _cache(2, 4, g), _cache(1, 4, g)
    q = torch.randn(2, 2, V4_HEAD_DIM, generator=g)
    ok = torch.tensor([[0, 1], [2, -1]])
    for sets in (
        [(win, torch.tensor([[0, 8], [1, 2]]), 4)],  # 2 pages x 4 rows: slot 8 is past them
        [(win, ok, 4), (comp, torch.tensor([[0, 1], [4, -1]]), 4)],
    ):
        with pytest.raises(RuntimeError, match=r"slot"):
            v4_attention_slots(q, sets, torch.zeros(2), 0.1, impl=kernels)
