"""The device seam's base class: :class:`KernelImpl`, what every kernel implementation provides,
the list of its per-call methods (:data:`SEAM_METHODS`), and the typed records those calls take.

An implementation subclasses :class:`KernelImpl` and sets ``name``. Every method of
:data:`SEAM_METHODS` is abstract here: an implementation serves each one with its own code or
delegates it explicitly to the torch implementation's (``m = torch_default("m")``,
:func:`mla_backend.ops.torch.torch_default`); a class that does neither is refused when it is
defined, naming the method (:func:`check_declared`), and :func:`served_by` says who serves
what (the registry, :mod:`mla_backend.ops.registry`, and ``python -m mla_backend info`` show
it). The per-call methods take one record each (:class:`LatentWrite`, :class:`AbsorbedCall`,
:class:`IndexKeyWrite`, :class:`IndexerCall`, :class:`SparseCall`, :class:`MaskedMHACall`,
:class:`KeySetCall` with :class:`KeyWindow` / :class:`KeyCache`), validated once at the public
entry points (:mod:`mla_backend.attention`, :mod:`mla_backend.sparse`,
:mod:`mla_backend.sparse_normal`, :mod:`mla_backend.keyset`) and handed down as they are to each
implementation's op wrappers, so no layer retypes their arguments. Per-plan
state an implementation keeps (a schedule, a planned third-party wrapper) is a
:class:`~mla_backend.parts.PlanState`, stored in the plan's
:class:`~mla_backend.parts.WorkPartition`; plan-time calls take a
:class:`~mla_backend.parts.StepShape`.

The plan-time hooks have neutral defaults (no torch code): one query block per request and one
split, no plan state, identity weight preparation, the generic CPU / GPU cost profile.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ..decision import Decision
from ..parts import PlanState, StepShape
from ..weights import AbsorbWeights

if TYPE_CHECKING:
    from ..cache_layout import CacheLayout
    from ..index_cache import IndexCacheLayout
    from ..parts import PlanPart, SparsePart

__all__ = [
    "SEAM_METHODS", "AbsorbedCall", "IndexKeyWrite", "IndexerCall", "KernelImpl", "KeyCache",
    "KeySetCall", "KeyWindow", "LatentWrite", "MaskedMHACall", "PlanState", "SparseCall",
    "StepShape", "V4SlotCall", "check_declared", "served_by",
]  # fmt: skip

#: the seam's per-call methods, in the order ``info`` lists them: every implementation serves
#: each one, with its own code or by an explicit delegation to the torch implementation's
SEAM_METHODS: tuple[str, ...] = (
    "absorb_q", "apply_W_UV", "write_latent", "absorbed_attention", "gather_latent",
    "decompress", "attention_with_lse", "write_index_keys", "indexer_logits", "indexer_topk",
    "sparse_absorbed_attention", "masked_attention_with_lse", "keyset_attention",
    "v4_slot_attention",
)  # fmt: skip
#: the attribute a delegated method carries: the implementation whose code serves it
DELEGATE_ATTR = "__seam_delegate__"


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
    (:mod:`mla_backend.ops.torch.indexer` states the rule every implementation follows).

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
class MaskedMHACall:
    """One masked MHA call of DSA's sparse MHA path (:mod:`mla_backend.sparse_normal`): every
    head of the query rows over decompressed keys and values, query row i seeing key j iff
    ``mask[i, j]``.

    Attributes:
        q: [H, Lq, Dqk]; k: [H, Lk, Dqk]; v: [H, Lk, Dv]; one dtype (bf16/fp16/fp32), last dims
            contiguous.
        mask: [Lq, Lk] bool, contiguous, shared by the heads (True: the key is selected).
        scale: softmax scale of ``q·k``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    scale: float


@dataclass(frozen=True, eq=False)
class KeyWindow:
    """Per-request sliding windows of a step (made by :func:`mla_backend.plan` from its
    ``window`` argument): query token at position p of request i sees the causal range
    ``max(0, p - sizes[i] + 1) .. p``.

    Attributes:
        sizes: per request of the step, the window size (>= 1 tokens; host ints).
        sizes_t: [B] int32 on the plan's device, the same values.
    """

    sizes: tuple[int, ...]
    sizes_t: torch.Tensor

    @staticmethod
    def make(window: int | Sequence[int], num_reqs: int, device: torch.device) -> KeyWindow:
        """Validate ``window`` (one int >= 1 for every request, or one per request) and make
        the record."""
        sizes = [window] * num_reqs if isinstance(window, int) else list(window)
        bad = [w for w in sizes if isinstance(w, bool) or not isinstance(w, int) or w < 1]
        if isinstance(window, bool) or bad or len(sizes) != num_reqs:
            raise ValueError(
                f"window={window!r} is not supported: an int >= 1 (tokens each query token sees, "
                f"itself included) or a sequence of {num_reqs} of them, one per request"
            )
        return KeyWindow(tuple(sizes), torch.tensor(sizes, dtype=torch.int32, device=device))

    def start(self, req: int, pos: torch.Tensor) -> torch.Tensor:
        """First visible position of query tokens at positions ``pos`` of request ``req``."""
        return (pos - self.sizes[req] + 1).clamp(min=0)


@dataclass(frozen=True)
class KeyCache:
    """A second paged cache of a key-set call (V4: the compressed rows), in the main cache's
    row format (same dtype, width and per-tensor kv scale), with its own pages.

    Attributes:
        kv_cache: [num_pages2, page_size2, W] (W, dtype: the main cache's).
        block_table: [B, max_pages2] int32 / int64: physical page of each logical page of the
            step's requests (B = the plan's requests, in its order).
        lens: [B] int32 / int64: entries each request has in this cache.
    """

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    lens: torch.Tensor


@dataclass(frozen=True)
class KeySetCall:
    """One attention call over key sets (:mod:`mla_backend.ops.torch.keyset_attention` states
    the semantics): each query token attends to a causal range with a start, index lists into
    the main cache and into a second cache (each distinct position of a cache counted once),
    with a per-head sink.

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


@dataclass(frozen=True)
class V4SlotCall:
    """DeepSeek-V4 attention over flat slots of caches in V4's 584-byte fp8 page layout
    (:mod:`mla_backend.v4_cache`), the contract of vLLM's CPU op ``flash_mla_with_kvcache_cpu``:
    per query token, one softmax over the distinct rows it lists in each cache and the per-head
    sink, the 512-wide row being key and value (no block table, no plan: the slots are the
    metadata). Validated by :func:`mla_backend.v4_layer.v4_attention_slots`.

    Attributes:
        q: [T, H, 512] bf16 / fp16 / fp32 queries (normalized and RoPE'd).
        sets: per cache ``(cache, slots, page_size)``: ``cache`` uint8 [num_pages, page_bytes]
            (bytes contiguous within a page), ``slots`` [T, k] int32 / int64 flat slots ``page *
            page_size + offset`` (negative = none; a slot listed twice counts once; each below
            ``num_pages * page_size``), ``page_size`` its rows per page. The window cache first.
        sink: [H] float32 per-head sink logits (finite, or -inf for none).
        softmax_scale: scale of ``q . k``.
        out: [T, H, 512] contiguous buffer of q's dtype, or None.
    """

    q: torch.Tensor
    sets: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]
    sink: torch.Tensor
    softmax_scale: float
    out: torch.Tensor | None = None


def _abstract_in(cls: type) -> list[str]:
    """The seam methods ``cls`` neither implements nor delegates (still :class:`KernelImpl`'s
    abstract ones)."""
    missing = []
    for m in SEAM_METHODS:
        attr = getattr(cls, m, None)
        if attr is None or getattr(attr, "__isabstractmethod__", False):
            missing.append(m)
    return missing


def check_declared(cls: type[KernelImpl]) -> None:
    """Refuse an implementation class that leaves a seam method undeclared (TypeError naming it
    and the two ways to declare it)."""
    missing = _abstract_in(cls)
    if missing:
        first = missing[0]
        raise TypeError(
            f"kernel implementation {cls.__module__}.{cls.__qualname__} ({cls.name!r}) neither "
            f"implements nor delegates the seam method(s) {', '.join(missing)}: define each, "
            f"or delegate it explicitly to the torch implementation ({first} = "
            f"torch_default({first!r}), from mla_backend.ops.torch)"
        )


def served_by(cls: type[KernelImpl]) -> dict[str, str]:
    """Seam method -> the implementation whose code serves it on ``cls``: the implementation
    that defines it (``cls``'s own name, or a base implementation's it composes), or the one it
    is delegated to (``torch_default``: ``"torch"``)."""
    check_declared(cls)
    out = {}
    for m in SEAM_METHODS:
        owner = next(c for c in cls.__mro__ if m in c.__dict__)
        delegate = getattr(owner.__dict__[m], DELEGATE_ATTR, None)
        out[m] = delegate or owner.name  # type: ignore[attr-defined]
    return out


class KernelImpl(ABC):
    """What every kernel implementation provides: the seam methods (:data:`SEAM_METHODS`,
    abstract: each implementation declares every one, see the module doc) and the plan-time
    hooks (neutral defaults).
    Tuning knobs are keyword arguments of an implementation's constructor; no call reads tensor
    data on the host.
    """

    #: the implementation's registered name (``MLA_BACKEND_IMPL`` value)
    name: ClassVar[str] = "base"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        check_declared(cls)

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
    @abstractmethod
    def absorb_q(
        self, q_nope: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``q_lat = q_nope · W_UK`` per head: q_nope [T, H, nope] -> [T, H, r] in its dtype
        (into ``out`` [T, H, r] when given)."""

    @abstractmethod
    def apply_W_UV(
        self, o_lat: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``o = o_lat · W_UV`` per head: o_lat [T, H, r] -> [T, H, v] in its dtype (into
        ``out`` [T, H, v] when given)."""

    @abstractmethod
    def write_latent(self, w: LatentWrite) -> None:
        """Write ``[c_kv ; k_pe]`` into the cache, in place (see :class:`LatentWrite`)."""

    @abstractmethod
    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_lat [T, H, r] in q's dtype, lse [T, H] float32, natural log), in ``call.out`` /
        ``call.lse`` when given (see :class:`AbsorbedCall`)."""

    # ---- per layer: normal path ----------------------------------------------------------
    @abstractmethod
    def gather_latent(
        self,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        part: PlanPart,
        i: int,
        start: int,
        end: int,
        dtype: torch.dtype,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Rows ``[start, end)`` of request ``i`` of ``part`` as [end - start, r + rope] in
        ``dtype``, dequantized by ``layout``: the normal path's read of the latent cache."""

    @abstractmethod
    def decompress(
        self, c_kv: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor, W_UV: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [L, r], k_pe [L, rope], W_UK [H, nope, r], W_UV [H, r, v] (one dtype) ->
        (k [H, L, nope + rope] = ``[c_kv·W_UK[h]^T ; k_pe]``, v [H, L, v] = ``c_kv·W_UV[h]``)."""

    @abstractmethod
    def attention_with_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA of q [H, Lq, Dqk] over k [H, Lk, Dqk], v [H, Lk, Dv] (top-left causal when
        ``causal``) -> (o [H, Lq, Dv] in q's dtype, lse [H, Lq] float32)."""

    # ---- per layer: DeepSeek Sparse Attention (DSA) ---------------------------------------
    @abstractmethod
    def write_index_keys(self, w: IndexKeyWrite) -> None:
        """Write the indexer keys into the index cache, in place (see :class:`IndexKeyWrite`)."""

    @abstractmethod
    def indexer_logits(self, call: IndexerCall) -> torch.Tensor:
        """float32 [T, call.sparse.max_kv_len]: the scores, -inf where a token does not see the
        position (see :class:`IndexerCall`)."""

    @abstractmethod
    def indexer_topk(self, call: IndexerCall) -> torch.Tensor:
        """[T, call.topk] int32: each token's best ``min(topk, visible)`` positions, ascending,
        then -1 (see :class:`IndexerCall`)."""

    @abstractmethod
    def sparse_absorbed_attention(self, call: SparseCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_lat [T, H, r] in q's dtype, lse [T, H] float32), in ``call.attn.out`` /
        ``call.attn.lse`` when given (see :class:`SparseCall`)."""

    @abstractmethod
    def masked_attention_with_lse(self, call: MaskedMHACall) -> tuple[torch.Tensor, torch.Tensor]:
        """DSA's sparse MHA: (o [H, Lq, Dv] in q's dtype, lse [H, Lq] float32; o = 0, lse = -inf
        for a row whose mask is empty) (see :class:`MaskedMHACall`)."""

    # ---- per layer: attention over key sets (dense MLA, DSA, DeepSeek-V4 as cases) ---------
    @abstractmethod
    def keyset_attention(self, call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(o [T, H, dv] in q's dtype, lse [T, H] float32, the sink included), in
        ``call.attn.out`` / ``call.attn.lse`` when given (see :class:`KeySetCall`;
        :mod:`mla_backend.ops.torch.keyset_attention` states the semantics)."""

    @abstractmethod
    def v4_slot_attention(self, call: V4SlotCall) -> torch.Tensor:
        """DeepSeek-V4 attention over flat slots of V4 fp8 caches: o [T, H, 512] in q's dtype,
        in ``call.out`` when given; a token that lists no row gets 0 (see :class:`V4SlotCall`;
        :mod:`mla_backend.ops.torch.v4_slot_attention` states the semantics)."""
