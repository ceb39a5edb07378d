"""DeepSeek-V4's attention layer through the core (mla_backend.v4_layer over the key-set
primitive, mla_backend.compressor for the compressed entries) against transformers' own
``DeepseekV4Attention`` (fp32, eager, with its cache): sliding-window, CSA and HCA layers, ragged
batches of requests fed in chunks (prefill, continuations, decode tokens), pages shuffled, the
layer's output (after ``wo_a`` / ``wo_b``) equal. CSA's selection is transformers' indexer's (the
core's indexer over compressed keys is tested on its own)."""

from __future__ import annotations

import random

import pytest
import torch

import mla_backend as mb
from mla_backend import compressor as cz
from mla_backend import v4_layer as v4a
from mla_backend.rope import rope_interleaved
from mla_backend.testing import v4_oracle as vo

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

HIDDEN, H, D, ROPE, WINDOW, TOPK = 32, 4, 64, 16, 8, 3
RATIO = {"sliding": 0, "csa": 4, "hca": 8}


def _layer(kind: str, seed: int):
    torch.manual_seed(seed)
    cfg = vo.v4_config(kind, heads=H, index_topk=TOPK, hca_ratio=RATIO["hca"], window=WINDOW,
                       o_groups=2)  # fmt: skip
    return cfg, vo.randomize(v4.DeepseekV4Attention(cfg, 0)), v4.DeepseekV4RotaryEmbedding(cfg)


def _mask(pos0: int, n: int, cached: int) -> torch.Tensor:
    """transformers' sliding causal mask over its cache's keys: the last ``cached`` rows before
    ``pos0`` (at most WINDOW - 1), then the chunk's ``n``."""
    kpos = torch.arange(pos0 - cached, pos0 + n)
    qpos = torch.arange(pos0, pos0 + n).unsqueeze(1)
    ok = (kpos <= qpos) & (qpos - kpos < WINDOW)
    return torch.zeros(1, 1, n, kpos.numel()).masked_fill(~ok, float("-inf"))


def _reference(cfg, attn, rotary, x: torch.Tensor, chunks: list[int], indices: list) -> list:
    """transformers' layer output per chunk of one request; ``indices`` collects its indexer's
    selection per chunk (CSA)."""
    cache = transformers.DynamicCache(config=cfg)
    hook = None
    if attn.compressor is not None and hasattr(attn.compressor, "indexer"):
        hook = attn.compressor.indexer.register_forward_hook(
            lambda _m, _i, out: indices.append(out[0].clone())
        )
    outs, pos = [], 0
    for n in chunks:
        h = x[pos : pos + n].unsqueeze(0)
        pid = torch.arange(pos, pos + n).unsqueeze(0)
        pe = {t: rotary(h, pid, layer_type=t) for t in ("main", "compress")}
        with torch.no_grad():
            o, _ = attn(h, pe, pid, _mask(pos, n, min(pos, WINDOW - 1)), past_key_values=cache)
        outs.append(o[0])
        pos += n
    if hook is not None:
        hook.remove()
    return outs


def _pages(B: int, tokens: int, ps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shuffled block table for B requests of up to ``tokens`` rows and a NaN-filled cache
    (rows never written stay NaN: reading one would show)."""
    per = max(1, -(-tokens // ps))
    bt = torch.randperm(B * per + 1)[: B * per].view(B, per).int()
    return bt, torch.full((B * per + 1, ps, D), float("nan"))


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize(("page_size", "seed"), [(1, 0), (4, 1), (16, 2)])
def test_layer_equals_transformers(kind: str, page_size: int, seed: int) -> None:
    cfg, attn, rotary = _layer(kind, seed)
    rng = random.Random(seed)
    B, ratio = 3, RATIO[kind]
    schedules = vo.chunk_schedules(rng, B, (20, 40), [1, 1, 3, 5, 9, 17])
    xs = [torch.randn(sum(c), HIDDEN) for c in schedules]
    sel: list[list[torch.Tensor]] = [[] for _ in range(B)]
    want = [
        _reference(cfg, attn, rotary, x, c, s) for x, c, s in zip(xs, schedules, sel, strict=True)
    ]

    lens = [sum(c) for c in schedules]
    bt, cache = _pages(B, max(lens), page_size)
    cos_sin = vo.cos_sin_table(rotary, "main" if kind == "sliding" else "compress", max(lens) + 1)
    comp = attn.compressor
    if comp is not None:
        spec = cz.CompressorSpec(ratio, D, overlap=kind == "csa", rope_dim=ROPE,
                                 eps=cfg.rms_norm_eps)  # fmt: skip
        sbt, _ = _pages(B, max(lens), page_size)
        state = torch.full((sbt.numel() + 1, page_size, spec.state_width), float("nan"))
        cbt, ccache = _pages(B, max(lens) // ratio, page_size)
    dims = v4a.v4_dims(H, D, ROPE)
    done = [0] * B
    for step in range(max(len(c) for c in schedules)):
        new = [c[step] if step < len(c) else 0 for c in schedules]
        live = [i for i in range(B) if new[i]]
        batch = mb.MLABatch.build(done, new, bt, page_size)
        plan = mb.plan(batch, dims, window=WINDOW)
        h = torch.cat([xs[i][done[i] : done[i] + new[i]] for i in range(B)])
        pos = batch.positions()
        reqs = torch.repeat_interleave(torch.arange(B), torch.tensor(new))
        with torch.no_grad():  # the engine's part: projections, norms, RoPE
            q_res = attn.q_a_norm(attn.q_a_proj(h))
            q = attn.q_b_norm(attn.q_b_proj(q_res).view(-1, H, D))
            q = rope_interleaved(q, cos_sin, pos)
            kv = rope_interleaved(attn.kv_norm(attn.kv_proj(h)), cos_sin, pos)
        mb.write_latent(
            cache, kv[:, : D - ROPE], kv[:, D - ROPE :], vo.slots(bt, reqs, pos, page_size)
        )
        compressed = indices = None
        if comp is not None:
            sched, entries = vo.compress_step(comp, spec, h, batch, state, sbt, cos_sin)
            eslots = vo.slots(cbt, sched.reqs, sched.entries, page_size)
            mb.write_latent(ccache, entries[:, : D - ROPE], entries[:, D - ROPE :], eslots)
            compressed = mb.KeyCache(ccache, cbt, sched.num_entries_t)
            if kind == "hca":
                indices = v4a.visible_entries(pos, ratio, max(sched.num_entries))
            else:
                rows = [sel[i][step] for i in live]
                k = max(1, *(r.shape[-1] for r in rows))
                indices = torch.cat([torch.nn.functional.pad(r, (0, k - r.shape[-1]), value=-1)
                                     for r in rows]).int()  # fmt: skip
        o = v4a.v4_attention(q, cache, plan, attn.sinks.detach().float(), cos_sin, pos,
                             compressed=compressed, compressed_indices=indices)  # fmt: skip
        with torch.no_grad():
            got = attn.o_b_proj(attn.o_a_proj(o.reshape(o.shape[0], cfg.o_groups, -1)).flatten(1))
        expect = torch.cat([want[i][step] for i in live])
        torch.testing.assert_close(got, expect, rtol=2e-4, atol=2e-4)
        done = [a + b for a, b in zip(done, new, strict=True)]


def test_visible_entries() -> None:
    pos = torch.tensor([0, 3, 4, 7, 8, 30])
    got = v4a.visible_entries(pos, 4, 8)
    for t, p in enumerate(pos.tolist()):
        n = (p + 1) // 4
        assert got[t].tolist() == list(range(n)) + [-1] * (8 - n)
    with pytest.raises(ValueError, match="ratio=0"):
        v4a.visible_entries(pos, 0, 8)


def test_bad_input_named() -> None:
    bt = torch.zeros(1, 2, dtype=torch.int32)
    batch = mb.MLABatch.build([0], [2], bt, 4)
    dims = v4a.v4_dims(H, D, ROPE)
    cache = torch.zeros(2, 4, D)
    q, sink, pos = torch.zeros(2, H, D), torch.zeros(H), torch.arange(2)
    cs = torch.zeros(8, ROPE)
    with pytest.raises(ValueError, match="no window"):
        v4a.v4_attention(q, cache, mb.plan(batch, dims), sink, cs, pos)
    plan = mb.plan(batch, dims, window=WINDOW)
    with pytest.raises(ValueError, match=r"q \(2, 4, 32\)"):
        v4a.v4_attention(q[..., :32], cache, plan, sink, cs, pos)
    with pytest.raises(ValueError, match=r"cos_sin \(8, 8\)"):
        v4a.v4_attention(q, cache, plan, sink, cs[:, :8], pos)
    with pytest.raises(ValueError, match=r"positions \(3,\)"):
        v4a.v4_attention(q, cache, plan, sink, cs, torch.arange(3))
    with pytest.raises(ValueError, match="sink"):
        v4a.v4_attention(q, cache, plan, torch.zeros(H + 1), cs, pos)
