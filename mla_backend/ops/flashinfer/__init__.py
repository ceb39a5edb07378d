"""The FlashInfer implementation of the device seam (opt-in: ``MLA_BACKEND_IMPL=flashinfer``):
FlashInfer's MLA paged-attention wrapper for the absorbed path where it serves the case, our
Triton kernels everywhere else. Importable without flashinfer (it is imported when planning)."""

from .kernels import Kernels

__all__ = ["Kernels"]
