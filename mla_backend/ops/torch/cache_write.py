"""The torch implementation's cache write: ``[c_kv ; k_pe]`` rows encoded by the layout
(:meth:`~mla_backend.cache_layout.CacheLayout.encode`) and scattered to their slots without
reading the padding mask on the host."""

from __future__ import annotations

import torch

from ..base import LatentWrite


def write_latent(w: LatentWrite) -> None:
    """Write c_kv [T, r], k_pe [T, rope] to ``slot_mapping`` [>= T] of ``kv_cache`` [pages,
    page_size, width] in ``layout``, in place (the fields of ``w``).

    Padding slots (< 0) are redirected, without reading the mask on the host, to the largest
    slot of the step with that slot's own row (identical duplicate writes), or, when every slot
    is padding, to the last cache row with its current content. Slots are in range (refused at
    the entry point, :func:`mla_backend.checks.check_slots`); the index never wraps."""
    kv_cache, c_kv, k_pe, slot_mapping = w.kv_cache, w.c_kv, w.k_pe, w.slot_mapping
    kv_scale, layout = w.kv_scale, w.layout
    T = c_kv.shape[0]
    n_rows = kv_cache.shape[0] * kv_cache.shape[1]
    if T == 0 or n_rows == 0:  # no cache rows: every slot is padding (the entry point checked)
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1]).view(layout.storage_dtype)
    slots = slot_mapping[:T].long()
    row = layout.encode(c_kv, k_pe, kv_scale)
    valid = slots >= 0
    top = slots.argmax().view(1)
    smax = slots.index_select(0, top)  # [1]; < 0 only if every slot is padding
    redirect = torch.where(smax >= 0, smax, n_rows - 1)  # all padding: the last row
    target = torch.where(valid, slots, redirect)
    keep = flat.index_select(0, redirect)  # that row's current content
    fill = torch.where((smax >= 0)[:, None], row.index_select(0, top), keep)
    src = torch.where(valid[:, None], row, fill)
    flat.index_put_((target,), src)
