"""MLA dimensions: one validated object describing a DeepSeek-style MLA attention layer.

Names follow DeepSeek-V2 (arXiv 2405.04434): ``kv_lora_rank`` (r), ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank``. Any positive dims are accepted, not only
DeepSeek's 128/512/128/64/128; ``qk_rope_head_dim`` may be 0 and must be even otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MLADims.{name} must be an int, got {value!r} ({type(value).__name__})")
    low = 0 if allow_zero else 1
    if value < low:
        raise ValueError(f"MLADims.{name}={value} is not supported: it must be >= {low}")


@dataclass(frozen=True)
class MLADims:
    """Dimensions of one MLA layer (per tensor-parallel rank for ``num_heads``).

    Attributes:
        num_heads: query heads H on this rank.
        kv_lora_rank: latent width r of ``c_kv``.
        qk_nope_head_dim: per-head width of ``q_nope`` / ``k_nope``.
        qk_rope_head_dim: width of ``q_pe`` / ``k_pe`` (shared by all heads); 0 or even.
        v_head_dim: per-head value width.
        q_lora_rank: rank of the query down-projection, or None for a plain ``q_proj``.
        hidden_size: model hidden size, or None when only the attention core is used.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    hidden_size: int | None = None

    def __post_init__(self) -> None:
        _check_positive("num_heads", self.num_heads)
        _check_positive("kv_lora_rank", self.kv_lora_rank)
        _check_positive("qk_nope_head_dim", self.qk_nope_head_dim)
        _check_positive("qk_rope_head_dim", self.qk_rope_head_dim, allow_zero=True)
        _check_positive("v_head_dim", self.v_head_dim)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLADims.qk_rope_head_dim={self.qk_rope_head_dim} is not supported: RoPE "
                "rotates pairs, so it must be even (or 0 for no rotary part)"
            )
        if self.q_lora_rank is not None:
            _check_positive("q_lora_rank", self.q_lora_rank)
        if self.hidden_size is not None:
            _check_positive("hidden_size", self.hidden_size)

    @property
    def latent_dim(self) -> int:
        """Width of one cached row ``[c_kv ; k_pe]`` (r + rope): 576 for DeepSeek."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the decompressed attention (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def default_softmax_scale(self) -> float:
        """1 / sqrt(nope + rope), the scale without yarn correction."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Latent-cache bytes per token per layer for a storage element size in bytes."""
        return self.latent_dim * element_size

    def decompressed_bytes_per_token(self, element_size: int) -> int:
        """Bytes per token per layer of a decompressed (CD) cache: H * (nope + rope + v)."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim) * element_size

    @classmethod
    def from_hf_config(cls, config: Any, num_heads: int | None = None) -> MLADims:
        """Build from a Hugging Face DeepSeek-V2/V3 config (object or dict).

        Args:
            config: has ``num_attention_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``,
                ``qk_rope_head_dim``, ``v_head_dim``, optional ``q_lora_rank``, ``hidden_size``.
            num_heads: heads on this rank (tensor parallelism); defaults to all heads.
        """
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        missing = [
            k
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if get(k) is None
        ]
        if missing:
            raise ValueError(
                f"config is not an MLA (DeepSeek-V2/V3) config: missing {', '.join(missing)}"
            )
        return cls(
            num_heads=num_heads if num_heads is not None else get("num_attention_heads"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            q_lora_rank=get("q_lora_rank"),
            hidden_size=get("hidden_size"),
        )


#: Attribute names of the per-rank query head count, in lookup order: SGLang's
#: ``DeepseekV2AttentionMLA.num_local_heads``, vLLM's MLA layer / impl ``num_heads``, a Hugging
#: Face config's ``num_attention_heads`` (all heads: pass ``num_heads`` under tensor parallelism).
_HEAD_ATTRS = ("num_local_heads", "num_heads", "num_attention_heads")


def dims_from(source: Any, num_heads: int | None = None) -> MLADims:
    """``MLADims`` from a Hugging Face DeepSeek-V2/V3 config (object or dict), an engine's
    model config (SGLang's ``ModelConfig`` carries the MLA fields itself), or an engine's MLA
    attention layer (vLLM's ``MLAAttention`` or its impl, SGLang's ``DeepseekV2AttentionMLA``).

    Args:
        source: anything with ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
            ``v_head_dim``, a head count (``num_local_heads``, ``num_heads`` or
            ``num_attention_heads``, in that order), optional ``q_lora_rank`` / ``hidden_size``.
        num_heads: heads on this rank; overrides the source's head count.
    Raises:
        ValueError: a field is missing (naming it) or out of range (naming the value).
    """
    get = source.get if isinstance(source, Mapping) else lambda k, d=None: getattr(source, k, d)
    fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in fields if get(k) is None]
    heads = num_heads
    if heads is None:
        heads = next((get(k) for k in _HEAD_ATTRS if get(k) is not None), None)
        if heads is None:
            missing.append("/".join(_HEAD_ATTRS))
    if missing:
        raise ValueError(
            f"{type(source).__name__} does not describe an MLA (DeepSeek-V2/V3) layer: missing "
            f"{', '.join(missing)}"
        )

    return MLADims(
        num_heads=heads,
        **{k: get(k) for k in fields},
        q_lora_rank=get("q_lora_rank"),
        hidden_size=get("hidden_size"),
    )

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn attention-magnitude correction: 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(rope_scaling: Mapping[str, Any]) -> float:
    """The yarn scaling ``factor`` (required; > 0)."""
    factor = rope_scaling.get("factor")
    if factor is None or float(factor) <= 0:
        raise ValueError(f"yarn rope_scaling needs a positive 'factor', got {factor!r}")
    return float(factor)


def yarn_softmax_scale(dims: MLADims, rope_scaling: Mapping[str, Any] | None) -> float:
    """Softmax scale 1/sqrt(nope + rope), times yarn mscale(factor, mscale_all_dim)^2 if set."""
    scale = dims.default_softmax_scale
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in (None, "yarn", "deepseek_yarn", "default"):
            raise ValueError(
                f"rope_scaling type {kind!r} is not supported; supported: 'yarn' (DeepSeek)"
            )
        if kind in ("yarn", "deepseek_yarn"):
            m = yarn_mscale(
                yarn_factor(rope_scaling),
                float(rope_scaling.get("mscale_all_dim", 0.0) or 0.0),
            )
            scale *= m * m
    return scale
