"""Triton kernel tests: on CPU tensors under the Triton interpreter (default), or compiled on a
GPU with ``MLA_TEST_DEVICE=cuda``.

The interpreter must be switched on before any ``@triton.jit`` kernel of the package is
decorated, so it is set here, at conftest import (before the test modules are collected).
"""

from __future__ import annotations

import os

if os.environ.get("MLA_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
