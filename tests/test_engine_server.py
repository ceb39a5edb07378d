"""The engine test servers' launcher (``mla_backend_integrations._testing.engine_server``): a
picked port lies outside the kernel's ephemeral range with its derived ports free, and a server
that finds its port taken is restarted on another instead of hanging until the start-up timeout
(CI once lost an SGLang module that way)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from mla_backend_integrations._testing import engine_server


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's ephemeral port range")
def test_free_port_is_below_the_ephemeral_range_with_its_offsets_free() -> None:
    offsets = (0, 233, 240)
    for _ in range(20):
        port = engine_server.free_port(offsets)
        assert port + max(offsets) < _ephemeral_low()
        for o in offsets:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + o))  # raises if taken


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_a_server_whose_port_is_taken_is_restarted_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    busy = taken.getsockname()[1]
    picks = iter([busy])
    real = engine_server.free_port
    monkeypatch.setattr(
        engine_server, "free_port", lambda offsets=(0,): next(picks, None) or real(offsets)
    )
    ports: list[int] = []

    def cmd(port: int) -> list[str]:
        ports.append(port)
        return _http_server(port)

    server = engine_server.Server.launch(cmd, {}, tmp_path / "log", "/", startup_timeout=60)
    try:
        assert ports[0] == busy and len(ports) == 2 and server.port == ports[1] != busy
        assert server.alive()
    finally:
        server.stop()
        taken.close()
    assert not server.alive()


def test_a_server_that_never_gets_a_port_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    busy = taken.getsockname()[1]
    monkeypatch.setattr(engine_server, "free_port", lambda offsets=(0,): busy)
    try:
        with pytest.raises(RuntimeError, match="no free port after 2 tries"):
            engine_server.Server.launch(
                _http_server, {}, tmp_path / "log", "/", startup_timeout=60, attempts=2
            )
    finally:
        taken.close()
