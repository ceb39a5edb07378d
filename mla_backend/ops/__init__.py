"""The device seam: the base class every kernel implementation extends, the seam methods each
one declares (:data:`~.base.SEAM_METHODS`) and the typed records its calls take (:mod:`.base`),
the registry implementations are registered in (:mod:`.registry`), and the implementations as
sibling packages of one shape, each exporting a ``Kernels`` class: :mod:`.torch` (plain
PyTorch, the fallback, one module per op), :mod:`.native` (C++ CPU kernels), :mod:`.triton`
(GPU), :mod:`.flashinfer` (FlashInfer's MLA wrapper, composing Triton). No torch code of the
ops lives here: an implementation that wants the torch implementation's code for a seam method
says so by name (``m = torch_default("m")``, :func:`mla_backend.ops.torch.torch_default`).

Which implementation runs on a device is decided once, above the implementations, by
:func:`mla_backend.selection.resolve` (the registrations live there too).

(No module here is named after an implementation: importing the subpackage
``mla_backend.ops.torch`` binds the name ``torch`` in this package's namespace.)
"""

from __future__ import annotations

from .base import (
    SEAM_METHODS,
    AbsorbedCall,
    IndexerCall,
    IndexKeyWrite,
    KernelImpl,
    KeyCache,
    KeySetCall,
    KeyWindow,
    LatentWrite,
    MaskedMHACall,
    SparseCall,
    V4SlotCall,
)  # fmt: skip
from .registry import IMPLS

__all__ = [
    "IMPLS", "SEAM_METHODS", "AbsorbedCall", "IndexKeyWrite", "IndexerCall", "KernelImpl",
    "KeyCache", "KeySetCall", "KeyWindow", "LatentWrite", "MaskedMHACall", "SparseCall",
    "V4SlotCall",
]  # fmt: skip
