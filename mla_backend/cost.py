"""The cost model's roofline: a device's :class:`DeviceProfile` and the per-request time of each
path on it (:func:`absorbed_cost`, :func:`normal_cost`, and for DSA layers :func:`sparse_cost`:
the lightning indexer plus the sparse attention), with the generic CPU and GPU profiles.

Each kernel implementation carries its own profile (``Kernels.cost_profile(device)``, built from
these types); the policy (:mod:`mla_backend.policy`) asks the plan's implementation for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dims import MLADims
from .index_cache import IndexerDims


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline of a device for the cost model.

    Attributes:
        peak_flops: matmul FLOP/s in the compute dtype.
        bandwidth: read bandwidth from memory (bytes/s).
        absorbed_efficiency: fraction of peak the absorbed attention reaches.
        attn_efficiency: fraction of peak the normal path's fused MHA kernel reaches.
        cache_bytes: decompressed K/V up to this size stays in cache (no memory traffic).
        normal_overhead: fixed seconds per request of the normal path (its per-request
            decompression and attention calls), in the model's time units.
    """

    peak_flops: float
    bandwidth: float
    absorbed_efficiency: float = 1.0
    attn_efficiency: float = 1.0
    cache_bytes: float = 0.0
    normal_overhead: float = 0.0


# Measured on the project's CPU machines (2 threads, bf16 AMX; the efficiencies fitted to
# benchmarks/mla_policy_bench.py, whose 36 extend shapes they all pick right).
CPU_PROFILE = DeviceProfile(
    peak_flops=0.6e12,
    bandwidth=7.8e9,
    absorbed_efficiency=0.7,
    attn_efficiency=0.3,
    cache_bytes=32 * 2**20,
)
# H800-class GPU (FlashMLA's published figures); unmeasured by us.
GPU_PROFILE = DeviceProfile(
    peak_flops=660e12,
    bandwidth=3.0e12,
    absorbed_efficiency=0.6,
    attn_efficiency=0.6,
    cache_bytes=32 * 2**20,
)


def _phase(flops: float, nbytes: float, profile: DeviceProfile, efficiency: float = 1.0) -> float:
    """Roofline time of one phase: compute and memory traffic overlap within a phase."""
    return max(flops / (profile.peak_flops * efficiency), nbytes / profile.bandwidth)


def absorbed_cost(
    dims: MLADims, prefix: int, new: int, profile: DeviceProfile, elt: int = 2
) -> float:
    """Roofline seconds of the absorbed path for one request (P cached, N new tokens):
    the two absorption bmms (reading ``W_UK``/``W_UV``), then MQA over the latent, which is
    read once for all heads."""
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    w = H * r * (dims.qk_nope_head_dim + dims.v_head_dim)
    kv_avg = prefix + (new + 1) / 2  # causal among the new tokens
    bmm = _phase(2 * new * w, w * elt, profile)
    attn = _phase(
        2 * new * kv_avg * H * (2 * r + rope),
        (prefix + new) * (r + rope) * elt,
        profile,
        profile.absorbed_efficiency,
    )
    return bmm + attn


def normal_cost(
    dims: MLADims, prefix: int, new: int, profile: DeviceProfile, elt: int = 2
) -> float:
    """Roofline seconds of the normal path for one request: decompress all P + N latents
    (reading ``kv_b_proj``; the per-head K/V it writes costs memory traffic once it outgrows
    the cache), then MHA over the decompressed K/V."""
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    nope, v = dims.qk_nope_head_dim, dims.v_head_dim
    w = H * r * (nope + v)
    kv = prefix + new
    kv_avg = prefix + (new + 1) / 2
    kv_bytes = kv * H * (nope + rope + v) * elt
    kv_traffic = kv_bytes if kv_bytes > profile.cache_bytes else 0.0
    decompress = _phase(2 * kv * w, w * elt + kv * (r + rope) * elt + kv_traffic, profile)
    attn = _phase(
        2 * new * kv_avg * H * (nope + rope + v), kv_traffic, profile, profile.attn_efficiency
    )
    return decompress + attn + profile.normal_overhead


def sparse_cost(
    dims: MLADims,
    indexer: IndexerDims,
    prefix: int,
    new: int,
    profile: DeviceProfile,
    elt: int = 2,
) -> float:
    """Roofline seconds of a DSA layer's sparse path for one request: the two absorption bmms,
    the lightning indexer (``2 Hi Di`` FLOPs per visible cached token and query token, reading
    every key once: Di + 4 bytes each, vLLM's fp8 index cache) and the sparse attention (each
    query token over ``min(topk, visible)`` latent rows, gathered per token)."""
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    w = H * r * (dims.qk_nope_head_dim + dims.v_head_dim)
    kv = prefix + new
    kv_avg = prefix + (new + 1) / 2
    sel = min(float(indexer.topk), kv_avg)
    bmm = _phase(2 * new * w, w * elt, profile)
    index = _phase(
        2 * new * kv_avg * indexer.n_heads * indexer.head_dim,
        kv * (indexer.head_dim + 4),
        profile,
        profile.absorbed_efficiency,
    )
    attn = _phase(
        2 * new * sel * H * (2 * r + rope),
        min(new * sel, kv) * (r + rope) * elt,
        profile,
        profile.absorbed_efficiency,
    )
    return bmm + index + attn
