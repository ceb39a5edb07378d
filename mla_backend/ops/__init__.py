"""The device seam: the kernel interface every implementation provides and the one place that
picks an implementation for a device (:mod:`.seam`), and the implementations as sibling
packages of one shape, each exporting a ``Kernels`` class: :mod:`.torch` (plain PyTorch, the
fallback), :mod:`.native` (C++ CPU kernels), :mod:`.triton` (GPU). Implementations compose the
helpers they share instead of inheriting from each other: :mod:`.paged` (page gathers and the
normal path's dequantized cache reads), :mod:`.sdpa` (torch's fused MHA with LSE).

(The seam lives in its own module: importing the subpackage ``mla_backend.ops.torch`` binds the
name ``torch`` in this package's namespace.)
"""

from __future__ import annotations

from .seam import ENV_VAR, IMPLS, KernelImpl, get_impl, impl_name

__all__ = ["ENV_VAR", "IMPLS", "KernelImpl", "get_impl", "impl_name"]
