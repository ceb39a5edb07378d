"""The Triton implementation of the device seam (:class:`Kernels`): the custom ops of
:mod:`.ops` for the cache write and the absorbed attention (with its plan-time schedule,
:mod:`.schedule`); the normal path's cache reads and MHA (torch's fused SDPA) are the base
class's defaults."""

from __future__ import annotations

import torch
import triton

from ...cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ...decision import Decision
from ...dims import MLADims
from ...parts import StepShape
from ..base import AbsorbedCall, KernelImpl, LatentWrite
from . import ops as triton_ops  # by module: tests reload it and patch its functions
from . import schedule
from .jit import heuristics as hx
from .schedule import TritonSchedule


class Kernels(KernelImpl):
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

    def describe(self, device: torch.device) -> dict[str, Decision]:
        interp = hx.interpreting()
        where = "the interpreter (TRITON_INTERPRET=1)" if interp else device.type
        return {
            "kernels": Decision(f"Triton {triton.__version__}", f"runs on {where}"),
            "cost_profile": Decision(
                "CPU (interpreter)" if device.type == "cpu" else "GPU (FlashMLA's H800 figures)",
                "not fitted to a measured GPU yet",
            ),
        }

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The GPU's (FlashMLA's published figures); CPU tensors (the interpreter): the CPU's."""
        return CPU_PROFILE if device.type == "cpu" else GPU_PROFILE

    def work_shape(self, step: StepShape) -> tuple[int, int]:
        dims = step.dims
        block_q, block_h = hx.attention_tiles(
            dims.num_heads, max(step.new_lens, default=1), self.rows_per_program
        )
        if self.num_kv_splits is not None:
            return block_q, self.num_kv_splits
        heads = triton.cdiv(dims.num_heads, block_h)
        return block_q, hx.num_parts(heads, hx.sm_count(step.device))

    def _block_h(self, dims: MLADims, block_q: int) -> int:
        return hx.attention_tiles(dims.num_heads, block_q, self.rows_per_program)[1]

    def _block_n(self, dims: MLADims, block_q: int) -> int:
        if self.block_n is not None:
            return self.block_n
        block_h = self._block_h(dims, block_q)
        return hx.kv_block(hx.dim_block(dims.kv_lora_rank), block_q * block_h)

    def plan_state(self, step: StepShape, block_q: int, num_splits: int) -> TritonSchedule:
        """The plan-time split schedule of :mod:`mla_backend.ops.triton.schedule`, from the
        plan's host ints."""
        block_n = self._block_n(step.dims, block_q)
        tiles = schedule.query_block_tiles(step.new_lens, step.kv_lens, block_q, block_n)
        overhead = -(-hx.OVERHEAD_KV_ROWS // block_n)
        min_units = 1 if self.num_kv_splits is not None else hx.MIN_KV_ROWS_PER_PART // block_n
        return schedule.schedule_tensors(
            tiles, num_splits, overhead, min_units, block_n, step.device
        )

    def write_latent(self, w: LatentWrite) -> None:
        triton_ops.write_latent(
            w.kv_cache, w.c_kv, w.k_pe, w.slot_mapping, w.kv_scale, fp8_mode=self.fp8_mode
        )

    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run_scheduled(call, None)

    def run_scheduled(
        self, call: AbsorbedCall, state: TritonSchedule | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed attention on ``state`` (None: the part's own plan state): the entry for
        an implementation that composes this one and keeps the schedule inside its own state."""
        part = call.part
        o, lse = triton_ops.absorbed_attention(
            call.q_lat, call.q_pe, call.kv_cache, part, call.softmax_scale, call.kv_scale,
            schedule=state, block_n=self._block_n(part.dims, part.work.block_q),
            block_h=self._block_h(part.dims, part.work.block_q), fp8_mode=self.fp8_mode,
        )
        return call.deliver(o, lse)
