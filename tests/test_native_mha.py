"""Native MHA of the normal path (``native.attention_with_lse``, bf16 at every ISA level): output
and log-sum-exp against a float64 reference over shapes (causal squares, non-causal rectangles,
odd head dims, strided keys and values as the decompression hands them, empty key sets) and
hypothesis, argument errors, fake-tensor shapes, and the whole normal path through the native
implementation against the torch implementation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.ops import native
from mla_backend.ops import torch as torch_ops
from mla_backend.testing.cases import make_case
from mla_backend.testing.native_checks import check_mha

if not native.host_isas():
    pytest.skip("no native ISA level runs on this machine", allow_module_level=True)


def _rand(*shape: int, g: torch.Generator, s: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)


def _check(isa, H, Lq, Lk, D, Dv, causal, seed=0, strided=True, s=1.0):
    g = torch.Generator().manual_seed(seed)
    q = _rand(H, Lq, D, g=g, s=s)
    if strided:  # [L, H, D] buffers viewed as [H, L, D], as normal.decompress returns them
        k = _rand(Lk, H, D, g=g, s=s).transpose(0, 1)
        v = _rand(Lk, H, Dv, g=g).transpose(0, 1)
    else:
        k, v = _rand(H, Lk, D, g=g, s=s), _rand(H, Lk, Dv, g=g)
    scale = 1.0 / math.sqrt(D)
    o, lse = native.attention_with_lse(q, k, v, causal, scale, isa=isa)
    check_mha(o, lse, q, k, v, causal, scale)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize("L", [1, 5, 24, 63, 64, 65, 200])
@pytest.mark.parametrize("D,Dv", [(192, 128), (33, 17), (8, 70), (1, 1)])
def test_square_matches_float64(isa, causal, H, L, D, Dv):
    _check(isa, H, L, L, D, Dv, causal, seed=L * 7 + H)


@pytest.mark.parametrize("Lq,Lk", [(1, 300), (30, 100), (100, 30), (7, 0)])
def test_rectangles_non_causal(isa, Lq, Lk):
    _check(isa, 4, Lq, Lk, 192, 128, False, seed=Lq + Lk)


def test_sharp_scores_and_contiguous_inputs(isa):
    _check(isa, 2, 130, 130, 64, 64, True, seed=5, strided=False, s=6.0)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    H=st.integers(1, 5),
    Lq=st.integers(1, 90),
    Lk=st.integers(0, 140),
    D=st.integers(1, 80),
    Dv=st.integers(1, 80),
    causal=st.booleans(),
    seed=st.integers(0, 100),
)
def test_hypothesis_shapes(isa, H, Lq, Lk, D, Dv, causal, seed):
    if causal:
        Lk = Lq  # the normal path calls causal attention on the new tokens' own block
    _check(isa, H, Lq, Lk, D, Dv, causal, seed)


def test_bad_inputs_raise_clear_errors(isa):
    q = torch.randn(2, 4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        native.attention_with_lse(q.float(), q.float(), q.float(), True, 0.1, isa=isa)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        native.attention_with_lse(q, q[:, :, :4], q, True, 0.1, isa=isa)
    with pytest.raises(RuntimeError, match="last dims must be contiguous"):
        k = q.transpose(1, 2).contiguous().transpose(1, 2)
        native.attention_with_lse(q, k, q, True, 0.1, isa=isa)


def test_fake_tensor_shapes(isa):
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.randn(3, 5, 12).bfloat16())
        k = mode.from_tensor(torch.randn(3, 9, 12).bfloat16())
        v = mode.from_tensor(torch.randn(3, 9, 7).bfloat16())
        o, lse = native.op_namespace(isa).native_attention_with_lse(q, k, v, False, 0.3)
        assert o.shape == (3, 5, 7) and lse.shape == (3, 5) and lse.dtype == torch.float32


@pytest.mark.parametrize("chunk", [4096, 16])
def test_normal_path_native_vs_torch(isa, chunk):
    """The normal path (decompress + MHA, a chunked prefix merged by LSE) on the native
    implementation against the torch implementation, bf16."""
    dims = mb.MLADims(8, 64, 32, 16, 24)
    case = make_case(dims, [0, 40, 100], [37, 1, 70], 16, dtype=torch.bfloat16)
    outs = {}
    for impl in (native.Kernels(isa), torch_ops.Kernels()):
        plan = mb.plan(case.batch, dims, mb.Policy("normal"), impl=impl)
        outs[impl.name] = mb.normal_attention(
            case.q_nope, case.q_pe, case.kv_cache, plan, case.weights,
            dims.default_softmax_scale, chunk_tokens=chunk,
        )  # fmt: skip
    (o_n, lse_n), (o_t, lse_t) = outs["native"], outs["torch"]
    scale = max(1.0, o_t.abs().max().item())
    assert (o_n.double() - o_t.double()).abs().max().item() <= 2e-2 * scale
    assert (lse_n - lse_t).abs().max().item() <= 1e-3
