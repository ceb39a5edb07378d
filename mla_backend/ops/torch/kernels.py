"""The torch implementation of the kernel interface (runs everywhere; the fallback): every seam
method in plain PyTorch, one module per op (see the package doc), and :func:`torch_default`, an
explicit delegation of one seam method of another implementation to this one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ...weights import AbsorbWeights, absorb_q, apply_W_UV
from ..base import (
    DELEGATE_ATTR,
    SEAM_METHODS,
    AbsorbedCall,
    IndexerCall,
    IndexKeyWrite,
    KernelImpl,
    KeySetCall,
    LatentWrite,
    MaskedMHACall,
    SparseCall,
    V4SlotCall,
)  # fmt: skip
from . import (
    absorbed_attention,
    decompress,
    indexer,
    keyset_attention,
    mha,
    paged,
    sparse_attention,
    sparse_mha,
    v4_slot_attention,
)  # fmt: skip
from .cache_write import write_latent


class Kernels(KernelImpl):
    """The torch implementation of :class:`mla_backend.ops.KernelImpl`.

    Tuning knobs (keyword arguments, see :class:`.absorbed_attention.Tuning`):
    ``max_tile_elements``, ``max_group_tokens``, ``max_query_rows``, ``flash_max_heads``,
    ``flash_split_tokens``, ``min_split_tokens``, ``max_split_tokens``.
    """

    name = "torch"

    def __init__(self, **knobs: int) -> None:
        self.tuning = absorbed_attention.Tuning(**knobs)

    def __repr__(self) -> str:
        return f"ops.torch.Kernels({asdict(self.tuning)})"

    def absorb_q(
        self, q_nope: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return absorb_q(q_nope, weights, out=out)

    def apply_W_UV(
        self, o_lat: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_W_UV(o_lat, weights, out=out)

    def write_latent(self, w: LatentWrite) -> None:
        write_latent(w)

    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        return call.deliver(*absorbed_attention.absorbed_attention(call, self.tuning))

    #: the normal path's read of the latent cache: :func:`.paged.gather_latent` as it is
    gather_latent = staticmethod(paged.gather_latent)

    def decompress(
        self, c_kv: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor, W_UV: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return decompress.decompress(c_kv, k_pe, W_UK, W_UV)

    def attention_with_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return mha.attention_with_lse(q, k, v, causal, scale)

    def write_index_keys(self, w: IndexKeyWrite) -> None:
        indexer.write_index_keys(w)

    def indexer_logits(self, call: IndexerCall) -> torch.Tensor:
        return indexer.indexer_logits(call)

    def indexer_topk(self, call: IndexerCall) -> torch.Tensor:
        return indexer.indexer_topk(call)

    def sparse_absorbed_attention(self, call: SparseCall) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_attention.sparse_absorbed_attention(call)

    def masked_attention_with_lse(self, call: MaskedMHACall) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_mha.masked_attention_with_lse(call)

    def keyset_attention(self, call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor]:
        return keyset_attention.keyset_attention(call)

    def v4_slot_attention(self, call: V4SlotCall) -> torch.Tensor:
        return v4_slot_attention.v4_slot_attention(call)


#: the torch implementation with its default tuning: the instance delegations run on
DEFAULT = Kernels()


def torch_default(method: str) -> Callable[..., Any]:
    """Seam method ``method`` of the torch implementation, as a method of another
    implementation's class: its explicit delegation (``indexer_topk =
    torch_default("indexer_topk")``; :func:`mla_backend.ops.base.served_by` reports it as
    served by ``torch``)."""
    if method not in SEAM_METHODS:
        raise ValueError(f"{method!r} is not a seam method; seam methods: {SEAM_METHODS}")

    def delegated(self: KernelImpl, *args: Any, **kwargs: Any) -> Any:
        return getattr(DEFAULT, method)(*args, **kwargs)

    delegated.__name__ = delegated.__qualname__ = method
    delegated.__doc__ = f"The torch implementation's {method} (delegated explicitly)."
    setattr(delegated, DELEGATE_ATTR, Kernels.name)
    return delegated
