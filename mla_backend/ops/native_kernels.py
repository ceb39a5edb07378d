"""The native implementation of :class:`mla_backend.ops.KernelImpl` for CPU tensors: cache write
and absorbed attention from the C++ kernels of :mod:`mla_backend.ops.native` (compiled on first
use) for every cache layout (bf16/fp16/fp32, per-tensor fp8, ``fp8_ds_mla`` uint8 rows); the
normal path's cache reads and MHA from the torch implementation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from . import native
from .torch_ops import Kernels as TorchKernels

if TYPE_CHECKING:
    from ..dims import MLADims
    from ..plan import PlanPart


class Kernels(TorchKernels):
    """Native CPU kernels. Tuning knob: ``num_kv_splits`` (0 = the kernel chooses)."""

    name = "native"

    def __init__(self, *, num_kv_splits: int = 0) -> None:
        super().__init__()
        if num_kv_splits < 0:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 0 (0 = automatic)")
        self.num_kv_splits = num_kv_splits

    def __repr__(self) -> str:
        return f"native_kernels.Kernels(num_kv_splits={self.num_kv_splits})"

    def work_shape(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        device: torch.device,
    ) -> tuple[int, int]:
        return max(1, max(new_lens, default=1)), self.num_kv_splits

    def write_latent(
        self,
        kv_cache: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None,
    ) -> None:
        native.write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale)

    def absorbed_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        part: PlanPart,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return native.absorbed_attention(
            q_lat,
            q_pe,
            kv_cache,
            part.block_table,
            part.cu_new_t,
            part.kv_lens_t,
            softmax_scale,
            kv_scale,
            part.work.num_kv_splits,
        )
