"""One plan part's FlashInfer MLA wrapper: planned at our plan time from host ints, re-planned
in place by :meth:`mla_backend.MLAPlan.refresh_`, run once per layer.

FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (public API: ``plan(qo_indptr,
kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
sm_scale, q_data_type, kv_data_type)``, ``run(q_nope, q_pe, ckv_cache, kpe_cache,
return_lse=True)``) takes the latent cache as two caches [pages, page_size, r] and
[pages, page_size, rope]; ours is one [pages, page_size, r + rope] tensor, so it gets the two
column views. Its pages are CSR (``kv_indptr`` / ``kv_indices``), gathered on the device from
our block table with an index built on the host (no sync). The wrapper is made with
``use_cuda_graph=True`` and fixed index buffers sized by the plan (requests, block-table
columns), so a refreshed plan re-plans into the same addresses a captured graph reads. Its LSE
is base 2 unless ``run`` has ``return_lse_base_on_e`` (newer versions): we return natural log.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...dims import MLADims

#: The latent widths FlashInfer's MLA kernels are built for (DeepSeek V2/V3).
KV_LORA_RANK, ROPE_DIM = 512, 64
#: Query / cache dtypes the wrapper serves (the cache in the same dtype as the queries).
DTYPES = (torch.bfloat16, torch.float16)
#: Float workspace for its split-KV partials (FlashInfer recommends 128 MB).
WORKSPACE_BYTES = 128 << 20


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when ``flashinfer`` imports and has the MLA wrapper."""
    try:
        module = importlib.import_module("flashinfer.mla")
    except Exception:  # not installed, or a broken install: never break the other paths
        return False
    return hasattr(module, "BatchMLAPagedAttentionWrapper")


def plan_serves(dims: MLADims, device: torch.device) -> bool:
    """The plan-time half of the rule: FlashInfer serves CUDA tensors with r = 512, rope = 64."""
    return (
        device.type == "cuda"
        and dims.kv_lora_rank == KV_LORA_RANK
        and dims.qk_rope_head_dim == ROPE_DIM
        and available()
    )


def run_serves(
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    planned_dtype: torch.dtype,
    softmax_scale: float,
    planned_scale: float,
    kv_scale: torch.Tensor | None,
) -> bool:
    """The call-time half: queries and cache in the planned dtype (bf16 / fp16; no fp8 or
    ``fp8_ds_mla`` cache, no ``kv_scale``) and the planned softmax scale."""
    return (
        q_dtype == planned_dtype
        and cache_dtype == planned_dtype
        and kv_scale is None
        and math.isclose(softmax_scale, planned_scale, rel_tol=1e-6)
    )


def csr_pages(
    kv_lens: Sequence[int], page_size: int, columns: int
) -> tuple[list[int], list[int]]:
    """(kv_indptr [n + 1], flat indices into the block table [n * columns] of the used pages)."""
    indptr, flat = [0], []
    for i, L in enumerate(kv_lens):
        n = -(-L // page_size)
        indptr.append(indptr[-1] + n)
        flat.extend(i * columns + p for p in range(n))
    return indptr, flat


class MLAWrapperPlan:
    """A FlashInfer MLA wrapper planned for one plan part (see the module doc).

    Args:
        workspace: the float workspace (uint8, on the device), shared by the implementation's
            plans (their runs are serialized on one stream).
        dims: the layer dims (r 512, rope 64).
        new_lens / kv_lens: host ints per request; block_table: [n, columns] int32 (device).
        page_size: tokens per page; dtype: queries' and cache's dtype; softmax_scale: the
            scale the wrapper is planned with.
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        block_table: torch.Tensor,
        page_size: int,
        dtype: torch.dtype,
        softmax_scale: float,
    ) -> None:
        import flashinfer.mla

        n, columns = block_table.shape
        dev = block_table.device
        i32 = torch.int32
        self.dims, self.dtype, self.softmax_scale = dims, dtype, softmax_scale
        self.page_size = page_size
        self._buffers = (
            torch.zeros(n + 1, dtype=i32, device=dev),
            torch.zeros(n + 1, dtype=i32, device=dev),
            torch.zeros(max(n * columns, 1), dtype=i32, device=dev),
            torch.zeros(n, dtype=i32, device=dev),
        )
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            workspace, True, *self._buffers
        )
        self._lse_base_e = "return_lse_base_on_e" in inspect.signature(self.wrapper.run).parameters
        self._args = (tuple(new_lens), tuple(kv_lens), block_table)
        self._plan(*self._args)

    def _plan(self, new_lens: Sequence[int], kv_lens: Sequence[int], table: torch.Tensor) -> None:
        qo = [0]
        for x in new_lens:
            qo.append(qo[-1] + x)
        indptr, flat = csr_pages(kv_lens, self.page_size, table.shape[1])
        index = torch.tensor(flat, dtype=torch.long, device=table.device)
        self.wrapper.plan(
            torch.tensor(qo, dtype=torch.int32),
            torch.tensor(indptr, dtype=torch.int32),
            table.reshape(-1).index_select(0, index),  # page ids, gathered on the device
            torch.tensor(list(kv_lens), dtype=torch.int32),
            self.dims.num_heads,
            KV_LORA_RANK,
            ROPE_DIM,
            self.page_size,
            True,  # causal among new tokens, bottom-right aligned (a no-op for decodes)
            self.softmax_scale,
            self.dtype,
            self.dtype,
        )

    def copy_(self, other: MLAWrapperPlan) -> MLAWrapperPlan:
        """Re-plan in place for ``other``'s step (same requests; lengths and pages may change)."""
        self._args = other._args
        self._plan(*self._args)
        return self

    def run(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_lat [T, H, 512], q_pe [T, H, 64], kv_cache [pages, page_size, 576] ->
        (o_lat [T, H, 512] in q's dtype, lse [T, H] float32, natural log)."""
        r = KV_LORA_RANK
        ckv, kpe = kv_cache[..., :r], kv_cache[..., r:]
        q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
        if self._lse_base_e:
            return self.wrapper.run(
                q_lat, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True
            )
        o, lse2 = self.wrapper.run(q_lat, q_pe, ckv, kpe, return_lse=True)
        return o, lse2 * math.log(2.0)
