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
import os
from typing import Any

from mla_backend_integrations.vllm import BACKEND_NAME, compat, is_selected
from mla_backend_integrations.vllm.compat import (  # noqa: F401 (re-exported)
    ALLOW_UNTESTED_ENV,
    check_vllm_version,
)
from mla_backend_integrations.vllm.dcp import check_context_parallel

from mla_backend.config import current

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
        compat.patch_cpu_platform(
            is_selected, prepare_cpu_config, SPARSE_BACKEND_PATH, keeps_user_scheduling
        )
        compat.patch_cpu_dcp_slot_mapping()
        from mla_backend_integrations.vllm.sparse import make_indexer_op

        compat.register_indexer_op(make_indexer_op)
        supply_v4(current().v4_ops)


#: set by a process whose engine config selects MLA_ABSORB for DeepSeek-V4 ("faster" or
#: "all", :func:`v4_ops_mode`), inherited by the engine processes it starts: their plugin then
#: serves those of V4's ops with ours
V4_OPS_ENV = "MLA_BACKEND_V4_OPS"
#: the V4 ops ours serve faster than vLLM's own AVX512-BF16 kernels (``python -m benchmarks
#: v4``: the attention over the 584-byte rows read in place, the indexer's paged logits)
V4_FASTER_OPS = ("flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu")


def supply_v4(mode: str = "0") -> None:
    """DeepSeek-V4 on this CPU: vLLM's V4 CPU ops computed by the core (:mod:`.v4_ops`) and
    in torch (:mod:`.v4_model_ops`), each where this vLLM build lacks it, and in place of
    vLLM's own by ``mode`` (:data:`V4_OPS_ENV`): "0" none, "faster" :data:`V4_FASTER_OPS`,
    "all" (or "1") every one; and its metadata builders without Triton."""
    from mla_backend_integrations.vllm import v4_model_ops, v4_ops

    ops = {
        name: (schema, getattr(module, name))
        for module in (v4_ops, v4_model_ops)
        for name, schema in module.SCHEMAS.items()
    }
    if mode not in ("0", "", "faster", "all", "1"):
        raise ValueError(f"{V4_OPS_ENV}={mode!r} is not supported: 0, faster or all")
    replace = set(ops) if mode in ("all", "1") else set(V4_FASTER_OPS if mode == "faster" else ())
    compat.supply_v4_cpu_ops({k: v for k, v in ops.items() if k in replace}, override=True)
    compat.supply_v4_cpu_ops(ops, override=False)
    compat.patch_v4_cpu_metadata()
    compat.patch_v4_tile_scheduler_keys()


def v4_ops_mode(model_config: Any) -> str:
    """Which of vLLM's V4 CPU ops ours replace for this model (:func:`supply_v4`): "all" where
    vLLM's own kernels cannot run it (they take bf16 only, 64-384 routed experts and 6-9 of them
    per token), else "faster" (its own kernels for the rest)."""
    import torch

    hf = getattr(model_config, "hf_text_config", None)
    experts = getattr(hf, "n_routed_experts", None)
    per_token = getattr(hf, "num_experts_per_tok", None)
    if (
        getattr(model_config, "dtype", None) != torch.bfloat16
        or not isinstance(experts, int) or not 64 <= experts <= 384
        or not isinstance(per_token, int) or not 6 <= per_token <= 9
    ):  # fmt: skip
        return "all"
    return "faster"


def is_v4(model_config: Any) -> bool:
    """Whether the model is DeepSeek-V4 (its attention is vLLM's model-driven V4 path)."""
    hf = getattr(model_config, "hf_text_config", None)
    return getattr(hf, "model_type", None) == "deepseek_v4"


def keeps_user_scheduling(vllm_config: Any) -> bool:
    """Whether the CPU platform keeps the user's chunked-prefill / prefix-caching settings
    under ``MLA_ABSORB``: yes, but for DeepSeek-V4 (vLLM turns both off for it without AMX;
    not yet tested through our ops)."""
    return not is_v4(getattr(vllm_config, "model_config", None))


def validate_engine_config(vllm_config: Any) -> None:
    """Start-up checks when ``MLA_ABSORB`` is selected; ``ValueError`` names the setting."""
    check_vllm_version()
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    if is_v4(model_config):
        validate_v4_config(vllm_config)
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
    from mla_backend.cache_layout import ENGINE_NAMES, CacheLayout

    if cache_dtype not in ENGINE_NAMES:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support kv_cache_dtype={cache_dtype!r}; "
            f"supported: {', '.join(ENGINE_NAMES)}"
        )
    import torch

    model_dtype = getattr(model_config, "dtype", None)
    if isinstance(model_dtype, torch.dtype):
        layout = CacheLayout.named(
            cache_dtype, int(hf.kv_lora_rank), int(hf.qk_rope_head_dim), model_dtype
        )
        try:
            layout.check_query_dtype(model_dtype)
        except ValueError as e:
            raise ValueError(
                f"attention backend {BACKEND_NAME}: kv_cache_dtype={cache_dtype!r} with "
                f"dtype={model_dtype}: {e}"
            ) from None
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


#: what vLLM's DeepSeek-V4 CPU path and the V4 fp8 page layout hold
V4_HEAD_DIM, V4_ROPE = 512, 64
#: V4 cache dtypes served (vLLM's CPU path stores V4's fp8 page layout: "auto" means it)
V4_CACHE_DTYPES = ("auto", "fp8_ds_mla")
#: the top-k vLLM's CPU V4 indexer runs (``SparseAttnIndexer.forward_cpu`` asserts it)
V4_INDEX_TOPK = 512


def validate_v4_config(vllm_config: Any) -> None:
    """Start-up checks of DeepSeek-V4 (vLLM's model-driven V4 path with the core's kernels
    underneath, :mod:`.v4_ops`): V4's attention dims (head_dim 512, RoPE 64), its fp8 cache
    and fp8 index cache, one rank (tensor / context parallel untested), and ``index_topk``
    512 where a compressed context can exceed it (vLLM's CPU indexer forward asserts 512 on
    its long-context path); ``ValueError`` names the value and what is supported."""
    hf = vllm_config.model_config.hf_text_config
    head, rope = getattr(hf, "head_dim", None), getattr(hf, "qk_rope_head_dim", None)
    if (head, rope) != (V4_HEAD_DIM, V4_ROPE):
        raise ValueError(
            f"attention backend {BACKEND_NAME}, DeepSeek-V4: head_dim={head}, "
            f"qk_rope_head_dim={rope} are not supported; supported: {V4_HEAD_DIM}, {V4_ROPE} "
            "(V4's fp8 page layout)"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in V4_CACHE_DTYPES:
        raise ValueError(
            f"attention backend {BACKEND_NAME}, DeepSeek-V4: kv_cache_dtype={cache_dtype!r} "
            f"is not supported; supported: {', '.join(V4_CACHE_DTYPES)} (V4's fp8 page layout)"
        )
    kv = getattr(getattr(vllm_config, "attention_config", None), "indexer_kv_dtype", "auto")
    if kv not in SUPPORTED_INDEXER_KV_DTYPES:
        raise ValueError(
            f"attention backend {BACKEND_NAME}, DeepSeek-V4: indexer_kv_dtype={kv!r} is not "
            f"supported; supported: {', '.join(SUPPORTED_INDEXER_KV_DTYPES)} (the fp8 index "
            "cache; V4's fp4 indexer cache is not served)"
        )
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "decode_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise ValueError(
                f"attention backend {BACKEND_NAME}, DeepSeek-V4: {name}={size} is not "
                "supported yet; supported: 1"
            )
    ratios = [int(r) for r in (getattr(hf, "compress_ratios", None) or ()) if int(r) > 1]
    topk = getattr(hf, "index_topk", None)
    csa = min((r for r in ratios if r < 128), default=None)
    max_len = int(vllm_config.model_config.max_model_len)
    reached = csa is not None and topk is not None and max_len // csa > int(topk)
    if reached and int(topk) != V4_INDEX_TOPK:
        raise ValueError(
            f"attention backend {BACKEND_NAME}, DeepSeek-V4: index_topk={topk} is not "
            f"supported at max_model_len={max_len} (compressed contexts up to {max_len} // "
            f"{csa} entries): vLLM's CPU indexer runs its top-k only at index_topk "
            f"{V4_INDEX_TOPK}; supported: index_topk {V4_INDEX_TOPK}, or max_model_len <= "
            f"{csa * int(topk)}"
        )


def prepare_cpu_config(vllm_config: Any) -> None:
    """On the CPU platform, once ``MLA_ABSORB`` is selected: the start-up checks, then native
    RoPE (:func:`compat.force_native_rope`). DeepSeek-V4 instead runs vLLM's model-driven V4
    path with the core underneath (the ops :func:`supply_v4` registers): its layers pick
    their own backends, so the selection goes back to vLLM's default (selected, our backend
    class would decide V4's KV-cache layout and page packing, which it does not serve)."""
    validate_engine_config(vllm_config)
    if is_v4(getattr(vllm_config, "model_config", None)):
        vllm_config.attention_config.backend = None
        mode = v4_ops_mode(vllm_config.model_config)
        os.environ[V4_OPS_ENV] = mode  # the engine processes this one starts
        supply_v4(mode)  # this process (an in-process engine)
        logger.info(
            "%s: DeepSeek-V4 runs vLLM's V4 model path, its CPU ops served by mla_backend: %s",
            BACKEND_NAME, "every one" if mode == "all" else
            f"{', '.join(V4_FASTER_OPS)}, and those this vLLM build lacks",
        )  # fmt: skip
        return
    compat.force_native_rope(vllm_config)
