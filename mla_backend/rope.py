"""Interleaved (GPT-J) rotary embedding on the trailing channels of rows, from a cos/sin table
by position: the rotation DeepSeek-V4's compressor applies to its entries and the inverse its
attention applies to outputs (V4's value rows carry RoPE). Engines rotate queries and keys
themselves; the core rotates only what it computes."""

from __future__ import annotations

import torch

__all__ = ["rope_interleaved"]


def rope_interleaved(
    x: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``x`` [N, ..., D] with pairs ``(2i, 2i+1)`` of its last ``rope`` channels rotated by the
    angle of pair i at positions ``pos`` [N] (``inverse``: by minus that angle); a new tensor of
    ``x``'s dtype, computed in fp32.

    ``cos_sin`` [P, rope] float: per position, the cosines of the rope / 2 pairs, then their
    sines (the layout of vLLM's ``cos_sin_cache``), any attention scaling included."""
    rope = cos_sin.shape[1]
    if rope == 0:
        return x.clone()
    cs = cos_sin.float()[pos.long()]
    cs = cs.view(cs.shape[0], *([1] * (x.dim() - 2)), rope)
    cos, sin = cs[..., : rope // 2], cs[..., rope // 2 :]
    # each pair as a complex number times e^{+-i angle}: (a + ib)(cos + i sin)
    turn = torch.complex(cos, -sin if inverse else sin)
    pairs = torch.view_as_complex(x[..., -rope:].float().reshape(*x.shape[:-1], rope // 2, 2))
    out = x.clone()
    out[..., -rope:] = torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)
    return out
