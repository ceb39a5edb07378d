"""One build or load of a torch JIT extension at a time per build directory, robust to killed
builds.

``torch.utils.cpp_extension.load`` guards an extension's build directory with a plain file named
``lock`` (torch's ``FileBaton``): created before the build, removed after it. A build killed in
between (Ctrl-C twice, OOM killer, a CI timeout) leaves the file behind, and every later load of
that extension, even of a finished build, waits for it to disappear, forever.

This module owns :func:`locked_load`, the loader's only way into ``cpp_extension.load``: it first
takes an OS-level lock (``fcntl.flock``) on ``<build dir>.mla-lock``, a file next to the build
directory, which the kernel releases when its holder exits or dies. Every loader of ours takes that
lock before torch's, so while holding it a torch ``lock`` file in the build directory is stale: it
is removed with one warning naming its path. Waiting for the lock is bounded
(``MLA_BACKEND_NATIVE_LOCK_TIMEOUT`` seconds, default :data:`DEFAULT_LOCK_TIMEOUT_S`); past it a
``TimeoutError`` names the lock file, the process holding it and what to do. Where the file
system has no ``flock`` the load goes ahead unlocked (torch's own lock only), saying so once.

A finished build is shared by every environment with the same binary identity (the caller's
``identity``: torch's build and ABI, Python, the compiler; not where they are installed): after a
successful build, a marker file holding ``identity`` is written into the build directory, and a
later load whose identity matches loads the library as it is. ``cpp_extension.load`` would instead
rewrite ``build.ninja`` with this environment's include paths, and ninja would rebuild every
source (minutes per ISA level) for a binary that is the same.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...config import current

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_S",
    "BUILT_MARKER",
    "ENV_LOCK_TIMEOUT",
    "build_directory",
    "build_lock",
    "lock_path",
    "lock_timeout",
    "locked_load",
]

ENV_LOCK_TIMEOUT = "MLA_BACKEND_NATIVE_LOCK_TIMEOUT"
#: seconds to wait for another process's build of the same extension (a cold build of every
#: native level takes minutes on a small, shared CPU)
DEFAULT_LOCK_TIMEOUT_S = 1800.0
_POLL_S = 0.1
#: the file a finished build's directory holds: the binary identity it was built with
BUILT_MARKER = "mla-built"
_TORCH_BATON = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory


def build_directory(name: str) -> Path:
    """The build directory ``cpp_extension.load(name=name)`` uses (``TORCH_EXTENSIONS_DIR`` or
    torch's default root, then ``name``; created if missing)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def lock_path(build_dir: Path) -> Path:
    """Our lock file of ``build_dir``: ``<build dir>.mla-lock``, next to it."""
    return build_dir.with_name(build_dir.name + ".mla-lock")


def lock_timeout() -> float:
    """``MLA_BACKEND_NATIVE_LOCK_TIMEOUT`` in seconds (>= 0), else the default."""
    raw = current().native_lock_timeout
    if not current().is_set(ENV_LOCK_TIMEOUT):
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{ENV_LOCK_TIMEOUT}={raw!r}: expected a number of seconds >= 0")
    return value


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote into the lock file ('unknown' if none)."""
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


def _acquire(fd: int, path: Path, limit: float) -> bool:
    """Take the flock of ``fd`` within ``limit`` seconds (True), or find that this file system
    has none (False, with a warning); ``TimeoutError`` past the limit."""
    import fcntl

    deadline = time.monotonic() + limit
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {limit:g} s for the native build lock {path}, held by process "
                    f"{_holder(fd)}, which is building or loading the same extension; wait for "
                    f"it or end it (the OS releases the lock of a process that exits), or set "
                    f"{ENV_LOCK_TIMEOUT} to wait longer"
                ) from None
            time.sleep(_POLL_S)
        except OSError as e:  # no flock on this file system (ENOLCK)
            _warn_unlocked(path, e)
            return False


def _warn_unlocked(path: Path, err: OSError) -> None:
    warnings.warn(f"cannot lock the native build lock {path} ({err}); loading with torch's "
                  "lock only", RuntimeWarning, stacklevel=4)  # fmt: skip


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the OS lock of ``build_dir`` (waiting at most ``timeout`` seconds, default
    :func:`lock_timeout`; ``TimeoutError`` past it); on entry remove torch's stale ``lock``
    file from ``build_dir``, with a warning naming it."""
    limit = lock_timeout() if timeout is None else timeout
    path = lock_path(build_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # a read-only cache directory
        _warn_unlocked(path, e)
        yield
        return
    try:
        if _acquire(fd, path, limit):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            baton = build_dir / _TORCH_BATON
            if baton.exists():  # we hold the lock every loader takes first: nobody is building
                warnings.warn(f"removing the stale torch extension lock {baton} (left by a "
                              "killed build)", RuntimeWarning, stacklevel=3)  # fmt: skip
                baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def locked_load(name: str, identity: str | None = None, **kwargs: Any) -> Any:
    """``torch.utils.cpp_extension.load(name=name, **kwargs)`` under :func:`build_lock` of the
    extension's build directory (``kwargs`` must not name ``build_directory``).

    With ``identity`` (only for ``is_python_module=False``): if the directory holds a finished
    build marked with the same identity, its library is loaded (``torch.ops.load_library``)
    without calling ninja; after a build, the directory is marked with it."""
    from torch.utils import cpp_extension

    if identity is not None and kwargs.get("is_python_module", True):
        raise ValueError("locked_load: identity= reuses op libraries only (is_python_module=False)")
    build_dir = build_directory(name)
    with build_lock(build_dir):
        marker, library = build_dir / BUILT_MARKER, build_dir / f"{name}.so"
        if identity is not None and library.is_file() and marker.is_file():
            if marker.read_text() == identity:
                import torch

                torch.ops.load_library(str(library))
                return str(library)
            marker.unlink()  # another identity's build: rebuilt below
        path = cpp_extension.load(name=name, build_directory=str(build_dir), **kwargs)
        if identity is not None:
            tmp = marker.with_name(marker.name + f".{os.getpid()}")
            tmp.write_text(identity)
            tmp.replace(marker)  # atomic: a reader sees no marker or the whole identity
        return path
