"""An engine's HTTP server as a child process: started in its own process group on 127.0.0.1
with its output in a log file, polled until a health path answers, always stopped as a group
(SIGTERM, then SIGKILL: engine subprocesses that outlive the main one). Used by the serving
benchmark; meant for the engine tests' servers too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One engine server in its own process group on 127.0.0.1, its output in ``log``."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log: Path,
                 ready_path: str, startup_timeout: float = 420.0) -> None:  # fmt: skip
        self.port, self.log_path, self.ready_path = port, log, ready_path
        self.startup_timeout = startup_timeout
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self) -> None:
        """Poll ``ready_path`` until it answers 200; raise if the server dies or times out."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                url = f"http://127.0.0.1:{self.port}{self.ready_path}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"server not ready in {self.startup_timeout:.0f}s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

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
