"""Thin Python wrappers of the native ``torch.library`` ops (registered by
:mod:`mla_backend.ops.native.build`): shapes and dtypes in, the op's outputs back. The device seam's
native implementation (:mod:`mla_backend.ops.native.kernels`) calls these.

Every wrapper takes ``isa``: the ISA level whose build runs the op (``torch.ops.mla_backend_<isa>``;
None = :func:`mla_backend.ops.native.build.selected_isa`), so several levels serve one process."""

from __future__ import annotations

import torch

from .build import _state, op_namespace, require
from .engine import attention_engine, engine_code


def simd_level(isa: str | None = None) -> str:
    """'avx512_bf16' when level ``isa``'s build has the bf16 engine, else 'fp32'."""
    st = _state(require(isa))
    if "simd" not in st:  # asked on every normal-path call: read the build once
        st["simd"] = "avx512_bf16" if op_namespace(isa).native_simd_info() else "fp32"
    return st["simd"]


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    num_kv_splits: int = 0,
    max_page_id: int = -1,
    *,
    isa: str | None = None,
    engine: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention (MQA over the paged latent cache), decode or extend.

    Args:
        q_lat: [T, H, r] bf16/fp16/fp32 (last dim contiguous; may be a strided view).
        q_pe: [T, H, rope], q_lat's dtype (rope may be 0).
        kv_cache: [num_pages, page_size, r + rope], q's dtype or float8_e4m3fn; row =
            [c_kv ; k_pe]; value = its first r columns. Or uint8 [num_pages, page_size, W]:
            ``fp8_ds_mla`` rows, W = ``CacheLayout.ds_mla(r, rope, q_lat.dtype).width`` (656
            at r 512, rope 64, bf16); value = the dequantized c_kv.
        block_table: [B, max_pages] int32, physical page of each logical page.
        cu_seqlens_q: [B + 1] int32; request i owns query rows cu[i]:cu[i+1] (may be empty).
        kv_lens: [B] int32, cached tokens of request i (prefix + new), >= its new tokens.
        softmax_scale: float > 0.
        kv_scale: float32 0-d tensor; cached value = stored * kv_scale (None = 1.0; ignored for
            ``fp8_ds_mla``, whose scales are in the rows).
        num_kv_splits: kv splits per request (0 = the kernel chooses).
        max_page_id: the largest page id any request uses (the plan's; checked in O(1)
            against the cache's page count), or -1: the op checks every used block_table entry.
        isa: the ISA level that runs it (None: the selected level).
        engine: the compute engine (``ENGINES`` of :mod:`mla_backend.ops.native.engine`;
            None: its rule's pick for the level and CPU, ``attention_engine``).

    Returns:
        o_lat: [T, H, r] in q's dtype; lse: [T, H] float32 (natural log).

    Query row j of request i sits at position kv_len_i - n_i + j and attends causally to kv
    positions 0 .. kv_len_i - n_i + j. Scores and softmax are fp32.
    """
    level = require(isa)
    code = engine_code(attention_engine(level) if engine is None else engine)
    return op_namespace(level).native_absorbed_attention(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        cu_seqlens_q,
        kv_lens,
        float(softmax_scale),
        kv_scale,
        int(num_kv_splits),
        int(max_page_id),
        code,
    )


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    isa: str | None = None,
) -> None:
    """Write ``[c_kv ; k_pe]`` into the paged cache, in place.

    Args:
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
    """
    op_namespace(isa).native_write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale)


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


def indexer_topk(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    quant_block_size: int,
    topk: int,
    max_page_id: int = -1,
    out: torch.Tensor | None = None,
    *,
    isa: str | None = None,
) -> torch.Tensor:
    """The DSA indexer's causal top-k per query token (``csrc/indexer.cpp``).

    Args:
        q_I: [T, Hi, Di] bf16 / fp16 / fp32 / float8_e4m3fn, last dim contiguous.
        weights: [T, Hi] float32 (every scale folded in).
        index_cache: uint8 [pages, page_size, Di + 4 Di / quant_block_size] (vLLM's fp8 index
            cache) or bf16 / fp16 / fp32 [pages, page_size, Di]; pages contiguous.
        block_table / cu_seqlens_q / kv_lens: as :func:`absorbed_attention`; query row j of
            request i sits at position kv_len - n + j and sees positions <= it.
        quant_block_size: values per scale (fp8 cache).
        topk: positions per token; out: optional [T, topk] int32 contiguous.
    Returns:
        [T, topk] int32: the best ``min(topk, visible)`` positions (rank rule of
        :mod:`mla_backend.ops.indexer`), ascending, then -1.
    """
    if out is None:
        out = torch.empty(q_I.shape[0], topk, dtype=torch.int32)
    op_namespace(isa).native_indexer_topk(
        q_I, weights, index_cache, block_table, cu_seqlens_q, kv_lens, int(quant_block_size),
        int(topk), int(max_page_id), out,
    )  # fmt: skip
    return out


def indexer_logits(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    quant_block_size: int,
    width: int,
    max_page_id: int = -1,
    *,
    isa: str | None = None,
) -> torch.Tensor:
    """The DSA indexer's scores, float32 [T, width] (-inf where a token does not see the
    position); arguments as :func:`indexer_topk`."""
    return op_namespace(isa).native_indexer_logits(
        q_I, weights, index_cache, block_table, cu_seqlens_q, kv_lens, int(quant_block_size),
        int(width), int(max_page_id),
    )  # fmt: skip


def sparse_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    indices: torch.Tensor,
    token_req: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    max_page_id: int = -1,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    *,
    isa: str | None = None,
    engine: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSA's sparse absorbed attention (``csrc/sparse_attention.cpp``): q_lat [T, H, r], q_pe
    [T, H, rope], the latent cache in any layout :func:`absorbed_attention` reads, indices
    [T, k] int32 (logical positions of the token's request, -1 = none), token_req [T] int32
    (each token's request) -> (o_lat [T, H, r] in q's dtype, lse [T, H] float32). An index
    >= its request's kv length (or < -1) raises RuntimeError naming it, before any read."""
    level = require(isa)
    T, H, r = q_lat.shape
    o = out if out is not None else torch.empty(T, H, r, dtype=q_lat.dtype)
    l = lse if lse is not None else torch.empty(T, H, dtype=torch.float32)
    code = engine_code(attention_engine(level) if engine is None else engine)
    op_namespace(level).native_sparse_attention(
        q_lat, q_pe, kv_cache, block_table, cu_seqlens_q, kv_lens, indices, token_req,
        float(softmax_scale), kv_scale, int(max_page_id), code, o, l,
    )  # fmt: skip
    return o, l


def keyset_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    causal_range: bool = True,
    window: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    cache2: torch.Tensor | None = None,
    block_table2: torch.Tensor | None = None,
    lens2: torch.Tensor | None = None,
    indices2: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    max_page_id: int = -1,
    num_kv_splits: int = 0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    isa: str | None = None,
    engine: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention over key sets (``csrc/keyset_attention.cpp``; the semantics of
    :mod:`mla_backend.ops.keyset`): q_lat [T, H, r], q_pe [T, H, rope], the main cache in any
    layout :func:`absorbed_attention` reads with block_table / cu_seqlens_q / kv_lens as there;
    ``causal_range`` with ``window`` [B] int32 sizes (None: from 0), ``indices`` [T, k] int32
    positions of the main cache, ``cache2`` (the main cache's row format) with
    ``block_table2`` [B, pages2], ``lens2`` [B] and ``indices2`` [T, k2], ``sink`` [H] float32
    -> (o_lat [T, H, r] in q's dtype, lse [T, H] float32, the sink included). A bad window,
    index or used page id raises RuntimeError naming it, before any read."""
    level = require(isa)
    T, H, r = q_lat.shape
    o = out if out is not None else torch.empty(T, H, r, dtype=q_lat.dtype)
    l = lse if lse is not None else torch.empty(T, H, dtype=torch.float32)
    code = engine_code(attention_engine(level) if engine is None else engine)
    op_namespace(level).native_keyset_attention(
        q_lat, q_pe, kv_cache, block_table, cu_seqlens_q, kv_lens, bool(causal_range), window,
        indices, cache2, block_table2, lens2, indices2, sink, float(softmax_scale), kv_scale,
        int(max_page_id), int(num_kv_splits), code, o, l,
    )  # fmt: skip
    return o, l
