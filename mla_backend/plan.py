"""The per-step plan: everything the per-layer run needs, made once per step from host data.

``plan(batch, dims, policy)`` is called once per engine step (FlashMLA's
``get_mla_metadata`` / FlashInfer's ``plan``). It makes the policy's decision per request,
splits the step into the requests each path serves, builds every index tensor the kernels read
(int32 block table, kv lengths, query starts, the query-block x KV-split work partition) on the
target device, and validates page ids from host data the engine already has. The per-layer
calls (:func:`mla_backend.absorbed_attention`, :func:`mla_backend.normal_attention`,
:class:`mla_backend.MLAAttention`) take the plan and read no tensor data on the host, so the
GPU path has no device-to-host sync and can be captured or traced.

CUDA-graph replay needs the plan's tensors at fixed addresses: :meth:`MLAPlan.refresh_` copies
a new step's index tensors into an existing plan of the same shape (same requests, pages and
query counts; the lengths may change) instead of making new ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .batch import MLABatch, Phase
from .dims import MLADims
from .index_cache import IndexerDims
from .ops import KernelImpl, KeyWindow
from .parts import PlanPart, PlanState, SparsePart, StepShape, WorkPartition
from .policy import PathChoice, Policy
from .selection import get_impl, resolve_policy


@dataclass(frozen=True, eq=False)
class MLAPlan:
    """One step, planned: made by :func:`plan`, read by every layer's attention call.

    Attributes:
        dims: the layers' MLA dims (heads on this rank).
        page_size: tokens per cache page.
        phase: the step's :class:`Phase`.
        impl: the kernel implementation serving the plan's device (the device seam).
        device: where the plan's tensors live (the queries' and cache's device).
        choice: the policy's decision per request (absorbed or normal).
        step: the whole step (every request), for callers that run one path on all of it.
        absorbed: the requests the policy sends to the absorbed path (None if none).
        normal: the requests the policy sends to the normal path (None if none).
        max_page_id: the largest page id any request uses (-1 if unknown): the run checks
            the cache has more pages than this, from its shape alone.
        sparse: a DSA step's per-token data (:class:`~mla_backend.parts.SparsePart`: made when
            :func:`plan` is given ``indexer``), read by the indexer and the sparse attention
            (:mod:`mla_backend.sparse`); None otherwise.
        dsa_routes: a DSA step's requests grouped by the policy's route
            (``choice.routes``: :data:`~mla_backend.policy.DSA_ROUTES`), each route's
            ``(PlanPart, SparsePart)`` (the step's own where one route serves every request),
            executed by :func:`mla_backend.sparse_layer.sparse_mla_attention`; None otherwise.
        window: per-request sliding windows of the key-set attention
            (:class:`~mla_backend.ops.KeyWindow`: made when :func:`plan` is given ``window``);
            None: causal ranges start at 0.
    """

    dims: MLADims
    page_size: int
    phase: Phase
    impl: KernelImpl
    device: torch.device
    choice: PathChoice
    step: PlanPart
    absorbed: PlanPart | None
    normal: PlanPart | None
    max_page_id: int
    sparse: SparsePart | None = None
    dsa_routes: dict[str, tuple[PlanPart, SparsePart]] | None = None
    window: KeyWindow | None = None

    @property
    def num_reqs(self) -> int:
        return self.step.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens

    @property
    def mode(self) -> str:
        """``"absorbed"``, ``"normal"`` or ``"mixed"`` (the policy split the step)."""
        return self.choice.batch_mode

    @property
    def uses_normal(self) -> bool:
        """SGLang's ``no_absorb()`` question: does any request of the step go normal? Then the
        step needs the engine's normal (MHA) call, where the core serves both paths."""
        return self.mode != "absorbed"

    def refresh_(self, batch: MLABatch) -> None:
        """Copy a new step's lengths and block table into this plan's tensors in place (the
        addresses a captured CUDA graph reads). The step keeps the policy's decision, the
        requests' query counts and the work partition's shape (its schedule is rewritten in
        place for the new lengths); its lengths and pages may change, and
        its block table must fit the plan's columns. Anything else needs a new plan."""
        if tuple(batch.new_lens) != self.step.new_lens or batch.page_size != self.page_size:
            raise ValueError(
                "refresh_ keeps query counts and page size fixed: the plan has new_lens="
                f"{list(self.step.new_lens)}, page_size={self.page_size}; the batch has "
                f"new_lens={batch.new_lens}, page_size={batch.page_size}"
            )
        indexer = self.sparse.indexer if self.sparse is not None else None
        fresh = _build(batch, self.dims, self.choice, self.impl, self.device, indexer)
        pairs = [(self.step, fresh.step), (self.absorbed, fresh.absorbed),
                 (self.normal, fresh.normal)]  # fmt: skip
        for name, (part, sp) in (self.dsa_routes or {}).items():
            new_part, new_sp = fresh.dsa_routes[name]  # type: ignore[index]
            pairs.append((part, new_part))
            if sp is not self.sparse:
                _refresh_sparse(sp, new_sp)
        for old, new in pairs:
            if old is None or new is None or old is new:
                continue
            cols = new.block_table.shape[1]
            if cols > old.block_table.shape[1]:
                raise ValueError(
                    f"the new step needs {cols} block-table columns; the plan has "
                    f"{old.block_table.shape[1]}"
                )
            old.block_table.zero_()
            old.block_table[:, :cols].copy_(new.block_table)
            for name in ("kv_lens_t", "prefix_lens_t", "new_lens_t", "cu_new_t"):
                getattr(old, name).copy_(getattr(new, name))
            w = old.work  # the new lengths' plan state, cut into the plan's number of splits
            if w.state is not None:
                shape = _step_shape(self.dims, new.new_lens, new.kv_lens, self.device,
                                    new.block_table, self.page_size)
                fresh_state = self.impl.plan_state(shape, w.block_q, w.num_kv_splits)
                assert fresh_state is not None
                w.state.copy_(fresh_state)
            object.__setattr__(old, "prefix_lens", new.prefix_lens)
            object.__setattr__(old, "pages", new.pages)
            object.__setattr__(old, "max_page_id", new.max_page_id)
        object.__setattr__(self, "max_page_id", fresh.max_page_id)
        if self.sparse is not None and fresh.sparse is not None:
            _refresh_sparse(self.sparse, fresh.sparse)


def _refresh_sparse(old: SparsePart, new: SparsePart) -> None:
    """``old``'s per-token DSA data replaced in place by ``new``'s (same token count)."""
    old.token_pos_t.copy_(new.token_pos_t)
    if old.token_last_t is not old.token_pos_t:
        old.token_last_t.copy_(new.token_last_t)
    object.__setattr__(old, "max_kv_len", new.max_kv_len)


def _int32_views(
    lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """One int32 tensor per list, made as views of one buffer (one ``torch.tensor`` call, one
    host-to-device copy per step instead of one per list)."""
    flat = [v for values in lists for v in values]
    buf = torch.tensor(flat, dtype=torch.int32, device=device)
    return tuple(buf.split([len(values) for values in lists]))


def _host_pages(
    table_host: torch.Tensor | None, reqs: Sequence[int], kv_lens: Sequence[int], page_size: int
) -> tuple[tuple[int, ...], ...] | None:
    if table_host is None:
        return None
    rows = table_host.tolist()  # a host tensor: no device sync
    return tuple(
        tuple(rows[i][: -(-L // page_size)]) for i, L in zip(reqs, kv_lens, strict=True)
    )


def _step_shape(
    dims: MLADims,
    new: Sequence[int],
    kv: Sequence[int],
    device: torch.device,
    block_table: torch.Tensor,
    page_size: int,
) -> StepShape:
    return StepShape(dims, tuple(new), tuple(kv), device, block_table, page_size)


def _max_page_id(pages: tuple[tuple[int, ...], ...] | None) -> int:
    """The largest page id of the host pages (-1 if unknown or none); a negative id for a
    used page is an error."""
    used = [p for req in pages or () for p in req]
    if not used:
        return -1
    if min(used) < 0:
        raise ValueError(
            f"block_table holds page id {min(used)} for a used page; page ids are >= 0"
        )
    return max(used)


def _part(
    batch: MLABatch,
    reqs: Sequence[int],
    whole: bool,
    dims: MLADims,
    impl: KernelImpl,
    device: torch.device,
) -> PlanPart:
    prefix = tuple(batch.prefix_lens[i] for i in reqs)
    new = tuple(batch.new_lens[i] for i in reqs)
    kv = tuple(p + n for p, n in zip(prefix, new, strict=True))
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    ps = batch.page_size
    table = batch.block_table
    if whole:
        table = table[: len(reqs)]
    else:
        table = table.index_select(0, torch.tensor(list(reqs), device=table.device))
    table = table.to(device=device, dtype=torch.int32).contiguous()
    rows = None
    if not whole:
        idx = [t for i in reqs for t in range(batch.cu_new[i], batch.cu_new[i + 1])]
        rows = torch.tensor(idx, dtype=torch.long, device=device)
    pages = _host_pages(batch.host_block_table(), reqs, kv, ps)
    shape = _step_shape(dims, new, kv, device, table, ps)
    block_q, splits = impl.work_shape(shape)
    q_req = [i for i, n in enumerate(new) for _ in range(0, n, block_q)]
    q_start = [q0 for n in new for q0 in range(0, n, block_q)]
    q_req_t, q_start_t, kv_t, prefix_t, new_t, cu_t = _int32_views(
        (q_req, q_start, kv, prefix, new, cu), device
    )
    state: PlanState | None = impl.plan_state(shape, block_q, splits)
    work = WorkPartition(block_q, q_req_t, q_start_t, splits, state)
    return PlanPart(
        dims=dims,
        reqs=tuple(reqs),
        prefix_lens=prefix,
        new_lens=new,
        cu_new=tuple(cu),
        pages=pages,
        max_page_id=_max_page_id(pages),
        rows=rows,
        block_table=table,
        kv_lens_t=kv_t,
        prefix_lens_t=prefix_t,
        new_lens_t=new_t,
        cu_new_t=cu_t,
        work=work,
    )


def plan(
    batch: MLABatch,
    dims: MLADims,
    policy: Policy | None = None,
    device: torch.device | str | None = None,
    impl: str | KernelImpl | None = None,
    *,
    indexer: IndexerDims | None = None,
    window: int | Sequence[int] | None = None,
) -> MLAPlan:
    """Plan one step: the policy's decision, the requests of each path and the kernels' index
    tensors. Call once per step; every layer's attention call takes the result.

    Args:
        batch: the step (:meth:`MLABatch.build`).
        dims: the layers' MLA dims (all layers of a model share them).
        policy: absorbed-vs-normal policy; default the configuration's, resolved once
            (:func:`mla_backend.selection.resolve_policy`, the selection's ``plan_policy``:
            ``MLA_BACKEND_POLICY``).
        device: where queries and cache live; default the block table's device.
        impl: kernel implementation: a name (``torch``, ``native``, ``triton``) or an instance
            (tuning knobs are its keyword arguments); default the device's resolved selection
            (:func:`mla_backend.selection.resolve`: ``MLA_BACKEND_IMPL`` or the device's
            choice).
        indexer: a DSA model's indexer dims (:class:`~mla_backend.index_cache.IndexerDims`):
            the plan then carries the per-token data of the indexer and the sparse attention
            (``MLAPlan.sparse``) and the policy's choice says which requests need the sparse
            path (``PathChoice.use_sparse``: those whose context exceeds ``indexer.topk``, where
            the selection matters) and prices the dense paths against it for the others.
        window: sliding-window size (an int >= 1, or one per request) of the key-set
            attention's causal ranges (:func:`mla_backend.keyset_attention`): a query token at
            position p sees ``max(0, p - window + 1) .. p`` (``MLAPlan.window``).
    Returns:
        the step's :class:`MLAPlan`.
    Raises:
        ValueError: a request uses a negative page id (checked on the host block table when
            the engine gave one).
    """
    if not isinstance(batch, MLABatch):
        raise ValueError(f"plan() takes an MLABatch, got {type(batch).__name__}")
    if not isinstance(dims, MLADims):
        raise ValueError(f"plan() takes MLADims, got {type(dims).__name__}")
    dev = torch.device(device) if device is not None else batch.block_table.device
    if indexer is not None and not isinstance(indexer, IndexerDims):
        raise ValueError(f"plan(indexer=...) takes IndexerDims, got {type(indexer).__name__}")
    kernels = get_impl(dev, impl)
    policy = policy if policy is not None else resolve_policy()
    extra = {"indexer": indexer} if indexer is not None else {}
    choice = policy.choose(batch, dims, kernels.cost_profile(dev), **extra)
    built = _build(batch, dims, choice, kernels, dev, indexer)
    if window is None:
        return built
    return replace(built, window=KeyWindow.make(window, batch.num_reqs, dev))


def _sparse_part(
    batch: MLABatch, indexer: IndexerDims, dev: torch.device, reqs: Sequence[int] | None = None
) -> SparsePart:
    """The per-token DSA data of requests ``reqs`` (default: all), indexed within them."""
    reqs = range(batch.num_reqs) if reqs is None else reqs
    new = [batch.new_lens[i] for i in reqs]
    prefix = [batch.prefix_lens[i] for i in reqs]
    req = [k for k, n in enumerate(new) for _ in range(n)]
    pos = [p + j for p, n in zip(prefix, new, strict=True) for j in range(n)]
    R = indexer.compress_ratio
    if R == 1:
        req_t, pos_t = _int32_views((req, pos), dev)
        last_t = pos_t
    else:  # compressed keys: the last key each token sees, once per step
        req_t, pos_t, last_t = _int32_views((req, pos, [(p + 1) // R - 1 for p in pos]), dev)
    keys = max(((p + n) // R for p, n in zip(prefix, new, strict=True)), default=0)
    return SparsePart(indexer, req_t, pos_t, keys, R, last_t)


def _dsa_routes(
    batch: MLABatch,
    dims: MLADims,
    choice: PathChoice,
    kernels: KernelImpl,
    dev: torch.device,
    indexer: IndexerDims,
    step: PlanPart,
    sparse: SparsePart,
) -> dict[str, tuple[PlanPart, SparsePart]]:
    """The step's requests grouped by route: the step itself where one route serves all."""
    assert choice.routes is not None
    names = dict.fromkeys(choice.routes)
    if len(names) == 1:
        return {choice.routes[0]: (step, sparse)} if choice.routes else {}
    out = {}
    for name in names:
        reqs = [i for i, r in enumerate(choice.routes) if r == name]
        out[name] = (_part(batch, reqs, False, dims, kernels, dev),
                     _sparse_part(batch, indexer, dev, reqs))  # fmt: skip
    return out


def _build(
    batch: MLABatch,
    dims: MLADims,
    choice: PathChoice,
    kernels: KernelImpl,
    dev: torch.device,
    indexer: IndexerDims | None = None,
) -> MLAPlan:
    all_reqs = list(range(batch.num_reqs))
    step = _part(batch, all_reqs, True, dims, kernels, dev)
    absorbed = normal = None
    mode = choice.batch_mode
    if mode == "absorbed":
        absorbed = step
    elif mode == "normal":
        normal = step
    else:
        a = [i for i in all_reqs if choice.use_absorbed[i]]
        n = [i for i in all_reqs if not choice.use_absorbed[i]]
        absorbed = _part(batch, a, False, dims, kernels, dev)
        normal = _part(batch, n, False, dims, kernels, dev)
    sparse = _sparse_part(batch, indexer, dev) if indexer is not None else None
    routes = None
    if sparse is not None and indexer is not None and choice.routes is not None:
        routes = _dsa_routes(batch, dims, choice, kernels, dev, indexer, step, sparse)
    return MLAPlan(
        dims=dims,
        page_size=batch.page_size,
        phase=batch.phase,
        impl=kernels,
        device=dev,
        choice=choice,
        step=step,
        absorbed=absorbed,
        normal=normal,
        max_page_id=step.max_page_id,
        sparse=sparse,
        dsa_routes=routes,
    )
