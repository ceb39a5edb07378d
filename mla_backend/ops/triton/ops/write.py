"""The cache write op ``mla_backend::triton_write_latent`` (:func:`write_latent`): one program
per new token scatters ``[c_kv ; k_pe]`` into its slot of the paged latent cache (plain rows,
per-tensor fp8 rows, or ``fp8_ds_mla`` rows with per-tile scales); it mutates the cache."""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .... import fp8 as _fp8
from ....cache_layout import FP8_TILE, CacheLayout
from ..jit import heuristics as hx
from ..jit.cache_write import write_latent_ds_kernel, write_latent_kernel
from .checks import (
    TL_DTYPE,
    check_cache,
    check_runnable,
    last_dim_contiguous,
    skip_launch,
)
from .fp8_decode import resolve_fp8_mode
from .launch import launch

_FLT_MIN = float(torch.finfo(torch.float32).tiny)


def write_latent_op(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: Optional[torch.Tensor],  # noqa: UP045 (torch's schema inference reads it)
    fp8_bits: bool,
) -> None:
    """``mla_backend::triton_write_latent``: arguments already checked by :func:`write_latent`
    (c_kv / k_pe last-dim contiguous, ``slots`` [T] contiguous, T >= 1)."""
    T, r = c_kv.shape
    rope = k_pe.shape[-1]
    if skip_launch(kv_cache):
        return
    check_runnable(kv_cache.device, write_latent_kernel)
    if kv_cache.dtype == torch.uint8:  # fp8_ds_mla (kv_scale is not used: per-tile scales)
        layout = CacheLayout.ds_mla(r, rope, c_kv.dtype)
        launch(
            write_latent_ds_kernel,
            (T,),
            kv_cache,
            c_kv,
            k_pe,
            slots,
            r,
            rope,
            kv_cache.shape[1],
            layout.scale_offset,
            layout.rope_offset,
            kv_cache.stride(0),
            kv_cache.stride(1),
            c_kv.stride(0),
            k_pe.stride(0) if rope else 0,
            NUM_TILES=hx.next_pow2(layout.tiles),
            TILE=FP8_TILE,
            BLOCK_ROPE=hx.dim_block(rope),
            HAS_ROPE=rope > 0,
            ROPE_DTYPE=TL_DTYPE[layout.rope_dtype],
            FP8_MAX=_fp8.FP8_MAX,
            FLT_MIN=_FLT_MIN,
        )
        return
    is_fp8 = kv_cache.dtype == _fp8.FP8_DTYPE
    has_scale = is_fp8 and kv_scale is not None
    scale = kv_scale if has_scale else c_kv
    launch(
        write_latent_kernel,
        (T,),
        kv_cache.view(torch.uint8) if fp8_bits else kv_cache,
        c_kv,
        k_pe,
        slots,
        scale,
        r,
        rope,
        kv_cache.shape[1],
        kv_cache.stride(0),
        kv_cache.stride(1),
        c_kv.stride(0),
        k_pe.stride(0) if rope else 0,
        BLOCK_R=hx.dim_block(r),
        BLOCK_ROPE=hx.dim_block(rope),
        HAS_ROPE=rope > 0,
        HAS_SCALE=has_scale,
        SATURATE=is_fp8,
        FP8_BITS=fp8_bits,
        FP8_MAX=_fp8.FP8_MAX,
    )


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    fp8_mode: str | None = None,
) -> None:
    """Write new tokens' latents into the paged cache (in place), through the custom op
    ``mla_backend::triton_write_latent``.

    Args:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn, or uint8
            [num_pages, page_size, width]: ``fp8_ds_mla`` rows (per-token, per-tile scales;
            k_pe in c_kv's dtype; bit-identical to :meth:`CacheLayout.pack`).
        c_kv: [T, r] float; k_pe: [T, rope] float (rope may be 0).
        slot_mapping: [>= T] int32/int64; token t goes to page ``slot // page_size``, row
            ``slot % page_size``; slots < 0 are padding and are skipped.
        kv_scale: float32 scalar; used for fp8 caches only (stored = value / scale, saturated
            to +-448), ignored otherwise, as in the torch path.
        fp8_mode: ``"native"`` or ``"bits"`` e4m3 conversion; default
            :func:`~.fp8_decode.fp8_mode`.
    """
    T, r = c_kv.shape
    rope = k_pe.shape[-1]
    if T == 0:
        return
    if kv_cache.dtype == torch.uint8 and c_kv.dtype not in TL_DTYPE:
        raise ValueError(f"c_kv dtype {c_kv.dtype} is not supported for an fp8_ds_mla cache")
    check_cache(kv_cache, r, rope, c_kv.dtype)
    check_runnable(kv_cache.device, write_latent_kernel)
    is_fp8 = kv_cache.dtype == _fp8.FP8_DTYPE
    fp8_bits = is_fp8 and resolve_fp8_mode(fp8_mode, kv_cache.device) == "bits"
    scale = kv_scale.float().reshape(()) if is_fp8 and kv_scale is not None else None
    torch.ops.mla_backend.triton_write_latent(
        kv_cache,
        last_dim_contiguous(c_kv),
        last_dim_contiguous(k_pe),
        slot_mapping[:T].contiguous(),
        scale,
        fp8_bits,
    )


if not hasattr(torch.ops.mla_backend, "triton_write_latent"):
    # once per process: a reload of this module keeps the first registration (the op looks its
    # kernels up in this module's globals, which a reload updates in place)
    triton_op("mla_backend::triton_write_latent", mutates_args={"kv_cache"})(write_latent_op)
