"""Native decompression of the normal path (``native.decompress``: ``k = [c_kv·W_UK[h]^T ;
k_pe]``, ``v = c_kv·W_UV[h]``, bf16 with fp32 sums): against a float64 reference over a shape
grid (odd r / nope / v, 1..128 heads, 1..4K tokens, no rope) and hypothesis, strided inputs
as the normal path hands them (c_kv and k_pe slices of one latent row, a transposed weight),
argument errors, fake-tensor shapes, and the seam: the native implementation's ``decompress``
against the torch implementation's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_backend.ops import native
from mla_backend.ops import torch as torch_ops
from mla_backend.testing.native_checks import check_bf16_gemm

if not native.host_isas():
    pytest.skip("no native ISA level runs on this machine", allow_module_level=True)


def _rand(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _check(isa: str, L: int, H: int, r: int, nope: int, rope: int, v_dim: int, seed: int = 0,
           uv_transposed: bool = False) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    latent = _rand(L, r + rope, g=g)  # c_kv and k_pe as slices of one row, like the cache's
    c_kv, k_pe = latent[:, :r], latent[:, r:]
    W_UK = _rand(H, nope, r, g=g)
    W_UV = _rand(H, v_dim, r, g=g).transpose(1, 2) if uv_transposed else _rand(H, r, v_dim, g=g)
    k, v = native.decompress(c_kv, k_pe, W_UK, W_UV, isa=isa)
    assert k.shape == (H, L, nope + rope) and v.shape == (H, L, v_dim)
    assert k.dtype == v.dtype == torch.bfloat16
    assert torch.equal(k[:, :, nope:], k_pe.unsqueeze(0).expand(H, L, rope))
    for got, ref, mag in (
        (k[:, :, :nope], torch.einsum("lk,hdk->hld", c_kv.double(), W_UK.double()),
         torch.einsum("lk,hdk->hld", c_kv.double().abs(), W_UK.double().abs())),
        (v, torch.einsum("lk,hkd->hld", c_kv.double(), W_UV.double()),
         torch.einsum("lk,hkd->hld", c_kv.double().abs(), W_UV.double().abs())),
    ):  # fmt: skip
        check_bf16_gemm(got, ref, mag, f"L{L} H{H} r{r}")


@pytest.mark.parametrize("L", [1, 7, 64, 65, 300])
@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize(
    "r,nope,rope,v_dim", [(512, 128, 64, 128), (33, 17, 5, 9), (2, 1, 0, 1), (96, 40, 8, 70)]
)
def test_matches_float64(isa, L, H, r, nope, rope, v_dim):
    _check(isa, L, H, r, nope, rope, v_dim, seed=L * 10 + H)


def test_many_tokens_many_heads_transposed_weight(isa):
    _check(isa, 4096, 2, 64, 16, 8, 24, seed=1)
    _check(isa, 70, 128, 128, 32, 16, 32, seed=2, uv_transposed=True)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    L=st.integers(1, 200),
    H=st.integers(1, 6),
    r=st.integers(1, 130),
    nope=st.integers(1, 70),
    rope=st.integers(0, 20),
    v_dim=st.integers(1, 70),
    seed=st.integers(0, 1000),
    uv_transposed=st.booleans(),
)
def test_hypothesis_shapes(isa, L, H, r, nope, rope, v_dim, seed, uv_transposed):
    _check(isa, L, H, r, nope, rope, v_dim, seed, uv_transposed)


def test_empty_latent(isa):
    g = torch.Generator().manual_seed(0)
    k, v = native.decompress(
        _rand(0, 8, g=g), _rand(0, 4, g=g), _rand(2, 3, 8, g=g), _rand(2, 8, 5, g=g), isa=isa
    )
    assert k.shape == (2, 0, 7) and v.shape == (2, 0, 5)


def test_bad_inputs_raise_clear_errors(isa):
    g = torch.Generator().manual_seed(0)
    c, p, uk, uv = _rand(5, 8, g=g), _rand(5, 4, g=g), _rand(2, 3, 8, g=g), _rand(2, 8, 6, g=g)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        native.decompress(c.float(), p, uk, uv, isa=isa)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        native.decompress(c, p, uk[:, :, :4], uv, isa=isa)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        native.decompress(c, p[:4], uk, uv, isa=isa)
    with pytest.raises(RuntimeError, match="last dims must be contiguous"):
        native.decompress(_rand(8, 5, g=g).t(), p, uk, uv, isa=isa)
    with pytest.raises(RuntimeError, match=r"c_kv \[L, r\]"):
        native.decompress(c[None], p, uk, uv, isa=isa)


def test_fake_tensor_shapes(isa):
    from torch._subclasses import FakeTensorMode

    g = torch.Generator().manual_seed(0)
    with FakeTensorMode() as mode:
        c, p = mode.from_tensor(_rand(9, 16, g=g)), mode.from_tensor(_rand(9, 4, g=g))
        uk, uv = mode.from_tensor(_rand(3, 5, 16, g=g)), mode.from_tensor(_rand(3, 16, 7, g=g))
        k, v = native.op_namespace(isa).native_decompress(c, p, uk, uv)
        assert k.shape == (9, 3, 9) and v.shape == (9, 3, 7) and k.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_seam_native_vs_torch(isa, dtype):
    """``Kernels.decompress`` of the native implementation (native for bf16, torch.mm for the
    rest) against the torch implementation's."""
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(130, 72, generator=g).to(dtype)
    W_UK = torch.randn(4, 16, 64, generator=g).to(dtype)
    W_UV = torch.randn(4, 64, 24, generator=g).to(dtype)
    args = (latent[:, :64], latent[:, 64:], W_UK, W_UV)
    k_n, v_n = native.Kernels(isa).decompress(*args)
    k_t, v_t = torch_ops.Kernels().decompress(*args)
    assert k_n.shape == k_t.shape and v_n.shape == v_t.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in ((k_n, k_t), (v_n, v_t)):
        assert (a.double() - b.double()).abs().max().item() <= tol * b.abs().max().item()
