"""DeepSeek rotary embedding of ``q_pe`` / ``k_pe``: interleaved pairs, optional yarn scaling.

DeepSeek rotates adjacent pairs ``(x[2i], x[2i+1])`` (vLLM's ``is_neox_style=False``). With
``rope_scaling = {"type": "yarn", ...}`` the frequencies are blended between interpolation
and extrapolation (YaRN) and cos/sin carry ``mscale(factor, mscale) / mscale(factor,
mscale_all_dim)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..dims import yarn_factor, yarn_mscale


def _yarn_correction_dim(num_rot: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(
    dim: int, base: float, rope_scaling: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] float32 and the cos/sin magnitude factor."""
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base**exps)
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if not rope_scaling or kind in (None, "default"):
        return inv_freq, 1.0
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: 'yarn'")
    factor = yarn_factor(rope_scaling)
    orig = int(rope_scaling.get("original_max_position_embeddings", 4096))
    beta_fast = float(rope_scaling.get("beta_fast", 32))
    beta_slow = float(rope_scaling.get("beta_slow", 1))
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, orig)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    magnitude = yarn_mscale(factor, float(rope_scaling.get("mscale", 1.0))) / yarn_mscale(
        factor, float(rope_scaling.get("mscale_all_dim", 0.0) or 0.0)
    )
    return inv_freq, magnitude


class DeepseekRope:
    """Applies RoPE to ``[..., rope]`` tensors at given positions (interleaved pairs)."""

    def __init__(
        self, dim: int, base: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None
    ) -> None:
        self.dim = dim
        self.inv_freq, self.magnitude = (
            rope_inv_freq(dim, base, rope_scaling) if dim else (torch.zeros(0), 1.0)
        )

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., rope] any float dtype; positions: [T] int -> rotated, x's dtype."""
        if self.dim == 0:
            return x
        ang = positions.float()[:, None] * self.inv_freq.to(x.device)[None, :]  # [T, rope/2]
        cos = (torch.cos(ang) * self.magnitude).view(ang.shape[0], *[1] * (x.dim() - 2), -1)
        sin = (torch.sin(ang) * self.magnitude).view_as(cos)
        xf = x.float()
        even, odd = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
        return out.flatten(-2).to(x.dtype)
