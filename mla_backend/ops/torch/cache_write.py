"""The torch implementation's cache write: ``[c_kv ; k_pe]`` rows encoded by the layout
(:meth:`~mla_backend.cache_layout.CacheLayout.encode`) and scattered to their slots without
reading the padding mask on the host."""

from __future__ import annotations

import torch

from ..base import LatentWrite
from .slots import write_targets


def write_latent(w: LatentWrite) -> None:
    """Write c_kv [T, r], k_pe [T, rope] to ``slot_mapping`` [>= T] of ``kv_cache`` [pages,
    page_size, width] in ``layout``, in place (the fields of ``w``).

    Slots are in range (refused at the entry point, :func:`mla_backend.checks.check_slots`);
    the index never wraps. A slot named by several tokens holds the last one's row and padding
    (< 0) writes nothing (:func:`~.slots.write_targets`: no host read of the mask)."""
    kv_cache, c_kv, k_pe, slot_mapping = w.kv_cache, w.c_kv, w.k_pe, w.slot_mapping
    T = c_kv.shape[0]
    n_rows = kv_cache.shape[0] * kv_cache.shape[1]
    if T == 0 or n_rows == 0:  # no cache rows: every slot is padding (the entry point checked)
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1]).view(w.layout.storage_dtype)
    to = write_targets(slot_mapping[:T].long(), n_rows)
    row = w.layout.encode(c_kv, k_pe, w.kv_scale)
    keep = flat.index_select(0, to.target[:1])  # all padding: the row's current content
    src = torch.where(to.any_valid[:, None], row.index_select(0, to.source), keep)
    flat.index_put_((to.target,), src)
