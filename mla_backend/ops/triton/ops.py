"""Triton implementation of the paged-latent-cache kernels (the GPU path: CUDA and ROCm).

:class:`mla_backend.ops.triton.Kernels` (in :mod:`.kernels`) is the
:class:`mla_backend.ops.KernelImpl` over them (the device seam picks it for CUDA tensors). The
two kernels are ``torch.library`` custom ops built with ``torch.library.triton_op`` (each
launch goes through ``torch.library.wrap_triton``), so ``torch.compile`` and ``FakeTensorMode``
trace them like built-in operators:

- ``mla_backend::triton_write_latent`` (:func:`write_latent`): one program per new token
  scatters ``[c_kv ; k_pe]`` into its slot (mutates the cache).
- ``mla_backend::triton_absorbed_attention`` (:func:`absorbed_attention`): grouped-head paged
  attention over the latent cache (decode and extend onto a prefix, ragged batches) in
  FlashMLA's shape: up to 64 query rows per program, the kv work cut into equal pieces by the
  plan's schedule (:mod:`.schedule`), split blocks' partials merged by LSE in a second kernel.

The Python wrappers check shapes and dtypes and turn the plan part into the ops' tensor
arguments; nothing in a call reads tensor data on the host (no ``.item()``, no ``.tolist()``),
so a call can run under ``FakeTensorMode`` and be captured in a CUDA graph.

Precision (issue 12): the scores are fp32 from the dot products (``tl.dot`` accumulates in
fp32) through the online softmax; the probabilities are rounded to the query's dtype before
``P @ V``, which accumulates in fp32; split partials and the LSE merge are fp32; the output is
rounded once.

The kernels also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how this project
tests them without a GPU. The interpreter cannot ``tl.dot`` bfloat16 operands (it multiplies
their raw bit patterns, triton-lang/triton#11584), so when interpreting, bf16 dot operands are
widened to fp32 first; the products are identical (bf16 -> fp32 is exact) and the
probabilities are still rounded to bf16 before ``P @ V`` as on a GPU. Its fp32 -> bf16 cast
truncates where GPUs round to nearest even, so when interpreting the kernels round
probabilities and bf16 outputs to the bf16 grid first (``ROUND_BF16``; compiled GPU kernels
do not need it and do not run it). Under the interpreter a
``FakeTensorMode`` call allocates the outputs and launches nothing (the interpreter runs
kernels on real data; on a GPU ``wrap_triton`` records the launch instead), and
``torch.compile`` of the ops needs a GPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import triton_op, wrap_triton

from ... import fp8 as _fp8
from ...cache_layout import FP8_TILE, CacheLayout
from .jit import heuristics as hx
from .jit.attention import absorbed_attn_kernel, merge_splits_kernel
from .jit.cache_write import write_latent_ds_kernel, write_latent_kernel
from .schedule import TritonSchedule, max_partial_slots

if TYPE_CHECKING:
    from ...parts import PlanPart

_TL_DTYPE = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, _fp8.FP8_DTYPE, torch.uint8)
_FLT_MIN = float(torch.finfo(torch.float32).tiny)


def _row_width(kv_cache: torch.Tensor, r: int, rope: int, compute_dtype: torch.dtype) -> int:
    """The cache's expected last dimension: ``r + rope`` elements, or the ``fp8_ds_mla``
    row's bytes for a uint8 cache (rope part in ``compute_dtype``)."""
    return CacheLayout.of(kv_cache, r, rope, compute_dtype).width
_LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch (see :func:`record_launches`): the kernel, its grid, its
    positional arguments and its keyword arguments (constexprs and launch options)."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple[object, ...]
    kwargs: dict[str, object]


#: the launches recorded instead of run, while :func:`record_launches` is active
_RECORDING: list[list[Launch]] = []
#: the compute capability each active :func:`record_launches` records for (None: any)
_RECORDING_ARCH: list[int | None] = []


@contextlib.contextmanager
def record_launches(arch: int | None = None) -> Iterator[list[Launch]]:
    """Within this block the ops record their kernel launches (with the constexprs a GPU
    compile gets, also under the interpreter) instead of running them, on any device's
    tensors: what the ahead-of-time resource check (``python -m benchmarks gpu-resources``)
    compiles is exactly what a call launches. ``arch``: the compute capability (90: sm_90,
    100: sm_100) the calls are recorded for, which decides the kernels that serve them (the
    Gluon kernel serves Hopper only); None: any."""
    launches: list[Launch] = []
    _RECORDING.append(launches)
    _RECORDING_ARCH.append(arch)
    try:
        yield launches
    finally:
        _RECORDING.pop()
        _RECORDING_ARCH.pop()


def target_arch(device: torch.device) -> int | None:
    """The compute capability a call on ``device`` launches for (major * 10 + minor): the
    recorded one while :func:`record_launches` is active, the CUDA device's otherwise; None
    when unknown (recording for any arch, a CPU device, ROCm)."""
    if _RECORDING:
        return _RECORDING_ARCH[-1]
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _launch(kernel: object, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    if _RECORDING:
        _RECORDING[-1].append(Launch(kernel, grid, args, kwargs))
        return
    if type(kernel).__name__.startswith("Gluon"):
        # launched directly: torch's wrap_triton analyses Triton (not Gluon) kernels' IR, so
        # the Gluon path runs eagerly (and is not traced by torch.compile)
        kernel[grid](*args, **kwargs)
        return
    wrap_triton(kernel)[grid](*args, **kwargs)


def _interpreting() -> bool:
    """Run on the Triton interpreter (and not recording launches for a GPU compile)."""
    return hx.interpreting() and not _RECORDING


def _check_runnable(device: torch.device, kernel: object) -> None:
    """Triton kernels run on GPU tensors, or on CPU tensors only under the interpreter."""
    if device.type == "cuda" or _RECORDING:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"the Triton kernels got {device.type} tensors but were compiled for a GPU: set "
            "TRITON_INTERPRET=1 before mla_backend.ops.triton.ops is imported to run them on "
            "CPU (slow; for tests), or use the torch path (MLA_BACKEND_IMPL=torch)"
        )


def _skip_launch(x: torch.Tensor) -> bool:
    """True when ``x`` is a FakeTensor and the kernels are interpreted: the op's fake
    implementation (this same code under ``FakeTensorMode``) then only allocates outputs.
    On a GPU the launch goes through ``wrap_triton``, which records it instead of running it.
    Tracing for ``torch.compile`` (functional tensors) cannot use the interpreter."""
    if not hx.interpreting():
        return False
    if isinstance(x, FakeTensor):
        return True
    if torch._subclasses.fake_tensor.is_fake(x):
        raise RuntimeError(
            "torch.compile of the Triton MLA ops needs a GPU: the Triton interpreter "
            "(TRITON_INTERPRET=1) runs kernels on real data and cannot be traced"
        )
    return False


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


# ----------------------------------------------------------------------------------------
# Cache write
# ----------------------------------------------------------------------------------------


def _write_latent_op(
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
    if _skip_launch(kv_cache):
        return
    _check_runnable(kv_cache.device, write_latent_kernel)
    if kv_cache.dtype == torch.uint8:  # fp8_ds_mla (kv_scale is not used: per-tile scales)
        layout = CacheLayout.ds_mla(r, rope, c_kv.dtype)
        _launch(
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
            ROPE_DTYPE=_TL_DTYPE[layout.rope_dtype],
            FP8_MAX=_fp8.FP8_MAX,
            FLT_MIN=_FLT_MIN,
        )
        return
    is_fp8 = kv_cache.dtype == _fp8.FP8_DTYPE
    has_scale = is_fp8 and kv_scale is not None
    scale = kv_scale if has_scale else c_kv
    _launch(
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
        fp8_mode: ``"native"`` or ``"bits"`` e4m3 conversion; default :func:`fp8_mode`.
    """
    T, r = c_kv.shape
    rope = k_pe.shape[-1]
    if T == 0:
        return
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported")
    if kv_cache.dtype == torch.uint8 and c_kv.dtype not in _TL_DTYPE:
        raise ValueError(f"c_kv dtype {c_kv.dtype} is not supported for an fp8_ds_mla cache")
    width = _row_width(kv_cache, r, rope, c_kv.dtype)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not hold rows of r + rope = {r} + {rope}"
            f" ({width} elements of {kv_cache.dtype})"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    _check_runnable(kv_cache.device, write_latent_kernel)
    is_fp8 = kv_cache.dtype == _fp8.FP8_DTYPE
    fp8_bits = is_fp8 and _resolve_fp8_mode(fp8_mode, kv_cache.device) == "bits"
    scale = kv_scale.float().reshape(()) if is_fp8 and kv_scale is not None else None
    torch.ops.mla_backend.triton_write_latent(
        kv_cache,
        _last_dim_contiguous(c_kv),
        _last_dim_contiguous(k_pe),
        slot_mapping[:T].contiguous(),
        scale,
        fp8_bits,
    )


def fp8_mode(device: torch.device) -> str:
    """How the kernels convert fp8 e4m3 cache values on ``device``: ``"native"`` or ``"bits"``.

    Triton converts float8e4nv natively on NVIDIA sm_89+ (Ada, Hopper, Blackwell) and in the
    interpreter; on older NVIDIA GPUs and on ROCm the bytes are decoded with integer ops.
    """
    if device.type != "cuda":
        return "native"
    if torch.version.hip is not None:
        return "bits"
    return "native" if torch.cuda.get_device_capability(device) >= (8, 9) else "bits"


def _resolve_fp8_mode(mode: str | None, device: torch.device) -> str:
    mode = mode or fp8_mode(device)
    if mode not in ("native", "bits"):
        raise ValueError(f"fp8_mode={mode!r} is not supported; use 'native' or 'bits'")
    return mode


# ----------------------------------------------------------------------------------------
# Absorbed attention
# ----------------------------------------------------------------------------------------


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
    dot_dtype = torch.float32 if round_bf16 else q_dtype  # see the module doc
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
        DOT_DTYPE=_TL_DTYPE[dot_dtype],
        P_DTYPE=_TL_DTYPE[q_dtype],
        IEEE=dot_dtype == torch.float32,
        ROUND_BF16=round_bf16,
        DS=cache == "ds",
        TILE=FP8_TILE,
        ROPE_DTYPE=_TL_DTYPE[q_dtype],
        NUM_CHUNKS=hx.latent_chunks(block_r, chunk, FP8_TILE if cache == "ds" else None),
        LAT_DTYPE=_TL_DTYPE[lat_dtype],
        LAT_P_DTYPE=_TL_DTYPE[torch.float16 if f16 else q_dtype],
        LAT_IEEE=lat_dtype == torch.float32,
        num_warps=num_warps or hx.num_warps(block_q * block_h, block_r),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )


def _launch_gluon_attention(
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
    o_lat: torch.Tensor,
    lse: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    softmax_scale: float,
    block_q: int,
    block_h: int,
    grid: tuple[int, int],
) -> None:
    """The Gluon kernel (:mod:`.jit.gluon_attention`) on a call it serves: TMA descriptors
    over the queries as [T * H, r] / [T * H, rope] and the cache as [pages * 64, r + rope]."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .jit import gluon_attention as ga

    T, H, r = q_lat.shape
    dt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q_lat.dtype]

    def desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for(block, dt)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    q2 = q_lat.contiguous().view(T * H, r)
    p2 = q_pe.contiguous().view(T * H, q_pe.shape[-1])
    kv2 = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2])
    _launch(
        ga.absorbed_attn_gluon_kernel,
        grid,
        desc(q2, [ga.BLOCK_M.value, 256]),
        desc(p2, [ga.BLOCK_M.value, ga.ROPE.value]),
        desc(kv2, [ga.BLOCK_N.value, 256]),
        desc(kv2, [ga.BLOCK_N.value, ga.ROPE.value]),
        block_table,
        prefix_lens,
        new_lens,
        cu_new,
        q_block_req,
        q_block_start,
        part_meta,
        split_base,
        o_lat,
        lse,
        part_o,
        part_lse,
        H,
        kv_cache.shape[1],
        softmax_scale * _LOG2E,
        block_table.stride(0),
        o_lat.stride(0),
        o_lat.stride(1),
        lse.stride(0),
        lse.stride(1),
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        num_warps=ga.NUM_WARPS,
    )


def _absorbed_attention_op(
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
    num_h_blocks = triton.cdiv(H, block_h)
    max_splits = max_partial_slots(num_pieces)  # bounded by the pieces, not by the batch
    part_o = torch.empty(max_splits, block_q, H, r, dtype=torch.float32, device=device)
    part_lse = torch.empty(max_splits, block_q, H, dtype=torch.float32, device=device)
    if _skip_launch(q_lat):
        return o_lat, lse
    _check_runnable(device, absorbed_attn_kernel)
    round_bf16 = _interpreting() and cd == torch.bfloat16
    part_o_arg = part_o if max_splits else lse  # never written when nothing is split
    part_lse_arg = part_lse if max_splits else lse
    if gluon:
        _launch_gluon_attention(
            q_lat, q_pe, kv_cache, block_table, prefix_lens, new_lens, cu_new, q_block_req,
            q_block_start, part_meta, split_base, o_lat, lse, part_o_arg, part_lse_arg,
            softmax_scale, block_q, block_h, (num_h_blocks, num_pieces),
        )
    else:
        ds = kv_cache.dtype == torch.uint8  # fp8_ds_mla rows
        has_scale = kv_scale is not None and not ds
        scale = kv_scale if has_scale else lse
        if ds:
            layout = CacheLayout.ds_mla(r, rope, cd)
            scale_offset, rope_offset = layout.scale_offset, layout.rope_offset
            kv_arg = kv_cache if fp8_bits else kv_cache.view(_fp8.FP8_DTYPE)
        else:
            scale_offset = rope_offset = 0
            kv_arg = kv_cache.view(torch.uint8) if fp8_bits else kv_cache
        meta = attention_meta(
            r, rope, cd, "ds" if ds else ("fp8" if has_scale else "plain"), block_q, block_h,
            block_n, fp8_bits, _interpreting(), chunk, num_warps or None, num_stages or None,
            fp8_f16,
        )
        q_pe_arg = q_pe if rope else q_lat
        _launch(
            absorbed_attn_kernel,
            (num_h_blocks, num_pieces),
            q_lat,
            q_pe_arg,
            kv_arg,
            block_table,
            prefix_lens,
            new_lens,
            cu_new,
            q_block_req,
            q_block_start,
            part_meta,
            split_base,
            scale,
            o_lat,
            lse,
            part_o_arg,
            part_lse_arg,
            H,
            r,
            rope,
            kv_cache.shape[1],
            scale_offset,
            rope_offset,
            softmax_scale * _LOG2E,
            q_lat.stride(0),
            q_lat.stride(1),
            q_pe_arg.stride(0),
            q_pe_arg.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            block_table.stride(0),
            o_lat.stride(0),
            o_lat.stride(1),
            lse.stride(0),
            lse.stride(1),
            **meta,
        )
    if max_splits:
        merge_block_h = min(hx.next_pow2(H), 16)
        _launch(
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
            o_lat.stride(0),
            o_lat.stride(1),
            lse.stride(0),
            lse.stride(1),
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
            the bytes); default: :func:`fp8_mode` of the device.
        chunk: latent columns per chunk (a power of two >= 16; see
            :func:`heuristics.latent_chunks`).
        num_warps / num_stages: launch options (default :func:`heuristics.num_warps` /
            Triton's).
        fp8_f16: fp8 / ``fp8_ds_mla`` caches: the latent dots in fp16 (e4m3 -> fp16 is exact
            and one conversion per two values; the queries must lie in fp16's range).
        gluon: run the Gluon kernel (:mod:`.jit.gluon_attention`, Hopper) on a CUDA call it
            serves (``gluon_attention.serves``); the Triton kernel otherwise.
    Returns:
        o_lat: [T, H, r] in q_lat's dtype; lse: [T, H] float32 (natural log).
    """
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    if q_lat.dtype not in _TL_DTYPE:
        raise ValueError(f"q_lat dtype {q_lat.dtype} is not supported")
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported")
    width = _row_width(kv_cache, r, rope, q_lat.dtype)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(
            f"kv_cache row width {kv_cache.shape[-1]} != {width} (kv_lora_rank {r}, rope "
            f"{rope}, {kv_cache.dtype} cache)"
        )
    if q_pe.shape[:2] != (T, H):
        raise ValueError(
            f"q_pe shape {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)}"
        )
    if T != part.num_tokens:
        raise ValueError(f"q_lat has {T} tokens but the plan part has {part.num_tokens}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
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
        _check_runnable(device, absorbed_attn_kernel)
    fp8_bits = (
        kv_cache.dtype in (_fp8.FP8_DTYPE, torch.uint8)
        and _resolve_fp8_mode(fp8_mode, device) == "bits"
    )
    work = part.work
    schedule = schedule if schedule is not None else work.state
    if not isinstance(schedule, TritonSchedule):
        raise ValueError(
            "the plan part has no Triton schedule (work.state is "
            f"{type(work.state).__name__}): plan the step with mla_backend.ops.triton.Kernels"
        )
    part_meta, split_base = schedule.part_meta, schedule.split_base
    return torch.ops.mla_backend.triton_absorbed_attention(
        _last_dim_contiguous(q_lat),
        _last_dim_contiguous(q_pe.to(q_lat.dtype)),
        kv_cache,
        part.block_table,
        part.prefix_lens_t,
        part.new_lens_t,
        part.cu_new_t,
        work.q_block_req,
        work.q_block_start,
        part_meta,
        split_base,
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
        gluon and _gluon_serves(q_lat, q_pe, kv_cache, block_q, block_h),
    )


def _gluon_serves(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  block_q: int, block_h: int) -> bool:
    """The Gluon kernel serves CUDA tensors (or recorded launches) of its shapes on a GPU of
    its archs (:data:`gluon_attention.ARCHS`), on a cache whose pages are one
    [pages * page_size, width] matrix (its TMA descriptor)."""
    if (q_lat.device.type != "cuda" and not _RECORDING) or not kv_cache.is_contiguous():
        return False
    try:
        from .jit import gluon_attention as ga
    except ImportError:  # a Triton without Gluon (before 3.5): the Triton kernel serves
        return False
    arch = target_arch(q_lat.device)
    if arch not in ga.ARCHS and not (arch is None and _RECORDING):  # ROCm: never
        return False

    return ga.serves(q_lat.shape[1], q_lat.shape[2], q_pe.shape[-1], kv_cache.shape[1],
                     q_lat.dtype, kv_cache.dtype, block_q, block_h)


def _register_ops() -> None:
    """Register the custom ops once per process (``importlib.reload`` of this module keeps
    the first registration: the ops look their kernels up in this module's globals, which a
    reload updates in place)."""
    ns = torch.ops.mla_backend
    if not hasattr(ns, "triton_write_latent"):
        triton_op("mla_backend::triton_write_latent", mutates_args={"kv_cache"})(
            _write_latent_op
        )
    if not hasattr(ns, "triton_absorbed_attention"):
        triton_op("mla_backend::triton_absorbed_attention", mutates_args=())(
            _absorbed_attention_op
        )


_register_ops()
