"""fp8 absorption bmm: torch._scaled_mm branch and the exact dequantize fallback vs bf16."""

from __future__ import annotations

import math

import pytest
import torch

import mla_backend as mb
from mla_backend.testing.cases import DIMS, make_case


@pytest.mark.parametrize("per_token", [True, False])
def test_scaled_mm_and_fallback_agree_and_bound_error(per_token: bool) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 5, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 128, 96, generator=g) / 11
    w_q, w_s = mb.quantize_fp8(w)
    exact = torch.bmm(a.float(), w)
    fast = mb.fp8_bmm(a, w_q, w_s, per_token=per_token, use_scaled_mm=True)
    slow = mb.fp8_bmm(a, w_q, w_s, per_token=per_token, use_scaled_mm=False)
    assert fast.dtype == torch.bfloat16
    # both branches compute the same quantized product (up to bf16 rounding of the output)
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=1e-2)
    # e4m3 has a 3-bit mantissa: relative error per element <= 2^-4; bound the matmul error
    rel = (fast.float() - exact).norm() / exact.norm()
    assert rel < 0.06, rel


def test_fp8_absorbed_layer_close_to_bf16() -> None:
    case = make_case(DIMS["lite"], [100, 3], [1, 5], 16, dtype=torch.bfloat16)
    w8 = mb.split_kv_b_proj(case.kv_b.to(torch.bfloat16), case.dims, keep_fp8=True)
    assert w8.fp8 and w8.W_UK.dtype == mb.FP8_DTYPE
    attn8 = mb.MLAAttention(case.dims, w8)
    out = attn8(case.q_nope, case.q_pe, case.kv_cache, case.plan("absorb")).float()
    ref = case.oracle()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.08, rel


def test_fp8_bmm_rejects_non_fp8_weight() -> None:
    with pytest.raises(ValueError, match="float32"):
        mb.fp8_bmm(torch.randn(1, 2, 3), torch.randn(1, 3, 4), torch.ones(()))


def test_scaled_mm_branch_is_taken_and_matches_dequantized(monkeypatch) -> None:
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 5, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 32, 16, generator=g)
    w_fp8, w_scale = mb.quantize_fp8(w)
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    got = mb.fp8_bmm(a, w_fp8, w_scale)  # auto: CPU supports _scaled_mm
    assert len(calls) == 3  # one scaled matmul per head
    a_q, a_scale = mb.quantize_fp8(a, per_token=True)
    ref = torch.bmm(a_q.double() * a_scale.double(), w_fp8.double() * w_scale.double())
    assert got.dtype == torch.bfloat16 and got.shape == (3, 5, 16)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("pow2", [False, True])
def test_group_quantization_rounds_each_group_with_its_own_scale(pow2: bool) -> None:
    """Per group of 64: scale = max(amax, eps) / 448 (a power of two rounded up with pow2),
    stored = e4m3(x / scale); checked against that definition group by group, over groups
    whose magnitudes span 1e-12 .. 1e3 (an all-zero group takes the eps scale)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 64, generator=g) * torch.logspace(-12, 3, 8)[None, :, None]
    x[0, 0] = 0.0
    q, s = mb.fp8.quantize_fp8_groups(x.reshape(3, 512).bfloat16(), 64, 1e-10, pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 512) and s.shape == (3, 8)
    xb = x.bfloat16().float()
    for i in range(3):
        for j in range(8):
            grp = xb[i, j]
            scale = max(grp.abs().max().item(), 1e-10) / 448.0
            if pow2:
                scale = 2.0 ** math.ceil(math.log2(scale))
            assert s[i, j].item() == pytest.approx(scale, rel=1e-6)
            want = (grp / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
            got = q[i, j * 64 : (j + 1) * 64]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="group_size 48"):
        mb.fp8.quantize_fp8_groups(x.reshape(3, 512), 48)
