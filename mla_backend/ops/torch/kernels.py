"""The torch implementation of the kernel interface (runs everywhere; the fallback): the cache
write (:mod:`.write`) and the absorbed attention's strategies (:mod:`.absorbed`); everything else
is the base class's torch default (:mod:`mla_backend.ops.base`)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from ..base import AbsorbedCall, KernelImpl, LatentWrite
from . import absorbed
from .write import write_latent


class Kernels(KernelImpl):
    """The torch implementation of :class:`mla_backend.ops.KernelImpl` (every other method is
    the base class's torch default).

    Tuning knobs (keyword arguments, see :class:`.absorbed.Tuning`): ``max_tile_elements``,
    ``max_group_tokens``, ``max_query_rows``, ``flash_max_heads``, ``flash_split_tokens``,
    ``min_split_tokens``, ``max_split_tokens``.
    """

    name = "torch"

    def __init__(self, **knobs: int) -> None:
        self.tuning = absorbed.Tuning(**knobs)

    def __repr__(self) -> str:
        return f"ops.torch.Kernels({asdict(self.tuning)})"

    def write_latent(self, w: LatentWrite) -> None:
        write_latent(w.kv_cache, w.c_kv, w.k_pe, w.slot_mapping, w.kv_scale, w.layout)

    def absorbed_attention(self, call: AbsorbedCall) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = absorbed.absorbed_attention(
            call.q_lat, call.q_pe, call.kv_cache, call.part, call.softmax_scale, call.kv_scale,
            call.layout, self.tuning,
        )
        return call.deliver(o, lse)
