"""The Triton implementation of the device seam (:class:`Kernels`): the custom ops of
:mod:`.ops` for the cache write and the absorbed attention (with its plan-time schedule,
:mod:`.schedule`), and of :mod:`.dsa` for DSA's index-key write, indexer logits / top-k and
sparse attention. Delegated explicitly to the torch implementation
(:func:`mla_backend.ops.torch.torch_default`): the absorption bmms, the normal path's cache
reads, decompression and MHA (torch's fused SDPA), DSA's sparse (masked) MHA, and the DSA
shapes the kernels do not take (a latent wider than 512, more than 16 scales per index key)."""

from __future__ import annotations

import torch
import triton

from ...cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ...decision import Decision
from ...dims import MLADims
from ...parts import StepShape
from ..base import (
    AbsorbedCall,
    IndexerCall,
    IndexKeyWrite,
    KernelImpl,
    KeySetCall,
    LatentWrite,
    SparseCall,
)  # fmt: skip
from ..torch import DEFAULT as TORCH
from ..torch import torch_default
from . import dsa, keyset, schedule
from . import ops as triton_ops  # by module: tests reload it and patch its functions
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
        num_warps / num_stages: launch options of the attention kernel (default
            :func:`heuristics.num_warps` / Triton's).
        pad_rows: fill every program's ``rows_per_program`` rows even when the heads (x new
            tokens) are fewer (masked rows: 16 heads in a 64-row block get Hopper's wgmma).
        chunk: latent columns per chunk (default :data:`heuristics.LATENT_CHUNK`).
        fp8_f16: fp8 and ``fp8_ds_mla`` caches: the latent dots (q·kᵀ, P·V) in fp16 instead
            of the queries' bf16: e4m3 -> fp16 is exact and one conversion per two values
            (to bf16 it costs two more per value); queries beyond fp16's range (65504) give
            NaN rows, never a silently wrong value.
        gluon: run the Gluon kernel (:mod:`.jit.gluon_attention`: Hopper, FlashMLA's split of
            the work between two warpgroups) where it serves the call: True, False, or None
            (default: from :data:`heuristics.GLUON_MIN_HEADS` heads on, where the H200 run
            timed it faster). Its schedule is cut at whole 64-row pages (``block_n`` 64).
        sparse_splits: force DSA's sparse attention's pieces per index list (default
            :func:`mla_backend.ops.triton.dsa.sparse_splits`).
    """

    name = "triton"

    absorb_q = torch_default("absorb_q")
    apply_W_UV = torch_default("apply_W_UV")
    gather_latent = torch_default("gather_latent")
    decompress = torch_default("decompress")
    attention_with_lse = torch_default("attention_with_lse")
    masked_attention_with_lse = torch_default("masked_attention_with_lse")
    v4_slot_attention = torch_default("v4_slot_attention")  # vLLM's CPU V4 op contract

    def __init__(
        self,
        *,
        num_kv_splits: int | None = None,
        block_n: int | None = None,
        rows_per_program: int = hx.ROWS_PER_PROGRAM,
        fp8_mode: str | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        pad_rows: bool = False,
        chunk: int = hx.LATENT_CHUNK,
        fp8_f16: bool = False,
        gluon: bool | None = None,
        sparse_splits: int | None = None,
    ) -> None:
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
        if sparse_splits is not None and sparse_splits < 1:
            raise ValueError(f"sparse_splits={sparse_splits} must be >= 1")
        self.sparse_splits = sparse_splits
        rows = rows_per_program
        if rows < hx.MIN_DOT_DIM or rows & (rows - 1):
            raise ValueError(
                f"rows_per_program={rows} must be a power of two >= {hx.MIN_DOT_DIM}"
            )
        if block_n is not None and (block_n < hx.MIN_DOT_DIM or block_n & (block_n - 1)):
            raise ValueError(f"block_n={block_n} must be a power of two >= {hx.MIN_DOT_DIM}")
        if gluon and block_n not in (None, 64):
            raise ValueError(f"block_n={block_n}: the Gluon kernel walks whole 64-row pages")
        hx.check_launch_knobs(chunk, num_warps, num_stages)
        self.rows_per_program = rows
        self.num_kv_splits = num_kv_splits
        self.block_n = block_n
        self.fp8_mode = fp8_mode
        self.num_warps, self.num_stages = num_warps, num_stages
        self.pad_rows, self.chunk, self.fp8_f16, self.gluon = pad_rows, chunk, fp8_f16, gluon

    def __repr__(self) -> str:
        return (
            f"ops.triton.Kernels(num_kv_splits={self.num_kv_splits}, block_n={self.block_n}, "
            f"rows_per_program={self.rows_per_program}, fp8_mode={self.fp8_mode}, "
            f"num_warps={self.num_warps}, num_stages={self.num_stages}, "
            f"pad_rows={self.pad_rows}, chunk={self.chunk}, fp8_f16={self.fp8_f16}, "
            f"gluon={self.gluon}, sparse_splits={self.sparse_splits})"
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
            dims.num_heads, max(step.new_lens, default=1), self.rows_per_program, self.pad_rows
        )
        if self.num_kv_splits is not None:
            return block_q, self.num_kv_splits
        heads = triton.cdiv(dims.num_heads, block_h)
        # one wave of the programs resident per SM (the split count from residency)
        warps = self.num_warps or hx.num_warps(block_q * block_h, hx.dim_block(dims.kv_lora_rank))
        ctas = hx.ctas_per_sm(block_q * block_h, self._block_n(dims, block_q), warps)
        return block_q, hx.num_parts(heads, hx.sm_count(step.device), ctas)

    def _block_h(self, dims: MLADims, block_q: int) -> int:
        return hx.attention_tiles(dims.num_heads, block_q, self.rows_per_program,
                                  self.pad_rows)[1]

    def _gluon(self, dims: MLADims) -> bool:
        """Whether calls of these dims try the Gluon kernel: the ``gluon`` knob, else (None)
        from :data:`heuristics.GLUON_MIN_HEADS` heads on (the H200 run,
        ``benchmarks/results/gpu-latest.md``: faster than the Triton kernel at 128 heads,
        slower at 16). It still serves only the calls it can (page 64, bf16 /
        fp16, r 512, rope 64); the Triton kernel serves the rest."""
        return self.gluon if self.gluon is not None else dims.num_heads >= hx.GLUON_MIN_HEADS

    def _block_n(
        self, dims: MLADims, block_q: int, kind: str = "plain", q_bytes: int = 2
    ) -> int:
        if self.block_n is not None:
            return self.block_n
        if self._gluon(dims) and kind == "plain" and q_bytes == 2:
            return 64  # whole 64-row pages (its schedule)
        block_h = self._block_h(dims, block_q)
        return hx.kv_block(hx.dim_block(dims.kv_lora_rank), block_q * block_h, kind, q_bytes)

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
            schedule=state,
            block_n=self._block_n(part.dims, part.work.block_q, call.layout.kind,
                                  call.q_lat.element_size()),
            block_h=self._block_h(part.dims, part.work.block_q), fp8_mode=self.fp8_mode,
            chunk=self.chunk, num_warps=self.num_warps, num_stages=self.num_stages,
            fp8_f16=self.fp8_f16, gluon=self._gluon(part.dims),
        )
        return call.deliver(o, lse)

    # ---- DSA ----------------------------------------------------------------------------
    def write_index_keys(self, w: IndexKeyWrite) -> None:
        dsa.write_index_keys(w)

    def indexer_logits(self, call: IndexerCall) -> torch.Tensor:
        if not dsa.indexer_supported(call.layout.scales_per_key):
            return TORCH.indexer_logits(call)
        return dsa.indexer_logits(call, fp8_mode=self.fp8_mode)

    def indexer_topk(self, call: IndexerCall) -> torch.Tensor:
        if not dsa.indexer_supported(call.layout.scales_per_key):
            return TORCH.indexer_topk(call)
        return dsa.indexer_topk(call, fp8_mode=self.fp8_mode)

    def sparse_absorbed_attention(self, call: SparseCall) -> tuple[torch.Tensor, torch.Tensor]:
        if not dsa.sparse_supported(call.attn.layout.kv_lora_rank):
            return TORCH.sparse_absorbed_attention(call)
        return dsa.sparse_attention(call, fp8_mode=self.fp8_mode, num_splits=self.sparse_splits)

    # ---- attention over key sets --------------------------------------------------------
    def keyset_attention(self, call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor]:
        if not keyset.keyset_supported(call):
            return TORCH.keyset_attention(call)
        return keyset.keyset_attention(call, fp8_mode=self.fp8_mode)
