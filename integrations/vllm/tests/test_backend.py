"""Backend-level tests: vLLM metadata (CommonAttentionMetadata -> our builder) + MLAAbsorbImpl
against the core's independent oracle ``mla_backend.testing.reference.reference_mla_attention``.

Each case lays requests out in a paged cache with randomly permuted physical blocks (block 0
is vLLM's null block and never used), writes the prefix latents in an earlier "step" and the
new tokens' latents through the impl's ``do_kv_cache_update`` (vLLM's slot mapping), then
runs ``forward_mha`` (which serves every token of the step, see backend.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mla_backend_integrations.vllm.backend import (
    MLAAbsorbBackend,
    MLAAbsorbImpl,
    MLAAbsorbMetadataBuilder,
    batch_phase,
)
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

import mla_backend as mb
from mla_backend.testing.reference import reference_mla_attention

DIMS = {
    # name: (heads, r, rope, nope, v)
    "deepseek": (16, 512, 64, 128, 128),
    "odd": (4, 96, 32, 48, 40),
}

# name: list of (prefix_len, new_len) per request
CASES = {
    "decode": [(37, 1), (1, 1), (64, 1), (200, 1)],
    "prefill": [(0, 23), (0, 1), (0, 70)],
    "mixed": [(50, 1), (0, 40), (17, 9), (90, 1), (33, 120)],
    "chunked_prefill": [(128, 64), (64, 64)],
    "spec_verify": [(40, 4), (71, 4), (5, 4)],
    "single_token_prompt": [(0, 1)],
}


def _impl(dims: tuple[int, ...], dtype: torch.dtype, kv_cache_dtype: str, seed: int):
    H, r, rope, nope, v = dims
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.nn.Linear(r, H * (nope + v), bias=False)
    with torch.no_grad():
        kv_b.weight.copy_(torch.randn(H * (nope + v), r, generator=g) * r**-0.5)
    impl = MLAAbsorbImpl(
        num_heads=H,
        head_size=r + rope,
        scale=(nope + rope) ** -0.5,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=r,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        qk_head_dim=nope + rope,
        v_head_dim=v,
        kv_b_proj=kv_b,
    )
    impl.process_weights_after_loading(dtype)
    return impl, kv_b.weight.detach().clone()


def _layout(reqs: list[tuple[int, int]], page: int, g: torch.Generator, shared_prefix: int):
    """Block table [B, max_pages] over randomly permuted physical blocks (0 = null block).
    With ``shared_prefix`` > 0, every request's first shared_prefix // page blocks are the
    same physical blocks (a prefix-cache hit)."""
    pages_needed = [-(-(p + n) // page) for p, n in reqs]
    max_pages = max(pages_needed) + 1
    n_shared = shared_prefix // page
    total = sum(pages_needed) + 4
    perm = (torch.randperm(total, generator=g) + 1).tolist()  # never block 0
    table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
    shared = perm[:n_shared]
    nxt = n_shared
    for i, need in enumerate(pages_needed):
        for j in range(need):
            if j < n_shared:
                table[i, j] = shared[j]
            else:
                table[i, j] = perm[nxt]
                nxt += 1
    return table, total + 1


def _slots(table: torch.Tensor, i: int, positions: range, page: int) -> list[int]:
    return [int(table[i, p // page]) * page + p % page for p in positions]


def _run_case(
    dims_name: str,
    case: str,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    policy: str,
    seed: int,
    page: int = 16,
    shared_prefix: int = 0,
    kv_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = DIMS[dims_name]
    H, r, rope, nope, v = dims
    reqs = CASES[case]
    if shared_prefix:
        reqs = [(max(p, shared_prefix), n) for p, n in reqs]
    g = torch.Generator().manual_seed(seed)
    impl, kv_b_w = _impl(dims, dtype, kv_cache_dtype, seed)
    impl.attn.policy = mb.Policy(mode=policy)
    table, num_blocks = _layout(reqs, page, g, shared_prefix)
    fp8 = kv_cache_dtype == "fp8"
    # vLLM allocates an fp8 cache as raw bytes; the impl views it as float8_e4m3fn
    cache = torch.zeros(num_blocks, page, r + rope, dtype=torch.uint8 if fp8 else dtype)
    k_scale = torch.tensor(kv_scale, dtype=torch.float32)

    # whole-sequence latents per request (shared prefix tokens identical across requests)
    shared_ckv = torch.randn(shared_prefix, r, generator=g)
    shared_kpe = torch.randn(shared_prefix, rope, generator=g)
    c_kv_seqs, k_pe_seqs = [], []
    for p, n in reqs:
        ckv = torch.randn(p + n, r, generator=g)
        kpe = torch.randn(p + n, rope, generator=g)
        ckv[:shared_prefix], kpe[:shared_prefix] = shared_ckv, shared_kpe
        c_kv_seqs.append(ckv.to(dtype))
        k_pe_seqs.append(kpe.to(dtype))

    # "earlier steps": prefix latents (shared blocks are written once per request: same data)
    for i, (p, _) in enumerate(reqs):
        if p:
            slots = torch.tensor(_slots(table, i, range(p), page))
            impl.do_kv_cache_update(
                c_kv_seqs[i][:p],
                k_pe_seqs[i][:p].unsqueeze(1),
                cache,
                slots,
                kv_cache_dtype,
                k_scale,
            )
    # this step: new tokens, with a padding slot (-1) appended like vLLM's padded batches
    new_ckv = torch.cat([c[p:] for c, (p, _) in zip(c_kv_seqs, reqs, strict=True)])
    new_kpe = torch.cat([k[p:] for k, (p, _) in zip(k_pe_seqs, reqs, strict=True)])
    slot_list = []
    for i, (p, n) in enumerate(reqs):
        slot_list += _slots(table, i, range(p, p + n), page)
    T = len(slot_list)
    pad_ckv = torch.cat([new_ckv, torch.full((1, r), 99.0, dtype=dtype)])
    pad_kpe = torch.cat([new_kpe, torch.full((1, rope), 99.0, dtype=dtype)])
    slot_mapping = torch.tensor(slot_list + [-1], dtype=torch.int64)
    impl.do_kv_cache_update(
        pad_ckv, pad_kpe.unsqueeze(1), cache, slot_mapping, kv_cache_dtype, k_scale
    )

    new_lens = [n for _, n in reqs]
    qsl = torch.tensor([0] + torch.tensor(new_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([p + n for p, n in reqs], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=len(reqs),
        num_actual_tokens=T,
        max_query_len=max(new_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=slot_mapping[:T],
    )
    spec = SimpleNamespace(block_size=page)
    builder = MLAAbsorbMetadataBuilder(
        spec, ["layer.0"], SimpleNamespace(speculative_config=None), torch.device("cpu")
    )
    md = builder.build(0, common)
    assert md.num_decode_tokens == 0 and md.num_actual_tokens == T

    q = torch.randn(T, H, nope + rope, generator=g).to(dtype)
    out = torch.full((T, H * v), float("nan"), dtype=dtype)
    impl.forward_mha(q, new_ckv, new_kpe, cache, md, k_scale, out)

    # oracle on what the cache is supposed to hold
    if fp8:

        def roundtrip(x: torch.Tensor) -> torch.Tensor:
            return (x.float() / kv_scale).to(torch.float8_e4m3fn).float() * kv_scale

        c_kv_seqs = [roundtrip(c) for c in c_kv_seqs]
        k_pe_seqs = [roundtrip(k) for k in k_pe_seqs]
    ref = reference_mla_attention(
        q[:, :, :nope],
        q[:, :, nope:],
        c_kv_seqs,
        k_pe_seqs,
        kv_b_w,
        nope,
        v,
        new_lens,
        (nope + rope) ** -0.5,
    )
    return out.float().view(T, H, v), ref


TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("policy", ["cost", "absorb", "normal"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dims_name", sorted(DIMS))
def test_fp32_cases_match_oracle(dims_name: str, case: str, policy: str) -> None:
    out, ref = _run_case(
        dims_name, case, torch.float32, "auto", policy, seed=sorted(CASES).index(case)
    )
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("case", ["mixed", "chunked_prefill"])
def test_block_sizes(case: str, page: int) -> None:
    out, ref = _run_case("odd", case, torch.float32, "auto", "cost", seed=7, page=page)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("policy", ["cost", "absorb", "normal"])
def test_prefix_hit_shared_blocks(policy: str) -> None:
    # all requests reuse the same 64-token prefix blocks (prefix cache hit)
    out, ref = _run_case(
        "deepseek", "mixed", torch.float32, "auto", policy, seed=3, shared_prefix=64
    )
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", ["mixed", "decode", "chunked_prefill"])
def test_bf16(case: str) -> None:
    out, ref = _run_case("deepseek", case, torch.bfloat16, "auto", "cost", seed=11)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_scale", [1.0, 0.05])
@pytest.mark.parametrize("policy", ["absorb", "normal"])
@pytest.mark.parametrize("case", ["mixed", "decode"])
def test_fp8_cache(case: str, policy: str, kv_scale: float) -> None:
    # oracle sees the fp8-rounded latents; the residual error is the bf16 query/compute
    out, ref = _run_case("deepseek", case, torch.bfloat16, "fp8", policy, seed=5, kv_scale=kv_scale)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_phase_mapping() -> None:
    assert batch_phase([1, 1, 1], 0) is mb.Phase.DECODE
    assert batch_phase([4, 4], 3) is mb.Phase.TARGET_VERIFY
    assert batch_phase([40, 7], 0) is mb.Phase.EXTEND
    assert batch_phase([1, 40], 0) is mb.Phase.MIXED
    assert batch_phase([], 0) is mb.Phase.IDLE


def test_backend_descriptor_accepts_any_mla_dims() -> None:
    reasons = MLAAbsorbBackend.validate_configuration(
        head_size=128,  # 96 + 32: outside vLLM's MLA 320/512/576
        dtype=torch.float32,
        kv_cache_dtype="fp8",
        block_size=48,
        use_mla=True,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type=AttentionType.DECODER,
    )
    assert reasons == []
    bad = MLAAbsorbBackend.validate_configuration(
        head_size=576,
        dtype=torch.float32,
        kv_cache_dtype="fp8_e5m2",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=True,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type=AttentionType.DECODER,
    )
    assert set(bad) >= {"kv_cache_dtype not supported", "non-MLA not supported"}


@pytest.mark.parametrize(
    ("kwarg", "value"),
    [
        ("sliding_window", 128),
        ("alibi_slopes", [0.5]),
        ("logits_soft_cap", 30.0),
        ("kv_cache_dtype", "fp8_e5m2"),
    ],
)
def test_impl_rejects_unsupported_settings(kwarg: str, value: object) -> None:
    kwargs = dict(
        num_heads=4,
        head_size=128,
        scale=0.1,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=96,
        qk_nope_head_dim=48,
        qk_rope_head_dim=32,
        qk_head_dim=80,
        v_head_dim=40,
        kv_b_proj=None,
    )
    kwargs[kwarg] = value
    with pytest.raises(ValueError, match=kwarg):
        MLAAbsorbImpl(**kwargs)
