"""The torch implementation of the kernel interface (runs everywhere; the fallback): the cache
write (:mod:`.write`), the absorbed attention's strategies (:mod:`.absorbed`), and the shared
helpers of :mod:`mla_backend.ops` for the normal path's cache reads and MHA and for DSA (the
indexer, :mod:`mla_backend.ops.indexer`; the sparse attention, :mod:`mla_backend.ops.sparse`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from ...cache_layout import CacheLayout
from ...cost import CPU_PROFILE, GPU_PROFILE, DeviceProfile
from ...weights import AbsorbWeights, absorb_q, apply_W_UV
from .. import dense, indexer, paged, sdpa, sparse
from . import absorbed
from .write import write_latent

if TYPE_CHECKING:
    from ...dims import MLADims
    from ...parts import PlanPart


class Kernels:
    """The torch implementation of :class:`mla_backend.ops.KernelImpl`.

    Tuning knobs (keyword arguments, see :class:`.absorbed.Tuning`): ``max_tile_elements``,
    ``max_group_tokens``, ``max_query_rows``, ``flash_max_heads``, ``flash_split_tokens``,
    ``min_split_tokens``, ``max_split_tokens``.
    """

    name = "torch"
    # shared helpers (composition: each is the same function in every implementation)
    absorb_q = staticmethod(absorb_q)
    apply_W_UV = staticmethod(apply_W_UV)
    attention_with_lse = staticmethod(sdpa.attention_with_lse)
    decompress = staticmethod(dense.decompress)
    gather_latent = staticmethod(paged.gather_latent)
    write_index_keys = staticmethod(indexer.write_index_keys)
    indexer_logits = staticmethod(indexer.indexer_logits)
    indexer_topk = staticmethod(indexer.indexer_topk)
    sparse_absorbed_attention = staticmethod(sparse.sparse_absorbed_attention)

    def __init__(self, **knobs: int) -> None:
        self.tuning = absorbed.Tuning(**knobs)

    def __repr__(self) -> str:
        return f"ops.torch.Kernels({asdict(self.tuning)})"

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """torch's CPU kernels (fused flash SDPA, bmm), or the GPU's published figures."""
        return CPU_PROFILE if device.type == "cpu" else GPU_PROFILE

    def work_shape(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        device: torch.device,
    ) -> tuple[int, int]:
        """One query block per request, one split (the strategies cut the work themselves)."""
        return max(1, max(new_lens, default=1)), 1

    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        return weights

    def write_latent(
        self,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None,
    ) -> None:
        write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale, layout)

    def absorbed_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        part: PlanPart,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return absorbed.absorbed_attention(
            q_lat, q_pe, kv_cache, part, softmax_scale, kv_scale, layout, self.tuning
        )
