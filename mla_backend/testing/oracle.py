"""Teacher-forced oracle log-probs of a transformers model for many served requests at once
(the engines' server tests check every generated token against them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


@torch.no_grad()
def teacher_forced_logprobs(
    model: Any, requests: Sequence[tuple[list[int], list[int]]], batch: int = 16, pad_id: int = 3
) -> list[torch.Tensor]:
    """Log-probs of each request's generated tokens given its prompt and the tokens before.

    Right-padded batches of similar lengths (causal: padding after a sequence cannot change its
    logits), one forward per batch instead of one per request.

    Args:
        model: a causal LM returning ``.logits`` [B, L, vocab].
        requests: (prompt ids, generated ids) per request.
    Returns:
        entry i: float32 [len(generated_i), vocab] log-softmax rows.
    """
    order = sorted(range(len(requests)), key=lambda i: sum(map(len, requests[i])))
    out: list[torch.Tensor] = [torch.empty(0)] * len(requests)
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        seqs = [requests[i][0] + requests[i][1] for i in idx]
        width = max(len(q) for q in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, q in enumerate(seqs):
            ids[r, : len(q)] = torch.tensor(q)
            mask[r, : len(q)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        for r, i in enumerate(idx):
            p, n = len(requests[i][0]), len(requests[i][1])
            out[i] = torch.log_softmax(logits[r, p - 1 : p - 1 + n], dim=-1)
    return out
