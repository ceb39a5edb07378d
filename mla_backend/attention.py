"""Public attention entry points: cache write, absorbed and normal attention, and
:class:`MLAAttention` (one layer's policy-routed attention).

Like FlashMLA's interface: plan the step once (:func:`mla_backend.plan`), then make one call per
layer. Inputs are validated here, once; the kernels come from the plan's implementation (the
device seam, :mod:`mla_backend.ops`). No call reads tensor data on the host.
"""

from __future__ import annotations

import torch

from .cache_layout import CacheLayout
from .checks import (
    QUERY_DTYPES,
    check_cache,
    check_devices,
    check_kv_scale_device,
    check_scale,
    check_slots,
    check_step,
)
from .dims import MLADims
from .normal import DEFAULT_CHUNK_TOKENS, normal_attention_part
from .ops import AbsorbedCall, KernelImpl, LatentWrite
from .plan import MLAPlan
from .selection import get_impl
from .weights import AbsorbWeights


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    impl: str | KernelImpl | None = None,
) -> None:
    """Write ``[c_kv ; k_pe]`` of T tokens into the paged cache (slot < 0 = padding, skipped).

    Args:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn, or uint8
            [num_pages, page_size, bytes] in the ``fp8_ds_mla`` layout
            (:mod:`mla_backend.cache_layout`), in place.
        c_kv: [T, r]; k_pe: [T, rope]; bf16/fp16/fp32, on the cache's device.
        slot_mapping: [>= T] int32/int64 flat slot per token, on the cache's device; a slot
            ``>= num_pages * page_size`` is refused (:func:`mla_backend.checks.check_slots`:
            a ValueError naming it on the CPU, a device-side assert on a GPU).
        kv_scale: float32 scalar tensor for an fp8 cache (stored = value / scale).
        impl: kernel implementation override (default: the device's resolved selection,
            :func:`mla_backend.selection.resolve`).
    """
    for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
        if t.dtype not in QUERY_DTYPES:
            raise ValueError(
                f"{name} dtype {t.dtype} is not supported; use bfloat16, float16 or float32"
            )
    layout = check_cache(kv_cache, c_kv.shape[-1], k_pe.shape[-1], kv_scale, c_kv.dtype)
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.dim() != 1:
        raise ValueError(
            f"slot_mapping {slot_mapping.dtype} {tuple(slot_mapping.shape)} is not supported: "
            "[>= T] int32/int64"
        )
    if c_kv.dim() != 2 or k_pe.dim() != 2:
        raise ValueError(
            f"c_kv {tuple(c_kv.shape)} and k_pe {tuple(k_pe.shape)} must be [T, r] and [T, rope]"
        )
    if c_kv.shape[0] != k_pe.shape[0] or slot_mapping.shape[0] < c_kv.shape[0]:
        raise ValueError(
            f"c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} disagree on the number of tokens"
        )
    check_devices(kv_cache.device, "the cache", c_kv=c_kv, k_pe=k_pe, slot_mapping=slot_mapping)
    check_kv_scale_device(kv_scale, kv_cache.device)
    check_slots(slot_mapping, c_kv.shape[0], kv_cache.shape[0] * kv_cache.shape[1], "cache")
    get_impl(kv_cache.device, impl).write_latent(
        LatentWrite(kv_cache, layout, c_kv, k_pe, slot_mapping, kv_scale)
    )


def _check_out(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    """An ``out=`` / ``lse=`` buffer must have the result's shape, dtype and device."""
    if t is None:
        return
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; the result is {shape} "
            f"{dtype} on {device}"
        )


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA (MQA over the shared latent) for every request of the step (decode and
    extend onto a prefix), whatever the policy decided.

    Args:
        q_lat: [T, H, r] = ``q_nope · W_UK``; q_pe: [T, H, rope] (rope may be 0);
            bf16/fp16/fp32; T == plan.num_tokens.
        kv_cache: [num_pages, page_size, r + rope], already holding all kv tokens.
        plan: the step's :class:`~mla_backend.plan.MLAPlan`.
        softmax_scale: scale of ``q·k``, a finite float > 0 (anything else is refused).
        kv_scale: float32 scalar tensor of an fp8 cache.
        out: optional [T, H, r] buffer in q_lat's dtype (any strides) for ``o_lat``.
        lse: optional [T, H] float32 buffer (any strides) for the log-sum-exp.
    Returns:
        (o_lat [T, H, r] in q_lat's dtype, lse [T, H] float32, natural log): ``out`` / ``lse``
        when given. A NaN / inf in a query or in a cache row a token attends makes that token's
        (head's) result unspecified (NaN, or o = 0 / lse = -inf, by implementation); every
        other token's result and all memory outside the outputs are unaffected.
    """
    layout = check_step(q_lat, q_pe, kv_cache, plan, q_lat.shape[-1] + q_pe.shape[-1], kv_scale)
    if q_lat.shape[-1] != plan.dims.kv_lora_rank:
        raise ValueError(
            f"q_lat width {q_lat.shape[-1]} != kv_lora_rank {plan.dims.kv_lora_rank}"
        )
    check_scale(softmax_scale)
    _check_out("out", out, tuple(q_lat.shape), q_lat.dtype, q_lat.device)
    _check_out("lse", lse, tuple(q_lat.shape[:2]), torch.float32, q_lat.device)
    call = AbsorbedCall(
        q_lat, q_pe, kv_cache, layout, plan.step, softmax_scale, kv_scale, out=out, lse=lse
    )
    with torch.no_grad():
        return plan.impl.absorbed_attention(call)


def _check_normal(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    weights: AbsorbWeights,
    kv_scale: torch.Tensor | None,
    chunk_tokens: int,
) -> CacheLayout:
    """Validate a normal-path or layer call; returns the cache's layout."""
    H, nope, r = weights.W_UK.shape
    layout = check_step(q_nope, q_pe, kv_cache, plan, r + q_pe.shape[-1], kv_scale)
    if q_nope.shape[1:] != (H, nope):
        raise ValueError(
            f"q_nope shape {tuple(q_nope.shape)} does not match the weights' [T, H={H}, "
            f"nope={nope}]"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an int >= 1")
    return layout


def normal_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    weights: AbsorbWeights,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    new_c_kv: torch.Tensor | None = None,
    new_k_pe: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The normal path (decompress + causal MHA) for every request of the step.

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope]; T == plan.num_tokens.
        kv_cache: [num_pages, page_size, r + rope], holding at least every request's prefix
            (and the new tokens too, unless ``new_c_kv`` [T, r] / ``new_k_pe`` [T, rope] give
            them).
        weights: the layer's :class:`AbsorbWeights` (``W_UK`` / ``W_UV`` decompress).
        chunk_tokens: prefix tokens decompressed at a time (bounds memory).
    Returns:
        (o [T, H, v] in q_nope's dtype, lse [T, H] float32).
    """
    layout = _check_normal(q_nope, q_pe, kv_cache, plan, weights, kv_scale, chunk_tokens)
    check_scale(softmax_scale)
    with torch.no_grad():
        return normal_attention_part(
            q_nope, q_pe, kv_cache, layout, plan.step, weights, softmax_scale, kv_scale,
            chunk_tokens, plan.impl, new_c_kv, new_k_pe,
        )


class MLAAttention:
    """One MLA layer's attention core: the absorbed and normal paths, routed by the plan.

    ``attn(q_nope, q_pe, kv_cache, plan)`` returns ``[T, H, v]`` (before ``o_proj``); the new
    tokens' latents must already be in ``kv_cache`` (:func:`write_latent`). The plan carries
    the policy's decision per request, made once per step for every layer.

    Args:
        dims: the layer's dims.
        weights: ``W_UK`` / ``W_UV`` (:func:`mla_backend.split_kv_b_proj` and friends).
        softmax_scale: default ``1 / sqrt(nope + rope)``.
        chunk_tokens: cached-prefix tokens the normal path decompresses at once.
    """

    def __init__(
        self,
        dims: MLADims,
        weights: AbsorbWeights,
        softmax_scale: float | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        H, nope, r, v = (dims.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank, dims.v_head_dim)
        expected = {"W_UK": (weights.W_UK, (H, nope, r)), "W_UV": (weights.W_UV, (H, r, v))}
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} shape {tuple(t.shape)} does not match dims: expected {list(shape)} "
                    f"for H={H}, nope={nope}, r={r}, v={v}"
                )
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an int >= 1")
        self.dims = dims
        self.weights = weights
        # the weights as each kernel implementation reads them (packed copies where it packs),
        # made once: now for the weights' device's default implementation, on first use for
        # another one a plan names
        self._prepared: dict[str, AbsorbWeights] = {}
        self._weights_for(get_impl(weights.W_UK.device))
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else dims.default_softmax_scale
        )
        check_scale(self.softmax_scale)
        self.chunk_tokens = chunk_tokens

    def __call__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: MLAPlan,
        kv_scale: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] -> o [T, H, v] in q_nope's dtype, written
        into ``out`` [T, H, v] when given (any strides with a contiguous last dim serve without
        a copy: a view of the engine's output buffer).

        Inference only: runs without autograd."""
        layout = _check_normal(
            q_nope, q_pe, kv_cache, plan, self.weights, kv_scale, self.chunk_tokens
        )
        T, H, v = q_nope.shape[0], self.dims.num_heads, self.dims.v_head_dim
        _check_out("out", out, (T, H, v), q_nope.dtype, q_nope.device)
        cache = (kv_cache, layout)
        with torch.no_grad():
            mode = plan.mode
            if mode == "absorbed":
                return self._absorbed(q_nope, q_pe, cache, plan, plan.step, kv_scale, out)
            if mode == "normal":
                o = self._normal(q_nope, q_pe, cache, plan, plan.step, kv_scale)
                return o if out is None else out.copy_(o)
            if out is None:
                out = q_nope.new_empty(T, H, v)
            for part, fn in ((plan.absorbed, self._absorbed), (plan.normal, self._normal)):
                rows = part.rows
                o = fn(q_nope[rows], q_pe[rows], cache, plan, part, kv_scale)
                out.index_copy_(0, rows, o)
            return out

    def absorb_q(self, q_nope: torch.Tensor, impl: KernelImpl | None = None) -> torch.Tensor:
        """``q_lat = q_nope · W_UK`` with this layer's weights as ``impl`` reads them (default:
        the device's implementation): q_nope [T, H, nope] -> [T, H, r] in its dtype. For
        callers that run the absorbed attention themselves (context-parallel shards)."""
        impl = impl if impl is not None else get_impl(q_nope.device)
        with torch.no_grad():
            return impl.absorb_q(q_nope, self._weights_for(impl))

    def apply_W_UV(self, o_lat: torch.Tensor, impl: KernelImpl | None = None) -> torch.Tensor:
        """``o = o_lat · W_UV``: o_lat [T, H, r] -> o [T, H, v] in its dtype (see
        :meth:`absorb_q`)."""
        impl = impl if impl is not None else get_impl(o_lat.device)
        with torch.no_grad():
            return impl.apply_W_UV(o_lat, self._weights_for(impl))

    def _weights_for(self, impl: KernelImpl) -> AbsorbWeights:
        w = self._prepared.get(impl.name)
        if w is None:
            w = self._prepared[impl.name] = impl.prepare_weights(self.weights)
        return w

    def _absorbed(self, q_nope, q_pe, cache, plan, part, kv_scale, out=None) -> torch.Tensor:
        """``W_UV · attn([q_nope·W_UK ; q_pe], [c_kv ; k_pe])`` -> [T, H, v] (into ``out``
        when given; ``cache``: the cache tensor and its layout)."""
        impl = plan.impl
        w = self._weights_for(impl)
        q_lat = impl.absorb_q(q_nope, w)
        call = AbsorbedCall(q_lat, q_pe, *cache, part, self.softmax_scale, kv_scale)
        o_lat, _ = impl.absorbed_attention(call)
        return impl.apply_W_UV(o_lat, w, out=out)

    def _normal(self, q_nope, q_pe, cache, plan, part, kv_scale) -> torch.Tensor:
        """Decompress + causal MHA -> [T, H, v]."""
        o, _ = normal_attention_part(
            q_nope, q_pe, *cache, part, self.weights, self.softmax_scale, kv_scale,
            self.chunk_tokens, plan.impl,
        )
        return o
