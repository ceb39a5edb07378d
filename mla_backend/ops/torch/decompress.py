"""The normal path's decompression in plain torch: the torch implementation's, and the one the
others delegate to (Triton, FlashInfer; the native one for the dtypes its kernel does not
take)."""

from __future__ import annotations

import torch


def decompress(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows -> per-head keys and values with two ``torch.mm`` in the weights' dtype.

    Args:
        c_kv: [L, r]; k_pe: [L, rope] (same dtype as the weights).
        W_UK: [H, nope, r]; W_UV: [H, r, v].

    Returns:
        k: [H, L, nope + rope] (``[W_UK·c_kv ; k_pe]``), v: [H, L, v] (``W_UV·c_kv``), views
        of [L, H, ·] tensors (a transient [r, H*v] copy of ``W_UV`` is made).
    """
    H, nope, r = W_UK.shape
    v_dim = W_UV.shape[-1]
    L = c_kv.shape[0]
    W_UV_flat = W_UV.transpose(0, 1).reshape(r, H * v_dim)
    k_nope = torch.mm(c_kv, W_UK.reshape(H * nope, r).t()).view(L, H, nope)
    v = torch.mm(c_kv, W_UV_flat).view(L, H, v_dim)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(L, H, k_pe.shape[-1])], dim=-1)
    return k.transpose(0, 1), v.transpose(0, 1)
