"""DeepSeek-V4's KV compressor (mla_backend.compressor) against transformers' own
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` (fp32, eager, with their cache):
ragged batches of requests fed in chunks (prefill, chunked-prefill continuations, decode tokens),
state rows in shuffled pages of several sizes, every entry equal to the one transformers emits
(through ``compress``, and through ``compress_slots`` given each window's flat slots the way
vLLM's CPU compressor computes them)."""

from __future__ import annotations

import random

import pytest
import torch

import mla_backend as mb
from mla_backend import compressor as cz
from mla_backend.testing import v4_oracle as vo

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

HIDDEN, D, ROPE, Q_LORA = 32, 64, 16, 24


class _Cache:
    """What the compressor reads of a transformers Cache: ``layers[layer_idx]``."""

    def __init__(self, layer: object) -> None:
        self.layers = [layer]


def _oracle(kind: str, ratio: int, seed: int):
    torch.manual_seed(seed)
    cfg = vo.v4_config(kind, csa_ratio=ratio if kind == "csa" else 4,
                       hca_ratio=ratio if kind == "hca" else 128)  # fmt: skip
    cls = v4.DeepseekV4CSACompressor if kind == "csa" else v4.DeepseekV4HCACompressor
    return cfg, vo.randomize(cls(cfg))


def _reference_entries(cfg, comp, kind: str, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Every entry transformers emits for one request fed in ``chunks``: [entries, D]."""
    layer = (v4.DeepseekV4CSACache if kind == "csa" else v4.DeepseekV4HCACache)(cfg)
    cache, pos, out = _Cache(layer), 0, None
    for n in chunks:
        h = x[pos : pos + n].unsqueeze(0)
        q_res = torch.zeros(1, n, Q_LORA)
        position_ids = torch.arange(pos, pos + n).unsqueeze(0)
        with torch.no_grad():
            out = comp(h, q_res, position_ids, cache, 0)[0]
        pos += n
    assert out is not None
    return out[0, 0]


@pytest.mark.parametrize(
    ("kind", "ratio", "page_size"),
    [("csa", 4, 1), ("csa", 4, 3), ("csa", 4, 16), ("hca", 8, 4), ("hca", 128, 16)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_entries_equal_transformers(kind: str, ratio: int, page_size: int, seed: int) -> None:
    cfg, comp = _oracle(kind, ratio, seed)
    rng = random.Random(seed)
    spec = cz.CompressorSpec(ratio, D, overlap=kind == "csa", rope_dim=ROPE, eps=cfg.rms_norm_eps)
    B = 3
    # per request: chunks of a prefill (some not window-aligned), continuations, decodes
    total = 3 * ratio + 5 if ratio > 8 else 41
    schedules = vo.chunk_schedules(rng, B, (total // 2, total),
                                   [1, 1, 2, ratio - 1, ratio + 1, 2 * ratio + 3])  # fmt: skip
    xs = [torch.randn(sum(c), HIDDEN) for c in schedules]
    want = [_reference_entries(cfg, comp, kind, x, c) for x, c in zip(xs, schedules, strict=True)]

    lens = [sum(c) for c in schedules]
    pages_per_req = -(-max(lens) // page_size)
    perm = torch.randperm(B * pages_per_req + 2)
    bt = perm[: B * pages_per_req].view(B, pages_per_req).int()
    # seed 1: pages padded past page_size rows by a part of a row (vLLM's unified page stride)
    width, pad = spec.state_width, 37 * seed
    n_pages = B * pages_per_req + 2
    state = torch.full((n_pages * (page_size * width + pad),), float("nan"))
    state = state.as_strided((n_pages, page_size, width), (page_size * width + pad, width, 1))
    cos_sin = vo.cos_sin_table(comp.rotary_emb, "compress", max(lens) + 1)
    got: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [0] * B
    for step in range(max(len(c) for c in schedules)):
        new = [c[step] if step < len(c) else 0 for c in schedules]
        batch = mb.MLABatch.build(done, new, bt, page_size)
        h = torch.cat([xs[i][done[i] : done[i] + new[i]] for i in range(B)])
        sched, entries = vo.compress_step(comp, spec, h, batch, state, bt, cos_sin)
        # the windows as flat slots the way vLLM's CPU compressor resolves them (positions
        # p - window + 1 .. p of each completing token p, -1 before the sequence), pooled by
        # compress_slots: the same entries
        p = sched.entries * ratio + ratio - 1
        local = p.unsqueeze(1) - spec.window + 1 + torch.arange(spec.window)
        page = bt.long()[sched.reqs.unsqueeze(1), local.clamp(min=0) // page_size]
        win_slots = torch.where(local >= 0, page * page_size + local % page_size, -1)
        by_slots = cz.compress_slots(state, win_slots, sched.entries * ratio, spec,
                                     comp.kv_norm.weight.detach(), cos_sin)  # fmt: skip
        torch.testing.assert_close(by_slots, entries, rtol=0, atol=0)
        for e in range(sched.num_emitted):
            r, w = int(sched.reqs[e]), int(sched.entries[e])
            assert w == len(got[r])  # entries come in order, each once
            got[r].append(entries[e])
        done = [a + b for a, b in zip(done, new, strict=True)]
        assert list(sched.num_entries) == [len(g) for g in got]
    for i in range(B):
        assert len(got[i]) == want[i].shape[0] == lens[i] // ratio
        if got[i]:
            torch.testing.assert_close(torch.stack(got[i]), want[i], rtol=1e-5, atol=1e-5)


def test_schedule_lists_the_completing_tokens() -> None:
    """Token at position p completes entry (p + 1) // m - 1 exactly when (p + 1) % m == 0."""
    bt = torch.zeros(3, 8, dtype=torch.int32)
    batch = mb.MLABatch.build([0, 5, 7], [9, 1, 6], bt, 4)
    s = cz.schedule(batch, 4)
    pos = batch.positions()
    want = [(t, i) for t, p in enumerate(pos.tolist())
            for i in [next(j for j in range(3) if batch.cu_new[j] <= t < batch.cu_new[j + 1])]
            if (p + 1) % 4 == 0]  # fmt: skip
    assert [(int(t), int(r)) for t, r in zip(s.tokens, s.reqs, strict=True)] == want
    assert s.entries.tolist() == [(int(pos[t]) + 1) // 4 - 1 for t, _ in want]
    assert s.num_entries == (2, 1, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0}, "ratio=0"),
        ({"head_dim": -1}, "head_dim=-1"),
        ({"rope_dim": 3}, "rope_dim=3"),
        ({"rope_dim": 128}, "rope_dim=128"),
        ({"eps": 0.0}, "eps=0.0"),
    ],
)
def test_spec_rejects(kwargs: dict, match: str) -> None:
    args = {"ratio": 4, "head_dim": 64, "overlap": True, "rope_dim": 16} | kwargs
    with pytest.raises(ValueError, match=match):
        cz.CompressorSpec(**args)


def test_bad_state_and_inputs_named() -> None:
    spec = cz.CompressorSpec(4, 64, overlap=True, rope_dim=16)
    state = torch.zeros(4, 4, spec.state_width)
    kv = torch.zeros(3, 128)
    pos = torch.arange(3)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="state cache torch.bfloat16"):
        cz.save_states(kv, kv, torch.zeros(4, 128), pos, state.bfloat16(), slots, spec)
    with pytest.raises(ValueError, match=r"kv torch.float32 \(3, 64\)"):
        cz.save_states(kv[:, :64], kv, torch.zeros(4, 128), pos, state, slots, spec)
    with pytest.raises(ValueError, match=r"ape torch.float32 \(8, 128\)"):
        cz.save_states(kv, kv, torch.zeros(8, 128), pos, state, slots, spec)
    with pytest.raises(ValueError, match=r"slot_mapping torch.float32"):
        cz.save_states(kv, kv, torch.zeros(4, 128), pos, state, slots.float(), spec)
    batch = mb.MLABatch.build([0], [8], torch.zeros(1, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="schedule of ratio 8"):
        cz.compress(state, batch.block_table, cz.schedule(batch, 8), spec, torch.ones(64),
                    torch.zeros(16, 16))  # fmt: skip
    with pytest.raises(ValueError, match=r"cos_sin \(16, 8\)"):
        cz.compress(state, batch.block_table, cz.schedule(batch, 4), spec, torch.ones(64),
                    torch.zeros(16, 8))  # fmt: skip
    with pytest.raises(ValueError, match="ratio=0"):
        cz.schedule(batch, 0)
    with pytest.raises(ValueError, match=r"window_slots torch.int64 \(2, 4\)"):
        cz.compress_slots(state, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2), spec,
                          torch.ones(64), torch.zeros(16, 16))  # fmt: skip
    with pytest.raises(ValueError, match=r"entry_pos \(3,\)"):
        cz.compress_slots(state, torch.zeros(2, 8, dtype=torch.long), torch.zeros(3), spec,
                          torch.ones(64), torch.zeros(16, 16))  # fmt: skip


def test_skipped_slots_are_not_written() -> None:
    spec = cz.CompressorSpec(4, 8, overlap=False, rope_dim=0)
    state = torch.zeros(2, 4, spec.state_width)
    kv = torch.ones(3, 8)
    cz.save_states(kv, kv, torch.zeros(4, 8), torch.arange(3), state, torch.tensor([5, -1, 0]),
                   spec)  # fmt: skip
    rows = state.view(-1, spec.state_width)
    assert rows[5].eq(1).all() and rows[0].eq(1).all()
    assert rows[[1, 2, 3, 4, 6, 7]].eq(0).all()
