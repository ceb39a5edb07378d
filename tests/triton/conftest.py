"""Triton kernel tests run on CPU tensors under the Triton interpreter.

The variable must be set before any ``@triton.jit`` kernel of the package is decorated, so it
is set here, at conftest import (before the test modules are collected).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
