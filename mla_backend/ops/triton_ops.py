"""Triton implementation of the paged-latent-cache kernels (the GPU path: CUDA and ROCm).

Same functions and signatures as :mod:`mla_backend.ops.torch_ops` (the device seam in
:mod:`mla_backend.ops` picks one module per device), plus keyword-only tuning knobs that
tests use to force a split count or tile size:

- :func:`write_latent`: one program per new token scatters ``[c_kv ; k_pe]`` into its slot.
- :func:`absorbed_attention`: grouped-head paged attention over the latent cache (decode and
  extend onto a prefix, ragged batches), split-KV partials merged by LSE in a second kernel.

The fp8 absorption bmm is :func:`mla_backend.fp8.fp8_bmm` on every device (``torch._scaled_mm``
where the device supports it).

The kernels also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how this project
verifies them (no GPU here). The interpreter cannot ``tl.dot`` bfloat16 operands (it multiplies
their raw bit patterns, triton-lang/triton#11584), so when interpreting, bf16 dot operands are
widened to fp32 first; the products are identical (bf16 -> fp32 is exact) and the
probabilities are still rounded to bf16 before ``P @ V`` as on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .. import fp8 as _fp8
from ..ops.torch_ops import Kernels as TorchKernels
from .triton_kernels import heuristics as hx
from .triton_kernels.attention import absorbed_attn_kernel, merge_splits_kernel
from .triton_kernels.cache_write import write_latent_kernel

if TYPE_CHECKING:
    from ..dims import MLADims
    from ..plan import PlanPart

_TL_DTYPE = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, _fp8.FP8_DTYPE)
_LOG2E = 1.0 / math.log(2.0)


def _check_runnable(device: torch.device, kernel: object) -> None:
    """Triton kernels run on GPU tensors, or on CPU tensors only under the interpreter."""
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"the Triton kernels got {device.type} tensors but were compiled for a GPU: set "
            "TRITON_INTERPRET=1 before mla_backend.ops.triton_ops is imported to run them on "
            "CPU (slow; for tests), or use the torch path (MLA_BACKEND_IMPL=torch)"
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    fp8_mode: str | None = None,
) -> None:
    """Write new tokens' latents into the paged cache (in place).

    Args:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn.
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
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != r + rope:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not hold rows of r + rope = {r} + {rope}"
        )
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    _check_runnable(kv_cache.device, write_latent_kernel)
    c_kv = _last_dim_contiguous(c_kv)
    k_pe = _last_dim_contiguous(k_pe)
    slots = slot_mapping[:T]
    if not slots.is_contiguous():
        slots = slots.contiguous()
    is_fp8 = kv_cache.dtype == _fp8.FP8_DTYPE
    has_scale = is_fp8 and kv_scale is not None
    scale = kv_scale.float().reshape(()) if has_scale else c_kv
    fp8_bits = is_fp8 and _resolve_fp8_mode(fp8_mode, kv_cache.device) == "bits"
    write_latent_kernel[(T,)](
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


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    part: PlanPart,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    fp8_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the paged latent cache (decode and extend), in Triton.

    Args:
        q_lat: [T, H, r] absorbed query (``q_nope · W_UK``), bf16/fp16/fp32.
        q_pe: [T, H, rope] rotated rope query (rope may be 0).
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn; holds every
            request's ``prefix_lens[i] + new_lens[i]`` tokens.
        part: the plan's requests (T == part.num_tokens); its work partition gives the query
            blocks and the split count.
        softmax_scale: applied to ``q·k``.
        kv_scale: float32 scalar: cached values are ``stored * kv_scale`` (fp8 caches).
        block_n: force the kv tile (power of two >= 16; default :func:`heuristics.kv_block`).
        fp8_mode: ``"native"`` (Triton's e4m3 conversion) or ``"bits"`` (integer decode of
            the bytes); default: :func:`fp8_mode` of the device.
    Returns:
        o_lat: [T, H, r] in q_lat's dtype; lse: [T, H] float32 (natural log).
    """
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != r + rope:
        raise ValueError(
            f"kv_cache row width {kv_cache.shape[-1]} != kv_lora_rank + rope = {r} + {rope}"
        )
    if q_pe.shape[:2] != (T, H):
        raise ValueError(
            f"q_pe shape {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)}"
        )
    if T != part.num_tokens:
        raise ValueError(f"q_lat has {T} tokens but the plan part has {part.num_tokens}")
    if q_lat.dtype not in _TL_DTYPE:
        raise ValueError(f"q_lat dtype {q_lat.dtype} is not supported")
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    device = q_lat.device
    cd = q_lat.dtype
    o_lat = torch.empty(T, H, r, dtype=cd, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    if T == 0 or H == 0:
        return o_lat, lse
    _check_runnable(device, absorbed_attn_kernel)
    q_lat = _last_dim_contiguous(q_lat)
    q_pe = _last_dim_contiguous(q_pe.to(cd)) if rope else q_lat

    work = part.work
    block_q = work.block_q
    block_h = hx.attention_tiles(H, block_q)[1]
    block_r = hx.dim_block(r)
    block_rope = hx.dim_block(rope)
    if block_n is None:
        block_n = hx.kv_block(block_r)
    if block_n < hx.MIN_DOT_DIM or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= {hx.MIN_DOT_DIM}")
    num_q_blocks = work.q_block_req.shape[0]
    num_h_blocks = triton.cdiv(H, block_h)
    num_kv_splits = work.num_kv_splits
    block_table = part.block_table

    if num_kv_splits == 1:
        out, out_lse = o_lat, lse
        so = (o_lat.stride(0), o_lat.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1), 0)
    else:
        out = torch.empty(T, H, num_kv_splits, r, dtype=torch.float32, device=device)
        out_lse = torch.empty(T, H, num_kv_splits, dtype=torch.float32, device=device)
        so = (out.stride(0), out.stride(1), out.stride(2))
        sl = (out_lse.stride(0), out_lse.stride(1), out_lse.stride(2))

    dot_dtype = cd
    if hx.interpreting() and cd == torch.bfloat16:
        dot_dtype = torch.float32  # interpreter tl.dot cannot take bf16 (see module doc)
    has_scale = kv_scale is not None
    scale = kv_scale.float().reshape(()) if has_scale else lse
    fp8_bits = kv_cache.dtype == _fp8.FP8_DTYPE and _resolve_fp8_mode(fp8_mode, device) == "bits"
    kv_arg = kv_cache.view(torch.uint8) if fp8_bits else kv_cache

    grid = (num_q_blocks * num_h_blocks, num_kv_splits)
    absorbed_attn_kernel[grid](
        q_lat,
        q_pe,
        kv_arg,
        block_table,
        part.prefix_lens_t,
        part.new_lens_t,
        part.cu_new_t,
        work.q_block_req,
        work.q_block_start,
        scale,
        out,
        out_lse,
        H,
        r,
        rope,
        kv_cache.shape[1],
        num_kv_splits,
        float(softmax_scale) * _LOG2E,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        *so,
        *sl,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_ROPE=block_rope,
        HAS_ROPE=rope > 0,
        HAS_SCALE=has_scale,
        FP8_BITS=fp8_bits,
        DOT_DTYPE=_TL_DTYPE[dot_dtype],
        P_DTYPE=_TL_DTYPE[cd],
        IEEE=dot_dtype == torch.float32,
        num_warps=4,
    )
    if num_kv_splits > 1:
        merge_block_h = min(hx.next_pow2(H), 16)
        merge_splits_kernel[(T, triton.cdiv(H, merge_block_h))](
            out,
            out_lse,
            o_lat,
            lse,
            H,
            r,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            out_lse.stride(0),
            out_lse.stride(1),
            out_lse.stride(2),
            o_lat.stride(0),
            o_lat.stride(1),
            lse.stride(0),
            lse.stride(1),
            BLOCK_H=merge_block_h,
            BLOCK_R=block_r,
            num_warps=4,
        )
    return o_lat, lse


class Kernels(TorchKernels):
    """The Triton implementation of :class:`mla_backend.ops.KernelImpl`: cache write and
    absorbed attention in Triton; the normal path's cache reads and MHA from the torch
    implementation (torch's fused SDPA).

    Tuning knobs (keyword arguments; tests use them to force paths):
        num_kv_splits: force the split count (default :func:`heuristics.choose_num_splits`).
        block_n: force the kv tile (power of two >= 16; default :func:`heuristics.kv_block`).
        fp8_mode: ``"native"`` or ``"bits"`` e4m3 conversion (default :func:`fp8_mode`).
    """

    name = "triton"

    def __init__(
        self,
        *,
        num_kv_splits: int | None = None,
        block_n: int | None = None,
        fp8_mode: str | None = None,
    ) -> None:
        super().__init__()
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
        self.num_kv_splits = num_kv_splits
        self.block_n = block_n
        self.fp8_mode = fp8_mode

    def __repr__(self) -> str:
        return (
            f"triton_ops.Kernels(num_kv_splits={self.num_kv_splits}, block_n={self.block_n}, "
            f"fp8_mode={self.fp8_mode})"
        )

    def work_shape(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        device: torch.device,
    ) -> tuple[int, int]:
        block_q, block_h = hx.attention_tiles(dims.num_heads, max(new_lens, default=1))
        if self.num_kv_splits is not None:
            return block_q, self.num_kv_splits
        q_blocks = sum(-(-n // block_q) for n in new_lens)
        programs = q_blocks * triton.cdiv(dims.num_heads, block_h)
        return block_q, hx.choose_num_splits(
            programs, max(kv_lens, default=0), hx.sm_count(device)
        )

    def write_latent(self, kv_cache, c_kv, k_pe, slot_mapping, kv_scale) -> None:
        write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale, fp8_mode=self.fp8_mode)

    def absorbed_attention(self, q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale):
        return absorbed_attention(
            q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale,
            block_n=self.block_n, fp8_mode=self.fp8_mode,
        )
