"""Plugin path: ``--attention-backend mla_absorb`` parses only because our entry point ran.

Each check runs in a fresh interpreter (argparse choices are process-global), doing what
``sglang.launch_server`` does before serving: ``load_plugins()`` then ``prepare_server_args``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from . import _server

SCRIPT = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
args = prepare_server_args(["--model-path", sys.argv[1], "--device", "cpu",
                            "--attention-backend", "mla_absorb"])
print("BACKEND", args.attention_backend)
print("FACTORY", "mla_absorb" in ATTENTION_BACKENDS)
print("HANDLER", AttentionBackendRegistry.get_handler("mla_absorb").__name__)
print("SPLIT", "mla_absorb" in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS)
"""


def _run(model, env_extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = _server.STUBS + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_cli_parses_with_plugin(tmp_path):
    model = _server.make_model(
        tmp_path / "m", num_heads=2, hidden_size=64, num_layers=1, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, moe=False,
    )  # fmt: skip
    ok = _run(model, {"SGLANG_PLUGINS": "mla_absorb"})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "BACKEND mla_absorb" in ok.stdout
    assert "FACTORY True" in ok.stdout
    assert "HANDLER handle_attention_mla_absorb" in ok.stdout
    assert "SPLIT True" in ok.stdout
    # Without our plugin (SGLANG_PLUGINS whitelists another name) the choice is rejected.
    no = _run(model, {"SGLANG_PLUGINS": "some_other_plugin"})
    assert no.returncode != 0
    assert "mla_absorb" in no.stderr and "invalid choice" in no.stderr
