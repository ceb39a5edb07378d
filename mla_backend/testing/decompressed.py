"""The decompressed-cache (CD) baseline of the paper's comparison: cache per-head K and V
(H * (nope + rope + v) values per token instead of r + rope) and attend with plain matmuls.

Used as the baseline in benchmarks and as a third path in the layer tests; it is not what the
backend serves with."""

from __future__ import annotations

import torch

from ..normal import decompress
from ..weights import AbsorbWeights


class DecompressedCache:
    """Contiguous per-request K [H, capacity, nope + rope] and V [H, capacity, v] buffers."""

    def __init__(
        self,
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        capacity: int,
        num_reqs: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.k = torch.zeros(num_reqs, num_heads, capacity, qk_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_reqs, num_heads, capacity, v_dim, dtype=dtype, device=device)
        self.lens = [0] * num_reqs

    @property
    def bytes_per_token(self) -> int:
        return (self.k.shape[1] * (self.k.shape[-1] + self.v.shape[-1])) * self.k.element_size()

    def append(self, req: int, latent: torch.Tensor, weights: AbsorbWeights, nope: int) -> None:
        """Decompress latent rows [L, r + rope] of request ``req`` and append them."""
        k, v = decompress(latent.to(self.k.dtype), weights, self.k.dtype)
        s, L = self.lens[req], latent.shape[0]
        if s + L > self.k.shape[2]:
            raise ValueError(f"request {req}: {s + L} tokens exceed capacity {self.k.shape[2]}")
        self.k[req, :, s : s + L] = k
        self.v[req, :, s : s + L] = v
        self.lens[req] = s + L


def cd_attention(
    q: torch.Tensor, cache: DecompressedCache, new_lens: list[int], softmax_scale: float
) -> torch.Tensor:
    """Attention over a decompressed cache with plain matmuls (the seed's CD variant).

    Args:
        q: [T, H, nope + rope], packed per request; the cache already holds the new tokens.
        new_lens: per request, new tokens (the last ones of its cached sequence).
    Returns:
        [T, H, v] in q's dtype.
    """
    T, H, _ = q.shape
    out = torch.empty(T, H, cache.v.shape[-1], dtype=q.dtype, device=q.device)
    row = 0
    for i, n in enumerate(new_lens):
        L = cache.lens[i]
        qi = q[row : row + n].transpose(0, 1)  # [H, n, qk]
        s = torch.matmul(qi, cache.k[i, :, :L].transpose(1, 2)).float() * softmax_scale
        if n > 1:
            mask = torch.arange(L, device=q.device)[None, :] > (
                L - n + torch.arange(n, device=q.device)[:, None]
            )
            s.masked_fill_(mask, float("-inf"))
        p = torch.softmax(s, dim=-1).to(q.dtype)
        out[row : row + n] = torch.matmul(p, cache.v[i, :, :L]).transpose(0, 1)
        row += n
    return out
