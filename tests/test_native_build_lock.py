"""The native loader's build lock (mla_backend.ops.native.build_lock), for real: a tiny C++
extension (no torch headers, seconds to build) loaded by child processes into a temporary
``TORCH_EXTENSIONS_DIR`` after a build was killed holding torch's ``lock``, and by two processes
at once; the bounded wait and its error; the kernels' loader going through it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mla_backend.ops.native import build, build_lock

fcntl = pytest.importorskip("fcntl")

ROOT = Path(__file__).resolve().parents[1]
NAME = "mla_lock_test_ext"
CHILD_TIMEOUT_S = 240  # a hang (the bug) fails the test instead of blocking the suite

# the loader child: waits for the file ``go`` (when given), then loads the tiny extension
_LOADER = textwrap.dedent(
    """
    import ctypes, sys, time
    from pathlib import Path
    from mla_backend.ops.native.build_lock import locked_load
    name, src, go = sys.argv[1], sys.argv[2], sys.argv[3]
    print("imported", flush=True)
    while go and not Path(go).exists():
        time.sleep(0.01)
    path = locked_load(name, sources=[src], is_python_module=False, verbose=False)
    print(ctypes.CDLL(path).mla_lock_test_answer(), flush=True)
    """
)
# the loader child of one environment: its own include path (where its torch and Python would
# be), the binary identity it would compute
_ENV_LOADER = textwrap.dedent(
    """
    import ctypes, sys
    from mla_backend.ops.native.build_lock import locked_load
    name, src, inc, identity = sys.argv[1:5]
    path = locked_load(name, identity=identity, sources=[src], is_python_module=False,
                       extra_include_paths=[inc], verbose=False)
    print(ctypes.CDLL(path).mla_lock_test_answer(), flush=True)
    """
)
# the killed build: holds our lock and torch's ``lock`` file, as a build in progress does
_KILLED_BUILD = textwrap.dedent(
    """
    import sys, time
    from mla_backend.ops.native.build_lock import build_directory, build_lock
    d = build_directory(sys.argv[1])
    with build_lock(d):
        (d / "lock").touch()
        print("building", flush=True)
        time.sleep(600)
    """
)


@pytest.fixture
def ext_env(tmp_path: Path) -> dict[str, str]:
    """A child environment with a fresh ``TORCH_EXTENSIONS_DIR``; skips without a toolchain."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        pytest.skip(f"no ninja: {e}")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONWARNINGS="default")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    (tmp_path / "tiny.cpp").write_text('extern "C" int mla_lock_test_answer() { return 42; }\n')
    return env


def _child(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(p: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the load hung for {CHILD_TIMEOUT_S} s:\n{out}\n{err}")
    assert p.returncode == 0, f"the load failed (rc {p.returncode}):\n{out}\n{err}"
    return out, err


def _build_dir(env: dict[str, str]) -> Path:
    return Path(env["TORCH_EXTENSIONS_DIR"]) / NAME


def test_load_after_a_killed_build(ext_env: dict[str, str], tmp_path: Path) -> None:
    """A build killed while holding torch's ``lock`` leaves it behind; the next load removes it
    (warning with its path) and finishes."""
    holder = _child(_KILLED_BUILD, ext_env, NAME)
    assert holder.stdout is not None
    line = holder.stdout.readline().strip()
    holder.send_signal(signal.SIGKILL)
    holder.communicate()
    baton = _build_dir(ext_env) / "lock"
    assert line == "building" and baton.exists()
    assert build_lock.lock_path(_build_dir(ext_env)).exists()  # the dead holder's file stays

    out, err = _finish(_child(_LOADER, ext_env, NAME, str(tmp_path / "tiny.cpp"), ""))
    assert out.split() == ["imported", "42"]
    assert f"removing the stale torch extension lock {baton}" in err
    assert not baton.exists()


def test_two_processes_load_at_once(ext_env: dict[str, str], tmp_path: Path) -> None:
    """Two processes released together into a cold build both load the extension; one build."""
    go = tmp_path / "go"
    src = str(tmp_path / "tiny.cpp")
    kids = [_child(_LOADER, ext_env, NAME, src, str(go)) for _ in range(2)]
    for k in kids:  # both imported torch and wait at the start line
        assert k.stdout is not None and k.stdout.readline().strip() == "imported"
    go.touch()
    for k in kids:
        out, err = _finish(k)
        assert out.split() == ["42"]
        assert "stale" not in err  # a live build's lock is never taken for a stale one
    assert not (_build_dir(ext_env) / "lock").exists()
    assert [p.name for p in _build_dir(ext_env).glob("*.so")] == [f"{NAME}.so"]


def test_environments_share_a_finished_build(ext_env: dict[str, str], tmp_path: Path) -> None:
    """A build finished in one environment is loaded as it is by another with the same binary
    identity but other include paths (no ninja run: the library and build.ninja unchanged);
    another identity rebuilds; a build without a marker (killed before it) is rebuilt."""
    src = str(tmp_path / "tiny.cpp")
    incs = [tmp_path / f"env{i}" for i in range(3)]
    for d in incs:
        d.mkdir()
    d = _build_dir(ext_env)
    library, ninja, marker = d / f"{NAME}.so", d / "build.ninja", d / build_lock.BUILT_MARKER

    def load(inc: Path, identity: str) -> None:
        out, _ = _finish(_child(_ENV_LOADER, ext_env, NAME, src, str(inc), identity))
        assert out.split() == ["42"]

    load(incs[0], "torch X")
    assert marker.read_text() == "torch X" and str(incs[0]) in ninja.read_text()
    built = library.stat().st_mtime_ns
    load(incs[1], "torch X")  # same binary, another environment: loaded, not rebuilt
    assert library.stat().st_mtime_ns == built and str(incs[1]) not in ninja.read_text()
    load(incs[1], "torch Y")  # another identity: rebuilt with this environment's command
    assert marker.read_text() == "torch Y" and str(incs[1]) in ninja.read_text()
    marker.unlink()  # as a build killed before it finished leaves it
    load(incs[2], "torch Y")
    assert marker.read_text() == "torch Y" and str(incs[2]) in ninja.read_text()


def test_wait_is_bounded(tmp_path: Path) -> None:
    """A lock held by a live process: the wait ends at the bound with a TimeoutError naming the
    lock file, the holder's pid and the setting."""
    d = tmp_path / "ext" / NAME
    d.mkdir(parents=True)
    path = build_lock.lock_path(d)
    with path.open("w") as held:  # its own open file: flock conflicts within one process too
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        with pytest.raises(TimeoutError) as ei, build_lock.build_lock(d, timeout=0.3):
            pass
    msg = str(ei.value)
    assert str(path) in msg and "4242" in msg and build_lock.ENV_LOCK_TIMEOUT in msg
    with build_lock.build_lock(d, timeout=0.0):  # released: taken at once
        assert path.read_text().strip() == str(os.getpid())


@pytest.mark.parametrize(("raw", "want"), [("", 1800.0), ("2.5", 2.5), ("0", 0.0)])
def test_lock_timeout(monkeypatch: pytest.MonkeyPatch, raw: str, want: float) -> None:
    monkeypatch.setenv(build_lock.ENV_LOCK_TIMEOUT, raw)
    assert build_lock.lock_timeout() == want


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_lock_timeout_rejects(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(build_lock.ENV_LOCK_TIMEOUT, raw)
    with pytest.raises(ValueError, match=rf"{build_lock.ENV_LOCK_TIMEOUT}='{raw}'"):
        build_lock.lock_timeout()


def test_kernels_loader_takes_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load of the kernels' builds (OpenMP, then serial) goes through locked_load."""
    names: list[str] = []

    class Refused(Exception):
        pass

    def fake(name: str, **kwargs: object) -> None:
        names.append(name)
        raise Refused(name)

    monkeypatch.setattr(build_lock, "locked_load", fake)
    with pytest.raises(Refused):
        build._build("scalar")
    assert [n.startswith("mla_backend_native_scalar_") for n in names] == [True, True]
    assert not names[0].endswith("_serial") and names[1].endswith("_serial")
