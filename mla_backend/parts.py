"""The seam's input types: :class:`PlanPart` (the requests one kernel call serves, with their
host data and index tensors), :class:`WorkPartition` (how a kernel call is cut into programs),
:class:`StepShape` (the host facts plan-time calls see) and :class:`PlanState` (an
implementation's per-plan state).

Plain data, made by :mod:`mla_backend.plan` at plan time and read by every kernel
implementation (:mod:`mla_backend.ops`); this module sits below both and imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dims import MLADims
from .index_cache import IndexerDims


@dataclass(frozen=True)
class StepShape:
    """The host facts of one plan part that plan-time calls see.

    Attributes:
        dims: the layers' MLA dims.
        new_lens / kv_lens: per request, query tokens and prefix + query tokens.
        device: where the plan's tensors live.
        block_table: [n, max_pages] int32 on ``device`` (the part's requests).
        page_size: tokens per cache page.
    """

    dims: MLADims
    new_lens: Sequence[int]
    kv_lens: Sequence[int]
    device: torch.device
    block_table: torch.Tensor
    page_size: int


class PlanState:
    """An implementation's per-plan state of one part (made at plan time by its
    ``plan_state``). A refreshed plan (:meth:`mla_backend.MLAPlan.refresh_`) rewrites it in place
    from a new step's state of the same shape through :meth:`copy_`, so the addresses a
    captured graph reads stay."""

    def copy_(self, other: PlanState) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be refreshed in place")


@dataclass(frozen=True)
class WorkPartition:
    """How a kernel call is cut into independent programs: query blocks x KV splits.

    Attributes:
        block_q: new tokens of one request per query block.
        q_block_req: [W] int32, the request (index within the part) of each query block.
        q_block_start: [W] int32, its first new token (0-based within the request).
        num_kv_splits: KV splits per query block (their partial results are merged by LSE);
            for an implementation with a plan state, its programs along the split axis.
        state: the implementation's own per-plan state (:class:`PlanState`, made by its
            ``plan_state(step, block_q, num_kv_splits)``), or None when it keeps none.
    """

    block_q: int
    q_block_req: torch.Tensor
    q_block_start: torch.Tensor
    num_kv_splits: int
    state: PlanState | None = None


@dataclass(frozen=True, eq=False)
class PlanPart:
    """The requests of one step that one kernel call serves: the whole step, or the share of
    one path in a step the policy splits. Query rows are packed in request order.

    Host data (python ints; sizes outputs and drives the torch path's loops):
        dims: the step's MLA dims.
        reqs: indices of the part's requests in the step.
        prefix_lens: per request, tokens cached before this step.
        new_lens: per request, query tokens in this step.
        cu_new: [n + 1] prefix sums of ``new_lens``: request i owns rows cu_new[i]:cu_new[i+1]
            of the part's query tensors.
        pages: per request, the physical ids of the pages it uses (from the host block
            table), or None when the engine gave no host copy of the block table.
        max_page_id: the largest page id any request of the part uses (-1 if unknown or
            none): checked against the cache's page count at every entry point (O(1)), so
            the kernels bound-check page ids against it instead of re-scanning the table.
    Device data (int32, on the plan's device):
        rows: [num_tokens] int64 rows of the step's packed queries that belong to this part,
            or None when the part is the whole step (all rows, in order).
        block_table: [n, max_pages] physical page of each logical page (the engine's width:
            a fixed capacity, so a refreshed plan keeps its addresses).
        kv_lens_t: [n] prefix + new tokens.
        prefix_lens_t / new_lens_t: [n]; cu_new_t: [n + 1].
        work: the kernels' work partition.
    """

    dims: MLADims
    reqs: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    new_lens: tuple[int, ...]
    cu_new: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...] | None
    max_page_id: int
    rows: torch.Tensor | None
    block_table: torch.Tensor
    kv_lens_t: torch.Tensor
    prefix_lens_t: torch.Tensor
    new_lens_t: torch.Tensor
    cu_new_t: torch.Tensor
    work: WorkPartition

    @property
    def num_reqs(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return self.cu_new[-1]

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.prefix_lens, self.new_lens, strict=True))

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=0)

    @property
    def max_new_len(self) -> int:
        return max(self.new_lens, default=0)


@dataclass(frozen=True, eq=False)
class SparsePart:
    """A DSA step's per-token data for the indexer and the sparse attention (made by
    :func:`mla_backend.plan` when given ``indexer``), over the whole step (``MLAPlan.step``):
    query token ``t`` belongs to request ``token_req_t[t]`` and sits at logical position
    ``token_pos_t[t]`` (prefix + j), so it sees positions ``0 .. token_pos_t[t]``.

    Attributes:
        indexer: the model's :class:`~mla_backend.index_cache.IndexerDims`.
        token_req_t: [T] int32 request (index within the step) of each query token.
        token_pos_t: [T] int32 logical position of each query token.
        max_kv_len: the most keys a request has (host int; the logits' width): its kv length,
            over ``ratio`` with compressed keys.
        ratio: tokens per key (``indexer.compress_ratio``).
        token_last_t: [T] int32 the last key each token sees, ``(token_pos_t + 1) // ratio - 1``
            (-1: none yet); ``token_pos_t`` itself when ratio is 1. What the indexers read.
    """

    indexer: IndexerDims
    token_req_t: torch.Tensor
    token_pos_t: torch.Tensor
    max_kv_len: int
    ratio: int
    token_last_t: torch.Tensor
