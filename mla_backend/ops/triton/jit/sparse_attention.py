"""Triton kernels of DSA's sparse absorbed attention: each query token attends to the latent rows
of its own index list, and the LSE merge of split lists.

``sparse_attn_kernel`` (FlashMLA's sparse decode in shape): grid (query tokens, head blocks,
splits). Program ``(t, h, s)`` holds ``BLOCK_H`` heads of token t (the M of ``tl.dot``) and walks
its share of the index list ``BLOCK_N`` (64) indices per step: each index, a logical position
of the token's request, is mapped to its page through the block table and the rows are
gathered; an entry < 0, or past the request's kv length, is masked (never read; the wrapper
refuses out-of-range indices with ``torch._assert_async``). The latent is handled in
``NUM_CHUNKS`` (<= 4) column chunks of ``CHUNK`` (<= 128) values: scores are
``q_pe · k_pe^T + sum_c q_lat[:, c] · c_kv[:, c]^T`` and ``P · V`` has one accumulator per
chunk, so no [64, 512] tile is live at once. Online softmax in base 2, fp32; probabilities
rounded to q's dtype before ``P · V`` (as the dense kernel). A program that sees no valid index
writes o = 0 and LSE -inf.

Cache layouts: bf16 / fp16 / fp32 rows; per-tensor fp8 (values exact in the dot dtype, the
scale applied once to the scores and once to the output); ``fp8_ds_mla`` (``DS``): a chunk is
within one 128-value scale tile, so its e4m3 values go to the dot unscaled (exact) and the
tile's per-row scale multiplies that chunk's [heads, BLOCK_N] partial scores and the
probabilities before its ``P · V``; k_pe is read as ``ROPE_DTYPE`` at its byte offset.

``sparse_merge_kernel``: grid (tokens, head blocks); combines the splits' fp32 partials by
``o = sum_s exp(lse_s - lse) o_s``, ``lse = logsumexp_s lse_s``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import _dot, _e4m3_bits_to_f32, _round_to_bf16_grid, merge_partials


@triton.jit
def _load_chunk(rows, c: tl.constexpr, offs_c, r_dim, ok, CHUNK: tl.constexpr, BITS: tl.constexpr):
    """Columns ``[c * CHUNK, (c + 1) * CHUNK)`` of the gathered rows -> [BLOCK_N, CHUNK] (e4m3
    bytes decoded when ``BITS``; masked rows / columns 0)."""
    cols = c * CHUNK + offs_c
    kv = tl.load(rows[:, None] + cols[None, :], mask=ok[:, None] & (cols < r_dim)[None, :],
                 other=0.0)  # fmt: skip
    if BITS:
        kv = _e4m3_bits_to_f32(kv)
    return kv


@triton.jit
def _chunk_scale(rows, c: tl.constexpr, scale_offset, ok, DS: tl.constexpr):
    """``fp8_ds_mla``: chunk c's per-row float32 tile scale [BLOCK_N] (otherwise unused: the
    row mask as float)."""
    if DS:
        sc_row = (rows + scale_offset).to(tl.pointer_type(tl.float32))
        return tl.load(sc_row + c, mask=ok, other=0.0)
    else:
        return ok.to(tl.float32)


@triton.jit
def _pv(acc, alpha, p, kv, sc, DS: tl.constexpr, P_DTYPE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, ROUND_BF16: tl.constexpr):  # fmt: skip
    """One chunk's ``acc * alpha + P · V`` (``DS``: P times the chunk's per-row scale)."""
    if DS:
        p = p * sc[None, :]
    if ROUND_BF16:
        p = _round_to_bf16_grid(p)
    return acc * alpha[:, None] + _dot(p.to(P_DTYPE).to(DOT_DTYPE), kv.to(DOT_DTYPE), IEEE)


@triton.jit
def _qk(q, kv, sc, DS: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """One chunk's ``q · kv^T`` [heads, BLOCK_N] (``DS``: times the per-row scale)."""
    s = _dot(q, tl.trans(kv.to(DOT_DTYPE)), IEEE)
    if DS:
        s = s * sc[None, :]
    return s


@triton.jit
def _store_chunk(base, acc, l_safe, c: tl.constexpr, offs_c, r_dim, row_ok, CHUNK: tl.constexpr,
                 ROUND: tl.constexpr):  # fmt: skip
    cols = c * CHUNK + offs_c
    o = acc / l_safe[:, None]
    if ROUND:
        o = _round_to_bf16_grid(o)
    tl.store(base + cols[None, :], o.to(base.dtype.element_ty),
             mask=row_ok[:, None] & (cols < r_dim)[None, :])  # fmt: skip


@triton.jit
def _paged_rows(pos, ok, bt_row, page_size, kv_ptr, stride_p, stride_s):
    """Row pointers [BLOCK_N] of logical positions ``pos`` through a request's block table row
    (masked entries: page 0, never read)."""
    pos = tl.where(ok, pos, 0)
    page = tl.load(bt_row + pos // page_size, mask=ok, other=0).to(tl.int64)
    return kv_ptr + page * stride_p + (pos % page_size).to(tl.int64) * stride_s


@triton.jit
def _load_queries(q_lat_ptr, q_pe_ptr, t, heads64, h_ok, offs_c, offs_p, r_dim, rope_dim,
                  stride_qlt, stride_qlh, stride_qpt, stride_qph, BLOCK_H: tl.constexpr,
                  BLOCK_ROPE: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                  HAS_ROPE: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Token t's queries for heads ``heads64``: the latent's chunks q0..q3 [BLOCK_H, CHUNK]
    (chunks past NUM_CHUNKS: q0, unused) and q_pe [BLOCK_H, BLOCK_ROPE] (zeros without rope),
    in the dot dtype."""
    q_base = q_lat_ptr + t * stride_qlt + heads64[:, None] * stride_qlh
    q_mask = h_ok[:, None]
    q0 = tl.load(q_base + offs_c[None, :], mask=q_mask & (offs_c < r_dim)[None, :], other=0.0)
    q0 = q0.to(DOT_DTYPE)
    q1 = q0
    q2 = q0
    q3 = q0
    if NUM_CHUNKS > 1:
        cols = CHUNK + offs_c
        q1 = tl.load(q_base + cols[None, :], mask=q_mask & (cols < r_dim)[None, :], other=0.0)
        q1 = q1.to(DOT_DTYPE)
    if NUM_CHUNKS > 2:
        cols = 2 * CHUNK + offs_c
        q2 = tl.load(q_base + cols[None, :], mask=q_mask & (cols < r_dim)[None, :], other=0.0)
        q2 = q2.to(DOT_DTYPE)
    if NUM_CHUNKS > 3:
        cols = 3 * CHUNK + offs_c
        q3 = tl.load(q_base + cols[None, :], mask=q_mask & (cols < r_dim)[None, :], other=0.0)
        q3 = q3.to(DOT_DTYPE)
    q_pe = tl.zeros([BLOCK_H, BLOCK_ROPE], dtype=DOT_DTYPE)
    if HAS_ROPE:
        q_pe = tl.load(
            q_pe_ptr + t * stride_qpt + heads64[:, None] * stride_qph + offs_p[None, :],
            mask=q_mask & (offs_p < rope_dim)[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
    return q0, q1, q2, q3, q_pe


@triton.jit
def _keys_step(rows, ok, q0, q1, q2, q3, q_pe, m_i, l_i, acc0, acc1, acc2, acc3, offs_c, offs_p,
               r_dim, rope_dim, scale_offset, rope_offset, qk_scale,
               CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_ROPE: tl.constexpr,
               FP8_BITS: tl.constexpr, DOT_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr,
               IEEE: tl.constexpr, ROUND_BF16: tl.constexpr, DS: tl.constexpr,
               ROPE_DTYPE: tl.constexpr):  # fmt: skip
    """One block of rows (``rows`` [BLOCK_N] pointers, ``ok`` their mask) into the online
    softmax state (m_i, l_i, acc0..acc3)."""
    kv0 = _load_chunk(rows, 0, offs_c, r_dim, ok, CHUNK, FP8_BITS)
    sc0 = _chunk_scale(rows, 0, scale_offset, ok, DS)
    s = _qk(q0, kv0, sc0, DS, DOT_DTYPE, IEEE)
    if NUM_CHUNKS > 1:
        kv1 = _load_chunk(rows, 1, offs_c, r_dim, ok, CHUNK, FP8_BITS)
        sc1 = _chunk_scale(rows, 1, scale_offset, ok, DS)
        s += _qk(q1, kv1, sc1, DS, DOT_DTYPE, IEEE)
    if NUM_CHUNKS > 2:
        kv2 = _load_chunk(rows, 2, offs_c, r_dim, ok, CHUNK, FP8_BITS)
        sc2 = _chunk_scale(rows, 2, scale_offset, ok, DS)
        s += _qk(q2, kv2, sc2, DS, DOT_DTYPE, IEEE)
    if NUM_CHUNKS > 3:
        kv3 = _load_chunk(rows, 3, offs_c, r_dim, ok, CHUNK, FP8_BITS)
        sc3 = _chunk_scale(rows, 3, scale_offset, ok, DS)
        s += _qk(q3, kv3, sc3, DS, DOT_DTYPE, IEEE)
    if HAS_ROPE:
        pe_mask = ok[:, None] & (offs_p < rope_dim)[None, :]
        if DS:  # k_pe unquantized, in the compute dtype, at its byte offset
            pe_row = (rows + rope_offset).to(tl.pointer_type(ROPE_DTYPE))
            k_pe = tl.load(pe_row[:, None] + offs_p[None, :], mask=pe_mask, other=0.0)
        else:
            k_pe = tl.load(rows[:, None] + r_dim + offs_p[None, :], mask=pe_mask, other=0.0)
            if FP8_BITS:
                k_pe = _e4m3_bits_to_f32(k_pe)
        s += _dot(q_pe, tl.trans(k_pe.to(DOT_DTYPE)), IEEE)
    s = (s * qk_scale).to(tl.float32)
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc0 = _pv(acc0, alpha, p, kv0, sc0, DS, P_DTYPE, DOT_DTYPE, IEEE, ROUND_BF16)
    if NUM_CHUNKS > 1:
        acc1 = _pv(acc1, alpha, p, kv1, sc1, DS, P_DTYPE, DOT_DTYPE, IEEE, ROUND_BF16)
    if NUM_CHUNKS > 2:
        acc2 = _pv(acc2, alpha, p, kv2, sc2, DS, P_DTYPE, DOT_DTYPE, IEEE, ROUND_BF16)
    if NUM_CHUNKS > 3:
        acc3 = _pv(acc3, alpha, p, kv3, sc3, DS, P_DTYPE, DOT_DTYPE, IEEE, ROUND_BF16)
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def sparse_attn_kernel(
    q_lat_ptr,  # [T, H, r]
    q_pe_ptr,  # [T, H, rope] (unused when not HAS_ROPE)
    kv_ptr,  # [P, page_size, width]: latent rows (e4m3 as uint8 when FP8_BITS)
    block_table_ptr,  # [B, max_pages] int32
    kv_lens_ptr,  # [B] int32
    token_req_ptr,  # [T] int32
    idx_ptr,  # [T, K] int32/int64 logical positions (-1: none)
    kv_scale_ptr,  # [] float32 (read only when HAS_SCALE)
    out_ptr,  # [T, H, r] q dtype (not SPLIT)
    lse_ptr,  # [T, H] float32 (not SPLIT)
    part_o_ptr,  # [S, T, H, r] float32 (SPLIT; contiguous)
    part_lse_ptr,  # [S, T, H] float32 (SPLIT; contiguous)
    num_tokens,
    num_heads,
    r_dim,
    rope_dim,
    page_size,
    num_idx,  # K
    blocks_per_split,  # BLOCK_N-index blocks of the list per split
    scale_offset,  # DS: byte offset of a row's float32 tile scales
    rope_offset,  # DS: byte offset of a row's k_pe
    qk_scale_log2,  # softmax_scale * log2(e)
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_kvp,
    stride_kvs,
    stride_bt,
    stride_it,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # 1 .. 4
    BLOCK_ROPE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8_BITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # interpreter, bf16: round p to nearest even before P · V
    ROUND_OUT: tl.constexpr,  # interpreter, bf16 output written here: round it the same way
    DS: tl.constexpr,
    ROPE_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,  # write fp32 partials of split lists (merged by sparse_merge_kernel)
):
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + req)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    heads64 = heads.to(tl.int64)
    offs_c = tl.arange(0, CHUNK)
    offs_p = tl.arange(0, BLOCK_ROPE)
    offs_n0 = tl.arange(0, BLOCK_N)

    q0, q1, q2, q3, q_pe = _load_queries(
        q_lat_ptr, q_pe_ptr, t, heads64, h_ok, offs_c, offs_p, r_dim, rope_dim, stride_qlt,
        stride_qlh, stride_qpt, stride_qph, BLOCK_H, BLOCK_ROPE, NUM_CHUNKS, CHUNK, HAS_ROPE,
        DOT_DTYPE)  # fmt: skip
    acc0 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)

    qk_scale = qk_scale_log2
    if HAS_SCALE:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
        qk_scale = qk_scale * kv_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    bt_row = block_table_ptr + req * stride_bt
    idx_row = idx_ptr + t * stride_it
    k_lo = pid_s * blocks_per_split * BLOCK_N
    k_hi = tl.minimum(num_idx, k_lo + blocks_per_split * BLOCK_N)
    for k0 in range(k_lo, k_hi, BLOCK_N):
        offs_n = k0 + offs_n0
        idx = tl.load(idx_row + offs_n, mask=offs_n < k_hi, other=-1)
        ok = (idx >= 0) & (idx < kv_len)  # out of range: masked (and refused by the wrapper)
        rows = _paged_rows(idx, ok, bt_row, page_size, kv_ptr, stride_kvp, stride_kvs)
        m_i, l_i, acc0, acc1, acc2, acc3 = _keys_step(
            rows, ok, q0, q1, q2, q3, q_pe, m_i, l_i, acc0, acc1, acc2, acc3, offs_c, offs_p,
            r_dim, rope_dim, scale_offset, rope_offset, qk_scale, CHUNK, NUM_CHUNKS, HAS_ROPE,
            FP8_BITS, DOT_DTYPE, P_DTYPE, IEEE, ROUND_BF16, DS, ROPE_DTYPE)  # fmt: skip

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    if HAS_SCALE:
        l_safe = l_safe / kv_scale  # o = acc * kv_scale / l
    lse = tl.where(has_mass, (m_i + tl.log2(tl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    if SPLIT:
        prow = (pid_s.to(tl.int64) * num_tokens + t) * num_heads + heads64
        base = part_o_ptr + prow[:, None] * r_dim
        tl.store(part_lse_ptr + prow, lse, mask=h_ok)
    else:
        base = out_ptr + t * stride_ot + heads64[:, None] * stride_oh
        tl.store(lse_ptr + t * stride_lt + heads64 * stride_lh, lse, mask=h_ok)
    _store_chunk(base, acc0, l_safe, 0, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
    if NUM_CHUNKS > 1:
        _store_chunk(base, acc1, l_safe, 1, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
    if NUM_CHUNKS > 2:
        _store_chunk(base, acc2, l_safe, 2, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
    if NUM_CHUNKS > 3:
        _store_chunk(base, acc3, l_safe, 3, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)


@triton.jit
def sparse_merge_kernel(
    part_o_ptr,  # [S, T, H, r] float32 (contiguous)
    part_lse_ptr,  # [S, T, H] float32 (contiguous)
    out_ptr,  # [T, H, r] q dtype
    lse_ptr,  # [T, H] float32
    num_splits,
    num_tokens,
    num_heads,
    r_dim,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    h_ok = heads < num_heads
    merge_partials(part_o_ptr, part_lse_ptr, t, num_tokens, num_splits, heads, h_ok,
                   num_heads, r_dim, out_ptr, lse_ptr, t, stride_ot, stride_oh, stride_lt,
                   stride_lh, BLOCK_H, BLOCK_R, ROUND_BF16)
