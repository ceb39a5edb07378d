"""A Gluon (``triton.experimental.gluon``) absorbed-attention kernel for Hopper (sm_90a) with
FlashMLA's division of work between two warpgroups; opt-in (``MLA_BACKEND_IMPL=gluon`` or
``mla_backend.ops.triton.Kernels(gluon=True)``) until it is timed on a GPU.

What plain ``tl.dot`` cannot express and this kernel does (the resource check,
``python -m benchmarks gpu-resources``, showed the ``tl.dot`` kernel computing the whole
``Q·Kᵀ`` in both warpgroups, with MMA and softmax never overlapping):

- 64 query rows per program, 8 warps = two warpgroups. Each kv tile is one page of 64 rows,
  brought into shared memory by TMA (two buffers, mbarriers): the latent ``[64, 512]`` and
  ``k_pe [64, 64]``; the queries ``[64, 512]`` / ``[64, 64]`` stay in shared memory.
- ``S = Q·Kᵀ`` [64, 64] by one async wgmma chain whose layout splits S's columns between the
  warpgroups (32 each: no duplicated work); the row max / sum of the online softmax reduce
  across both.
- P goes through shared memory (``p_smem``): each warpgroup stores its 32 columns and reads all
  64 as the A operand of ``P·V``, so each warpgroup owns one 256-wide half of the output
  ``O [64, 512]`` (FlashMLA's split of the output).
- Async wgmma overlaps the softmax: ``S`` of the next tile is issued before the softmax of the
  current one, and ``P·V`` of the current tile runs while the next tile's ``S`` is awaited.
  (FlashMLA gives each warpgroup alternate kv tiles' ``S`` instead; here both work on every
  tile's ``S``, half each.)

Scope: a GPU of :data:`ARCHS` (Hopper), and (checked by :func:`serves`) bf16 / fp16 queries
and cache, ``kv_lora_rank`` 512, rope 64, page size 64, heads a multiple of 16 dividing 64 or a
multiple of 64. It runs the plan's
schedule (:mod:`mla_backend.ops.triton.schedule`, cut at multiples of 64 rows) and writes the
same outputs and partials as ``absorbed_attn_kernel``; the Triton merge kernel combines the
partials. Unwritten cache rows of a request's last page (any bits, NaN included) are zeroed in
shared memory before ``P·V`` reads them. Gluon kernels do not run under the Triton interpreter:
on the CPU they are compiled for sm_90a and resource-checked; the GPU tests check them against
the float64 reference.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

#: rows per program (wgmma's M), kv rows per tile (= the page size it serves)
BLOCK_M = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
R = gl.constexpr(512)
ROPE = gl.constexpr(64)
NUM_WARPS = 8
#: compute capabilities the kernel is built for: Hopper's (sm_90a: wgmma, TMA). Blackwell has
#: no wgmma (Triton 3.6 aborts compiling it for sm_100a); there the Triton kernel serves.
ARCHS = (90,)


def serves(num_heads: int, r: int, rope: int, page_size: int, q_dtype: object,
           cache_dtype: object, block_q: int, block_h: int) -> bool:
    """True when this kernel serves the call (see the module doc); the Triton kernel otherwise.
    Dtypes are torch dtypes."""
    import torch

    rows = BLOCK_M.value
    heads_ok = num_heads % 16 == 0 and (rows % num_heads == 0 or num_heads % rows == 0)
    return (
        r == R.value and rope == ROPE.value and page_size == BLOCK_N.value and heads_ok
        and q_dtype in (torch.bfloat16, torch.float16) and cache_dtype == q_dtype
        and block_q * block_h <= rows and (block_h == num_heads or block_h == rows)
    )


@gluon.jit
def _issue_kv(kv_lat_desc, kv_pe_desc, kv_lat_smem, kv_pe_smem, bar, bt_row, n0, page_size,
              buf):
    """TMA of the kv tile starting at kv row ``n0`` (a page) into buffer ``buf``."""
    page = gl.load(bt_row + n0 // page_size).to(gl.int32)
    row = page * page_size
    mbarrier.expect(bar.index(buf), kv_lat_desc.block_type.nbytes * 2
                    + kv_pe_desc.block_type.nbytes)
    dst = kv_lat_smem.index(buf)
    tma.async_copy_global_to_shared(kv_lat_desc, [row, 0], bar.index(buf),
                                    dst.slice(0, 256, dim=1))
    tma.async_copy_global_to_shared(kv_lat_desc, [row, 256], bar.index(buf),
                                    dst.slice(256, 256, dim=1))
    tma.async_copy_global_to_shared(kv_pe_desc, [row, R], bar.index(buf), kv_pe_smem.index(buf))


@gluon.jit
def _zero_rows_from(kv_smem, first_bad, n0, LAYOUT: gl.constexpr):
    """Zero rows ``>= first_bad`` (absolute kv rows; the tile starts at ``n0``) of a
    [64, 512] kv tile in shared memory, 64 columns at a time."""
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    keep = (rows < first_bad)[:, None]
    for c in gl.static_range(R // 64):
        part = kv_smem.slice(c * 64, 64, dim=1)
        tile = part.load(LAYOUT)
        part.store(gl.where(keep, tile, gl.zeros_like(tile)))


@gluon.jit
def absorbed_attn_gluon_kernel(
    q_lat_desc,  # TMA over q_lat [T * H, 512], block [64, 256]
    q_pe_desc,  # TMA over q_pe [T * H, 64], block [64, 64]
    kv_lat_desc,  # TMA over the cache [pages * 64, 576], block [64, 256]
    kv_pe_desc,  # TMA over the cache [pages * 64, 576], block [64, 64]
    block_table_ptr,
    prefix_lens_ptr,
    new_lens_ptr,
    cu_new_ptr,
    blk_req_ptr,
    blk_q0_ptr,
    part_meta_ptr,
    split_base_ptr,
    out_ptr,  # [T, H, 512]
    lse_ptr,  # [T, H] float32
    part_o_ptr,  # [S, BLOCK_Q, H, 512] float32
    part_lse_ptr,  # [S, BLOCK_Q, H] float32
    num_heads,
    page_size,
    qk_scale_log2,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_Q: gl.constexpr,
    BLOCK_H: gl.constexpr,
):
    dtype: gl.constexpr = q_lat_desc.dtype
    # S [64, 64]: the two warpgroups take 32 columns each; O [64, 512]: 256 each
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])

    q_lat_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, R], q_lat_desc.layout)
    q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], q_pe_desc.layout)
    kv_lat_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], kv_lat_desc.layout)
    kv_pe_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], kv_pe_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(kv_bar.index(0), count=1)
    mbarrier.init(kv_bar.index(1), count=1)

    pid_h = gl.program_id(0)
    meta = part_meta_ptr + gl.program_id(1) * 5
    w_first = gl.load(meta)
    n_first = gl.load(meta + 1)
    w_last = gl.load(meta + 2)
    n_last = gl.load(meta + 3)
    g_first = gl.load(meta + 4)

    offs_m_s = gl.arange(0, BLOCK_M, layout=row_s)
    offs_m_o = gl.arange(0, BLOCK_M, layout=row_o)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    offs_r = gl.arange(0, R, layout=col_o)
    q_phase = 0
    kv_phase0 = 0
    kv_phase1 = 0
    for w in range(w_first, w_last + 1):
        req = gl.load(blk_req_ptr + w)
        q0 = gl.load(blk_q0_ptr + w)
        prefix = gl.load(prefix_lens_ptr + req)
        n_new = gl.load(new_lens_ptr + req)
        tok0 = gl.load(cu_new_ptr + req)
        kv_len = prefix + n_new
        need = gl.minimum(prefix + q0 + BLOCK_Q, kv_len)
        start = gl.where(w == w_first, n_first, 0)
        end = gl.minimum(gl.where(w == w_last, n_last, need), need)
        g_base = gl.load(split_base_ptr + w)
        n_split = gl.load(split_base_ptr + w + 1) - g_base
        g = gl.where(w == w_first, g_first, g_base).to(gl.int64)
        bt_row = block_table_ptr + req.to(gl.int64) * stride_btb
        # the block's 64 query rows: consecutive rows of [T * H] (tokens x heads)
        q_row = ((tok0 + q0) * num_heads + pid_h * BLOCK_H).to(gl.int32)
        mbarrier.expect(q_bar, q_lat_desc.block_type.nbytes * 2
                        + q_pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_lat_desc, [q_row, 0], q_bar,
                                        q_lat_smem.slice(0, 256, dim=1))
        tma.async_copy_global_to_shared(q_lat_desc, [q_row, 256], q_bar,
                                        q_lat_smem.slice(256, 256, dim=1))
        tma.async_copy_global_to_shared(q_pe_desc, [q_row, 0], q_bar, q_pe_smem)
        n_tiles = gl.cdiv(end - start, BLOCK_N)
        if n_tiles > 0:
            _issue_kv(kv_lat_desc, kv_pe_desc, kv_lat_smem, kv_pe_smem, kv_bar, bt_row, start,
                      page_size, 0)
        mbarrier.wait(q_bar, q_phase)
        q_phase ^= 1

        jq_s = offs_m_s // BLOCK_H
        row_end = prefix + q0 + jq_s + 1  # causal bound (exclusive) per row
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        o = gl.zeros([BLOCK_M, R], gl.float32, layout=o_layout)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if n_tiles > 0:  # S of the first tile
            mbarrier.wait(kv_bar.index(0), kv_phase0)
            kv_phase0 ^= 1
            s = warpgroup_mma(q_lat_smem, kv_lat_smem.index(0).permute((1, 0)), s,
                              use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe_smem, kv_pe_smem.index(0).permute((1, 0)), s,
                              is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        for i in range(0, n_tiles):
            buf = i % 2
            n0 = start + i * BLOCK_N
            # the next tile: its TMA (its buffer's last reader, P·V of tile i - 1, finished
            # before the previous iteration ended) and its S, issued before this softmax
            has_next = i + 1 < n_tiles
            if has_next:
                _issue_kv(kv_lat_desc, kv_pe_desc, kv_lat_smem, kv_pe_smem, kv_bar, bt_row,
                          n0 + BLOCK_N, page_size, 1 - buf)
            # zero the unwritten rows of the request's last page before P·V reads them
            if n0 + BLOCK_N > kv_len:
                _zero_rows_from(kv_lat_smem.index(buf), kv_len, n0, blocked)
                fence_async_shared()
                gl.thread_barrier()
            if has_next:
                if buf == 0:
                    mbarrier.wait(kv_bar.index(1), kv_phase1)
                    kv_phase1 ^= 1
                else:
                    mbarrier.wait(kv_bar.index(0), kv_phase0)
                    kv_phase0 ^= 1
            # (after the last tile this reads the other buffer's stale rows: discarded)
            s_next = warpgroup_mma(q_lat_smem, kv_lat_smem.index(1 - buf).permute((1, 0)), s,
                                   use_acc=False, is_async=True)
            s_next = warpgroup_mma(q_pe_smem, kv_pe_smem.index(1 - buf).permute((1, 0)),
                                   s_next, is_async=True)
            # online softmax of tile i (base 2), overlapping the next tile's S
            cols = n0 + offs_n
            visible = (cols[None, :] < end) & (cols[None, :] < row_end[:, None])
            x = gl.where(visible, s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(x - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            # P through shared memory: each warpgroup wrote 32 columns, reads all 64
            p_smem.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            o = warpgroup_mma(p_smem, kv_lat_smem.index(buf), o, is_async=True)
            s_next = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
            # P·V of tile i done before p_smem and this buffer are rewritten
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            s = s_next

        # normalize and write: the final output (served whole) or an fp32 partial (split)
        has_mass = l_i > 0.0
        l_safe = gl.where(has_mass, l_i, 1.0)
        lse = gl.where(has_mass, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        inv = gl.convert_layout(1.0 / l_safe, row_o)
        o = o * inv[:, None]
        jq = offs_m_o // BLOCK_H
        head = pid_h * BLOCK_H + offs_m_o % BLOCK_H
        row_ok = (jq < BLOCK_Q) & (q0 + jq < n_new) & (head < num_heads)
        tok = (tok0 + q0 + jq).to(gl.int64)
        head64 = head.to(gl.int64)
        nsp = gl.zeros([BLOCK_M], gl.int32, layout=row_o) + n_split
        whole = row_ok & (nsp == 0)
        split = row_ok & (nsp > 0)
        out_rows = out_ptr + tok * stride_ot + head64 * stride_oh
        gl.store(out_rows[:, None] + offs_r[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=whole[:, None])
        prow = (g * BLOCK_Q + jq) * num_heads + head64
        gl.store(part_o_ptr + prow[:, None] * R + offs_r[None, :], o, mask=split[:, None])
        lse_o = gl.convert_layout(lse, row_o)
        gl.store(lse_ptr + tok * stride_lt + head64 * stride_lh, lse_o, mask=whole)
        gl.store(part_lse_ptr + prow, lse_o, mask=split)

    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(kv_bar.index(0))
    mbarrier.invalidate(kv_bar.index(1))
