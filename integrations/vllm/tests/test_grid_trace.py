"""The grid conftest's opt-in tracing (``MLA_GRID_DUMP`` / ``MLA_GRID_RNG``,
``integrations/vllm/upstream/grid_conftest.py``) on a stand-in for vLLM's test module: it
draws its data from the global RNG as vLLM's does, and its backend writes into the cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    _run(d, "-k", "chunked", MLA_GRID_RNG=str(d / "dump" / "rng" / CHUNKED),
         FAKE_SEEN=str(d / "replay.pt"))  # fmt: skip
    assert torch.equal(torch.load(d / "replay.pt")["query"], seen["query"])
    _run(d, "-k", "chunked", FAKE_SEEN=str(d / "alone.pt"))
    assert not torch.equal(torch.load(d / "alone.pt")["query"], seen["query"])
