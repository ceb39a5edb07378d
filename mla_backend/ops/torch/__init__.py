"""The plain-PyTorch implementation of the device seam: runs on every device (the fallback)."""

from __future__ import annotations

from .kernels import Kernels

__all__ = ["Kernels"]
