"""Test tooling: a tiny DeepSeek-V2 checkpoint, a CPU SGLang server on 127.0.0.1, and the
transformers oracle (``DeepseekV2ForCausalLM`` on the same safetensors weights).

Every request and wait loop is bounded; the server runs in its own process group, which the
fixture's teardown terminates (SIGTERM, then SIGKILL) by its id.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from mla_backend_integrations._testing import engine_server

STUBS = str(Path(__file__).resolve().parent / "stubs")
# SGLang's CPU rotary path asserts yarn rope_scaling; mscale == mscale_all_dim keeps the rope
# magnitude 1 but still scales the softmax by mscale(factor, mscale_all_dim)^2.
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120


def make_model(path: Path, **dims: Any) -> Path:
    """A tiny random DeepSeek-V2 checkpoint (fp32 safetensors), see mla_backend.testing."""
    from mla_backend.testing.tiny_model import make_tiny_deepseek_v2

    make_tiny_deepseek_v2(path, rope_scaling=YARN, dtype="float32", **dims)
    return path


#: SGLang's CPU rotary asserts a DeepSeek-yarn rope_scaling; at factor 1 (mscale 1) it is the
#: default RoPE transformers' DSA models read from rope_parameters: same frequencies, no scaling
YARN_AS_DEFAULT = {
    "type": "yarn",
    "factor": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def make_dsa_model(path: Path, index_topk: int, seed: int, preset: str = "v32") -> Path:
    """A tiny random DSA checkpoint (``make_tiny_dsa`` with ``DSA_PRESETS[preset]``, fp32) that
    SGLang's CPU path loads and transformers reads the same: ``rope_scaling``
    :data:`YARN_AS_DEFAULT`, and the indexers' ``weights_proj`` rounded to bf16 values (SGLang
    keeps that weight in bf16 whatever the model dtype, so the fp32 reference then holds the
    same values)."""
    from safetensors.torch import load_file, save_file

    from mla_backend.testing.tiny_model import DSA_PRESETS, make_tiny_dsa

    make_tiny_dsa(path, index_topk=index_topk, dtype="float32", seed=seed,
                  **DSA_PRESETS[preset])  # fmt: skip
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_scaling"] = dict(
        YARN_AS_DEFAULT, original_max_position_embeddings=cfg["max_position_embeddings"]
    )
    cfg_path.write_text(json.dumps(cfg, indent=2))
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name.endswith("indexer.weights_proj.weight"):
                tensors[name] = t.to(torch.bfloat16).float()
        save_file(tensors, str(f), metadata={"format": "pt"})
    return path


class Server(engine_server.Server):
    """A CPU SGLang server (``engine_server.Server``) with the requests the tests make."""

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
            },
            "return_logprob": True,
        }
        req = urllib.request.Request(
            self.url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def score(self, input_ids: list[int], start: int) -> list[float]:
        """Teacher-forced logprobs of ``input_ids[start:]`` (each given the tokens before it)."""
        body = {
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": start - 1,
        }
        req = urllib.request.Request(
            self.url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            entries = json.loads(r.read())["meta_info"]["input_token_logprobs"]
        lps = [e[0] for e in entries]
        if lps and lps[0] is None:  # the first position has no preceding token
            lps = lps[1:]
        return [float(x) for x in lps[: len(input_ids) - start]]


def start_server(
    model: Path,
    log_path: Path,
    extra_args: list[str],
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
    skip_tokenizer_init: bool = True,
) -> Server:
    """``SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --device cpu`` on 127.0.0.1.

    ``skip_tokenizer_init=False`` loads the model folder's tokenizer (the OpenAI endpoints
    need it; /generate with ``input_ids`` works either way)."""
    full_env = dict(os.environ)
    full_env["SGLANG_USE_CPU_ENGINE"] = "1"
    pp = full_env.get("PYTHONPATH", "")
    full_env["PYTHONPATH"] = STUBS + (os.pathsep + pp if pp else "")
    full_env.update(env or {})

    def cmd(port: int) -> list[str]:
        return [
            *(launcher or [sys.executable, "-m", "sglang.launch_server"]),
            "--model-path", str(model),
            "--device", "cpu",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", "float32",
            "--max-total-tokens", "4096",
            "--disable-cuda-graph",
            *(["--skip-tokenizer-init"] if skip_tokenizer_init else []),
            *extra_args,
        ]  # fmt: skip

    # DP attention binds the ports from port + 233 on (SGLang's ZMQ_TCP_PORT_DELTA)
    return Server.launch(
        cmd, full_env, log_path, "/model_info", startup_timeout=STARTUP_TIMEOUT_S,
        ready_text="The server is fired up", port_offsets=(0, *range(233, 233 + 8)),
    )  # fmt: skip


class Oracle:
    """transformers' DeepseekV2ForCausalLM (fp32, eager attention) on the same weights."""

    def __init__(self, model: Path) -> None:
        from transformers import DeepseekV2ForCausalLM

        self.model = DeepseekV2ForCausalLM.from_pretrained(
            str(model), dtype=torch.float32, attn_implementation="eager"
        ).eval()

    @torch.no_grad()
    def greedy(self, input_ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """(tokens, logprob of each chosen token) of greedy decoding."""
        out = self.model.generate(
            torch.tensor([input_ids]),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=3,
            eos_token_id=None,
        )
        toks = out.sequences[0, len(input_ids) :].tolist()
        lps = [
            torch.log_softmax(lg[0].float(), -1)[t].item()
            for lg, t in zip(out.logits, toks, strict=True)
        ]
        return toks, lps


def tokens_and_logprobs(resp: dict[str, Any]) -> tuple[list[int], list[float]]:
    entries = resp["meta_info"]["output_token_logprobs"]
    return [int(e[1]) for e in entries], [float(e[0]) for e in entries]


def random_prompt(seed: int, n: int) -> list[int]:
    """n token ids (10..9999, inside the tiny models' vocab) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 10000, (n,), generator=g).tolist()


def module_fixtures(
    name: str,
    model_kwargs: dict[str, Any],
    extra_args: list[str],
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> tuple[Any, Any, Any]:
    """The module-scoped ``model``, ``server`` and ``oracle`` fixtures of one e2e module (one
    tiny checkpoint, one server on it, transformers on the same weights)::

        model, server, oracle = _server.module_fixtures("tiny_odd", dims, ["--attention-..."])
    """
    import pytest

    @pytest.fixture(scope="module")
    def model(tmp_path_factory: Any) -> Path:
        return make_model(tmp_path_factory.mktemp(name) / "model", **model_kwargs)

    @pytest.fixture(scope="module")
    def server(model: Path, tmp_path_factory: Any) -> Any:
        log = tmp_path_factory.mktemp(f"server_{name}") / "server.log"
        srv = start_server(model, log, extra_args, env=env, launcher=launcher)
        yield srv
        srv.stop()

    @pytest.fixture(scope="module")
    def oracle(model: Path) -> Oracle:
        return Oracle(model)

    return model, server, oracle
