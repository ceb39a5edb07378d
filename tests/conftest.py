"""Core test configuration (threads). Test modules import the shared case builder from
:mod:`mla_backend.testing.cases`, never from ``conftest``: with ``tests/triton_path`` collected in
the same run, the name ``conftest`` can resolve to that folder's conftest instead."""

from __future__ import annotations

import pytest
import torch

import mla_backend.testing.reference  # noqa: F401  (mb.testing.reference in tests)


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)
