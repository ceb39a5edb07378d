"""What the DeepSeek-V4 tests share (``tests/test_v4_*.py``): tiny configs of transformers'
``DeepseekV4`` (the oracle, fp32 eager; imported on use), its modules with random weights, the
random chunking of requests into steps, slots of positions in paged caches, and the engine's part
of a compressor step (transformers' projections, then the core's :mod:`mla_backend.compressor`)."""

from __future__ import annotations

import random
from typing import Any

import torch

from .. import compressor as cz
from ..batch import MLABatch

KINDS = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
         "hca": "heavily_compressed_attention"}  # fmt: skip


def v4_config(
    kind: str, *, hidden: int = 32, heads: int = 2, head_dim: int = 64, rope: int = 16,
    q_lora: int = 24, index_heads: int = 2, index_head_dim: int = 16, index_topk: int = 4,
    csa_ratio: int = 4, hca_ratio: int = 128, window: int = 8, o_groups: int = 1,
) -> Any:  # fmt: skip
    """A one-layer ``DeepseekV4Config`` of layer ``kind`` (``KINDS``), eager attention, yarn RoPE
    on the compressed branches (as V4)."""
    import transformers

    cfg = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
        head_dim=head_dim, partial_rotary_factor=rope / head_dim, q_lora_rank=q_lora,
        index_n_heads=index_heads, index_head_dim=index_head_dim, index_topk=index_topk,
        layer_types=[KINDS[kind]],
        compress_rates={KINDS["csa"]: csa_ratio, KINDS["hca"]: hca_ratio},
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 256},
        sliding_window=window, o_groups=o_groups, o_lora_rank=8, max_position_embeddings=4096,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def randomize(module: torch.nn.Module) -> torch.nn.Module:
    """Random weights (transformers leaves sinks and position biases uninitialized): RMSNorm
    weights around 1, matrices at 1 / sqrt(fan-in), other vectors N(0, 0.5); fp32, eval."""
    module.float().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if p.dim() < 2 else p.shape[-1] ** -0.5)
    return module


def chunk_schedules(
    rng: random.Random, n_reqs: int, lengths: tuple[int, int], sizes: list[int]
) -> list[list[int]]:
    """Per request, a length in ``lengths`` (inclusive) cut into chunks drawn from ``sizes``:
    a prefill, its continuations and decode steps (step s feeds every request its chunk s)."""
    out = []
    for _ in range(n_reqs):
        left, chunks = rng.randint(*lengths), []
        while left:
            n = min(left, rng.choice(sizes))
            chunks.append(n)
            left -= n
        out.append(chunks)
    return out


def slots(
    table: torch.Tensor, reqs: torch.Tensor, pos: torch.Tensor, page_size: int
) -> torch.Tensor:
    """int64 slots of positions ``pos`` of requests ``reqs`` through ``table`` [B, pages]."""
    return table.long()[reqs, pos // page_size] * page_size + pos % page_size


def cos_sin_table(rotary: torch.nn.Module, rope_type: str, n: int) -> torch.Tensor:
    """transformers' V4 RoPE (``rope_type`` main / compress) for positions 0 .. n-1 as the core's
    table [n, rope] (cos of each pair, then sin)."""
    cos, sin = rotary(torch.zeros(1), torch.arange(n).unsqueeze(0), layer_type=rope_type)
    return torch.cat([cos[0], sin[0]], -1).float()


def compress_step(
    comp: torch.nn.Module, spec: cz.CompressorSpec, h: torch.Tensor, batch: MLABatch,
    state: torch.Tensor, state_table: torch.Tensor, cos_sin: torch.Tensor,
) -> tuple[cz.CompressSchedule, torch.Tensor]:  # fmt: skip
    """One step of a transformers compressor module (``kv_proj``, ``gate_proj``,
    ``position_bias``, ``kv_norm``) through the core: save the step's state rows (slots of
    ``state_table`` at ``batch``'s page size) and compress what it completes -> (schedule,
    entries [E, d] fp32)."""
    pos = batch.positions()
    reqs = torch.repeat_interleave(torch.arange(batch.num_reqs), torch.tensor(batch.new_lens))
    with torch.no_grad():
        kv, score = comp.kv_proj(h), comp.gate_proj(h)
    cz.save_states(kv, score, comp.position_bias, pos, state,
                   slots(state_table, reqs, pos, batch.page_size), spec)  # fmt: skip
    sched = cz.schedule(batch, spec.ratio)
    return sched, cz.compress(state, state_table, sched, spec, comp.kv_norm.weight.detach(),
                              cos_sin)  # fmt: skip
