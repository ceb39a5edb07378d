"""A tiny DeepSeek-V4 model (mla_backend.testing.tiny_v4: HCA, CSA, sliding and CSA layers,
V4's attention dims) with every attention layer served by the core, as an engine adapter would
serve it: paged window rows (``write_latent``), the compressor's state and entries
(:mod:`mla_backend.compressor`), CSA's indexer keys and top-k over compressed keys
(``IndexerDims(compress_ratio=4)``), ``mb.v4_attention`` over the key sets; the prompt fed in
chunks (prefill continuations, then decode steps), each a step with its own plan. Its logits equal
transformers' own ``DeepseekV4ForCausalLM`` (fp32) over the whole sequence at once, with
``index_topk`` above every context and below it (the selection then matters; the indexer runs
the torch path there, whose fp32 scores order keys as transformers' do: the native kernels'
bf16 products are checked against near-ties in tests/test_v4_indexer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import mla_backend as mb
from mla_backend import compressor as cz
from mla_backend.rope import rope_interleaved
from mla_backend.testing import v4_oracle as vo
from mla_backend.testing.tiny_v4 import make_tiny_v4

transformers = pytest.importorskip("transformers")

PAGE, PROMPT = 16, 300
CHUNKS = (97, 97, 97, 1, 1, 6, 1)


class CoreLayer:
    """One V4 attention layer of transformers' model served by the core (batch 1)."""

    def __init__(self, attn: Any, tables: dict[str, torch.Tensor], cfg: Any, topk: int) -> None:
        self.attn, self.cfg, self.topk = attn, cfg, topk
        self.H, self.D, self.rope = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.cos_sin = tables[attn.rope_layer_type]
        pages = -(-PROMPT // PAGE) + 2
        self.bt = torch.arange(pages, dtype=torch.int32).flip(0).view(1, pages)  # shuffled
        self.cache = torch.full((pages, PAGE, self.D), float("nan"))
        self.comp = attn.compressor
        if self.comp is not None:
            ratio = self.comp.compress_rate
            self.spec = cz.CompressorSpec(ratio, self.D, overlap=ratio == 4, rope_dim=self.rope,
                                          eps=cfg.rms_norm_eps)  # fmt: skip
            self.state = torch.full((pages, PAGE, self.spec.state_width), float("nan"))
            self.ccache = torch.full((pages, PAGE, self.D), float("nan"))
            self.idx = getattr(self.comp, "indexer", None)
        if self.comp is not None and self.idx is not None:
            Di = cfg.index_head_dim
            self.ispec = cz.CompressorSpec(4, Di, overlap=True, rope_dim=self.rope,
                                           eps=cfg.rms_norm_eps)  # fmt: skip
            self.istate = torch.full((pages, PAGE, self.ispec.state_width), float("nan"))
            self.icache = torch.full((pages, PAGE, Di), float("nan"))

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any,
                position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:  # fmt: skip
        a, H, D, R = self.attn, self.H, self.D, self.rope
        h, pos = hidden_states[0], position_ids[0]
        S, p0 = h.shape[0], int(pos[0])
        batch = mb.MLABatch.build([p0], [S], self.bt, PAGE)
        plan = mb.plan(batch, mb.v4_dims(H, D, R), window=self.cfg.sliding_window)
        q_res = a.q_a_norm(a.q_a_proj(h))
        q = rope_interleaved(a.q_b_norm(a.q_b_proj(q_res).view(S, H, D)), self.cos_sin, pos)
        kv = rope_interleaved(a.kv_norm(a.kv_proj(h)), self.cos_sin, pos)
        reqs = torch.zeros(S, dtype=torch.long)
        mb.write_latent(
            self.cache, kv[:, : D - R], kv[:, D - R :], vo.slots(self.bt, reqs, pos, PAGE)
        )
        compressed = indices = None
        if self.comp is not None:
            sched, e = vo.compress_step(self.comp, self.spec, h, batch, self.state, self.bt,
                                        self.cos_sin)  # fmt: skip
            mb.write_latent(self.ccache, e[:, : D - R], e[:, D - R :],
                            vo.slots(self.bt, sched.reqs, sched.entries, PAGE))  # fmt: skip
            compressed = mb.KeyCache(self.ccache, self.bt, sched.num_entries_t)
            if self.idx is None:  # HCA: every visible entry
                indices = mb.v4_layer.visible_entries(pos, self.spec.ratio, max(sched.num_entries))
            else:
                indices = self._select(h, q_res, pos, batch)
        o = mb.v4_attention(q, self.cache, plan, a.sinks.float(), self.cos_sin, pos,
                            compressed=compressed, compressed_indices=indices)  # fmt: skip
        out = a.o_b_proj(a.o_a_proj(o.reshape(S, self.cfg.o_groups, -1)).flatten(1))
        return out.unsqueeze(0), None

    def _select(self, h: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor,
                batch: mb.MLABatch) -> torch.Tensor:  # fmt: skip
        """CSA: the indexer's keys written, its top-k over compressed keys."""
        idx, cfg = self.idx, self.cfg
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        sched, keys = vo.compress_step(idx, self.ispec, h, batch, self.istate, self.bt,
                                       self.cos_sin)  # fmt: skip
        mb.write_index_keys(self.icache, keys, vo.slots(self.bt, sched.reqs, sched.entries, PAGE))
        q_I = rope_interleaved(idx.q_b_proj(q_res).view(-1, Hi, Di), self.cos_sin, pos)
        w = idx.scorer.weights_proj(h).float() * Hi**-0.5 * Di**-0.5
        ibatch = mb.MLABatch.build(batch.prefix_lens, batch.new_lens, self.bt, PAGE * 4)
        iplan = mb.plan(ibatch, mb.v4_dims(self.H, self.D, self.rope), impl="torch",
                        indexer=mb.IndexerDims(Hi, Di, self.topk, compress_ratio=4))  # fmt: skip
        return mb.indexer_topk(q_I.contiguous(), w.contiguous(), self.icache, iplan, self.topk)


@pytest.mark.parametrize("index_topk", [512, 8])
def test_logits_equal_transformers(tmp_path: Path, index_topk: int) -> None:
    # 32 index heads: a key scores exactly 0 (every head's relu zero, a tie transformers' topk
    # breaks arbitrarily) with probability 2^-32
    out = make_tiny_v4(tmp_path / "v4", dtype="float32", index_topk=index_topk, index_n_heads=32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(4, 1024, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    assert sum(CHUNKS) == PROMPT
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits[0]
        rot = ours.model.rotary_emb
        tables = {t: vo.cos_sin_table(rot, t, PROMPT + 1) for t in ("main", "compress")}
        for layer in ours.model.layers:
            core = CoreLayer(layer.self_attn, tables, ours.config, index_topk)
            layer.self_attn.forward = core.forward
        p = 0
        for n in CHUNKS:
            pid = torch.arange(p, p + n).unsqueeze(0)
            got = ours(ids[:, p : p + n], position_ids=pid, use_cache=False).logits[0]
            torch.testing.assert_close(got, want[p : p + n], rtol=2e-3, atol=2e-3,
                                       msg=lambda m, p=p: f"tokens from {p}: {m}")  # fmt: skip
            p += n
