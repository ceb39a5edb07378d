"""The native implementation of :class:`mla_backend.ops.KernelImpl` for CPU tensors: cache write
and absorbed attention from the C++ kernels of :mod:`mla_backend.ops.native` (compiled on first
use) for every cache layout (bf16/fp16/fp32, per-tensor fp8, ``fp8_ds_mla`` uint8 rows), and the
absorption GEMMs ``q_nope · W_UK`` / ``o_lat · W_UV`` for bf16 weights (packed once per layer by
:meth:`Kernels.prepare_weights`) and the normal path's MHA for bf16 (both on AVX512-BF16 CPUs;
elsewhere, and for other dtypes, torch's bmm and SDPA through the shared helpers); the normal
path's cache reads from the shared helpers (:mod:`mla_backend.ops.paged`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...cost import DeviceProfile
from ...weights import absorb_q, apply_W_UV
from .. import paged, sdpa
from . import ops as native
from .build import ISA_LEVELS
from .profile import profile_for

if TYPE_CHECKING:
    from ...cache_layout import CacheLayout
    from ...dims import MLADims
    from ...parts import PlanPart
    from ...weights import AbsorbWeights


class Kernels:
    """Native CPU kernels of one ISA level (``isa``, one of :data:`ISA_LEVELS`; None = the
    selected level, :func:`mla_backend.ops.native.selected_isa`). Tuning knob:
    ``num_kv_splits`` (0 = the kernel chooses)."""

    name = "native"
    # shared helpers (composition: each is the same function in every implementation)
    gather_latent = staticmethod(paged.gather_latent)

    def __init__(self, isa: str | None = None, *, num_kv_splits: int = 0) -> None:
        if num_kv_splits < 0:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 0 (0 = automatic)")
        if isa is not None and isa not in ISA_LEVELS:
            raise ValueError(f"isa={isa!r} is not supported; use one of {ISA_LEVELS} or None")
        #: the ISA level the kernels run at (None: the loader's pick); keys the cost profile
        self.isa = isa
        self.num_kv_splits = num_kv_splits

    def __repr__(self) -> str:
        return f"ops.native.Kernels(isa={self.isa!r}, num_kv_splits={self.num_kv_splits})"

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The measured profile of the native kernels at this ISA level (:mod:`.profile`)."""
        return profile_for(self.isa)

    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        """bf16 weights on a CPU with AVX512-BF16: add their packed copies (W_UK's and W_UV's
        element count again, padded to even rows and blocks of 64 columns)."""
        if (
            weights.fp8
            or weights.W_UK.dtype != torch.bfloat16
            or weights.W_UV.dtype != torch.bfloat16
            or weights.W_UK.device.type != "cpu"
            or native.simd_level(self.isa) != "avx512_bf16"
        ):
            return weights
        return replace(
            weights,
            W_UK_packed=native.pack_heads(weights.W_UK, isa=self.isa),
            W_UV_packed=native.pack_heads(weights.W_UV, isa=self.isa),
        )

    def absorb_q(self, q_nope: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        if weights.W_UK_packed is None or q_nope.dtype != torch.bfloat16:
            return absorb_q(q_nope, weights)
        return native.head_gemm(q_nope, weights.W_UK_packed, weights.W_UK.shape[-1], isa=self.isa)

    def apply_W_UV(self, o_lat: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        if weights.W_UV_packed is None or o_lat.dtype != torch.bfloat16:
            return apply_W_UV(o_lat, weights)
        return native.head_gemm(o_lat, weights.W_UV_packed, weights.W_UV.shape[-1], isa=self.isa)

    def attention_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            q.dtype == k.dtype == v.dtype == torch.bfloat16
            and q.device.type == "cpu"
            and native.simd_level(self.isa) == "avx512_bf16"
        ):
            return native.attention_with_lse(q, k, v, causal, scale, isa=self.isa)
        return sdpa.attention_with_lse(q, k, v, causal, scale)

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
        layout: CacheLayout,
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
        layout: CacheLayout,
        part: PlanPart,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # page ids were bounds-checked at the entry point against part.max_page_id (O(1)); the
        # op checks it once more against the cache (O(1)) instead of scanning the block table
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
            part.max_page_id,
            isa=self.isa,
        )
