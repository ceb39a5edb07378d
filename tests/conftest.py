"""Core test configuration; the shared case builder lives in :mod:`mla_backend.testing.cases`."""

from __future__ import annotations

import pytest
import torch

import mla_backend.testing.reference  # noqa: F401  (mb.testing.reference in tests)
from mla_backend.testing.cases import DIMS, TOL, Case, assert_close_to_oracle, make_case

__all__ = ["DIMS", "TOL", "Case", "assert_close_to_oracle", "make_case"]


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)
