"""Random problems the operator benchmarks share: paged latent caches and absorption weights;
and the decode problem's shape and cost (read by ``decode`` and ``plot``)."""

from __future__ import annotations

import torch

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout

#: the decode benchmark's latent (DeepSeek-V2/V3: kv_lora_rank 512, rope 64), its fp8_ds_mla
#: layout and the bytes of one cached row per cache kind
R, ROPE = 512, 64
DS = CacheLayout.ds_mla(R, ROPE, torch.bfloat16)
ROW_BYTES = {"bf16": (R + ROPE) * 2, "fp8": R + ROPE, "fp8_ds_mla": DS.bytes_per_token}


def flops_bytes(H: int, B: int, L: int, kind: str) -> tuple[float, float]:
    """FLOPs and cache bytes of one absorbed decode step: B requests of one query token over
    L cached rows of cache kind ``kind`` (:data:`ROW_BYTES`), H heads."""
    return 2.0 * H * L * (2 * R + ROPE) * B, float(B * L * ROW_BYTES[kind])


def paged_latents(dims: mb.MLADims, kv_lens: list[int], page_size: int, dtype: torch.dtype,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random latent cache holding ``kv_lens`` tokens per request in shuffled pages
    (page 0 unused). Returns (kv_cache [P, page, r + rope], block_table [B, max_pages])."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    num = sum(pages) + 1
    cache = (torch.randn(num, page_size, dims.latent_dim, generator=g) * 0.5).to(dtype)
    perm = torch.randperm(num - 1, generator=g) + 1
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    k = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[k : k + n]
        k += n
    return cache, table


def random_kv_b(dims: mb.MLADims, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random ``kv_b_proj`` weight [H * (nope + v), r], scaled by 1 / sqrt(r)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                    dims.kv_lora_rank, generator=g) / dims.kv_lora_rank**0.5  # fmt: skip
    return w.to(dtype)


def random_weights(dims: mb.MLADims, dtype: torch.dtype, seed: int = 0) -> mb.AbsorbWeights:
    """W_UK / W_UV split from :func:`random_kv_b`."""
    return mb.split_kv_b_proj(random_kv_b(dims, dtype, seed), dims)
