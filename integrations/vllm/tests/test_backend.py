"""Backend-level tests: vLLM metadata (CommonAttentionMetadata -> our builder -> the step's
plan) + MLAAbsorbImpl against the one oracle, ``mla_backend.testing.reference`` (through
``Case.oracle``).

Each case comes from the shared builder ``mla_backend.testing.cases.make_case`` (random
latents, queries and ``kv_b_proj``; requests over randomly permuted physical blocks, block 0
unused like vLLM's null block). The test lays the latents into a vLLM-shaped cache (NaN where
nothing is written; raw bytes for fp8) through the impl itself: the prefix in an earlier
"step", the new tokens through ``do_kv_cache_update`` with vLLM's slot mapping and a padding
slot (-1); then ``forward_mha`` (which serves every token of the step, see backend.py) fills
an output with one padding row, which must come back zero.
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
from mla_backend.cache_layout import CacheLayout
from mla_backend.testing.cases import ds_mla_dequantized, make_case

DIMS = {
    # MLADims(heads, r, nope, rope, v)
    "deepseek": mb.MLADims(16, 512, 128, 64, 128),
    "odd": mb.MLADims(4, 96, 48, 32, 40),
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


def vllm_config(dims: mb.MLADims, num_spec_tokens: int = 0) -> SimpleNamespace:
    """What the metadata builder reads of vLLM's config (model dims, speculation)."""
    hf = SimpleNamespace(
        num_attention_heads=dims.num_heads,
        kv_lora_rank=dims.kv_lora_rank,
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
    )
    model = SimpleNamespace(hf_text_config=hf, get_num_attention_heads=lambda _p: dims.num_heads)
    spec = SimpleNamespace(num_speculative_tokens=num_spec_tokens) if num_spec_tokens else None
    return SimpleNamespace(speculative_config=spec, model_config=model, parallel_config=None)


def _impl(dims: mb.MLADims, kv_b: torch.Tensor, dtype: torch.dtype, kv_cache_dtype: str):
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    nope, v = dims.qk_nope_head_dim, dims.v_head_dim
    kv_b_proj = torch.nn.Linear(r, H * (nope + v), bias=False)
    with torch.no_grad():
        kv_b_proj.weight.copy_(kv_b)
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
        kv_b_proj=kv_b_proj,
    )
    impl.process_weights_after_loading(dtype)
    return impl


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
    r, rope, nope = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim
    H, v = dims.num_heads, dims.v_head_dim
    reqs = CASES[case]
    if shared_prefix:
        reqs = [(max(p, shared_prefix), n) for p, n in reqs]
    prefix_lens, new_lens = [p for p, _ in reqs], [n for _, n in reqs]
    c = make_case(dims, prefix_lens, new_lens, page, dtype=dtype, seed=seed)
    table = c.batch.block_table.clone()
    c_kv = [x.to(dtype).clone() for x in c.c_kv]
    k_pe = [x.to(dtype).clone() for x in c.k_pe]
    if shared_prefix:  # a prefix-cache hit: every request reuses request 0's prefix blocks
        n_shared = shared_prefix // page
        table[:, :n_shared] = table[0, :n_shared]
        for i in range(1, len(reqs)):
            c_kv[i][:shared_prefix] = c_kv[0][:shared_prefix]
            k_pe[i][:shared_prefix] = k_pe[0][:shared_prefix]
    impl = _impl(dims, c.kv_b, dtype, kv_cache_dtype)
    fp8 = kv_cache_dtype == "fp8"
    ds = kv_cache_dtype == "fp8_ds_mla"
    # vLLM allocates an fp8 cache as raw bytes (the impl views it as float8_e4m3fn); never
    # written rows hold NaN (0x7f is NaN in e4m3fn). fp8_ds_mla: uint8 rows of the core's
    # layout width, in vLLM's 4-D [blocks, 1, block_size, bytes] shape; 0xFF = NaN values
    # and NaN scales
    shape = (c.kv_cache.shape[0], page, r + rope)
    if ds:
        width = CacheLayout.ds_mla(r, rope, dtype).bytes_per_token
        cache = torch.full((shape[0], 1, page, width), 0xFF, dtype=torch.uint8)
    elif fp8:
        cache = torch.full(shape, 0x7F, dtype=torch.uint8)
    else:
        cache = torch.full(shape, float("nan"), dtype=dtype)
    k_scale = torch.tensor(kv_scale, dtype=torch.float32)

    # "earlier steps": prefix latents (shared blocks are written once per request: same data)
    for i, p in enumerate(prefix_lens):
        if p:
            slots = torch.tensor(_slots(table, i, range(p), page))
            impl.do_kv_cache_update(
                c_kv[i][:p], k_pe[i][:p].unsqueeze(1), cache, slots, kv_cache_dtype, k_scale
            )
    # this step: new tokens, with a padding slot (-1) appended like vLLM's padded batches
    new_ckv = torch.cat([x[p:] for x, p in zip(c_kv, prefix_lens, strict=True)])
    new_kpe = torch.cat([x[p:] for x, p in zip(k_pe, prefix_lens, strict=True)])
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
    builder = MLAAbsorbMetadataBuilder(
        SimpleNamespace(block_size=page), ["layer.0"], vllm_config(dims), torch.device("cpu")
    )
    builder.policy = mb.Policy(mode=policy)
    md = builder.build(0, common)
    assert md.num_decode_tokens == 0 and md.num_actual_tokens == T
    assert md.plan.num_tokens == T and md.plan.dims == dims

    # one padding row past the step's tokens (vLLM pads token tensors)
    q = torch.cat([c.q_nope, c.q_pe], -1).to(dtype)
    q = torch.cat([q, torch.full((1, H, nope + rope), 7.0, dtype=dtype)])
    out = torch.full((T + 1, H * v), float("nan"), dtype=dtype)
    impl.forward_mha(q, new_ckv, new_kpe, cache, md, k_scale, out)
    assert torch.equal(out[T:], torch.zeros_like(out[T:])), "padding rows must be zero"

    # the oracle on what the cache is supposed to hold
    if fp8:

        def roundtrip(x: torch.Tensor) -> torch.Tensor:
            return (x.float() / kv_scale).to(torch.float8_e4m3fn).float() * kv_scale

        c_kv = [roundtrip(x) for x in c_kv]
        k_pe = [roundtrip(x) for x in k_pe]
    if ds:  # per-token, per-128-tile scales computed independently of the core; rope as is
        c_kv = [ds_mla_dequantized(x) for x in c_kv]
        k_pe = [x.float() for x in k_pe]
    c.c_kv, c.k_pe = c_kv, k_pe
    return out[:T].float().view(T, H, v), c.oracle((nope + rope) ** -0.5)


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


@pytest.mark.parametrize(
    ("dims_name", "case", "policy", "dtype"),
    [
        ("deepseek", "decode", "absorb", torch.bfloat16),
        ("deepseek", "mixed", "absorb", torch.bfloat16),
        ("deepseek", "mixed", "normal", torch.bfloat16),
        ("deepseek", "chunked_prefill", "cost", torch.bfloat16),
        ("deepseek", "spec_verify", "cost", torch.bfloat16),
        ("odd", "mixed", "cost", torch.float32),  # r 96: one partial tile; rope in fp32
        ("odd", "prefill", "normal", torch.float32),
    ],
)
def test_fp8_ds_mla_cache(dims_name: str, case: str, policy: str, dtype: torch.dtype) -> None:
    # oracle on the dequantized cache: each token's 128-value tiles times their own scale
    out, ref = _run_case(dims_name, case, dtype, "fp8_ds_mla", policy, seed=13)
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("page", [1, 64])
def test_fp8_ds_mla_block_sizes_and_prefix_hit(page: int) -> None:
    out, ref = _run_case(
        "deepseek",
        "mixed",
        torch.bfloat16,
        "fp8_ds_mla",
        "cost",
        seed=17,
        page=page,
        shared_prefix=64,
    )
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_fp8_ds_mla_impl_writes_the_core_layout_and_rejects_a_wrong_width() -> None:
    d = DIMS["deepseek"]
    kv_b = torch.randn(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)
    impl = _impl(d, kv_b, torch.bfloat16, "fp8_ds_mla")
    layout = impl.ds_layout
    assert layout is not None and layout.bytes_per_token == 656
    assert impl._kv_scale(torch.tensor(0.5)) is None  # no per-tensor scale for this layout
    c_kv = (torch.randn(5, 512) * torch.logspace(-2, 1, 5)[:, None]).to(torch.bfloat16)
    k_pe = torch.randn(5, 64).to(torch.bfloat16)
    cache = torch.zeros(2, 1, 4, 656, dtype=torch.uint8)
    impl.do_kv_cache_update(
        c_kv, k_pe.unsqueeze(1), cache, torch.tensor([4, 5, 6, 7, 0]), "fp8_ds_mla", None
    )
    rows = cache.view(8, 656)[[4, 5, 6, 7, 0]]
    assert torch.equal(rows, layout.pack(c_kv, k_pe))
    back = layout.unpack(rows, torch.float32)
    torch.testing.assert_close(back[:, :512], ds_mla_dequantized(c_kv), atol=0, rtol=0)
    assert torch.equal(back[:, 512:], k_pe.float())
    with pytest.raises(ValueError, match="656"):
        impl.do_kv_cache_update(
            c_kv,
            k_pe.unsqueeze(1),
            torch.zeros(2, 1, 4, 576, dtype=torch.uint8),
            torch.arange(5),
            "fp8_ds_mla",
            None,
        )


@pytest.mark.parametrize("source", ["impl", "config"])
@pytest.mark.parametrize(
    ("r", "rope", "dtype", "want"),
    [(512, 64, torch.bfloat16, 656), (512, 64, torch.float32, 784), (96, 32, torch.float32, 228)],
)
def test_fp8_ds_mla_spec_is_sized_by_the_core_layout(
    monkeypatch, source, r, rope, dtype, want
) -> None:
    """vLLM's MLA layer asks for 656 B per token whatever the dims; the backend's
    customize_spec makes it the core layout's bytes for the model's r, rope and dtype, from
    the impl built in this process (the engine's case: no current config on the CPU worker)
    or else the current vLLM config."""
    import vllm.config
    from mla_backend_integrations.vllm import backend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    monkeypatch.setattr(backend, "_DS_MLA_LAYOUTS", {})
    if source == "impl":
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
        d = mb.MLADims(4, r, 32, rope, 32)
        _impl(d, torch.randn(4 * 64, r), dtype, "fp8_ds_mla")
    else:
        hf = SimpleNamespace(kv_lora_rank=r, qk_rope_head_dim=rope)
        cfg = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf, dtype=dtype))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)

    def spec(cache_dtype: str, content: int | None) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=r + rope,
            dtype=torch.uint8 if cache_dtype == "fp8_ds_mla" else dtype,
            cache_dtype_str=cache_dtype,
            kv_quant_mode=get_kv_quant_mode(cache_dtype),
            state_content_bytes=content,
        )

    got = MLAAbsorbBackend.customize_spec(spec("fp8_ds_mla", 656))
    assert got.state_content_size_bytes == want == CacheLayout.ds_mla(r, rope, dtype).width
    assert got.page_size_bytes == 16 * want
    plain = spec("auto", None)
    assert MLAAbsorbBackend.customize_spec(plain) == plain
    assert MLAAbsorbBackend.supports_kv_cache_dtype("fp8_ds_mla")


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_bytes_beyond_checkpoint(dtype: torch.dtype) -> None:
    """The core keeps exactly one W_UK + W_UV copy in the model dtype: H*(nope+v)*r elements
    (the figure benchmarks/compare.py reports for MLA_ABSORB)."""
    from mla_backend.weights import extra_weight_bytes

    d = DIMS["deepseek"]
    K = d.num_heads * (d.qk_nope_head_dim + d.v_head_dim) * d.kv_lora_rank
    impl = _impl(d, torch.randn(K // d.kv_lora_rank, d.kv_lora_rank), dtype, "auto")
    assert extra_weight_bytes(impl.attn.weights) == K * dtype.itemsize
    assert impl.attn.weights.W_UK.dtype == dtype
