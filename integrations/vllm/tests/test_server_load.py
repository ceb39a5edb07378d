"""vLLM's OpenAI server with ``--attention-backend mla_absorb`` under load, against transformers.

Server (``python -m mla_backend_integrations.vllm.cli serve``, 127.0.0.1): the tiny DeepSeek-V2
with V2-Lite attention dims (16 heads, 512 + 64, nope 128, v 128), fp32, context limit 2048
(``max_position_embeddings`` = ``--max-model-len`` = 2048), prefix caching and chunked prefill
on (256-token budget), block size 16 and only 160 KV blocks (2560 tokens, 1.25 max-length
requests): the load below needs several times that, so cached blocks are evicted and reused
and requests wait or are preempted.

Oracle: transformers' ``DeepseekV2ForCausalLM`` (fp32, conftest.HFOracle) on the same
safetensors, teacher-forced along the server's tokens: every token is transformers' argmax
(so the sequence is its greedy continuation), chosen-token logprobs within 2e-3. (Not
``HFOracle.greedy``: its ``min_new_tokens`` masks EOS, while ``ignore_eos`` requests may
legitimately pick EOS and go on.)

* ``test_concurrent_load_matches_transformers``: 199 requests at once: plain completions,
  full streams, streams the client drops after the first chunk, requests sharing four
  400-token prefixes (plain and streamed), and bad requests mixed in. Every completed
  request equals transformers; every bad one gets its 4xx; the dropped streams are aborted
  (they generate far fewer than their 300 tokens; vLLM 0.32's ``request_success_total
  {finished_reason="abort"}`` stays 0 for client disconnects, so the generated-token counter
  is used) and nothing is left running; prefix-cache hits happened.
* ``test_bad_requests_get_4xx``: token id >= vocab, negative id, empty prompt (ids / text),
  prompt longer than the context, max_tokens < 1, unknown model: each a 4xx naming the
  problem; the server stays up.
* ``test_long_context_near_limit``: a 2040-token prompt + 8 tokens = the 2048 limit:
  finite logprobs, tokens equal transformers; then a request sharing its first 2000 tokens.
* ``test_server_answers_correctly_afterwards``: runs last: health, fresh requests equal
  transformers, no request left running, the server process never died.

Measured here (2 cores, shared): module ~110 s (server start ~30 s, load 12-25 s, oracle).
"""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _openai_server as srv
import pytest
import torch
from conftest import HFOracle

from mla_backend.testing.oracle import teacher_forced_logprobs
from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

# Under -m slow: CI (the wheel / sglang sessions) runs what is not marked slow, within its
# 60 minutes on 2 cores; `python3 -m nox -s vllm` runs these too.
pytestmark = pytest.mark.slow  # a server soak

LOGPROB_ATOL = 2e-3
TIE_NATS = 1e-4
VOCAB = 10240
MAX_LEN = 2048
NUM_BLOCKS = 160
BLOCK = 16
N_PLAIN, N_STREAM, N_DROP, N_SHARED = 70, 50, 30, 40
SHARED_PREFIX_LEN = 400
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_deepseek_v2(
        tmp_path_factory.mktemp("tiny_load") / "lite",
        dtype="float32",
        seed=1,
        max_position_embeddings=MAX_LEN,
        **PRESETS["default"],
    )


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    s = srv.start_server(
        model,
        log,
        [
            "--attention-backend", "mla_absorb",
            "--dtype", "float32",
            "--max-model-len", str(MAX_LEN),
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--max-num-batched-tokens", "256",
            "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(NUM_BLOCKS),
            "--enforce-eager",
        ],
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(model) -> HFOracle:
    return HFOracle(model)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def _body(prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": srv.SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


@dataclass
class Job:
    kind: str  # plain | stream | drop | shared | shared_stream | bad:<what>
    prompt: list[int]
    max_tokens: int
    body: dict[str, Any] = field(default_factory=dict)
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    error: str = ""


def _bad_requests(rng: random.Random) -> list[tuple[str, Any, int]]:
    """(name, request body, expected status) of requests a server must refuse."""
    return [
        ("token_id_ge_vocab", _body(_ids(rng, 5) + [VOCAB], 4), 400),
        ("token_id_huge", _body([7, 10**9], 4), 400),
        ("token_id_negative", _body([7, -1, 9], 4), 400),
        ("empty_prompt_ids", _body([], 4), 400),
        ("empty_prompt_text", _body("", 4), 400),
        ("prompt_longer_than_context", _body(_ids(rng, MAX_LEN + 20), 4), 400),
        ("max_tokens_negative", _body(_ids(rng, 5), -1), 400),
        ("max_tokens_zero", _body(_ids(rng, 5), 0), 400),
        ("unknown_model", {**_body(_ids(rng, 5), 4), "model": "no-such-model"}, 404),
    ]


def _run(server: srv.OpenAIServer, job: Job) -> Job:
    try:
        if job.kind.startswith("bad:"):
            rep = server.post(COMPLETIONS, job.body)
            job.status, job.error = rep.status, str(rep.body)[:300]
        elif job.kind in ("stream", "drop", "shared_stream"):
            status, chunks = server.stream(
                COMPLETIONS, job.body, drop_after=1 if job.kind == "drop" else None
            )
            job.status = status
            for c in chunks:
                for ch in c.get("choices", []):
                    job.tokens += list(ch.get("token_ids") or [])
            if status != 200:
                job.error = str(chunks)[:300]
        else:
            rep = server.post(COMPLETIONS, job.body)
            job.status = rep.status
            if rep.status == 200:
                ch = rep.body["choices"][0]
                job.tokens = list(ch["token_ids"])
                job.logprobs = [float(x) for x in ch["logprobs"]["token_logprobs"]]
            else:
                job.error = str(rep.body)[:300]
    except Exception as e:  # recorded, asserted on below
        job.error = f"{type(e).__name__}: {e}"
    return job


def _oracle_logprobs(model: Any, jobs: list[Job]) -> list[torch.Tensor]:
    return teacher_forced_logprobs(model, [(job.prompt, job.tokens) for job in jobs])


def _check_against_oracle(oracle: HFOracle, job: Job, ref: torch.Tensor | None = None) -> None:
    """Teacher-forced along the server's tokens (one transformers forward per request): each
    token is transformers' argmax given the same prefix (so the whole sequence is its greedy
    continuation; a near-tie within TIE_NATS counts as either), and the chosen tokens'
    logprobs are within LOGPROB_ATOL. EOS is an ordinary token here (``ignore_eos``)."""
    assert job.tokens, job
    if ref is None:
        ref = oracle.logprobs_along(job.prompt, job.tokens)
    assert torch.isfinite(ref).all()
    chosen = ref[torch.arange(len(job.tokens)), torch.tensor(job.tokens)]
    best = ref.max(dim=-1)
    for i, t in enumerate(job.tokens):
        assert chosen[i] >= best.values[i] - TIE_NATS, (
            f"{job.kind} (prompt len {len(job.prompt)}): token {i} is {t}, transformers' "
            f"greedy is {best.indices[i].item()} ({chosen[i].item():.5f} vs "
            f"{best.values[i].item():.5f}); server tokens {job.tokens}"
        )
    if job.logprobs is not None:
        assert all(math.isfinite(x) for x in job.logprobs), job.logprobs
        diff = (torch.tensor(job.logprobs) - chosen).abs().max().item()
        assert diff <= LOGPROB_ATOL, f"{job.kind}: logprob diff {diff}"


def test_served_with_mla_absorb_prefix_caching_chunked_prefill(server) -> None:
    log = server.log()
    assert "Using MLA_ABSORB backend" in log
    m = server.metrics()
    info = [k for k in m if k.startswith("vllm:cache_config_info")]
    assert info and 'enable_prefix_caching="True"' in info[0], info
    assert f'num_gpu_blocks="{NUM_BLOCKS}"' in info[0], info
    assert "enable_chunked_prefill': True" in log or "enable_chunked_prefill=True" in log


def test_concurrent_load_matches_transformers(server, oracle) -> None:
    rng = random.Random(11)
    jobs: list[Job] = []
    for _ in range(N_PLAIN):
        p, n = _ids(rng, rng.randint(1, 120)), rng.randint(4, 12)
        jobs.append(Job("plain", p, n, _body(p, n, logprobs=1)))
    for _ in range(N_STREAM):
        p, n = _ids(rng, rng.randint(1, 120)), rng.randint(4, 12)
        jobs.append(Job("stream", p, n, _body(p, n)))
    for _ in range(N_DROP):
        # long generations: if the server did not abort them they would hold their blocks
        p = _ids(rng, rng.randint(1, 120))
        jobs.append(Job("drop", p, 300, _body(p, 300)))
    prefixes = [_ids(rng, SHARED_PREFIX_LEN) for _ in range(4)]
    for i in range(N_SHARED):
        p = prefixes[i % 4] + _ids(rng, rng.randint(1, 30))
        kind = "shared" if i % 2 == 0 else "shared_stream"
        extra = {"logprobs": 1} if kind == "shared" else {}
        jobs.append(Job(kind, p, 6, _body(p, 6, **extra)))
    bad = _bad_requests(rng)
    for name, body, _ in bad:
        jobs.append(Job(f"bad:{name}", [], 0, body))
    expected_bad = {f"bad:{name}": status for name, _, status in bad}
    rng.shuffle(jobs)
    assert len(jobs) == N_PLAIN + N_STREAM + N_DROP + N_SHARED + len(bad)

    before = server.metrics()
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        done = list(ex.map(lambda j: _run(server, j), jobs))
    elapsed = time.monotonic() - t0
    assert server.alive(), server.log()[-4000:]

    # every request got an answer of the right kind
    for job in done:
        if job.kind.startswith("bad:"):
            assert job.status == expected_bad[job.kind], (job.kind, job.status, job.error)
        else:
            assert job.status == 200 and not job.error, (job.kind, job.status, job.error)
    for job in done:
        if job.kind == "drop":
            assert 1 <= len(job.tokens) < job.max_tokens, (len(job.tokens), job.max_tokens)
        elif not job.kind.startswith("bad:"):
            assert len(job.tokens) == job.max_tokens, (job.kind, len(job.tokens))

    # the dropped streams were aborted (not run to their 300 tokens) and nothing is left
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = server.metrics()
        if srv.metric(after, "vllm:num_requests_running") == 0 and (
            srv.metric(after, "vllm:num_requests_waiting") == 0
        ):
            break
        time.sleep(1)
    # vLLM 0.32 does not count client disconnects in request_success_total{abort}; the
    # generated-token counter shows whether the dropped streams ran on
    generated = srv.metric(after, "vllm:generation_tokens_total") - srv.metric(
        before, "vllm:generation_tokens_total"
    )
    completed = sum(len(j.tokens) for j in done if j.kind != "drop" and j.status == 200)
    dropped_generated = generated - completed
    assert 0 < dropped_generated <= N_DROP * 300 // 4, (
        f"dropped streams generated {dropped_generated} tokens (300 each if never aborted)"
    )
    assert srv.metric(after, "vllm:num_requests_running") == 0
    hits = srv.metric(after, "vllm:prefix_cache_hits_total") - srv.metric(
        before, "vllm:prefix_cache_hits_total"
    )
    assert hits >= SHARED_PREFIX_LEN, f"only {hits} prefix-cache hit tokens"
    preempt = srv.metric(after, "vllm:num_preemptions_total") - srv.metric(
        before, "vllm:num_preemptions_total"
    )
    print(
        f"\n{len(done)} requests in {elapsed:.1f}s; prefix-cache hit tokens {hits:.0f}, "
        f"preemptions {preempt:.0f}, tokens generated for dropped streams {dropped_generated:.0f}"
    )

    # every completed request equals transformers' greedy tokens (fp32); of a dropped
    # stream, the tokens it received
    checked = [j for j in done if not j.kind.startswith("bad:")]
    refs = _oracle_logprobs(oracle.model, checked)
    for job, ref in zip(checked, refs, strict=True):
        _check_against_oracle(oracle, job, ref)


@pytest.mark.parametrize("name", [b[0] for b in _bad_requests(random.Random(0))])
def test_bad_requests_get_4xx(server, name) -> None:
    _, body, status = next(b for b in _bad_requests(random.Random(5)) if b[0] == name)
    rep = server.post(COMPLETIONS, body)
    assert rep.status == status, (rep.status, rep.body)
    assert "error" in rep.body, rep.body
    assert server.get("/health").status == 200
    assert server.alive()


def test_long_context_near_limit(server, oracle) -> None:
    rng = random.Random(21)
    prompt = _ids(rng, MAX_LEN - 8)
    rep = server.post(COMPLETIONS, _body(prompt, 8, logprobs=1))
    assert rep.status == 200, rep.body
    job = Job("plain", prompt, 8)
    ch = rep.body["choices"][0]
    job.tokens, job.logprobs = ch["token_ids"], ch["logprobs"]["token_logprobs"]
    assert rep.body["usage"]["total_tokens"] == MAX_LEN
    assert len(set(job.tokens)) >= 4, job.tokens  # not degenerate
    _check_against_oracle(oracle, job)
    # a second request sharing the first 2000 tokens (prefix hit near the limit)
    prompt2 = prompt[:2000] + _ids(rng, 30)
    before = srv.metric(server.metrics(), "vllm:prefix_cache_hits_total")
    rep2 = server.post(COMPLETIONS, _body(prompt2, 8, logprobs=1))
    assert rep2.status == 200, rep2.body
    hits = srv.metric(server.metrics(), "vllm:prefix_cache_hits_total") - before
    assert hits >= 1984, hits  # 124 full 16-token blocks of the shared 2000 tokens
    ch2 = rep2.body["choices"][0]
    job2 = Job(
        "plain", prompt2, 8, tokens=ch2["token_ids"], logprobs=ch2["logprobs"]["token_logprobs"]
    )
    _check_against_oracle(oracle, job2)


def test_server_answers_correctly_afterwards(server, oracle) -> None:
    assert server.alive()
    assert server.get("/health").status == 200
    rng = random.Random(31)
    for n in (1, 17, 200):
        p = _ids(rng, n)
        rep = server.post(COMPLETIONS, _body(p, 10, logprobs=1))
        assert rep.status == 200, rep.body
        ch = rep.body["choices"][0]
        _check_against_oracle(
            oracle, Job("plain", p, 10, tokens=ch["token_ids"],
                        logprobs=ch["logprobs"]["token_logprobs"])
        )  # fmt: skip
    m = server.metrics()
    assert srv.metric(m, "vllm:num_requests_running") == 0
    assert srv.metric(m, "vllm:request_success_total", finished_reason="error") == 0
