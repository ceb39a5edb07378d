"""An engine's HTTP server as a child process: started in its own process group on 127.0.0.1
with its output in a log file, polled until a ready path answers, always stopped as a group
(SIGTERM, then SIGKILL: engine subprocesses that outlive the main one). One place for the
serving benchmark and both engines' test servers.

Ports: the server binds its port tens of seconds after the test picks it, so the pick comes
from below the kernel's ephemeral range (where ``bind(0)`` and every outgoing connection of the
machine, e.g. the engines' own gloo and ZMQ sockets, take theirs) and below SGLang's own
22000-29999 picks; a server that still finds its port taken (another test's server picked it
first) is restarted on another (``Server.launch``).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

PORT_LOW, PORT_HIGH = 12000, 21999  # below SGLang's nccl picks (22000-29999)
BIND_FAILED = "address already in use"

S = TypeVar("S", bound="Server")


class Reply(NamedTuple):
    status: int
    body: Any  # parsed JSON (or the raw text when it is not JSON)


class PortTaken(RuntimeError):
    """The server could not bind a port it was given (its log says so)."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(offsets: Sequence[int] = (0,), attempts: int = 200) -> int:
    """A port ``p`` such that nothing listens on ``p + o`` for each ``o`` in ``offsets`` now,
    outside the kernel's ephemeral range where it has room (else any free port)."""
    high = min(PORT_HIGH, _ephemeral_low() - 1 - max(offsets))
    if high - PORT_LOW >= attempts:
        for port in random.sample(range(PORT_LOW, high + 1), attempts):
            if all(_bindable(port + o) for o in offsets):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One engine server in its own process group on 127.0.0.1, its output in ``log``.

    Ready when ``ready_path`` answers 200 (and, if given, ``ready_text`` is in the log)."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log: Path,
                 ready_path: str, startup_timeout: float = 420.0,
                 ready_text: str | None = None) -> None:  # fmt: skip
        self.port, self.log_path, self.ready_path = port, log, ready_path
        self.startup_timeout, self.ready_text = startup_timeout, ready_text
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @classmethod
    def launch(cls: type[S], cmd_for_port: Callable[[int], list[str]], env: dict[str, str],
               log: Path, ready_path: str, *, startup_timeout: float = 420.0,
               ready_text: str | None = None, port_offsets: Sequence[int] = (0,),
               attempts: int = 3) -> S:  # fmt: skip
        """Start ``cmd_for_port(port)`` on a ``free_port(port_offsets)`` and wait until it is
        ready; on a port found taken, stop it and start again on another (``attempts`` in all).
        ``port_offsets``: the ports the server derives from its own (SGLang's DP attention
        binds ``port + 233 ...``)."""
        for _ in range(attempts):
            port = free_port(port_offsets)
            server = cls(cmd_for_port(port), env, port, log, ready_path, startup_timeout,
                         ready_text)  # fmt: skip
            try:
                server.wait_ready()
                return server
            except PortTaken:
                server.stop()
            except BaseException:
                server.stop()
                raise
        raise RuntimeError(f"no free port after {attempts} tries: {server.tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self) -> None:
        """Poll ``ready_path`` until ready; raise ``PortTaken`` when the log shows a port the
        server could not bind, ``RuntimeError`` if it dies or times out."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if BIND_FAILED in self.log().lower():
                raise PortTaken(f"port {self.port} (or one derived from it) taken: {self.tail()}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200 and (
                        self.ready_text is None or self.ready_text in self.log()
                    ):
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"server not ready in {self.startup_timeout:.0f}s: {self.tail()}")

    # ------------------------------------------------------------------------------------
    # a small stdlib client: GET, POST, streaming POST (every request bounded by ``timeout``)
    # ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, data: bytes | None, timeout: float) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, data, {"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read().decode(errors="replace")
            try:
                return Reply(r.status, json.loads(raw))
            except json.JSONDecodeError:
                return Reply(r.status, raw)
        finally:
            conn.close()

    def get(self, path: str, timeout: float = 30) -> Reply:
        return self._request("GET", path, None, timeout)

    def post(self, path: str, body: Any, timeout: float = 240) -> Reply:
        """POST JSON (``body`` may also be raw bytes) and return the parsed reply."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self._request("POST", path, data, timeout)

    def stream(self, path: str, body: dict[str, Any], drop_after: int | None = None,
               timeout: float = 240,
               on_chunk: Callable[[int], None] | None = None) -> tuple[int, list[Any]]:  # fmt: skip
        """POST with ``stream: true``; returns (status, the parsed ``data:`` chunks).

        ``drop_after=k``: close the connection after k chunks (a client that goes away);
        ``on_chunk(n)`` is called after the n-th chunk."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        chunks: list[Any] = []
        try:
            data = json.dumps({**body, "stream": True}).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
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
                if on_chunk is not None:
                    on_chunk(len(chunks))
                if drop_after is not None and len(chunks) >= drop_after:
                    break
            return r.status, chunks
        finally:
            conn.close()  # for a dropped stream: the server sees the client go away

    def tail(self, n: int = 4000) -> str:
        return self.log()[-n:]

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL it (engine subprocesses that outlive the main one)."""
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
