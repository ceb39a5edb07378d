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

#: every workaround above, in the order docs/engines.md lists them
WORKAROUNDS: tuple[Workaround, ...] = (
    PLAIN_MLA_ON_CPU, CPU_IMPORT_STUBS, ATTENTION_TP_SIZE, SPLIT_QK_BACKENDS,
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
