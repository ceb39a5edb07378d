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

DSA layers (DeepSeek-V3.2, GLM-5: ``choose(..., indexer=IndexerDims(...))``): each request
gets one of :data:`DSA_ROUTES` (``PathChoice.routes``). A request whose context exceeds
``indexer.topk`` takes a sparse route (lightning indexer, then attention over each token's
selection) in every mode: there the selection changes the answer. ``cost`` prices both sparse
routes, DeepSeek's two modes: the sparse absorbed attention (:func:`~mla_backend.cost.
sparse_cost`, MQA over the latent rows) and the sparse MHA (:func:`~mla_backend.cost.
sparse_mha_cost`, decompressed per-head K/V, in the cheaper of its masked / gathered variants),
and takes the cheaper; decode tokens and speculative steps stay absorbed. Where the whole
context is ``<= topk`` the selection is every visible token, so the dense paths give the same
attention: ``cost`` prices the dense path it picked against both sparse routes (the sparse
routes add the indexer to the same attention, so a dense path wins; SGLang's DSA backend
likewise runs MHA for such prefills). The fixed modes apply their dense rule within topk and
past it take the sparse absorbed route (``sglang``, ``absorb``) or the sparse MHA (``normal``).
``PathChoice.use_sparse`` says which requests go sparse (None for non-DSA layers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .batch import MLABatch, Phase
from .config import Settings, current
from .cost import (
    CPU_PROFILE,
    GPU_PROFILE,
    DeviceProfile,
    absorbed_cost,
    normal_cost,
    sparse_cost,
    sparse_mha_cost,
    sparse_mha_variant,
)
from .dims import MLADims
from .index_cache import IndexerDims

logger = logging.getLogger("mla_backend.policy")

__all__ = [
    "CPU_PROFILE", "GPU_PROFILE", "MODES", "DeviceProfile", "PathChoice", "Policy",
    "DSA_ROUTES", "absorbed_cost", "normal_cost", "sparse_cost", "sparse_mha_cost",
]
ENV_VAR = "MLA_BACKEND_POLICY"
THRESHOLD_ENV_VAR = "MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD"
#: a DSA layer's per-request paths: the dense ones (the selection is everything), the sparse
#: absorbed attention, and the sparse MHA in its masked or gathered variant
#: (:mod:`mla_backend.sparse_normal`)
DSA_ROUTES = ("absorbed", "normal", "sparse_absorbed", "sparse_masked", "sparse_gather")


@dataclass(frozen=True)
class PathChoice:
    """Per-request decision of one batch: ``use_absorbed[i]`` (else normal); for a DSA layer
    ``use_sparse[i]``: request i takes a sparse path (the indexer, then its attention over the
    selection; ``use_absorbed`` is True for the sparse absorbed one) and ``routes[i]``: its path,
    one of :data:`DSA_ROUTES`; both None for non-DSA layers."""

    use_absorbed: list[bool]
    use_sparse: list[bool] | None = None
    routes: list[str] | None = None

    @property
    def sparse_mode(self) -> str | None:
        """``"sparse"`` (every request), ``"dense"`` (none: the selection is everything for
        every request, so the step runs the dense paths and the indexer only writes its keys),
        ``"mixed"``; None for a non-DSA layer."""
        if self.use_sparse is None:
            return None
        if self.use_sparse and all(self.use_sparse):
            return "sparse"
        return "mixed" if any(self.use_sparse) else "dense"

    @property
    def batch_mode(self) -> str:
        if all(self.use_absorbed):
            return "absorbed"
        if not any(self.use_absorbed):
            return "normal"
        return "mixed"


@dataclass(frozen=True)
class _Mode:
    """One policy mode: how it decides (``per_batch``: one answer for the whole batch, SGLang's
    ``no_absorb()``; else per request) and, for a fixed mode, the path it always takes."""

    per_batch: bool = False
    always_absorbed: bool | None = None


#: the modes, in one table
_MODES: dict[str, _Mode] = {
    "cost": _Mode(),
    "sglang": _Mode(per_batch=True),
    "absorb": _Mode(always_absorbed=True),
    "normal": _Mode(always_absorbed=False),
}
MODES = tuple(_MODES)


class Policy:
    """Chooses absorbed vs normal per request (``choose``) or per batch
    (``batch_uses_normal``, SGLang's ``no_absorb()`` question).

    The ``cost`` mode prices both paths on a :class:`DeviceProfile`: the policy's own
    ``profile`` when given, else the one the caller passes (the plan passes its kernel
    implementation's ``cost_profile(device)``), else :data:`CPU_PROFILE`."""

    def __init__(
        self,
        mode: str = "cost",
        chunked_prefix_threshold: int = 8192,
        profile: DeviceProfile | None = None,
    ) -> None:
        key = mode.strip().lower() if isinstance(mode, str) else None
        if key not in _MODES:
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
        self.mode = key
        self._mode = _MODES[key]
        self.chunked_prefix_threshold = chunked_prefix_threshold
        self.profile = profile

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        """The policy a configuration names: ``MLA_BACKEND_POLICY`` (cost|sglang|absorb|normal)
        and ``MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD`` (tokens) of ``settings``.

        Raises:
            ValueError: an unknown mode or a threshold that is not an integer >= 0, naming the
                variable, its value and what is supported.
        """
        mode = settings.policy.strip().lower()
        if mode not in _MODES:
            raise ValueError(
                f"{ENV_VAR}={settings.policy!r} is not supported; supported: {', '.join(MODES)}"
            )
        raw = settings.chunked_prefix_threshold
        try:
            threshold = int(raw)
        except ValueError:
            raise ValueError(f"{THRESHOLD_ENV_VAR}={raw!r} is not an integer") from None
        if threshold < 0:
            raise ValueError(f"{THRESHOLD_ENV_VAR}={threshold} must be >= 0 (tokens)")
        return cls(mode, threshold)

    @classmethod
    def from_env(cls) -> Policy:
        """A new policy of the variables now (:meth:`from_settings` of
        :func:`mla_backend.config.current`). :func:`mla_backend.plan` does not call this per
        step: it uses the resolved one (:func:`mla_backend.selection.resolve_policy`)."""
        return cls.from_settings(current())

    def __repr__(self) -> str:
        return (
            f"Policy(mode={self.mode!r}, chunked_prefix_threshold={self.chunked_prefix_threshold})"
        )

    def _profile(self, profile: DeviceProfile | None) -> DeviceProfile:
        """The policy's own profile, else the caller's (the implementation's), else the CPU's."""
        return self.profile or profile or CPU_PROFILE

    def request_uses_absorbed(
        self,
        dims: MLADims,
        prefix: int,
        new: int,
        phase: Phase,
        profile: DeviceProfile | None = None,
    ) -> bool:
        """Per-request decision (``sglang`` mode decides per batch: :meth:`batch_uses_normal`).
        Decode tokens and speculative phases go absorbed unless the mode fixes the path."""
        if self._mode.always_absorbed is not None:
            return self._mode.always_absorbed
        if new <= 1 or phase.speculative:
            return True
        prof = self._profile(profile)
        return absorbed_cost(dims, prefix, new, prof) <= normal_cost(dims, prefix, new, prof)

    def batch_uses_normal(
        self, batch: MLABatch, dims: MLADims, profile: DeviceProfile | None = None
    ) -> bool:
        """The per-batch ``no_absorb()`` answer: True if the whole batch should go normal."""
        if batch.num_reqs == 0 or batch.phase is Phase.IDLE:
            return False
        if self._mode.always_absorbed is not None:
            return not self._mode.always_absorbed
        if self._mode.per_batch:  # SGLang's rule
            if batch.phase is not Phase.EXTEND:
                return False
            total_prefix = sum(batch.prefix_lens)
            return total_prefix == 0 or total_prefix >= self.chunked_prefix_threshold
        if batch.phase.speculative or batch.phase is Phase.DECODE:
            return False
        prof = self._profile(profile)
        lens = list(zip(batch.prefix_lens, batch.new_lens, strict=True))
        a = sum(absorbed_cost(dims, p, n, prof) for p, n in lens)
        m = sum(normal_cost(dims, p, n, prof) for p, n in lens)
        return m < a

    def request_uses_sparse(
        self,
        dims: MLADims,
        indexer: IndexerDims,
        prefix: int,
        new: int,
        dense_absorbed: bool,
        profile: DeviceProfile | None = None,
    ) -> bool:
        """A DSA layer's request: sparse where its context exceeds ``indexer.topk`` (every
        mode); else, in ``cost`` mode, where a sparse path (absorbed or MHA) prices below the
        dense path the policy picked (``dense_absorbed``; a decode token stays on it); never in
        the fixed modes."""
        if new == 0:
            return False
        if prefix + new > indexer.topk:
            return True
        if self._mode.per_batch or self._mode.always_absorbed is not None or new <= 1:
            return False
        prof = self._profile(profile)
        dense = (absorbed_cost if dense_absorbed else normal_cost)(dims, prefix, new, prof)
        sparse = min(sparse_cost(dims, indexer, prefix, new, prof),
                     sparse_mha_cost(dims, indexer, prefix, new, prof))  # fmt: skip
        return sparse < dense

    def dsa_route(
        self,
        dims: MLADims,
        indexer: IndexerDims,
        prefix: int,
        new: int,
        phase: Phase,
        dense_absorbed: bool,
        profile: DeviceProfile | None = None,
    ) -> str:
        """A DSA layer's request: its route (:data:`DSA_ROUTES`; module docstring).
        ``dense_absorbed``: the dense path the policy picked for it."""
        dense = "absorbed" if dense_absorbed else "normal"
        fits = prefix + new <= indexer.topk
        if new == 0 or (fits and not self.request_uses_sparse(dims, indexer, prefix, new,
                                                               dense_absorbed, profile)):
            return dense
        prof = self._profile(profile)
        if self._mode.always_absorbed is False:
            return "sparse_" + sparse_mha_variant(dims, indexer, prefix, new, prof)
        if self._mode.per_batch or self._mode.always_absorbed or new <= 1 or phase.speculative:
            return "sparse_absorbed"
        variant = sparse_mha_variant(dims, indexer, prefix, new, prof)
        mha = sparse_mha_cost(dims, indexer, prefix, new, prof, variant)
        absorbed = sparse_cost(dims, indexer, prefix, new, prof)
        return "sparse_absorbed" if absorbed <= mha else "sparse_" + variant

    def choose(
        self,
        batch: MLABatch,
        dims: MLADims,
        profile: DeviceProfile | None = None,
        *,
        indexer: IndexerDims | None = None,
    ) -> PathChoice:
        """Per-request decision (``sglang`` mode decides for the whole batch). ``profile``: the
        plan's kernel implementation's measured profile, which prices the paths. ``indexer``:
        a DSA layer's indexer dims (the choice then says which requests go sparse)."""
        if self._mode.per_batch:
            normal = self.batch_uses_normal(batch, dims, profile)
            choice = PathChoice([not normal] * batch.num_reqs)
        else:
            choice = PathChoice(
                [
                    self.request_uses_absorbed(dims, p, n, batch.phase, profile)
                    for p, n in zip(batch.prefix_lens, batch.new_lens, strict=True)
                ]
            )
        if indexer is not None:
            lens = zip(batch.prefix_lens, batch.new_lens, choice.use_absorbed, strict=True)
            routes = [
                self.dsa_route(dims, indexer, p, n, batch.phase, a, profile) for p, n, a in lens
            ]
            choice = PathChoice(
                [r in ("absorbed", "sparse_absorbed") for r in routes],
                [r.startswith("sparse") for r in routes],
                routes,
            )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "mla policy %s: phase=%s prefix=%s new=%s -> %s (dsa: %s)",
                self.mode,
                batch.phase.value,
                batch.prefix_lens,
                batch.new_lens,
                choice.batch_mode,
                choice.sparse_mode,
            )
        return choice
