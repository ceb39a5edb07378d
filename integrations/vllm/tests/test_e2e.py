"""End to end: greedy generation through vLLM with MLA_ABSORB vs transformers'
``DeepseekV2ForCausalLM`` (the oracle) on the same tiny random safetensors checkpoints.

Tolerances (fp32 model, stated here and in the README):
* fp32 latent cache: identical greedy tokens; |logprob_vllm - logprob_hf| <= 2e-3 for every
  generated token.
* fp8 latent cache (``kv_cache_dtype="fp8"``): the oracle is transformers with every cached
  latent rounded to float8_e4m3fn (conftest.HFOracle); identical greedy tokens and
  |logprob diff| <= 2e-2 (a latent in fp32 rounding to a different fp8 neighbour moves it
  by up to 6%).

One engine at a time (module-scoped, shut down before the next starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    HFOracle,
    generate_greedy,
    make_llm,
    random_prompts,
    shutdown,
    token_logprobs,
)

FP32_LOGPROB_ATOL = 2e-3
FP8_LOGPROB_ATOL = 2e-2


def _check_exact(oracle: HFOracle, prompts: list[list[int]], outs: list[Any], max_new: int):
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        want = oracle.greedy(prompt, max_new)
        assert got == want, f"prompt len {len(prompt)}: vLLM {got} != transformers {want}"
        ref = oracle.logprobs_along(prompt, got)
        ref_lp = ref[torch.arange(len(got)), torch.tensor(got)]
        diff = (torch.tensor(token_logprobs(out)) - ref_lp).abs().max().item()
        assert diff <= FP32_LOGPROB_ATOL, f"logprob diff {diff} (prompt len {len(prompt)})"


# ---------------------------------------------------------------------------------------
# DeepSeek-V2-Lite attention dims: chunked prefill (max_num_batched_tokens=256 < prompts),
# ragged mixed batches, prefix-cache hits.
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lite_llm(model_dirs: dict[str, Path]):
    llm = make_llm(
        model_dirs["lite"],
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=256,
        block_size=32,
    )
    yield llm
    shutdown(llm)


def test_lite_config_keeps_chunked_prefill_prefix_caching_and_native_rope(lite_llm) -> None:
    cfg = lite_llm.llm_engine.vllm_config
    assert cfg.attention_config.backend.name == "MLA_ABSORB"
    assert cfg.scheduler_config.enable_chunked_prefill
    assert cfg.cache_config.enable_prefix_caching
    assert cfg.scheduler_config.max_num_batched_tokens == 256
    assert "-rotary_embedding" in cfg.compilation_config.custom_ops


def test_lite_chunked_prefill_mixed_batch_matches_transformers(lite_llm, hf_oracles) -> None:
    # 600- and 300-token prompts are prefilled in 256-token chunks while the short ones decode
    prompts = random_prompts(1, [600, 7, 300, 45])
    outs = generate_greedy(lite_llm, prompts, 12)
    _check_exact(hf_oracles["lite"], prompts, outs, 12)


def test_lite_prefix_cache_hits_match_transformers(lite_llm, hf_oracles) -> None:
    base = random_prompts(2, [520])[0]
    first = generate_greedy(lite_llm, [base], 4)
    _check_exact(hf_oracles["lite"], [base], first, 4)
    tails = random_prompts(3, [30, 1, 90])
    prompts = [base[:512] + t for t in tails]
    outs = generate_greedy(lite_llm, prompts, 10)
    assert all((o.num_cached_tokens or 0) >= 256 for o in outs), [o.num_cached_tokens for o in outs]
    _check_exact(hf_oracles["lite"], prompts, outs, 10)


# ---------------------------------------------------------------------------------------
# Non-DeepSeek dims + q_lora, vLLM's default (torch.compile) mode, tiny chunks.
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_llm(model_dirs: dict[str, Path]):
    llm = make_llm(
        model_dirs["odd"],
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        enforce_eager=False,
    )
    yield llm
    shutdown(llm)


def test_odd_dims_compiled_matches_transformers(odd_llm, hf_oracles) -> None:
    prompts = random_prompts(4, [150, 3, 64, 200])
    outs = generate_greedy(odd_llm, prompts, 16)
    _check_exact(hf_oracles["odd"], prompts, outs, 16)
    # again, sharing the first 128 tokens of the first prompt (prefix hit on tiny blocks)
    again = [prompts[0][:128] + t for t in random_prompts(5, [5, 40])]
    outs = generate_greedy(odd_llm, again, 8)
    assert all((o.num_cached_tokens or 0) >= 64 for o in outs)
    _check_exact(hf_oracles["odd"], again, outs, 8)


# ---------------------------------------------------------------------------------------
# MoE layers (dense first layer, routed + shared experts), q_lora on.
# ---------------------------------------------------------------------------------------
def test_moe_matches_transformers(model_dirs, hf_oracles) -> None:
    llm = make_llm(model_dirs["moe"], enable_prefix_caching=True, max_num_batched_tokens=128)
    try:
        prompts = random_prompts(6, [250, 12, 90])
        outs = generate_greedy(llm, prompts, 12)
    finally:
        shutdown(llm)
    _check_exact(hf_oracles["moe"], prompts, outs, 12)


# ---------------------------------------------------------------------------------------
# fp8 latent cache: oracle = transformers with its cached latents rounded to fp8.
# ---------------------------------------------------------------------------------------
def test_fp8_cache_matches_transformers_with_fp8_latents(model_dirs) -> None:
    llm = make_llm(
        model_dirs["lite"],
        kv_cache_dtype="fp8",
        enable_prefix_caching=True,
        max_num_batched_tokens=256,
        block_size=32,
    )
    try:
        assert str(llm.llm_engine.vllm_config.cache_config.cache_dtype) == "fp8"
        prompts = random_prompts(7, [400, 20, 130])
        outs = generate_greedy(llm, prompts, 12)
    finally:
        shutdown(llm)
    oracle = HFOracle(model_dirs["lite"], fp8_latents=True)
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        want = oracle.greedy(prompt, 12)
        assert got == want, f"prompt len {len(prompt)}: vLLM {got} != fp8 oracle {want}"
        ref = oracle.logprobs_along(prompt, got)
        ref_lp = ref[torch.arange(len(got)), torch.tensor(got)]
        diff = (torch.tensor(token_logprobs(out)) - ref_lp).abs().max().item()
        assert diff <= FP8_LOGPROB_ATOL, f"logprob diff {diff}"


# ---------------------------------------------------------------------------------------
# Speculative decoding (n-gram drafts): multi-token verify queries go through the backend.
# ---------------------------------------------------------------------------------------
def test_ngram_speculative_decoding_matches_transformers(model_dirs, hf_oracles) -> None:
    llm = make_llm(
        model_dirs["odd"],
        max_num_batched_tokens=128,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    )
    try:
        assert llm.llm_engine.vllm_config.speculative_config is not None
        # repetitive prompts, so the n-gram proposer finds drafts
        base = random_prompts(8, [12, 20])
        prompts = [b * 6 for b in base]
        outs = generate_greedy(llm, prompts, 16)
    finally:
        shutdown(llm)
    _check_exact(hf_oracles["odd"], prompts, outs, 16)


# ---------------------------------------------------------------------------------------
# Negative control for the RoPE workaround: vLLM's in-tree CPU_MLA in eager mode (custom ops
# on, so the CPU rotary_embedding op runs) disagrees with transformers; MLA_ABSORB in the
# same mode (the tests above, enforce_eager=True) agrees because the plugin forces native RoPE.
# ---------------------------------------------------------------------------------------
def test_in_tree_cpu_mla_eager_is_wrong_without_native_rope(model_dirs, hf_oracles) -> None:
    llm = make_llm(model_dirs["lite"], attention_backend="CPU_MLA", enable_prefix_caching=False)
    try:
        cfg = llm.llm_engine.vllm_config
        assert cfg.attention_config.backend.name == "CPU_MLA"
        assert "-rotary_embedding" not in cfg.compilation_config.custom_ops
        prompts = random_prompts(9, [30, 60])
        outs = generate_greedy(llm, prompts, 8)
    finally:
        shutdown(llm)
    oracle = hf_oracles["lite"]
    mismatches = [
        list(o.outputs[0].token_ids) != oracle.greedy(p, 8)
        for p, o in zip(prompts, outs, strict=True)
    ]
    assert any(mismatches), "CPU_MLA matched transformers: has vLLM fixed its CPU RoPE op?"
