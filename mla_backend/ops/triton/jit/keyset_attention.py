"""Triton kernel of the attention over key sets (the semantics:
:mod:`mla_backend.ops.torch.keyset_attention`; repeats dropped by the launcher): per query token,
a causal range with a start, an index list into the main cache and one into a second cache, and
a per-head sink.

``keyset_attn_kernel``: grid (query tokens, head blocks). Program ``(t, h)`` holds ``BLOCK_H``
heads of token t (the M of ``tl.dot``) and walks, ``BLOCK_N`` keys per step, first the range
``start_t .. pos_t`` of the main cache (``RANGE``), then its index list into the main cache
(``HAS_IDX``), then its list into the second cache through that cache's block table
(``HAS_IDX2``): each step maps logical positions to rows and runs the sparse attention's step
(:mod:`.sparse_attention`: latent in ``NUM_CHUNKS`` column chunks, online softmax in base 2,
fp32; an entry < 0 or past its cache's rows is masked, never read). The sink enters as one more
logit of value 0 before the output is normalised; the stored lse includes it (o = 0 and lse =
sink where no key is seen, -inf without a sink). Cache layouts: as the sparse attention's
(bf16 / fp16 / fp32, per-tensor fp8, ``fp8_ds_mla``), the second cache in the main one's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sparse_attention import _keys_step, _load_queries, _paged_rows, _store_chunk


@triton.jit
def keyset_attn_kernel(
    q_lat_ptr,  # [T, H, r]
    q_pe_ptr,  # [T, H, rope] (unused when not HAS_ROPE)
    kv_ptr,  # [P, page_size, width]: the main cache's rows (e4m3 as uint8 when FP8_BITS)
    kv2_ptr,  # [P2, page_size2, width]: the second cache's (HAS_IDX2)
    block_table_ptr,  # [B, max_pages] int32
    block_table2_ptr,  # [B, max_pages2] int32 (HAS_IDX2)
    kv_lens_ptr,  # [B] int32
    lens2_ptr,  # [B] int32 (HAS_IDX2)
    token_req_ptr,  # [T] int32
    token_pos_ptr,  # [T] int32
    token_start_ptr,  # [T] int32 first position of the range
    idx_ptr,  # [T, K] int32 positions of the main cache (HAS_IDX)
    idx2_ptr,  # [T, K2] int32 entries of the second cache (HAS_IDX2)
    sink_ptr,  # [H] float32 (HAS_SINK)
    kv_scale_ptr,  # [] float32 (HAS_SCALE)
    out_ptr,  # [T, H, r] q dtype
    lse_ptr,  # [T, H] float32
    num_heads,
    r_dim,
    rope_dim,
    page_size,
    page_size2,
    num_idx,
    num_idx2,
    scale_offset,
    rope_offset,
    qk_scale_log2,  # softmax_scale * log2(e)
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_kvp,
    stride_kvs,
    stride_kv2p,
    stride_kv2s,
    stride_bt,
    stride_bt2,
    stride_it,
    stride_i2t,
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
    ROUND_BF16: tl.constexpr,
    ROUND_OUT: tl.constexpr,
    DS: tl.constexpr,
    ROPE_DTYPE: tl.constexpr,
    RANGE: tl.constexpr,
    HAS_IDX: tl.constexpr,
    HAS_IDX2: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
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
    if RANGE:
        start = tl.load(token_start_ptr + t)
        pos_end = tl.load(token_pos_ptr + t) + 1
        for k0 in range(start, pos_end, BLOCK_N):
            pos = k0 + offs_n0
            ok = pos < pos_end
            rows = _paged_rows(pos, ok, bt_row, page_size, kv_ptr, stride_kvp, stride_kvs)
            m_i, l_i, acc0, acc1, acc2, acc3 = _keys_step(
                rows, ok, q0, q1, q2, q3, q_pe, m_i, l_i, acc0, acc1, acc2, acc3, offs_c,
                offs_p, r_dim, rope_dim, scale_offset, rope_offset, qk_scale, CHUNK,
                NUM_CHUNKS, HAS_ROPE, FP8_BITS, DOT_DTYPE, P_DTYPE, IEEE, ROUND_BF16, DS,
                ROPE_DTYPE)  # fmt: skip
    if HAS_IDX:
        idx_row = idx_ptr + t * stride_it
        for k0 in range(0, num_idx, BLOCK_N):
            offs_n = k0 + offs_n0
            idx = tl.load(idx_row + offs_n, mask=offs_n < num_idx, other=-1)
            ok = (idx >= 0) & (idx < kv_len)  # out of range: masked (refused by the wrapper)
            rows = _paged_rows(idx, ok, bt_row, page_size, kv_ptr, stride_kvp, stride_kvs)
            m_i, l_i, acc0, acc1, acc2, acc3 = _keys_step(
                rows, ok, q0, q1, q2, q3, q_pe, m_i, l_i, acc0, acc1, acc2, acc3, offs_c,
                offs_p, r_dim, rope_dim, scale_offset, rope_offset, qk_scale, CHUNK,
                NUM_CHUNKS, HAS_ROPE, FP8_BITS, DOT_DTYPE, P_DTYPE, IEEE, ROUND_BF16, DS,
                ROPE_DTYPE)  # fmt: skip
    if HAS_IDX2:
        len2 = tl.load(lens2_ptr + req)
        bt2_row = block_table2_ptr + req * stride_bt2
        idx2_row = idx2_ptr + t * stride_i2t
        for k0 in range(0, num_idx2, BLOCK_N):
            offs_n = k0 + offs_n0
            e = tl.load(idx2_row + offs_n, mask=offs_n < num_idx2, other=-1)
            ok = (e >= 0) & (e < len2)
            rows = _paged_rows(e, ok, bt2_row, page_size2, kv2_ptr, stride_kv2p, stride_kv2s)
            m_i, l_i, acc0, acc1, acc2, acc3 = _keys_step(
                rows, ok, q0, q1, q2, q3, q_pe, m_i, l_i, acc0, acc1, acc2, acc3, offs_c,
                offs_p, r_dim, rope_dim, scale_offset, rope_offset, qk_scale, CHUNK,
                NUM_CHUNKS, HAS_ROPE, FP8_BITS, DOT_DTYPE, P_DTYPE, IEEE, ROUND_BF16, DS,
                ROPE_DTYPE)  # fmt: skip

    # the sink: one more logit (natural log -> base 2) of value 0 in the denominator
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + heads64, mask=h_ok, other=float("-inf")) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.exp2(sink2 - m_use)
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        m_i = m_new
    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    if HAS_SCALE:
        l_safe = l_safe / kv_scale  # o = acc * kv_scale / l
    lse = tl.where(has_mass, (m_i + tl.log2(tl.where(has_mass, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    base = out_ptr + t * stride_ot + heads64[:, None] * stride_oh
    tl.store(lse_ptr + t * stride_lt + heads64 * stride_lh, lse, mask=h_ok)
    _store_chunk(base, acc0, l_safe, 0, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
    if NUM_CHUNKS > 1:
        _store_chunk(base, acc1, l_safe, 1, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
    if NUM_CHUNKS > 2:
        _store_chunk(base, acc2, l_safe, 2, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
    if NUM_CHUNKS > 3:
        _store_chunk(base, acc3, l_safe, 3, offs_c, r_dim, h_ok, CHUNK, ROUND_OUT)
