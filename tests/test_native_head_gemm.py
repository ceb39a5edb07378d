"""Native per-head absorption GEMM (``native.pack_heads`` / ``native.head_gemm``, the bf16
``q_nope · W_UK`` and ``o_lat · W_UV`` of the native implementation): the packed layout element
by element, products against a float64 reference over a shape grid and hypothesis (odd K and N,
partial column blocks, strided queries, empty batches), argument errors, fake-tensor shapes, and
``MLAAttention`` on the native implementation against the torch implementation with and without
packed weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.ops import native
from mla_backend.ops import torch as torch_ops
from mla_backend.testing.cases import make_case
from mla_backend.testing.native_checks import check_bf16_gemm

if not native.host_isas():
    pytest.skip("no native ISA level runs on this machine", allow_module_level=True)

COLS = native.HEAD_GEMM_COLS


def _rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _check(isa: str, T: int, H: int, K: int, N: int, seed: int = 0, strided: bool = True) -> None:
    w = _rand(H, K, N, seed=seed)
    if strided:  # x as an engine hands it: a slice of a wider [T, H, K + extra] query
        x = _rand(T, H, K + 7, seed=seed + 1)[:, :, :K]
    else:
        x = _rand(T, H, K, seed=seed + 1)
    y = native.head_gemm(x, native.pack_heads(w, isa=isa), N, isa=isa)
    assert y.shape == (T, H, N) and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = torch.einsum("thk,hkn->thn", x.double(), w.double())
    mag = torch.einsum("thk,hkn->thn", x.double().abs(), w.double().abs())
    check_bf16_gemm(y, ref, mag, f"T{T} H{H} K{K} N{N}")


def test_packed_layout_element_by_element(isa):
    H, K, N = 3, 5, COLS + 6
    w = _rand(H, K, N, seed=3)
    p = native.pack_heads(w, isa=isa)
    nb, kp = -(-N // COLS), -(-K // 2)
    assert p.shape == (H, nb, kp, COLS, 2) and p.dtype == torch.bfloat16
    expect = torch.zeros(H, nb, kp, COLS, 2, dtype=torch.bfloat16)
    for h in range(H):
        for k in range(K):
            for n in range(N):
                expect[h, n // COLS, k // 2, n % COLS, k % 2] = w[h, k, n]
    assert torch.equal(p.view(torch.int16), expect.view(torch.int16))


@pytest.mark.parametrize("T", [0, 1, 5, 7, 13])
@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize("K,N", [(1, 1), (2, 16), (33, 70), (128, 512), (512, 128), (96, 200)])
def test_matches_float64(isa, T, H, K, N):
    _check(isa, T, H, K, N, seed=T * 100 + H)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    "H,K,N", [(1, 7, 65), (16, 128, 512), (128, 512, 128), (3, 127, 129), (5, 33, 64)]
)
def test_decode_rows(isa, T, H, K, N):
    """Decode's few rows (the small-row kernels: all 64 columns per pass, the row block packed
    once per head and reused across its column blocks), odd K and N, strided x, 1..128 heads."""
    _check(isa, T, H, K, N, seed=T * 7 + H + K)


@pytest.mark.parametrize("T", [8, 16, 33, 64, 300])
def test_many_rows_and_128_heads(isa, T):
    """Row blocks of 8..32 rows (AMX tiles where the CPU has them; a tail of the last one),
    128 heads."""
    _check(isa, T, 16, 128, 512, seed=T)
    _check(isa, T, 128, 128, 512, seed=1, strided=False)


def test_large_token_count(isa):
    _check(isa, 2048, 2, 96, 70, seed=4)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    T=st.integers(0, 20),
    H=st.integers(1, 9),
    K=st.integers(1, 140),
    N=st.integers(1, 150),
    seed=st.integers(0, 1000),
    strided=st.booleans(),
)
def test_hypothesis_shapes(isa, T, H, K, N, seed, strided):
    _check(isa, T, H, K, N, seed, strided)


def test_bad_inputs_raise_clear_errors(isa):
    w = _rand(2, 8, 16, seed=0)
    p = native.pack_heads(w, isa=isa)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.pack_heads(w.half(), isa=isa)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        native.head_gemm(torch.randn(3, 2, 8, dtype=torch.float16), p, 16, isa=isa)
    with pytest.raises(RuntimeError, match="does not match"):
        native.head_gemm(_rand(3, 2, 10, seed=1), p, 16, isa=isa)
    with pytest.raises(RuntimeError, match="does not match"):
        native.head_gemm(_rand(3, 2, 8, seed=1), p, 200, isa=isa)
    with pytest.raises(RuntimeError, match="last dim must be contiguous"):
        native.head_gemm(_rand(3, 8, 2, seed=1).transpose(1, 2), p, 16, isa=isa)


def test_fake_tensor_shapes(isa):
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode() as mode:
        w = mode.from_tensor(_rand(4, 33, 70, seed=0))
        p = native.op_namespace(isa).native_pack_heads(w)
        assert p.shape == (4, 2, 17, COLS, 2)
        x = mode.from_tensor(_rand(3, 4, 33, seed=1))
        y = native.op_namespace(isa).native_head_gemm(x, p, 70)
        assert y.shape == (3, 4, 70) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_mla_attention_native_vs_torch(isa, dtype):
    """The layer on the native implementation (packed bf16 weights at every ISA level, torch's
    bmm for the other dtypes) against the same layer on the torch implementation."""
    dims = mb.MLADims(16, 64, 32, 16, 24)
    case = make_case(dims, [0, 40, 7], [1, 1, 5], 16, dtype=dtype)
    attn = mb.MLAAttention(dims, case.weights)
    nat = native.Kernels(isa)
    packed = attn._weights_for(nat)
    expect_packed = dtype == torch.bfloat16
    assert (packed.W_UK_packed is not None) == expect_packed
    assert (packed.W_UV_packed is not None) == expect_packed
    outs = {}
    for impl in (nat, torch_ops.Kernels()):
        plan = mb.plan(case.batch, dims, mb.Policy("absorb"), impl=impl)
        outs[impl.name] = attn(case.q_nope, case.q_pe, case.kv_cache, plan).double()
    ref = outs["torch"]
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    err = (outs["native"] - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err
