"""SGLang's own MLA attention harness drives ``mla_absorb`` (the absorbed path).

``sglang.test.kits.attention_unittest.attention_methods.mla_attention`` builds a tiny
DeepSeek-style attention module, a real ``MLATokenToKVPool`` / ``ReqToTokenPool`` with
shuffled pages, a ``ForwardBatch``, and compares the backend's output with its own fp32
reference (atol = rtol = 3e-2). It passes the concatenated query ``[q_lat ; q_pe]``.
"""

from __future__ import annotations

import pytest
import torch
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mh

CASES = mh.make_mla_cases("mla_absorb")


class _NoSkip:
    """The harness skips a case when the backend fails to build; here that is a failure."""

    def skipTest(self, reason: str) -> None:  # noqa: N802 (unittest's name)
        raise AssertionError(f"backend could not be built: {reason}")


def test_cases_cover_decode_and_extend() -> None:
    names = {c.name for c in CASES}
    assert len(CASES) == 10
    assert any(c.forward_mode.is_decode() for c in CASES)
    assert any(c.forward_mode.is_extend() for c in CASES)
    assert "mla_extend_page32_cross_boundary" in names


@pytest.mark.parametrize("rope", [0, 16], ids=["rope0", "rope16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sglang_mla_harness(case, dtype, rope) -> None:
    mh.run_mla_attention_case(_NoSkip(), case, device="cpu", dtype=dtype, qk_rope_head_dim=rope)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sglang_mla_harness_fp8_kv(case) -> None:
    """fp8 (e4m3) latent pool: the harness writes bf16 latents, the pool casts to fp8."""
    mh.run_mla_attention_case(
        _NoSkip(),
        case,
        device="cpu",
        dtype=torch.bfloat16,
        qk_rope_head_dim=16,
        fp8_kv_cache=True,
        atol=6e-2,
        rtol=6e-2,
    )


def test_harness_detects_a_wrong_backend(monkeypatch) -> None:
    """The harness check can fail: a backend whose scale is off by 2x is rejected."""
    from mla_backend_integrations.sglang import backend as be

    real = be.mb.absorbed_attention

    def wrong(q_lat, q_pe, kv_cache, batch, scale, *a, **k):
        return real(q_lat, q_pe, kv_cache, batch, scale * 2.0, *a, **k)

    monkeypatch.setattr(be.mb, "absorbed_attention", wrong)
    with pytest.raises(AssertionError):
        mh.run_mla_attention_case(
            _NoSkip(), CASES[0], device="cpu", dtype=torch.float32, qk_rope_head_dim=16
        )
