"""The normal path: decompress latents to per-head K/V and run causal varlen MHA.

Good for long fresh prefills. New tokens attend causally to themselves; a cached prefix is
decompressed in bounded chunks (``chunk_tokens``) whose results are merged with the new-token
attention through the log-sum-exp, so peak memory does not grow with the prefix length.
Cache reads and attention go through the plan's kernel implementation (the device seam).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .merge import merge_attention_states
from .ops import KernelImpl
from .ops.torch import DEFAULT as TORCH
from .weights import AbsorbWeights

if TYPE_CHECKING:
    from .cache_layout import CacheLayout
    from .parts import PlanPart

DEFAULT_CHUNK_TOKENS = 4096


def decompress(
    latent: torch.Tensor,
    weights: AbsorbWeights,
    dtype: torch.dtype,
    impl: KernelImpl | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows -> per-head keys and values, with ``W_UK`` / ``W_UV`` (no other copy of
    ``kv_b_proj`` is kept), through ``impl.decompress`` (default: the torch implementation's).

    Args:
        latent: [L, r + rope] rows ``[c_kv ; k_pe]`` (already dequantized, ``dtype``).
        weights: ``W_UK`` [H, nope, r], ``W_UV`` [H, r, v] (fp8 ones are dequantized).
    Returns:
        k: [H, L, nope + rope] (``[W_UK·c_kv ; k_pe]``), v: [H, L, v] (``W_UV·c_kv``).
    """
    if impl is None:
        impl = TORCH  # the torch implementation
    r = weights.W_UK.shape[-1]
    W_UK = _dequant_weight(weights.W_UK, weights.W_UK_scale, dtype)
    W_UV = _dequant_weight(weights.W_UV, weights.W_UV_scale, dtype)
    return impl.decompress(latent[:, :r], latent[:, r:], W_UK, W_UV)


def _dequant_weight(
    w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    return w.to(dtype) if scale is None else (w.float() * scale).to(dtype)


def normal_attention_part(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    part: PlanPart,
    weights: AbsorbWeights,
    softmax_scale: float,
    kv_scale: torch.Tensor | None,
    chunk_tokens: int,
    impl: KernelImpl,
    new_c_kv: torch.Tensor | None = None,
    new_k_pe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decompressed causal MHA over prefix + new tokens for the requests of ``part``, through
    the plan's kernel implementation (inputs validated by the caller).

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope] (T == part.num_tokens).
        kv_cache: [num_pages, page_size, r + rope] holding every request's prefix (and the
            new tokens too, unless ``new_c_kv`` / ``new_k_pe`` [T, r] / [T, rope] are given);
            ``layout``: its layout, resolved by the caller.
        chunk_tokens: prefix tokens decompressed at a time.
        impl: the plan's kernel implementation (cache reads and attention).
    Returns:
        (o [T, H, v] in q_nope's dtype, lse [T, H] float32).
    """
    H, r, v_dim = weights.W_UV.shape
    T = q_nope.shape[0]
    cd = q_nope.dtype
    o_out = torch.empty(T, H, v_dim, dtype=cd, device=q_nope.device)
    lse_out = torch.empty(T, H, dtype=torch.float32, device=q_nope.device)
    for i in range(part.num_reqs):
        n = part.new_lens[i]
        if n == 0:
            continue
        P = part.prefix_lens[i]
        t0 = part.cu_new[i]
        q = torch.cat([q_nope[t0 : t0 + n], q_pe[t0 : t0 + n].to(cd)], -1).transpose(0, 1)
        if new_c_kv is not None and new_k_pe is not None:
            latent = torch.cat([new_c_kv[t0 : t0 + n], new_k_pe[t0 : t0 + n]], -1).to(cd)
        else:
            latent = impl.gather_latent(kv_cache, layout, part, i, P, P + n, cd, kv_scale)
        k, v = decompress(latent, weights, cd, impl)
        o, lse = impl.attention_with_lse(q, k, v, True, softmax_scale)
        o, lse = o.transpose(0, 1).float(), lse.transpose(0, 1)  # [n, H, v], [n, H]
        for s in range(0, P, chunk_tokens):
            e = min(P, s + chunk_tokens)
            latent = impl.gather_latent(kv_cache, layout, part, i, s, e, cd, kv_scale)
            k, v = decompress(latent, weights, cd, impl)
            o_c, lse_c = impl.attention_with_lse(q, k, v, False, softmax_scale)
            o, lse = merge_attention_states(o, lse, o_c.transpose(0, 1), lse_c.transpose(0, 1))
        o_out[t0 : t0 + n] = o
        lse_out[t0 : t0 + n] = lse
    return o_out, lse_out
