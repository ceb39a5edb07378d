"""Translate SGLang's ``ForwardBatch`` into the core's engine-neutral :class:`mla_backend.MLABatch`.

SGLang keeps one row of token slots per request (``req_to_token[req_pool_idx, pos] = slot``);
with page size ``P`` the slots of one page are contiguous and page-aligned, so logical page
``j`` of a request is physical page ``req_to_token[req, j * P] // P``. The MLA token pool
buffer ``[num_slots, 1, r + rope]`` viewed as ``[num_slots // P, P, r + rope]`` is then exactly
the core's paged latent cache.

Per forward mode (what the query rows are, what is already cached):

- DECODE: one new token per request; ``seq_lens`` includes it, so prefix = seq_lens - 1.
- EXTEND / MIXED / SPLIT_PREFILL / DRAFT_EXTEND_V2: ``extend_prefix_lens`` cached tokens and
  ``extend_seq_lens`` new tokens per request (a MIXED batch's decodes are extends of 1).
- TARGET_VERIFY: ``seq_lens`` cached tokens and ``spec_info.num_tokens_per_req`` draft tokens
  per request, causal among themselves (a linear chain: EAGLE topk = 1).
- IDLE: no requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import mla_backend as mb


def _host_ints(
    cpu_list: Sequence[int] | torch.Tensor | None, dev: torch.Tensor | None
) -> list[int]:
    """Python ints from the host copy when SGLang has one, else from the device tensor."""
    if cpu_list is not None:
        if isinstance(cpu_list, torch.Tensor):
            return [int(v) for v in cpu_list.tolist()]
        return [int(v) for v in cpu_list]
    if dev is None:
        raise ValueError("ForwardBatch is missing the lengths this forward mode needs")
    return [int(v) for v in dev.tolist()]


def phase_of(forward_mode: Any) -> mb.Phase:
    """Map SGLang's ``ForwardMode`` to :class:`mla_backend.Phase`."""
    if forward_mode.is_idle():
        return mb.Phase.IDLE
    if forward_mode.is_decode():
        return mb.Phase.DECODE
    if forward_mode.is_target_verify():
        return mb.Phase.TARGET_VERIFY
    if forward_mode.is_draft_extend_v2():
        return mb.Phase.DRAFT_EXTEND
    if forward_mode.is_mixed():
        return mb.Phase.MIXED
    if forward_mode.is_extend():
        return mb.Phase.EXTEND
    raise ValueError(f"SGLang forward mode {forward_mode!r} is not supported by mla_absorb")


def request_lengths(forward_batch: Any) -> tuple[list[int], list[int], mb.Phase]:
    """(prefix_lens, new_lens, phase) of a ForwardBatch, as python ints."""
    mode = forward_batch.forward_mode
    phase = phase_of(mode)
    if phase is mb.Phase.IDLE:
        return [], [], phase
    seq = _host_ints(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
    bs = forward_batch.batch_size
    seq = seq[:bs]
    if phase is mb.Phase.DECODE:
        return [s - 1 for s in seq], [1] * len(seq), phase
    if phase is mb.Phase.TARGET_VERIFY:
        spec = forward_batch.spec_info
        n = int(getattr(spec, "num_tokens_per_req", 0) or 0)
        if n <= 0:
            n = int(getattr(spec, "draft_token_num", 0) or 0)
        if n <= 0:
            raise ValueError("TARGET_VERIFY batch without a draft token count in spec_info")
        return seq, [n] * len(seq), phase
    prefix = _host_ints(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
    new = _host_ints(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
    return prefix[:bs], new[:bs], phase


def block_table_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    max_kv_len: int,
    page_size: int,
) -> torch.Tensor:
    """[B, ceil(max_kv_len / page_size)] physical page ids of each request's logical pages.

    Args:
        req_to_token: [max_reqs, max_context_len] int32 token slots (SGLang's table).
        req_pool_indices: [B] rows of the batch's requests.
    Returns:
        int64 tensor on req_to_token's device (columns past a request's length are unused).
    """
    n_pages = max(1, -(-max_kv_len // page_size))
    rows = req_pool_indices.to(device=req_to_token.device, dtype=torch.long)
    slots = req_to_token[rows, : n_pages * page_size : page_size].to(torch.long)
    return slots // page_size if page_size > 1 else slots


def build_mla_batch(
    forward_batch: Any, req_to_token: torch.Tensor, page_size: int
) -> mb.MLABatch:
    """The core's batch description of one SGLang forward."""
    prefix, new, phase = request_lengths(forward_batch)
    if phase is mb.Phase.IDLE or not new:
        empty = torch.zeros(0, 1, dtype=torch.long, device=req_to_token.device)
        return mb.MLABatch.build([], [], empty, page_size, mb.Phase.IDLE)
    max_kv = max(p + n for p, n in zip(prefix, new, strict=True))
    table = block_table_from_req_to_token(
        req_to_token, forward_batch.req_pool_indices[: len(new)], max_kv, page_size
    )
    return mb.MLABatch.build(prefix, new, table, page_size, phase)
