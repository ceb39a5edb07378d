"""The FlashInfer implementation of the device seam (:class:`Kernels`).

One rule decides who serves an absorbed call: FlashInfer's MLA wrapper when the plan part was
planned for it (CUDA, ``kv_lora_rank`` 512, rope 64, flashinfer importable) and the call brings
what it was planned for (queries and cache in the planned bf16 / fp16 dtype, no fp8 or
``fp8_ds_mla`` cache, the planned softmax scale); our Triton kernel otherwise (odd dims, fp8
caches, CPU tensors under the interpreter). Everything else (cache write, absorption GEMMs,
normal path) is the Triton implementation's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..triton import Kernels as TritonKernels
from . import wrapper as fi

if TYPE_CHECKING:
    from ...cache_layout import CacheLayout
    from ...dims import MLADims
    from ...parts import PlanPart


class Kernels:
    """FlashInfer's MLA paged attention for the absorbed path where it serves (see the module
    doc), the Triton implementation (held as ``fallback``) for the rest: every seam method this
    class does not define is the fallback's.

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
        self.fallback = TritonKernels(**triton_knobs)  # type: ignore[arg-type]
        if dtype not in fi.DTYPES:
            raise ValueError(f"dtype={dtype} is not served by FlashInfer's MLA wrapper; use "
                             f"one of {fi.DTYPES}")
        self.dtype = dtype
        self.softmax_scale = softmax_scale
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def __getattr__(self, name: str) -> object:
        # only reached for attributes this class lacks: the Triton implementation's
        if name == "fallback":
            raise AttributeError(name)
        return getattr(self.fallback, name)

    def __repr__(self) -> str:
        return f"ops.flashinfer.Kernels(dtype={self.dtype}, softmax_scale={self.softmax_scale})"

    def work_schedule(
        self, dims: MLADims, *shape: object, block_table: torch.Tensor, page_size: int
    ) -> tuple[object, ...]:
        """The Triton schedule (the fallback's) for ``shape`` = (new_lens, kv_lens, block_q,
        num_parts, device), plus the part's planned FlashInfer wrapper when FlashInfer serves
        these dims on this device."""
        sched = self.fallback.work_schedule(dims, *shape)
        new_lens, kv_lens, _, _, device = shape
        if not fi.plan_serves(dims, device):
            return sched
        if device not in self._workspaces:
            self._workspaces[device] = torch.empty(
                fi.WORKSPACE_BYTES, dtype=torch.uint8, device=device
            )
        scale = self.softmax_scale if self.softmax_scale is not None else (
            dims.default_softmax_scale
        )
        plan = fi.MLAWrapperPlan(
            self._workspaces[device], dims, new_lens, kv_lens, block_table, page_size,
            self.dtype, scale,
        )
        return (*sched, plan)

    def absorbed_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        part: PlanPart,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sched = part.work.schedule
        plan = sched[2] if len(sched) > 2 else None
        if plan is not None and fi.run_serves(
            q_lat.dtype, kv_cache.dtype, plan.dtype, softmax_scale, plan.softmax_scale, kv_scale
        ):
            return plan.run(q_lat, q_pe, kv_cache)
        return self.fallback.absorbed_attention(
            q_lat, q_pe, kv_cache, layout, part, softmax_scale, kv_scale
        )
