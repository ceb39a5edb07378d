"""DeepSeek-V4's CSA indexer through the core: its compressed keys (mla_backend.compressor at
index_head_dim) written into a paged index cache, then the lightning indexer's top-k over
compressed keys (``IndexerDims(compress_ratio=4)``: the token at p sees keys w < (p + 1) // 4),
against transformers' own ``DeepseekV4Indexer`` (fp32, eager, its cache): the same selected
entries for every token of ragged chunked batches, pages shuffled. Also the ratio against the
module's own fp64 rule on random keys, at every implementation this host runs."""

from __future__ import annotations

import random

import pytest
import torch

import mla_backend as mb
from mla_backend import compressor as cz
from mla_backend.rope import rope_interleaved
from mla_backend.testing import v4_oracle as vo

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

HIDDEN, D, ROPE, Q_LORA, HI, DI, RATIO = 32, 64, 16, 24, 4, 32, 4


def _indexer(topk: int, seed: int):
    torch.manual_seed(seed)
    cfg = vo.v4_config("csa", index_heads=HI, index_head_dim=DI, index_topk=topk)
    return cfg, vo.randomize(v4.DeepseekV4Indexer(cfg))


def _reference(cfg, idx, x: torch.Tensor, q_res: torch.Tensor, chunks: list[int]) -> list:
    """transformers' scores of every compressed key per token, per chunk ([n, keys])."""
    cache = transformers.DynamicCache(config=cfg)
    scores: list[torch.Tensor] = []
    hook = idx.scorer.register_forward_hook(lambda _m, _i, out: scores.append(out[0].clone()))
    pos = 0
    for n in chunks:
        pid = torch.arange(pos, pos + n).unsqueeze(0)
        with torch.no_grad():
            idx(x[pos : pos + n].unsqueeze(0), q_res[pos : pos + n].unsqueeze(0), pid, cache, 0)
        pos += n
    hook.remove()
    return scores


def _expected(scores: torch.Tensor, n: int, topk: int, tol: float = 1e-5) -> list[int] | None:
    """The top-k of the first n keys by the module's rule (larger score first, a tie to the
    lower position), ascending; None when the k-th and the next score are a near-tie (within
    ``tol`` relative of each other, not equal) that rounding could order either way."""
    s = scores[:n].double()
    order = sorted(range(n), key=lambda w: (-float(s[w]), w))
    k = min(topk, n)
    if k < n:
        a, b = float(s[order[k - 1]]), float(s[order[k]])
        if a != b and abs(a - b) <= tol * max(1.0, abs(a)):
            return None
    return sorted(order[:k])


@pytest.mark.parametrize(("topk", "page_size", "seed"), [(3, 1, 0), (5, 2, 1), (64, 4, 2)])
def test_selection_equals_transformers(topk: int, page_size: int, seed: int) -> None:
    """page_size: compressed keys per page (a block-table page spans page_size x 4 tokens)."""
    cfg, idx = _indexer(topk, seed)
    rng = random.Random(seed)
    B = 3
    schedules = vo.chunk_schedules(rng, B, (20, 48), [1, 1, 2, 3, 7, 13])
    xs = [torch.randn(sum(c), HIDDEN) for c in schedules]
    qs = [torch.randn(sum(c), Q_LORA) for c in schedules]
    want = [_reference(cfg, idx, x, q, c) for x, q, c in zip(xs, qs, schedules, strict=True)]

    lens = [sum(c) for c in schedules]
    spec = cz.CompressorSpec(RATIO, DI, overlap=True, rope_dim=ROPE, eps=cfg.rms_norm_eps)
    tok_pages = -(-max(lens) // page_size)  # state rows: a page of page_size tokens
    sbt = torch.randperm(B * tok_pages).view(B, tok_pages).int()
    state = torch.full((B * tok_pages, page_size, spec.state_width), float("nan"))
    key_pages = -(-max(lens) // (page_size * RATIO))
    ibt = torch.randperm(B * key_pages + 1)[: B * key_pages].view(B, key_pages).int()
    icache = torch.full((B * key_pages + 1, page_size, DI), float("nan"))
    cos_sin = vo.cos_sin_table(idx.rotary_emb, "compress", max(lens) + 1)
    dims = mb.IndexerDims(HI, DI, topk, compress_ratio=RATIO)
    done, checked = [0] * B, 0
    for step in range(max(len(c) for c in schedules)):
        new = [c[step] if step < len(c) else 0 for c in schedules]
        live = [i for i in range(B) if new[i]]
        h = torch.cat([xs[i][done[i] : done[i] + new[i]] for i in range(B)])
        q_res = torch.cat([qs[i][done[i] : done[i] + new[i]] for i in range(B)])
        state_batch = mb.MLABatch.build(done, new, sbt, page_size)
        pos = state_batch.positions()
        with torch.no_grad():  # the engine's part: projections, RoPE, folded weights
            q_I = rope_interleaved(idx.q_b_proj(q_res).view(-1, HI, DI), cos_sin, pos)
            w = idx.scorer.weights_proj(h) * HI**-0.5 * DI**-0.5
        sched, keys = vo.compress_step(idx, spec, h, state_batch, state, sbt, cos_sin)
        eslots = vo.slots(ibt, sched.reqs, sched.entries, page_size)
        mb.write_index_keys(icache, keys, eslots)
        batch = mb.MLABatch.build(done, new, ibt, page_size * RATIO)
        plan = mb.plan(batch, mb.v4_dims(2, D, ROPE), indexer=dims)
        got = mb.indexer_topk(q_I.contiguous(), w.float().contiguous(), icache, plan, topk)
        t = 0
        for i in live:
            ref = want[i][step]
            for j in range(new[i]):
                p = done[i] + j
                g = [v for v in got[t].tolist() if v >= 0]
                r = _expected(ref[j], (p + 1) // RATIO, topk, tol=2e-2)  # bf16 products
                checked += r is not None
                assert r is None or g == r, f"request {i} position {p}: {g} != {r}"
                assert len(g) == min(topk, (p + 1) // RATIO)
                t += 1
        done = [a + b for a, b in zip(done, new, strict=True)]
    assert checked >= 0.8 * sum(lens)  # near-ties are rare


@pytest.mark.parametrize("ratio", [2, 4, 7])
def test_compressed_visibility_rule(ratio: int) -> None:
    """Random keys (a plain fp32 index cache): logits -inf exactly where w >= (p + 1) // ratio,
    the top-k the best visible keys by the fp64 score (no near-ties drawn)."""
    torch.manual_seed(ratio)
    B, ps, topk = 3, 2, 4
    prefix, new = [0, 9, 30], [13, 1, 6]
    lens = [a + b for a, b in zip(prefix, new, strict=True)]
    pages = -(-max(lens) // (ps * ratio))
    bt = torch.randperm(B * pages).view(B, pages).int()
    keys = torch.randn(B * pages, ps, DI)
    batch = mb.MLABatch.build(prefix, new, bt, ps * ratio)
    plan = mb.plan(batch, mb.v4_dims(2, D, ROPE), indexer=mb.IndexerDims(HI, DI, topk, ratio))
    T = batch.num_tokens
    q = torch.randn(T, HI, DI)
    w = torch.rand(T, HI)
    lg = mb.indexer_logits(q, w, keys, plan)
    sel = mb.indexer_topk(q, w, keys, plan, topk)
    pos = batch.positions()
    t = checked = 0
    for i in range(B):
        kv = keys[bt[i].long()].reshape(-1, DI)[: lens[i] // ratio].double()
        for _ in range(new[i]):
            n = (int(pos[t]) + 1) // ratio
            s = (torch.relu(q[t].double() @ kv.T) * w[t].double()[:, None]).sum(0)
            # the native kernels multiply in bf16 (q and keys rounded): within its precision
            torch.testing.assert_close(lg[t, :n].double(), s[:n], rtol=2e-2, atol=2e-2)
            assert torch.isinf(lg[t, n:]).all() and (lg[t, n:] < 0).all()
            best = _expected(s, n, topk, tol=2e-2)
            checked += best is not None
            assert best is None or [v for v in sel[t].tolist() if v >= 0] == best
            t += 1
    assert checked >= 0.8 * T


def test_page_size_mismatch_named() -> None:
    bt = torch.zeros(1, 2, dtype=torch.int32)
    batch = mb.MLABatch.build([0], [8], bt, 8)
    plan = mb.plan(batch, mb.v4_dims(2, D, ROPE), indexer=mb.IndexerDims(HI, DI, 4, 4))
    with pytest.raises(ValueError, match="index cache page size 8 != the plan's page_size 8 / "
                                         "compress_ratio 4"):  # fmt: skip
        mb.indexer_topk(torch.zeros(8, HI, DI), torch.zeros(8, HI), torch.zeros(2, 8, DI), plan, 4)
    with pytest.raises(ValueError, match="compress_ratio=0"):
        mb.IndexerDims(HI, DI, 4, 0)
