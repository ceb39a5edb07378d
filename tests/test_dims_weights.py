"""Dims validation, HF config parsing, yarn scale, and the kv_b_proj split (incl. fp8)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_backend as mb


def test_deepseek_v2_config() -> None:
    cfg = {
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "hidden_size": 5120,
    }
    d = mb.MLADims.from_hf_config(cfg)
    assert (d.latent_dim, d.qk_head_dim, d.q_lora_rank) == (576, 192, 1536)
    assert d.kv_bytes_per_token(2) == 1152
    assert d.decompressed_bytes_per_token(2) == 81920
    assert math.isclose(d.default_softmax_scale, 1 / math.sqrt(192))
    assert mb.MLADims.from_hf_config(cfg, num_heads=16).num_heads == 16


def test_config_object_and_missing_fields() -> None:
    class Cfg:
        num_attention_heads = 4
        kv_lora_rank = 96
        qk_nope_head_dim = 48
        qk_rope_head_dim = 32
        v_head_dim = 40

    assert mb.MLADims.from_hf_config(Cfg()).kv_lora_rank == 96
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mb.MLADims.from_hf_config({"num_attention_heads": 4})


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("num_heads", 0, "num_heads=0"),
        ("kv_lora_rank", -3, "kv_lora_rank=-3"),
        ("qk_rope_head_dim", 7, "qk_rope_head_dim=7"),
        ("v_head_dim", 1.5, "v_head_dim must be an int"),
        ("q_lora_rank", 0, "q_lora_rank=0"),
    ],
)
def test_bad_dims_name_the_value(field: str, value: object, msg: str) -> None:
    kw = dict(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    kw[field] = value
    with pytest.raises(ValueError, match=msg):
        mb.MLADims(**kw)


def test_yarn_scale() -> None:
    d = mb.MLADims(2, 8, 128, 64, 8)
    rs = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}
    m = 0.1 * math.log(40) + 1
    assert math.isclose(mb.yarn_softmax_scale(d, rs), m * m / math.sqrt(192))
    assert mb.yarn_softmax_scale(d, None) == d.default_softmax_scale
    with pytest.raises(ValueError, match="'linear'"):
        mb.yarn_softmax_scale(d, {"type": "linear", "factor": 2})


def test_split_layout() -> None:
    d = mb.MLADims(3, 5, 2, 0, 4)
    w = torch.arange(3 * 6 * 5, dtype=torch.float32).view(18, 5)
    s = mb.split_kv_b_proj(w, d)
    # head h rows: h*6 .. h*6+1 are W_UK (nope=2), h*6+2 .. h*6+5 are W_UV (v=4)
    for h in range(3):
        assert torch.equal(s.W_UK[h], w[h * 6 : h * 6 + 2])
        assert torch.equal(s.W_UV[h], w[h * 6 + 2 : h * 6 + 6].T)
    q_nope = torch.randn(7, 3, 2)
    expect = torch.stack([q_nope[:, h] @ w[h * 6 : h * 6 + 2] for h in range(3)], 1)
    torch.testing.assert_close(mb.absorb_q(q_nope, s), expect)
    o_lat = torch.randn(7, 3, 5)
    expect = torch.stack([o_lat[:, h] @ w[h * 6 + 2 : h * 6 + 6].T for h in range(3)], 1)
    torch.testing.assert_close(mb.apply_W_UV(o_lat, s), expect)


@pytest.mark.parametrize("scale_kind", ["tensor", "row", "block"])
def test_fp8_weight_dequantized(scale_kind: str) -> None:
    d = mb.MLADims(2, 256, 64, 0, 64)
    w = torch.randn(256, 256)
    if scale_kind == "tensor":
        scale = w.abs().max() / 448
        q = (w / scale).to(mb.FP8_DTYPE)
        deq = q.float() * scale
    elif scale_kind == "row":
        scale = w.abs().amax(1, keepdim=True) / 448
        q = (w / scale).to(mb.FP8_DTYPE)
        deq = q.float() * scale
    else:  # DeepSeek-V3 style 128x128 blocks
        blocks = w.view(2, 128, 2, 128).abs().amax(dim=(1, 3)) / 448  # [2, 2]
        full = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = (w / full).to(mb.FP8_DTYPE)
        scale, deq = blocks, q.float() * full
    s = mb.split_kv_b_proj(q, d, weight_scale=scale, dtype=torch.float32)
    H_deq = deq.view(2, 128, 256)
    torch.testing.assert_close(s.W_UV, H_deq[:, 64:].transpose(1, 2))
    torch.testing.assert_close(s.W_UK, deq.view(2, 128, 256)[:, :64])


def test_bad_weights_name_the_value() -> None:
    d = mb.MLADims(2, 8, 4, 2, 4)
    with pytest.raises(ValueError, match=r"\[16, 8\]"):
        mb.split_kv_b_proj(torch.zeros(15, 8), d)
    with pytest.raises(ValueError, match="int32"):
        mb.split_kv_b_proj(torch.zeros(16, 8, dtype=torch.int32), d)
    with pytest.raises(ValueError, match="no weight_scale"):
        mb.split_kv_b_proj(torch.zeros(16, 8).to(mb.FP8_DTYPE), d)
    with pytest.raises(ValueError, match=r"scale of shape \(3,\)"):
        mb.split_kv_b_proj(torch.zeros(16, 8).to(mb.FP8_DTYPE), d, weight_scale=torch.ones(3))
    with pytest.raises(ValueError, match=r"scale of shape \(2, 2\)"):  # 16 rows: 1 block of 128
        mb.split_kv_b_proj(torch.zeros(16, 8).to(mb.FP8_DTYPE), d, weight_scale=torch.ones(2, 2))


def test_fp8_block_scale_with_partial_blocks() -> None:
    """300 rows in 128-row blocks: the last block is partial (rows 256..299); every row must
    get its own block's scale (a block size inferred by division would shift them)."""
    d = mb.MLADims(3, 64, 50, 0, 50)
    w = torch.randn(300, 64)
    blocks = torch.tensor([[1.0], [2.0], [4.0]]) / 448  # [ceil(300/128), ceil(64/128)]
    row_scale = torch.cat([blocks[0].expand(128), blocks[1].expand(128), blocks[2].expand(44)])
    q = (w / row_scale[:, None]).clamp(-448, 448).to(mb.FP8_DTYPE)
    s = mb.split_kv_b_proj(q, d, weight_scale=blocks, dtype=torch.float32)
    full = (q.float() * row_scale[:, None]).view(3, 100, 64)
    torch.testing.assert_close(s.W_UK, full[:, :50])
    torch.testing.assert_close(s.W_UV, full[:, 50:].transpose(1, 2))
    s2 = mb.split_kv_b_proj(
        q, d, weight_scale=torch.ones(10, 1), dtype=torch.float32, weight_block_size=(30, 64)
    )
    torch.testing.assert_close(s2.W_UK, q.float().view(3, 100, 64)[:, :50])
