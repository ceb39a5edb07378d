"""End to end, DeepSeek Sparse Attention: tiny random DeepSeek-V3.2 and GLM-5 checkpoints
(``mla_backend.testing.tiny_model.make_tiny_dsa``, written at test time) served by vLLM on CPU
with ``attention_backend="mla_absorb"`` (fp32), against transformers' own DSA models on the same
safetensors (:class:`dsa_reference.DSAOracle`).

Which reference, and why:

* ``index_topk`` (2048) above every context: the selection is every visible token, so the model
  is dense MLA and the indexer's rounding cannot matter. Reference: transformers' fp32
  ``DeepseekV32ForCausalLM`` as it is (unquantized indexer). Greedy tokens identical; every
  generated token's logprob within ``LOGPROB_ATOL``.
* ``index_topk`` (16) far below the contexts (up to 600 tokens): the selection decides the
  answer. vLLM's model code rounds the indexer's query and keys to fp8 before scoring,
  transformers does not, and that rounding alone moves the top-k sets (mla-notes.md), so
  unquantized transformers cannot judge the serving path there (negative control: it disagrees).
  Reference: transformers with the indexer's q / k rounded exactly as vLLM rounds them
  (``DSAOracle(fp8_indexer=True)``; the rounding rules are written in dsa_reference.py from
  vLLM's definitions) and the core's documented tie rule. Checked twice: greedy tokens identical,
  and teacher-forced logprobs (the reference run once over prompt + vLLM's tokens) within
  ``LOGPROB_ATOL`` at every generated token. A second negative control shows the selection is
  real: the same reference with every token selected (dense) disagrees.

Coverage: chunked prefill (prompts longer than ``max_num_batched_tokens``), ragged batches whose
requests mix contexts below and above ``index_topk`` (dense and sparse requests in one step),
prefix-cache hits, GLM-5's shared top-k layer (``index_topk_pattern="FFS"``), interleaved indexer
RoPE and v_head_dim != qk_nope_head_dim, vLLM's compiled (default) mode, tensor parallel 2.
One engine at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import generate_greedy, make_llm, random_prompts, shutdown, token_logprobs
from mla_backend_integrations._testing.dsa_reference import DSAOracle

from mla_backend.testing.tiny_model import DSA_PRESETS, make_tiny_dsa

LOGPROB_ATOL = 2e-3
SPARSE_TOPK = 16
DENSE_TOPK = 2048  # above every context of these tests (max_model_len 1024)
MAX_NEW = 10


@pytest.fixture(scope="module")
def dsa_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_dsa")
    specs = {
        "v32_dense": ("v32", DENSE_TOPK, 11),
        "v32_sparse": ("v32", SPARSE_TOPK, 11),
        "glm5_sparse": ("glm5", SPARSE_TOPK, 12),
    }
    return {
        name: make_tiny_dsa(root / name, index_topk=topk, dtype="float32", seed=seed,
                            **DSA_PRESETS[preset])  # fmt: skip
        for name, (preset, topk, seed) in specs.items()
    }


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(oracle: DSAOracle, prompts: list[list[int]], outs: list[Any]) -> None:
    """Greedy tokens identical to the reference's, and the reference's teacher-forced logprob
    of every generated token within LOGPROB_ATOL of vLLM's."""
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        want = oracle.greedy(prompt, len(got))
        assert got == want, f"prompt len {len(prompt)}: vLLM {got} != reference {want}"
        ref = oracle.logprobs_along(prompt, got)[torch.arange(len(got)), torch.tensor(got)]
        diff = (torch.tensor(token_logprobs(out)) - ref).abs().max().item()
        assert diff <= LOGPROB_ATOL, f"prompt len {len(prompt)}: logprob diff {diff}"


def _prefix_hits(llm: Any, base: list[int], seed: int) -> tuple[list[list[int]], list[Any]]:
    """Prompts sharing ``base[:256]`` (after ``base`` was served): each must hit the cache."""
    prompts = [base[:256] + t for t in random_prompts(seed, [30, 1, 70])]
    outs = generate_greedy(llm, prompts, MAX_NEW)
    assert all((o.num_cached_tokens or 0) >= 128 for o in outs), [
        o.num_cached_tokens for o in outs
    ]
    return prompts, outs


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2, index_topk above every context: identical to unquantized transformers fp32.
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # one more engine run: under -m slow (CI's time; nox -s vllm runs it)
def test_v32_topk_above_context_matches_transformers_fp32(dsa_dirs) -> None:
    llm = make_llm(
        dsa_dirs["v32_dense"],
        enable_prefix_caching=True,
        max_num_batched_tokens=128,
        block_size=16,
    )
    try:
        cfg = llm.llm_engine.vllm_config
        assert cfg.attention_config.backend.name == "MLA_ABSORB"
        assert cfg.scheduler_config.enable_chunked_prefill
        assert cfg.cache_config.enable_prefix_caching
        prompts = random_prompts(1, [300, 7, 600])
        outs = generate_greedy(llm, prompts, MAX_NEW)
        hit_prompts, hit_outs = _prefix_hits(llm, prompts[0], 2)
    finally:
        shutdown(llm)
    oracle = DSAOracle(dsa_dirs["v32_dense"])
    _check(oracle, prompts + hit_prompts, outs + hit_outs)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2, index_topk 16 (the selection matters): the fp8-indexer reference.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v32_sparse_run(dsa_dirs) -> Iterator[dict[str, Any]]:
    llm = make_llm(
        dsa_dirs["v32_sparse"],
        enable_prefix_caching=True,
        max_num_batched_tokens=128,
        block_size=16,
    )
    try:
        prompts = random_prompts(3, [300, 12, 600, 45])
        outs = generate_greedy(llm, prompts, MAX_NEW)
        hit_prompts, hit_outs = _prefix_hits(llm, prompts[0], 4)
    finally:
        shutdown(llm)
    yield dict(prompts=prompts + hit_prompts, outs=outs + hit_outs)


def test_v32_sparse_matches_fp8_indexer_reference(dsa_dirs, v32_sparse_run) -> None:
    _check(DSAOracle(dsa_dirs["v32_sparse"], fp8_indexer=True), **v32_sparse_run)


def test_v32_sparse_negative_controls(dsa_dirs, v32_sparse_run) -> None:
    """The unquantized reference and the dense reference (every token selected) each disagree
    with vLLM somewhere: the rounding and the selection both matter at index_topk 16."""
    prompts, got = v32_sparse_run["prompts"], _tokens(v32_sparse_run["outs"])
    for oracle in (
        DSAOracle(dsa_dirs["v32_sparse"], fp8_indexer=False),
        DSAOracle(dsa_dirs["v32_sparse"], fp8_indexer=True, index_topk=DENSE_TOPK),
    ):
        want = [oracle.greedy(p, MAX_NEW) for p in prompts]
        assert want != got, "a reference that should disagree agrees with vLLM"


# ---------------------------------------------------------------------------------------------
# GLM-5 shape (shared top-k layer, interleaved indexer RoPE, v 256 != nope 192), compiled mode.
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # one more engine run: under -m slow (CI's time; nox -s vllm runs it)
def test_glm5_sparse_compiled_matches_fp8_indexer_reference(dsa_dirs) -> None:
    llm = make_llm(
        dsa_dirs["glm5_sparse"],
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        enforce_eager=False,
    )
    try:
        assert llm.llm_engine.vllm_config.model_config.architectures == ["GlmMoeDsaForCausalLM"]
        prompts = random_prompts(5, [200, 10, 90])
        outs = generate_greedy(llm, prompts, MAX_NEW)
        hit_prompts, hit_outs = _prefix_hits(llm, prompts[0], 6)
    finally:
        shutdown(llm)
    _check(
        DSAOracle(dsa_dirs["glm5_sparse"], fp8_indexer=True), prompts + hit_prompts,
        outs + hit_outs,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Tensor parallel 2 (oversubscribed on a 2-core machine: one core per rank).
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # two engine ranks on 2 cores: under -m slow (CI's time)
def test_v32_sparse_tensor_parallel_2(dsa_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = make_llm(
        dsa_dirs["v32_sparse"],
        tensor_parallel_size=2,
        enable_prefix_caching=True,
        max_num_batched_tokens=128,
        block_size=16,
    )
    try:
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
        prompts = random_prompts(7, [260, 20])
        outs = generate_greedy(llm, prompts, MAX_NEW)
    finally:
        shutdown(llm)
    _check(DSAOracle(dsa_dirs["v32_sparse"], fp8_indexer=True), prompts, outs)
