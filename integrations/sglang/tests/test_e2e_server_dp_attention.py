"""End to end: SGLang's DP attention (``--tp 2 --enable-dp-attention --dp 2``: two attention
data-parallel ranks, each holding every head and its own requests' latent cache, the MLP
gathered across both) with ``--attention-backend mla_absorb`` on CPU, vs transformers.

Same tiny model as ``test_e2e_server.py`` (4 heads, r 96, rope 32, nope 48, v 40, q_lora 64,
fp32, yarn) and the same policy (``sglang``, chunked-prefix threshold 48: every path runs).
Concurrent requests spread over both DP ranks, whose batches SGLang pads to one size for the
gathered MLP (padding requests of sequence length ``get_cpu_graph_seq_len_fill_value()``).
Criterion: identical greedy tokens, chosen-token logprobs within 1e-3 (both fp32).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from . import _server

LOGPROB_ATOL = 1e-3
N_NEW = 10

model, server, oracle = _server.module_fixtures(
    "tiny_odd_dp_attention",
    dict(
        num_heads=4, hidden_size=128, num_layers=2, kv_lora_rank=96, qk_rope_head_dim=32,
        qk_nope_head_dim=48, v_head_dim=40, q_lora_rank=64, moe=False, seed=1,
    ),
    ["--attention-backend", "mla_absorb", "--tp", "2", "--enable-dp-attention", "--dp", "2"],
    env={
        "MLA_BACKEND_POLICY": "sglang",
        "MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD": "48",
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank
    },
)  # fmt: skip


def _check(oracle, ids, resp):
    toks, lps = _server.tokens_and_logprobs(resp)
    ref_toks, ref_lps = oracle.greedy(ids, N_NEW)
    assert toks == ref_toks, f"prompt len {len(ids)}: {toks} != transformers {ref_toks}"
    diff = max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
    assert diff <= LOGPROB_ATOL, f"logprob difference {diff}"


def test_each_dp_rank_built_mla_absorb_with_every_head(server):
    """Attention TP size is 1 under DP attention: each rank serves all 4 heads."""
    log = server.log()
    for rank in ("DP0 TP0", "DP1 TP1"):
        assert re.search(rf"{rank}\] mla_absorb: H=4 r=96 rope=32 nope=48 v=40", log), rank


def test_concurrent_requests_over_both_ranks_match_transformers(server, oracle):
    prompts = [_server.random_prompt(60 + i, n) for i, n in enumerate([40, 7, 90, 23, 60, 5])]
    with ThreadPoolExecutor(len(prompts)) as ex:
        resps = list(ex.map(lambda p: server.generate(p, N_NEW), prompts))
    for ids, resp in zip(prompts, resps, strict=True):
        _check(oracle, ids, resp)
    log = server.log()
    # both ranks ran batches (the DP controller spread the requests)
    assert "DP0 TP0] Prefill batch" in log and "DP1 TP1] Prefill batch" in log


def test_prefix_cache_hit_on_a_dp_rank(server, oracle):
    """A >= 48-token cached prefix (the normal path over the cached prefix) on whichever
    rank the request lands; prompts repeated so the same rank sees the prefix again."""
    base = _server.random_prompt(70, 100)
    _check(oracle, base, server.generate(base, N_NEW))
    hits = 0
    for seed in (71, 72):
        ids = base + _server.random_prompt(seed, 12)
        resp = server.generate(ids, N_NEW)
        _check(oracle, ids, resp)
        hits += resp["meta_info"]["cached_tokens"] >= 100
    assert hits >= 1, "no request reused the cached 100-token prefix"
