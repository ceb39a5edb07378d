"""End to end: decode context parallel (``decode_context_parallel_size=2`` on
``tensor_parallel_size=2``, two CPU worker processes) through MLA_ABSORB.

* fp32 cache: greedy tokens identical to transformers' ``DeepseekV2ForCausalLM`` (the oracle) and
  |logprob diff| <= 2e-3, with chunked prefill and prefix caching on and contexts many pages
  long (every rank holds part of every request), interleave 1 (DeepSeek-V2-Lite dims) and
  interleave = block size with n-gram speculative decoding (odd dims: multi-token verify
  queries over the shards);
* fp8 cache: the same greedy tokens as our own TP-only run (TP 2, no DCP) of the same model and
  prompts, logprobs within 1e-3.

One engine at a time (each is shut down before the next starts).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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
from test_e2e import _check_exact

# Under -m slow: CI (the wheel / sglang sessions) runs what is not marked slow, within its
# 60 minutes on 2 cores; `python3 -m nox -s vllm` runs these too.
pytestmark = pytest.mark.slow  # TP 2 x DCP 2 engines, oversubscribed on 2 cores

TP, DCP = 2, 2
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def _one_core_per_rank() -> Iterator[None]:
    """Each of the two TP ranks binds its OpenMP threads to its own core."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _dcp_llm(model: Path, **kw: Any) -> Any:
    args: dict[str, Any] = dict(
        tensor_parallel_size=TP,
        decode_context_parallel_size=DCP,
        block_size=BLOCK,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=128,
    )
    args.update(kw)
    return make_llm(model, **args)


# ---------------------------------------------------------------------------------------
# DeepSeek-V2-Lite attention dims, interleave 1: chunked prefill, mixed batches, prefix hits.
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lite_dcp(model_dirs: dict[str, Path]) -> Iterator[Any]:
    llm = _dcp_llm(model_dirs["lite"])
    yield llm
    shutdown(llm)


def test_dcp_config(lite_dcp) -> None:
    cfg = lite_dcp.llm_engine.vllm_config
    assert cfg.attention_config.backend.name == "MLA_ABSORB"
    assert cfg.parallel_config.decode_context_parallel_size == DCP
    assert cfg.parallel_config.tensor_parallel_size == TP
    assert cfg.scheduler_config.enable_chunked_prefill and cfg.cache_config.enable_prefix_caching
    assert cfg.cache_config.block_size == BLOCK


def test_dcp_chunked_prefill_mixed_batch_matches_transformers(lite_dcp, hf_oracles) -> None:
    # 600 tokens = 38 pages of 16: both ranks hold 300 of them; the 7-token prompt lives on
    # rank 0 only until it grows; prefills in 128-token chunks next to decodes
    prompts = random_prompts(11, [600, 7, 300, 45])
    outs = generate_greedy(lite_dcp, prompts, 12)
    _check_exact(hf_oracles["lite"], prompts, outs, 12)


def test_dcp_prefix_cache_hits_match_transformers(lite_dcp, hf_oracles) -> None:
    base = random_prompts(12, [520])[0]
    _check_exact(hf_oracles["lite"], [base], generate_greedy(lite_dcp, [base], 4), 4)
    prompts = [base[:512] + t for t in random_prompts(13, [30, 1, 90])]
    outs = generate_greedy(lite_dcp, prompts, 10)
    assert all((o.num_cached_tokens or 0) >= 256 for o in outs), [o.num_cached_tokens for o in outs]
    _check_exact(hf_oracles["lite"], prompts, outs, 10)


# ---------------------------------------------------------------------------------------
# Odd dims, interleave = block size, n-gram speculative decoding (verify queries sharded).
# ---------------------------------------------------------------------------------------
def _drafting_prompts(oracle: HFOracle) -> list[list[int]]:
    """Prompts that contain tokens the model itself tends to emit (its greedy outputs after
    other prompts), so a 1-gram lookup finds drafts while it generates."""
    emitted: list[int] = []
    for p in random_prompts(14, [30] * 8):
        emitted += oracle.greedy(p, 24)
    return [head + emitted for head in random_prompts(15, [40, 40])]


def _metric(llm: Any, name: str) -> float:
    return sum(float(m.value) for m in llm.get_metrics() if m.name == name)


def test_dcp_speculative_decoding_interleave_block_matches_transformers(
    model_dirs, hf_oracles
) -> None:
    oracle = hf_oracles["odd"]
    prompts = _drafting_prompts(oracle)
    llm = _dcp_llm(
        model_dirs["odd"],
        cp_kv_cache_interleave_size=BLOCK,
        max_num_batched_tokens=64,
        disable_log_stats=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    try:
        assert llm.llm_engine.vllm_config.parallel_config.cp_kv_cache_interleave_size == BLOCK
        outs = generate_greedy(llm, prompts, 24)
        drafts = _metric(llm, "vllm:spec_decode_num_draft_tokens")
    finally:
        shutdown(llm)
    assert drafts > 0, "no speculative drafts were verified: the test lost its point"
    _check_exact(oracle, prompts, outs, 24)


# ---------------------------------------------------------------------------------------
# fp8 latent cache: DCP vs our own TP-only run.
# ---------------------------------------------------------------------------------------
def test_dcp_fp8_cache_matches_tp_only_run(model_dirs) -> None:
    prompts = random_prompts(16, [400, 20, 130])
    results = {}
    for name, dcp in (("dcp", DCP), ("tp_only", 1)):
        llm = _dcp_llm(model_dirs["lite"], kv_cache_dtype="fp8", decode_context_parallel_size=dcp)
        try:
            cfg = llm.llm_engine.vllm_config
            assert str(cfg.cache_config.cache_dtype) == "fp8"
            assert cfg.parallel_config.decode_context_parallel_size == dcp
            results[name] = generate_greedy(llm, prompts, 12)
        finally:
            shutdown(llm)
    for prompt, a, b in zip(prompts, results["dcp"], results["tp_only"], strict=True):
        got, want = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        assert got == want, f"prompt len {len(prompt)}: DCP {got} != TP-only {want}"
        diff = (torch.tensor(token_logprobs(a)) - torch.tensor(token_logprobs(b))).abs().max()
        assert diff.item() <= 1e-3, f"logprob diff {diff.item()} (prompt len {len(prompt)})"



# ---------------------------------------------------------------------------------------
# Four ranks on the two cores (oversubscribed): TP 4 x DCP 4 and TP 4 x DCP 2.
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dcp", [4, 2])
def test_tp4_dcp_matches_transformers(model_dirs, hf_oracles, dcp: int) -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1|0|1"
    try:
        llm = _dcp_llm(model_dirs["lite"], tensor_parallel_size=4, decode_context_parallel_size=dcp,
                       cp_kv_cache_interleave_size=1 if dcp == 4 else BLOCK)  # fmt: skip
        try:
            prompts = random_prompts(17, [300, 7, 45])
            outs = generate_greedy(llm, prompts, 8)
        finally:
            shutdown(llm)
    finally:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    _check_exact(hf_oracles["lite"], prompts, outs, 8)
