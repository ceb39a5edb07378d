"""A full MLA attention layer (hidden states -> output) on top of the core, as DeepSeek-V2
defines it: q_lora (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) or plain ``q_proj``,
``kv_a_proj_with_mqa`` -> ``[c_kv ; k_pe]``, RMSNorm on ``c_kv``, RoPE (incl. yarn) on
``q_pe`` and ``k_pe``, attention, ``o_proj``. Parameter names are DeepSeek's, so a checkpoint's
``self_attn.*`` tensors load directly.

Variants (the paper's comparison): ``"A_CC_ME"`` caches the latent in a paged cache and runs
:class:`~mla_backend.attention.MLAAttention` (absorbed with move elision, or normal, as the
policy says); ``"CD"`` caches decompressed K/V and attends with plain matmuls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..attention import MLAAttention, write_latent
from ..batch import MLABatch
from ..dims import MLADims, yarn_softmax_scale
from ..plan import plan as make_plan
from ..policy import Policy
from ..weights import AbsorbWeights, split_kv_b_proj
from .decompressed import DecompressedCache, cd_attention
from .rope import DeepseekRope

VARIANTS = ("A_CC_ME", "CD")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class MLALayer(nn.Module):
    """DeepSeek-V2 MLA attention layer. Inputs are packed per :class:`MLABatch`."""

    def __init__(
        self,
        dims: MLADims,
        rope_theta: float = 10000.0,
        rope_scaling: Mapping[str, Any] | None = None,
        rms_norm_eps: float = 1e-6,
        variant: str = "A_CC_ME",
        policy: Policy | None = None,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r} is not supported; supported: {VARIANTS}")
        if dims.hidden_size is None:
            raise ValueError("MLALayer needs dims.hidden_size")
        self.dims, self.variant, self.policy = dims, variant, policy
        H, hid = dims.num_heads, dims.hidden_size
        qk = dims.qk_head_dim
        if dims.q_lora_rank is None:
            self.q_proj = nn.Linear(hid, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hid, dims.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, rms_norm_eps)
            self.q_b_proj = nn.Linear(dims.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, dims.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            dims.kv_lora_rank, H * (dims.qk_nope_head_dim + dims.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(H * dims.v_head_dim, hid, bias=False)
        self.rope = DeepseekRope(dims.qk_rope_head_dim, rope_theta, rope_scaling)
        self.softmax_scale = yarn_softmax_scale(dims, rope_scaling)
        self._attn: MLAAttention | None = None
        self._attn_key: tuple | None = None

    def absorb_weights(self) -> AbsorbWeights:
        return split_kv_b_proj(self.kv_b_proj.weight.detach(), self.dims)

    def attention(self) -> MLAAttention:
        """The layer's attention core, rebuilt whenever ``kv_b_proj.weight`` changed (loaded,
        modified in place, or moved to another dtype/device)."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._attn is None or self._attn_key != key:
            self._attn = MLAAttention(self.dims, self.absorb_weights(), self.softmax_scale)
            self._attn_key = key
        return self._attn

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, hidden] -> q_nope [T,H,nope], q_pe [T,H,rope] (rotated), c_kv [T,r]
        (normalized), k_pe [T,rope] (rotated)."""
        d = self.dims
        if d.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q[..., : d.qk_nope_head_dim], q[..., d.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(hidden)
        c_kv, k_pe = kv[:, : d.kv_lora_rank], kv[:, d.kv_lora_rank :]
        return (
            q_nope,
            self.rope(q_pe, positions),
            self.kv_a_layernorm(c_kv),
            self.rope(k_pe, positions),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        batch: MLABatch,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A_CC_ME: hidden [T, hidden] -> [T, hidden]; writes the new latents to ``kv_cache``
        [num_pages, page_size, r + rope] at ``slot_mapping`` [T] first."""
        if self.variant != "A_CC_ME":
            raise ValueError("this layer is the CD variant: call forward_cd")
        q_nope, q_pe, c_kv, k_pe = self.project(hidden, batch.positions(hidden.device))
        write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale)
        step = make_plan(batch, self.dims, self.policy, hidden.device)
        o = self.attention()(q_nope, q_pe, kv_cache, step, kv_scale)
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward_cd(
        self, hidden: torch.Tensor, batch: MLABatch, cache: DecompressedCache
    ) -> torch.Tensor:
        """CD: hidden [T, hidden] -> [T, hidden]; appends decompressed K/V to ``cache``."""
        q_nope, q_pe, c_kv, k_pe = self.project(hidden, batch.positions(hidden.device))
        w = self.attention().weights
        for i, (t0, n) in enumerate(zip(batch.cu_new, batch.new_lens)):
            latent = torch.cat([c_kv[t0 : t0 + n], k_pe[t0 : t0 + n]], -1)
            cache.append(i, latent, w, self.dims.qk_nope_head_dim)
        o = cd_attention(torch.cat([q_nope, q_pe], -1), cache, batch.new_lens, self.softmax_scale)
        return self.o_proj(o.reshape(o.shape[0], -1))
