"""Merging partial attention results over disjoint key sets through their log-sum-exps: two
partials (:func:`merge_attention_states`, the normal path's prefix chunks) or any number of
shards (:func:`merge_attention_shards`, a context-parallel group's ranks)."""

from __future__ import annotations

import torch


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax-attention outputs computed over two disjoint key sets.

    Args:
        o_a, o_b: [T, H, D] partial outputs (each normalized over its own keys).
        lse_a, lse_b: [T, H] float32 natural-log sum of exp(scores) over each key set;
            ``-inf`` where a set was empty.
    Returns:
        (o [T, H, D] in o_a's dtype, lse [T, H] float32) over the union of the key sets.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    o = o_a.float() * w_a + o_b.float() * w_b
    return o.to(o_a.dtype), lse


def merge_attention_shards(
    o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine S partial attention outputs over disjoint key sets (one per shard).

    Shard s contributes with weight ``exp(lse[s] - lse_total)``; an empty shard (``lse``
    ``-inf``) contributes nothing, whatever its ``o`` holds (never a NaN from ``0 * inf``);
    a row whose every shard is empty comes out as zeros with ``lse`` ``-inf``.

    Args:
        o: [S, T, H, D] partial outputs, each normalized over its own keys (any float dtype;
            merged in float32).
        lse: [S, T, H] natural-log sum of exp(scores) of each shard, ``-inf`` where the shard
            holds no key for that row (NaN or ``+inf`` are treated as empty too).
        out_dtype: dtype of the merged output (default ``o``'s).
    Returns:
        (o [T, H, D] in ``out_dtype``, lse [T, H] float32) over the union of the key sets.
    """
    if o.dim() != 4 or lse.shape != o.shape[:3]:
        raise ValueError(
            f"shard outputs {tuple(o.shape)} and lses {tuple(lse.shape)} are not [S, T, H, D] "
            "and [S, T, H]"
        )
    lse = lse.float()
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("-inf")))
    top = lse.amax(0)  # [T, H]
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - top)  # [S, T, H]; 0 for empty shards
    total = w.sum(0)  # [T, H]
    merged_lse = torch.where(total > 0, torch.log(total) + top, torch.full_like(top, -torch.inf))
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    parts = torch.where(w.unsqueeze(-1) > 0, o.float(), torch.zeros((), device=o.device))
    merged = (parts * w.unsqueeze(-1)).sum(0)
    return merged.to(out_dtype or o.dtype), merged_lse
