"""Triton kernel: scatter new ``[c_kv ; k_pe]`` latent rows into the paged latent cache.

One program per new token. The token's slot ``s`` maps to page ``s // page_size`` and row
``s % page_size``; ``s < 0`` (padding) writes nothing. With a scale the stored value is
``value / scale`` (fp8 e4m3 caches; saturated to +-448 before the cast).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_latent_kernel(
    kv_ptr,  # [P, page_size, r + rope] cache, any float dtype incl. float8_e4m3fn
    c_kv_ptr,  # [T, r]
    k_pe_ptr,  # [T, rope]
    slot_ptr,  # [T] int32/int64
    scale_ptr,  # [] float32 (read only when HAS_SCALE)
    r_dim,
    rope_dim,
    page_size,
    stride_kvp,
    stride_kvs,
    stride_ct,
    stride_pt,
    BLOCK_R: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SATURATE: tl.constexpr,  # clamp to +-FP8_MAX before the cast (fp8 caches)
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    row = kv_ptr + (slot // page_size) * stride_kvp + (slot % page_size) * stride_kvs
    if HAS_SCALE:
        inv_scale = 1.0 / tl.load(scale_ptr).to(tl.float32)

    offs_r = tl.arange(0, BLOCK_R)
    r_ok = (offs_r < r_dim) & valid
    c = tl.load(c_kv_ptr + t * stride_ct + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        c = c * inv_scale
    if SATURATE:
        c = tl.minimum(tl.maximum(c, -FP8_MAX), FP8_MAX)
    tl.store(row + offs_r, c.to(kv_ptr.dtype.element_ty), mask=r_ok)

    if HAS_ROPE:
        offs_p = tl.arange(0, BLOCK_ROPE)
        p_ok = (offs_p < rope_dim) & valid
        k = tl.load(k_pe_ptr + t * stride_pt + offs_p, mask=p_ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            k = k * inv_scale
        if SATURATE:
            k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
        tl.store(row + r_dim + offs_p, k.to(kv_ptr.dtype.element_ty), mask=p_ok)
