"""Test tooling: vLLM's OpenAI-compatible server on 127.0.0.1 (started through the project's
launcher ``python -m mla_backend_integrations.vllm.cli serve``), and a small stdlib HTTP client
for it: plain and streaming completions, streams dropped by the client, Prometheus metrics.

Every wait and request is bounded; the server runs in its own process group (session), which
``stop()`` terminates by its id (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_backend_integrations._testing import engine_server

STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 240
SERVED_NAME = "tiny"


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON (or the raw text when it is not JSON)


class OpenAIServer(engine_server.Server):
    """vLLM's OpenAI server (``engine_server.Server``) with the requests the tests make."""

    def _conn(self, timeout: float = REQUEST_TIMEOUT_S) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> Reply:
        conn = self._conn(timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            raw = r.read().decode(errors="replace")
            try:
                return Reply(r.status, json.loads(raw))
            except json.JSONDecodeError:
                return Reply(r.status, raw)
        finally:
            conn.close()

    def post(self, path: str, body: Any, timeout: float = REQUEST_TIMEOUT_S) -> Reply:
        """POST JSON (``body`` may also be raw bytes) and return the parsed reply."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = self._conn(timeout)
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read().decode(errors="replace")
            try:
                return Reply(r.status, json.loads(raw))
            except json.JSONDecodeError:
                return Reply(r.status, raw)
        finally:
            conn.close()

    def stream(
        self, path: str, body: dict[str, Any], drop_after: int | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> tuple[int, list[dict[str, Any]]]:
        """POST with ``stream: true``; returns (status, the parsed ``data:`` chunks).

        ``drop_after=k``: close the connection after k chunks (a client that goes away)."""
        conn = self._conn(timeout)
        chunks: list[dict[str, Any]] = []
        try:
            conn.request(
                "POST", path, json.dumps({**body, "stream": True}).encode(),
                {"Content-Type": "application/json"},
            )
            r = conn.getresponse()
            if r.status != 200:
                return r.status, [{"error": r.read().decode(errors="replace")}]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunks.append(json.loads(payload))
                if drop_after is not None and len(chunks) >= drop_after:
                    break
            return r.status, chunks
        finally:
            # closes the socket: for a dropped stream the server sees the client disconnect
            conn.close()

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
