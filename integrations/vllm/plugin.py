"""Registration of the ``MLA_ABSORB`` attention backend with vLLM (idempotent, every process).

Entry points (``pyproject.toml``):

* ``vllm.platform_plugins: mla_absorb = mla_backend_integrations.vllm.plugin:platform_hook``
  runs first in every vLLM process (while ``vllm.platforms.current_platform`` resolves). It
  registers the enum member and returns ``None`` (it never activates a platform).
* ``vllm.general_plugins: mla_absorb = mla_backend_integrations.vllm.plugin:register``
  runs in every process before engine arguments are parsed. It registers the member (again,
  a no-op) and, on the CPU platform, extends the platform's backend selection.

The engine workarounds (the CPU platform's backend selection and config checks, the enum
member pickling by name through :func:`backend_member`, native RoPE on CPU) live in
:mod:`mla_backend_integrations.vllm.compat`, each guarded by the vLLM versions it applies to.

CUDA and ROCm platforms honour a selected backend through ``validate_configuration``; the
backend class declares its capabilities, so nothing is patched there.
"""

from __future__ import annotations

import logging
from typing import Any

from mla_backend_integrations.vllm import BACKEND_NAME, compat, is_selected
from mla_backend_integrations.vllm.compat import (  # noqa: F401 (re-exported)
    ALLOW_UNTESTED_ENV,
    check_vllm_version,
)
from mla_backend_integrations.vllm.dcp import check_context_parallel

# a child of the "vllm" logger, so vLLM's logging configuration shows our messages
logger = logging.getLogger("vllm.mla_absorb")

BACKEND_PATH = "mla_backend_integrations.vllm.backend.MLAAbsorbBackend"
#: the backend class of sparse MLA layers (DeepSeek-V3.2 / GLM-5), same enum member
SPARSE_BACKEND_PATH = "mla_backend_integrations.vllm.sparse.MLAAbsorbSparseBackend"
#: vLLM's DSA indexer quantizes its keys (and query) in blocks of this many values
#: (``deepseek_v2.Indexer.quant_block_size``, fixed there) with power-of-two scales
VLLM_INDEX_QUANT_BLOCK = 128
VLLM_INDEX_SCALE_FMT = "ue8m0"
#: ``--attention-config indexer_kv_dtype`` values served (vLLM's DSA indexer cache is fp8)
SUPPORTED_INDEXER_KV_DTYPES = ("auto", "fp8")
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
    compat.pickle_by_name(member, backend_member)
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
        compat.patch_cpu_platform(is_selected, prepare_cpu_config, SPARSE_BACKEND_PATH)
        compat.patch_cpu_dcp_slot_mapping()
        from mla_backend_integrations.vllm.sparse import make_indexer_op

        compat.register_indexer_op(make_indexer_op)


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
        validate_dsa_config(vllm_config)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    # every cache layout of the core, as the backend's SUPPORTED_KV_CACHE_DTYPES (the backend
    # imports this module: importing it here would be a cycle)
    from mla_backend.cache_layout import ENGINE_NAMES

    if cache_dtype not in ENGINE_NAMES:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support kv_cache_dtype={cache_dtype!r}; "
            f"supported: {', '.join(ENGINE_NAMES)}"
        )
    check_context_parallel(vllm_config)


def validate_dsa_config(vllm_config: Any) -> None:
    """Start-up checks of a DSA model (``index_topk``: DeepSeek-V3.2, GLM-5) under MLA_ABSORB:
    the indexer dims (``index_topk``, ``index_n_heads``, ``index_head_dim`` ints >= 1), an index
    head dim vLLM's fp8 key cache and the core's layout hold (a multiple of 128, >= the RoPE
    dims), the indexer's query latent (``q_lora_rank``) and an fp8 indexer cache;
    ``ValueError`` names the value and what is supported."""
    from mla_backend.index_cache import IndexCacheLayout, IndexerDims

    hf = vllm_config.model_config.hf_text_config
    try:
        dims = IndexerDims.from_config(hf)
        assert dims is not None
        IndexCacheLayout.named(
            "fp8", dims.head_dim, VLLM_INDEX_QUANT_BLOCK, scale_fmt=VLLM_INDEX_SCALE_FMT
        )
    except (ValueError, AttributeError) as e:
        raise ValueError(f"attention backend {BACKEND_NAME}, DSA model: {e}") from e
    rope = int(hf.qk_rope_head_dim)
    if dims.head_dim < rope:
        raise ValueError(
            f"attention backend {BACKEND_NAME}, DSA model: index_head_dim={dims.head_dim} is "
            f"smaller than qk_rope_head_dim={rope} (the indexer rotates its first {rope} dims)"
        )
    if getattr(hf, "q_lora_rank", None) is None:
        raise ValueError(
            f"attention backend {BACKEND_NAME}, DSA model: q_lora_rank=None is not supported "
            "(the lightning indexer's query reads the query latent)"
        )
    kv = getattr(getattr(vllm_config, "attention_config", None), "indexer_kv_dtype", "auto")
    if kv not in SUPPORTED_INDEXER_KV_DTYPES:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support indexer_kv_dtype={kv!r}; "
            f"supported: {', '.join(SUPPORTED_INDEXER_KV_DTYPES)}"
        )


def prepare_cpu_config(vllm_config: Any) -> None:
    """On the CPU platform, once ``MLA_ABSORB`` is selected: the start-up checks, then native
    RoPE (:func:`compat.force_native_rope`)."""
    validate_engine_config(vllm_config)
    compat.force_native_rope(vllm_config)
