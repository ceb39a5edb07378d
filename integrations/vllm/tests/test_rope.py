"""Why the plugin forces native RoPE: vLLM CPU's ``rotary_embedding`` custom op rotates
DeepSeek's 3-D query ``[T, H, rope]`` (interleaved, ``is_neox_style=False``) wrongly.

The reference below is the DeepSeek-V2 RoPE written from its definition (pairs
``(x[2i], x[2i+1])`` rotated by ``pos * theta**(-2i/d)``), independent of vLLM. The engine-level
proof that our backend comes out right is test_e2e (greedy tokens identical to transformers).
"""

from __future__ import annotations

import pytest
import torch

T, H, D, THETA = 7, 4, 64, 10000.0


def _reference_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    inv = THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # [D/2]
    ang = pos.double()[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x0, x1 = x.double()[..., 0::2], x.double()[..., 1::2]
    out = torch.empty_like(x, dtype=torch.float64)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out.float()


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(D, D, 4096, THETA, False, torch.float32)


def _inputs():
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 1, 2, 5, 17, 300, 1000])
    return pos, torch.randn(T, H, D, generator=g), torch.randn(T, 1, D, generator=g)


def test_native_rope_matches_definition(rope) -> None:
    pos, q, k = _inputs()
    qn, kn = rope.forward_native(pos, q.clone(), k.clone())
    torch.testing.assert_close(qn.view(T, H, D), _reference_rope(q, pos), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kn.view(T, 1, D), _reference_rope(k, pos), atol=1e-4, rtol=1e-4)


def test_cpu_custom_op_is_wrong_for_3d_query(rope) -> None:
    """Pins the upstream bug the plugin works around. If this fails, vLLM fixed its op and
    ``force_native_rope`` in compat.py can be dropped."""
    pos, q, k = _inputs()
    qc, kc = rope.forward_cpu(pos, q.clone(), k.clone())
    ref_q = _reference_rope(q, pos)
    torch.testing.assert_close(kc.view(T, 1, D), _reference_rope(k, pos), atol=1e-4, rtol=1e-4)
    assert (qc.view(T, H, D) - ref_q).abs().max() > 0.1
    # the same op is right on the flattened [T, H * rope] query
    qf, _ = rope.forward_cpu(pos, q.clone().reshape(T, H * D), k.clone())
    torch.testing.assert_close(qf.view(T, H, D), ref_q, atol=1e-4, rtol=1e-4)


def test_plugin_forces_native_rope() -> None:
    from types import SimpleNamespace

    from mla_backend_integrations.vllm.compat import force_native_rope

    for ops in ([], ["+rotary_embedding"], ["none", "-rotary_embedding"]):
        cfg = SimpleNamespace(compilation_config=SimpleNamespace(custom_ops=list(ops)))
        force_native_rope(cfg)
        assert "-rotary_embedding" in cfg.compilation_config.custom_ops
        assert "+rotary_embedding" not in cfg.compilation_config.custom_ops
