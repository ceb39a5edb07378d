"""Decode context parallel (DCP), engine-neutral: the latent cache sharded by token over the
ranks of a group, attention per shard, partial results merged through the log-sum-exp.

The shard layout is vLLM's (``--decode-context-parallel-size W``,
``cp_kv_cache_interleave_size`` I): each request's kv token at global position ``p`` lives on
one rank only, in interleaves of I tokens, rank ``(p // I) % W`` (:class:`ShardLayout`). Every
rank keeps the same block table; its pages hold its own tokens in order, so rank ``s`` sees
request ``i`` as an ordinary paged sequence of ``local_len(kv_len_i, s)`` tokens.

Each step has two parts (:class:`DCPPlanner` makes them once per step from host lengths;
:func:`dcp_attention` runs them per layer, reading no tensor data on the host)::

    sharded  (requests with at most max_sharded_query new tokens: decode, speculative verify)
        q_lat = absorb(q_nope, W_UK)                     # this rank's heads
        q     = all_gather([q_lat ; q_pe], heads)        # all W x H heads on every rank
        o_s, lse_s = absorbed_attention(q, own shard)    # query token j of a request with P
                                                         # cached tokens sees local_len(P+j+1)
        (o_s, lse_s) of every rank = all_gather(...)
        o = merge_attention_shards(this rank's heads) @ W_UV
    gathered (longer queries: prefills, chunked-prefill continuations, prefix hits)
        rows  = all_gather(the requests' raw cache rows)  # any cache layout, as bytes
        temp  = rows in global order, a temporary paged cache
        o     = MLAAttention(q, temp, its own plan)       # the policy picks absorbed / normal

Every rank of the group sees the same batch, so every rank makes the same collectives in the
same order with the same shapes (each rank's gather rows are padded to the largest rank's).
The group is any object with ``world_size``, ``rank_in_group`` and ``all_gather``
(:class:`DCPGroup`; vLLM's ``GroupCoordinator`` is one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .attention import MLAAttention, absorbed_attention
from .batch import MLABatch, Phase
from .dims import MLADims
from .merge import merge_attention_shards
from .plan import MLAPlan, plan
from .policy import Policy

__all__ = [
    "DCPGroup",
    "DCPPlanner",
    "DCPStep",
    "GatheredPart",
    "ShardLayout",
    "ShardedPart",
    "check_shard_layout",
    "dcp_attention",
]


class DCPGroup(Protocol):
    """The collectives of a DCP group (vLLM's ``GroupCoordinator`` has them)."""

    world_size: int
    rank_in_group: int

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


@dataclass(frozen=True)
class ShardLayout:
    """Which rank of a DCP group holds a request's kv token, and where (vLLM's rule).

    Token ``p`` lives on rank ``(p // interleave) % world_size`` as that rank's local token
    ``(p // (world_size * interleave)) * interleave + p % interleave``; local token ``k`` sits
    in page ``block_table[k // page_size]`` at offset ``k % page_size`` (the same block table
    on every rank). Requires ``page_size % interleave == 0``.
    """

    world_size: int
    rank: int
    interleave: int
    page_size: int

    def __post_init__(self) -> None:
        check_shard_layout(self.world_size, self.interleave, self.page_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DCP rank {self.rank} is outside 0..{self.world_size - 1}")

    def local_len(self, n: int, rank: int | None = None) -> int:
        """How many of a request's first ``n`` kv tokens rank ``rank`` (default: this one)
        holds."""
        r = self.rank if rank is None else rank
        span = self.world_size * self.interleave
        full, rem = divmod(n, span)
        return full * self.interleave + min(max(rem - r * self.interleave, 0), self.interleave)

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner rank, local token index) of each global position (int64 tensors)."""
        inter, span = self.interleave, self.world_size * self.interleave
        owner = torch.div(positions, inter, rounding_mode="floor") % self.world_size
        local = torch.div(positions, span, rounding_mode="floor") * inter + positions % inter
        return owner, local

    def local_slots(
        self, block_table: torch.Tensor, rows: torch.Tensor, local: torch.Tensor
    ) -> torch.Tensor:
        """Flat cache slot (``page * page_size + offset``) of local token ``local[t]`` of the
        request in block-table row ``rows[t]`` (int64, on the block table's device)."""
        ps = self.page_size
        page = block_table[rows, torch.div(local, ps, rounding_mode="floor")].to(torch.long)
        return page * ps + local % ps

    def slot_mapping(
        self, positions: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
        pad: int = -1,
    ) -> torch.Tensor:  # fmt: skip
        """Where this rank writes each new token: its flat cache slot, or ``pad`` for a token
        another rank holds (positions and rows: [T] int64; block_table: [reqs, cols])."""
        owner, local = self.locate(positions)
        slots = self.local_slots(block_table, rows, local)
        return torch.where(owner == self.rank, slots, torch.full_like(slots, pad))


def check_shard_layout(world_size: int, interleave: int, page_size: int) -> None:
    """``ValueError`` naming the values (by vLLM's option names) when the shard layout cannot
    serve them."""
    if world_size < 1 or interleave < 1:
        raise ValueError(
            f"decode_context_parallel_size={world_size} and cp_kv_cache_interleave_size="
            f"{interleave} must be >= 1"
        )
    if page_size % interleave:
        raise ValueError(
            f"cp_kv_cache_interleave_size={interleave} does not divide block_size={page_size}: "
            "under decode context parallel each rank's page holds whole interleaves; use an "
            f"interleave size that divides {page_size} (1 or the block size)"
        )


@dataclass(frozen=True)
class ShardedPart:
    """Query tokens attended over the local shard (decode, speculative verify).

    Attributes:
        rows: [Ts] int64 rows of the step's tokens.
        live: [V] int64 indices into ``rows`` of the tokens that see at least one local kv
            token, or None when all do.
        plan: V one-token requests over this rank's shard with all the group's heads, or None
            when V == 0.
    """

    rows: torch.Tensor
    live: torch.Tensor | None
    plan: MLAPlan | None


@dataclass(frozen=True)
class GatheredPart:
    """Requests whose latent rows the group gathers into one temporary cache.

    Attributes:
        rows: [Tg] int64 rows of the step's tokens.
        send: [S] int64 flat slots of this rank's cache rows to contribute, in order.
        rows_per_rank: the largest S of any rank (each rank pads its rows to it).
        order: [pages * page_size] int64 row of the all-gathered [W * rows_per_rank] rows for
            each slot of the temporary cache (0 in slots past a request's end: never read).
        plan: the requests over the temporary cache, this rank's heads.
    """

    rows: torch.Tensor
    send: torch.Tensor
    rows_per_rank: int
    order: torch.Tensor
    plan: MLAPlan


@dataclass(frozen=True)
class DCPStep:
    """One step under DCP: made by :meth:`DCPPlanner.build`, read by :func:`dcp_attention`."""

    layout: ShardLayout
    num_tokens: int
    sharded: ShardedPart | None
    gathered: GatheredPart | None

    @property
    def modes(self) -> str:
        """For logs: ``sharded``, ``gathered`` or ``sharded+gathered``."""
        names = [n for n, p in (("sharded", self.sharded), ("gathered", self.gathered)) if p]
        return "+".join(names) or "idle"


class _Batch(NamedTuple):
    """The engine's step as the planner reads it (global lengths, host ints)."""

    prefix_lens: list[int]
    new_lens: list[int]
    cu: list[int]  # prefix sums of new_lens: request i owns rows cu[i]:cu[i + 1]
    block_table: torch.Tensor


class DCPPlanner:
    """Makes each step's :class:`DCPStep` from the engine's host data (once per step).

    Args:
        layout: this rank's :class:`ShardLayout`.
        dims: the layers' dims with this rank's heads.
        policy: the absorbed-vs-normal policy of the gathered requests.
        device: where queries and cache live.
        max_sharded_query: requests with at most this many new tokens go sharded.
    """

    def __init__(
        self,
        layout: ShardLayout,
        dims: MLADims,
        policy: Policy,
        device: torch.device,
        max_sharded_query: int,
    ) -> None:
        self.layout = layout
        self.dims = dims
        self.group_dims = MLADims(
            dims.num_heads * layout.world_size,
            dims.kv_lora_rank,
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
            dims.q_lora_rank,
        )
        self.policy = policy
        self.device = torch.device(device)
        self.max_sharded_query = max(1, int(max_sharded_query))

    def build(
        self,
        prefix_lens: Sequence[int],
        new_lens: Sequence[int],
        block_table: torch.Tensor,
        phase_of: Callable[[list[int]], Phase],
    ) -> DCPStep:
        """The step's parts.

        Args:
            prefix_lens / new_lens: per request, global cached and new token counts.
            block_table: [num_reqs, cols] the engine's block table (same on every rank).
            phase_of: the :class:`mla_backend.Phase` of a list of new-token counts (the
                gathered requests' phase for the policy).
        """
        cu = [0]
        for n in new_lens:
            cu.append(cu[-1] + n)
        b = _Batch(list(prefix_lens), list(new_lens), cu, block_table)
        short = [i for i, n in enumerate(new_lens) if 0 < n <= self.max_sharded_query]
        long_ = [i for i, n in enumerate(new_lens) if n > self.max_sharded_query]
        return DCPStep(
            layout=self.layout,
            num_tokens=cu[-1],
            sharded=self._sharded(short, b) if short else None,
            gathered=self._gathered(long_, b, phase_of) if long_ else None,
        )

    def _rows(self, reqs: Sequence[int], cu: Sequence[int]) -> torch.Tensor:
        idx = [t for i in reqs for t in range(cu[i], cu[i + 1])]
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    def _sharded(self, reqs: list[int], b: _Batch) -> ShardedPart:
        prefix_lens, new_lens, cu, block_table = b
        visible, owner_req, live = [], [], []
        t = 0
        for i in reqs:
            for j in range(new_lens[i]):
                v = self.layout.local_len(prefix_lens[i] + j + 1)
                if v > 0:
                    visible.append(v)
                    owner_req.append(i)
                    live.append(t)
                t += 1
        shard_plan = None
        if visible:
            table = block_table.index_select(
                0, torch.tensor(owner_req, dtype=torch.long, device=block_table.device)
            )
            batch = MLABatch.build(
                [v - 1 for v in visible], [1] * len(visible), table, self.layout.page_size,
                Phase.DECODE,
            )  # fmt: skip
            shard_plan = plan(batch, self.group_dims, Policy("absorb"), device=self.device)
        live_t = (
            None if len(live) == t else torch.tensor(live, dtype=torch.long, device=self.device)
        )
        return ShardedPart(self._rows(reqs, cu), live_t, shard_plan)

    def _gathered(
        self, reqs: list[int], b: _Batch, phase_of: Callable[[list[int]], Phase]
    ) -> GatheredPart:
        prefix_lens, new_lens, cu, block_table = b
        lay = self.layout
        W, ps = lay.world_size, lay.page_size
        kv = [prefix_lens[i] + new_lens[i] for i in reqs]
        counts = [[lay.local_len(n, r) for n in kv] for r in range(W)]  # [W][reqs]
        starts = []  # per rank, each request's first row among that rank's rows
        for r in range(W):
            acc, s = [], 0
            for c in counts[r]:
                acc.append(s)
                s += c
            starts.append(acc)
        rows_per_rank = max(sum(c) for c in counts)
        # this rank's rows: request-major local tokens 0..count-1, as flat cache slots
        mine = counts[lay.rank]
        sel = torch.tensor(reqs, dtype=torch.long).repeat_interleave(torch.tensor(mine))
        k = torch.cat([torch.arange(c) for c in mine]) if mine else torch.zeros(0)
        k = k.to(torch.long)
        send = lay.local_slots(block_table, sel.to(block_table.device), k.to(block_table.device))
        # the temporary cache: each request in whole pages, positions in global order
        pages = [-(-n // ps) for n in kv]
        order = torch.zeros(sum(pages) * ps, dtype=torch.long)
        base = 0
        for q, n in enumerate(kv):
            owner, local = lay.locate(torch.arange(n))
            first = torch.tensor([starts[r][q] for r in range(W)])
            order[base * ps : base * ps + n] = owner * rows_per_rank + first[owner] + local
            base += pages[q]
        max_pages = max(pages)
        temp_table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
        base = 0
        for q, p in enumerate(pages):
            temp_table[q, :p] = torch.arange(base, base + p, dtype=torch.int32)
            base += p
        new = [new_lens[i] for i in reqs]
        batch = MLABatch.build(
            [prefix_lens[i] for i in reqs], new, temp_table.to(self.device), ps, phase_of(new),
            block_table_host=temp_table if self.device.type != "cpu" else None,
        )  # fmt: skip
        temp_plan = plan(batch, self.dims, self.policy, device=self.device)
        return GatheredPart(
            rows=self._rows(reqs, cu),
            send=send.to(self.device),
            rows_per_rank=rows_per_rank,
            order=order.to(self.device),
            plan=temp_plan,
        )


def dcp_attention(
    attn: MLAAttention,
    step: DCPStep,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    group: DCPGroup,
    out: torch.Tensor,
) -> None:
    """One layer's attention under DCP, written into ``out``.

    Args:
        attn: the layer's core attention (this rank's heads).
        step: the step's :class:`DCPStep`.
        q_nope: [T, H, nope]; q_pe: [T, H, rope] (T == step.num_tokens, this rank's heads).
        kv_cache: [num_pages, page_size, width] this rank's shard, in the core's layout.
        kv_scale: float32 scalar of a per-tensor fp8 cache, else None.
        group: the DCP group (``world_size``, ``rank_in_group``, ``all_gather``).
        out: [T, H, v] filled in place (rows of every part).
    """
    if group.world_size != step.layout.world_size or group.rank_in_group != step.layout.rank:
        raise RuntimeError(
            f"DCP group rank {group.rank_in_group}/{group.world_size} != the step's layout "
            f"rank {step.layout.rank}/{step.layout.world_size}"
        )
    if step.sharded is not None:
        o = _sharded(attn, step.sharded, step.layout, q_nope, q_pe, kv_cache, kv_scale, group)
        out.index_copy_(0, step.sharded.rows, o)
    if step.gathered is not None:
        g = step.gathered
        temp = _gather_rows(g, kv_cache, group)
        o = attn(q_nope.index_select(0, g.rows), q_pe.index_select(0, g.rows), temp, g.plan,
                 kv_scale)  # fmt: skip
        out.index_copy_(0, g.rows, o)


def _sharded(
    attn: MLAAttention,
    part: ShardedPart,
    layout: ShardLayout,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    group: DCPGroup,
) -> torch.Tensor:
    """The sharded part: [Ts, H, v] for this rank's heads."""
    impl = part.plan.impl if part.plan is not None else None
    r = attn.dims.kv_lora_rank
    H = q_nope.shape[1]
    q_lat = attn.absorb_q(q_nope.index_select(0, part.rows), impl)
    q = torch.cat([q_lat, q_pe.index_select(0, part.rows).to(q_lat.dtype)], -1)
    q = group.all_gather(q.contiguous(), dim=1)  # [Ts, W * H, r + rope], the group's heads
    Ts, HW = q.shape[0], q.shape[1]
    # partial o_lat and its lse side by side, float32, so one gather carries both
    partial = torch.zeros(Ts, HW, r + 1, dtype=torch.float32, device=q.device)
    partial[..., r] = float("-inf")
    if part.plan is not None:
        qv = q if part.live is None else q.index_select(0, part.live)
        o_lat, lse = absorbed_attention(
            qv[..., :r], qv[..., r:], kv_cache, part.plan, attn.softmax_scale, kv_scale
        )
        live = torch.cat([o_lat.float(), lse.unsqueeze(-1)], -1)
        if part.live is None:
            partial.copy_(live)
        else:
            partial.index_copy_(0, part.live, live)
    shards = group.all_gather(partial.unsqueeze(0), dim=0)  # [W, Ts, W * H, r + 1]
    own = shards[:, :, layout.rank * H : (layout.rank + 1) * H]
    o_lat, _ = merge_attention_shards(own[..., :r], own[..., r], out_dtype=q_lat.dtype)
    return attn.apply_W_UV(o_lat, impl)


def _gather_rows(g: GatheredPart, kv_cache: torch.Tensor, group: DCPGroup) -> torch.Tensor:
    """The gathered requests' latent rows from every rank, as a temporary paged cache in the
    shard's dtype and layout (1-byte layouts travel as uint8)."""
    pages, ps, width = kv_cache.shape
    flat = kv_cache.view(pages * ps, width)
    wire = flat.view(torch.uint8) if flat.element_size() == 1 else flat
    send = wire.new_zeros(g.rows_per_rank, width)
    send[: g.send.shape[0]] = wire.index_select(0, g.send)
    everyone = group.all_gather(send, dim=0)  # [W * rows_per_rank, width]
    temp = everyone.index_select(0, g.order).view(-1, ps, width)
    return temp.view(kv_cache.dtype) if temp.dtype != kv_cache.dtype else temp
