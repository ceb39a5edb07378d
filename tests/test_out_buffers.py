"""``out=`` / ``lse=`` buffers: the per-layer calls write into the caller's tensors (views of a
larger engine buffer, strided) exactly what they return without them, on every implementation
this host runs, and refuse a buffer of the wrong shape, dtype or device."""

from __future__ import annotations

import pytest
import torch

import mla_backend as mb
from mla_backend.selection import impl_name
from mla_backend.testing.cases import DIMS, make_case

IMPLS = sorted({"torch", impl_name(torch.device("cpu"))})


def _engine_rows(T: int, width: int, dtype: torch.dtype, pad: int = 3) -> torch.Tensor:
    """An engine's output buffer [T + pad, width] filled with NaN (unwritten rows show)."""
    return torch.full((T + pad, width), float("nan"), dtype=dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["absorb", "normal", "cost"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_writes_into_a_view_of_the_engine_buffer(impl: str, mode: str, dtype) -> None:
    case = make_case(DIMS["odd"], [40, 0, 7], [1, 30, 6], 16, dtype=dtype, seed=11)
    plan = case.plan(mode, impl=impl)
    attn = mb.MLAAttention(case.dims, case.weights)
    ref = attn(case.q_nope, case.q_pe, case.kv_cache, plan)
    T, H, v = ref.shape
    buf = _engine_rows(T, H * v, dtype)
    view = buf[:T].view(T, H, v)
    got = attn(case.q_nope, case.q_pe, case.kv_cache, plan, out=view)
    assert got.data_ptr() == view.data_ptr()
    torch.testing.assert_close(view, ref, atol=0, rtol=0)
    assert torch.isnan(buf[T:]).all()  # nothing past the step's rows


@pytest.mark.parametrize("impl", IMPLS)
def test_absorbed_attention_out_and_lse(impl: str) -> None:
    case = make_case(DIMS["odd"], [17, 64, 3], [5, 9, 31], 16, seed=4)
    plan = case.plan("absorb", impl=impl)
    q_lat = mb.absorb_q(case.q_nope, case.weights)
    o_ref, lse_ref = mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, plan, 0.3)
    T, H, r = o_ref.shape
    o_buf = torch.full((T, H, r + 5), float("nan"))[..., :r]  # strided: rows of r + 5
    lse_buf = torch.full((H, T), float("nan")).t()  # transposed
    o, lse = mb.absorbed_attention(
        q_lat, case.q_pe, case.kv_cache, plan, 0.3, out=o_buf, lse=lse_buf
    )
    assert o.data_ptr() == o_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    torch.testing.assert_close(o_buf, o_ref, atol=0, rtol=0)
    torch.testing.assert_close(lse_buf, lse_ref, atol=0, rtol=0)


def test_bad_buffers_are_refused() -> None:
    case = make_case(DIMS["odd"], [3], [2], 16, seed=1)
    plan = case.plan("absorb", impl="torch")
    q_lat = mb.absorb_q(case.q_nope, case.weights)
    T, H = q_lat.shape[:2]
    with pytest.raises(ValueError, match=r"out is \(2, 3"):
        mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, plan, 1.0,
                              out=torch.empty(2, 3, 4))
    with pytest.raises(ValueError, match="lse is .*torch.float64"):
        mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, plan, 1.0,
                              lse=torch.empty(T, H, dtype=torch.float64))
    attn = mb.MLAAttention(case.dims, case.weights)
    with pytest.raises(ValueError, match="out is .*torch.bfloat16"):
        attn(case.q_nope, case.q_pe, case.kv_cache, plan,
             out=torch.empty(T, H, case.dims.v_head_dim, dtype=torch.bfloat16))
