"""Merging two partial attention results over disjoint key sets through their log-sum-exps."""

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
