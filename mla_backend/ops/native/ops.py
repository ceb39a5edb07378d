"""Thin Python wrappers of the native ``torch.library`` ops (their schemas in ``csrc/api.cpp``,
their fakes in :mod:`mla_backend.ops.native.build`): the seam's record in (:class:`LatentWrite`,
:class:`AbsorbedCall`, :class:`IndexerCall`, :class:`SparseCall`, :class:`MaskedMHACall`: the
op's arguments are its fields, named once, here), the op's outputs back; the normal path's and
the absorption's ops take the seam method's tensors. The device seam's native implementation
(:mod:`mla_backend.ops.native.kernels`) calls these.

Every wrapper takes ``isa``: the ISA level whose build runs the op (``torch.ops.mla_backend_<isa>``;
None = :func:`mla_backend.ops.native.build.selected_isa`), so several levels serve one process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .build import _state, op_namespace, require
from .engine import attention_engine, engine_code

if TYPE_CHECKING:
    from ..base import (
        AbsorbedCall,
        IndexerCall,
        KeySetCall,
        LatentWrite,
        MaskedMHACall,
        SparseCall,
        V4SlotCall,
    )  # fmt: skip


def simd_level(isa: str | None = None) -> str:
    """'avx512_bf16' when level ``isa``'s build has the bf16 engine, else 'fp32'."""
    st = _state(require(isa))
    if "simd" not in st:  # asked on every normal-path call: read the build once
        st["simd"] = "avx512_bf16" if op_namespace(isa).native_simd_info() else "fp32"
    return st["simd"]


def absorbed_attention(
    call: AbsorbedCall, *, isa: str | None = None, engine: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention (MQA over the paged latent cache), decode or extend: op
    ``native_absorbed_attention`` on the record's fields (the schema in ``csrc/api.cpp``).

    What the op takes from ``call``:
        q_lat: [T, H, r] bf16/fp16/fp32 (last dim contiguous; may be a strided view).
        q_pe: [T, H, rope], q_lat's dtype (rope may be 0).
        kv_cache: [num_pages, page_size, r + rope], q's dtype or float8_e4m3fn; row =
            [c_kv ; k_pe]; value = its first r columns. Or uint8 [num_pages, page_size, W]:
            ``fp8_ds_mla`` rows, W = ``CacheLayout.ds_mla(r, rope, q_lat.dtype).width`` (656
            at r 512, rope 64, bf16); value = the dequantized c_kv.
        part.block_table: [B, max_pages] int32, physical page of each logical page;
            part.cu_new_t: [B + 1] int32 (request i owns query rows cu[i]:cu[i+1], may be
            empty); part.kv_lens_t: [B] int32, cached tokens of request i (prefix + new), >= its
            new tokens; part.work.num_kv_splits: kv splits per request (0 = the kernel
            chooses); part.max_page_id: the largest page id any request uses (checked in O(1)
            against the cache's page count; -1: the op checks every used block_table entry).
        softmax_scale: float > 0; kv_scale: float32 0-d tensor, cached value = stored *
            kv_scale (None = 1.0; ignored for ``fp8_ds_mla``, whose scales are in the rows).
    isa: the ISA level that runs it (None: the selected level); engine: the compute engine
    (``ENGINES`` of :mod:`mla_backend.ops.native.engine`; None: its rule's pick for the level
    and CPU, ``attention_engine``).

    Returns:
        o_lat: [T, H, r] in q's dtype; lse: [T, H] float32 (natural log), new tensors.

    Query row j of request i sits at position kv_len_i - n_i + j and attends causally to kv
    positions 0 .. kv_len_i - n_i + j. Scores and softmax are fp32.
    """
    level = require(isa)
    code = engine_code(attention_engine(level) if engine is None else engine)
    part = call.part
    return op_namespace(level).native_absorbed_attention(
        call.q_lat, call.q_pe, call.kv_cache, part.block_table, part.cu_new_t, part.kv_lens_t,
        float(call.softmax_scale), call.kv_scale, int(part.work.num_kv_splits),
        int(part.max_page_id), code,
    )  # fmt: skip


def write_latent(w: LatentWrite, *, isa: str | None = None) -> None:
    """Write ``[c_kv ; k_pe]`` into the paged cache, in place: op ``native_write_latent`` on the
    record's fields.

    What the op takes from ``w``:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn, or uint8
            [num_pages, page_size, ``CacheLayout.ds_mla(r, rope, c_kv.dtype).width``]
            (``fp8_ds_mla``: per tile of 128 values scale = max(amax / 448, FLT_MIN), e4m3 of
            clamp(value / scale), k_pe stored in c_kv's dtype; bit-identical to
            ``CacheLayout.pack``, the torch path's writer).
        c_kv: [T, r]; k_pe: [T, rope] (bf16/fp16/fp32).
        slot_mapping: [>= T] int32/int64; token t goes to page slot // page_size, row
            slot % page_size; slot < 0 is padding (skipped).
        kv_scale: float32 0-d tensor (fp8 cache only): stored = clamp(value / kv_scale, -448,
            448) rounded to nearest-even e4m3, bit-identical to torch's ``.to(float8_e4m3fn)``.
    (The cache's layout is read from its dtype and width; ``w.layout`` is not passed.)
    """
    op_namespace(isa).native_write_latent(w.kv_cache, w.c_kv, w.k_pe, w.slot_mapping, w.kv_scale)


def pack_heads(w: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """Pack a per-head weight once for :func:`head_gemm`.

    Args:
        w: [H, K, N] bfloat16 (``W_UK`` [H, nope, r] or ``W_UV`` [H, r, v]).
    Returns:
        [H, ceil(N / 64), ceil(K / 2), 64, 2] bfloat16: VNNI pairs of rows in blocks of 64
        columns, zero-padded (same element count as ``w`` up to the padding).
    """
    return op_namespace(isa).native_pack_heads(w)


def head_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    *,
    out: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """``y[t, h] = x[t, h] · w[h]`` for every head, w given packed (:func:`pack_heads`).

    Args:
        x: [T, H, K] bfloat16, last dim contiguous (any other strides: a view of q is fine).
        packed: :func:`pack_heads` of w [H, K, N].
        n: N, the output width.
        out: optional [T, H, N] bfloat16 buffer, last dim contiguous (any other strides: a
            view of an engine's output), written in place.
    Returns:
        y: [T, H, N] bfloat16 (``out``, else new and contiguous); fp32 sums, rounded once
        (nearest even).
    """
    ns = op_namespace(isa)
    if out is None:
        return ns.native_head_gemm(x, packed, int(n))
    ns.native_head_gemm_out(x, packed, out)
    return out


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention with its log-sum-exp (the normal path's MHA), bf16, any ISA level.

    Args:
        q: [H, Lq, Dqk]; k: [H, Lk, Dqk]; v: [H, Lk, Dv]; bfloat16, last dims contiguous (any
            other strides).
        causal: top-left causal (key j visible to query i iff j <= i).
        scale: softmax scale of ``q·k``.
    Returns:
        o [H, Lq, Dv] bfloat16 (fp32 sums; probabilities rounded to bf16 before P·V where the
        CPU has bf16 dot products), lse
        [H, Lq] float32 (natural log; -inf and o = 0 for a row that sees no key).
    """
    return op_namespace(isa).native_attention_with_lse(q, k, v, bool(causal), float(scale))


def masked_attention_with_lse(
    call: MaskedMHACall, *, isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSA's sparse MHA (``csrc/sparse_mha.cpp``, see :class:`MaskedMHACall`):
    :func:`attention_with_lse` where query row i sees key j iff ``mask[i, j]`` (mask [Lq, Lk]
    bool, contiguous, shared by the heads; tiles of 32 rows x 64 keys that no row selected are
    skipped); bf16, any ISA level. A row whose mask is empty gets o = 0, lse = -inf."""
    ns = op_namespace(isa)
    return ns.native_masked_attention_with_lse(call.q, call.k, call.v, call.mask, float(call.scale))


def decompress(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    *,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The normal path's decompression, bf16 (fp32 sums, one rounding; no packed weight copy:
    c_kv is packed per call, L * r bf16 of scratch).

    Args:
        c_kv: [L, r]; k_pe: [L, rope]; bfloat16, last dims contiguous (any row stride).
        W_UK: [H, nope, r]; W_UV: [H, r, v]; bfloat16, any strides.
        isa: the ISA level that runs it (None: the selected level).
    Returns:
        k [H, L, nope + rope] = ``[c_kv·W_UK[h]^T ; k_pe]``, v [H, L, v] = ``c_kv·W_UV[h]``,
        bfloat16 views of contiguous [L, H, ...] buffers.
    """
    k, v = op_namespace(isa).native_decompress(c_kv, k_pe, W_UK, W_UV)
    return k.transpose(0, 1), v.transpose(0, 1)


def indexer_topk(call: IndexerCall, *, isa: str | None = None) -> torch.Tensor:
    """The DSA indexer's causal top-k per query token (``csrc/indexer.cpp``): op
    ``native_indexer_topk`` on the record's fields, into ``call.out`` when given.

    What the op takes from ``call``:
        q_I: [T, Hi, Di] bf16 / fp16 / fp32 / float8_e4m3fn, last dim contiguous.
        weights: [T, Hi] float32 (every scale folded in).
        index_cache: uint8 [pages, page_size, Di + 4 Di / quant_block_size] (vLLM's fp8 index
            cache) or bf16 / fp16 / fp32 [pages, page_size, Di]; pages contiguous.
        part's block_table / cu_new_t / kv_lens_t / max_page_id: as :func:`absorbed_attention`;
            query row j of request i sits at position kv_len - n + j and sees positions <= it.
        layout.quant_block_size: values per scale (fp8 cache).
        topk: positions per token; out: optional [T, topk] int32 contiguous.
    Returns:
        [T, topk] int32: the best ``min(topk, visible)`` positions (rank rule of
        :mod:`mla_backend.ops.torch.indexer`), ascending, then -1.
    """
    ns = op_namespace(isa)
    out = call.out
    if out is None:
        out = torch.empty(call.q_I.shape[0], call.topk, dtype=torch.int32)
    p = call.part
    ns.native_indexer_topk(
        call.q_I, call.weights, call.index_cache, p.block_table, p.cu_new_t, p.kv_lens_t,
        int(call.layout.quant_block_size), int(call.topk), int(p.max_page_id), out,
        int(call.sparse.ratio),
    )  # fmt: skip
    return out


def indexer_logits(call: IndexerCall, *, isa: str | None = None) -> torch.Tensor:
    """The DSA indexer's scores, float32 [T, call.sparse.max_kv_len] (-inf where a token does
    not see the position; into ``call.out`` when given): op ``native_indexer_logits``,
    arguments as :func:`indexer_topk`."""
    p = call.part
    res = op_namespace(isa).native_indexer_logits(
        call.q_I, call.weights, call.index_cache, p.block_table, p.cu_new_t, p.kv_lens_t,
        int(call.layout.quant_block_size), int(call.sparse.max_kv_len), int(p.max_page_id),
        int(call.sparse.ratio),
    )  # fmt: skip
    return res if call.out is None else call.out.copy_(res)


def sparse_attention(
    call: SparseCall, *, isa: str | None = None, engine: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSA's sparse absorbed attention (``csrc/sparse_attention.cpp``): op
    ``native_sparse_attention`` on the record's fields: ``call.attn`` as
    :func:`absorbed_attention` takes it (any latent layout), ``call.indices`` [T, k] int32
    (logical positions of the token's request, -1 = none), ``call.sparse.token_req_t`` [T]
    int32 (each token's request) -> (o_lat [T, H, r] in q's dtype, lse [T, H] float32; into
    ``call.attn.out`` / ``lse`` when given). An index >= its request's kv length (or < -1)
    raises RuntimeError naming it, before any read."""
    level = require(isa)
    a, p = call.attn, call.attn.part
    T, H, r = a.q_lat.shape
    o = a.out if a.out is not None else torch.empty(T, H, r, dtype=a.q_lat.dtype)
    lse = a.lse if a.lse is not None else torch.empty(T, H, dtype=torch.float32)
    code = engine_code(attention_engine(level) if engine is None else engine)
    op_namespace(level).native_sparse_attention(
        a.q_lat, a.q_pe, a.kv_cache, p.block_table, p.cu_new_t, p.kv_lens_t, call.indices,
        call.sparse.token_req_t, float(a.softmax_scale), a.kv_scale, int(p.max_page_id), code,
        o, lse,
    )  # fmt: skip
    return o, lse


def keyset_attention(
    call: KeySetCall, *, isa: str | None = None, engine: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention over key sets (``csrc/keyset_attention.cpp``; the semantics of
    :mod:`mla_backend.ops.torch.keyset_attention`): op ``native_keyset_attention`` on the
    record's fields: ``call.attn`` as :func:`absorbed_attention` takes it (the main cache in any
    layout), ``call.causal_range`` with ``call.window.sizes_t`` [B] int32 (None: from 0),
    ``call.indices`` [T, k] positions of the main cache, ``call.extra`` (the main cache's row
    format, its block table [B, pages2] and lens [B]) with ``call.extra_indices`` [T, k2],
    ``call.sink`` [H] float32 -> (o [T, H, dv] in q's dtype, lse [T, H] float32, the sink
    included; into ``call.attn.out`` / ``lse`` when given and contiguous). value = key runs as
    a latent of the whole row with no rope part (q = ``[q_lat ; q_pe]``). A bad window, index
    or used page id raises RuntimeError naming it, before any read."""
    level = require(isa)
    a, p, ex = call.attn, call.attn.part, call.extra
    q_lat, q_pe = a.q_lat, a.q_pe
    if call.value_is_key:
        q_lat = torch.cat([q_lat, q_pe], -1)
        q_pe = q_lat.new_empty(q_lat.shape[0], q_lat.shape[1], 0)
    T, H, r = q_lat.shape
    o = a.out if a.out is not None and a.out.is_contiguous() else None
    lse = a.lse if a.lse is not None and a.lse.is_contiguous() else None
    o = o if o is not None else torch.empty(T, H, r, dtype=q_lat.dtype)
    lse = lse if lse is not None else torch.empty(T, H, dtype=torch.float32)
    code = engine_code(attention_engine(level) if engine is None else engine)
    op_namespace(level).native_keyset_attention(
        q_lat, q_pe, a.kv_cache, p.block_table, p.cu_new_t, p.kv_lens_t, bool(call.causal_range),
        call.window.sizes_t if call.window is not None else None, call.indices,
        ex.kv_cache if ex is not None else None, ex.block_table if ex is not None else None,
        ex.lens if ex is not None else None, call.extra_indices, call.sink,
        float(a.softmax_scale), a.kv_scale, int(p.max_page_id), int(p.work.num_kv_splits), code,
        o, lse,
    )  # fmt: skip
    return o, lse


def v4_slot_attention(
    call: V4SlotCall, *, isa: str | None = None, engine: str | None = None
) -> torch.Tensor:
    """DeepSeek-V4 attention over flat slots of V4 fp8 caches, the rows read in place
    (``csrc/keyset_attention.cpp``; the semantics of
    :mod:`mla_backend.ops.torch.v4_slot_attention`): op ``native_v4_slot_attention`` on the
    record's fields (the window cache's set first, then the compressed cache's, if any) -> o
    [T, H, 512] in q's dtype (into ``call.out`` when given and contiguous). A slot past its cache
    or a page too small for its rows raises RuntimeError naming it, before any read."""
    level = require(isa)
    q = call.q
    T, H, D = q.shape
    o = call.out if call.out is not None and call.out.is_contiguous() else torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32)
    (win, wslots, wpage), *rest = call.sets
    cache2, slots2, page2 = rest[0] if rest else (None, None, 1)
    code = engine_code(attention_engine(level) if engine is None else engine)
    op_namespace(level).native_v4_slot_attention(
        q, win, wslots, int(wpage), cache2, slots2, int(page2), call.sink,
        float(call.softmax_scale), 0, code, o, lse,
    )  # fmt: skip
    if call.out is not None and o is not call.out:
        call.out.copy_(o)
        return call.out
    return o
