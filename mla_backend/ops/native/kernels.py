"""The native implementation of :class:`mla_backend.ops.KernelImpl` for CPU tensors: cache write
and absorbed attention from the C++ kernels of :mod:`mla_backend.ops.native` (compiled on first
use) for every cache layout (bf16/fp16/fp32, per-tensor fp8, ``fp8_ds_mla`` uint8 rows), and the
absorption GEMMs ``q_nope · W_UK`` / ``o_lat · W_UV`` for bf16 weights (packed once per layer by
:meth:`Kernels.prepare_weights`), the normal path's decompression and MHA for bf16 (all at every
ISA level: fp32 sums, never torch's bf16 GEMM; other dtypes: torch's bmm, mm and SDPA); the
normal path's cache reads from the torch implementation."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..torch import Kernels as TorchKernels
from . import ops as native
from .build import ISA_LEVELS

if TYPE_CHECKING:
    from ...dims import MLADims
    from ...plan import PlanPart
    from ...weights import AbsorbWeights


# max_page_id per plan part, until the plan carries it (PlanPart.max_page_id, the ops branch)
_MAX_PAGE: weakref.WeakKeyDictionary[PlanPart, int] = weakref.WeakKeyDictionary()


def _max_page_id(part: PlanPart) -> int:
    """The largest page id ``part``'s requests use, from its host data (-1: unknown, the op
    then checks every used block_table entry)."""
    known = getattr(part, "max_page_id", None)
    if known is not None:
        return int(known)
    got = _MAX_PAGE.get(part)
    if got is None:
        pages = part.pages
        got = max((max(p) for p in pages if p), default=-1) if pages is not None else -1
        _MAX_PAGE[part] = got
    return got


class Kernels(TorchKernels):
    """Native CPU kernels of one ISA level (``isa``, one of :data:`ISA_LEVELS`; None = the
    selected level, :func:`mla_backend.ops.native.selected_isa`). Tuning knob:
    ``num_kv_splits`` (0 = the kernel chooses)."""

    name = "native"

    def __init__(self, isa: str | None = None, *, num_kv_splits: int = 0) -> None:
        super().__init__()
        if num_kv_splits < 0:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 0 (0 = automatic)")
        if isa is not None and isa not in ISA_LEVELS:
            raise ValueError(f"isa={isa!r} is not supported; use one of {ISA_LEVELS} or None")
        self.isa = isa
        self.num_kv_splits = num_kv_splits

    def __repr__(self) -> str:
        return f"ops.native.Kernels(isa={self.isa!r}, num_kv_splits={self.num_kv_splits})"

    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        """bf16 CPU weights: add their packed copies (W_UK's and W_UV's element count again,
        padded to even rows and blocks of 64 columns: 2·H·r·(nope + v) bytes per layer)."""
        if (
            weights.fp8
            or weights.W_UK.dtype != torch.bfloat16
            or weights.W_UV.dtype != torch.bfloat16
            or weights.W_UK.device.type != "cpu"
        ):
            return weights
        return replace(
            weights,
            W_UK_packed=native.pack_heads(weights.W_UK, isa=self.isa),
            W_UV_packed=native.pack_heads(weights.W_UV, isa=self.isa),
        )

    def absorb_q(self, q_nope: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        if weights.W_UK_packed is None or q_nope.dtype != torch.bfloat16:
            return super().absorb_q(q_nope, weights)
        return native.head_gemm(q_nope, weights.W_UK_packed, weights.W_UK.shape[-1], isa=self.isa)

    def apply_W_UV(self, o_lat: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        if weights.W_UV_packed is None or o_lat.dtype != torch.bfloat16:
            return super().apply_W_UV(o_lat, weights)
        return native.head_gemm(o_lat, weights.W_UV_packed, weights.W_UV.shape[-1], isa=self.isa)

    def attention_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu":
            return native.attention_with_lse(q, k, v, causal, scale, isa=self.isa)
        return super().attention_with_lse(q, k, v, causal, scale)

    def decompress(
        self,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        W_UK: torch.Tensor,
        W_UV: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ts = (c_kv, k_pe, W_UK, W_UV)
        if all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts):
            return native.decompress(c_kv, k_pe, W_UK, W_UV, isa=self.isa)
        return super().decompress(c_kv, k_pe, W_UK, W_UV)

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
        native.write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale, isa=self.isa)

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
            _max_page_id(part),
            isa=self.isa,
        )
