"""Triton kernels: paged split-KV absorbed MLA attention (decode + extend) and the LSE merge.

Absorbed MLA is MQA over one shared latent key per kv token, row ``[c_kv (r) ; k_pe (rope)]``
of the paged cache; the first ``r`` columns are also the value. For a query row
``(q_lat [r], q_pe [rope])``::

    score(n) = softmax_scale * (q_lat . c_kv[n] + q_pe . k_pe[n])     (two dots, no concat)
    o_lat    = sum_n softmax(score)(n) * c_kv[n]

``absorbed_attn_kernel`` (FlashMLA's shape): grid (head blocks, pieces). A query block is
``BLOCK_Q`` consecutive new tokens of ONE request x ``BLOCK_H`` heads, flattened into
``BLOCK_Q*BLOCK_H`` (up to 64) rows so every latent row loaded serves all of them. Program
``(h, k)`` runs piece ``k`` of the plan's schedule (:mod:`mla_backend.ops.triton.schedule`): a
run of consecutive query blocks, the first and last possibly cut at a kv row. For each, it
walks its kv tiles ``BLOCK_N`` rows at a time through the block table (one tile feeds both
``Q·Kᵀ`` dots, r and rope, and ``P·V`` over its first r columns), runs an online softmax in base
2 in fp32, and writes either the final output (a block served whole by this piece) or an fp32
partial and its natural-log LSE (a block the schedule split). Causality: row ``(token j, head
h)`` sees kv positions ``< prefix + j + 1``; a row that sees nothing in a piece writes output 0
and LSE -inf. A decode is the ``BLOCK_Q = 1`` special case of the same code.

The latent is processed in ``NUM_CHUNKS`` (1, 2 or 4) column chunks of ``BLOCK_R / NUM_CHUNKS``
(128 by default: :data:`heuristics.LATENT_CHUNK`): the scores are ``q_pe·k_peᵀ`` plus the sum of
the chunks' partial dots ``q_c·kv_cᵀ`` (the query's chunk read inside the kv loop), and each
chunk has its own ``P·kv_c`` accumulator [BLOCK_M, CHUNK]. Compiled for sm_90a, holding the
whole [BLOCK_M, 512] query and [BLOCK_N, 512] tile in one dot spilled at the 255-register cap;
the chunks do not (``python -m benchmarks gpu-resources``).

``merge_splits_kernel``: one program = one token of a query block x ``BLOCK_H`` heads; for a
split block it combines the pieces' ``(o_s, lse_s)`` by ``o = sum_s exp(lse_s - lse) o_s`` with
``lse = logsumexp_s lse_s``; a block served whole is left as the attention kernel wrote it.

``fp8_ds_mla`` caches (``DS``, uint8 rows, see :mod:`mla_backend.cache_layout`): a chunk lies
in one scale tile (chunks of at most 128 columns), so its e4m3 codes enter the dots unscaled
(exact in bf16 / fp16) and the tile's float32 scale (loaded per kv row from ``scale_offset``)
multiplies the chunk's partial scores and, before the chunk's ``P·V``, the probabilities;
``k_pe`` is loaded as ``ROPE_DTYPE`` from ``rope_offset``. Masked (unwritten) rows are never
loaded, so their NaN bytes are never read. ``LAT_DTYPE`` fp16 (``Kernels(fp8_f16=True)``): the
e4m3 latent dots in fp16 (one conversion per two values instead of bf16's three per value).

fp8 e4m3 caches: rows are converted to the dot dtype unscaled (exact for e4m3 -> bf16/fp16)
and the per-tensor scale is applied once to the scores and once to the output. Where Triton
has no native e4m3 conversion (NVIDIA before sm_89, ROCm) the cache is read as bytes and
decoded with integer ops (``_e4m3_bits_to_f32``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] -> fp32; IEEE keeps fp32 inputs out of TF32 on NVIDIA GPUs."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _round_to_bf16_grid(x):
    """Round finite fp32 ``x`` to the nearest bfloat16 value (ties to even), still in fp32.

    Used under the interpreter only (``ROUND_BF16``): its fp32 -> bf16 cast truncates, where
    GPUs round to nearest even; rounding first makes the cast exact, so the interpreter
    rounds probabilities and outputs as a GPU does.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits_to_f32(b):
    """float8 e4m3fn bit patterns (uint8) -> float32 values, with integer ops only.

    For GPUs without a native e4m3 conversion in Triton (NVIDIA before sm_89, ROCm): the cache
    is read as bytes. Normal: 2^(e-7) * (1 + m/8); subnormal (e = 0): m * 2^-9. The NaN code
    (e = 15, m = 7) decodes to 480 instead of NaN (writers never produce it: they saturate).
    """
    b = b.to(tl.int32)
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # 2^-9
    sub = (sub | sign).to(tl.float32, bitcast=True)  # the sign bit set: -0.0 stays -0.0
    return tl.where(e == 0, sub, normal)


@triton.jit
def _kv_chunk(rows, n_ok, offs_c, r_dim, FP8_BITS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Columns ``offs_c`` of the kv rows at ``rows`` ([BLOCK_N] pointers; masked rows are not
    read) in ``DOT_DTYPE``: [BLOCK_N, CHUNK], the chunk's keys and values."""
    ptrs = rows[:, None] + offs_c[None, :]
    mask = n_ok[:, None] & (offs_c < r_dim)[None, :]
    if FP8_BITS:
        kv = _e4m3_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        kv = tl.load(ptrs, mask=mask, other=0.0)
    return kv.to(DOT_DTYPE)


@triton.jit
def _q_chunk(q_rows, row_ok, offs_c, r_dim, DOT_DTYPE: tl.constexpr):
    """Columns ``offs_c`` of the query rows at ``q_rows`` ([BLOCK_M] pointers): [BLOCK_M, CHUNK]."""
    mask = row_ok[:, None] & (offs_c < r_dim)[None, :]
    return tl.load(q_rows[:, None] + offs_c[None, :], mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def _chunk_scores(q_rows, row_ok, rows, n_ok, c: tl.constexpr, r_dim, sc_row,
                  CHUNK: tl.constexpr, TILE: tl.constexpr, FP8_BITS: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, DS: tl.constexpr):
    """Chunk ``c`` of the latent: (its partial scores q_c · kv_c^T [BLOCK_M, BLOCK_N] (times
    the chunk's ``fp8_ds_mla`` tile scale per kv row when DS), kv_c [BLOCK_N, CHUNK], that scale
    [BLOCK_N] (ones when not DS))."""
    offs_c = c * CHUNK + tl.arange(0, CHUNK)
    kv_c = _kv_chunk(rows, n_ok, offs_c, r_dim, FP8_BITS, DOT_DTYPE)
    s_c = _dot(_q_chunk(q_rows, row_ok, offs_c, r_dim, DOT_DTYPE), tl.trans(kv_c), IEEE)
    if DS:
        # the chunk lies in one scale tile: its float32 scale per kv row, applied to the
        # partial scores here and to the probabilities before this chunk's P·V
        sc = tl.load(sc_row + (c * CHUNK) // TILE, mask=n_ok, other=0.0)
        s_c = s_c * sc[None, :]
    else:
        sc = tl.full([kv_c.shape[0]], 1.0, tl.float32)
    return s_c, kv_c, sc


@triton.jit
def _chunk_pv(acc_c, alpha, p, sc, kv_c, P_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
              IEEE: tl.constexpr, ROUND_BF16: tl.constexpr, DS: tl.constexpr):
    """One chunk's P·V step: acc_c * alpha + round(p [x tile scale]) · kv_c."""
    if DS:
        p = p * sc[None, :]
    if ROUND_BF16:
        if P_DTYPE == tl.bfloat16:
            p = _round_to_bf16_grid(p)
    return acc_c * alpha[:, None] + _dot(p.to(P_DTYPE).to(DOT_DTYPE), kv_c, IEEE)


@triton.jit
def _store_chunk(o_c, c: tl.constexpr, CHUNK: tl.constexpr, out_ptr, out_rows, whole,
                 part_o_ptr, prow, split, r_dim, ROUND_BF16: tl.constexpr):
    """Chunk ``c`` of the normalized output: the final one (a block served whole) in the
    output's dtype, or the fp32 partial (a split block)."""
    offs_c = c * CHUNK + tl.arange(0, CHUNK)
    c_ok = (offs_c < r_dim)[None, :]
    o_fin = o_c
    if ROUND_BF16:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            o_fin = _round_to_bf16_grid(o_c)
    tl.store(out_rows[:, None] + offs_c[None, :], o_fin.to(out_ptr.dtype.element_ty),
             mask=whole[:, None] & c_ok)
    tl.store(part_o_ptr + prow[:, None] * r_dim + offs_c[None, :], o_c, mask=split[:, None] & c_ok)


@triton.jit
def absorbed_attn_kernel(
    q_lat_ptr,  # [T, H, r]
    q_pe_ptr,  # [T, H, rope] (unused when not HAS_ROPE)
    kv_ptr,  # [P, page_size, r + rope]
    kv_scale_ptr,  # [] float32 (read only when HAS_SCALE)
    block_table_ptr,  # [B, max_pages] int32/int64
    prefix_lens_ptr,  # [B] int32
    new_lens_ptr,  # [B] int32
    cu_new_ptr,  # [B + 1] int32
    blk_req_ptr,  # [W] int32: request of each query block
    blk_q0_ptr,  # [W] int32: first new-token index (within the request)
    part_meta_ptr,  # [num_parts, 5] int32: the plan's schedule (see schedule.py)
    split_base_ptr,  # [W + 1] int32: first partial slot of each split query block
    out_ptr,  # [T, H, r] q dtype: final o_lat of query blocks served whole by one piece
    lse_ptr,  # [T, H] float32
    part_o_ptr,  # [S, BLOCK_Q, H, r] float32 partials of split query blocks (contiguous)
    part_lse_ptr,  # [S, BLOCK_Q, H] float32 (contiguous)
    num_heads,
    r_dim,
    rope_dim,
    page_size,
    scale_offset,  # DS: byte offset of a row's float32 tile scales
    rope_offset,  # DS: byte offset of a row's k_pe (ROPE_DTYPE)
    qk_scale_log2,  # softmax_scale * log2(e)
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_kvp,
    stride_kvs,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8_BITS: tl.constexpr,  # kv_ptr is the fp8 cache viewed as uint8: decode in-kernel
    DOT_DTYPE: tl.constexpr,  # dtype fed to tl.dot (q's dtype; fp32 under the interpreter for bf16)
    P_DTYPE: tl.constexpr,  # probabilities are rounded to q's dtype before P @ V, as on GPU
    IEEE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # interpreter, bf16: round p (and a bf16 output) to nearest even
    DS: tl.constexpr = False,  # fp8_ds_mla rows (bytes): e4m3 tiles x float32 scales, k_pe
    TILE: tl.constexpr = 128,  # DS: c_kv values per scale
    ROPE_DTYPE: tl.constexpr = tl.float32,  # DS: dtype of the stored k_pe
    NUM_CHUNKS: tl.constexpr = 1,  # the latent in 1, 2 or 4 column chunks of BLOCK_R / NUM_CHUNKS
    LAT_DTYPE: tl.constexpr = None,  # the latent dots' operands (DOT_DTYPE, or fp16 for e4m3)
    LAT_P_DTYPE: tl.constexpr = None,  # probabilities before the latent P·V (P_DTYPE or fp16)
    LAT_IEEE: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    CHUNK: tl.constexpr = BLOCK_R // NUM_CHUNKS
    # Head blocks vary fastest in launch order, so the programs that read the same latent rows
    # (all head blocks of one piece) run together and share them through L2.
    pid_h = tl.program_id(0)
    pid_p = tl.program_id(1)
    meta = part_meta_ptr + pid_p * 5
    w_first = tl.load(meta)
    n_first = tl.load(meta + 1)
    w_last = tl.load(meta + 2)
    n_last = tl.load(meta + 3)
    g_first = tl.load(meta + 4)

    offs_m = tl.arange(0, BLOCK_M)
    jq = offs_m // BLOCK_H  # token of the row within its query block
    head = pid_h * BLOCK_H + offs_m % BLOCK_H
    head_ok = head < num_heads
    head64 = head.to(tl.int64)
    offs_p = tl.arange(0, BLOCK_ROPE)
    p_ok = offs_p < rope_dim
    offs_n0 = tl.arange(0, BLOCK_N)

    qk_scale = qk_scale_log2
    if HAS_SCALE:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
        qk_scale = qk_scale * kv_scale

    for w in range(w_first, w_last + 1):
        req = tl.load(blk_req_ptr + w)
        q0 = tl.load(blk_q0_ptr + w)
        prefix = tl.load(prefix_lens_ptr + req)
        n_new = tl.load(new_lens_ptr + req)
        tok0 = tl.load(cu_new_ptr + req)
        kv_len = prefix + n_new
        qj = q0 + jq  # new-token index within the request
        row_ok = (qj < n_new) & head_ok
        tok = (tok0 + qj).to(tl.int64)
        row_end = prefix + qj + 1  # causal bound (exclusive) of each row
        # this piece's kv rows of block w: all of them, except at the piece's two ends
        need = tl.minimum(prefix + q0 + BLOCK_Q, kv_len)
        start = tl.where(w == w_first, n_first, 0)
        end = tl.minimum(tl.where(w == w_last, n_last, need), need)
        g_base = tl.load(split_base_ptr + w)
        n_split = tl.load(split_base_ptr + w + 1) - g_base
        g = tl.where(w == w_first, g_first, g_base).to(tl.int64)

        # the query's latent is read per chunk inside the kv loop (from L1/L2): holding all
        # of it in registers next to the accumulators is what made the kernel spill
        q_rows = q_lat_ptr + tok * stride_qlt + head64 * stride_qlh
        if HAS_ROPE:
            q_pe = tl.load(
                q_pe_ptr
                + tok[:, None] * stride_qpt
                + head64[:, None] * stride_qph
                + offs_p[None, :],
                mask=row_ok[:, None] & p_ok[None, :],
                other=0.0,
            ).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
        if NUM_CHUNKS > 1:
            acc1 = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
        if NUM_CHUNKS > 2:
            acc2 = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_btb
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + offs_n0
            n_ok = offs_n < end
            page = tl.load(bt_row + offs_n // page_size, mask=n_ok, other=0).to(tl.int64)
            rows = kv_ptr + page * stride_kvp + (offs_n % page_size).to(tl.int64) * stride_kvs
            sc_row = (rows + scale_offset).to(tl.pointer_type(tl.float32))  # DS tile scales
            # scores = q_pe · k_pe^T + the sum over chunks of q_c · kv_c^T
            s, kv0, sc0 = _chunk_scores(q_rows, row_ok, rows, n_ok, 0, r_dim, sc_row, CHUNK,
                                        TILE, FP8_BITS, LAT_DTYPE, LAT_IEEE, DS)
            if NUM_CHUNKS > 1:
                s1, kv1, sc1 = _chunk_scores(q_rows, row_ok, rows, n_ok, 1, r_dim, sc_row,
                                             CHUNK, TILE, FP8_BITS, LAT_DTYPE, LAT_IEEE, DS)
                s += s1
            if NUM_CHUNKS > 2:
                s2, kv2, sc2 = _chunk_scores(q_rows, row_ok, rows, n_ok, 2, r_dim, sc_row,
                                             CHUNK, TILE, FP8_BITS, LAT_DTYPE, LAT_IEEE, DS)
                s3, kv3, sc3 = _chunk_scores(q_rows, row_ok, rows, n_ok, 3, r_dim, sc_row,
                                             CHUNK, TILE, FP8_BITS, LAT_DTYPE, LAT_IEEE, DS)
                s += s2 + s3
            if HAS_ROPE:
                pe_ptrs = rows[:, None] + r_dim + offs_p[None, :]
                pe_mask = n_ok[:, None] & p_ok[None, :]
                if DS:  # k_pe unquantized, in the compute dtype, at its byte offset
                    pe_row = (rows + rope_offset).to(tl.pointer_type(ROPE_DTYPE))
                    k_pe = tl.load(pe_row[:, None] + offs_p[None, :], mask=pe_mask, other=0.0)
                elif FP8_BITS:
                    k_pe = _e4m3_bits_to_f32(tl.load(pe_ptrs, mask=pe_mask, other=0))
                else:
                    k_pe = tl.load(pe_ptrs, mask=pe_mask, other=0.0)
                s += _dot(q_pe, tl.trans(k_pe.to(DOT_DTYPE)), IEEE)
            s = (s * qk_scale).to(tl.float32)  # fp32 even if the scale comes in as fp64
            visible = n_ok[None, :] & (offs_n[None, :] < row_end[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)  # fp32 row sums of the unrounded probabilities
            acc0 = _chunk_pv(acc0, alpha, p, sc0, kv0, LAT_P_DTYPE, LAT_DTYPE, LAT_IEEE,
                             ROUND_BF16, DS)
            if NUM_CHUNKS > 1:
                acc1 = _chunk_pv(acc1, alpha, p, sc1, kv1, LAT_P_DTYPE, LAT_DTYPE,
                                 LAT_IEEE, ROUND_BF16, DS)
            if NUM_CHUNKS > 2:
                acc2 = _chunk_pv(acc2, alpha, p, sc2, kv2, LAT_P_DTYPE, LAT_DTYPE,
                                 LAT_IEEE, ROUND_BF16, DS)
                acc3 = _chunk_pv(acc3, alpha, p, sc3, kv3, LAT_P_DTYPE, LAT_DTYPE,
                                 LAT_IEEE, ROUND_BF16, DS)
            m_i = m_new

        has_mass = l_i > 0.0
        l_safe = tl.where(has_mass, l_i, 1.0)
        inv = 1.0 / l_safe
        if HAS_SCALE:
            inv = inv * kv_scale
        lse = tl.where(has_mass, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        # a block served whole by this piece: its final output; a split one: an fp32 partial
        nsp = tl.zeros([BLOCK_M], dtype=tl.int32) + n_split  # as a row vector: mask dtype
        whole = row_ok & (nsp == 0)  # a block served whole has no partial slots
        split = row_ok & (nsp > 0)
        out_rows = out_ptr + tok * stride_ot + head64 * stride_oh
        prow = (g * BLOCK_Q + jq) * num_heads + head64  # [BLOCK_M] row of the partials
        _store_chunk(acc0 * inv[:, None], 0, CHUNK, out_ptr, out_rows, whole, part_o_ptr,
                     prow, split, r_dim, ROUND_BF16)
        if NUM_CHUNKS > 1:
            _store_chunk(acc1 * inv[:, None], 1, CHUNK, out_ptr, out_rows, whole,
                         part_o_ptr, prow, split, r_dim, ROUND_BF16)
        if NUM_CHUNKS > 2:
            _store_chunk(acc2 * inv[:, None], 2, CHUNK, out_ptr, out_rows, whole,
                         part_o_ptr, prow, split, r_dim, ROUND_BF16)
            _store_chunk(acc3 * inv[:, None], 3, CHUNK, out_ptr, out_rows, whole,
                         part_o_ptr, prow, split, r_dim, ROUND_BF16)
        tl.store(lse_ptr + tok * stride_lt + head64 * stride_lh, lse, mask=whole)
        tl.store(part_lse_ptr + prow, lse, mask=split)


@triton.jit
def merge_partials(
    part_o_ptr,  # [S, ..., H, r] float32 partial outputs (contiguous)
    part_lse_ptr,  # [S, ..., H] float32 (contiguous)
    slot0,  # int64: the first partial's row (in units of H heads)
    slot_step,  # rows between consecutive partials of the same token
    n_split,  # partials to merge (0: the output is left as it is)
    heads,  # [BLOCK_H] int64 head indices
    h_ok,  # [BLOCK_H] bool: heads to merge and write
    num_heads,
    r_dim,
    out_ptr,  # [T, H, r] q dtype
    lse_ptr,  # [T, H] float32
    t,  # int64 token
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Merge token ``t``'s ``n_split`` partials by their LSE (fp32; partial ``s`` of head ``h``
    is row ``(slot0 + s * slot_step) * num_heads + h`` of ``part_o`` / ``part_lse``) into its
    final output (out's dtype) and LSE (natural log; -inf where nothing had mass), for the
    heads of ``h_ok``. The split-KV merge of the absorbed and the sparse attention."""
    offs_r = tl.arange(0, BLOCK_R)
    mask = h_ok[:, None] & (offs_r < r_dim)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for s in range(0, n_split):
        prow = (slot0 + s * slot_step) * num_heads + heads
        lse_s = tl.load(part_lse_ptr + prow, mask=h_ok, other=float("-inf"))
        o_s = tl.load(part_o_ptr + prow[:, None] * r_dim + offs_r[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        wgt = tl.exp(lse_s - m_use)
        l_sum = l_sum * alpha + wgt
        acc = acc * alpha[:, None] + wgt[:, None] * o_s
        m = m_new
    has_mass = l_sum > 0.0
    l_safe = tl.where(has_mass, l_sum, 1.0)
    o = acc / l_safe[:, None]
    if ROUND_BF16:
        o = _round_to_bf16_grid(o)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh,
             tl.where(has_mass, m + tl.log(l_safe), float("-inf")), mask=h_ok)  # fmt: skip


@triton.jit
def merge_splits_kernel(
    blk_req_ptr,  # [W] int32
    blk_q0_ptr,  # [W] int32
    new_lens_ptr,  # [B] int32
    cu_new_ptr,  # [B + 1] int32
    split_base_ptr,  # [W + 1] int32
    part_o_ptr,  # [S, BLOCK_Q, H, r] float32 (contiguous)
    part_lse_ptr,  # [S, BLOCK_Q, H] float32 (contiguous)
    out_ptr,  # [T, H, r] q dtype
    lse_ptr,  # [T, H] float32
    num_heads,
    r_dim,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # interpreter, bf16 output: round to nearest even (see above)
):
    pid = tl.program_id(0)
    w = pid // BLOCK_Q
    j = pid % BLOCK_Q
    req = tl.load(blk_req_ptr + w)
    qj = tl.load(blk_q0_ptr + w) + j
    t = (tl.load(cu_new_ptr + req) + qj).to(tl.int64)
    n_new = tl.load(new_lens_ptr + req)
    g_base = tl.load(split_base_ptr + w)
    n_split = tl.load(split_base_ptr + w + 1) - g_base
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    zero = tl.zeros([BLOCK_H], dtype=tl.int32)  # scalars as row vectors: mask dtype
    # a block served whole is already final
    h_ok = (heads < num_heads) & (zero + qj < n_new) & (zero + n_split > 0)
    merge_partials(part_o_ptr, part_lse_ptr, g_base.to(tl.int64) * BLOCK_Q + j, BLOCK_Q,
                   n_split, heads.to(tl.int64), h_ok, num_heads, r_dim, out_ptr, lse_ptr, t,
                   stride_ot, stride_oh, stride_lt, stride_lh, BLOCK_H, BLOCK_R, ROUND_BF16)
