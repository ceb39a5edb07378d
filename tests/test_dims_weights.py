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
    # small integers: every product and sum is exact in fp32 whatever the summation order
    # (the CPU's GEMM kernel), so the layout is checked bit for bit
    g = torch.Generator().manual_seed(0)
    q_nope = torch.randint(-4, 5, (7, 3, 2), generator=g).float()
    expect = torch.stack([q_nope[:, h] @ w[h * 6 : h * 6 + 2] for h in range(3)], 1)
    assert torch.equal(mb.absorb_q(q_nope, s), expect)
    o_lat = torch.randint(-4, 5, (7, 3, 5), generator=g).float()
    expect = torch.stack([o_lat[:, h] @ w[h * 6 + 2 : h * 6 + 6].T for h in range(3)], 1)
    assert torch.equal(mb.apply_W_UV(o_lat, s), expect)


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


# -- dims and weights from an engine (dims_from, weights_from_kv_b_proj, weights_from_w_kc_w_vc)


def test_dims_from_hf_config_engine_layer_and_dict() -> None:
    from types import SimpleNamespace

    fields = dict(kv_lora_rank=96, qk_nope_head_dim=48, qk_rope_head_dim=32, v_head_dim=40)
    hf = SimpleNamespace(num_attention_heads=8, q_lora_rank=64, hidden_size=128, **fields)
    assert mb.dims_from(hf) == mb.MLADims(8, 96, 48, 32, 40, q_lora_rank=64, hidden_size=128)
    assert mb.dims_from(hf, num_heads=2).num_heads == 2  # tensor parallel rank
    # SGLang's DeepseekV2AttentionMLA: num_local_heads (per rank) wins over num_attention_heads
    sgl = SimpleNamespace(num_local_heads=4, num_attention_heads=8, **fields)
    assert mb.dims_from(sgl).num_heads == 4
    # vLLM's MLA layer / impl: num_heads
    assert mb.dims_from(dict(num_heads=3, **fields)).num_heads == 3
    with pytest.raises(ValueError, match="missing v_head_dim"):
        mb.dims_from({"num_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                      "qk_rope_head_dim": 2})  # fmt: skip
    with pytest.raises(ValueError, match="num_local_heads/num_heads/num_attention_heads"):
        mb.dims_from(fields)
    with pytest.raises(ValueError, match="qk_rope_head_dim=7"):
        mb.dims_from({**fields, "qk_rope_head_dim": 7, "num_heads": 2})


def _fp8_kv_b(d: mb.MLADims, scale_kind: str, seed: int = 0):
    """An fp8 kv_b_proj weight, its scale and its dequantized fp32 value."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank
    w = torch.randn(rows, cols, generator=g)
    if scale_kind == "tensor":
        scale = w.abs().max() / 448
        full = scale.expand(rows, cols)
    elif scale_kind == "row":
        scale = w.abs().amax(1, keepdim=True) / 448
        full = scale.expand(rows, cols)
    else:  # blocks of 64 x 32
        br, bc = 64, 32
        nb_r, nb_c = -(-rows // br), -(-cols // bc)
        scale = torch.rand(nb_r, nb_c, generator=g) / 100 + 1e-3
        full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    q = (w / full).clamp(-448, 448).to(mb.FP8_DTYPE)
    return q, scale, q.float() * full


def _module(weight, **attrs):
    from types import SimpleNamespace

    return SimpleNamespace(weight=weight, **attrs)


def _split(full: torch.Tensor, d: mb.MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    w = full.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :].transpose(1, 2)


@pytest.mark.parametrize("scale_kind", ["tensor", "row", "block"])
@pytest.mark.parametrize("attr", ["weight_scale_inv", "weight_scale"])
def test_weights_from_kv_b_proj_fp8_scales(scale_kind: str, attr: str) -> None:
    d = mb.MLADims(2, 96, 48, 0, 40)
    q, scale, deq = _fp8_kv_b(d, scale_kind)
    extra = {"weight_block_size": [64, 32]} if scale_kind == "block" else {}
    w = mb.weights_from_kv_b_proj(_module(q, **{attr: scale}, **extra), d, dtype=torch.float32)
    uk, uv = _split(deq, d)
    torch.testing.assert_close(w.W_UK, uk)
    torch.testing.assert_close(w.W_UV, uv)


def test_weights_from_kv_b_proj_scale_lookup_order_and_block_size_from_quant_config() -> None:
    """weight_scale_inv is looked up before weight_scale; the block size may live on the
    module's quant_method.quant_config (SGLang) instead of the module (vLLM)."""
    from types import SimpleNamespace

    d = mb.MLADims(2, 96, 48, 0, 40)
    q, scale, deq = _fp8_kv_b(d, "block")
    qm = SimpleNamespace(quant_config=SimpleNamespace(weight_block_size=(64, 32)))
    mod = _module(q, weight_scale_inv=scale, weight_scale=scale * 1000, quant_method=qm)
    w = mb.weights_from_kv_b_proj(mod, d, dtype=torch.float32)
    torch.testing.assert_close(w.W_UK, _split(deq, d)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weights_from_kv_b_proj_dtype(dtype: torch.dtype) -> None:
    d = mb.MLADims(2, 96, 48, 32, 40)
    q, scale, deq = _fp8_kv_b(d, "tensor")
    w = mb.weights_from_kv_b_proj(_module(q, weight_scale=scale), d, dtype=dtype)
    assert w.W_UK.dtype == w.W_UV.dtype == dtype  # the model's dtype, not a fixed bf16
    torch.testing.assert_close(w.W_UK, _split(deq, d)[0].to(dtype))
    # a float weight keeps its dtype by default; a Linear module and a bare tensor agree
    lin = torch.nn.Linear(96, 2 * 88, bias=False).to(dtype)
    a = mb.weights_from_kv_b_proj(lin, d)
    b = mb.weights_from_kv_b_proj(lin.weight, d)
    assert a.W_UK.dtype == dtype and torch.equal(a.W_UK, b.W_UK)
    # a weight stored transposed ([r, H*(nope+v)], column-major fp8 GEMM layout) is accepted
    t = mb.weights_from_kv_b_proj(_module(q.t(), weight_scale=scale), d, dtype=dtype)
    torch.testing.assert_close(t.W_UV, _split(deq, d)[1].to(dtype))


def test_weights_from_kv_b_proj_bad_inputs_name_the_value() -> None:
    d = mb.MLADims(2, 96, 48, 0, 40)
    q, scale, _ = _fp8_kv_b(d, "block")
    with pytest.raises(ValueError, match="pass dtype="):
        mb.weights_from_kv_b_proj(_module(q, weight_scale=scale), d)
    with pytest.raises(ValueError, match="no weight_scale"):
        mb.weights_from_kv_b_proj(_module(q), d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale of shape \(3, 3\)"):  # default 128 x 128 blocks
        mb.weights_from_kv_b_proj(_module(q, weight_scale_inv=scale), d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight_block_size=\[0, 32\]"):
        mb.weights_from_kv_b_proj(
            _module(q, weight_scale_inv=scale, weight_block_size=[0, 32]), d, dtype=torch.float32
        )
    with pytest.raises(ValueError, match=r"\[176, 96\]"):
        mb.weights_from_kv_b_proj(torch.zeros(170, 96), d)
    with pytest.raises(ValueError, match="no weight tensor"):
        mb.weights_from_kv_b_proj(_module(None), d)
    with pytest.raises(ValueError, match="compute dtype torch.int8"):
        mb.weights_from_kv_b_proj(torch.zeros(176, 96), d, dtype=torch.int8)


def test_weights_from_w_kc_w_vc() -> None:
    d = mb.MLADims(3, 40, 12, 6, 20)
    g = torch.Generator().manual_seed(0)
    w_kc = torch.randn(3, 12, 40, generator=g)
    w_vc = torch.randn(3, 40, 20, generator=g)
    w = mb.weights_from_w_kc_w_vc(w_kc, w_vc, d, w_scale=1.0)  # SGLang's default scale
    assert w.W_UK.data_ptr() == w_kc.data_ptr() and w.W_UV.data_ptr() == w_vc.data_ptr()
    b = mb.weights_from_w_kc_w_vc(w_kc, w_vc, d, dtype=torch.bfloat16)
    assert b.W_UK.dtype == torch.bfloat16
    # fp8: per-tensor and per-head scales, dequantized to the model's dtype
    for s in (torch.tensor(0.01), torch.tensor([0.01, 0.02, 0.04])):
        sk = s.reshape(-1, 1, 1) if s.numel() > 1 else s
        qk, qv = (w_kc / sk).to(mb.FP8_DTYPE), (w_vc / sk).to(mb.FP8_DTYPE)
        f = mb.weights_from_w_kc_w_vc(qk, qv, d, w_scale=s, dtype=torch.float16)
        assert f.W_UK.dtype == torch.float16
        torch.testing.assert_close(f.W_UK, (qk.float() * sk).half())
        torch.testing.assert_close(f.W_UV, (qv.float() * sk).half())
    with pytest.raises(ValueError, match=r"w_kc shape \(3, 12, 41\)"):
        mb.weights_from_w_kc_w_vc(torch.zeros(3, 12, 41), w_vc, d)
    with pytest.raises(ValueError, match="no w_scale"):
        mb.weights_from_w_kc_w_vc(qk, qv, d, dtype=torch.float32)
    with pytest.raises(ValueError, match="pass dtype="):
        mb.weights_from_w_kc_w_vc(qk, qv, d, w_scale=0.1)
    with pytest.raises(ValueError, match=r"w_scale of shape \(2,\)"):
        mb.weights_from_w_kc_w_vc(qk, qv, d, w_scale=torch.ones(2), dtype=torch.float32)
    with pytest.raises(ValueError, match="w_scale=0.5"):
        mb.weights_from_w_kc_w_vc(w_kc, w_vc, d, w_scale=0.5)
    with pytest.raises(ValueError, match="int32"):
        mb.weights_from_w_kc_w_vc(w_kc.int(), w_vc.int(), d)
