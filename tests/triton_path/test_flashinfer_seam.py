"""The FlashInfer implementation's seam (:mod:`mla_backend.ops.flashinfer`) without a GPU: the
rule that decides who serves a call, the page lists it plans with, the Triton fallback serving
every call it cannot, and the seam's errors. FlashInfer's kernels themselves are checked
against our Triton kernel and the reference in ``test_triton_gpu_only.py`` (GPU only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_case import ON_GPU, TCase, assert_matches  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend import selection as seam  # noqa: E402
from mla_backend.ops.flashinfer import Kernels as FlashInferKernels  # noqa: E402
from mla_backend.ops.flashinfer import wrapper as fi  # noqa: E402
from mla_backend.ops.triton.schedule import TritonSchedule  # noqa: E402

DS = mb.MLADims(16, 512, 128, 64, 128)


def test_csr_pages_of_a_block_table() -> None:
    indptr, flat = fi.csr_pages([0, 5, 16, 17], page_size=8, columns=3)
    assert indptr == [0, 0, 1, 3, 6]
    assert flat == [3, 6, 7, 9, 10, 11]


def test_plan_rule(monkeypatch) -> None:
    monkeypatch.setattr(fi, "available", lambda: True)
    cuda = torch.device("cuda")
    assert fi.plan_serves(DS, cuda)
    assert not fi.plan_serves(DS, torch.device("cpu"))
    assert not fi.plan_serves(mb.MLADims(16, 256, 128, 64, 128), cuda)
    assert not fi.plan_serves(mb.MLADims(16, 512, 128, 32, 128), cuda)
    monkeypatch.setattr(fi, "available", lambda: False)
    assert not fi.plan_serves(DS, cuda)


@pytest.mark.parametrize(
    "q,cache,scale,kv_scale,serves",
    [
        (torch.bfloat16, torch.bfloat16, 0.1, None, True),
        (torch.float16, torch.float16, 0.1, None, False),  # planned for bf16
        (torch.bfloat16, mb.FP8_DTYPE, 0.1, torch.tensor(0.5), False),
        (torch.bfloat16, torch.uint8, 0.1, None, False),  # fp8_ds_mla rows
        (torch.bfloat16, torch.bfloat16, 0.2, None, False),  # another softmax scale
    ],
)
def test_call_rule(q, cache, scale, kv_scale, serves) -> None:
    assert fi.run_serves(q, cache, torch.bfloat16, scale, 0.1, kv_scale) == serves


def test_triton_serves_what_flashinfer_cannot() -> None:
    """On CPU (and for odd dims on a GPU) the plan holds only the Triton schedule, and the
    call is the Triton kernel's: checked against the float64 reference."""
    case = TCase([7, 40], [1, 3], H=4, r=32, rope=16, page_size=16, seed=5)
    impl = FlashInferKernels(num_kv_splits=3)
    plan = case.plan(impl)
    state = plan.step.work.state
    assert plan.impl.name == "flashinfer" and state.wrapper is None
    assert isinstance(state.triton, TritonSchedule)
    out = mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, plan, case.scale)
    assert_matches(case, out)


def test_bad_knobs_and_seam_errors(monkeypatch) -> None:
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        FlashInferKernels(dtype=torch.float32)
    if not fi.available():
        with pytest.raises(RuntimeError, match="flashinfer"):
            seam.impl_name(torch.device("cuda"), "flashinfer")
    monkeypatch.setenv(seam.ENV_VAR, "flashinfr")
    with pytest.raises(ValueError, match="flashinfer"):
        seam.impl_name(torch.device("cpu"))


@pytest.mark.skipif(ON_GPU, reason="checks the CPU default")
def test_auto_never_picks_flashinfer_on_cpu(monkeypatch) -> None:
    monkeypatch.delenv(seam.ENV_VAR, raising=False)
    assert seam.impl_name(torch.device("cpu")) in ("native", "torch")
