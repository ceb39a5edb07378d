"""The FlashInfer implementation's seam (:mod:`mla_backend.ops.flashinfer`) without a GPU: the
rule that decides who serves a call, the page lists it plans with, the Triton implementation
serving every seam method FlashInfer does not (inherited: read off the classes, no flashinfer
needed) and every absorbed call its wrapper cannot, and the seam's errors. FlashInfer's
kernels themselves are checked against our Triton kernel and the reference in
``test_triton_gpu_only.py`` (GPU only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_case import ON_GPU, TCase, assert_matches  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend import selection as seam  # noqa: E402
from mla_backend.ops.base import KernelImpl  # noqa: E402
from mla_backend.ops.flashinfer import Kernels as FlashInferKernels  # noqa: E402
from mla_backend.ops.flashinfer import wrapper as fi  # noqa: E402
from mla_backend.ops.triton import Kernels as TritonKernels  # noqa: E402
from mla_backend.ops.triton.schedule import TritonSchedule  # noqa: E402

DS = mb.MLADims(16, 512, 128, 64, 128)


#: the seam methods FlashInfer serves itself: the absorbed call (its wrapper where it serves,
#: else the Triton kernel: ``test_triton_serves_what_flashinfer_cannot``), the plan state
#: holding the planned wrapper next to the Triton schedule, and the record of what runs
FLASHINFER_OWN = {"absorbed_attention", "plan_state", "describe"}


def _seam_methods() -> set[str]:
    """The public methods (and static functions) of the seam's base class."""
    return {
        n for n in dir(KernelImpl) if not n.startswith("_") and callable(getattr(KernelImpl, n))
    }


def test_every_triton_method_is_triton_under_flashinfer() -> None:
    """Each seam method the Triton implementation overrides resolves, on the FlashInfer
    implementation, to the Triton implementation's own function (DSA's write_index_keys,
    indexer_topk, sparse_absorbed_attention included), except the few FlashInfer serves
    itself; none falls through to the base class's torch default."""
    methods = _seam_methods()
    triton = {n for n in methods if getattr(TritonKernels, n) is not getattr(KernelImpl, n)}
    assert {"write_latent", "absorbed_attention", "write_index_keys", "indexer_logits",
            "indexer_topk", "sparse_absorbed_attention"} <= triton  # fmt: skip
    own = {n for n in methods if getattr(FlashInferKernels, n) is not getattr(TritonKernels, n)}
    assert own == FLASHINFER_OWN
    for n in sorted(triton - own):
        assert getattr(FlashInferKernels, n) is getattr(TritonKernels, n), n
        bound = getattr(FlashInferKernels(), n)
        assert getattr(bound, "__func__", bound) is getattr(TritonKernels, n), n


def test_triton_knobs_reach_the_inherited_calls() -> None:
    """The Triton knobs given to the FlashInfer implementation are the ones its inherited
    calls read (DSA's sparse splits, the absorbed kernel's tiles)."""
    impl = FlashInferKernels(sparse_splits=3, block_n=32, num_kv_splits=2)
    assert (impl.sparse_splits, impl.block_n, impl.num_kv_splits) == (3, 32, 2)
    assert isinstance(impl, TritonKernels) and impl.name == "flashinfer"
    with pytest.raises(ValueError, match="sparse_splits=0"):
        FlashInferKernels(sparse_splits=0)


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
