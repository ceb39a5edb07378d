"""Which path serves which request: the ``no_absorb()`` policy family.

Modes (one setting: ``Policy(mode=...)`` or the ``MLA_BACKEND_POLICY`` environment variable):

- ``cost`` (default): per request, estimate the time of both paths from their FLOP and byte
  counts at the layer's actual dims on a roofline (``max(flops / (peak * efficiency),
  bytes / bandwidth)`` per phase, with a measured per-device profile) and take the cheaper
  one. Absorbed attention costs ``N·(P+N)·H·(2r+rope)`` MACs plus the
  two absorption bmms; normal costs decompressing ``P+N`` latents (``(P+N)·H·r·(nope+v)``)
  plus ``N·(P+N)·H·(nope+rope+v)`` MACs of attention, and writes/reads the decompressed K/V.
- ``sglang``: SGLang's rule: the normal path only for a plain (non-speculative) EXTEND batch
  with no cached prefix, or (chunked-prefix MHA) whose cached prefix is at least
  ``chunked_prefix_threshold`` tokens; everything else absorbed. Per batch.
- ``absorb`` / ``normal``: always one path (debugging).

Decode tokens are always absorbed (there is nothing to gain from decompressing for one
token), and speculative phases are absorbed in every mode but ``normal``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .batch import MLABatch, Phase
from .dims import MLADims

logger = logging.getLogger("mla_backend.policy")

MODES = ("cost", "sglang", "absorb", "normal")
ENV_VAR = "MLA_BACKEND_POLICY"
THRESHOLD_ENV_VAR = "MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD"


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
# The same CPUs with the native C++ kernels (mla_backend/ops/native): the absorbed attention
# and, for bf16, the normal path's MHA run near the machine's peak, the normal path paying a
# fixed per-request cost (fitted to benchmarks/mla_policy_bench.py, see
# benchmarks/results/mla_policy-latest.md: fresh prefills of >= ~128-192 tokens go normal).
CPU_NATIVE_PROFILE = DeviceProfile(
    peak_flops=0.6e12,
    bandwidth=7.8e9,
    absorbed_efficiency=2.0,
    attn_efficiency=1.0,
    cache_bytes=32 * 2**20,
    normal_overhead=0.6e-3,
)
# H800-class GPU (FlashMLA's published figures); unmeasured by us.
GPU_PROFILE = DeviceProfile(
    peak_flops=660e12,
    bandwidth=3.0e12,
    absorbed_efficiency=0.6,
    attn_efficiency=0.6,
    cache_bytes=32 * 2**20,
)


@dataclass(frozen=True)
class PathChoice:
    """Per-request decision of one batch."""

    use_absorbed: list[bool]

    @property
    def batch_mode(self) -> str:
        if all(self.use_absorbed):
            return "absorbed"
        if not any(self.use_absorbed):
            return "normal"
        return "mixed"


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


class Policy:
    """Chooses absorbed vs normal per request (``choose``) or per batch
    (``batch_uses_normal``, SGLang's ``no_absorb()`` question)."""

    def __init__(
        self,
        mode: str = "cost",
        chunked_prefix_threshold: int = 8192,
        profile: DeviceProfile | None = None,
    ) -> None:
        if not isinstance(mode, str) or mode.strip().lower() not in MODES:
            raise ValueError(
                f"MLA policy mode {mode!r} is not supported; supported: {', '.join(MODES)}"
            )
        mode = mode.strip().lower()
        if mode not in MODES:
            raise ValueError(
                f"MLA policy mode {mode!r} is not supported; supported: {', '.join(MODES)}"
            )
        if isinstance(chunked_prefix_threshold, bool) or not isinstance(
            chunked_prefix_threshold, int
        ):
            raise ValueError(
                f"chunked_prefix_threshold={chunked_prefix_threshold!r} must be an int (tokens)"
            )
        if chunked_prefix_threshold < 0:
            raise ValueError(f"chunked_prefix_threshold={chunked_prefix_threshold} must be >= 0")
        self.mode = mode
        self.chunked_prefix_threshold = chunked_prefix_threshold
        self.profile = profile

    @classmethod
    def from_env(cls, default: str = "cost") -> Policy:
        """``MLA_BACKEND_POLICY`` (cost|sglang|absorb|normal) and
        ``MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD`` (tokens, default 8192)."""
        raw = os.environ.get(THRESHOLD_ENV_VAR, "8192")
        try:
            threshold = int(raw)
        except ValueError:
            raise ValueError(f"{THRESHOLD_ENV_VAR}={raw!r} is not an integer") from None
        return cls(os.environ.get(ENV_VAR, default), threshold)

    def __repr__(self) -> str:
        return (
            f"Policy(mode={self.mode!r}, chunked_prefix_threshold={self.chunked_prefix_threshold})"
        )

    def _profile(self, device_type: str, impl: str) -> DeviceProfile:
        """The policy's own profile, else the measured one of the device and kernels."""
        if self.profile is not None:
            return self.profile
        if device_type != "cpu":
            return GPU_PROFILE
        return CPU_NATIVE_PROFILE if impl == "native" else CPU_PROFILE

    def request_uses_absorbed(
        self,
        dims: MLADims,
        prefix: int,
        new: int,
        phase: Phase,
        device_type: str = "cpu",
        impl: str = "torch",
    ) -> bool:
        """Per-request decision for ``cost``/``absorb``/``normal`` modes."""
        if self.mode == "absorb":
            return True
        if self.mode == "normal":
            return False
        if new <= 1 or phase.speculative:
            return True
        prof = self._profile(device_type, impl)
        return absorbed_cost(dims, prefix, new, prof) <= normal_cost(dims, prefix, new, prof)

    def batch_uses_normal(
        self, batch: MLABatch, dims: MLADims, device_type: str = "cpu", impl: str = "torch"
    ) -> bool:
        """The per-batch ``no_absorb()`` answer: True if the whole batch should go normal."""
        if batch.num_reqs == 0 or batch.phase is Phase.IDLE:
            return False
        if self.mode == "sglang":
            if batch.phase is not Phase.EXTEND:
                return False
            total_prefix = sum(batch.prefix_lens)
            return total_prefix == 0 or total_prefix >= self.chunked_prefix_threshold
        if self.mode in ("absorb", "normal"):
            return self.mode == "normal"
        if batch.phase.speculative or batch.phase is Phase.DECODE:
            return False
        prof = self._profile(device_type, impl)
        a = sum(
            absorbed_cost(dims, p, n, prof)
            for p, n in zip(batch.prefix_lens, batch.new_lens, strict=True)
        )
        m = sum(
            normal_cost(dims, p, n, prof)
            for p, n in zip(batch.prefix_lens, batch.new_lens, strict=True)
        )
        return m < a

    def choose(
        self, batch: MLABatch, dims: MLADims, device_type: str = "cpu", impl: str = "torch"
    ) -> PathChoice:
        """Per-request decision (``sglang`` mode decides for the whole batch). ``impl`` names
        the kernel implementation (the plan's), whose measured profile prices the paths."""
        if self.mode == "sglang":
            normal = self.batch_uses_normal(batch, dims, device_type, impl)
            choice = PathChoice([not normal] * batch.num_reqs)
        else:
            choice = PathChoice(
                [
                    self.request_uses_absorbed(dims, p, n, batch.phase, device_type, impl)
                    for p, n in zip(batch.prefix_lens, batch.new_lens, strict=True)
                ]
            )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "mla policy %s: phase=%s prefix=%s new=%s -> %s",
                self.mode,
                batch.phase.value,
                batch.prefix_lens,
                batch.new_lens,
                choice.batch_mode,
            )
        return choice
