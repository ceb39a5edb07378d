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
cost profile; DeepSeek Sparse Attention's index-key write, indexer logits / top-k
(:mod:`.indexer`) and sparse attention (:mod:`.sparse`) in plain torch; attention over key
sets (:mod:`.keyset`: windows, index lists into one or two caches, sinks) in plain torch.
``write_latent`` and ``absorbed_attention`` have no default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ..decision import Decision
from ..parts import PlanState, StepShape
from ..weights import AbsorbWeights, absorb_q, apply_W_UV
from . import dense, indexer, keyset, paged, sdpa, sparse
from .keyset import KeyCache, KeyWindow

if TYPE_CHECKING:
    from ..cache_layout import CacheLayout
    from ..index_cache import IndexCacheLayout
    from ..parts import PlanPart, SparsePart

__all__ = [
    "AbsorbedCall", "IndexKeyWrite", "IndexerCall", "KernelImpl", "KeySetCall", "LatentWrite",
    "PlanState", "SparseCall", "StepShape",
]  # fmt: skip


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


@dataclass(frozen=True)
class IndexKeyWrite:
    """One write of DSA indexer keys into the paged index cache.

    Attributes:
        index_cache: [num_pages, page_size, W] in ``layout`` (written in place).
        layout: the cache's :class:`~mla_backend.index_cache.IndexCacheLayout`.
        k_I: [T, Di] bf16/fp16/fp32 keys.
        slot_mapping: [>= T] int32/int64 flat slot per token (< 0: padding, skipped).
    """

    index_cache: torch.Tensor
    layout: IndexCacheLayout
    k_I: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class IndexerCall:
    """One lightning-indexer call: ``I[s, t] = sum_h weights[s, h] * relu(q_I[s, h] . k_I[t])``
    over the positions each query token sees, then (``topk`` > 0) its causal top-k
    (:mod:`mla_backend.ops.indexer` states the rule every implementation follows).

    Attributes:
        q_I: [T, Hi, Di] bf16/fp16/fp32/float8_e4m3fn; weights: [T, Hi] float32.
        index_cache: the paged index cache in ``layout``, read through ``part``'s block table.
        part: the step (host data, index tensors); sparse: its per-token DSA data.
        topk: positions per token (0: the logits only).
        out: optional output buffer ([T, topk] int32, or [T, sparse.max_kv_len] float32).
    """

    q_I: torch.Tensor
    weights: torch.Tensor
    index_cache: torch.Tensor
    layout: IndexCacheLayout
    part: PlanPart
    sparse: SparsePart
    topk: int = 0
    out: torch.Tensor | None = None


@dataclass(frozen=True)
class SparseCall:
    """One sparse absorbed attention call: the attention of ``attn`` (queries, cache, part,
    scale, output buffers) with each query token restricted to its own index list.

    Attributes:
        attn: the :class:`AbsorbedCall` it restricts (``attn.part`` is the step).
        sparse: the step's per-token DSA data (each token's request).
        indices: [T, k] int32/int64 logical positions of the token's request, -1 = none.
    """

    attn: AbsorbedCall
    sparse: SparsePart
    indices: torch.Tensor


@dataclass(frozen=True)
class KeySetCall:
    """One attention call over key sets (:mod:`mla_backend.ops.keyset` states the semantics):
    each query token attends to a causal range with a start, index lists into the main cache
    and into a second cache, with a per-head sink.

    Attributes:
        attn: the :class:`AbsorbedCall` it generalises (queries, main cache, ``attn.part`` =
            the plan's whole step, scale, output buffers; ``attn.out`` is [T, H, r + rope]
            when ``value_is_key``).
        window: the plan's per-request windows (None: the range starts at 0).
        causal_range: whether the causal range of the main cache is in the key set.
        indices: [T, k] int32 / int64 positions of the main cache, -1 = none (or None).
        extra: the second cache (or None); extra_indices: [T, k2] its entries (or None).
        sink: [H] float32 per-head sink logits (or None).
        value_is_key: the value is the whole row (else its first r columns).
    """

    attn: AbsorbedCall
    window: KeyWindow | None
    causal_range: bool = True
    indices: torch.Tensor | None = None
    extra: KeyCache | None = None
    extra_indices: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    value_is_key: bool = False

    @property
    def value_width(self) -> int:
        """dv: r, or r + rope when ``value_is_key``."""
        a = self.attn
        return a.q_lat.shape[-1] + (a.q_pe.shape[-1] if self.value_is_key else 0)


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

    # ---- per layer: DeepSeek Sparse Attention (DSA) ---------------------------------------
    def write_index_keys(self, w: IndexKeyWrite) -> None:
        """Write the indexer keys into the index cache, in place (see :class:`IndexKeyWrite`)."""
        indexer.write_index_keys(w.index_cache, w.layout, w.k_I, w.slot_mapping)

    def indexer_logits(self, call: IndexerCall) -> torch.Tensor:
        """float32 [T, call.sparse.max_kv_len]: the scores, -inf where a token does not see the
        position (see :class:`IndexerCall`)."""
        c = call
        return indexer.indexer_logits(
            c.q_I, c.weights, c.index_cache, c.layout, c.part, c.sparse, c.out
        )

    def indexer_topk(self, call: IndexerCall) -> torch.Tensor:
        """[T, call.topk] int32: each token's best ``min(topk, visible)`` positions, ascending,
        then -1 (see :class:`IndexerCall`)."""
        c = call
        return indexer.indexer_topk(
            c.q_I, c.weights, c.index_cache, c.layout, c.part, c.sparse, c.topk, c.out
        )

    def sparse_absorbed_attention(self, call: SparseCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_lat [T, H, r] in q's dtype, lse [T, H] float32), in ``call.attn.out`` /
        ``call.attn.lse`` when given (see :class:`SparseCall`)."""
        a = call.attn
        return sparse.sparse_absorbed_attention(
            a.q_lat, a.q_pe, a.kv_cache, a.layout, a.part, call.sparse, call.indices,
            a.softmax_scale, a.kv_scale, a.out, a.lse,
        )  # fmt: skip

    # ---- per layer: attention over key sets (dense MLA, DSA, DeepSeek-V4 as cases) ---------
    def keyset_attention(self, call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(o [T, H, dv] in q's dtype, lse [T, H] float32, the sink included), in
        ``call.attn.out`` / ``call.attn.lse`` when given (see :mod:`mla_backend.ops.keyset`)."""
        a = call.attn
        o, lse = keyset.keyset_attention(
            a.q_lat, a.q_pe, a.kv_cache, a.layout, a.part, a.softmax_scale, a.kv_scale,
            call.window, call.causal_range, call.indices, call.extra, call.extra_indices,
            call.sink, call.value_is_key,
        )  # fmt: skip
        return a.deliver(o, lse)
