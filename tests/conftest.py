"""Core test configuration (threads; the ``isa`` fixture: one native ISA level per run). Test
modules import the shared case builder from :mod:`mla_backend.testing.cases`, never from
``conftest``: with ``tests/triton_path`` collected in the same run, the name ``conftest`` can
resolve to that folder's conftest instead."""

from __future__ import annotations

import zlib

import pytest
import torch

import mla_backend.testing.reference  # noqa: F401  (mb.testing.reference in tests)
from mla_backend.config import current


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
