"""DeepSeek-V4's attention at the layer level, engine-neutral: the three layer kinds as cases of
the key-set primitive (:func:`mla_backend.keyset_attention`).

V4 attends, per query token at position p, with every head over one 512-wide row per key (the
row is key and value: shared-K=V MQA; RoPE'd on its last 64 values) and a learned per-head sink::

    sliding (ratio 0):  keys = window rows p-W+1 .. p                     (W = 128)
    CSA (ratio 4):      keys = window rows + the compressed entries the indexer selected
    HCA (ratio 128):    keys = window rows + every visible compressed entry (w < (p + 1) // m)
    o = sum_k softmax_k(q . k * scale ; sink) * k          (scale = 512^-1/2)
    o[..., -64:] = RoPE^-1_p(o[..., -64:])                  (the value carried RoPE)

The engine projects and rotates q (``q_b`` -> per-head RMSNorm -> RoPE) and the key rows
(``kv_norm(kv_proj(x))`` -> RoPE), writes rows into the window cache (``write_latent``), runs the
compressor (:mod:`mla_backend.compressor`) into the compressed cache, and applies ``wo_a`` /
``wo_b`` to the result. This module owns what is between: the key sets and the output rotation.
"""

from __future__ import annotations

import torch

from .dims import MLADims
from .keyset import KeyCache, keyset_attention
from .ops import KernelImpl, V4SlotCall
from .plan import MLAPlan
from .rope import rope_interleaved
from .selection import get_impl
from .v4_cache import V4_HEAD_DIM, V4_ROW_DTYPES, check_v4_cache

__all__ = ["v4_attention", "v4_attention_slots", "v4_dims", "visible_entries"]

def v4_dims(num_heads: int, head_dim: int = 512, rope_dim: int = 64) -> MLADims:
    """The :class:`MLADims` of a V4 attention layer for :func:`mla_backend.plan`: the row's
    first ``head_dim - rope_dim`` values play the latent ``c_kv`` (width r), the last
    ``rope_dim`` the shared ``k_pe``; the value is the whole row."""
    return MLADims(
        num_heads=num_heads, kv_lora_rank=head_dim - rope_dim, qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim, v_head_dim=head_dim,
    )  # fmt: skip


def visible_entries(positions: torch.Tensor, ratio: int, max_entries: int) -> torch.Tensor:
    """HCA's compressed key set: [T, max_entries] int32, row t = ``0 .. (p_t + 1) // ratio - 1``
    then -1 (``positions`` [T]: the tokens' positions; ``max_entries`` >= every request's entry
    count, a host int, e.g. ``max(kv_lens) // ratio``)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"compression ratio={ratio!r} is not supported: an int >= 1")
    n = (positions.long() + 1) // ratio
    w = torch.arange(max(max_entries, 1), device=positions.device)
    idx = w.expand(positions.shape[0], -1)
    return torch.where(idx < n.unsqueeze(1), idx, -1).int()


def v4_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    sink: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    compressed: KeyCache | None = None,
    compressed_indices: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One V4 attention layer's core for a step.

    Args:
        q: [T, H, D] bf16 / fp16 / fp32 queries, normalized and RoPE'd (D = 512 in V4).
        kv_cache: [pages, page_size, D] the window rows (the plan's block table; bf16 / fp16 /
            fp32 or per-tensor fp8 with ``kv_scale``).
        plan: the step's plan from ``mb.plan(batch, v4_dims(H, D), window=W)``.
        sink: [H] float32 per-head sink logits.
        cos_sin: [P, rope] float, the layer's RoPE table (cos of each pair, then sin); rope =
            ``plan.dims.qk_rope_head_dim``.
        positions: [T] int32 / int64 the tokens' positions.
        compressed: the compressed entries' cache (CSA / HCA layers; the window cache's row
            format), with its block table and per-request entry counts.
        compressed_indices: [T, k] int32 / int64 entries per token, -1 = none (CSA: the
            indexer's top-k; HCA: :func:`visible_entries`).
        softmax_scale: default ``D ** -0.5``.
    Returns:
        o [T, H, D] in q's dtype, its last ``rope`` values rotated back to position 0.
    """
    rope = plan.dims.qk_rope_head_dim
    D = q.shape[-1]
    if q.dim() != 3 or D != plan.dims.kv_lora_rank + rope:
        raise ValueError(
            f"q {tuple(q.shape)} is not supported: [T, H, {plan.dims.kv_lora_rank + rope}] "
            "(the plan's v4_dims)"
        )
    if cos_sin.dim() != 2 or cos_sin.shape[1] != rope:
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} is not supported: [positions, {rope}]")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions {tuple(positions.shape)}: expected [T={q.shape[0]}]")
    if plan.window is None:
        raise ValueError("the plan has no window: make it with mb.plan(..., window=W)")
    o, _ = keyset_attention(
        q[..., : D - rope], q[..., D - rope :], kv_cache, plan,
        D**-0.5 if softmax_scale is None else softmax_scale, kv_scale, causal_range=True,
        extra=compressed, extra_indices=compressed_indices, sink=sink, value_is_key=True,
    )  # fmt: skip
    return rope_interleaved(o, cos_sin, positions, inverse=True)


def v4_attention_slots(
    q: torch.Tensor,
    sets: list[tuple[torch.Tensor, torch.Tensor, int]],
    sink: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    impl: str | KernelImpl | None = None,
) -> torch.Tensor:
    """V4 attention over key sets given as flat slots of caches in V4's fp8 page layout
    (:mod:`mla_backend.v4_cache`): the contract of vLLM's CPU V4 attention op
    (``flash_mla_with_kvcache_cpu``: window slots and compressed slots per token). One softmax
    over every distinct row each token lists in every set and the sink, the row being key and
    value; the seam's ``v4_slot_attention`` (native: the rows read in place, a tile at a time).

    Args:
        q: [T, H, 512] bf16 / fp16 / fp32 queries (normalized and RoPE'd).
        sets: per cache ``(cache, slots, page_size)`` (one or two: the window cache, then the
            compressed one): ``cache`` uint8 [pages, >= page bytes] in V4's page layout,
            ``slots`` [T, k] int32 / int64 flat slots ``page * page_size + offset`` (-1 = none;
            a slot listed twice counts once).
        sink: [H] float32 per-head sink logits.
        softmax_scale: scale of ``q·k``.
        out: optional [T, H, 512] buffer of q's dtype.
        impl: kernel implementation override (default: the device's).
    Returns:
        o [T, H, 512] (no output rotation: the caller applies V4's inverse RoPE); a token with
        no listed row gets 0.
    """
    if q.dim() != 3 or q.shape[-1] != V4_HEAD_DIM or q.dtype not in V4_ROW_DTYPES:
        raise ValueError(
            f"q {q.dtype} {tuple(q.shape)} is not supported: [T, H, {V4_HEAD_DIM}] of "
            f"{', '.join(str(d) for d in V4_ROW_DTYPES)}"
        )
    T, H, _ = q.shape
    if not 1 <= len(sets) <= 2:
        raise ValueError(f"{len(sets)} cache sets are not supported: the window cache's, then "
                         "optionally the compressed cache's")  # fmt: skip
    checked = []
    for cache, slots, page_size in sets:
        check_v4_cache(cache, page_size)
        if slots.dim() != 2 or slots.shape[0] != T or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"slots {slots.dtype} {tuple(slots.shape)} are not supported: [T={T}, k] "
                "int32 / int64"
            )
        pages = cache if cache.dim() == 2 else cache.view(cache.shape[0], -1)
        checked.append((pages, slots, int(page_size)))
    if sink.dtype != torch.float32 or tuple(sink.shape) != (H,):
        raise ValueError(f"sink {sink.dtype} {tuple(sink.shape)} is not supported: [H={H}] float32")
    if out is not None and (
        out.dtype != q.dtype or tuple(out.shape) != tuple(q.shape) or out.device != q.device
    ):
        raise ValueError(
            f"out {out.dtype} {tuple(out.shape)} on {out.device}: expected {tuple(q.shape)} "
            f"{q.dtype} on {q.device}"
        )
    call = V4SlotCall(q, tuple(checked), sink, float(softmax_scale), out)
    with torch.no_grad():
        return get_impl(q.device, impl).v4_slot_attention(call)
