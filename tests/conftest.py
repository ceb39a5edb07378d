"""Core test configuration (threads; the ``isa`` fixture: one native ISA level per run; the
``kernels`` fixture: the torch implementation once and native at every tested level). Test
modules import the shared case builder from :mod:`mla_backend.testing.cases`, never from
``conftest``: with ``tests/triton_path`` collected in the same run, the name ``conftest`` can
resolve to that folder's conftest instead."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

import mla_backend.testing.reference  # noqa: F401  (mb.testing.reference in tests)
from mla_backend.config import current

if os.environ.get("MLA_TEST_INSTALLED") == "1":  # the nox sessions that test the built wheel
    _here = Path(mla_backend.__file__).resolve()
    if _here.is_relative_to(Path(__file__).resolve().parents[1] / "mla_backend"):
        raise pytest.UsageError(
            f"MLA_TEST_INSTALLED=1 but mla_backend is imported from the source tree ({_here}), "
            "not the installed wheel: run pytest from a directory outside the repository"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``MLA_TEST_DEFAULT_IMPL_ONLY=1`` (the core session's second pass, forced onto the torch
    implementation): only the tests that run on the default implementation; those that name
    theirs (the ``kernels`` / ``isa`` fixtures) ran in the first pass and would run the same."""
    if os.environ.get("MLA_TEST_DEFAULT_IMPL_ONLY") != "1":
        return
    keep, named = [], []
    for item in items:
        uses = getattr(item, "fixturenames", ())
        (named if "kernels" in uses or "isa" in uses else keep).append(item)
    if named:
        config.hook.pytest_deselected(items=named)
        items[:] = keep


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Seed torch's generator from the test's id: a failure found on one CPU reruns with the
    same data on another (only the CPU's own kernels, e.g. their summation order, differ)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _test_isas() -> list[str]:
    """The native ISA levels the per-level tests run: every level this CPU executes, or those
    of them named in ``MLA_BACKEND_TEST_ISAS`` (comma separated)."""
    from mla_backend.ops.native import host_isas

    host = list(host_isas())
    want = [x.strip() for x in current().test_isas.split(",") if x.strip()]
    return [x for x in host if x in want] if want else host


@pytest.fixture(params=_test_isas())
def isa(request: pytest.FixtureRequest) -> str:
    """One native ISA level (the test runs once per level); skipped where it does not build."""
    from mla_backend.ops import native

    if not native.available(request.param):
        pytest.skip(f"native ISA level {request.param}: {native.unavailable_reason(request.param)}")
    return request.param


def _first_test_level() -> str:
    """The first level the ``isa`` fixture runs (``MLA_BACKEND_TEST_ISAS`` filters them)."""
    from mla_backend.ops import native

    want = {x.strip() for x in current().test_isas.split(",") if x.strip()}
    return next((x for x in native.host_isas() if not want or x in want), "")


@pytest.fixture(params=["torch", "native"])
def kernels(request: pytest.FixtureRequest, isa: str) -> object:
    """The torch implementation (run once, at the first level tested) or native at ``isa``."""
    from mla_backend.ops import native
    from mla_backend.selection import get_impl

    if request.param == "torch":
        if isa != _first_test_level():
            pytest.skip("the torch path runs once")
        return get_impl(torch.device("cpu"), "torch")
    return native.Kernels(isa=isa)
