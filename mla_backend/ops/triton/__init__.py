"""The GPU implementation of the device seam, in Triton (CUDA/ROCm; CPU tensors under
``TRITON_INTERPRET=1``): :mod:`.jit` holds the ``@triton.jit`` kernels, :mod:`.ops` the
``torch.library`` custom ops that launch them, :mod:`.kernels` the :class:`Kernels` class."""

from __future__ import annotations

from .kernels import Kernels

__all__ = ["Kernels"]
