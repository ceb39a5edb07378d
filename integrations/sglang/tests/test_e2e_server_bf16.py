"""End to end in bf16 with page size 32 (the separate q_rope/k_rope convention, cost policy).

bf16 rounding through the whole model makes greedy tokens of a random tiny model diverge from
an fp32 oracle at near-ties, so this module compares teacher-forced log-probabilities instead:
the oracle (transformers ``DeepseekV2ForCausalLM``, fp32) generates a greedy continuation, the
server scores prompt + continuation, and every continuation token's logprob must agree within
BF16_LOGPROB_ATOL = 0.15 nats (measured: <= 0.075 on these prompts; with the absorbed path's
softmax scale deliberately multiplied by 1.5 the difference was 1.09, so the check can fail).

SGLang 0.5.23 itself refuses an fp8 KV cache for MLA models on CPU ("CPU FP8 KV cache is only
supported for MHA"), so fp8 KV is covered by the harness and ForwardBatch tests only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from . import _server

BF16_LOGPROB_ATOL = 0.15
N_NEW = 16


model, server, oracle = _server.module_fixtures(
    "tiny_bf16",
    dict(
        num_heads=4, hidden_size=128, num_layers=2, kv_lora_rank=96, qk_rope_head_dim=32,
        qk_nope_head_dim=48, v_head_dim=40, q_lora_rank=64, moe=False, seed=0,
    ),
    ["--attention-backend", "mla_absorb", "--dtype", "bfloat16", "--page-size", "32"],
    env={"MLA_BACKEND_POLICY": "cost"},
)  # fmt: skip


def test_bf16_page32_backend_resolved(server):
    assert "page_size=32 kv dtype=torch.bfloat16" in server.log()


def test_teacher_forced_logprobs_match_oracle(server, oracle):
    prompts = [_server.random_prompt(s, n) for s, n in ((1, 9), (2, 70), (3, 200))]
    refs = [oracle.greedy(p, N_NEW) for p in prompts]
    # concurrent scoring requests are batched together
    with ThreadPoolExecutor(max_workers=3) as ex:
        jobs = [(p + ref[0], len(p)) for p, ref in zip(prompts, refs, strict=True)]
        got = list(ex.map(lambda job: server.score(*job), jobs))
    for (ref_toks, ref_lps), lps in zip(refs, got, strict=True):
        assert len(lps) == len(ref_toks)
        diff = max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
        assert diff <= BF16_LOGPROB_ATOL, f"bf16 logprob difference {diff}"


def test_prefix_hit_scoring_matches_oracle(server, oracle):
    """The same prompt scored again extends onto its cached prefix (radix hit)."""
    ids = _server.random_prompt(4, 120)
    ref_toks, ref_lps = oracle.greedy(ids, N_NEW)
    server.score(ids, 1)  # cache the prompt
    lps = server.score(ids + ref_toks, len(ids))
    assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= BF16_LOGPROB_ATOL
