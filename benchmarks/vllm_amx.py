"""Which vLLM CPU MLA backend really runs, and running AMX_MLA's code on a CPU without AMX.

vLLM 0.32's CPU platform serves a request for ``AMX_MLA`` with CPU_MLA when the CPU has no AMX
tiles (it logs "Using CPU_MLA backend." and nothing else says so). The benchmarks compare against
AMX_MLA's code either way: on such a CPU they start its engine with :data:`SHIM_DIR` on
``PYTHONPATH`` (``amx_shim/sitecustomize.py``), which answers "AMX present" to vLLM's CPU platform
only: vLLM selects and configures AMX_MLA as on an AMX CPU, its kernels (``decode_attention_cpu``,
``extend_attention_cpu``, the packed ``bmm_cpu``) run their AVX-512 paths, and the rest of the
model (the linear layers' kernel choice) runs as it does for every other backend. The tables
name the backend each engine actually ran and say when AMX_MLA was forced this way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "amx_shim"
FORCE_ENV = "MLA_BENCH_FORCE_AMX_MLA"
FORCED_NOTE = (
    "AMX_MLA forced: this CPU has no AMX tiles, where vLLM would run CPU_MLA instead; the "
    "benchmark makes vLLM's CPU platform select and configure AMX_MLA as on an AMX CPU "
    "(benchmarks/vllm_amx.py); its kernels then run their AVX-512 code (no AMX tiles), the "
    "rest of the model as for every backend."
)
_USING = re.compile(r"Using (\w+) backend\.")


def cpu_has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def engine_env(backend: str, env: dict[str, str] | None = None) -> tuple[dict[str, str], bool]:
    """The environment for an engine process running ``backend``; second item: True when
    AMX_MLA is forced on a CPU without AMX (the shim is on ``PYTHONPATH``)."""
    env = dict(os.environ if env is None else env)
    if backend != "AMX_MLA" or cpu_has_amx():
        env.pop(FORCE_ENV, None)
        return env, False
    env[FORCE_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SHIM_DIR), env.get("PYTHONPATH", "")) if p
    )
    return env, True


def selected_from_log(text: str) -> str | None:
    """The backend vLLM says it selected (its last "Using X backend." line), if any."""
    found = _USING.findall(text)
    return found[-1] if found else None
