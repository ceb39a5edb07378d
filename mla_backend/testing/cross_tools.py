"""The tools of the core harness (tests/native_core/) beyond the host compiler: Debian's
aarch64 cross compiler ``g++-aarch64-linux-gnu`` and ``qemu-user`` (``qemu-aarch64``), and for
the fuzz targets (tests/native_core/fuzz/) ``clang`` with its libFuzzer runtime
(``libclang-rt-dev``, the default clang's), installed with apt-get where they are missing and
this process may (root, apt-get present). ``python -m mla_backend.testing.cross_tools
[--dry-run]`` prints what it found and what it did (or would do); it never fails: targets whose
tools are still missing are skipped by the tests, naming them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Callable

LIBFUZZER = "libFuzzer"
#: tool (on PATH, or :data:`LIBFUZZER`: clang++'s fuzzer runtime) -> the Debian package that
#: provides it
PACKAGES = {
    "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
    "qemu-aarch64": "qemu-user",
    "clang++": "clang",
    LIBFUZZER: "libclang-rt-dev",
}


def fuzzer_runtime() -> str | None:
    """The path of clang++'s libFuzzer runtime (x86-64), or None (no clang++, or no runtime)."""
    cxx = shutil.which("clang++")
    if cxx is None:
        return None
    res = subprocess.run(
        [cxx, "-print-file-name=libclang_rt.fuzzer-x86_64.a"], capture_output=True, text=True
    )
    path = res.stdout.strip()
    return path if os.path.isabs(path) and os.path.isfile(path) else None


def missing_tools() -> list[str]:
    """The tools of :data:`PACKAGES` not present."""
    return [
        t for t in PACKAGES if (fuzzer_runtime() if t == LIBFUZZER else shutil.which(t)) is None
    ]


def install_commands(missing: list[str]) -> list[list[str]]:
    """The apt-get commands that install ``missing`` tools (none when nothing is missing)."""
    if not missing:
        return []
    pkgs = sorted({PACKAGES[t] for t in missing})
    return [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *pkgs],
    ]


def ensure(
    dry_run: bool = False,
    run: Callable[[list[str]], int] | None = None,
    is_root: bool | None = None,
) -> list[str]:
    """Install the missing tools if possible; returns what happened, one line per step.
    ``run`` (default: subprocess) runs one command and returns its exit status."""
    missing = missing_tools()
    if not missing:
        return [f"tools present: {', '.join(PACKAGES)}"]
    cmds = install_commands(missing)
    root = os.geteuid() == 0 if is_root is None else is_root
    if dry_run:
        return [f"missing {', '.join(missing)}; would run:"] + [" ".join(c) for c in cmds]
    if not root or shutil.which("apt-get") is None:
        why = "not root" if not root else "no apt-get"
        return [f"missing {', '.join(missing)}; cannot install ({why}): their targets skip"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run = run or (lambda c: subprocess.run(c, env=env).returncode)
    lines = []
    for c in cmds:
        rc = run(c)
        lines.append(f"ran {' '.join(c)}: exit {rc}")
        if rc != 0:
            break
    still = missing_tools()
    lines.append(f"still missing: {', '.join(still)}" if still else "tools installed")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    for line in ensure(dry_run=ap.parse_args().dry_run):
        print(line)


if __name__ == "__main__":
    main()
