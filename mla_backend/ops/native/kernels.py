"""The native implementation of :class:`mla_backend.ops.KernelImpl` for CPU tensors: cache write
and absorbed attention from the C++ kernels of :mod:`mla_backend.ops.native` (compiled on first
use) for every cache layout (bf16/fp16/fp32, per-tensor fp8, ``fp8_ds_mla`` uint8 rows), and the
absorption GEMMs ``q_nope · W_UK`` / ``o_lat · W_UV`` for bf16 weights (packed once per layer by
:meth:`Kernels.prepare_weights`), the normal path's decompression and MHA and DSA's sparse
(masked) MHA for bf16 (all at every ISA level: fp32 sums, never torch's bf16 GEMM; other dtypes:
the torch implementation's); DSA's indexer (logits, top-k) and sparse attention from their C++
kernels; attention over key sets (windows, index lists into one or two caches, sinks) from
``csrc/keyset_attention.cpp``. Delegated explicitly to the torch implementation
(:func:`mla_backend.ops.torch.torch_default`): the normal path's cache reads
(``gather_latent``) and the index-key write."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...cost import DeviceProfile, stored_fit
from ...decision import Decision
from ..base import (
    AbsorbedCall,
    IndexerCall,
    KernelImpl,
    KeySetCall,
    LatentWrite,
    MaskedMHACall,
    SparseCall,
    StepShape,
    V4SlotCall,
)  # fmt: skip
from ..torch import DEFAULT as TORCH
from ..torch import torch_default
from . import ops as native
from .engine import select_engine
from .isa import ISA_LEVELS, select_isa
from .profile import profile_for, profile_key

if TYPE_CHECKING:
    from ...index_cache import IndexCacheLayout
    from ...weights import AbsorbWeights


#: rows (tokens of a GEMM, query rows x heads of an MHA) from which torch's AMX-backed bf16 ops
#: serve a call at level ``amx`` (:meth:`Kernels._torch_bf16_is_faster`)
AMX_TORCH_MIN_ROWS = 256


def torch_bf16_on_amx() -> bool:
    """Whether torch's own bf16 GEMM and SDPA can reach AMX tiles in this process: torch's
    kernels run at capability ``AVX512`` (not capped by ``ATEN_CPU_CAPABILITY``) and oneDNN is
    not capped below AMX (``ONEDNN_MAX_CPU_ISA`` unset, ``ALL``/``DEFAULT`` or an ``*AMX*`` ISA).
    Capped (an AVX2-only CPU imitated), torch's bf16 GEMM is far slower than our kernels
    (``benchmarks/results/gemm-latest.md``)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return onednn in ("", "ALL", "DEFAULT") or "AMX" in onednn


class Kernels(KernelImpl):
    """Native CPU kernels of one ISA level (``isa``, one of :data:`ISA_LEVELS`; None = the
    selected level, :func:`mla_backend.ops.native.selected_isa`). Tuning knob:
    ``num_kv_splits`` (0 = the kernel chooses)."""

    name = "native"

    gather_latent = torch_default("gather_latent")
    write_index_keys = torch_default("write_index_keys")

    def __init__(self, isa: str | None = None, *, num_kv_splits: int = 0) -> None:
        if num_kv_splits < 0:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 0 (0 = automatic)")
        if isa is not None and isa not in ISA_LEVELS:
            raise ValueError(f"isa={isa!r} is not supported; use one of {ISA_LEVELS} or None")
        #: the ISA level the kernels run at (None: the loader's pick); keys the cost profile
        self.isa = isa
        self.num_kv_splits = num_kv_splits
        self._level: Decision | None = None
        self._engine: Decision | None = None

    @property
    def level(self) -> str:
        """The ISA level these kernels run at (``isa``, or the process's selected level)."""
        return self._level_decision().value

    def _level_decision(self) -> Decision:
        if self._level is None:
            if self.isa is not None:
                self._level = Decision(self.isa, "chosen by the caller (Kernels(isa=...))")
            else:
                self._level = Decision(*select_isa())
        return self._level

    @property
    def engine(self) -> str:
        """The absorbed attention's compute engine at this level on this CPU (resolved once)."""
        return self._engine_decision().value

    def _engine_decision(self) -> Decision:
        if self._engine is None:
            self._engine = Decision(*select_engine(self.level))
        return self._engine

    def _torch_bf16_is_faster(self, rows: int) -> bool:
        """The one dispatch rule for compute-bound bf16 shapes: on a CPU with AMX tiles (level
        ``amx``) torch's bf16 GEMM and SDPA run on AMX through oneDNN and beat our kernels from
        :data:`AMX_TORCH_MIN_ROWS` rows on (measured with ``python -m benchmarks gemm``); at
        every other level, and at ``amx`` when torch itself is capped below AMX
        (:func:`torch_bf16_on_amx`), our kernels are the fast ones (torch's bf16 GEMM without
        bf16 dot products: ``benchmarks/results/gemm-latest.md``)."""
        return self.level == "amx" and rows >= AMX_TORCH_MIN_ROWS and torch_bf16_on_amx()

    def __repr__(self) -> str:
        return f"ops.native.Kernels(isa={self.isa!r}, num_kv_splits={self.num_kv_splits})"

    def describe(self, device: torch.device) -> dict[str, Decision]:
        level, engine = self._level_decision(), self._engine_decision()
        if level.value == "amx" and torch_bf16_on_amx():
            gemm = Decision(
                f"torch's AMX bf16 GEMM/SDPA from {AMX_TORCH_MIN_ROWS} rows, ours below",
                "level amx and torch's kernels reach AMX tiles",
            )
        else:
            why = (
                "torch is capped below AMX in this process" if level.value == "amx"
                else f"level {level.value}: torch's bf16 GEMM has no AMX tiles to beat ours"
            )
            gemm = Decision("ours at every size (bf16)", why)
        key = profile_key(level.value, engine.value)
        fit = stored_fit(key)
        profile = Decision(
            key,
            f"mla_backend/profiles.json: fitted on {fit.get('cpu', fit.get('device', '?'))}, "
            f"{fit.get('date', '?')} ({fit.get('score', 'no score')})",
        )
        return {
            "isa": level,
            "attention_engine": engine,
            "gemm_dispatch": gemm,
            "cost_profile": profile,
        }

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The measured profile of the native kernels at this ISA level and attention engine
        (:mod:`.profile`)."""
        return profile_for(self.level, self.engine)

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

    def _head_gemm(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        packed: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Our head GEMM where it serves (bf16, packed weights, the dispatch rule), else None."""
        if packed is None or x.dtype != torch.bfloat16 or self._torch_bf16_is_faster(x.shape[0]):
            return None
        if out is not None and (out.dtype != torch.bfloat16 or out.stride(-1) != 1):
            return None
        return native.head_gemm(x, packed, w.shape[-1], out=out, isa=self.level)

    def absorb_q(
        self, q_nope: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = self._head_gemm(q_nope, weights.W_UK, weights.W_UK_packed, out)
        return y if y is not None else TORCH.absorb_q(q_nope, weights, out)

    def apply_W_UV(
        self, o_lat: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = self._head_gemm(o_lat, weights.W_UV, weights.W_UV_packed, out)
        return y if y is not None else TORCH.apply_W_UV(o_lat, weights, out)

    def attention_with_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bf16 = q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu"
        if bf16 and not self._torch_bf16_is_faster(q.shape[1] * q.shape[0]):
            return native.attention_with_lse(q, k, v, causal, scale, isa=self.level)
        return TORCH.attention_with_lse(q, k, v, causal, scale)

    def masked_attention_with_lse(self, call: MaskedMHACall) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = call.q, call.k, call.v
        if q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu":
            return native.masked_attention_with_lse(call, isa=self.level)
        return TORCH.masked_attention_with_lse(call)

    def decompress(
        self, c_kv: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor, W_UV: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ts = (c_kv, k_pe, W_UK, W_UV)
        bf16 = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts)
        if bf16 and not self._torch_bf16_is_faster(c_kv.shape[0]):
            return native.decompress(c_kv, k_pe, W_UK, W_UV, isa=self.level)
        return TORCH.decompress(c_kv, k_pe, W_UK, W_UV)

    def work_shape(self, step: StepShape) -> tuple[int, int]:
        return max(1, max(step.new_lens, default=1)), self.num_kv_splits

    def write_latent(self, w: LatentWrite) -> None:
        native.write_latent(w, isa=self.level)

    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        # page ids were bounds-checked at the entry point against part.max_page_id (O(1)); the
        # op checks it once more against the cache (O(1)) instead of scanning the block table
        return call.deliver(*native.absorbed_attention(call, isa=self.level, engine=self.engine))

    @staticmethod
    def _native_index(layout: IndexCacheLayout) -> bool:
        """Whether the native indexer takes this index cache (an fp8 cache's quant block
        even, at most 64 scales per key, where a key has several)."""
        if layout.kind != "fp8" or layout.scales_per_key == 1:
            return True
        return layout.quant_block_size % 2 == 0 and layout.scales_per_key <= 64

    def indexer_logits(self, call: IndexerCall) -> torch.Tensor:
        if not self._native_index(call.layout):
            return TORCH.indexer_logits(call)
        return native.indexer_logits(call, isa=self.level)

    def indexer_topk(self, call: IndexerCall) -> torch.Tensor:
        if not self._native_index(call.layout):
            return TORCH.indexer_topk(call)
        return native.indexer_topk(call, isa=self.level)

    def sparse_absorbed_attention(self, call: SparseCall) -> tuple[torch.Tensor, torch.Tensor]:
        # page ids were bounds-checked at the entry point (part.max_page_id); the op checks
        # every index against its request's kv length before reading the cache
        o, lse = native.sparse_attention(call, isa=self.level, engine=self.engine)
        return call.attn.deliver(o, lse)

    def keyset_attention(self, call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor]:
        # page ids of the main cache were bounds-checked at the entry point
        # (part.max_page_id); the op checks every window, index and second-cache page
        o, lse = native.keyset_attention(call, isa=self.level, engine=self.engine)
        return call.attn.deliver(o, lse)

    def v4_slot_attention(self, call: V4SlotCall) -> torch.Tensor:
        # the op checks every slot against its cache and each cache's page size
        return native.v4_slot_attention(call, isa=self.level, engine=self.engine)
