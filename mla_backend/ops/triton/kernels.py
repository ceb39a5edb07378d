"""The Triton implementation of the device seam (:class:`Kernels`): the custom ops of
:mod:`.ops` for the cache write and the absorbed attention, the torch implementation's normal
path (cache reads, fused SDPA)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton

from ..torch import Kernels as TorchKernels
from .jit import heuristics as hx
from .ops import absorbed_attention, write_latent

if TYPE_CHECKING:
    from ...dims import MLADims


class Kernels(TorchKernels):
    """The Triton implementation of :class:`mla_backend.ops.KernelImpl`: cache write and
    absorbed attention in Triton; the normal path's cache reads and MHA from the torch
    implementation (torch's fused SDPA).

    Tuning knobs (keyword arguments; tests use them to force paths):
        num_kv_splits: force the split count (default :func:`heuristics.choose_num_splits`).
        block_n: force the kv tile (power of two >= 16; default :func:`heuristics.kv_block`).
        fp8_mode: ``"native"`` or ``"bits"`` e4m3 conversion (default :func:`fp8_mode`).
    """

    name = "triton"

    def __init__(
        self,
        *,
        num_kv_splits: int | None = None,
        block_n: int | None = None,
        fp8_mode: str | None = None,
    ) -> None:
        super().__init__()
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
        self.num_kv_splits = num_kv_splits
        self.block_n = block_n
        self.fp8_mode = fp8_mode

    def __repr__(self) -> str:
        return (
            f"ops.triton.Kernels(num_kv_splits={self.num_kv_splits}, block_n={self.block_n}, "
            f"fp8_mode={self.fp8_mode})"
        )

    def work_shape(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        device: torch.device,
    ) -> tuple[int, int]:
        block_q, block_h = hx.attention_tiles(dims.num_heads, max(new_lens, default=1))
        if self.num_kv_splits is not None:
            return block_q, self.num_kv_splits
        q_blocks = sum(-(-n // block_q) for n in new_lens)
        programs = q_blocks * triton.cdiv(dims.num_heads, block_h)
        return block_q, hx.choose_num_splits(
            programs, max(kv_lens, default=0), hx.sm_count(device)
        )

    def write_latent(self, kv_cache, c_kv, k_pe, slot_mapping, kv_scale) -> None:
        write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale, fp8_mode=self.fp8_mode)

    def absorbed_attention(self, q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale):
        return absorbed_attention(
            q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale,
            block_n=self.block_n, fp8_mode=self.fp8_mode,
        )
