"""The cost model's roofline: a device's :class:`DeviceProfile` and the per-request time of each
path on it (:func:`absorbed_cost`, :func:`normal_cost`, and for DSA layers :func:`sparse_cost`:
the lightning indexer plus the sparse absorbed attention, and :func:`sparse_mha_cost`: the
indexer plus the sparse MHA, in the cheaper of its two variants, :func:`sparse_mha_variant`);
the profiles as data (``mla_backend/profiles.json``: :func:`stored_profile`,
:func:`store_profile`), among them the generic CPU and GPU profiles.

Each kernel implementation carries its own profile (``Kernels.cost_profile(device)``, built from
these types); the policy (:mod:`mla_backend.policy`) asks the plan's implementation for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        index_efficiency: fraction of peak the DSA lightning indexer reaches (None: as the
            absorbed attention).
        sparse_efficiency: fraction of peak DSA's sparse absorbed attention reaches (None: as
            the absorbed attention).
        sparse_mha_efficiency: fraction of peak DSA's sparse MHA reaches (None: as the normal
            path's MHA).
    """

    peak_flops: float
    bandwidth: float
    absorbed_efficiency: float = 1.0
    attn_efficiency: float = 1.0
    cache_bytes: float = 0.0
    normal_overhead: float = 0.0
    index_efficiency: float | None = None
    sparse_efficiency: float | None = None
    sparse_mha_efficiency: float | None = None


#: the profiles' data file: ``{"profiles": {name: {<DeviceProfile fields>, "fit": {...}}}}``,
#: "fit" saying where the values come from (CPU or device, date, score, run); shipped with the
#: package, written by ``python -m benchmarks policy --fit``
PROFILES_PATH = Path(__file__).resolve().with_name("profiles.json")
_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceProfile))


@functools.cache
def _stored(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["profiles"]


def stored_profile(name: str, path: Path = PROFILES_PATH) -> DeviceProfile:
    """The profile ``name`` of the data file (``cpu``, ``gpu``, ``native:<level>``, ...; a field
    it does not store takes :class:`DeviceProfile`'s default); a KeyError names the stored
    ones."""
    profiles = _stored(path)
    if name not in profiles:
        raise KeyError(f"no cost profile {name!r} in {path}; stored: {sorted(profiles)}")
    return DeviceProfile(**{k: profiles[name][k] for k in _FIELDS if k in profiles[name]})


def stored_fit(name: str, path: Path = PROFILES_PATH) -> dict[str, str]:
    """Where profile ``name``'s values come from (its CPU or device, date, score, run)."""
    return dict(_stored(path)[name].get("fit", {}))


def store_profile(
    name: str, profile: DeviceProfile, fit: Mapping[str, str], path: Path = PROFILES_PATH
) -> None:
    """Write ``profile`` as ``name`` into the data file with its ``fit`` (replacing that entry,
    keeping the others); later :func:`stored_profile` calls read it."""
    data = json.loads(path.read_text())
    data["profiles"][name] = {**dataclasses.asdict(profile), "fit": dict(fit)}
    path.write_text(json.dumps(data, indent=2) + "\n")
    _stored.cache_clear()


#: the torch and Triton implementations' profiles on a CPU and on a GPU
CPU_PROFILE = stored_profile("cpu")
GPU_PROFILE = stored_profile("gpu")


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


def _index_phase(
    indexer: IndexerDims, prefix: int, new: int, profile: DeviceProfile
) -> float:
    """The lightning indexer of one request: ``2 Hi Di`` FLOPs per visible cached token and
    query token, reading every key once (Di + 4 bytes each, vLLM's fp8 index cache)."""
    eff = profile.index_efficiency
    return _phase(
        2 * new * (prefix + (new + 1) / 2) * indexer.n_heads * indexer.head_dim,
        (prefix + new) * (indexer.head_dim + 4),
        profile,
        profile.absorbed_efficiency if eff is None else eff,
    )


def sparse_cost(
    dims: MLADims,
    indexer: IndexerDims,
    prefix: int,
    new: int,
    profile: DeviceProfile,
    elt: int = 2,
) -> float:
    """Roofline seconds of a DSA layer's sparse absorbed path for one request: the two
    absorption bmms, the lightning indexer and the sparse attention (each query token over
    ``min(topk, visible)`` latent rows, gathered per token)."""
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    w = H * r * (dims.qk_nope_head_dim + dims.v_head_dim)
    kv = prefix + new
    kv_avg = prefix + (new + 1) / 2
    sel = min(float(indexer.topk), kv_avg)
    eff = profile.sparse_efficiency
    bmm = _phase(2 * new * w, w * elt, profile)
    attn = _phase(
        2 * new * sel * H * (2 * r + rope),
        min(new * sel, kv) * (r + rope) * elt,
        profile,
        profile.absorbed_efficiency if eff is None else eff,
    )
    return bmm + _index_phase(indexer, prefix, new, profile) + attn


def sparse_mha_cost(
    dims: MLADims,
    indexer: IndexerDims,
    prefix: int,
    new: int,
    profile: DeviceProfile,
    variant: str | None = None,
    elt: int = 2,
) -> float:
    """Roofline seconds of a DSA layer's sparse MHA path for one request
    (:mod:`mla_backend.sparse_normal`): the indexer, then ``variant``'s decompression and
    attention (None: the cheaper variant, :func:`sparse_mha_variant`):

    - ``masked``: the normal path's decompression of all ``P + N`` rows, then a masked MHA
      whose tiles visit the causal keys (the tiles a selection skips are not modelled);
    - ``gather``: ``min(topk, visible)`` rows decompressed per query token and attended by that
      token alone (their K/V written and read once: memory traffic beyond the cache).
    """
    if variant is None:
        variant = sparse_mha_variant(dims, indexer, prefix, new, profile)
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    nope, v = dims.qk_nope_head_dim, dims.v_head_dim
    w = H * r * (nope + v)
    eff = profile.sparse_mha_efficiency
    eff = profile.attn_efficiency if eff is None else eff
    kv_avg = prefix + (new + 1) / 2
    if variant == "masked":
        rows, keys = prefix + new, kv_avg
        kv_bytes = rows * H * (nope + rope + v) * elt
        traffic = kv_bytes if kv_bytes > profile.cache_bytes else 0.0
    elif variant == "gather":
        keys = min(float(indexer.topk), kv_avg)
        rows = new * keys
        traffic = rows * H * (nope + rope + v) * elt * 2
    else:
        raise ValueError(f"variant={variant!r} is not supported; use masked, gather or None")
    decompress = _phase(2 * rows * w, w * elt + rows * (r + rope) * elt + traffic, profile)
    attn = _phase(2 * new * keys * H * (nope + rope + v), traffic, profile, eff)
    return _index_phase(indexer, prefix, new, profile) + decompress + attn + (
        profile.normal_overhead
    )


def sparse_mha_variant(
    dims: MLADims, indexer: IndexerDims, prefix: int, new: int, profile: DeviceProfile
) -> str:
    """The cheaper way to compute a request's sparse MHA on ``profile``: ``"masked"`` or
    ``"gather"`` (:func:`sparse_mha_cost`)."""
    m = sparse_mha_cost(dims, indexer, prefix, new, profile, "masked")
    g = sparse_mha_cost(dims, indexer, prefix, new, profile, "gather")
    return "masked" if m <= g else "gather"
