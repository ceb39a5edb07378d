"""The Triton implementation of the device seam (:class:`Kernels`): the custom ops of
:mod:`.ops` for the cache write and the absorbed attention (with its plan-time schedule,
:mod:`.schedule`); the normal path's cache reads and MHA (torch's fused SDPA) from the helpers
every implementation shares, and DSA's indexer and sparse attention in plain torch from the
shared helpers (:mod:`mla_backend.ops.indexer`, :mod:`mla_backend.ops.sparse`) until Triton
kernels of their own exist."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton

from ...cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ...weights import absorb_q, apply_W_UV
from .. import dense, indexer, paged, sdpa, sparse
from . import ops as triton_ops  # by module: tests reload it and patch its functions
from . import schedule
from .jit import heuristics as hx

if TYPE_CHECKING:
    from ...cache_layout import CacheLayout
    from ...dims import MLADims
    from ...parts import PlanPart
    from ...weights import AbsorbWeights


class Kernels:
    """The Triton implementation of :class:`mla_backend.ops.KernelImpl`.

    Tuning knobs (keyword arguments; tests use them to force paths):
        num_kv_splits: force the number of schedule pieces (programs along the split axis;
            default :func:`heuristics.num_parts`); a forced count cuts the work into exactly
            that many equal pieces (no minimum piece size).
        block_n: force the kv tile (power of two >= 16; default :func:`heuristics.kv_block`).
        rows_per_program: query rows (heads x tokens) per program, a power of two >= 16
            (default :data:`heuristics.ROWS_PER_PROGRAM` = 64, FlashMLA's block).
        fp8_mode: ``"native"`` or ``"bits"`` e4m3 conversion (default :func:`fp8_mode`).
    """

    name = "triton"
    # shared helpers (composition: each is the same function in every implementation)
    absorb_q = staticmethod(absorb_q)
    apply_W_UV = staticmethod(apply_W_UV)
    attention_with_lse = staticmethod(sdpa.attention_with_lse)
    decompress = staticmethod(dense.decompress)
    gather_latent = staticmethod(paged.gather_latent)
    write_index_keys = staticmethod(indexer.write_index_keys)
    indexer_logits = staticmethod(indexer.indexer_logits)
    indexer_topk = staticmethod(indexer.indexer_topk)
    sparse_absorbed_attention = staticmethod(sparse.sparse_absorbed_attention)

    def __init__(
        self,
        *,
        num_kv_splits: int | None = None,
        block_n: int | None = None,
        rows_per_program: int = hx.ROWS_PER_PROGRAM,
        fp8_mode: str | None = None,
    ) -> None:
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
        rows = rows_per_program
        if rows < hx.MIN_DOT_DIM or rows & (rows - 1):
            raise ValueError(
                f"rows_per_program={rows} must be a power of two >= {hx.MIN_DOT_DIM}"
            )
        self.rows_per_program = rows
        self.num_kv_splits = num_kv_splits
        self.block_n = block_n
        self.fp8_mode = fp8_mode

    def __repr__(self) -> str:
        return (
            f"ops.triton.Kernels(num_kv_splits={self.num_kv_splits}, block_n={self.block_n}, "
            f"rows_per_program={self.rows_per_program}, fp8_mode={self.fp8_mode})"
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
        block_q, block_h = hx.attention_tiles(
            dims.num_heads, max(new_lens, default=1), self.rows_per_program
        )
        if self.num_kv_splits is not None:
            return block_q, self.num_kv_splits
        return block_q, hx.num_parts(triton.cdiv(dims.num_heads, block_h), hx.sm_count(device))

    def _block_h(self, dims: MLADims, block_q: int) -> int:
        return hx.attention_tiles(dims.num_heads, block_q, self.rows_per_program)[1]

    def _block_n(self, dims: MLADims, block_q: int) -> int:
        if self.block_n is not None:
            return self.block_n
        block_h = self._block_h(dims, block_q)
        return hx.kv_block(hx.dim_block(dims.kv_lora_rank), block_q * block_h)

    def work_schedule(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        block_q: int,
        num_parts: int,
        device: torch.device,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(part_meta [num_parts, 5], split_base [W + 1]) int32: the plan-time schedule of
        :mod:`mla_backend.ops.triton.schedule`, from the plan's host ints (the plan's other
        keyword arguments, ``block_table`` and ``page_size``, are not needed)."""
        block_n = self._block_n(dims, block_q)
        tiles = schedule.query_block_tiles(new_lens, kv_lens, block_q, block_n)
        overhead = -(-hx.OVERHEAD_KV_ROWS // block_n)
        min_units = 1 if self.num_kv_splits is not None else hx.MIN_KV_ROWS_PER_PART // block_n
        return schedule.schedule_tensors(tiles, num_parts, overhead, min_units, block_n, device)

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
        triton_ops.write_latent(
            kv_cache, c_kv, k_pe, slot_mapping, kv_scale, fp8_mode=self.fp8_mode
        )

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
        return triton_ops.absorbed_attention(
            q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale,
            block_n=self._block_n(part.dims, part.work.block_q),
            block_h=self._block_h(part.dims, part.work.block_q), fp8_mode=self.fp8_mode,
        )
