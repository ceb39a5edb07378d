"""Triton kernel: scatter new ``[c_kv ; k_pe]`` latent rows into the paged latent cache.

One program per new token. The token's slot ``s`` maps to page ``s // page_size`` and row
``s % page_size``; ``s < 0`` (padding) writes nothing. With a scale the stored value is
``value / scale`` (fp8 e4m3 caches; saturated to +-448 before the cast). Values already in
the cache dtype are copied bit-exactly; fp8 values are rounded to nearest even in fp32 (see
``_round_to_e4m3_grid``); fp32 -> bf16/fp16 uses the device's round-to-nearest-even (the Triton
interpreter truncates instead, so tests allow one ulp for that conversion). Where Triton has
no native e4m3 conversion the bytes are encoded with integer ops (``_e4m3_grid_to_bits``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3_grid(x):
    """Round fp32 ``x`` (already within +-448) to the nearest float8 e4m3 value, ties to even.

    Done in fp32 so the final cast is exact on every backend: the Triton interpreter's own
    fp32 -> fp8 rounding drops the mantissa carry (e.g. 1.97 becomes 1.0), and this keeps the
    GPU and the interpreter bit-identical to torch's ``.to(float8_e4m3fn)``.
    """
    a = tl.abs(x)
    exp = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # -6: subnormals
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 3): 3 mantissa bits
    y = a / ulp  # exact (power of two), in [0, 16]
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to integer, ties to even
    y = y * ulp
    return tl.where(x < 0, -y, y)  # keeps -0.0 like torch


@triton.jit
def _e4m3_grid_to_bits(y):
    """fp32 values already on the e4m3 grid (within +-448) -> float8 e4m3fn bytes (uint8).

    Integer ops only, for GPUs without a native e4m3 conversion in Triton (NVIDIA before
    sm_89, ROCm). Normal (|y| >= 2^-6): exponent + 7 and the top 3 mantissa bits; subnormal:
    the integer |y| * 2^9.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    normal = ((((a_bits >> 23) & 0xFF) - 120) << 3) | ((a_bits >> 20) & 0x7)
    sub = (a_bits.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    code = tl.where(a_bits >= 0x3C800000, normal, sub)  # 0x3C800000 = 2^-6
    return (sign | code).to(tl.uint8)


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
    SATURATE: tl.constexpr,  # fp8 cache: clamp to +-FP8_MAX and round to the e4m3 grid
    FP8_BITS: tl.constexpr,  # kv_ptr is the fp8 cache viewed as uint8: encode in-kernel
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    row = kv_ptr + (slot // page_size) * stride_kvp + (slot % page_size) * stride_kvs
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)

    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < tl.where(valid, r_dim, 0)  # a padding token masks every column
    c = tl.load(c_kv_ptr + t * stride_ct + offs_r, mask=r_ok, other=0.0)
    if HAS_SCALE:
        c = c.to(tl.float32) / scale
    if SATURATE:
        c = _round_to_e4m3_grid(tl.minimum(tl.maximum(c.to(tl.float32), -FP8_MAX), FP8_MAX))
        if FP8_BITS:
            c = _e4m3_grid_to_bits(c)
    tl.store(row + offs_r, c.to(kv_ptr.dtype.element_ty), mask=r_ok)

    if HAS_ROPE:
        offs_p = tl.arange(0, BLOCK_ROPE)
        p_ok = offs_p < tl.where(valid, rope_dim, 0)
        k = tl.load(k_pe_ptr + t * stride_pt + offs_p, mask=p_ok, other=0.0)
        if HAS_SCALE:
            k = k.to(tl.float32) / scale
        if SATURATE:
            k = _round_to_e4m3_grid(tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX))
            if FP8_BITS:
                k = _e4m3_grid_to_bits(k)
        tl.store(row + r_dim + offs_p, k.to(kv_ptr.dtype.element_ty), mask=p_ok)


@triton.jit
def write_latent_ds_kernel(
    kv_ptr,  # [P, page_size, width] uint8 fp8_ds_mla cache
    c_kv_ptr,  # [T, r]
    k_pe_ptr,  # [T, rope]
    slot_ptr,  # [T] int32/int64
    r_dim,
    rope_dim,
    page_size,
    scale_offset,  # byte offset of the float32 tile scales
    rope_offset,  # byte offset of k_pe (ROPE_DTYPE)
    stride_kvp,
    stride_kvs,
    stride_ct,
    stride_pt,
    NUM_TILES: tl.constexpr,  # power of two >= ceil(r / TILE)
    TILE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_DTYPE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FLT_MIN: tl.constexpr,
):
    """One token's ``fp8_ds_mla`` row, bit for bit as :meth:`CacheLayout.pack` (vLLM's
    ``concat_and_cache_ds_mla``): per tile ``scale = max(amax / 448, FLT_MIN)`` (IEEE
    division), ``e4m3(clamp(x / scale, +-448))`` rounded to nearest even (encoded with integer
    ops on every backend), the scales as float32, k_pe copied in ``ROPE_DTYPE``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    row = kv_ptr + (slot // page_size) * stride_kvp + (slot % page_size) * stride_kvs

    offs_t = tl.arange(0, NUM_TILES)
    offs_c = offs_t[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [NUM_TILES, TILE]
    r_valid = tl.where(valid, r_dim, 0)  # a padding token masks every column
    c_ok = offs_c < r_valid
    x = tl.load(c_kv_ptr + t * stride_ct + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), FLT_MIN)  # [NUM_TILES]
    q = tl.math.div_rn(x, scale[:, None])
    y = _round_to_e4m3_grid(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    sign = ((q.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)  # keeps -0.0 as 0x80
    code = tl.where(c_ok, _e4m3_grid_to_bits(y) | sign, 0)  # alignment bytes [r, s0): 0
    tl.store(row + offs_c, code, mask=offs_c < tl.where(valid, scale_offset, 0))
    tile_ok = offs_t * TILE < r_valid
    tl.store((row + scale_offset).to(tl.pointer_type(tl.float32)) + offs_t, scale, mask=tile_ok)

    if HAS_ROPE:
        offs_p = tl.arange(0, BLOCK_ROPE)
        p_ok = offs_p < tl.where(valid, rope_dim, 0)
        k = tl.load(k_pe_ptr + t * stride_pt + offs_p, mask=p_ok, other=0.0)
        pe_row = (row + rope_offset).to(tl.pointer_type(ROPE_DTYPE))
        tl.store(pe_row + offs_p, k.to(ROPE_DTYPE), mask=p_ok)
