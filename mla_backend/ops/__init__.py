"""The device seam: the one place that picks the kernel implementation for a tensor's device.

``torch`` (``mla_backend.ops.torch_ops``) runs everywhere and is the CPU path; ``triton``
(``mla_backend.ops.triton_ops``) is the GPU path on CUDA/ROCm. ``MLA_BACKEND_IMPL`` =
``auto`` (default) | ``torch`` | ``triton`` overrides the choice, so tests can force the
Triton path on CPU tensors under ``TRITON_INTERPRET=1``.
Both modules expose ``write_latent(...)`` and ``absorbed_attention(...)`` with identical
signatures (see ``torch_ops``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

IMPLS = ("auto", "torch", "triton")
ENV_VAR = "MLA_BACKEND_IMPL"


def impl_name(device: torch.device, override: str | None = None) -> str:
    """Which implementation serves ``device`` ('torch' or 'triton')."""
    choice = (override or os.environ.get(ENV_VAR, "auto")).strip().lower()
    if choice not in IMPLS:
        raise ValueError(f"{ENV_VAR}={choice!r} is not supported; supported: {', '.join(IMPLS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if choice == "triton" and not _triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported")
    return choice


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def get_impl(device: torch.device, override: str | None = None) -> ModuleType:
    """The implementation module for ``device``."""
    name = impl_name(device, override)
    return importlib.import_module(f"mla_backend.ops.{name}_ops")
