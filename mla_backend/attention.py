"""Public attention entry points: cache write, absorbed attention, and :class:`MLAAttention`.

Like FlashMLA's interface: describe the step once (:class:`~mla_backend.batch.MLABatch`), then
make one call per layer. The kernels come from the device seam (:mod:`mla_backend.ops`).
"""

from __future__ import annotations

import logging

import torch

from .batch import MLABatch
from .checks import check_cache, check_step
from .dims import MLADims
from .normal import DEFAULT_CHUNK_TOKENS, normal_attention
from .ops import get_impl
from .policy import PathChoice, Policy
from .weights import AbsorbWeights, absorb_q, apply_W_UV

logger = logging.getLogger("mla_backend")


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    impl: str | None = None,
) -> None:
    """Write ``[c_kv ; k_pe]`` of T tokens into the paged cache (slot < 0 = padding, skipped).

    Args:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn, in place.
        c_kv: [T, r]; k_pe: [T, rope]; slot_mapping: [T] int32/int64 flat slot per token.
        kv_scale: float32 scalar for an fp8 cache (stored = value / scale).
    """
    check_cache(kv_cache, c_kv.shape[-1] + k_pe.shape[-1], kv_scale)
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping dtype {slot_mapping.dtype} is not supported; use int32/64")
    if c_kv.shape[0] != k_pe.shape[0] or slot_mapping.shape[0] < c_kv.shape[0]:
        raise ValueError(
            f"c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} disagree on the number of tokens"
        )
    get_impl(kv_cache.device, impl).write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale)


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA (MQA over the shared latent) for decode and extend-onto-prefix.

    Args:
        q_lat: [T, H, r] = ``q_nope · W_UK``; q_pe: [T, H, rope] (rope may be 0);
            bf16/fp16/fp32.
        kv_cache: [num_pages, page_size, r + rope], already holding all kv tokens.
        batch: the step's description; T == batch.num_tokens.
        softmax_scale: scale of ``q·k``.
        kv_scale: float32 scalar of an fp8 cache.
    Returns:
        (o_lat [T, H, r] in q_lat's dtype, lse [T, H] float32).
    """
    check_step(q_lat, q_pe, kv_cache, batch, q_lat.shape[-1] + q_pe.shape[-1], kv_scale)
    return get_impl(q_lat.device, impl).absorbed_attention(
        q_lat, q_pe, kv_cache, batch, softmax_scale, kv_scale
    )


class MLAAttention:
    """One MLA layer's attention core: policy + absorbed path + normal path.

    ``attn(q_nope, q_pe, kv_cache, batch)`` returns ``[T, H, v]`` (before ``o_proj``). The
    new tokens' latents must already be in ``kv_cache`` (:func:`write_latent`).
    ``last_choice`` holds the most recent :class:`~mla_backend.policy.PathChoice`;
    ``chunk_tokens`` bounds how many cached-prefix tokens the normal path decompresses at once.
    """

    def __init__(
        self,
        dims: MLADims,
        weights: AbsorbWeights,
        softmax_scale: float | None = None,
        policy: Policy | None = None,
        impl: str | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        H, nope, r, v = (dims.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank, dims.v_head_dim)
        expected = {
            "W_UK": (weights.W_UK, (H, nope, r)),
            "W_UV": (weights.W_UV, (H, r, v)),
            "kv_b": (weights.kv_b, (H * (nope + v), r)),
        }
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} shape {tuple(t.shape)} does not match dims: expected {list(shape)} "
                    f"for H={H}, nope={nope}, r={r}, v={v}"
                )
        self.dims = dims
        self.weights = weights
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else dims.default_softmax_scale
        )
        self.policy = policy if policy is not None else Policy.from_env()
        self.impl = impl
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an int >= 1")
        self.chunk_tokens = chunk_tokens
        self.last_choice: PathChoice | None = None

    def absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: MLABatch,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed path: ``W_UV · attn([q_nope·W_UK ; q_pe], [c_kv ; k_pe])`` -> [T, H, v]."""
        q_lat = absorb_q(q_nope, self.weights)
        o_lat, _ = absorbed_attention(
            q_lat, q_pe, kv_cache, batch, self.softmax_scale, kv_scale, self.impl
        )
        return apply_W_UV(o_lat, self.weights)

    def normal(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: MLABatch,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normal path: decompress + causal MHA -> [T, H, v]."""
        o, _ = normal_attention(
            q_nope,
            q_pe,
            kv_cache,
            batch,
            self.weights,
            self.softmax_scale,
            kv_scale,
            chunk_tokens=self.chunk_tokens,
        )
        return o

    def __call__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: MLABatch,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] -> o [T, H, v] in q_nope's dtype.

        Inference only: runs without autograd."""
        if q_pe.shape[-1] != self.dims.qk_rope_head_dim:
            raise ValueError(
                f"q_pe width {q_pe.shape[-1]} != qk_rope_head_dim {self.dims.qk_rope_head_dim}"
            )
        with torch.no_grad():
            return self._forward(q_nope, q_pe, kv_cache, batch, kv_scale)

    def _plan(self, batch: MLABatch, device: torch.device) -> tuple[PathChoice, list]:
        """The policy's decision and, for a mixed batch, the per-path sub-batches and query
        rows: computed once per step and shared by every layer with the same dims and policy
        (cached on the batch)."""
        p = self.policy
        key = ("plan", p.mode, p.chunked_prefix_threshold, p.profile, self.dims, str(device))
        cached = batch._device_cache.get(key)
        if cached is not None:
            choice, parts = cached
            return choice, [(getattr(self, name), sub, rows) for name, sub, rows in parts]
        choice = p.choose(batch, self.dims, device.type)
        parts = []
        if choice.batch_mode == "mixed":
            for flag, name in ((True, "absorbed"), (False, "normal")):
                reqs = [i for i, a in enumerate(choice.use_absorbed) if a == flag]
                rows = torch.tensor(batch.token_index(reqs), dtype=torch.long, device=device)
                if rows.numel():
                    parts.append((name, batch.select(reqs), rows))
        batch._device_cache[key] = (choice, parts)
        return choice, [(getattr(self, name), sub, rows) for name, sub, rows in parts]

    def _forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: MLABatch,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        choice, parts = self._plan(batch, q_nope.device)
        self.last_choice = choice
        mode = choice.batch_mode
        if mode == "absorbed":
            return self.absorbed(q_nope, q_pe, kv_cache, batch, kv_scale)
        if mode == "normal":
            return self.normal(q_nope, q_pe, kv_cache, batch, kv_scale)
        out = torch.empty(
            q_nope.shape[0],
            self.dims.num_heads,
            self.dims.v_head_dim,
            dtype=q_nope.dtype,
            device=q_nope.device,
        )
        for fn, sub, rows in parts:
            out[rows] = fn(q_nope[rows], q_pe[rows], kv_cache, sub, kv_scale)
        return out
