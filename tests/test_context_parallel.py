"""Decode context parallel (:mod:`mla_backend.context_parallel`) without an engine: W ranks in one
process (one thread each, a barrier-based stand-in for the DCP group's all-gather), each
holding its shard of the latent cache, laid out by vLLM's slot-mapping rule as written plainly
here (the Triton kernel ``ComputeSlotMappingKernel`` of vLLM 0.32: virtual blocks of
``page_size * W`` tokens, interleaves of I tokens dealt round-robin).

Each rank plans the step (:class:`DCPPlanner`, as the metadata builder does) and runs
:func:`dcp_attention` with its tensor-parallel slice of the heads; the union of the ranks'
outputs must equal the paper's decompressed oracle over the whole, unsharded sequences (fp32
caches), or the core's own unsharded run on the same cache bytes (fp8 caches). Batches mix
decodes (some ranks holding none of a short request's tokens), speculative-verify queries
(several tokens served over shards), fresh prefills and chunked-prefill continuations (gathered).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.context_parallel import DCPPlanner, ShardLayout, dcp_attention
from mla_backend.testing.reference import reference_mla_attention

NAN = float("nan")
DIMS = {
    # (heads per rank, r, nope, rope, v)
    "odd": (3, 40, 12, 6, 20),
    "lite": (16, 512, 128, 64, 128),
}
# (prefix, new) per request; max_sharded_query 4 (3 speculative tokens)
BATCH = [(37, 1), (0, 1), (2, 1), (64, 1), (40, 4), (5, 3), (0, 23), (33, 17), (1, 6)]


class ThreadGroup:
    """The all-gather of W ranks that run as threads of this process."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * world

    def rank(self, r: int) -> RankGroup:
        return RankGroup(self, r)


class RankGroup:
    def __init__(self, shared: ThreadGroup, rank: int) -> None:
        self.shared, self.world_size, self.rank_in_group = shared, shared.world, rank
        self.gathers = 0

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        s = self.shared
        s.slots[self.rank_in_group] = input_
        s.barrier.wait()
        out = torch.cat([t for t in s.slots if t is not None], dim=dim)
        s.barrier.wait()  # nobody overwrites a slot before everyone has read
        self.gathers += 1
        return out


def vllm_slot(p: int, table_row: list[int], page: int, world: int, rank: int, inter: int):
    """vLLM 0.32's slot of kv position p on ``rank`` (None: another rank holds it)."""
    virtual = page * world
    block, off = divmod(p, virtual)
    if (off // inter) % world != rank:
        return None
    return table_row[block] * page + (off // (world * inter)) * inter + off % inter


def _rank_caches(c_kv, k_pe, table, page, world, inter, num_pages, cache_dtype, kv_scale):
    """Each rank's cache (NaN / 0xFF where nothing is written) holding its share of every
    request, written by the core's ``write_latent`` at vLLM's slots."""
    r, rope = c_kv[0].shape[1], k_pe[0].shape[1]
    caches = []
    for rank in range(world):
        if cache_dtype == torch.uint8:
            width = CacheLayout.ds_mla(r, rope, torch.float32).width
            cache = torch.full((num_pages, page, width), 0xFF, dtype=torch.uint8)
        else:
            cache = torch.full((num_pages, page, r + rope), NAN).to(cache_dtype)
        for i, (c, kp) in enumerate(zip(c_kv, k_pe, strict=True)):
            slots = [vllm_slot(p, table[i], page, world, rank, inter) for p in range(c.shape[0])]
            keep = [p for p, s in enumerate(slots) if s is not None]
            if keep:
                idx = torch.tensor(keep)
                dst = torch.tensor([slots[p] for p in keep])
                mb.write_latent(cache, c[idx], kp[idx], dst, kv_scale)
        caches.append(cache)
    return caches


def _problem(dims_name: str, page: int, world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    h, r, nope, rope, v = DIMS[dims_name]
    H = h * world
    kv = [p + n for p, n in BATCH]
    # the engine's block table: one block per page_size * world tokens, shuffled ids
    blocks = [-(-L // (page * world)) for L in kv]
    ids = list(range(1, sum(blocks) + 1))
    rng.shuffle(ids)
    table, k = [], 0
    for b in blocks:
        table.append(ids[k : k + b] + [0] * (max(blocks) + 1 - b))
        k += b
    c_kv = [torch.randn(L, r, generator=g) for L in kv]
    k_pe = [torch.randn(L, rope, generator=g) for L in kv]
    T = sum(n for _, n in BATCH)
    q_nope = torch.randn(T, H, nope, generator=g)
    q_pe = torch.randn(T, H, rope, generator=g)
    kv_b = torch.randn(H * (nope + v), r, generator=g) / r**0.5
    return dict(h=h, dims=mb.MLADims(H, r, nope, rope, v), table=table, num_pages=len(ids) + 2,
                c_kv=c_kv, k_pe=k_pe, q_nope=q_nope, q_pe=q_pe, kv_b=kv_b)  # fmt: skip


def _run_ranks(prob, page, world, inter, caches, kv_scale, max_sharded_query=4):
    """Every rank's output [T, h, v] (its heads), run concurrently."""
    h, dims = prob["h"], prob["dims"]
    H, nope, v = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    w = prob["kv_b"].view(H, nope + v, -1)
    group = ThreadGroup(world)
    table = torch.tensor(prob["table"], dtype=torch.int32)
    outs: list[torch.Tensor | None] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            heads = slice(rank * h, (rank + 1) * h)
            local = mb.MLADims(h, dims.kv_lora_rank, nope, dims.qk_rope_head_dim, v)
            weights = mb.split_kv_b_proj(w[heads].reshape(h * (nope + v), -1), local)
            attn = mb.MLAAttention(local, weights)
            planner = DCPPlanner(
                ShardLayout(world, rank, inter, page), local, mb.Policy.from_env(),
                torch.device("cpu"), max_sharded_query,
            )  # fmt: skip
            step = planner.build(
                [p for p, _ in BATCH], [n for _, n in BATCH], table, lambda _n: mb.Phase.MIXED
            )
            out = torch.full((step.num_tokens, h, v), NAN)
            dcp_attention(attn, step, prob["q_nope"][:, heads], prob["q_pe"][:, heads],
                          caches[rank], kv_scale, group.rank(rank), out)  # fmt: skip
            outs[rank] = out
        except BaseException as e:  # surfaced below; abort the barrier for the others
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return torch.cat(outs, dim=1)  # [T, H, v]


LAYOUTS = [  # (world, page, interleave)
    (2, 4, 1),
    (2, 16, 16),
    (3, 8, 2),
    (4, 4, 4),
]


@pytest.mark.parametrize("dims_name", list(DIMS))
@pytest.mark.parametrize(("world", "page", "inter"), LAYOUTS)
def test_ranks_together_match_the_oracle(dims_name: str, world: int, page: int, inter: int):
    if dims_name == "lite" and world > 2:
        pytest.skip("big dims: two layouts are enough")
    prob = _problem(dims_name, page, world, seed=world * 100 + page + inter)
    caches = _rank_caches(prob["c_kv"], prob["k_pe"], prob["table"], page, world, inter,
                          prob["num_pages"], torch.float32, None)  # fmt: skip
    got = _run_ranks(prob, page, world, inter, caches, None)
    d = prob["dims"]
    want = reference_mla_attention(
        prob["q_nope"], prob["q_pe"], prob["c_kv"], prob["k_pe"], prob["kv_b"],
        d.qk_nope_head_dim, d.v_head_dim, [n for _, n in BATCH],
    )  # fmt: skip
    err = (got - want).abs().max().item()
    assert err <= 2e-5 * max(1.0, want.abs().max().item()), f"max error {err:.3e}"


@pytest.mark.parametrize("cache", ["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize(("world", "page", "inter"), [(2, 4, 1), (3, 8, 8)])
def test_fp8_caches_match_the_unsharded_core(cache: str, world: int, page: int, inter: int):
    """Shards of an fp8 cache hold the same bytes an unsharded cache would (the same writes):
    the ranks' result equals the core's own run on one whole cache (its TP-only answer)."""
    prob = _problem("odd", page, world, seed=5)
    cache_dtype = mb.FP8_DTYPE if cache == "fp8" else torch.uint8
    kv_scale = torch.tensor(0.03) if cache == "fp8" else None
    caches = _rank_caches(prob["c_kv"], prob["k_pe"], prob["table"], page, world, inter,
                          prob["num_pages"], cache_dtype, kv_scale)  # fmt: skip
    got = _run_ranks(prob, page, world, inter, caches, kv_scale)
    # the unsharded run: one rank, every token in its own cache, all heads
    one = _rank_caches(prob["c_kv"], prob["k_pe"], prob["table"], page * world, 1, 1,
                       prob["num_pages"], cache_dtype, kv_scale)[0]  # fmt: skip
    d = prob["dims"]
    attn = mb.MLAAttention(d, mb.split_kv_b_proj(prob["kv_b"], d))
    batch = mb.MLABatch.build(
        [p for p, _ in BATCH], [n for _, n in BATCH], torch.tensor(prob["table"]), page * world
    )
    want = attn(prob["q_nope"], prob["q_pe"], one, mb.plan(batch, d), kv_scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


def test_collectives_per_layer_and_parts() -> None:
    """Decodes and spec-verify go sharded (two all-gathers: queries, partials), the longer
    queries gathered (one all-gather of latent rows); a rank holding none of a request's
    tokens still joins every collective."""
    world, page, inter = 2, 4, 4
    layout = ShardLayout(world, 1, inter, page)
    planner = DCPPlanner(layout, mb.MLADims(2, 16, 8, 4, 8), mb.Policy.from_env(),
                         torch.device("cpu"), 4)  # fmt: skip
    table = torch.arange(1, 11, dtype=torch.int32).view(2, 5)
    step = planner.build([0, 2], [1, 30], table, lambda _n: mb.Phase.EXTEND)
    assert step.modes == "sharded+gathered"
    # request 0 has one token, held by rank 0: nothing live on rank 1
    assert step.sharded.plan is None and step.sharded.live is not None
    assert step.sharded.live.numel() == 0
    assert step.gathered.rows.tolist() == list(range(1, 31))
    # 32 kv tokens in interleaves of 4 over 2 ranks: 16 each
    assert step.gathered.rows_per_rank == 16 and step.gathered.send.numel() == 16


@pytest.mark.parametrize(("world", "page", "inter"), [(2, 16, 1), (2, 16, 16), (3, 8, 2)])
def test_slot_mapping_follows_vllm_rule(world: int, page: int, inter: int) -> None:
    """:meth:`ShardLayout.slot_mapping` (what the CPU slot-mapping workaround writes) against
    the rule as written in :func:`vllm_slot`."""
    g = torch.Generator().manual_seed(1)
    table = torch.randperm(40, generator=g).view(4, 10).to(torch.int32)
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 3] * 20)
    pos = torch.randint(0, page * world * 10, (rows.numel(),), generator=g)
    for rank in range(world):
        got = ShardLayout(world, rank, inter, page).slot_mapping(pos, table, rows)
        want = [vllm_slot(int(p), table[int(i)].tolist(), page, world, rank, inter)
                for p, i in zip(pos, rows, strict=True)]  # fmt: skip
        assert got.tolist() == [-1 if s is None else s for s in want]


def test_layout_rejects_an_interleave_that_does_not_divide_the_page() -> None:
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=3 does not divide"):
        ShardLayout(2, 0, 3, 16)
    with pytest.raises(ValueError, match="DCP rank 2 is outside 0..1"):
        ShardLayout(2, 2, 1, 16)
