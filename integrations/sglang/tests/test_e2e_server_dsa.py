"""End to end, DeepSeek Sparse Attention: a CPU SGLang server with ``--attention-backend
mla_absorb`` on a tiny random DeepSeek-V3.2 (``make_tiny_dsa``, ``DSA_PRESETS["v32"]``: 8 heads,
latent 512 + rope 64, nope 128, v 128, q_lora 96, 8 index heads x 128; fp32 safetensors,
``_server.make_dsa_model``) vs transformers' own ``DeepseekV32ForCausalLM`` on the same weights
(``mla_backend_integrations._testing.dsa_reference.DSAOracle``).

One server, ``index_topk`` 16, page size 64 (SGLang's for DSA), ``--chunked-prefill-size 64``,
fp32 (the ``dsa-cpu-kv-dtype`` workaround keeps the latent cache fp32):

* contexts that stay within ``index_topk`` (prompt + new tokens <= 16): the selection is every
  visible token (the plan is dense: absorbed / normal paths), so the reference is transformers
  as it is (unquantized indexer): identical greedy tokens, logprobs within LOGPROB_ATOL;
* contexts far above it (up to 300 tokens, chunked into 64-token extends onto the cached
  prefix, prefix-cache hits, a concurrent batch mixing short and long requests): the selection
  decides the answer, and SGLang's indexer rounds q_I and k_I to e4m3 with power-of-two
  (``ue8m0``) scales per 128 values (``act_quant``), which this adapter's CPU forward does
  with the same rule (amax floor 1e-4; the reference's query floor 1e-10 differs only for
  groups whose amax is below 1e-4). Reference: ``DSAOracle(fp8_indexer=True)`` (that rounding,
  the core's tie rule): identical greedy tokens and the reference's teacher-forced logprob of
  every generated token within LOGPROB_ATOL. Negative controls: the unquantized and the dense
  (every token selected) references disagree.

Without ``-m slow``: the start-up check, one prompt within index_topk, the 300-token sparse
prompt and the path log (the server start dominates); the rest under ``-m slow``.

SGLang rotates q_I / k_I by a Hadamard transform before rounding (a CUDA kernel); the CPU
forward does not (see ``sparse.py``), and the reference does not either.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from mla_backend_integrations._testing.dsa_reference import DSAOracle

from . import _server

LOGPROB_ATOL = 1e-3
SPARSE_TOPK = 16
N_NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: Any) -> Path:
    return _server.make_dsa_model(
        tmp_path_factory.mktemp("tiny_v32") / "model", index_topk=SPARSE_TOPK, seed=11
    )


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: Any) -> Any:
    log = tmp_path_factory.mktemp("server_v32") / "server.log"
    srv = _server.start_server(
        model, log, ["--attention-backend", "mla_absorb", "--chunked-prefill-size", "64"]
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fp8_oracle(model: Path) -> DSAOracle:
    return DSAOracle(model, fp8_indexer=True)


def _check(server: Any, oracle: DSAOracle, ids: list[int], resp: dict | None = None) -> dict:
    resp = resp or server.generate(ids, N_NEW)
    toks, lps = _server.tokens_and_logprobs(resp)
    want = oracle.greedy(ids, N_NEW)
    assert toks == want, f"prompt len {len(ids)}: SGLang {toks} != reference {want}"
    ref = oracle.logprobs_along(ids, toks)[torch.arange(len(toks)), torch.tensor(toks)]
    diff = (torch.tensor(lps) - ref).abs().max().item()
    assert diff <= LOGPROB_ATOL, f"prompt len {len(ids)}: logprob difference {diff}"
    return resp


def test_server_built_mla_absorb_on_the_dsa_pool(server):
    log = server.log()
    assert "mla_absorb: H=8 r=512 rope=64 nope=128 v=128 page_size=64" in log
    assert "kv dtype=torch.float32" in log


@pytest.mark.parametrize("length", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_within_topk_matches_unquantized_transformers(server, model, length):
    """Every context <= index_topk: the model is dense MLA; transformers as it is."""
    assert length + N_NEW <= SPARSE_TOPK
    _check(server, DSAOracle(model), _server.random_prompt(length, length))


@pytest.mark.parametrize("length", [pytest.param(40, marks=pytest.mark.slow), 300])
def test_sparse_matches_fp8_indexer_reference(server, fp8_oracle, length):
    """Contexts above index_topk (300: five 64-token chunks, each extending the cached prefix
    sparsely) against the reference with SGLang's indexer rounding."""
    _check(server, fp8_oracle, _server.random_prompt(1000 + length, length))


@pytest.mark.slow
def test_prefix_hit_and_concurrent_mixed_batch(server, fp8_oracle):
    """A 128-token cached prefix (two pages) extended sparsely, then short (dense) and long
    (sparse) requests served together."""
    base = _server.random_prompt(7, 150)
    _check(server, fp8_oracle, base)
    hit = base[:140] + _server.random_prompt(8, 20)
    r = _check(server, fp8_oracle, hit)
    assert r["meta_info"]["cached_tokens"] >= 128
    prompts = [_server.random_prompt(50 + i, n) for i, n in enumerate([3, 90, 6, 200])]
    with ThreadPoolExecutor(max_workers=4) as ex:
        resps = list(ex.map(lambda p: server.generate(p, N_NEW), prompts))
    for ids, resp in zip(prompts, resps, strict=True):
        _check(server, fp8_oracle, ids, resp)


@pytest.mark.slow
def test_negative_controls(server, model):
    """The unquantized and the dense (every token selected) references each disagree with the
    server somewhere above index_topk: the rounding and the selection both matter."""
    prompts = [_server.random_prompt(2000 + n, n) for n in (40, 120, 300)]
    got = [_server.tokens_and_logprobs(server.generate(p, N_NEW))[0] for p in prompts]
    for oracle in (DSAOracle(model), DSAOracle(model, index_topk=4096)):
        want = [oracle.greedy(p, N_NEW) for p in prompts]
        assert want != got, "a reference that should disagree agrees with SGLang"


def test_every_path_ran(server):
    """Runs last: the log shows the dense (absorbed) and sparse paths, fresh and onto a
    cached prefix."""
    log = server.log()
    assert re.search(r"path=sparse_absorbed phase=extend has_prefix=False", log)
    assert re.search(r"path=sparse_absorbed phase=extend has_prefix=True", log)
    assert re.search(r"path=sparse_absorbed phase=decode", log)
    assert re.search(r"path=(absorbed|normal-call:\w+) phase=extend has_prefix=False", log)


@pytest.mark.slow  # a second server (~2 min to start)
def test_glm5_shape_matches_fp8_indexer_reference(tmp_path):
    """GLM-5's shape (``DSA_PRESETS["glm5"]``: the third layer reuses the second's top-k,
    interleaved indexer RoPE, v 256 != nope 192): dense and sparse prompts, one of them
    chunked, against the same references."""
    path = _server.make_dsa_model(tmp_path / "glm5", index_topk=SPARSE_TOPK, seed=12,
                                  preset="glm5")  # fmt: skip
    srv = _server.start_server(
        path, tmp_path / "server.log",
        ["--attention-backend", "mla_absorb", "--chunked-prefill-size", "64"],
    )  # fmt: skip
    try:
        assert "r=512 rope=64 nope=192 v=256 page_size=64" in srv.log()
        _check(srv, DSAOracle(path), _server.random_prompt(3, 6))
        fp8_oracle = DSAOracle(path, fp8_indexer=True)
        for n in (40, 200):
            _check(srv, fp8_oracle, _server.random_prompt(3000 + n, n))
    finally:
        srv.stop()
