"""Which kernels the native implementation's normal path calls, per ISA level: our native
decompression and MHA at every level below ``amx`` (torch's bf16 GEMM / SDPA there, without bf16
dot products, run at ~1 GFLOP/s), torch's AMX-backed ops at ``amx`` from
:data:`~mla_backend.ops.native.kernels.AMX_TORCH_MIN_ROWS` rows only where torch itself reaches
AMX (:func:`~mla_backend.ops.native.kernels.torch_bf16_on_amx`). The native ops are replaced by
spies around the torch implementation's (no build needed); the output is checked against the
independent reference of the paper's attention (:mod:`mla_backend.testing.reference`)."""

from __future__ import annotations

import pytest
import torch

import mla_backend as mb
from mla_backend.ops.native import kernels as native_kernels
from mla_backend.ops.torch import decompress as torch_decompress
from mla_backend.ops.torch import mha as torch_mha
from mla_backend.testing.reference import reference_mla_attention

DIMS = mb.MLADims(2, 32, 16, 8, 16)


def _run_normal(isa: str, monkeypatch: pytest.MonkeyPatch, prefix: int, new: int) -> list[str]:
    """Run the normal path at level ``isa`` over ``prefix`` cached + ``new`` tokens (bf16);
    returns the names of the native ops it called, asserting the output against the reference."""
    calls: list[str] = []

    def spy_decompress(c_kv, k_pe, W_UK, W_UV, *, isa=None):
        calls.append("decompress")
        return torch_decompress.decompress(c_kv, k_pe, W_UK, W_UV)

    def spy_attention(q, k, v, causal, scale, *, isa=None):
        calls.append("attention_with_lse")
        return torch_mha.attention_with_lse(q, k, v, causal, scale)

    monkeypatch.setattr(native_kernels.native, "decompress", spy_decompress)
    monkeypatch.setattr(native_kernels.native, "attention_with_lse", spy_attention)
    g = torch.Generator().manual_seed(prefix + new)
    d = DIMS
    L = prefix + new
    r, rope, nope = d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim
    latent = (torch.randn(L, r + rope, generator=g) / 4).to(torch.bfloat16)
    kv_b = (torch.randn(d.num_heads * (nope + d.v_head_dim), r, generator=g) / 8).to(
        torch.bfloat16
    )
    q_nope = torch.randn(new, d.num_heads, nope, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(new, d.num_heads, rope, generator=g).to(torch.bfloat16)
    cache = latent.view(L, 1, -1)  # page size 1, pages in order
    table = torch.arange(L, dtype=torch.int32).view(1, L)
    batch = mb.MLABatch.build([prefix], [new], table, 1, mb.Phase.EXTEND)
    plan = mb.plan(batch, d, mb.Policy("normal"), impl=native_kernels.Kernels(isa))
    scale = d.default_softmax_scale
    o, _ = mb.normal_attention(q_nope, q_pe, cache, plan, mb.split_kv_b_proj(kv_b, d), scale)
    ref = reference_mla_attention(
        q_nope, q_pe, [latent[:, :r]], [latent[:, r:]], kv_b, nope, d.v_head_dim, [new], scale
    )
    torch.testing.assert_close(o.float(), ref, atol=3e-2, rtol=3e-2)
    return calls


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_bf16"])
@pytest.mark.parametrize("prefix,new", [(0, 300), (40, 260)])
def test_below_amx_the_normal_path_runs_native_ops(
    isa: str, prefix: int, new: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_kernels, "torch_bf16_on_amx", lambda: True)
    calls = _run_normal(isa, monkeypatch, prefix, new)
    per_part = ["decompress", "attention_with_lse"]
    assert calls == per_part * (2 if prefix else 1)


def test_amx_uses_torch_only_where_torch_reaches_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_kernels, "torch_bf16_on_amx", lambda: False)
    assert _run_normal("amx", monkeypatch, 0, 300) == ["decompress", "attention_with_lse"]
    monkeypatch.setattr(native_kernels, "torch_bf16_on_amx", lambda: True)
    assert _run_normal("amx", monkeypatch, 0, 300) == []
    # below AMX_TORCH_MIN_ROWS our kernels serve the call at amx too
    assert _run_normal("amx", monkeypatch, 0, 40) == ["decompress", "attention_with_lse"]


@pytest.mark.parametrize("cap", ["AVX2", "avx512_core_bf16", "AVX512_CORE"])
def test_onednn_cap_below_amx_keeps_torch_off(cap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert native_kernels.torch_bf16_on_amx() is False
