"""Validation of attention inputs: each call's query, cache and batch against each other,
with errors that name the offending value and what is supported."""

from __future__ import annotations

import torch

from .batch import MLABatch
from .fp8 import FP8_DTYPE

QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)


def check_cache(kv_cache: torch.Tensor, latent_dim: int, kv_scale: torch.Tensor | None) -> None:
    """Validate a paged latent cache [num_pages, page_size, r + rope]."""
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != latent_dim:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not supported: expected "
            f"[num_pages, page_size, {latent_dim}] (kv_lora_rank + qk_rope_head_dim)"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} is not supported; supported: "
            "bfloat16, float16, float32, float8_e4m3fn"
        )
    if kv_scale is not None and kv_cache.dtype != FP8_DTYPE:
        raise ValueError(f"kv_scale is only meaningful for an fp8 cache, not {kv_cache.dtype}")
    if kv_scale is not None and kv_scale.numel() != 1:
        raise ValueError(
            f"kv_scale of shape {tuple(kv_scale.shape)} is not supported: the fp8 latent cache "
            "takes one per-tensor scale"
        )


def check_step(
    q_a: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    latent_dim: int,
    kv_scale: torch.Tensor | None,
) -> None:
    """Validate one attention call's query, cache and batch against each other."""
    if q_a.dtype not in QUERY_DTYPES or q_pe.dtype != q_a.dtype:
        raise ValueError(
            f"query dtypes {q_a.dtype}/{q_pe.dtype} are not supported; use one of bf16, fp16, "
            "fp32 for both"
        )
    if q_a.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_a.shape[:2]:
        raise ValueError(
            f"query shapes {tuple(q_a.shape)} / {tuple(q_pe.shape)} are not [T, H, *] / "
            "[T, H, rope] with the same T and H"
        )
    if q_a.shape[0] != batch.num_tokens:
        raise ValueError(
            f"queries hold {q_a.shape[0]} tokens but the batch describes {batch.num_tokens}"
        )
    check_cache(kv_cache, latent_dim, kv_scale)
    if kv_cache.shape[1] != batch.page_size:
        raise ValueError(
            f"kv_cache page size {kv_cache.shape[1]} != batch.page_size {batch.page_size}"
        )
    batch.check_pages(kv_cache.shape[0])
