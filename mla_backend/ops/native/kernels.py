"""The native implementation of :class:`mla_backend.ops.KernelImpl` for CPU tensors: cache write
and absorbed attention from the C++ kernels of :mod:`mla_backend.ops.native` (compiled on first
use) for every cache layout (bf16/fp16/fp32, per-tensor fp8, ``fp8_ds_mla`` uint8 rows), and the
absorption GEMMs ``q_nope · W_UK`` / ``o_lat · W_UV`` for bf16 weights (packed once per layer by
:meth:`Kernels.prepare_weights`), the normal path's decompression and MHA for bf16 (all at every
ISA level: fp32 sums, never torch's bf16 GEMM; other dtypes: torch's bmm, mm and SDPA); the
normal path's cache reads from the shared helpers (:mod:`mla_backend.ops.paged`); DSA's indexer
(logits, top-k) and sparse attention from their C++ kernels, the index-key write from the torch
helper (:mod:`mla_backend.ops.indexer`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...cost import DeviceProfile
from ...weights import absorb_q, apply_W_UV
from .. import dense, indexer, paged, sdpa
from . import ops as native
from .build import ISA_LEVELS, selected_isa
from .engine import attention_engine
from .profile import profile_for

if TYPE_CHECKING:
    from ...cache_layout import CacheLayout
    from ...dims import MLADims
    from ...index_cache import IndexCacheLayout
    from ...parts import PlanPart, SparsePart
    from ...weights import AbsorbWeights


#: rows (tokens of a GEMM, query rows x heads of an MHA) from which torch's AMX-backed bf16 ops
#: serve a call at level ``amx`` (:meth:`Kernels._torch_bf16_is_faster`)
AMX_TORCH_MIN_ROWS = 256


def torch_bf16_on_amx() -> bool:
    """Whether torch's own bf16 GEMM and SDPA can reach AMX tiles in this process: torch's
    kernels run at capability ``AVX512`` (not capped by ``ATEN_CPU_CAPABILITY``) and oneDNN is
    not capped below AMX (``ONEDNN_MAX_CPU_ISA`` unset, ``ALL``/``DEFAULT`` or an ``*AMX*`` ISA).
    Capped (an AVX2-only CPU imitated), torch's bf16 GEMM runs at ~1 GFLOP/s."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return onednn in ("", "ALL", "DEFAULT") or "AMX" in onednn


class Kernels:
    """Native CPU kernels of one ISA level (``isa``, one of :data:`ISA_LEVELS`; None = the
    selected level, :func:`mla_backend.ops.native.selected_isa`). Tuning knob:
    ``num_kv_splits`` (0 = the kernel chooses)."""

    name = "native"
    # shared helpers (composition: each is the same function in every implementation)
    gather_latent = staticmethod(paged.gather_latent)
    write_index_keys = staticmethod(indexer.write_index_keys)

    def __init__(self, isa: str | None = None, *, num_kv_splits: int = 0) -> None:
        if num_kv_splits < 0:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 0 (0 = automatic)")
        if isa is not None and isa not in ISA_LEVELS:
            raise ValueError(f"isa={isa!r} is not supported; use one of {ISA_LEVELS} or None")
        #: the ISA level the kernels run at (None: the loader's pick); keys the cost profile
        self.isa = isa
        self.num_kv_splits = num_kv_splits
        self._level: str | None = None

    @property
    def level(self) -> str:
        """The ISA level these kernels run at (``isa``, or the process's selected level)."""
        if self._level is None:
            self._level = self.isa if self.isa is not None else selected_isa()
        return self._level

    def _torch_bf16_is_faster(self, rows: int) -> bool:
        """The one dispatch rule for compute-bound bf16 shapes: on a CPU with AMX tiles (level
        ``amx``) torch's bf16 GEMM and SDPA run on AMX through oneDNN and beat our kernels from
        :data:`AMX_TORCH_MIN_ROWS` rows on (measured, ``python -m benchmarks gemm``: head GEMM
        at 512 rows 1.0 vs 2.5 ms, MHA 1.25-1.37x, decompression 41 vs 51 ms per 4K tokens);
        at every other level, and at ``amx`` when torch itself is capped below AMX
        (:func:`torch_bf16_on_amx`), our kernels are the fast ones (torch's bf16 GEMM without
        bf16 dot products runs at ~1 GFLOP/s: a normal prefill took 19 s instead of 0.3)."""
        return self.level == "amx" and rows >= AMX_TORCH_MIN_ROWS and torch_bf16_on_amx()

    def __repr__(self) -> str:
        return f"ops.native.Kernels(isa={self.isa!r}, num_kv_splits={self.num_kv_splits})"

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The measured profile of the native kernels at this ISA level and attention engine
        (:mod:`.profile`)."""
        return profile_for(self.level, attention_engine(self.level))

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
            W_UK_packed=native.pack_heads(weights.W_UK, isa=self.level),
            W_UV_packed=native.pack_heads(weights.W_UV, isa=self.level),
        )

    def absorb_q(self, q_nope: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        if (
            weights.W_UK_packed is None
            or q_nope.dtype != torch.bfloat16
            or self._torch_bf16_is_faster(q_nope.shape[0])
        ):
            return absorb_q(q_nope, weights)
        return native.head_gemm(q_nope, weights.W_UK_packed, weights.W_UK.shape[-1], isa=self.level)

    def apply_W_UV(self, o_lat: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        if (
            weights.W_UV_packed is None
            or o_lat.dtype != torch.bfloat16
            or self._torch_bf16_is_faster(o_lat.shape[0])
        ):
            return apply_W_UV(o_lat, weights)
        return native.head_gemm(o_lat, weights.W_UV_packed, weights.W_UV.shape[-1], isa=self.level)

    def attention_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bf16 = q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu"
        if bf16 and not self._torch_bf16_is_faster(q.shape[1] * q.shape[0]):
            return native.attention_with_lse(q, k, v, causal, scale, isa=self.level)
        return sdpa.attention_with_lse(q, k, v, causal, scale)

    def decompress(
        self,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        W_UK: torch.Tensor,
        W_UV: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ts = (c_kv, k_pe, W_UK, W_UV)
        bf16 = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts)
        if bf16 and not self._torch_bf16_is_faster(c_kv.shape[0]):
            return native.decompress(c_kv, k_pe, W_UK, W_UV, isa=self.level)
        return dense.decompress(c_kv, k_pe, W_UK, W_UV)

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
        native.write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale, isa=self.level)

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
            isa=self.level,
        )

    @staticmethod
    def _native_index(layout: IndexCacheLayout) -> bool:
        """Whether the native indexer takes this index cache (an fp8 cache's quant block
        even, at most 64 scales per key, where a key has several)."""
        if layout.kind != "fp8" or layout.scales_per_key == 1:
            return True
        return layout.quant_block_size % 2 == 0 and layout.scales_per_key <= 64

    def indexer_logits(
        self,
        q_I: torch.Tensor,
        weights: torch.Tensor,
        index_cache: torch.Tensor,
        layout: IndexCacheLayout,
        part: PlanPart,
        sparse_part: SparsePart,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self._native_index(layout):
            return indexer.indexer_logits(
                q_I, weights, index_cache, layout, part, sparse_part, out
            )
        res = native.indexer_logits(
            q_I, weights, index_cache, part.block_table, part.cu_new_t, part.kv_lens_t,
            layout.quant_block_size, sparse_part.max_kv_len, part.max_page_id, isa=self.level,
        )  # fmt: skip
        return res if out is None else out.copy_(res)

    def indexer_topk(
        self,
        q_I: torch.Tensor,
        weights: torch.Tensor,
        index_cache: torch.Tensor,
        layout: IndexCacheLayout,
        part: PlanPart,
        sparse_part: SparsePart,
        topk: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self._native_index(layout):
            return indexer.indexer_topk(
                q_I, weights, index_cache, layout, part, sparse_part, topk, out
            )
        return native.indexer_topk(
            q_I, weights, index_cache, part.block_table, part.cu_new_t, part.kv_lens_t,
            layout.quant_block_size, topk, part.max_page_id, out, isa=self.level,
        )  # fmt: skip

    def sparse_absorbed_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        part: PlanPart,
        sparse_part: SparsePart,
        indices: torch.Tensor,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # page ids were bounds-checked at the entry point (part.max_page_id); the op checks
        # every index against its request's kv length before reading the cache
        return native.sparse_attention(
            q_lat, q_pe, kv_cache, part.block_table, part.cu_new_t, part.kv_lens_t, indices,
            sparse_part.token_req_t, softmax_scale, kv_scale, part.max_page_id, out, lse,
            isa=self.level,
        )  # fmt: skip
