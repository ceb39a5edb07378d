"""The device seam: the base class every kernel implementation extends and the typed records
its calls take (:mod:`.base`), the registry implementations are registered in
(:mod:`.registry`), and the implementations as sibling packages of one shape, each exporting a
``Kernels`` class: :mod:`.torch` (plain PyTorch, the fallback), :mod:`.native` (C++ CPU
kernels), :mod:`.triton` (GPU), :mod:`.flashinfer` (FlashInfer's MLA wrapper, composing
Triton). Implementations share plain-torch helpers by composition, through the base class's
defaults: :mod:`.paged` (page gathers, the normal path's dequantized cache reads), :mod:`.dense`
(decompression), :mod:`.sdpa` (torch's fused MHA with LSE), :mod:`.indexer` / :mod:`.sparse`
(DSA's lightning indexer and sparse attention), :mod:`.keyset` (attention over key sets:
its records and plain-torch default).

Which implementation runs on a device is decided once, above the implementations, by
:func:`mla_backend.selection.resolve` (the registrations live there too).

(No module here is named after an implementation: importing the subpackage
``mla_backend.ops.torch`` binds the name ``torch`` in this package's namespace.)
"""

from __future__ import annotations

from .base import (
    AbsorbedCall,
    IndexerCall,
    IndexKeyWrite,
    KernelImpl,
    KeySetCall,
    LatentWrite,
    SparseCall,
)  # fmt: skip
from .keyset import KeyCache, KeyWindow
from .registry import IMPLS

__all__ = [
    "IMPLS", "AbsorbedCall", "IndexKeyWrite", "IndexerCall", "KernelImpl", "KeyCache",
    "KeySetCall", "KeyWindow", "LatentWrite", "SparseCall",
]  # fmt: skip
