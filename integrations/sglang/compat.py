"""Every SGLang workaround of this adapter, in one place, each guarded by the SGLang versions
it was written for and checked against (outside them it is skipped, logged once).

- :data:`PLAIN_MLA_ON_CPU` (SGLang >= 0.5.23, < 0.5.24): the forward-method handler answers the
  plain ``MLA`` method, never the CPU fused-rope subtype (:func:`absorbed_forward_method`).
- :data:`CPU_IMPORT_STUBS` (SGLang >= 0.5.23, < 0.5.24): import-only stand-ins for
  ``torchvision`` and ``sgl_kernel`` on a CPU machine (:func:`add_import_stubs`; the stand-ins
  themselves are test tooling under ``tests/stubs``, never shipped);
- :data:`ATTENTION_TP_SIZE` (SGLang >= 0.5.23, < 0.5.24): a layer's heads are split over the
  attention-TP group, which DP attention makes smaller than ``--tp`` (:func:`attention_tp_size`).

Each one's ``upstream`` attribute says, in one sentence, which SGLang behaviour it works
around. Importing this module does not import SGLang.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from typing import Any

from mla_backend_integrations._common import Workaround

_LOGGER = "mla_backend.sglang"
#: SGLang versions this adapter was tested with: [min, max).
TESTED_SGLANG_RANGE: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 5, 23), (0, 5, 24))


@functools.lru_cache(maxsize=1)
def sglang_version() -> str:
    """The installed SGLang version (distribution metadata: no SGLang import)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "0"


PLAIN_MLA_ON_CPU = Workaround(
    "plain-mla-on-cpu",
    TESTED_SGLANG_RANGE,
    "on CPU, _dispatch_mla_subtype picks AttnForwardMethod.MLA_FUSED_ROPE_CPU for models with "
    "fused_qkv_a_proj_with_mqa on the Intel AMX path, which runs sgl-kernel's fused "
    "decode op itself and never calls the attention backend",
    sglang_version,
    _LOGGER,
)
CPU_IMPORT_STUBS = Workaround(
    "cpu-import-stubs",
    TESTED_SGLANG_RANGE,
    "SGLang imports torchvision and sgl_kernel at module level in code never run on CPU, and "
    "neither has a build that loads against torch 2.13.0+cpu (PyPI torchvision fails, no CPU "
    "sgl-kernel wheel exists)",
    sglang_version,
    _LOGGER,
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
)


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
