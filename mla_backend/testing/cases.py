"""Shared test cases: random MLA problems laid out in a shuffled paged latent cache, with the
oracle's answer. Used by the core, native, Triton and engine backend tests alike."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import mla_backend as mb

from ..cache_layout import CacheLayout
from .reference import reference_mla_attention

# (H, r, nope, rope, v): tiny, odd (non power of two, v != nope), no rope, DeepSeek-V2-Lite.
DIMS = {
    "tiny": mb.MLADims(2, 16, 8, 4, 8),
    "odd": mb.MLADims(3, 40, 12, 6, 20),
    "norope": mb.MLADims(4, 32, 16, 0, 16),
    "lite": mb.MLADims(16, 512, 128, 64, 128),
}


@dataclass
class Case:
    dims: mb.MLADims
    kv_cache: torch.Tensor
    kv_scale: torch.Tensor | None
    batch: mb.MLABatch
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    c_kv: list[torch.Tensor]  # per request [L, r], the values actually stored (after fp8)
    k_pe: list[torch.Tensor]
    kv_b: torch.Tensor  # [H*(nope+v), r] fp32
    weights: mb.AbsorbWeights

    def plan(self, policy: str | mb.Policy = "absorb", impl: object = None) -> mb.MLAPlan:
        """The step's plan under ``policy`` (a mode name or a Policy)."""
        pol = mb.Policy(policy) if isinstance(policy, str) else policy
        return mb.plan(self.batch, self.dims, pol, impl=impl)

    def oracle(self, scale: float | None = None) -> torch.Tensor:
        return reference_mla_attention(
            self.q_nope,
            self.q_pe,
            self.c_kv,
            self.k_pe,
            self.kv_b,
            self.dims.qk_nope_head_dim,
            self.dims.v_head_dim,
            self.batch.new_lens,
            scale,
        )


def ds_mla_dequantized(c_kv: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """What an ``fp8_ds_mla`` cache holds for c_kv [L, r], written out plainly per token and
    tile (independent of :class:`CacheLayout`): scale = max(amax / 448, FLT_MIN), values
    e4m3(clamp(x / scale)), read back as e4m3 * scale. Returns float32 [L, r]."""
    tiny = torch.finfo(torch.float32).tiny
    out = torch.empty(c_kv.shape, dtype=torch.float32)
    for t in range(c_kv.shape[0]):
        for j0 in range(0, c_kv.shape[1], tile):
            x = c_kv[t, j0 : j0 + tile].float()
            scale = torch.clamp(x.abs().max() / 448.0, min=tiny)
            q = torch.clamp(x / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
            out[t, j0 : j0 + tile] = q.float() * scale
    return out


def make_case(
    dims: mb.MLADims,
    prefix_lens: list[int],
    new_lens: list[int],
    page_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
    phase: mb.Phase = mb.Phase.MIXED,
    spare_pages: int = 3,
    impl: str | None = None,
) -> Case:
    """Random latents written through ``write_latent`` into shuffled physical pages (page 0
    is left unused, like vLLM's null block; unwritten rows hold NaN), padding slots (-1)
    mixed into the slot mapping. ``cache_dtype=torch.uint8`` makes an ``fp8_ds_mla`` cache
    (unwritten bytes 0xFF: NaN values and NaN scales). ``impl``: the kernel implementation that
    writes the cache (default: the device's; ``"torch"`` keeps native code out of the case)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    r, rope = dims.kv_lora_rank, dims.qk_rope_head_dim
    cache_dtype = cache_dtype or dtype
    pages_needed = [-(-(p + n) // page_size) for p, n in zip(prefix_lens, new_lens)]
    num_pages = sum(pages_needed) + spare_pages + 1
    perm = list(range(1, num_pages))
    rng.shuffle(perm)
    max_pages = max(pages_needed + [1]) + 1
    block_table = torch.zeros(len(prefix_lens), max_pages, dtype=torch.int32)
    # never-written cache memory holds NaN: any read outside a request's rows shows up
    if cache_dtype == torch.uint8:
        width = CacheLayout.ds_mla(r, rope, dtype).width
        kv_cache = torch.full((num_pages, page_size, width), 0xFF, dtype=torch.uint8)
    else:
        kv_cache = torch.full((num_pages, page_size, r + rope), float("nan")).to(cache_dtype)
    kv_scale = torch.tensor(0.02, dtype=torch.float32) if cache_dtype == mb.FP8_DTYPE else None
    c_seqs, p_seqs = [], []
    k = 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        L = p + n
        block_table[i, : pages_needed[i]] = torch.tensor(perm[k : k + pages_needed[i]])
        k += pages_needed[i]
        c = torch.randn(L, r, generator=g).to(dtype)
        kp = torch.randn(L, rope, generator=g).to(dtype)
        slots = torch.tensor(
            [int(block_table[i, t // page_size]) * page_size + t % page_size for t in range(L)],
            dtype=torch.long,
        )
        # interleave padding slots that must never be written
        pad = torch.full((2,), -1)
        mb.write_latent(
            kv_cache,
            torch.cat([c, torch.full((2, r), 99.0).to(dtype)]),
            torch.cat([kp, torch.full((2, rope), 99.0).to(dtype)]),
            torch.cat([slots, pad]),
            kv_scale,
            impl=impl,
        )
        if kv_scale is not None:  # the oracle sees what the cache holds
            stored = torch.cat([c, kp], -1).float() / kv_scale
            deq = stored.clamp(-448, 448).to(mb.FP8_DTYPE).float() * kv_scale
            c, kp = deq[:, :r], deq[:, r:]
        if cache_dtype == torch.uint8:
            c = ds_mla_dequantized(c)
        c_seqs.append(c)
        p_seqs.append(kp)
    T = sum(new_lens)
    H = dims.num_heads
    q_nope = (torch.randn(T, H, dims.qk_nope_head_dim, generator=g)).to(dtype)
    q_pe = torch.randn(T, H, rope, generator=g).to(dtype)
    kv_b = torch.randn(H * (dims.qk_nope_head_dim + dims.v_head_dim), r, generator=g) / r**0.5
    kv_b = kv_b.to(dtype).float()
    weights = mb.split_kv_b_proj(kv_b.to(dtype), dims)
    batch = mb.MLABatch.build(prefix_lens, new_lens, block_table, page_size, phase)
    return Case(dims, kv_cache, kv_scale, batch, q_nope, q_pe, c_seqs, p_seqs, kv_b, weights)


TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def assert_close_to_oracle(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> None:
    """Max error relative to the oracle's scale (outputs are O(1) by construction)."""
    err = (out.float() - ref).abs().max().item()
    bound = TOL[dtype] * factor * max(1.0, ref.abs().max().item())
    assert err <= bound, f"max error {err:.3e} > {bound:.3e} ({dtype})"


# ---- DSA: the indexer's key cache next to the latent cache ----------------------------------
def index_fp8_dequantized(k: torch.Tensor, block: int = 128, ue8m0: bool = False) -> torch.Tensor:
    """What vLLM's fp8 index cache reads back for keys k [L, Di], written out plainly per key
    and block (independent of :class:`IndexCacheLayout`): scale = max(amax, 1e-4) / 448
    (rounded up to a power of two for ue8m0), values e4m3(clamp(x / scale)). float32 [L, Di]."""
    out = torch.empty(k.shape, dtype=torch.float32)
    for t in range(k.shape[0]):
        for j0 in range(0, k.shape[1], block):
            x = k[t, j0 : j0 + block].float()
            scale = torch.clamp(x.abs().max(), min=1e-4) / 448.0
            if ue8m0:
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            q = torch.clamp(x / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
            out[t, j0 : j0 + block] = q.float() * scale
    return out


@dataclass
class DsaCase:
    """A DSA problem: the latent :class:`Case` plus the indexer's paged key cache (same pages
    and block table), the keys as the cache reads them back, and indexer queries / weights."""

    case: Case
    indexer: mb.IndexerDims
    index_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request [L, Di] float32, as stored
    q_I: torch.Tensor  # [T, Hi, Di]
    weights: torch.Tensor  # [T, Hi] float32

    def plan(self, impl: object = None) -> mb.MLAPlan:
        return mb.plan(self.case.batch, self.case.dims, mb.Policy("absorb"), impl=impl,
                       indexer=self.indexer)  # fmt: skip


def make_dsa_case(
    dims: mb.MLADims,
    indexer: mb.IndexerDims,
    prefix_lens: list[int],
    new_lens: list[int],
    page_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.uint8,
    q_dtype: torch.dtype | None = None,
    seed: int = 0,
    impl: str | None = None,
    distinct_keys: int = 0,
) -> DsaCase:
    """A :func:`make_case` problem plus a paged index cache (uint8: vLLM's fp8 layout, or
    bf16 / fp16 / fp32 keys) written through ``write_index_keys`` (padding slots mixed in;
    never-written bytes 0xFF / NaN). ``q_dtype``: the indexer queries' dtype (default
    ``dtype``; float8_e4m3fn: e4m3 values). ``distinct_keys`` > 0: every key is one of that
    many vectors, and keys, queries and weights are small integers (weights in quarters), so
    every logit is exact in fp32 whatever the summation order: exact ties between positions
    in every implementation."""
    case = make_case(dims, prefix_lens, new_lens, page_size, dtype=dtype, cache_dtype=cache_dtype,
                     seed=seed, impl=impl)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 77)
    Hi, Di = indexer.n_heads, indexer.head_dim
    layout = (
        mb.IndexCacheLayout.named("fp8", Di, min(Di, 128)) if index_dtype == torch.uint8
        else mb.IndexCacheLayout("plain", Di, 0, index_dtype)
    )  # fmt: skip
    num_pages = case.kv_cache.shape[0]
    if index_dtype == torch.uint8:
        index_cache = torch.full((num_pages, page_size, layout.width), 0xFF, dtype=torch.uint8)
    else:
        index_cache = torch.full((num_pages, page_size, Di), float("nan")).to(index_dtype)
    bt = case.batch.block_table
    palette = torch.randint(-3, 4, (max(distinct_keys, 1), Di), generator=g).float()
    keys = []
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        L = p + n
        if distinct_keys:
            k = palette[torch.randint(0, distinct_keys, (L,), generator=g)]
        else:
            k = torch.randn(L, Di, generator=g) * (1 + torch.rand(L, 1, generator=g))
        k = k.to(index_dtype if index_dtype != torch.uint8 else dtype)
        slots = torch.tensor(
            [int(bt[i, t // page_size]) * page_size + t % page_size for t in range(L)],
            dtype=torch.long,
        )
        mb.write_index_keys(
            index_cache,
            torch.cat([k, torch.full((2, Di), 99.0).to(k.dtype)]),
            torch.cat([slots, torch.full((2,), -1)]),
            layout,
            impl=impl,
        )
        fp8 = index_dtype == torch.uint8
        keys.append(index_fp8_dequantized(k, layout.quant_block_size) if fp8 else k.float())
    T = sum(new_lens)
    qdt = q_dtype or dtype
    if distinct_keys:
        q_I = torch.randint(-3, 4, (T, Hi, Di), generator=g).float().to(qdt)
        weights = torch.randint(-4, 5, (T, Hi), generator=g).float() / 4
        return DsaCase(case, indexer, index_cache, keys, q_I, weights)
    q = torch.randn(T, Hi, Di, generator=g)
    q_I = (q * 8).to(qdt) if qdt == mb.FP8_DTYPE else q.to(qdt)
    weights = torch.randn(T, Hi, generator=g) / Hi**0.5
    return DsaCase(case, indexer, index_cache, keys, q_I, weights)


# ---- attention over key sets: a second paged cache next to the latent cache ----------------
@dataclass
class KeySetCase:
    """A :func:`make_case` problem plus a second cache (its own shuffled pages, page size and
    block table; never-written rows NaN / 0xFF), the rows both caches hold and absorbed-form
    queries."""

    case: Case
    extra: mb.ops.KeyCache
    rows: list[torch.Tensor]  # per request [L_i, r + rope] float32, as the main cache holds them
    rows2: list[torch.Tensor]  # per request [L2_i, r + rope] float32, as the second cache holds
    q_lat: torch.Tensor  # [T, H, r]
    q_pe: torch.Tensor  # [T, H, rope]

    def plan(self, impl: object = None, window: object = None) -> mb.MLAPlan:
        return mb.plan(self.case.batch, self.case.dims, mb.Policy("absorb"), impl=impl,
                       window=window)  # fmt: skip


def make_keyset_case(
    dims: mb.MLADims,
    prefix_lens: list[int],
    new_lens: list[int],
    page_size: int,
    lens2: list[int],
    page_size2: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> KeySetCase:
    """The main cache of :func:`make_case` (written by the torch implementation) and a second
    cache of ``lens2[i]`` rows per request in the same row format, written the same way."""
    case = make_case(dims, prefix_lens, new_lens, page_size, dtype=dtype, cache_dtype=cache_dtype,
                     seed=seed, impl="torch")  # fmt: skip
    g = torch.Generator().manual_seed(seed + 91)
    rng = random.Random(seed + 91)
    r, rope = dims.kv_lora_rank, dims.qk_rope_head_dim
    cdt = case.kv_cache.dtype
    need = [-(-n // page_size2) for n in lens2]
    num_pages = sum(need) + 2
    perm = list(range(1, num_pages))
    rng.shuffle(perm)
    table = torch.zeros(len(lens2), max(need + [1]) + 1, dtype=torch.int32)
    if cdt == torch.uint8:
        cache = torch.full((num_pages, page_size2, case.kv_cache.shape[2]), 0xFF, dtype=cdt)
    else:
        cache = torch.full((num_pages, page_size2, r + rope), float("nan")).to(cdt)
    rows2, k = [], 0
    for i, n in enumerate(lens2):
        table[i, : need[i]] = torch.tensor(perm[k : k + need[i]], dtype=torch.int32)
        k += need[i]
        c = torch.randn(n, r, generator=g).to(dtype)
        kp = torch.randn(n, rope, generator=g).to(dtype)
        slots = torch.tensor(
            [int(table[i, e // page_size2]) * page_size2 + e % page_size2 for e in range(n)],
            dtype=torch.long,
        )
        mb.write_latent(cache, c, kp, slots, case.kv_scale, impl="torch")
        if case.kv_scale is not None:
            stored = torch.cat([c, kp], -1).float() / case.kv_scale
            deq = stored.clamp(-448, 448).to(mb.FP8_DTYPE).float() * case.kv_scale
            c, kp = deq[:, :r], deq[:, r:]
        if cdt == torch.uint8:
            c = ds_mla_dequantized(c)
        rows2.append(torch.cat([c.float(), kp.float()], -1))
    extra = mb.ops.KeyCache(cache, table, torch.tensor(lens2, dtype=torch.int32))
    rows = [torch.cat([c.float(), kp.float()], -1) for c, kp in zip(case.c_kv, case.k_pe)]
    T, H = sum(new_lens), dims.num_heads
    q_lat = torch.randn(T, H, r, generator=g).to(dtype)
    q_pe = torch.randn(T, H, rope, generator=g).to(dtype)
    return KeySetCase(case, extra, rows, rows2, q_lat, q_pe)
