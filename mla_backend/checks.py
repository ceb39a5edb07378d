"""Validation of the public entry points' inputs: each call's query, cache and plan against each
other, with errors that name the offending value and what is supported. Checks read shapes,
dtypes, devices and the plan's host data only, never tensor contents, except
:func:`check_slots` and :func:`check_kv_scale`, which refuse an out-of-range cache slot or a bad
fp8 scale with ``torch._assert_async`` (no host read on success; on the CPU a refusal raises in
the call, naming the value, on a GPU it is a device-side assert). The one place a call's cache
layout is resolved (:func:`check_cache` returns it for the implementation)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .cache_layout import CACHE_DTYPES, CACHE_DTYPES_TEXT, PLAIN_DTYPES, CacheLayout

if TYPE_CHECKING:
    from .plan import MLAPlan

QUERY_DTYPES = PLAIN_DTYPES


def check_scale(softmax_scale: object) -> None:
    """``softmax_scale`` must be a finite real number > 0 (TypeError / ValueError naming it)."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale={softmax_scale!r} ({type(softmax_scale).__name__}) is not supported: "
            "a float > 0 (e.g. 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim))"
        )
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be finite and > 0")


def check_devices(device: torch.device, what: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor (None skipped) must be on ``device`` (``what`` names it in the
    error)."""
    for name, t in tensors.items():
        if t is not None and not _same_device(t.device, device):
            raise ValueError(f"{name} is on {t.device}, but {what} is on {device}")


def check_slots(slot_mapping: torch.Tensor, n_tokens: int, n_slots: int, what: str) -> None:
    """Refuse a slot ``>= n_slots`` among ``slot_mapping[:n_tokens]`` (< 0 is padding) without
    reading the slots on the host: ``torch._assert_async``. On the CPU the refusal is a
    ValueError naming the first such slot (read only then); on a GPU a device-side assert."""
    if n_tokens == 0:
        return
    slots = slot_mapping[:n_tokens]

    def named() -> str:
        bad = int((slots >= n_slots).nonzero()[0, 0])
        return (
            f"slot_mapping[{bad}] = {int(slots[bad])} is outside the {what}: it has {n_slots} "
            f"slots (valid 0 .. {n_slots - 1}; < 0 = padding)"
        )

    _refuse_unless(
        (slots < n_slots).all(),
        f"slot_mapping holds a slot outside the {what} ({n_slots} slots; < 0 = padding)",
        named,
    )


def check_kv_scale(kv_scale: torch.Tensor | None) -> None:
    """A per-tensor fp8 scale must be finite and > 0 (the value is not read on the host:
    :func:`check_slots`'s refusal)."""
    if kv_scale is None:
        return
    if not kv_scale.dtype.is_floating_point:
        raise ValueError(f"kv_scale dtype {kv_scale.dtype} is not supported; use float32")
    _refuse_unless(
        (torch.isfinite(kv_scale) & (kv_scale > 0)).all(),
        "kv_scale must be finite and > 0",
        lambda: f"kv_scale = {float(kv_scale.reshape(()))} must be finite and > 0",
    )


def _refuse_unless(ok: torch.Tensor, msg: str, named: Callable[[], str]) -> None:
    """``torch._assert_async(ok, msg)``: no host read while ``ok`` holds; on the CPU a
    refusal is a ValueError with ``named()``'s message (which reads the values, then only), on
    a GPU a device-side assert."""
    try:
        torch._assert_async(ok, msg)
    except RuntimeError:
        if ok.device.type != "cpu":
            raise
        raise ValueError(named()) from None


def check_cache(
    kv_cache: torch.Tensor,
    r: int,
    rope: int,
    kv_scale: torch.Tensor | None,
    compute_dtype: torch.dtype,
) -> CacheLayout:
    """Validate a paged latent cache [num_pages, page_size, width] and return its layout
    (:mod:`mla_backend.cache_layout`)."""
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} is not supported; supported: {CACHE_DTYPES_TEXT}"
        )
    layout = CacheLayout.of(kv_cache, r, rope, compute_dtype)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != layout.width:
        what = (
            f"{layout.width} bytes (fp8_ds_mla rows for r={r}, rope={rope} in {compute_dtype})"
            if layout.tile_scaled
            else f"{layout.width} (kv_lora_rank + qk_rope_head_dim)"
        )
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not supported: expected "
            f"[num_pages, page_size, {layout.width}]: {what}"
        )
    if layout.tile_scaled and compute_dtype not in QUERY_DTYPES:
        raise ValueError(f"fp8_ds_mla keeps k_pe in the compute dtype, not {compute_dtype}")
    if kv_scale is not None and not layout.per_tensor_scale:
        raise ValueError(
            f"kv_scale is only meaningful for a per-tensor fp8 cache, not {layout.kind} "
            f"({kv_cache.dtype})"
        )
    if kv_scale is not None and kv_scale.numel() != 1:
        raise ValueError(
            f"kv_scale of shape {tuple(kv_scale.shape)} is not supported: the fp8 latent cache "
            "takes one per-tensor scale (use the fp8_ds_mla layout for per-token tile scales)"
        )
    check_kv_scale(kv_scale)
    return layout


def check_step(
    q_a: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    latent_dim: int,
    kv_scale: torch.Tensor | None,
) -> CacheLayout:
    """Validate one attention call's query, cache and plan against each other; returns the
    cache's layout."""
    from .plan import MLAPlan

    if not isinstance(plan, MLAPlan):
        raise ValueError(
            f"attention calls take the step's MLAPlan (mla_backend.plan(batch, dims)), got "
            f"{type(plan).__name__}"
        )
    if q_a.dtype not in QUERY_DTYPES or q_pe.dtype != q_a.dtype:
        raise ValueError(
            f"query dtypes {q_a.dtype}/{q_pe.dtype} are not supported; use one of bf16, fp16, "
            "fp32 for both"
        )
    if q_a.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_a.shape[:2]:
        raise ValueError(
            f"query shapes {tuple(q_a.shape)} / {tuple(q_pe.shape)} are not [T, H, *] / "
            "[T, H, rope] with the same T and H"
        )
    if q_a.shape[0] != plan.num_tokens:
        raise ValueError(
            f"queries hold {q_a.shape[0]} tokens but the plan describes {plan.num_tokens}"
        )
    if q_a.shape[1] != plan.dims.num_heads:
        raise ValueError(
            f"queries have {q_a.shape[1]} heads but the plan's dims have {plan.dims.num_heads}"
        )
    if q_pe.shape[-1] != plan.dims.qk_rope_head_dim:
        raise ValueError(
            f"q_pe width {q_pe.shape[-1]} != qk_rope_head_dim {plan.dims.qk_rope_head_dim}"
        )
    layout = check_cache(
        kv_cache, latent_dim - q_pe.shape[-1], q_pe.shape[-1], kv_scale, q_a.dtype
    )
    layout.check_query_dtype(q_a.dtype)
    if kv_cache.shape[1] != plan.page_size:
        raise ValueError(
            f"kv_cache page size {kv_cache.shape[1]} != the plan's page_size {plan.page_size}"
        )
    if plan.max_page_id >= kv_cache.shape[0]:
        raise ValueError(
            f"block_table holds page id {plan.max_page_id} for a used page, but the cache has "
            f"{kv_cache.shape[0]} pages (valid ids 0..{kv_cache.shape[0] - 1})"
        )
    if not (_same_device(q_a.device, plan.device) and _same_device(kv_cache.device, plan.device)):
        raise ValueError(
            f"queries on {q_a.device} and cache on {kv_cache.device}, but the plan was made "
            f"for {plan.device}"
        )
    check_devices(kv_cache.device, "the cache", q_pe=q_pe)
    check_kv_scale_device(kv_scale, kv_cache.device)
    return layout


def check_kv_scale_device(kv_scale: torch.Tensor | None, device: torch.device) -> None:
    """A per-tensor fp8 scale lives on the cache's device or on the CPU (a 0-d host scalar)."""
    if kv_scale is not None and kv_scale.device.type != "cpu":
        check_devices(device, "the cache", kv_scale=kv_scale)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
