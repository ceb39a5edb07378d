"""Absorbed, normal and full (policy) attention against the paper's decompressed oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.policy import CPU_PROFILE
from mla_backend.testing.cases import DIMS, assert_close_to_oracle, make_case

BATCHES = {
    "decode1": ([7], [1]),
    "decode_ragged": ([0, 5, 33, 64, 130], [1, 1, 1, 1, 1]),
    "prefill": ([0, 0], [19, 40]),
    "extend_on_prefix": ([17, 64, 3], [5, 9, 31]),
    "mixed": ([0, 50, 12, 0], [23, 1, 4, 1]),
}


@pytest.mark.parametrize("dims_name", list(DIMS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("path", ["absorb", "normal"])
def test_paths_match_oracle_fp32(
    dims_name: str, page_size: int, batch_name: str, path: str
) -> None:
    if dims_name == "lite" and page_size == 1:
        pytest.skip("covered by smaller dims; keeps the grid fast")
    prefix, new = BATCHES[batch_name]
    case = make_case(DIMS[dims_name], prefix, new, page_size, seed=hash(batch_name) % 1000)
    attn = mb.MLAAttention(case.dims, case.weights)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan(path))
    assert out.shape == (case.batch.num_tokens, case.dims.num_heads, case.dims.v_head_dim)
    assert_close_to_oracle(out, case.oracle(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["absorb", "normal", "cost"])
@pytest.mark.parametrize("dims_name", ["odd", "lite"])
def test_half_precision(dtype: torch.dtype, path: str, dims_name: str) -> None:
    case = make_case(DIMS[dims_name], [40, 0, 7], [1, 30, 6], 16, dtype=dtype, seed=3)
    attn = mb.MLAAttention(case.dims, case.weights)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan(path))
    assert out.dtype == dtype
    assert_close_to_oracle(out, case.oracle(), dtype)


@pytest.mark.parametrize("path", ["absorb", "normal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(path: str, dtype: torch.dtype) -> None:
    """The oracle sees the dequantized cache contents: what remains is the kernels' error."""
    case = make_case(DIMS["lite"], [70, 0], [1, 12], 16, dtype=dtype, cache_dtype=mb.FP8_DTYPE)
    attn = mb.MLAAttention(case.dims, case.weights)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan(path), kv_scale=case.kv_scale)
    assert_close_to_oracle(out, case.oracle(), dtype, factor=1.5)


def test_lse_is_logsumexp_of_scaled_scores() -> None:
    case = make_case(DIMS["odd"], [9, 0], [3, 4], 4)
    d = case.dims
    scale = 0.3
    q_lat = mb.absorb_q(case.q_nope, case.weights)
    _, lse = mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, case.plan(), scale)
    _, lse_n = mb.normal_attention(
        case.q_nope, case.q_pe, case.kv_cache, case.plan("normal"), case.weights, scale
    )
    row = 0
    for c, kp, p, n in zip(case.c_kv, case.k_pe, case.batch.prefix_lens, case.batch.new_lens):
        w = case.kv_b.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, -1)
        k_nope = torch.einsum("lr,hdr->hld", c, w[:, : d.qk_nope_head_dim])
        for j in range(n):
            qn = case.q_nope[row + j].float()  # [H, nope]
            s = (torch.einsum("hd,hld->hl", qn, k_nope) + case.q_pe[row + j] @ kp.T) * scale
            expect = torch.logsumexp(s[:, : p + j + 1], dim=-1)
            torch.testing.assert_close(lse[row + j], expect, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lse_n[row + j], expect, atol=1e-4, rtol=1e-4)
        row += n


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_normal_chunked_prefix_matches_oracle(chunk: int) -> None:
    case = make_case(DIMS["odd"], [100, 3, 0], [7, 20, 5], 8)
    out, _ = mb.normal_attention(
        case.q_nope,
        case.q_pe,
        case.kv_cache,
        case.plan("normal"),
        case.weights,
        case.dims.default_softmax_scale,
        chunk_tokens=chunk,
    )
    assert_close_to_oracle(out, case.oracle(), torch.float32)


def test_normal_uses_given_new_latents() -> None:
    """new_c_kv/new_k_pe replace reading the new tokens back from the cache: passing zeros
    for the new c_kv must equal the oracle on a sequence whose new c_kv rows are zero."""
    case = make_case(DIMS["tiny"], [5, 0], [4, 6], 4)
    rows_c = torch.cat([c[p:] for c, p in zip(case.c_kv, case.batch.prefix_lens)])
    rows_p = torch.cat([k[p:] for k, p in zip(case.k_pe, case.batch.prefix_lens)])
    out, _ = mb.normal_attention(
        case.q_nope,
        case.q_pe,
        case.kv_cache,
        case.plan("normal"),
        case.weights,
        case.dims.default_softmax_scale,
        new_c_kv=torch.zeros_like(rows_c),
        new_k_pe=rows_p,
    )
    for c, p in zip(case.c_kv, case.batch.prefix_lens):
        c[p:] = 0
    assert_close_to_oracle(out, case.oracle(), torch.float32)


def test_long_context_8k_bf16_decode_and_extend() -> None:
    case = make_case(DIMS["lite"], [8192, 6000], [1, 16], 64, dtype=torch.bfloat16)
    for path in ("absorb", "normal"):
        attn = mb.MLAAttention(case.dims, case.weights)
        out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan(path))
        assert_close_to_oracle(out, case.oracle(), torch.bfloat16)


@pytest.mark.slow
def test_long_context_32k() -> None:
    case = make_case(DIMS["lite"], [32768, 20000], [1, 4], 64, dtype=torch.bfloat16)
    attn = mb.MLAAttention(case.dims, case.weights)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan("absorb"))
    assert_close_to_oracle(out, case.oracle(), torch.bfloat16)


def test_mixed_policy_scatters_rows_back() -> None:
    """With the cost policy a batch is split; every request's rows come back in place."""
    case = make_case(DIMS["lite"], [0, 300, 0], [200, 1, 3], 16, seed=11)
    attn = mb.MLAAttention(case.dims, case.weights)
    # the torch path's CPU profile splits this step (the native one absorbs all of it)
    plan = case.plan(mb.Policy("cost", profile=CPU_PROFILE))
    out = attn(case.q_nope, case.q_pe, case.kv_cache, plan)
    assert plan.mode == "mixed"
    assert_close_to_oracle(out, case.oracle(), torch.float32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    heads=st.integers(1, 5),
    r=st.integers(1, 40),
    nope=st.integers(1, 12),
    rope_half=st.integers(0, 4),
    v=st.integers(1, 12),
    page_size=st.sampled_from([1, 2, 3, 16, 64]),
    path=st.sampled_from(["absorb", "normal"]),
)
def test_property_any_dims_any_layout(data, heads, r, nope, rope_half, v, page_size, path) -> None:
    dims = mb.MLADims(heads, r, nope, 2 * rope_half, v)
    nreq = data.draw(st.integers(1, 4))
    prefix = data.draw(st.lists(st.integers(0, 90), min_size=nreq, max_size=nreq))
    new = data.draw(st.lists(st.integers(1, 12), min_size=nreq, max_size=nreq))
    seed = data.draw(st.integers(0, 10_000))
    case = make_case(dims, prefix, new, page_size, seed=seed)
    attn = mb.MLAAttention(dims, case.weights)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan(path))
    assert_close_to_oracle(out, case.oracle(), torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, mb.FP8_DTYPE])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("flash_max_heads", [0, 64], ids=["gemm", "flash"])
def test_torch_decode_paths_match_oracle(
    cache_dtype: torch.dtype, page_size: int, flash_max_heads: int
) -> None:
    """Many single-token requests on the torch path: through the grouped bmm path (similar
    lengths share one gather and bmm; padding columns of the block table hold garbage page ids
    on purpose) and through the fused flash decode path; LSE checked too."""
    from mla_backend.ops.torch import Kernels
    from mla_backend.ops.torch.absorbed_attention import decode_groups

    impl = Kernels(flash_max_heads=flash_max_heads)
    prefix = [40, 47, 33, 45, 300, 290, 0, 310]
    case = make_case(
        DIMS["odd"], prefix, [1] * 8, page_size, cache_dtype=cache_dtype, phase=mb.Phase.DECODE
    )
    bt = case.batch.block_table
    for i, L in enumerate(case.batch.kv_lens):
        bt[i, -(-L // page_size) :] = 10**6  # out-of-range garbage beyond the request's pages
    plan = case.plan("absorb", impl=impl)
    groups, rest = decode_groups(plan.step, case.dims.num_heads, impl.tuning)
    assert sum(len(g) for g in groups) >= 6 and len(groups) >= 2
    attn = mb.MLAAttention(case.dims, case.weights)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, plan, kv_scale=case.kv_scale)
    assert_close_to_oracle(out, case.oracle(), torch.float32)
    # LSE of decode rows against a direct computation over the stored latents
    q_lat = mb.absorb_q(case.q_nope, case.weights)
    _, lse = mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, plan, 0.1, case.kv_scale)
    for i, (c, kp) in enumerate(zip(case.c_kv, case.k_pe)):
        s = (q_lat[i] @ c.T + case.q_pe[i] @ kp.T) * 0.1
        torch.testing.assert_close(lse[i], torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_absorbed_many_kv_splits_with_causal_extends(dtype: torch.dtype) -> None:
    """Tiny splits and query blocks force LSE merging across many KV splits, including
    splits that lie entirely past some new tokens' causal limit (none of their keys)."""
    from mla_backend.ops.torch import Kernels

    # blocks of 7 new tokens (H=3)
    impl = Kernels(max_tile_elements=512, min_split_tokens=8, max_query_rows=21)
    case = make_case(DIMS["odd"], [0, 37, 5], [60, 25, 1], 8, dtype=dtype, seed=5)
    q_lat = mb.absorb_q(case.q_nope, case.weights)
    _, lse_ref = mb.normal_attention(
        case.q_nope, case.q_pe, case.kv_cache, case.plan("normal"), case.weights, 0.2
    )
    o_lat, lse = mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, case.plan(impl=impl), 0.2)
    assert torch.isfinite(o_lat).all()
    torch.testing.assert_close(
        lse,
        lse_ref,
        atol=5e-2 if dtype == torch.bfloat16 else 1e-4,
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
    )
    out = mb.apply_W_UV(o_lat, case.weights)
    assert_close_to_oracle(out, case.oracle(0.2), dtype)


def test_mla_attention_chunk_tokens_setting() -> None:
    case = make_case(DIMS["odd"], [50, 9], [4, 3], 8)
    attn = mb.MLAAttention(case.dims, case.weights, chunk_tokens=5)
    out = attn(case.q_nope, case.q_pe, case.kv_cache, case.plan("normal"))
    assert_close_to_oracle(out, case.oracle(), torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        mb.MLAAttention(case.dims, case.weights, chunk_tokens=0)


def test_policy_decides_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy runs once, in plan(); every layer's call reads the plan's decision."""
    case = make_case(DIMS["lite"], [0, 300, 0], [200, 1, 3], 16, seed=11)
    policy = mb.Policy("cost", profile=CPU_PROFILE)
    calls = []
    real = policy.choose
    monkeypatch.setattr(policy, "choose", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan = case.plan(policy)
    layers = [mb.MLAAttention(case.dims, case.weights) for _ in range(3)]
    outs = [attn(case.q_nope, case.q_pe, case.kv_cache, plan) for attn in layers]
    assert len(calls) == 1 and plan.mode == "mixed" and plan.uses_normal
    assert plan.absorbed.reqs == (1, 2) and plan.normal.reqs == (0,)
    for out in outs:
        assert_close_to_oracle(out, case.oracle(), torch.float32)
