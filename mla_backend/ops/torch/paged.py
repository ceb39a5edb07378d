"""Reads of the paged latent cache in plain torch: one request's logical rows gathered through
the plan's host page ids (:func:`latent_rows`, also the torch absorbed attention's), and those
rows dequantized for the normal path (:func:`gather_latent`: every implementation delegates its
``gather_latent`` here).

Sizes and page ids come from the plan's host data (:class:`~mla_backend.parts.PlanPart`), never
from tensors; the kv scale stays a tensor: no device-to-host sync.
"""

from __future__ import annotations

import torch

from ...cache_layout import CacheLayout
from ...parts import PlanPart


def latent_rows(
    kv_cache: torch.Tensor,
    part: PlanPart,
    i: int,
    start: int,
    end: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[start, end)`` of request ``i``'s logical latent sequence, as stored
    ([end - start, W], the cache's dtype and row width W): a view of the cache when the plan's
    host page ids are consecutive, else a copy (into ``out`` when given: a reusable buffer of at
    least ``pages * page_size * W`` elements, which spares a fresh allocation's page faults).

    kv_cache: [num_pages, page_size, W]."""
    ps, D = kv_cache.shape[1], kv_cache.shape[2]
    p0, p1 = start // ps, (end - 1) // ps + 1
    if part.pages is not None:
        ids = part.pages[i][p0:p1]
        first = ids[0]
        consecutive = ids == tuple(range(first, first + len(ids)))
        if ids[-1] - first == len(ids) - 1 and consecutive:
            rows = kv_cache[first : first + (p1 - p0)].reshape(-1, D)
            return rows[start - p0 * ps : end - p0 * ps]
    pages = part.block_table[i, p0:p1]
    if out is not None:
        dst = out[: (p1 - p0) * ps * D].view(p1 - p0, ps * D)
        torch.index_select(kv_cache.view(kv_cache.shape[0], ps * D), 0, pages, out=dst)
        rows = dst.view(-1, D)
    else:
        rows = kv_cache.index_select(0, pages).view(-1, D)
    return rows[start - p0 * ps : end - p0 * ps]


def gather_latent(
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    part: PlanPart,
    i: int,
    start: int,
    end: int,
    dtype: torch.dtype,
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Rows ``[start, end)`` of request ``i`` of ``part`` as [end - start, r + rope] in
    ``dtype``, dequantized by ``layout`` (``kv_scale``: a float32 tensor, never read on the
    host): the normal path's read of the latent cache."""
    return layout.decode(latent_rows(kv_cache, part, i, start, end), dtype, kv_scale)
