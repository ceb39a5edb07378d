"""Triton kernels of DSA's lightning indexer: the index-key cache write, the logits and the
causal top-k selection per query token.

``write_index_keys_kernel``: one program per new token writes its key ``k_I`` [Di] into its
slot of the index cache. ``fp8`` (vLLM's page layout, :mod:`mla_backend.index_cache`): per block
of ``quant_block`` values ``scale = max(amax, 1e-4) / 448`` (IEEE division; NaN values do not
enter the amax; ``UE8M0``: rounded up to a power of two, ``2^ceil(log2(scale))`` computed on the
exponent bits), ``e4m3(clamp(x / scale, +-448))`` rounded to nearest even and encoded with
integer ops (every backend), the value bytes at ``row * Di`` of the page and the float32 scales
after every token's values; ``plain``: the key converted to the cache dtype. Slots < 0 write
nothing.

``indexer_logits_kernel``: grid (query tokens, splits). Program ``(t, s)`` loads token t's
queries as one [heads, Di] tile (the 64 index heads are the M of ``tl.dot``) and walks key
blocks ``s, s + splits, ...`` of its request's visible positions ``0 .. pos(t)`` through the
block table: scores ``q_I · k_I^T`` [heads, BLOCK_N] (fp8 keys: one dot per scale block, times
that block's per-key scale), ``relu``, times the head weights, summed over heads -> BLOCK_N
logits, fp32 throughout. ``FILL`` writes -inf to the columns ``pos(t) + 1 .. width`` (the public
``indexer_logits``); the top-k reads only visible columns and skips it.

``topk_select_kernel``: one program per query token selects, from the visible logits of its
row, exactly the rule of :mod:`mla_backend.ops.torch.indexer`: each logit's order-preserving 32-bit
key (``-0.0`` as ``+0.0``, NaN below -inf), ties to the lower position. A radix select finds the
k-th largest key ``K`` in ``32 / RADIX_BITS`` histogram passes over the row (no sort); the last
pass takes every key > ``K`` and the first ``k - #(> K)`` keys == ``K`` in position order, and
writes their positions ascending (a running prefix sum). A row seeing <= k positions takes them
all and pads with -1 without reading its logits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import _dot, _e4m3_bits_to_f32, _round_to_bf16_grid
from .cache_write import _e4m3_grid_to_bits, _round_to_e4m3_grid


@triton.jit
def write_index_keys_kernel(
    cache_ptr,  # fp8: uint8 [P, page_size, Di + 4 Di / quant_block]; plain: [P, page_size, Di]
    k_ptr,  # [T, Di] bf16/fp16/fp32
    slot_ptr,  # [T] int32/int64
    head_dim,
    page_size,
    quant_block,  # fp8: values per scale
    num_blocks,  # fp8: scales per key
    stride_cp,  # page stride (elements of the cache dtype)
    stride_kt,
    FP8: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_NB: tl.constexpr,  # fp8: power of two >= num_blocks
    BLOCK_QB: tl.constexpr,  # fp8: power of two >= quant_block; plain: >= Di
    ROUND_BF16: tl.constexpr,  # interpreter, plain bf16 cache from another dtype: RNE first
    AMAX_FLOOR: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    page_base = cache_ptr + (slot // page_size) * stride_cp
    row = slot % page_size
    offs_c = tl.arange(0, BLOCK_QB)
    if FP8:
        offs_b = tl.arange(0, BLOCK_NB)
        nb_valid = tl.where(valid, num_blocks, 0)  # a padding token masks everything
        b_ok = offs_b < nb_valid
        col = offs_b[:, None] * quant_block + offs_c[None, :]  # [BLOCK_NB, BLOCK_QB]
        ok = b_ok[:, None] & (offs_c < quant_block)[None, :]
        x = tl.load(k_ptr + t * stride_kt + col, mask=ok, other=0.0).to(tl.float32)
        a = tl.abs(x)
        amax = tl.max(tl.where(a == a, a, 0.0), axis=1)  # NaN does not enter the amax
        scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)  # [BLOCK_NB]
        if UE8M0:  # 2^ceil(log2(scale)), exactly: the exponent, + 1 unless a power of two
            bits = scale.to(tl.int32, bitcast=True)
            up = ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = ((((bits >> 23) & 0xFF) + up) << 23).to(tl.float32, bitcast=True)
        q = tl.math.div_rn(x, scale[:, None])
        y = _round_to_e4m3_grid(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
        sign = ((q.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)  # -0.0 -> 0x80
        code = _e4m3_grid_to_bits(y) | sign
        code = tl.where(q == q, code, sign | 0x7F)  # NaN -> e4m3 NaN, as torch's cast
        tl.store(page_base + row * head_dim + col, code, mask=ok)
        sc_ptr = (page_base + page_size * head_dim + row * (num_blocks * 4)).to(
            tl.pointer_type(tl.float32)
        )
        tl.store(sc_ptr + offs_b, scale, mask=b_ok)
    else:
        ok = offs_c < tl.where(valid, head_dim, 0)
        x = tl.load(k_ptr + t * stride_kt + offs_c, mask=ok, other=0.0)
        if ROUND_BF16:
            x = _round_to_bf16_grid(x.to(tl.float32))
        tl.store(page_base + row * head_dim + offs_c, x.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def indexer_logits_kernel(
    q_ptr,  # [T, Hi, Di] (e4m3 as uint8 when FP8_BITS)
    w_ptr,  # [T, Hi] float32
    cache_ptr,  # fp8: the cache's bytes as e4m3 (uint8 when FP8_BITS); plain: [P, ps, Di]
    block_table_ptr,  # [B, max_pages] int32
    token_req_ptr,  # [T] int32
    token_pos_ptr,  # [T] int32
    out_ptr,  # [Tc, >= width] float32: rows of tokens t_base ..
    t_base,
    num_heads,
    head_dim,
    page_size,
    quant_block,  # values per scale (fp8); Di (plain)
    num_blocks,  # scales per key (fp8)
    width,  # FILL: columns to write
    num_splits,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_cp,
    stride_bt,
    stride_ot,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_QB: tl.constexpr,  # power of two >= max(quant_block, 16)
    NUM_QB: tl.constexpr,  # scale blocks per key (1 for plain)
    FP8_CACHE: tl.constexpr,
    Q_BITS: tl.constexpr,  # q_I is e4m3 read as bytes: decode with integer ops
    K_BITS: tl.constexpr,  # the fp8 cache is read as bytes: decode with integer ops
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    FILL: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = (t_base + pid_t).to(tl.int64)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    n_vis = tl.load(token_pos_ptr + t) + 1
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    w = tl.load(w_ptr + t * stride_wt + heads, mask=h_ok, other=0.0)
    offs_c = tl.arange(0, BLOCK_QB)
    c_ok = offs_c < quant_block
    q_rows = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh
    q_mask = h_ok[:, None] & c_ok[None, :]
    q0 = tl.load(q_rows + offs_c[None, :], mask=q_mask, other=0.0)
    if Q_BITS:
        q0 = _e4m3_bits_to_f32(q0)
    q0 = q0.to(DOT_DTYPE)
    bt_row = block_table_ptr + req * stride_bt
    out_row = out_ptr + pid_t.to(tl.int64) * stride_ot
    n_blocks = tl.cdiv(n_vis, BLOCK_N)
    for j in range(pid_s, n_blocks, num_splits):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_vis
        page = tl.load(bt_row + offs_n // page_size, mask=n_ok, other=0).to(tl.int64)
        page_base = cache_ptr + page * stride_cp
        slot = (offs_n % page_size).to(tl.int64)
        k_rows = page_base + slot * head_dim
        k_mask = n_ok[:, None] & c_ok[None, :]
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for b in tl.static_range(NUM_QB):
            if b == 0:
                q = q0
            else:
                q = tl.load(q_rows + b * quant_block + offs_c[None, :], mask=q_mask, other=0.0)
                if Q_BITS:
                    q = _e4m3_bits_to_f32(q)
                q = q.to(DOT_DTYPE)
            k = tl.load(k_rows[:, None] + b * quant_block + offs_c[None, :], mask=k_mask, other=0.0)
            if K_BITS:
                k = _e4m3_bits_to_f32(k)
            k = k.to(DOT_DTYPE)
            part = _dot(q, tl.trans(k), IEEE)
            if FP8_CACHE:
                sc_ptr = (page_base + page_size * head_dim + slot * (num_blocks * 4)).to(
                    tl.pointer_type(tl.float32)
                )
                part = part * tl.load(sc_ptr + b, mask=n_ok, other=0.0)[None, :]
            s += part
        lg = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)  # [BLOCK_N]
        tl.store(out_row + offs_n, lg, mask=n_ok)
    if FILL:  # positions the token does not see, up to the row's width
        for j in range(pid_s, tl.cdiv(width, BLOCK_N), num_splits):
            offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            fill = tl.full([BLOCK_N], float("-inf"), tl.float32)
            tl.store(out_row + offs_n, fill, mask=(offs_n >= n_vis) & (offs_n < width))


@triton.jit
def _order_key(x):
    """float32 logits -> uint32 keys in the rank order of :mod:`mla_backend.ops.torch.indexer`:
    larger logit, larger key; ``-0.0`` and ``+0.0`` one key; NaN key 0, below -inf."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits)  # sign flip / all bits flipped
    key = tl.where(x == x, key, 0)
    return key.to(tl.uint32, bitcast=True)


@triton.jit
def topk_select_kernel(
    logits_ptr,  # [Tc, >= n_vis] float32: rows of tokens t_base ..
    token_pos_ptr,  # [T] int32
    out_ptr,  # [T, topk] int32
    t_base,
    topk,
    stride_lt,
    stride_ot,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    NBINS: tl.constexpr = 1 << RADIX_BITS
    pid = tl.program_id(0)
    t = (t_base + pid).to(tl.int64)
    n_vis = tl.load(token_pos_ptr + t) + 1
    row = logits_ptr + pid.to(tl.int64) * stride_lt
    out_row = out_ptr + t * stride_ot
    offs = tl.arange(0, BLOCK)
    if n_vis <= topk:  # every visible position, ascending, then -1
        for p0 in range(0, topk, BLOCK):
            p = p0 + offs
            tl.store(out_row + p, tl.where(p < n_vis, p, -1), mask=p < topk)
    else:
        # radix select of the topk-th largest key: digits from the top, RADIX_BITS at a time
        prefix = tl.zeros([], dtype=tl.uint32)
        k_rem = topk  # keys still to take at or below the prefix found so far
        bins = tl.arange(0, NBINS)
        for shift in tl.static_range(32 - RADIX_BITS, -1, -RADIX_BITS):
            hist = tl.zeros([NBINS], dtype=tl.int32)
            for p0 in range(0, n_vis, BLOCK):
                p = p0 + offs
                ok = p < n_vis
                key = _order_key(tl.load(row + p, mask=ok, other=0.0))
                if shift + RADIX_BITS < 32:  # keys under the prefix of the digits above
                    ok = ok & ((key >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
                digit = ((key >> shift) & (NBINS - 1)).to(tl.int32)
                hist += tl.histogram(digit, NBINS, mask=ok)
            at_least = tl.cumsum(hist, 0, reverse=True)  # keys with this digit or a larger one
            d = tl.sum((at_least >= k_rem).to(tl.int32), 0) - 1  # the k_rem-th largest digit
            k_rem = k_rem - tl.sum(tl.where(bins > d, hist, 0), 0)
            prefix = prefix | (d.to(tl.uint32) << shift)
        # every key > prefix, and the first k_rem keys == prefix in position order
        n_out = 0
        n_eq = 0
        for p0 in range(0, n_vis, BLOCK):
            p = p0 + offs
            ok = p < n_vis
            key = _order_key(tl.load(row + p, mask=ok, other=0.0))
            eq = ok & (key == prefix)
            eq_i = eq.to(tl.int32)
            take = (ok & (key > prefix)) | (eq & (n_eq + tl.cumsum(eq_i, 0) <= k_rem))
            take_i = take.to(tl.int32)
            tl.store(out_row + n_out + tl.cumsum(take_i, 0) - 1, p, mask=take)
            n_out += tl.sum(take_i, 0)
            n_eq += tl.sum(eq_i, 0)
