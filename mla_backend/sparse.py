"""Public entry points of DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): the lightning
indexer's key-cache write, its logits and causal top-k, and the sparse absorbed attention.

Plan the step once with the model's indexer dims (``mb.plan(batch, dims, policy,
indexer=IndexerDims(n_heads, head_dim, topk))``), then per layer::

    write_index_keys(index_cache, k_I, slot_mapping)           # the new tokens' keys
    idx = indexer_topk(q_I, weights, index_cache, plan, topk)  # [T, topk] int32
    o_lat, lse = sparse_absorbed_attention(q_lat, q_pe, kv_cache, plan, idx, softmax_scale)

The index cache shares the plan's block table and page size with the latent cache (vLLM keeps
both in one KV-cache group). The plan's policy choice says which requests need the sparse path
(``plan.choice.use_sparse``, ``plan.choice.sparse_mode``: "dense" when every context fits in
``topk``, then the dense paths give the same attention and only the keys need writing). Where
a model's config sets ``scale_fmt`` (vLLM then rounds the key scales up to powers of two),
pass ``IndexCacheLayout.named("fp8", 128, 128, scale_fmt="ue8m0")`` as ``layout``.
Inputs are validated here, once, naming the bad value and what is
supported; the kernels come from the plan's implementation (the device seam); no call reads
tensor data on the host.

``weights`` carries every scale of the score, so the kernels compute exactly
``I[s, t] = sum_h weights[s, h] * relu(q_I[s, h] . k_I[t])`` (``k_I[t]`` as the cache reads it
back: e4m3 x its scale for the fp8 cache). How callers fold their model's scales in:

- vLLM (``DeepseekV32Indexer``): q_I = the e4m3 ``q_fp8`` of ``per_token_group_quant_fp8``
  (one group per head at Di = quant block 128), and weights = vLLM's own ``weights``:
  ``weights_proj(h) * q_scale * Di ** -0.5 * Hi ** -0.5`` ([T, Hi] float32);
- transformers (``DeepseekV32Indexer``, unquantized): q_I = q in the model dtype (bf16 /
  fp32) and ``weights = weights_proj(h).float() * Hi ** -0.5 * Di ** -0.5`` (its
  ``softmax_scale`` multiplies the scores before the weighted sum; every factor is positive,
  so it moves through the relu).

Top-k rule (every implementation, exactly): per query token at position ``prefix + j`` the
candidates are positions ``0 .. prefix + j`` of its request; larger logit first, a tie to the
lower position, ``-0.0 == +0.0``, a NaN logit below every number; the ``min(topk, visible)``
best, in ascending position order, then ``-1`` padding.
"""

from __future__ import annotations

import torch

from .cache_layout import CacheLayout
from .checks import check_devices, check_scale, check_slots, check_step
from .fp8 import FP8_DTYPE
from .index_cache import IndexCacheLayout
from .ops import AbsorbedCall, IndexerCall, IndexKeyWrite, KernelImpl, SparseCall
from .parts import SparsePart
from .plan import MLAPlan
from .selection import get_impl

#: dtypes of the indexer's queries (e4m3: vLLM's quantized q, its scale folded into weights)
INDEX_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)

__all__ = [
    "INDEX_Q_DTYPES",
    "indexer_logits",
    "indexer_topk",
    "sparse_absorbed_attention",
    "write_index_keys",
]


def _index_layout(
    index_cache: torch.Tensor, head_dim: int, layout: IndexCacheLayout | None
) -> IndexCacheLayout:
    """Validate an index cache [num_pages, page_size, W] and return its layout."""
    if layout is None:
        layout = IndexCacheLayout.of(index_cache, head_dim)
    elif not isinstance(layout, IndexCacheLayout):
        raise ValueError(f"layout={layout!r} is not an IndexCacheLayout")
    if layout.index_head_dim != head_dim:
        raise ValueError(
            f"the keys / queries have {head_dim} values but the layout's index_head_dim is "
            f"{layout.index_head_dim}"
        )
    if index_cache.dtype != layout.dtype:
        raise ValueError(f"index cache dtype {index_cache.dtype} != the layout's {layout.dtype}")
    if index_cache.dim() != 3 or index_cache.shape[-1] != layout.width:
        raise ValueError(
            f"index cache shape {tuple(index_cache.shape)} is not supported: expected "
            f"[num_pages, page_size, {layout.width}] for a {layout.kind} cache of "
            f"index_head_dim {head_dim}"
        )
    P, ps, W = index_cache.shape
    if index_cache.stride(2) != 1 or index_cache.stride(1) != W or index_cache.stride(0) < ps * W:
        raise ValueError(
            f"index cache strides {index_cache.stride()} are not supported: each page must be "
            f"contiguous ([.., {W}, 1] strides, page stride >= {ps * W})"
        )
    if layout.kind == "fp8" and index_cache.stride(0) % 4:
        raise ValueError(
            f"fp8 index cache page stride {index_cache.stride(0)} must be a multiple of 4 bytes "
            "(float32 scales)"
        )
    return layout


def write_index_keys(
    index_cache: torch.Tensor,
    k_I: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: IndexCacheLayout | None = None,
    impl: str | KernelImpl | None = None,
) -> None:
    """Write the indexer keys of T tokens into the paged index cache (slot < 0: padding,
    skipped).

    Args:
        index_cache: uint8 [num_pages, page_size, Di + 4 Di / quant_block] (vLLM's fp8 layout,
            :mod:`mla_backend.index_cache`) or bf16 / fp16 / fp32 [num_pages, page_size, Di],
            in place.
        k_I: [T, Di] bf16 / fp16 / fp32 keys (after the indexer's LayerNorm and RoPE).
        slot_mapping: [>= T] int32 / int64 flat slot per token (on the cache's device, as
            ``k_I``); a slot ``>= num_pages * page_size`` is refused
            (:func:`mla_backend.checks.check_slots`).
        layout: the cache's :class:`IndexCacheLayout` (default: from the tensor, quant block
            128, plain amax scales; pass ``IndexCacheLayout.named(..., scale_fmt="ue8m0")`` for
            power-of-two scales).
        impl: kernel implementation override (default: the device's).
    """
    if k_I.dim() != 2 or k_I.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"k_I of shape {tuple(k_I.shape)} and dtype {k_I.dtype} is not supported: [T, Di] "
            "bfloat16 / float16 / float32"
        )
    lay = _index_layout(index_cache, k_I.shape[1], layout)
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.dim() != 1:
        raise ValueError(
            f"slot_mapping {slot_mapping.dtype} {tuple(slot_mapping.shape)} is not supported: "
            "[>= T] int32 / int64"
        )
    if slot_mapping.shape[0] < k_I.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {k_I.shape[0]} keys"
        )
    check_devices(index_cache.device, "the index cache", k_I=k_I, slot_mapping=slot_mapping)
    check_slots(
        slot_mapping, k_I.shape[0], index_cache.shape[0] * index_cache.shape[1], "index cache"
    )
    with torch.no_grad():
        get_impl(index_cache.device, impl).write_index_keys(
            IndexKeyWrite(index_cache, lay, k_I, slot_mapping)
        )


def _sparse_of(plan: MLAPlan) -> SparsePart:
    if not isinstance(plan, MLAPlan):
        raise ValueError(f"DSA calls take the step's MLAPlan, got {type(plan).__name__}")
    if plan.sparse is None:
        raise ValueError(
            "this plan has no DSA data: make it with mb.plan(batch, dims, policy, "
            "indexer=IndexerDims(n_heads, head_dim, topk))"
        )
    return plan.sparse


def _check_indexer(
    q_I: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, plan: MLAPlan,
    layout: IndexCacheLayout | None,
) -> tuple[IndexCacheLayout, SparsePart, torch.Tensor]:  # fmt: skip
    """Validate an indexer call; returns (the index cache's layout, the plan's DSA part, the
    weights with a contiguous last dim)."""
    sparse = _sparse_of(plan)
    if q_I.dim() != 3 or q_I.dtype not in INDEX_Q_DTYPES:
        raise ValueError(
            f"q_I of shape {tuple(q_I.shape)} and dtype {q_I.dtype} is not supported: "
            "[T, Hi, Di] bfloat16 / float16 / float32 / float8_e4m3fn"
        )
    T, Hi, Di = q_I.shape
    if T != plan.num_tokens:
        raise ValueError(f"q_I holds {T} tokens but the plan describes {plan.num_tokens}")
    if q_I.stride(2) != 1:
        raise ValueError(f"q_I's last dim must be contiguous, got strides {q_I.stride()}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (T, Hi):
        raise ValueError(
            f"weights {weights.dtype} {tuple(weights.shape)} is not supported: [T={T}, "
            f"Hi={Hi}] float32 (every scale folded in: see mla_backend.sparse)"
        )
    lay = _index_layout(index_cache, Di, layout)
    R = sparse.ratio
    if index_cache.shape[1] * R != plan.page_size:
        raise ValueError(
            f"index cache page size {index_cache.shape[1]} != the plan's page_size "
            f"{plan.page_size}" + (f" / compress_ratio {R}" if R > 1 else "")
        )
    if plan.max_page_id >= index_cache.shape[0]:
        raise ValueError(
            f"block_table holds page id {plan.max_page_id} for a used page, but the index cache "
            f"has {index_cache.shape[0]} pages (valid ids 0..{index_cache.shape[0] - 1})"
        )
    check_devices(plan.device, "the plan", q_I=q_I, weights=weights, index_cache=index_cache)
    if Hi > 1 and weights.stride(1) != 1:  # any strides: the kernels read contiguous rows
        weights = weights.contiguous()
    return lay, sparse, weights


def indexer_logits(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    plan: MLAPlan,
    layout: IndexCacheLayout | None = None,
) -> torch.Tensor:
    """The lightning indexer's scores (mainly for tests and benchmarks; the serving path calls
    :func:`indexer_topk`).

    Args:
        q_I: [T, Hi, Di] bf16 / fp16 / fp32 / float8_e4m3fn (T == plan.num_tokens).
        weights: [T, Hi] float32, every scale folded in (module docstring); any strides.
        index_cache: the paged index cache (:func:`write_index_keys`), already holding every
            request's keys, read through the plan's block table.
        plan: the step's plan, made with ``indexer=``.
    Returns:
        float32 [T, max_kv_len]: ``I[s, t] = sum_h weights[s, h] * relu(q_I[s, h] . k_I[t])``
        for t <= the token's position, -inf elsewhere.
    """
    lay, sparse, weights = _check_indexer(q_I, weights, index_cache, plan, layout)
    with torch.no_grad():
        return plan.impl.indexer_logits(
            IndexerCall(q_I, weights, index_cache, lay, plan.step, sparse)
        )


def indexer_topk(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    plan: MLAPlan,
    topk: int,
    layout: IndexCacheLayout | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal top-k per query token (the rule of the module docstring; no full sort).

    Args: as :func:`indexer_logits`, and
        topk: tokens per query token (``index_topk``), an int >= 1.
        out: optional [T, topk] int32 contiguous buffer for the result.
    Returns:
        [T, topk] int32: logical positions within each token's request (0-based), ascending,
        ``min(topk, visible)`` of them, then -1.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r} is not supported: it must be an int >= 1")
    lay, sparse, weights = _check_indexer(q_I, weights, index_cache, plan, layout)
    T = q_I.shape[0]
    if out is not None and (
        out.dtype != torch.int32 or tuple(out.shape) != (T, topk) or not out.is_contiguous()
    ):
        raise ValueError(
            f"out {out.dtype} {tuple(out.shape)} is not supported: [T={T}, topk={topk}] int32, "
            "contiguous"
        )
    with torch.no_grad():
        return plan.impl.indexer_topk(
            IndexerCall(q_I, weights, index_cache, lay, plan.step, sparse, topk, out)
        )


def sparse_absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA where each query token attends only to the latent rows of its own index list.

    Args:
        q_lat: [T, H, r] = ``q_nope · W_UK``; q_pe: [T, H, rope]; bf16 / fp16 / fp32.
        kv_cache: the latent cache, every layout the dense path reads (bf16 / fp16 / fp32,
            per-tensor fp8 with ``kv_scale``, uint8 ``fp8_ds_mla``).
        plan: the step's plan, made with ``indexer=``.
        indices: [T, k] int32 / int64: logical positions within each token's request (any
            order), -1 = no entry. A token attends to the *set* of its valid entries: a
            position listed more than once counts once (every implementation drops the
            repeats; no host read). An index >= the request's kv length
            (or < -1) is refused: the native CPU kernels raise naming it, before reading the
            cache; the torch / Triton paths refuse it with ``torch._assert_async`` (no host
            read: on the CPU it raises in the call, on a GPU it is a device-side assert that
            surfaces at the next synchronization).
        softmax_scale: scale of ``q·k``, a finite float > 0.
        kv_scale: float32 scalar tensor of a per-tensor fp8 cache.
        out / lse: optional [T, H, r] (q's dtype) / [T, H] float32 contiguous outputs.
    Returns:
        (o_lat [T, H, r] in q's dtype, lse [T, H] float32, natural log); a token with no valid
        index gets o = 0, lse = -inf. Non-finite inputs: as
        :func:`mla_backend.absorbed_attention` (that token's result unspecified, no other).
    """
    sparse = _sparse_of(plan)
    layout: CacheLayout = check_step(
        q_lat, q_pe, kv_cache, plan, q_lat.shape[-1] + q_pe.shape[-1], kv_scale
    )
    if q_lat.shape[-1] != plan.dims.kv_lora_rank:
        raise ValueError(f"q_lat width {q_lat.shape[-1]} != kv_lora_rank {plan.dims.kv_lora_rank}")
    check_scale(softmax_scale)
    check_devices(kv_cache.device, "the cache", indices=indices, out=out, lse=lse)
    T, H, r = q_lat.shape
    if indices.dim() != 2 or indices.shape[0] != T or indices.dtype not in (torch.int32,
                                                                              torch.int64):
        raise ValueError(
            f"indices {indices.dtype} {tuple(indices.shape)} is not supported: [T={T}, k] "
            "int32 / int64"
        )
    if out is not None and (
        out.dtype != q_lat.dtype or tuple(out.shape) != (T, H, r) or not out.is_contiguous()
    ):
        raise ValueError(f"out {out.dtype} {tuple(out.shape)}: expected [{T}, {H}, {r}] "
                         f"{q_lat.dtype}, contiguous")
    if lse is not None and (
        lse.dtype != torch.float32 or tuple(lse.shape) != (T, H) or not lse.is_contiguous()
    ):
        raise ValueError(f"lse {lse.dtype} {tuple(lse.shape)}: expected [{T}, {H}] float32, "
                         "contiguous")
    with torch.no_grad():
        attn = AbsorbedCall(q_lat, q_pe, kv_cache, layout, plan.step, softmax_scale, kv_scale,
                            out, lse)  # fmt: skip
        return plan.impl.sparse_absorbed_attention(SparseCall(attn, sparse, indices))
