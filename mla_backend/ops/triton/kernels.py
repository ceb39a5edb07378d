"""The Triton implementation of the device seam (:class:`Kernels`): the custom ops of
:mod:`.ops` for the cache write and the absorbed attention; the normal path's cache reads and
MHA (torch's fused SDPA) from the helpers every implementation shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton

from ...cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ...weights import absorb_q, apply_W_UV
from .. import paged, sdpa
from . import ops
from .jit import heuristics as hx

if TYPE_CHECKING:
    from ...cache_layout import CacheLayout
    from ...dims import MLADims
    from ...parts import PlanPart
    from ...weights import AbsorbWeights


class Kernels:
    """The Triton implementation of :class:`mla_backend.ops.KernelImpl`.

    Tuning knobs (keyword arguments; tests use them to force paths):
        num_kv_splits: force the split count (default :func:`heuristics.choose_num_splits`).
        block_n: force the kv tile (power of two >= 16; default :func:`heuristics.kv_block`).
        fp8_mode: ``"native"`` or ``"bits"`` e4m3 conversion (default :func:`fp8_mode`).
    """

    name = "triton"
    # shared helpers (composition: each is the same function in every implementation)
    absorb_q = staticmethod(absorb_q)
    apply_W_UV = staticmethod(apply_W_UV)
    attention_with_lse = staticmethod(sdpa.attention_with_lse)
    gather_latent = staticmethod(paged.gather_latent)

    def __init__(
        self,
        *,
        num_kv_splits: int | None = None,
        block_n: int | None = None,
        fp8_mode: str | None = None,
    ) -> None:
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

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The GPU's (FlashMLA's published figures); CPU tensors (the interpreter): the CPU's."""
        return CPU_PROFILE if device.type == "cpu" else GPU_PROFILE

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

    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        return weights

    def write_latent(
        self,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None,
    ) -> None:
        ops.write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale, fp8_mode=self.fp8_mode)

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
        return ops.absorbed_attention(
            q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale,
            block_n=self.block_n, fp8_mode=self.fp8_mode,
        )
