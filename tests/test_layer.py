"""The full MLA layer (both variants) run step by step (prefill chunks, extends, decodes)
against the whole-sequence reference layer; RoPE/yarn properties."""

from __future__ import annotations

import math

import pytest
import torch

import mla_backend as mb
from mla_backend.testing.decompressed import DecompressedCache
from mla_backend.testing.layer import MLALayer
from mla_backend.testing.rope import DeepseekRope, rope_inv_freq

LAYER_DIMS = [
    mb.MLADims(4, 64, 32, 16, 24, q_lora_rank=48, hidden_size=96),
    mb.MLADims(3, 40, 12, 0, 20, q_lora_rank=None, hidden_size=64),
    mb.MLADims(16, 512, 128, 64, 128, q_lora_rank=None, hidden_size=256),
]


def make_layer(dims: mb.MLADims, variant: str, policy: str, seed: int = 0) -> MLALayer:
    torch.manual_seed(seed)
    layer = MLALayer(dims, variant=variant, policy=mb.Policy(policy))
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / math.sqrt(p.shape[1]))
            else:
                p.uniform_(0.5, 1.5)
    return layer


def ref_weights(layer: MLALayer) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in layer.state_dict().items()}


# Each request: list of step sizes (first = prefill chunk, then extends/decodes).
SCHEDULES = [[5, 3, 1, 1], [1, 1, 1], [9, 1, 4, 1]]


@pytest.mark.parametrize("dims", LAYER_DIMS, ids=["qlora", "norope", "lite"])
@pytest.mark.parametrize(
    "variant,policy",
    [("A_CC_ME", "absorb"), ("A_CC_ME", "normal"), ("A_CC_ME", "cost"), ("CD", "absorb")],
)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_layer_steps_match_reference(
    dims: mb.MLADims, variant: str, policy: str, page_size: int
) -> None:
    layer = make_layer(dims, variant, policy)
    g = torch.Generator().manual_seed(1)
    total = [sum(s) for s in SCHEDULES]
    hidden = [torch.randn(t, dims.hidden_size, generator=g) for t in total]
    pages = [-(-t // page_size) for t in total]
    perm = torch.randperm(sum(pages) + 1, generator=g)  # physical pages in shuffled order
    block_table = torch.zeros(len(total), max(pages), dtype=torch.int32)
    k = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = perm[k : k + n]
        k += n
    kv_cache = torch.zeros(sum(pages) + 1, page_size, dims.latent_dim)
    cd = DecompressedCache(
        dims.num_heads, dims.qk_head_dim, dims.v_head_dim, max(total), len(total), torch.float32
    )
    outs: list[list[torch.Tensor]] = [[] for _ in total]
    done = [0] * len(total)
    for step in range(max(len(s) for s in SCHEDULES)):
        new = [s[step] if step < len(s) else 0 for s in SCHEDULES]
        batch = mb.MLABatch.build(done, new, block_table, page_size)
        h = torch.cat([hidden[i][done[i] : done[i] + n] for i, n in enumerate(new)])
        slots = torch.tensor(
            [
                int(block_table[i, t // page_size]) * page_size + t % page_size
                for i, n in enumerate(new)
                for t in range(done[i], done[i] + n)
            ]
        )
        with torch.no_grad():
            out = (
                layer(h, batch, kv_cache, slots)
                if variant == "A_CC_ME"
                else layer.forward_cd(h, batch, cd)
            )
        for i, n in enumerate(new):
            outs[i].append(out[batch.cu_new[i] : batch.cu_new[i] + n])
            done[i] += n
    for i in range(len(total)):
        ref = mb.testing.reference.reference_mla_layer(
            ref_weights(layer),
            hidden[i],
            dims.num_heads,
            dims.kv_lora_rank,
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
        )
        torch.testing.assert_close(torch.cat(outs[i]), ref, atol=2e-4, rtol=2e-4)


def test_layer_bf16_close_to_fp32_reference() -> None:
    dims = LAYER_DIMS[2]
    layer = make_layer(dims, "A_CC_ME", "cost").to(torch.bfloat16)
    hidden = torch.randn(12, dims.hidden_size)
    batch = mb.MLABatch.build([0], [12], torch.tensor([[1]], dtype=torch.int32), 16)
    kv = torch.zeros(2, 16, dims.latent_dim, dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(hidden.bfloat16(), batch, kv, torch.arange(16, 28)).float()
    ref = mb.testing.reference.reference_mla_layer(
        ref_weights(layer), hidden.bfloat16(), 16, 512, 128, 64, 128
    )
    assert (out - ref).norm() / ref.norm() < 0.03


def test_bad_variant_names_value() -> None:
    with pytest.raises(ValueError, match="'XYZ'"):
        MLALayer(LAYER_DIMS[0], variant="XYZ")


def test_yarn_frequencies() -> None:
    base, dim = 10000.0, 64
    plain, m1 = rope_inv_freq(dim, base)
    yarn, mag = rope_inv_freq(
        dim,
        base,
        {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
    )
    assert m1 == 1.0 and mag == pytest.approx(1.0)  # mscale == mscale_all_dim
    # highest frequencies (many rotations within the original context) are kept ...
    torch.testing.assert_close(yarn[:4], plain[:4])
    # ... the lowest are interpolated by the factor, and everything lies in between
    torch.testing.assert_close(yarn[-4:], plain[-4:] / 40)
    assert bool(((yarn <= plain + 1e-9) & (yarn >= plain / 40 - 1e-9)).all())
    same, _ = rope_inv_freq(dim, base, {"type": "yarn", "factor": 1.0})
    torch.testing.assert_close(same, plain)


def test_rope_preserves_norm_and_relative_positions() -> None:
    rope = DeepseekRope(16)
    x = torch.randn(1, 3, 16).expand(6, 3, 16)
    y = rope(x, torch.arange(6))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # <R(a) q, R(b) k> depends on a - b only
    q, k = torch.randn(16), torch.randn(16)

    def dot(a: int, b: int) -> torch.Tensor:
        return (
            rope(q[None, None], torch.tensor([a])) * rope(k[None, None], torch.tensor([b]))
        ).sum()

    torch.testing.assert_close(dot(5, 2), dot(13, 10))


def test_layer_follows_weight_changes_and_runs_with_autograd_on() -> None:
    dims = LAYER_DIMS[1]
    layer = make_layer(dims, "A_CC_ME", "absorb")
    hidden = torch.randn(5, dims.hidden_size)
    batch = mb.MLABatch.build([0], [5], torch.tensor([[1, 2]], dtype=torch.int32), 4)

    def run() -> torch.Tensor:
        kv = torch.zeros(3, 4, dims.latent_dim)
        return layer(hidden, batch, kv, torch.arange(4, 9))  # no torch.no_grad() here

    before = run()
    with torch.no_grad():
        layer.kv_b_proj.weight.mul_(3.0)
    after = run()
    ref = mb.testing.reference.reference_mla_layer(
        ref_weights(layer),
        hidden,
        dims.num_heads,
        dims.kv_lora_rank,
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
    )
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after.detach(), ref, atol=2e-4, rtol=2e-4)
