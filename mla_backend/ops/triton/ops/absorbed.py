"""The absorbed attention op ``mla_backend::triton_absorbed_attention``
(:func:`absorbed_attention`): its checks, its compile-time half (:func:`attention_meta`, which
the ahead-of-time resource check reads too), the launch of the Triton kernel or the Gluon
kernel (:mod:`.gluon`) with the argument lists they share written once, and the merge of split
query blocks' partials."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import triton
from torch.library import triton_op

from .... import fp8 as _fp8
from ....cache_layout import FP8_TILE, CacheLayout
from ..jit import heuristics as hx
from ..jit.attention import absorbed_attn_kernel, merge_splits_kernel
from ..schedule import TritonSchedule, max_partial_slots
from . import gluon as gluon_module
from .checks import (
    TL_DTYPE,
    check_cache,
    check_runnable,
    last_dim_contiguous,
    skip_launch,
)
from .fp8_decode import resolve_fp8_mode
from .launch import interpreting, launch

if TYPE_CHECKING:
    from ....parts import PlanPart

_LOG2E = 1.0 / math.log(2.0)


def attention_meta(
    r: int,
    rope: int,
    q_dtype: torch.dtype,
    cache: str,
    block_q: int,
    block_h: int,
    block_n: int,
    fp8_bits: bool,
    interpreting: bool,
    chunk: int = hx.LATENT_CHUNK,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_f16: bool = False,
) -> dict[str, object]:
    """The compile-time half of an ``absorbed_attn_kernel`` launch: its constexprs and launch
    options (``num_warps``, ...), from the shapes and knobs alone. The launch uses it, and so
    does the ahead-of-time resource check (``python -m benchmarks gpu-resources``), so what is
    checked is what runs.

    Args:
        r, rope: latent and rope widths; q_dtype: the queries' (compute) dtype.
        cache: ``"plain"`` (bf16/fp16/fp32 rows, or e4m3 without a scale), ``"fp8"`` (e4m3
            with a per-tensor ``kv_scale``) or ``"ds"`` (``fp8_ds_mla`` rows).
        block_q, block_h, block_n: the tiles; fp8_bits: decode e4m3 bytes with integer ops.
        interpreting: for the Triton interpreter (bf16 dots widened to fp32, bf16 rounding).
        chunk: latent columns per chunk (:func:`heuristics.latent_chunks`).
        num_warps / num_stages: launch options (None: :func:`heuristics.num_warps` / Triton's
            default).
        fp8_f16: e4m3 caches (``fp8``, ``ds``): the latent dots in fp16 (see :class:`Kernels`).
    """
    round_bf16 = interpreting and q_dtype == torch.bfloat16
    dot_dtype = torch.float32 if round_bf16 else q_dtype  # see the package doc
    block_r = hx.dim_block(r)
    f16 = fp8_f16 and cache in ("fp8", "ds")
    lat_dtype = torch.float16 if f16 else dot_dtype
    return dict(
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_ROPE=hx.dim_block(rope),
        HAS_ROPE=rope > 0,
        HAS_SCALE=cache == "fp8",
        FP8_BITS=fp8_bits,
        DOT_DTYPE=TL_DTYPE[dot_dtype],
        P_DTYPE=TL_DTYPE[q_dtype],
        IEEE=dot_dtype == torch.float32,
        ROUND_BF16=round_bf16,
        DS=cache == "ds",
        TILE=FP8_TILE,
        ROPE_DTYPE=TL_DTYPE[q_dtype],
        NUM_CHUNKS=hx.latent_chunks(block_r, chunk, FP8_TILE if cache == "ds" else None),
        LAT_DTYPE=TL_DTYPE[lat_dtype],
        LAT_P_DTYPE=TL_DTYPE[torch.float16 if f16 else q_dtype],
        LAT_IEEE=lat_dtype == torch.float32,
        num_warps=num_warps or hx.num_warps(block_q * block_h, block_r),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )


def absorbed_attention_op(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_lens: torch.Tensor,
    cu_new: torch.Tensor,
    q_block_req: torch.Tensor,
    q_block_start: torch.Tensor,
    part_meta: torch.Tensor,
    split_base: torch.Tensor,
    kv_scale: Optional[torch.Tensor],  # noqa: UP045 (torch's schema inference reads it)
    softmax_scale: float,
    block_q: int,
    block_h: int,
    block_n: int,
    fp8_bits: bool,
    chunk: int,
    num_warps: int,
    num_stages: int,
    fp8_f16: bool,
    gluon: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_backend::triton_absorbed_attention``: arguments already checked by
    :func:`absorbed_attention` (the plan part's int32 index tensors, its work partition
    ``block_q`` and schedule ``part_meta`` [num_parts, 5] / ``split_base`` [W + 1], q_lat /
    q_pe last-dim contiguous, kv_scale a float32 scalar or None; ``num_warps`` /
    ``num_stages`` 0: the defaults).
    Returns (o_lat [T, H, r] in q_lat's dtype, lse [T, H] float32)."""
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    device = q_lat.device
    cd = q_lat.dtype
    o_lat = torch.empty(T, H, r, dtype=cd, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    if T == 0 or H == 0:
        return o_lat, lse
    block_r = hx.dim_block(r)
    num_q_blocks = q_block_req.shape[0]
    num_pieces = part_meta.shape[0]
    grid = (triton.cdiv(H, block_h), num_pieces)
    max_splits = max_partial_slots(num_pieces)  # bounded by the pieces, not by the batch
    part_o = torch.empty(max_splits, block_q, H, r, dtype=torch.float32, device=device)
    part_lse = torch.empty(max_splits, block_q, H, dtype=torch.float32, device=device)
    if skip_launch(q_lat):
        return o_lat, lse
    check_runnable(device, absorbed_attn_kernel)
    round_bf16 = interpreting() and cd == torch.bfloat16
    # what both attention kernels take, in their signatures' order: the schedule (the plan
    # part's index tensors), the outputs and partials (never written when nothing is split),
    # the head count; and the block table's and outputs' strides
    schedule_args = (
        block_table, prefix_lens, new_lens, cu_new, q_block_req, q_block_start, part_meta,
        split_base, o_lat, lse, part_o if max_splits else lse, part_lse if max_splits else lse,
        H,
    )  # fmt: skip
    stride_args = (block_table.stride(0), o_lat.stride(0), o_lat.stride(1), lse.stride(0),
                   lse.stride(1))  # fmt: skip
    qk_scale_log2 = softmax_scale * _LOG2E
    if gluon:
        gluon_module.launch_gluon_attention(q_lat, q_pe, kv_cache, schedule_args, qk_scale_log2,
                                     stride_args, block_q, block_h, grid)  # fmt: skip
    else:
        ds = kv_cache.dtype == torch.uint8  # fp8_ds_mla rows
        has_scale = kv_scale is not None and not ds
        if ds:
            layout = CacheLayout.ds_mla(r, rope, cd)
            scale_offset, rope_offset = layout.scale_offset, layout.rope_offset
            kv_arg = kv_cache if fp8_bits else kv_cache.view(_fp8.FP8_DTYPE)
        else:
            scale_offset = rope_offset = 0
            kv_arg = kv_cache.view(torch.uint8) if fp8_bits else kv_cache
        meta = attention_meta(
            r, rope, cd, "ds" if ds else ("fp8" if has_scale else "plain"), block_q, block_h,
            block_n, fp8_bits, interpreting(), chunk, num_warps or None, num_stages or None,
            fp8_f16,
        )
        q_pe_arg = q_pe if rope else q_lat
        launch(
            absorbed_attn_kernel,
            grid,
            q_lat,
            q_pe_arg,
            kv_arg,
            kv_scale if has_scale else lse,
            *schedule_args,
            r,
            rope,
            kv_cache.shape[1],
            scale_offset,
            rope_offset,
            qk_scale_log2,
            q_lat.stride(0),
            q_lat.stride(1),
            q_pe_arg.stride(0),
            q_pe_arg.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            *stride_args,
            **meta,
        )
    if max_splits:
        merge_block_h = min(hx.next_pow2(H), 16)
        launch(
            merge_splits_kernel,
            (num_q_blocks * block_q, triton.cdiv(H, merge_block_h)),
            q_block_req,
            q_block_start,
            new_lens,
            cu_new,
            split_base,
            part_o,
            part_lse,
            o_lat,
            lse,
            H,
            r,
            *stride_args[1:],
            BLOCK_Q=block_q,
            BLOCK_H=merge_block_h,
            BLOCK_R=block_r,
            ROUND_BF16=round_bf16,
            num_warps=4,
        )
    return o_lat, lse


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    part: PlanPart,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    schedule: TritonSchedule | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    fp8_mode: str | None = None,
    chunk: int = hx.LATENT_CHUNK,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_f16: bool = False,
    gluon: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the paged latent cache (decode and extend), through the
    custom op ``mla_backend::triton_absorbed_attention``.

    Args:
        q_lat: [T, H, r] absorbed query (``q_nope · W_UK``), bf16/fp16/fp32.
        q_pe: [T, H, rope] rotated rope query (rope may be 0).
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn, or uint8
            ``fp8_ds_mla`` rows (tile scales applied in-kernel; k_pe in q_lat's dtype; kv_scale
            ignored); holds every request's ``prefix_lens[i] + new_lens[i]`` tokens.
        part: the plan's requests (T == part.num_tokens); its work partition gives the query
            blocks and, unless ``schedule`` is given, the schedule (``work.state``, a
            :class:`TritonSchedule` made by :meth:`mla_backend.ops.triton.Kernels.plan_state`).
        softmax_scale: applied to ``q·k`` (a Python float).
        kv_scale: float32 scalar: cached values are ``stored * kv_scale`` (fp8 caches).
        block_n: kv rows per inner-loop step (power of two >= 16; default
            :func:`heuristics.kv_block`).
        block_h: heads per program (a power of two with ``block_q * block_h`` >= 16; default
            :func:`heuristics.attention_tiles` of the plan's ``block_q``).
        fp8_mode: ``"native"`` (Triton's e4m3 conversion) or ``"bits"`` (integer decode of
            the bytes); default: :func:`~.fp8_decode.fp8_mode` of the device.
        chunk: latent columns per chunk (a power of two >= 16; see
            :func:`heuristics.latent_chunks`).
        num_warps / num_stages: launch options (default :func:`heuristics.num_warps` /
            Triton's).
        fp8_f16: fp8 / ``fp8_ds_mla`` caches: the latent dots in fp16 (e4m3 -> fp16 is exact
            and one conversion per two values; the queries must lie in fp16's range).
        gluon: run the Gluon kernel (:mod:`..jit.gluon_attention`, Hopper) on a call it
            serves (:func:`.gluon.gluon_serves`); the Triton kernel otherwise.
    Returns:
        o_lat: [T, H, r] in q_lat's dtype; lse: [T, H] float32 (natural log).
    """
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    if q_lat.dtype not in TL_DTYPE:
        raise ValueError(f"q_lat dtype {q_lat.dtype} is not supported")
    check_cache(kv_cache, r, rope, q_lat.dtype)
    if q_pe.shape[:2] != (T, H):
        raise ValueError(
            f"q_pe shape {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)}"
        )
    if T != part.num_tokens:
        raise ValueError(f"q_lat has {T} tokens but the plan part has {part.num_tokens}")
    block_q = part.work.block_q
    if block_h is None:
        block_h = hx.attention_tiles(H, block_q)[1]
    if block_h & (block_h - 1) or block_q * block_h < hx.MIN_DOT_DIM:
        raise ValueError(
            f"block_h={block_h} must be a power of two with block_q * block_h >= "
            f"{hx.MIN_DOT_DIM} (block_q={block_q})"
        )
    if block_n is None:
        block_n = hx.kv_block(hx.dim_block(r), block_q * block_h)
    if block_n < hx.MIN_DOT_DIM or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= {hx.MIN_DOT_DIM}")
    hx.check_launch_knobs(chunk, num_warps, num_stages)
    if kv_cache.dtype == torch.uint8:
        hx.latent_chunks(hx.dim_block(r), chunk, FP8_TILE)  # raises for an unsupported r
    device = q_lat.device
    if T and H:
        check_runnable(device, absorbed_attn_kernel)
    fp8_bits = (
        kv_cache.dtype in (_fp8.FP8_DTYPE, torch.uint8)
        and resolve_fp8_mode(fp8_mode, device) == "bits"
    )
    work = part.work
    schedule = schedule if schedule is not None else work.state
    if not isinstance(schedule, TritonSchedule):
        raise ValueError(
            "the plan part has no Triton schedule (work.state is "
            f"{type(work.state).__name__}): plan the step with mla_backend.ops.triton.Kernels"
        )
    return torch.ops.mla_backend.triton_absorbed_attention(
        last_dim_contiguous(q_lat),
        last_dim_contiguous(q_pe.to(q_lat.dtype)),
        kv_cache,
        part.block_table,
        part.prefix_lens_t,
        part.new_lens_t,
        part.cu_new_t,
        work.q_block_req,
        work.q_block_start,
        schedule.part_meta,
        schedule.split_base,
        kv_scale.float().reshape(()) if kv_scale is not None else None,
        float(softmax_scale),
        work.block_q,
        block_h,
        block_n,
        fp8_bits,
        chunk,
        num_warps or 0,
        num_stages or 0,
        fp8_f16,
        gluon and gluon_module.gluon_serves(q_lat, q_pe, kv_cache, block_q, block_h),
    )


if not hasattr(torch.ops.mla_backend, "triton_absorbed_attention"):
    # once per process: a reload of this module keeps the first registration (the op looks its
    # kernels up in this module's globals, which a reload updates in place)
    triton_op("mla_backend::triton_absorbed_attention", mutates_args=())(absorbed_attention_op)
