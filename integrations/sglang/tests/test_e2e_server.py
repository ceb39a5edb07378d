"""End to end: a CPU SGLang server with ``--attention-backend mla_absorb`` vs transformers.

Model: tiny DeepSeek-V2 (2 layers, 4 heads, kv_lora_rank 96, rope 32, nope 48, v 40,
q_lora 64; not DeepSeek's dims), random fp32 safetensors weights, yarn rope scaling.
Server: fp32, page size 1, policy ``sglang`` with a chunked-prefix threshold of 48 tokens, so
one server exercises every path: fresh prefill -> normal (MHA); extend onto a short cached
prefix -> absorbed; extend onto a >= 48-token cached prefix -> normal over the cached prefix
(the core's chunked-prefix path); decode -> absorbed.

Oracle: transformers' ``DeepseekV2ForCausalLM`` (fp32, eager) on the same weights. Criterion:
identical greedy tokens, and each chosen token's logprob within LOGPROB_ATOL = 1e-3 (both
run fp32; measured differences are ~1e-5).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from . import _server

LOGPROB_ATOL = 1e-3
N_NEW = 12


model, server, oracle = _server.module_fixtures(
    "tiny_odd",
    dict(
        num_heads=4, hidden_size=128, num_layers=2, kv_lora_rank=96, qk_rope_head_dim=32,
        qk_nope_head_dim=48, v_head_dim=40, q_lora_rank=64, moe=False, seed=1,
    ),
    ["--attention-backend", "mla_absorb"],
    env={"MLA_BACKEND_POLICY": "sglang", "MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD": "48"},
)  # fmt: skip


def _check(server, oracle, ids, n=N_NEW):
    resp = server.generate(ids, n)
    toks, lps = _server.tokens_and_logprobs(resp)
    ref_toks, ref_lps = oracle.greedy(ids, n)
    assert toks == ref_toks, f"greedy tokens differ: {toks} vs {ref_toks}"
    diff = max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
    assert diff <= LOGPROB_ATOL, f"logprob difference {diff}"
    return resp


def test_scheduler_resolved_the_plugin_backend(server):
    """The scheduler subprocess built mla_absorb (the plugin loaded in that process)."""
    log = server.log()
    assert "mla_absorb: H=4 r=96 rope=32 nope=48 v=40 page_size=1" in log
    assert "policy=Policy(mode='sglang', chunked_prefix_threshold=48)" in log


@pytest.mark.parametrize("length", [1, 7, 33, 150])
def test_fresh_prompts_match_transformers(server, oracle, length):
    _check(server, oracle, _server.random_prompt(length, length))


def test_generations_are_not_degenerate(server):
    toks, _ = _server.tokens_and_logprobs(server.generate(_server.random_prompt(5, 20), N_NEW))
    assert len(set(toks)) >= N_NEW // 2


def test_prefix_cache_hits_short_and_long(server, oracle):
    """Radix-cache hits: a 30-token prefix (absorbed extend) and a 100-token one (normal over
    the cached prefix), both against the oracle on the full prompt."""
    base = _server.random_prompt(42, 100)
    _check(server, oracle, base)
    short = base[:30] + _server.random_prompt(43, 5)
    long = base + _server.random_prompt(44, 20)
    r_short = _check(server, oracle, short)
    r_long = _check(server, oracle, long)
    assert r_short["meta_info"]["cached_tokens"] >= 30
    assert r_long["meta_info"]["cached_tokens"] >= 100


def test_concurrent_batch(server, oracle):
    """Eight concurrent requests of mixed lengths are batched by the scheduler."""
    prompts = [_server.random_prompt(100 + i, 3 + 11 * i) for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as ex:
        resps = list(ex.map(lambda p: server.generate(p, N_NEW), prompts))
    for ids, resp in zip(prompts, resps, strict=True):
        toks, lps = _server.tokens_and_logprobs(resp)
        ref_toks, ref_lps = oracle.greedy(ids, N_NEW)
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= LOGPROB_ATOL
    log = server.log()
    together = [int(m) for m in re.findall(r"#new-seq: (\d+)", log)]
    together += [int(m) for m in re.findall(r"#running-req: (\d+)", log)]
    assert max(together) >= 2, "the requests were never batched together"


def test_every_path_ran(server):
    """Runs last in this module: the server log shows which core paths served batches."""
    log = server.log()
    assert re.search(r"path=normal-call:normal phase=extend has_prefix=False", log)
    assert re.search(r"path=normal-call:normal phase=extend has_prefix=True", log)
    assert re.search(r"path=absorbed phase=extend has_prefix=True", log)
    assert re.search(r"path=absorbed phase=decode", log)
