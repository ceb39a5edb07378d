"""The device seam's base class: :class:`KernelImpl`, what every kernel implementation provides,
with the shared defaults, and the typed records its calls take.

An implementation subclasses :class:`KernelImpl`, sets ``name`` and overrides only what it does
differently; it is registered with the seam's registry (:mod:`mla_backend.ops.registry`). The
per-layer calls take one record each (:class:`LatentWrite`, :class:`AbsorbedCall`), validated
once at the public entry points (:mod:`mla_backend.attention`), so no implementation retypes
their arguments. Per-plan state an implementation
keeps (a schedule, a planned third-party wrapper) is a :class:`~mla_backend.parts.PlanState`,
stored in the plan's :class:`~mla_backend.parts.WorkPartition`; plan-time calls take a
:class:`~mla_backend.parts.StepShape`.

Defaults (plain PyTorch, shared by every implementation that has nothing better): the
absorption bmms (:func:`mla_backend.weights.absorb_q` / ``apply_W_UV``), the normal path's cache
reads (:mod:`.paged`), decompression (:mod:`.dense`) and MHA (:mod:`.sdpa`), one query block
per request and one split, no plan state, identity weight preparation, the generic CPU / GPU
cost profile. ``write_latent`` and ``absorbed_attention`` have no default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ..decision import Decision
from ..parts import PlanState, StepShape
from ..weights import AbsorbWeights, absorb_q, apply_W_UV
from . import dense, paged, sdpa

if TYPE_CHECKING:
    from ..cache_layout import CacheLayout
    from ..parts import PlanPart

__all__ = ["AbsorbedCall", "KernelImpl", "LatentWrite", "PlanState", "StepShape"]


@dataclass(frozen=True)
class LatentWrite:
    """One cache write: ``[c_kv ; k_pe]`` of T tokens into their slots.

    Attributes:
        kv_cache: [num_pages, page_size, width] in ``layout`` (written in place).
        layout: the cache's :class:`~mla_backend.cache_layout.CacheLayout`.
        c_kv: [T, r]; k_pe: [T, rope]; bf16/fp16/fp32.
        slot_mapping: [>= T] int32/int64 flat slot per token (< 0: padding, skipped).
        kv_scale: float32 0-d tensor of a per-tensor fp8 cache (stored = value / scale), or None.
    """

    kv_cache: torch.Tensor
    layout: CacheLayout
    c_kv: torch.Tensor
    k_pe: torch.Tensor
    slot_mapping: torch.Tensor
    kv_scale: torch.Tensor | None


@dataclass(frozen=True)
class AbsorbedCall:
    """One absorbed attention call: MQA of every head over the latent rows, causal among the
    new tokens.

    Attributes:
        q_lat: [T, H, r] (``q_nope · W_UK``); q_pe: [T, H, rope]; bf16/fp16/fp32,
            T == part.num_tokens.
        kv_cache: [num_pages, page_size, width] in ``layout``, holding every kv token.
        layout: the cache's layout.
        part: the requests the call serves (host data, index tensors, work partition).
        softmax_scale: scale of ``q·k``.
        kv_scale: float32 0-d tensor of a per-tensor fp8 cache, or None.
        out: optional [T, H, r] buffer in q_lat's dtype to write ``o_lat`` into.
        lse: optional [T, H] float32 buffer to write the log-sum-exp into.
    """

    q_lat: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    layout: CacheLayout
    part: PlanPart
    softmax_scale: float
    kv_scale: torch.Tensor | None
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def deliver(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's results (``o`` [T, H, r], ``lse`` [T, H]) in the caller's buffers where it
        gave them (copied unless the kernel already wrote there), else as they are."""
        if self.out is not None and self.out.data_ptr() != o.data_ptr():
            self.out.copy_(o)
            o = self.out
        if self.lse is not None and self.lse.data_ptr() != lse.data_ptr():
            self.lse.copy_(lse)
            lse = self.lse
        return o, lse


class KernelImpl:
    """What every kernel implementation provides (see the module doc for the defaults).

    Tuning knobs are keyword arguments of an implementation's constructor; no call reads tensor
    data on the host.
    """

    #: the implementation's registered name (``MLA_BACKEND_IMPL`` value)
    name: ClassVar[str] = "base"

    def __repr__(self) -> str:
        return f"ops.{self.name}.Kernels()"

    # ---- what runs (the resolved selection) ----------------------------------------------
    def describe(self, device: torch.device) -> dict[str, Decision]:
        """This implementation's own decisions on ``device`` (ISA level, attention engine,
        GEMM dispatch, cost profile, ...), each with its reason; the selection record
        (:func:`mla_backend.selection.resolve`) shows them."""
        kind = "CPU" if device.type == "cpu" else "GPU"
        return {"cost_profile": Decision(f"generic {kind}", f"{self.name} has no fitted profile")}

    # ---- plan time -----------------------------------------------------------------------
    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The roofline the policy's ``cost`` mode prices both paths on (called at plan time)."""
        return CPU_PROFILE if device.type == "cpu" else GPU_PROFILE

    def work_shape(self, step: StepShape) -> tuple[int, int]:
        """(new tokens per query block, KV splits) of the absorbed kernel for these requests:
        by default one query block per request and one split."""
        return max(1, max(step.new_lens, default=1)), 1

    def plan_state(self, step: StepShape, block_q: int, num_splits: int) -> PlanState | None:
        """The implementation's per-plan state for a part (default: none)."""
        return None

    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        """A layer's weights in the form ``absorb_q`` / ``apply_W_UV`` read (once per layer,
        outside the step; may add packed copies). Default: as they are."""
        return weights

    # ---- per layer: absorbed path --------------------------------------------------------
    def absorb_q(
        self, q_nope: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``q_lat = q_nope · W_UK`` per head: q_nope [T, H, nope] -> [T, H, r] in its dtype
        (into ``out`` [T, H, r] when given)."""
        return absorb_q(q_nope, weights, out=out)

    def apply_W_UV(
        self, o_lat: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``o = o_lat · W_UV`` per head: o_lat [T, H, r] -> [T, H, v] in its dtype (into
        ``out`` [T, H, v] when given)."""
        return apply_W_UV(o_lat, weights, out=out)

    def write_latent(self, w: LatentWrite) -> None:
        """Write ``[c_kv ; k_pe]`` into the cache, in place (see :class:`LatentWrite`)."""
        raise NotImplementedError(f"{self.name} has no write_latent")

    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_lat [T, H, r] in q's dtype, lse [T, H] float32, natural log), in ``call.out`` /
        ``call.lse`` when given (see :class:`AbsorbedCall`)."""
        raise NotImplementedError(f"{self.name} has no absorbed_attention")

    # ---- per layer: normal path ----------------------------------------------------------
    #: rows ``[start, end)`` of request ``i`` of a part, dequantized: the normal path's read of
    #: the latent cache (:func:`mla_backend.ops.paged.gather_latent`; no implementation has its own)
    gather_latent = staticmethod(paged.gather_latent)

    def decompress(
        self, c_kv: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor, W_UV: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [L, r], k_pe [L, rope], W_UK [H, nope, r], W_UV [H, r, v] (one dtype) ->
        (k [H, L, nope + rope] = ``[c_kv·W_UK[h]^T ; k_pe]``, v [H, L, v] = ``c_kv·W_UV[h]``)."""
        return dense.decompress(c_kv, k_pe, W_UK, W_UV)

    def attention_with_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA of q [H, Lq, Dqk] over k [H, Lk, Dqk], v [H, Lk, Dv] (top-left causal when
        ``causal``) -> (o [H, Lq, Dv] in q's dtype, lse [H, Lq] float32)."""
        return sdpa.attention_with_lse(q, k, v, causal, scale)
