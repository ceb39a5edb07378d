"""DeepSeek-V4's long-context indexer ops as the adapter serves them (``v4_ops``:
``fused_indexer_q_rope_quant_cpu``, ``fp8_paged_mqa_logits_cpu``, ``topk_transform_512_cpu``)
against references written here from vLLM's definitions of the ops (the fp8 arm of
``fused_indexer_q_rope_quant``'s Triton kernel; the CPU kernels' contracts: a page of the index
cache is ``block_size`` e4m3 keys of 128 bytes then their float32 scales, a row's logit is
``scale[t] * sum_h weight[h] * relu(q[h] . k[t])``; the top-k keeps every key that fits, else
the k best finite scores, a tie to the lower key, each translated through the row's page
table). Values, pages and scales are written byte by byte here, not with our writer."""

from __future__ import annotations

import math

import pytest
import torch
from mla_backend_integrations.vllm import v4_ops

DI, ROPE, K = 128, 64, 512


def _rope_ref(x: torch.Tensor, cos_sin: torch.Tensor, pos: int) -> torch.Tensor:
    """GPT-J (interleaved) rotation of the last ROPE values of x [Di] at ``pos`` (float64)."""
    y = x.double().clone()
    half = ROPE // 2
    for i in range(half):
        c, s = float(cos_sin[pos, i]), float(cos_sin[pos, half + i])
        a, b = float(x[DI - ROPE + 2 * i]), float(x[DI - ROPE + 2 * i + 1])
        y[DI - ROPE + 2 * i], y[DI - ROPE + 2 * i + 1] = a * c - b * s, b * c + a * s
    return y


def test_fused_indexer_q_rope_quant() -> None:
    g = torch.Generator().manual_seed(0)
    T, H = 5, 3
    q = torch.randn(T, H, DI, generator=g) * 3
    q[1, 2] = 0.0  # amax below the floor
    q[2, 0, :4] = 900.0  # a large amax
    ang = torch.rand(20, ROPE // 2, generator=g) * 6
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1)
    pos = torch.tensor([0, 3, 19, 7, 7])
    w = torch.rand(T, H, generator=g)
    q8 = torch.empty(T, H, DI, dtype=torch.float8_e4m3fn)
    w_out = torch.empty(T, H)
    v4_ops.fused_indexer_q_rope_quant_cpu(pos, q, cos_sin, q8, w, 0.25, H**-0.5, w_out)
    for t in range(T):
        for h in range(H):
            x = _rope_ref(q[t, h], cos_sin, int(pos[t])).float()
            x[DI - ROPE :] = x[DI - ROPE :].to(torch.bfloat16).float()
            amax = max(float(x.abs().max()), 1e-4)
            scale = 2.0 ** math.ceil(math.log2(amax / 448.0))
            want = (x / scale).to(torch.float8_e4m3fn)
            assert torch.equal(q8[t, h].view(torch.uint8), want.view(torch.uint8)), (t, h)
            want_w = float(w[t, h]) * scale * 0.25 * H**-0.5
            assert math.isclose(float(w_out[t, h]), want_w, rel_tol=1e-6), (t, h)


def _index_cache(pages: int, bs: int, g: torch.Generator, pad: int = 40):
    """A pooled index cache written byte by byte: (cache uint8 [pages, bs * 132 + pad],
    keys e4m3 [pages * bs, 128], scales float32 [pages * bs])."""
    keys = (torch.randn(pages * bs, DI, generator=g) * 40).to(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-9, -3, (pages * bs,), generator=g).float())
    cache = torch.zeros(pages, bs * (DI + 4) + pad, dtype=torch.uint8)
    for p in range(pages):
        rows = slice(p * bs, (p + 1) * bs)
        cache[p, : bs * DI] = keys[rows].view(torch.uint8).reshape(-1)
        cache[p, bs * DI : bs * (DI + 4)] = scales[rows].view(torch.uint8)
    return cache, keys, scales


@pytest.mark.parametrize("bs", [4, 64])
def test_fp8_paged_mqa_logits(bs: int) -> None:
    g = torch.Generator().manual_seed(bs)
    pages, H = 8, 4
    cache, keys, scales = _index_cache(pages, bs, g)
    lens = torch.tensor([0, 1, bs + 3, 3 * bs, 5], dtype=torch.int32)
    B = lens.shape[0]
    table = torch.stack([torch.randperm(pages, generator=g) for _ in range(B)]).int()
    q8 = (torch.randn(B, H, DI, generator=g) * 30).to(torch.float8_e4m3fn)
    w = torch.rand(B, H, generator=g)
    width = 3 * bs + 7
    got = v4_ops.fp8_paged_mqa_logits_cpu(q8, cache, w, lens, table, bs, width)
    assert got.shape == (B, width) and got.dtype == torch.float32
    for b in range(B):
        for t in range(int(lens[b])):
            slot = int(table[b, t // bs]) * bs + t % bs
            dots = q8[b].double() @ keys[slot].double()  # [H]
            want = float(scales[slot]) * float((dots.clamp(min=0) * w[b].double()).sum())
            assert math.isclose(float(got[b, t]), want, rel_tol=1e-5, abs_tol=1e-3), (b, t)


def _topk_ref(row: list[float], n: int, table: list[int], bs: int) -> tuple[set, set]:
    if n <= K:
        raw = list(range(n))
    else:
        ok = [t for t in range(n) if not math.isnan(row[t]) and row[t] != -math.inf]
        raw = sorted(ok, key=lambda t: (-row[t], t))[:K]
    return set(raw), {table[t // bs] * bs + t % bs for t in raw}


def test_topk_transform_512() -> None:
    g = torch.Generator().manual_seed(1)
    bs, S = 64, 1400
    lens = torch.tensor([0, 17, K, K + 1, 1300, 1400], dtype=torch.int32)
    B = lens.shape[0]
    scores = torch.randn(B, S, generator=g).round(decimals=2)  # ties
    scores[1, 3] = float("-inf")  # fits: kept
    scores[4, :900] = float("-inf")  # fewer than K finite: those left out
    scores[4, 950] = float("nan")
    scores[5, 7] = float("inf")
    table = torch.stack([torch.randperm(40, generator=g)[:24] for _ in range(B)]).int()
    out_page = torch.full((B, K), -7, dtype=torch.int32)
    out_raw = torch.full((B, K), -7, dtype=torch.int32)
    v4_ops.topk_transform_512_cpu(scores, lens, table, out_page, bs, out_raw)
    for b in range(B):
        want_raw, want_page = _topk_ref(scores[b].tolist(), int(lens[b]), table[b].tolist(), bs)
        raw, page = out_raw[b].tolist(), out_page[b].tolist()
        assert {r for r in raw if r >= 0} == want_raw and raw.count(-1) == K - len(want_raw), b
        assert {p for p in page if p >= 0} == want_page and page.count(-1) == raw.count(-1), b
        for r, p in zip(raw, page, strict=True):  # each slot is its key's
            assert (r < 0 and p < 0) or p == int(table[b, r // bs]) * bs + r % bs
