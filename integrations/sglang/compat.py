"""Every SGLang workaround of this adapter, in one place: each a :class:`Workaround` guarded by
the SGLang versions it was written for and checked against (outside them it is skipped,
logged once), listed in :data:`WORKAROUNDS` (the table docs/engines.md shows, rendered by
:func:`~mla_backend_integrations._common.workaround_table`: name, versions, the upstream
behaviour and what the adapter does instead), next to the functions that apply them.
Importing this module does not import SGLang.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from mla_backend_integrations._common import Workaround, distribution_version

_LOGGER = "mla_backend.sglang"
#: SGLang versions this adapter was tested with: [min, max).
TESTED_SGLANG_RANGE: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 5, 23), (0, 5, 24))
#: the installed SGLang version (distribution metadata: no SGLang import)
sglang_version = functools.partial(distribution_version, "sglang")


PLAIN_MLA_ON_CPU = Workaround(
    "plain-mla-on-cpu",
    TESTED_SGLANG_RANGE,
    "on CPU, _dispatch_mla_subtype picks AttnForwardMethod.MLA_FUSED_ROPE_CPU for models with "
    "fused_qkv_a_proj_with_mqa on the Intel AMX path, which runs sgl-kernel's fused "
    "decode op itself and never calls the attention backend",
    sglang_version,
    _LOGGER,
    "the forward-method handler answers the plain AttnForwardMethod.MLA, so the attention "
    "backend runs (absorbed_forward_method)",
)
CPU_IMPORT_STUBS = Workaround(
    "cpu-import-stubs",
    TESTED_SGLANG_RANGE,
    "SGLang imports torchvision and sgl_kernel at module level in code never run on CPU, and "
    "neither has a build that loads against torch 2.13.0+cpu (PyPI torchvision fails, no CPU "
    "sgl-kernel wheel exists)",
    sglang_version,
    _LOGGER,
    "import-only stand-ins (test tooling under tests/stubs, never shipped) go first on "
    "sys.path and PYTHONPATH, which server subprocesses inherit (add_import_stubs)",
)

ATTENTION_TP_SIZE = Workaround(
    "attention-tp-size",
    TESTED_SGLANG_RANGE,
    "with DP attention (--attn-dp-size, formerly --enable-dp-attention --dp) a layer's heads "
    "are split over the attention-TP group (tp_size / attn_dp_size ranks, read from "
    "sglang.srt.runtime_context.get_parallel().attn_tp_size), not over the model runner's "
    "tp_size",
    sglang_version,
    _LOGGER,
    "a layer's heads per rank come from SGLang's attention-TP size, the runner's tp_size "
    "where no parallel context exists (attention_tp_size)",
)
SPLIT_QK_BACKENDS = Workaround(
    "split-qk-backends",
    TESTED_SGLANG_RANGE,
    "a DeepSeek layer passes q_pe / k_pe to the attention backend separately only for the "
    "backends named in sglang.srt.models.deepseek_common.utils."
    "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS, a module list with no registration call; for "
    "every other backend it concatenates [q_lat ; q_pe] and [k_lat ; k_pe] into new tensors",
    sglang_version,
    _LOGGER,
    "the plugin adds mla_absorb to that list (removes it for MLA_BACKEND_SGLANG_QK=concat); "
    "the backend serves both conventions (use_split_qk)",
)

DSA_CPU_CAPABILITY = Workaround(
    "dsa-cpu-capability",
    TESTED_SGLANG_RANGE,
    "for a DSA model (DeepSeek-V3.2, GLM-5) the server-argument hook handle_model_specific_"
    "adjustments (srt/arg_groups/model_hook.py) and the DSA passes it runs "
    "(_dsa_kv_cache_dtype_default, _dsa_split_backend_resolution in srt/arg_groups/"
    "overrides.py) call torch.cuda.get_device_capability() on every platform but NPU and XPU, "
    "the CPU platform included, where a CPU torch raises 'Torch not compiled with CUDA enabled'",
    sglang_version,
    _LOGGER,
    "while that one hook runs on SGLang's CPU platform with no CUDA device, "
    "torch.cuda.get_device_capability answers (0, 0), no CUDA capability (the DSA KV cache "
    "then defaults to bfloat16); torch's own everywhere else (answer_cpu_capability)",
)
DSA_CPU_KV_DTYPE = Workaround(
    "dsa-cpu-kv-dtype",
    TESTED_SGLANG_RANGE,
    "for a DSA model the argument pass _dsa_kv_cache_dtype_default (srt/arg_groups/"
    "overrides.py) turns --kv-cache-dtype auto into bfloat16 (fp8_e4m3 from SM100 on) and "
    "accepts only bfloat16 / fp8_e4m3, what SGLang's CUDA DSA kernels read, on the CPU "
    "platform too; an fp32 (or fp16) model then gets a bfloat16 latent cache",
    sglang_version,
    _LOGGER,
    "on the CPU platform with --attention-backend mla_absorb, auto stays auto (the model's "
    "dtype, which the core reads: bf16 / fp16 / fp32); explicit values and every other "
    "platform or backend go through upstream's pass (answer_cpu_capability)",
)
DSA_POOL = Workaround(
    "dsa-pool",
    TESTED_SGLANG_RANGE,
    "for a DSA model KVCacheConfigurator (srt/mem_cache/kv_cache_configurator.py) builds "
    "DSATokenToKVPool whatever the attention backend: MLATokenToKVPool's latent rows plus, "
    "per layer, the indexer's keys in 64-token pages of uint8 [pages, 64 x (Di + 4 Di / 128)] "
    "(a page's e4m3 keys, then its float32 scales: IndexKeyCache), written and read by CUDA "
    "kernels only",
    sglang_version,
    _LOGGER,
    "the backend reads the latent rows as from MLATokenToKVPool and views a layer's "
    "index-key buffer (index_key_cache.buffer) as the core's fp8 index cache [pages, "
    "page_size, Di + 4 Di / 128], the same bytes (index_cache_view)",
)
DSA_INDEXER_CPU = Workaround(
    "dsa-indexer-cpu",
    TESTED_SGLANG_RANGE,
    "the DSA Indexer (srt/layers/attention/dsa/dsa_indexer.py), a BaseFusedOp, has CUDA, "
    "HIP, XPU and NPU forwards only; on the CPU platform dispatch falls through to "
    "forward_native, which raises NotImplementedError (BaseFusedOp.register_oot_forward "
    "serves out-of-tree platforms only)",
    sglang_version,
    _LOGGER,
    "Indexer.forward_native is replaced when the plugin registers (serve_indexer_on_cpu) by "
    "sparse.indexer_forward: SGLang's own projections and weights, then the core's index-key "
    "write and top-k over the DSA pool (under mla_absorb; any other backend still gets "
    "upstream's NotImplementedError)",
)

#: every workaround above, in the order docs/engines.md lists them
WORKAROUNDS: tuple[Workaround, ...] = (
    PLAIN_MLA_ON_CPU, CPU_IMPORT_STUBS, ATTENTION_TP_SIZE, SPLIT_QK_BACKENDS,
    DSA_CPU_CAPABILITY, DSA_CPU_KV_DTYPE, DSA_POOL, DSA_INDEXER_CPU,
)  # fmt: skip


def attention_tp_size(model_runner: Any) -> int:
    """How many ranks split a layer's heads: SGLang's attention-TP size (inside
    :data:`ATTENTION_TP_SIZE`'s versions), else the runner's ``tp_size``."""
    if ATTENTION_TP_SIZE.applies():
        try:
            from sglang.srt.runtime_context import get_parallel

            return int(get_parallel().attn_tp_size)
        except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError):
            pass  # no parallel context (a test's mock runner): the runner's own size
    return int(getattr(model_runner, "tp_size", 1) or 1)


def absorbed_forward_method(attn: Any, forward_batch: Any) -> Any:
    """The absorbed forward method for a layer this backend serves: plain ``MLA`` (inside
    :data:`PLAIN_MLA_ON_CPU`'s versions), else SGLang's own subtype choice."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    if PLAIN_MLA_ON_CPU.applies():
        return AttnForwardMethod.MLA
    return _dispatch_mla_subtype(attn, forward_batch)


def add_import_stubs(stubs_dir: str, env: dict[str, str] | None = None) -> None:
    """Put the import-only stand-ins first on ``sys.path`` and on ``PYTHONPATH`` (``env``,
    default ``os.environ``; subprocesses such as a server inherit it), see
    :data:`CPU_IMPORT_STUBS`."""
    if not CPU_IMPORT_STUBS.applies():
        return
    env = os.environ if env is None else env
    if stubs_dir not in sys.path:
        sys.path.insert(0, stubs_dir)
    pp = env.get("PYTHONPATH", "")
    if stubs_dir not in pp.split(os.pathsep):
        env["PYTHONPATH"] = stubs_dir + (os.pathsep + pp if pp else "")


def use_split_qk(backends: list[str], name: str, split: bool) -> None:
    """Name ``name`` in SGLang's ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS`` (``backends``) when
    ``split`` (the model then passes q_pe / k_pe separately), else take it out (the model
    concatenates them), see :data:`SPLIT_QK_BACKENDS`; idempotent. Outside the workaround's
    versions the list is left alone (SGLang's own convention: concatenated)."""
    if not SPLIT_QK_BACKENDS.applies():
        return
    if split and name not in backends:
        backends.append(name)
    elif not split and name in backends:
        backends.remove(name)


#: the CUDA capability answered on a CPU platform inside the argument hook: none
NO_CUDA_CAPABILITY = (0, 0)


def _on_cpu_platform() -> bool:
    import torch
    from sglang.srt.utils.common import is_cpu

    return is_cpu() and not torch.cuda.is_available()


def answer_cpu_capability(model_hook: Any, backend_name: str) -> None:
    """Wrap ``model_hook.handle_model_specific_adjustments`` (SGLang's module, passed in) so
    that, on SGLang's CPU platform without a CUDA device, ``torch.cuda.get_device_capability``
    answers :data:`NO_CUDA_CAPABILITY` for the duration of that call only
    (:data:`DSA_CPU_CAPABILITY`), and, there, with ``--attention-backend backend_name``, a
    DSA model's ``--kv-cache-dtype auto`` stays the model's dtype (:data:`DSA_CPU_KV_DTYPE`);
    idempotent."""
    if DSA_CPU_KV_DTYPE.applies():
        upstream_pass = model_hook._dsa_kv_cache_dtype_default
        if not getattr(upstream_pass, "_mla_absorb_wrapped", False):

            @functools.wraps(upstream_pass)
            def _dsa_kv_cache_dtype_default(view: Any) -> dict:
                if (
                    _on_cpu_platform()
                    and getattr(view, "attention_backend", None) == backend_name
                    and getattr(view, "kv_cache_dtype", None) == "auto"
                ):
                    return {}
                return upstream_pass(view)

            _dsa_kv_cache_dtype_default._mla_absorb_wrapped = True  # type: ignore[attr-defined]
            model_hook._dsa_kv_cache_dtype_default = _dsa_kv_cache_dtype_default
    if not DSA_CPU_CAPABILITY.applies():
        return
    original = model_hook.handle_model_specific_adjustments
    if getattr(original, "_mla_absorb_wrapped", False):
        return

    @functools.wraps(original)
    def handle_model_specific_adjustments(server_args: Any) -> Any:
        import torch

        if not _on_cpu_platform():
            return original(server_args)
        saved = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: NO_CUDA_CAPABILITY
        try:
            return original(server_args)
        finally:
            torch.cuda.get_device_capability = saved

    handle_model_specific_adjustments._mla_absorb_wrapped = True  # type: ignore[attr-defined]
    model_hook.handle_model_specific_adjustments = handle_model_specific_adjustments


def is_dsa_pool(pool: Any) -> bool:
    """Whether ``pool`` is SGLang's ``DSATokenToKVPool`` (or a subclass), read by name (no
    import), inside :data:`DSA_POOL`'s versions."""
    names = {c.__name__ for c in type(pool).__mro__}
    return "DSATokenToKVPool" in names and DSA_POOL.applies()


def index_cache_view(pool: Any, layer_id: int, page_size: int, width: int) -> Any:
    """The index keys of ``layer_id`` in a ``DSATokenToKVPool`` as the core's fp8 index cache
    uint8 [pages, page_size, width] (``width`` = Di + 4 Di / 128; no copy), see
    :data:`DSA_POOL`. Raises ``ValueError`` for pooled / compressed index pages or a layer
    without its own keys (a shared top-k layer)."""
    if getattr(pool, "index_kpool", 1) != 1 or getattr(pool, "index_page_size", page_size) != (
        page_size
    ):
        raise ValueError(
            f"DSA index pages of {getattr(pool, 'index_page_size', '?')} tokens (index_kpool "
            f"{getattr(pool, 'index_kpool', '?')}) are not supported; supported: one index key "
            f"per token in pages of the KV page size {page_size}"
        )
    buf = pool.index_key_cache.buffer[layer_id - getattr(pool, "start_layer", 0)]
    if buf.shape[0] == 0:
        raise ValueError(f"layer {layer_id} holds no index keys (it reuses another layer's)")
    if buf.shape[1] != page_size * width:
        raise ValueError(
            f"DSA index page of {buf.shape[1]} bytes; the core's fp8 layout needs page_size "
            f"{page_size} x {width}"
        )
    return buf.view(buf.shape[0], page_size, width)


def serve_indexer_on_cpu(indexer_cls: Any, forward: Any) -> None:
    """Make ``forward`` the ``forward_native`` of SGLang's DSA ``Indexer`` class (upstream's
    raises NotImplementedError), see :data:`DSA_INDEXER_CPU`; idempotent."""
    if not DSA_INDEXER_CPU.applies():
        return
    if getattr(indexer_cls.forward_native, "_mla_absorb_cpu", False):
        return
    upstream = indexer_cls.forward_native

    def forward_native(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, upstream, *args, **kwargs)

    forward_native._mla_absorb_cpu = True  # type: ignore[attr-defined]
    indexer_cls.forward_native = forward_native
