"""The tool installer of the core harness (:mod:`mla_backend.testing.cross_tools`) with
the tools hidden from it: which apt-get commands it runs as root, that it runs none without
root or in a dry run, and what it reports."""

from __future__ import annotations

import pytest

from mla_backend.testing import cross_tools as ct


@pytest.fixture
def no_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ct.shutil.which
    monkeypatch.setattr(ct.shutil, "which", lambda t: None if t in ct.PACKAGES else real(t))
    monkeypatch.setattr(ct, "fuzzer_runtime", lambda: None)


def test_installs_missing_tools_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ct.shutil, "which", lambda t: "/usr/bin/apt-get" if t == "apt-get" else None
    )
    monkeypatch.setattr(ct, "fuzzer_runtime", lambda: None)
    ran: list[list[str]] = []
    lines = ct.ensure(run=lambda c: ran.append(c) or 0, is_root=True)
    assert ran == [
        ["apt-get", "update"],
        [
            "apt-get",
            "install",
            "-y",
            "--no-install-recommends",
            "clang",
            "g++-aarch64-linux-gnu",
            "libclang-rt-dev",
            "qemu-user",
        ],
    ]
    assert lines[-1] == (  # (which is faked)
        "still missing: aarch64-linux-gnu-g++, qemu-aarch64, clang++, libFuzzer"
    )


def test_stops_after_a_failed_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ct.shutil, "which", lambda t: "/usr/bin/apt-get" if t == "apt-get" else None
    )
    monkeypatch.setattr(ct, "fuzzer_runtime", lambda: None)
    ran: list[list[str]] = []
    lines = ct.ensure(run=lambda c: ran.append(c) or 100, is_root=True)
    assert ran == [["apt-get", "update"]] and lines[0] == "ran apt-get update: exit 100"


def test_runs_nothing_without_root_or_in_a_dry_run(no_tools) -> None:
    def fail(c: list[str]) -> int:
        raise AssertionError(f"ran {c}")

    assert "cannot install (not root)" in ct.ensure(run=fail, is_root=False)[0]
    lines = ct.ensure(dry_run=True, run=fail, is_root=True)
    assert lines[0].startswith(
        "missing aarch64-linux-gnu-g++, qemu-aarch64, clang++, libFuzzer; would run:"
    )
    assert lines[2].endswith("clang g++-aarch64-linux-gnu libclang-rt-dev qemu-user")


def test_nothing_to_do_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct.shutil, "which", lambda t: f"/usr/bin/{t}")
    monkeypatch.setattr(ct, "fuzzer_runtime", lambda: "/usr/lib/libclang_rt.fuzzer-x86_64.a")
    assert ct.ensure(run=lambda c: 1 / 0) == [
        "tools present: aarch64-linux-gnu-g++, qemu-aarch64, clang++, libFuzzer"
    ]
    assert ct.install_commands([]) == []
