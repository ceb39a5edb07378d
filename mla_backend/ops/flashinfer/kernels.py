"""The FlashInfer implementation of the device seam (:class:`Kernels`).

One rule decides who serves an absorbed call: FlashInfer's MLA wrapper when the plan part was
planned for it (CUDA, ``kv_lora_rank`` 512, rope 64, flashinfer importable) and the call brings
what it was planned for (queries and cache in the planned bf16 / fp16 dtype, no fp8 or
``fp8_ds_mla`` cache, the planned softmax scale); our Triton kernel otherwise (odd dims, fp8
caches, CPU tensors under the interpreter). The class subclasses the Triton implementation and
overrides only that call, the plan state it needs and its record; everything else (cache
write, absorption GEMMs, normal path, DSA's index-key write, indexer and sparse attention) is
the Triton implementation's, inherited.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...decision import Decision
from ...parts import PlanState, StepShape
from ..base import AbsorbedCall
from ..triton import Kernels as TritonKernels
from ..triton.schedule import TritonSchedule
from . import wrapper as fi


@dataclass(frozen=True)
class FlashInferState(PlanState):
    """One part's plan state: the Triton schedule (for the calls FlashInfer does not serve)
    and, where FlashInfer serves the part's dims and device, its planned wrapper."""

    triton: TritonSchedule
    wrapper: fi.MLAWrapperPlan | None

    def copy_(self, other: PlanState) -> None:
        if not isinstance(other, FlashInferState):
            raise TypeError(f"cannot refresh a FlashInferState from {type(other).__name__}")
        self.triton.copy_(other.triton)
        if self.wrapper is not None and other.wrapper is not None:
            self.wrapper.copy_(other.wrapper)


class Kernels(TritonKernels):
    """FlashInfer's MLA paged attention for the absorbed path where it serves (see the module
    doc), on the Triton implementation it subclasses: it overrides only what it serves
    (the absorbed attention, the plan state that holds its planned wrapper, the record of
    what runs); every other seam method, DSA's included, is the Triton
    implementation's, inherited.

    Knobs: ``dtype`` (bf16 default): the queries' and cache's dtype the wrapper is planned for;
    ``softmax_scale`` (default: the dims' ``1 / sqrt(nope + rope)``): the scale it is planned
    with (pass the model's, e.g. with the yarn correction); the Triton knobs.
    """

    name = "flashinfer"

    def __init__(
        self,
        *,
        dtype: torch.dtype = torch.bfloat16,
        softmax_scale: float | None = None,
        **triton_knobs: object,
    ) -> None:
        super().__init__(**triton_knobs)  # type: ignore[arg-type]
        if dtype not in fi.DTYPES:
            raise ValueError(f"dtype={dtype} is not served by FlashInfer's MLA wrapper; use "
                             f"one of {fi.DTYPES}")
        self.dtype = dtype
        self.softmax_scale = softmax_scale
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"ops.flashinfer.Kernels(dtype={self.dtype}, softmax_scale={self.softmax_scale}, "
                f"triton={super().__repr__()})")

    def describe(self, device: torch.device) -> dict[str, Decision]:
        return {
            **super().describe(device),
            "absorbed": Decision(
                "FlashInfer's BatchMLAPagedAttentionWrapper where it serves, Triton elsewhere",
                f"FlashInfer serves CUDA, r {fi.KV_LORA_RANK}, rope {fi.ROPE_DIM}, "
                "bf16/fp16 caches",
            ),
        }

    def plan_state(self, step: StepShape, block_q: int, num_splits: int) -> FlashInferState:
        """The Triton schedule, plus the part's planned FlashInfer wrapper when FlashInfer
        serves these dims on this device."""
        sched = super().plan_state(step, block_q, num_splits)
        if not fi.plan_serves(step.dims, step.device):
            return FlashInferState(sched, None)
        if step.device not in self._workspaces:
            self._workspaces[step.device] = torch.empty(
                fi.WORKSPACE_BYTES, dtype=torch.uint8, device=step.device
            )
        scale = self.softmax_scale if self.softmax_scale is not None else (
            step.dims.default_softmax_scale
        )
        plan = fi.MLAWrapperPlan(
            self._workspaces[step.device], step.dims, step.new_lens, step.kv_lens,
            step.block_table, step.page_size, self.dtype, scale,
        )
        return FlashInferState(sched, plan)

    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's wrapper where the call brings what it was planned for
        (:func:`wrapper.run_serves`), the Triton kernel on the plan's Triton schedule
        otherwise."""
        state = call.part.work.state
        if not isinstance(state, FlashInferState):
            raise ValueError(
                f"the plan part's state is {type(state).__name__}, not FlashInfer's: plan the "
                "step with mla_backend.ops.flashinfer.Kernels"
            )
        plan = state.wrapper
        if plan is not None and fi.run_serves(
            call.q_lat.dtype, call.kv_cache.dtype, plan.dtype, call.softmax_scale,
            plan.softmax_scale, call.kv_scale,
        ):
            return call.deliver(*plan.run(call.q_lat, call.q_pe, call.kv_cache))
        return self.run_scheduled(call, state.triton)

