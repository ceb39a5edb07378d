"""Merging attention over key shards (decode context parallel) against the fp64 oracle.

Each shard's partial result is attention over its own keys only; :func:`mb.merge_attention_shards`
must give attention over all keys. Shards come from random splits (empty shards, shards of one
key, everything in one shard), and from vLLM's DCP interleaving. Partials are made two ways: in
float64 from the oracle (the merge alone), and by the core's absorbed kernels over a paged cache
holding one shard's latents (what a DCP rank computes), merged and compared with
:func:`mla_backend.testing.reference.plain_attention` over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.testing.reference import plain_attention

NAN = float("nan")


def _shard_of_keys(draw: st.DrawFn, L: int, S: int) -> list[int]:
    """A shard id per key: random, with some shards forced empty and some holding one key."""
    kind = draw(st.sampled_from(["random", "one_key_shards", "all_in_one", "interleaved"]))
    if kind == "all_in_one":
        s = draw(st.integers(0, S - 1))
        return [s] * L
    if kind == "interleaved":
        interleave = draw(st.integers(1, 4))
        return [(p // interleave) % S for p in range(L)]
    owners = [draw(st.integers(0, S - 1)) for _ in range(L)]
    if kind == "one_key_shards" and L >= 2:
        # shard 0 holds exactly one key, shard S-1 none (when S > 2)
        owners = [1 % S if o == 0 else o for o in owners]
        owners[draw(st.integers(0, L - 1))] = 0
        if S > 2:
            owners = [S - 2 if o == S - 1 else o for o in owners]
    return owners


@st.composite
def shard_problems(draw: st.DrawFn) -> dict:
    S = draw(st.integers(1, 5))
    L = draw(st.integers(1, 40))
    return dict(
        S=S,
        L=L,
        n=draw(st.integers(1, 3)),
        H=draw(st.integers(1, 6)),
        dk=draw(st.integers(1, 24)),
        dv=draw(st.integers(1, 20)),
        owners=_shard_of_keys(draw, L, S),
        seed=draw(st.integers(0, 2**16)),
    )


def _oracle_partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owners: list[int], S: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, n, H, Dv] float32 / [S, n, H] float32 partials, each query row seeing every key of
    its shard (NaN outputs and -inf lse for an empty shard)."""
    n, H = q.shape[0], q.shape[1]
    o = torch.full((S, n, H, v.shape[-1]), NAN)
    lse = torch.full((S, n, H), float("-inf"))
    for s in range(S):
        idx = torch.tensor([p for p, w in enumerate(owners) if w == s], dtype=torch.long)
        if idx.numel() == 0:
            continue
        o_s, lse_s = plain_attention(q, k[idx], v[idx], idx.numel() - 1, scale, None)
        o[s], lse[s] = o_s.float(), lse_s.float()
    return o, lse


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shard_problems())
def test_merge_of_oracle_partials_is_attention_over_all_keys(p: dict) -> None:
    g = torch.Generator().manual_seed(p["seed"])
    n, H, L = p["n"], p["H"], p["L"]
    q = torch.randn(n, H, p["dk"], generator=g, dtype=torch.float64)
    k = torch.randn(L, 1, p["dk"], generator=g, dtype=torch.float64) * 2
    v = torch.randn(L, 1, p["dv"], generator=g, dtype=torch.float64)
    scale = 0.7
    o_parts, lse_parts = _oracle_partials(q, k, v, p["owners"], p["S"], scale)
    o, lse = mb.merge_attention_shards(o_parts, lse_parts)
    want_o, want_lse = plain_attention(q, k, v, L - 1, scale, None)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), "an empty shard leaked NaN into the merge"
    torch.testing.assert_close(o.double(), want_o, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=1e-6)


def test_rows_with_every_shard_empty_are_zero_with_minus_inf_lse() -> None:
    o = torch.full((3, 2, 4, 5), NAN)
    lse = torch.full((3, 2, 4), float("-inf"))
    o[1, 0], lse[1, 0] = 2.0, 0.5  # row 0 has one live shard, row 1 none
    out, out_lse = mb.merge_attention_shards(o, lse, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0].float(), torch.full((4, 5), 2.0))
    assert torch.equal(out[1].float(), torch.zeros(4, 5))
    assert torch.equal(out_lse[0], torch.full((4,), 0.5))
    assert torch.isneginf(out_lse[1]).all()


def test_merge_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[S, T, H, D\]"):
        mb.merge_attention_shards(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 5))


def _shard_cache(
    c_kv: torch.Tensor, k_pe: torch.Tensor, page_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard's latents [L_s, r], [L_s, rope] in a paged cache with reversed page order
    (NaN in every unwritten row); returns (cache, block_table row [1, pages])."""
    L = c_kv.shape[0]
    pages = -(-L // page_size)
    cache = torch.full((pages + 2, page_size, c_kv.shape[1] + k_pe.shape[1]), NAN).to(dtype)
    table = torch.arange(pages + 1, 1, -1, dtype=torch.int32)[None, :]  # pages..2 reversed
    slots = torch.tensor(
        [int(table[0, t // page_size]) * page_size + t % page_size for t in range(L)]
    )
    mb.write_latent(cache, c_kv.to(dtype), k_pe.to(dtype), slots)
    return cache, table


@pytest.mark.parametrize("impl", ["torch", None])  # None: the device's (native C++ on CPU)
@pytest.mark.parametrize(
    "dims", [mb.MLADims(3, 40, 12, 6, 20), mb.MLADims(16, 512, 128, 64, 128)], ids=["odd", "lite"]
)
@pytest.mark.parametrize("split", ["interleave1", "interleave4", "one_token_and_empty"])
def test_absorbed_kernels_over_shards_merge_to_oracle(
    impl: str | None, dims: mb.MLADims, split: str
) -> None:
    """What a DCP rank does: absorbed attention over its shard of the latent cache, all query
    heads, one query row per request; the merged result equals attention over the whole
    sequence (fp64 oracle) within fp32 kernel rounding."""
    g = torch.Generator().manual_seed(7)
    S, page_size, scale = 3, 4, 0.11
    lens = [1, 2, 5, 23, 40]  # short requests leave some shards empty
    r, rope, H = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.num_heads
    seqs = [(torch.randn(L, r, generator=g), torch.randn(L, rope, generator=g)) for L in lens]
    q_lat = torch.randn(len(lens), H, r, generator=g)
    q_pe = torch.randn(len(lens), H, rope, generator=g)
    o_parts = torch.full((S, len(lens), H, r), NAN)
    lse_parts = torch.full((S, len(lens), H), float("-inf"))
    for i, (c_kv, k_pe) in enumerate(seqs):
        L = c_kv.shape[0]
        if split == "one_token_and_empty":
            owners = [0] + [2] * (L - 1)  # shard 0: one token, shard 1: empty
        else:
            inter = int(split.removeprefix("interleave"))
            owners = [(p // inter) % S for p in range(L)]
        for s in range(S):
            idx = torch.tensor([p for p, w in enumerate(owners) if w == s], dtype=torch.long)
            if idx.numel() == 0:
                continue
            cache, table = _shard_cache(c_kv[idx], k_pe[idx], page_size, torch.float32)
            batch = mb.MLABatch.build([idx.numel() - 1], [1], table, page_size, mb.Phase.DECODE)
            plan = mb.plan(batch, dims, mb.Policy("absorb"), impl=impl)
            o_s, lse_s = mb.absorbed_attention(
                q_lat[i : i + 1], q_pe[i : i + 1], cache, plan, scale
            )
            o_parts[s, i], lse_parts[s, i] = o_s[0], lse_s[0]
    o, lse = mb.merge_attention_shards(o_parts, lse_parts)
    for i, (c_kv, k_pe) in enumerate(seqs):
        L = c_kv.shape[0]
        q = torch.cat([q_lat[i], q_pe[i]], -1)[None].double()  # [1, H, r + rope]
        k = torch.cat([c_kv, k_pe], -1)[:, None].double()  # [L, 1, r + rope]: MQA
        want_o, want_lse = plain_attention(q, k, c_kv[:, None].double(), L - 1, scale, None)
        torch.testing.assert_close(o[i].double(), want_o[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[i].double(), want_lse[0], atol=2e-5, rtol=2e-5)
