"""End to end, second model and configuration: started with ``sglang serve``.

Model: tiny DeepSeek-V2 MoE (3 layers, first dense then 8 routed experts top-2 + 1 shared,
8 heads, kv_lora_rank 256, rope 64, nope 64, v 64, no q_lora), random fp32 weights.
Server: page size 16, the default cost policy, and the concatenated calling convention
(``MLA_BACKEND_SGLANG_QK=concat``: the model passes ``[q_lat ; q_pe]`` and ``[c_kv ; k_pe]``).
Oracle and tolerance as in test_e2e_server.py (identical greedy tokens, logprobs within 1e-3,
fp32 both sides).
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import _server

LOGPROB_ATOL = 1e-3
N_NEW = 10


model, server, oracle = _server.module_fixtures(
    "tiny_moe",
    dict(
        num_heads=8, hidden_size=192, num_layers=3, kv_lora_rank=256, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=None, moe=True, seed=2,
    ),
    ["--attention-backend", "mla_absorb", "--page-size", "16"],
    env={"MLA_BACKEND_SGLANG_QK": "concat", "MLA_BACKEND_POLICY": "cost"},
    launcher=[str(Path(sys.executable).parent / "sglang"), "serve"],
)  # fmt: skip


def _match(resp, ref):
    toks, lps = _server.tokens_and_logprobs(resp)
    ref_toks, ref_lps = ref
    assert toks == ref_toks, f"greedy tokens differ: {toks} vs {ref_toks}"
    assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= LOGPROB_ATOL


def test_serve_cli_resolved_backend_with_page_16(server):
    log = server.log()
    assert "mla_absorb: H=8 r=256 rope=64 nope=64 v=64 page_size=16" in log
    assert "mode='cost'" in log


def test_prompts_and_prefix_hits_match_transformers(server, oracle):
    base = _server.random_prompt(7, 70)
    prompt = _server.random_prompt
    for ids in (base, base[:40] + prompt(8, 9), base + prompt(9, 3), prompt(10, 5)):
        _match(server.generate(ids, N_NEW), oracle.greedy(ids, N_NEW))


def test_concurrent_batch(server, oracle):
    prompts = [_server.random_prompt(200 + i, 4 + 9 * i) for i in range(6)]
    with ThreadPoolExecutor(max_workers=6) as ex:
        resps = list(ex.map(lambda p: server.generate(p, N_NEW), prompts))
    for ids, resp in zip(prompts, resps, strict=True):
        _match(resp, oracle.greedy(ids, N_NEW))


def test_absorbed_paths_ran(server):
    log = server.log()
    assert re.search(r"path=absorbed phase=decode", log)
    assert re.search(r"path=absorbed phase=extend", log)
