"""The device seam: the kernel interface (:class:`KernelImpl`) and the one place that picks an
implementation for a device.

Implementations:

- ``native`` (:mod:`mla_backend.ops.native`): C++ kernels compiled on first use, for
  CPU tensors; if they cannot be built the seam falls back to ``torch`` with one warning.
- ``triton`` (:mod:`mla_backend.ops.triton`): the GPU path on CUDA/ROCm.
- ``flashinfer`` (:mod:`mla_backend.ops.flashinfer`, opt-in until measured on a GPU):
  FlashInfer's MLA wrapper for the absorbed path where it serves, Triton elsewhere.
- ``torch`` (:mod:`mla_backend.ops.torch`): plain PyTorch, runs everywhere (the fallback).

Each is a sibling package of the same shape exporting one ``Kernels`` class.

``MLA_BACKEND_IMPL`` = ``auto`` (default) | ``torch`` | ``native`` | ``triton`` | ``flashinfer``
forces a choice
(tests force ``triton`` on CPU tensors under ``TRITON_INTERPRET=1``). Inputs are validated once,
at the public entry points (:mod:`mla_backend.attention`) and at plan time (page ids:
``PlanPart.max_page_id``); implementations trust them. The cache's layout is resolved there too,
once per call, and handed in as a :class:`~mla_backend.cache_layout.CacheLayout`: no
implementation looks at the cache's dtype or the engine's names for it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..cache_layout import CacheLayout
    from ..cost import DeviceProfile
    from ..dims import MLADims
    from ..parts import PlanPart
    from ..weights import AbsorbWeights

IMPLS = ("auto", "torch", "native", "triton", "flashinfer")
ENV_VAR = "MLA_BACKEND_IMPL"


@runtime_checkable
class KernelImpl(Protocol):
    """What every kernel implementation provides. Tuning knobs are keyword arguments of the
    implementation's constructor; calls read no tensor data on the host."""

    name: str

    def cost_profile(self, device: torch.device) -> DeviceProfile:
        """The measured roofline of these kernels on ``device`` (the policy's ``cost`` mode
        prices both paths on it; called at plan time)."""
        ...

    def work_shape(
        self,
        dims: MLADims,
        new_lens: Sequence[int],
        kv_lens: Sequence[int],
        device: torch.device,
    ) -> tuple[int, int]:
        """(new tokens per query block, KV splits) of the absorbed kernel for these requests
        (called at plan time)."""
        ...

    def prepare_weights(self, weights: AbsorbWeights) -> AbsorbWeights:
        """A layer's weights in the form this implementation's ``absorb_q`` / ``apply_W_UV``
        read (called once per layer, outside the step; may add packed copies)."""
        ...

    def absorb_q(self, q_nope: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        """``q_lat = q_nope · W_UK`` per head: q_nope [T, H, nope] -> [T, H, r] in its dtype
        (``weights`` from :meth:`prepare_weights`)."""
        ...

    def apply_W_UV(self, o_lat: torch.Tensor, weights: AbsorbWeights) -> torch.Tensor:
        """``o = o_lat · W_UV`` per head: o_lat [T, H, r] -> [T, H, v] in its dtype."""
        ...

    def write_latent(
        self,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None,
    ) -> None:
        """Write ``[c_kv ; k_pe]`` ([T, r], [T, rope]) to ``slot_mapping`` [T] (< 0 skipped) of
        ``kv_cache`` [pages, page_size, width] in ``layout``, in place; fp8 stores
        ``value / kv_scale``."""
        ...

    def absorbed_attention(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        part: PlanPart,
        softmax_scale: float,
        kv_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_lat [T, H, r], q_pe [T, H, rope] (T = part.num_tokens) -> (o_lat [T, H, r] in
        q's dtype, lse [T, H] float32): MQA over the latent rows, causal among new tokens."""
        ...

    def gather_latent(
        self,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        part: PlanPart,
        i: int,
        start: int,
        end: int,
        dtype: torch.dtype,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Rows ``[start, end)`` of request ``i`` of ``part`` as [end - start, r + rope] in
        ``dtype`` (dequantized): the normal path's read of the latent cache."""
        ...

    def decompress(
        self,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        W_UK: torch.Tensor,
        W_UV: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normal path's decompression: c_kv [L, r], k_pe [L, rope], W_UK [H, nope, r],
        W_UV [H, r, v] (one dtype) -> (k [H, L, nope + rope] = ``[c_kv·W_UK[h]^T ; k_pe]``,
        v [H, L, v] = ``c_kv·W_UV[h]``) in that dtype (views of [L, H, ...] buffers)."""
        ...

    def attention_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA of q [H, Lq, Dqk] over k [H, Lk, Dqk], v [H, Lk, Dv] (top-left causal when
        ``causal``) -> (o [H, Lq, Dv] in q's dtype, lse [H, Lq] float32): the normal path."""
        ...


def impl_name(device: torch.device, override: str | None = None) -> str:
    """Which implementation serves ``device``: 'torch', 'native', 'triton' or 'flashinfer'."""
    choice = (override or os.environ.get(ENV_VAR, "auto")).strip().lower()
    if choice not in IMPLS:
        raise ValueError(f"{ENV_VAR}={choice!r} is not supported; supported: {', '.join(IMPLS)}")
    if choice == "auto":
        if device.type == "cuda" and _triton_available():
            return "triton"
        if device.type == "cpu" and _native_available():
            return "native"
        return "torch"
    if choice in ("triton", "flashinfer") and not _triton_available():
        raise RuntimeError(f"{ENV_VAR}={choice} but triton cannot be imported")
    if choice == "flashinfer" and not _flashinfer_available():
        raise RuntimeError(
            f"{ENV_VAR}=flashinfer but flashinfer's MLA wrapper cannot be imported "
            "(pip install flashinfer-python), or use MLA_BACKEND_IMPL=triton"
        )
    if choice == "native" and device.type != "cpu":
        raise ValueError(f"{ENV_VAR}=native serves CPU tensors, not {device.type}")
    if choice == "native" and not _native_available():
        return "torch"  # the native loader has warned once, saying why
    return choice


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _flashinfer_available() -> bool:
    return bool(importlib.import_module("mla_backend.ops.flashinfer.wrapper").available())


def _native_available() -> bool:
    """True when the native CPU kernels built (the loader warns once, saying why, if not)."""
    try:
        native = importlib.import_module("mla_backend.ops.native.build")
        return bool(native.available())
    except Exception:  # never let the optional kernels break the torch path
        return False


_DEFAULTS: dict[str, KernelImpl] = {}
#: the variable that picks the native kernels' ISA level (``mla_backend.ops.native.build.ENV_ISA``;
#: named here so the seam need not import the native loader on every call)
_ENV_NATIVE_ISA = "MLA_BACKEND_NATIVE_ISA"
#: each asked-for choice, resolved once: (device type, name asked, ``MLA_BACKEND_IMPL``,
#: ``MLA_BACKEND_NATIVE_ISA``) -> implementation. Per-layer calls ask on every call; resolving
#: anew (the native loader re-deriving the host's ISA levels) cost ~20 us each time.
_RESOLVED: dict[tuple[str, str | None, str | None, str | None], KernelImpl] = {}


def get_impl(device: torch.device, override: str | KernelImpl | None = None) -> KernelImpl:
    """The kernel implementation for ``device`` (``override``: a name or an instance)."""
    if override is not None and not isinstance(override, str):
        if not isinstance(override, KernelImpl):
            raise ValueError(f"impl={override!r} is not a name or a KernelImpl")
        return override
    key = (device.type, override, os.environ.get(ENV_VAR), os.environ.get(_ENV_NATIVE_ISA))
    impl = _RESOLVED.get(key)
    if impl is None:
        name = impl_name(device, override)
        if name not in _DEFAULTS:
            _DEFAULTS[name] = importlib.import_module(f"mla_backend.ops.{name}").Kernels()
        impl = _RESOLVED[key] = _DEFAULTS[name]
    return impl
