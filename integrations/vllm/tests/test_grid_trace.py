"""The grid conftest's opt-in tracing (``MLA_GRID_DUMP`` / ``MLA_GRID_RNG``,
``integrations/vllm/upstream/grid_conftest.py``) on a stand-in for vLLM's test module (it
draws its data from the global RNG as vLLM's does, and its backend writes into the cache), and
``upstream/trace_report.py`` (a dump scored against the float64 oracle) on a synthetic dump."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_backend.testing.reference import reference_mla_attention

CONFTEST = Path(__file__).resolve().parents[1] / "upstream" / "grid_conftest.py"

#: a stand-in for tests/v1/attention/test_mla_backends.py: the names the conftest reads
FAKE_MODULE = '''
import os
from types import SimpleNamespace

import torch
from vllm.v1.attention.backends.registry import AttentionBackendEnum

B = AttentionBackendEnum.MLA_ABSORB
BACKENDS_TO_TEST = [B]
BACKEND_BLOCK_SIZES = {B: 1}
SPEC_DECODE_BACKENDS = [B]
torch.manual_seed(42)


def run_attention_backend(backend, kv_cache_spec, layer_names, vllm_config, device,
                          common_attn_metadata, query, kv_c, k_pe, kv_cache, kv_lora_rank,
                          qk_nope_head_dim, qk_rope_head_dim, v_head_dim, mock_kv_b_proj,
                          q_scale, k_scale, kv_cache_dtype="auto", prefill_backend=None,
                          chunked_prefill_workspace_size=None):
    kv_cache.add_(1.0)  # as a backend appends the new tokens: the dump keeps the input
    return query.flatten(1)[:, :4] * 2


def test_backend_correctness():
    torch.randn(1000)  # an earlier case: moves the global RNG on


def test_chunked_context_backend_correctness():
    query = torch.randn(3, 2, 8)
    kv_cache = torch.randn(4, 1, 2, 6)
    md = SimpleNamespace(
        block_table_tensor=torch.tensor([[1, 2]]), seq_lens=torch.tensor([3]),
        query_start_loc=torch.tensor([0, 3]), slot_mapping=torch.tensor([2, 3, 4]),
    )
    cache_in = kv_cache.clone()
    out = run_attention_backend(
        B, SimpleNamespace(block_size=2), ["x"], None, "cpu", md, query, query[:, 0, :4],
        query[:, :1, 4:], kv_cache, 4, 6, 2, 2, SimpleNamespace(weight=torch.ones(4, 4)),
        q_scale=1.0, k_scale=1.0, kv_cache_dtype="auto",
    )
    ref = out + 1e-3
    torch.save({"query": query, "kv_cache": cache_in, "output": out, "reference": ref},
               os.environ["FAKE_SEEN"])
    assert torch.allclose(out, ref, rtol=0, atol=1e-2)
'''

CHUNKED = "test_chunked_context_backend_correctness_MLA_ABSORB-bs2_.pt"


def _run(folder: Path, *args: str, **env: str) -> None:
    full = dict(os.environ, MLA_GRID_SELECT="all", MLA_GRID_BACKENDS="MLA_ABSORB",
                MLA_GRID_BLOCK_SIZES="2", **env)  # fmt: skip
    full["PYTHONPATH"] = os.pathsep.join([str(folder), full.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(folder), str(folder / "test_fake.py"), *args],
        cwd=folder, env=full, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def grid_folder(tmp_path: Path) -> Path:
    pytest.importorskip("vllm")
    shutil.copyfile(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_fake.py").write_text(FAKE_MODULE)
    return tmp_path


def test_dump_and_replay(grid_folder: Path) -> None:
    d = grid_folder
    # the selection: the chunked case's RNG state and data are saved
    _run(d, MLA_GRID_DUMP=str(d / "dump"), FAKE_SEEN=str(d / "seen.pt"))
    seen = torch.load(d / "seen.pt")
    dump = torch.load(d / "dump" / CHUNKED, weights_only=False)
    assert torch.equal(dump["query"], seen["query"])
    assert torch.equal(dump["kv_cache"], seen["kv_cache"])  # before the backend wrote
    assert torch.equal(dump["output"], seen["output"])
    assert torch.equal(dump["reference"], seen["reference"])
    assert dump["block_size"] == 2 and dump["backend"] == "MLA_ABSORB"
    assert torch.equal(dump["seq_lens"], torch.tensor([3]))
    rng = sorted(p.name for p in (d / "dump" / "rng").iterdir())
    assert rng == ["test_backend_correctness_MLA_ABSORB-bs2_.pt", CHUNKED]
    # the chunked case alone from its saved state sees the same data; without it, other data
    _run(d, "-k", "chunked", MLA_GRID_RNG=str(d / "dump" / "rng"), FAKE_SEEN=str(d / "replay.pt"))
    assert torch.equal(torch.load(d / "replay.pt")["query"], seen["query"])
    _run(d, "-k", "chunked", FAKE_SEEN=str(d / "alone.pt"))
    assert not torch.equal(torch.load(d / "alone.pt")["query"], seen["query"])


def _trace_report():
    path = CONFTEST.with_name("trace_report.py")
    spec = importlib.util.spec_from_file_location("trace_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_report_reads_the_paged_cache() -> None:
    """The report's truth is the oracle's float64 value of the sequences that were paged into
    a shuffled cache (unused slots hold noise), and it names the one element perturbed."""
    tr = _trace_report()
    g = torch.Generator().manual_seed(0)
    H, r, nope, rope, v, bs = 2, 16, 8, 4, 6, 4
    prefix, new = [5, 0, 9], [3, 2, 1]
    rand = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    c_kv = [rand(P + n, r) for P, n in zip(prefix, new)]
    k_pe = [rand(P + n, rope) for P, n in zip(prefix, new)]
    blocks = [-(-(P + n) // bs) for P, n in zip(prefix, new)]
    ids = (torch.randperm(sum(blocks), generator=g) + 1).tolist()
    cache = rand(sum(blocks) + 3, 1, bs, r + rope)
    table = torch.zeros(len(new), max(blocks), dtype=torch.int32)
    for i, P in enumerate(prefix):
        table[i, : blocks[i]] = torch.tensor(ids[: blocks[i]])
        del ids[: blocks[i]]
        for p in range(P):
            cache[table[i, p // bs], 0, p % bs] = torch.cat([c_kv[i][p], k_pe[i][p]])
    q = rand(sum(new), H, nope + rope)
    W = (torch.randn(H * (nope + v), r, generator=g) / 4).bfloat16()
    exact = reference_mla_attention(
        q[..., :nope], q[..., nope:], c_kv, k_pe, W, nope, v, new, dtype=torch.float64
    ).reshape(sum(new), -1)
    ref = exact.bfloat16()
    ref[2, 5] += 0.25  # token 2: request 0's third new token; head 0, dim 5
    dump = {
        "query": q, "kv_b_weight": W, "kv_cache": cache, "block_table": table,
        "kv_c": torch.cat([c[P:] for c, P in zip(c_kv, prefix)]),
        "k_pe": torch.cat([k[P:] for k, P in zip(k_pe, prefix)])[:, None, :],
        "seq_lens": torch.tensor([P + n for P, n in zip(prefix, new)]),
        "query_start_loc": torch.tensor([0, 3, 5, 6]), "block_size": bs, "kv_lora_rank": r,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
        "output": exact.bfloat16(), "reference": ref,
    }  # fmt: skip
    assert torch.equal(tr.truth_and_models(dump)["truth"], exact)
    lines = tr.report(dump, {"again": dict(dump)})
    assert lines[0].endswith(": 1 rejected")
    assert lines[1].startswith("  token 2 (request 0, new token 2) head 0 dim 5:")
    assert "rejected vs grid ref 1" in lines[-1]
    with pytest.raises(ValueError, match="kv_cache differs"):
        tr.report(dump, {"other": dict(dump, kv_cache=cache + 1)})
