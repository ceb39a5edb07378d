"""Test tooling: vLLM's OpenAI-compatible server on 127.0.0.1 (started through the project's
launcher ``python -m mla_backend_integrations.vllm.cli serve``), and a small stdlib HTTP client
for it: plain and streaming completions, streams dropped by the client, Prometheus metrics.

Every wait and request is bounded; the server runs in its own process group (session), which
``stop()`` terminates by its id (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mla_backend_integrations._testing import engine_server
from mla_backend_integrations._testing.engine_server import Reply

__all__ = ["OpenAIServer", "Reply", "metric", "start_server"]

STARTUP_TIMEOUT_S = 300
SERVED_NAME = "tiny"


class OpenAIServer(engine_server.Server):
    """vLLM's OpenAI server (``engine_server.Server``) with the requests the tests make."""

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value} (vLLM's /metrics)."""
        text = self.get("/metrics").body
        out: dict[str, float] = {}
        for line in str(text).splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
        return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def start_server(
    model: Path, log_path: Path, extra_args: list[str], env: dict[str, str] | None = None
) -> OpenAIServer:
    """``python -m mla_backend_integrations.vllm.cli serve MODEL`` on 127.0.0.1, fp32."""
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    full_env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    full_env.update(env or {})

    def cmd(port: int) -> list[str]:
        return [
            sys.executable, "-m", "mla_backend_integrations.vllm.cli", "serve", str(model),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--served-model-name", SERVED_NAME,
            "--seed", "0",
            *extra_args,
        ]  # fmt: skip

    return OpenAIServer.launch(
        cmd, full_env, log_path, "/health", startup_timeout=STARTUP_TIMEOUT_S
    )
