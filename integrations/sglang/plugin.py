"""SGLang general plugin (entry point group ``sglang.srt.plugins``): registers ``mla_absorb``.

``register()`` runs in every SGLang process before argument parsing (``load_plugins``). It is
idempotent and:

1. registers the backend factory under ``mla_absorb`` (``register_attention_backend``);
2. adds ``mla_absorb`` to the ``--attention-backend`` (and prefill/decode/draft) choices;
3. registers the DeepSeek forward-method handler (``AttentionBackendRegistry.register``);
4. chooses the absorbed calling convention: by default ``mla_absorb`` joins
   ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS`` so the model passes ``q_rope``/``k_rope``
   separately (no concatenated copies of q and k); ``MLA_BACKEND_SGLANG_QK=concat`` keeps the
   concatenated ``[q_lat ; q_pe]`` convention. The backend serves both.
"""

from __future__ import annotations

import logging
from typing import Any

from mla_backend_integrations.sglang import BACKEND_NAME

from mla_backend.config import current

logger = logging.getLogger("mla_backend.sglang")
QK_ENV_VAR = "MLA_BACKEND_SGLANG_QK"


def create_mla_absorb_backend(runner: Any) -> Any:
    """Factory SGLang calls with its ModelRunner."""
    from mla_backend_integrations.sglang.backend import MLAAbsorbBackend

    return MLAAbsorbBackend(runner)


def qk_convention() -> str:
    """``split`` (default) or ``concat`` from ``MLA_BACKEND_SGLANG_QK``."""
    value = current().sglang_qk.lower()
    if value not in ("split", "concat"):
        raise ValueError(f"{QK_ENV_VAR}={value!r} is not supported; use 'split' or 'concat'")
    return value


def register() -> None:
    """Entry point: register the backend, its CLI choice and its DeepSeek handler."""
    from mla_backend_integrations.sglang.handler import handle_attention_mla_absorb
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.models.deepseek_common import utils as ds_utils
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_mla_absorb_backend:
        register_attention_backend(BACKEND_NAME)(create_mla_absorb_backend)
    for lst in (choices.ATTENTION_BACKEND_CHOICES, choices.DRAFT_ATTENTION_BACKEND_CHOICES):
        if BACKEND_NAME not in lst:
            lst.append(BACKEND_NAME)
    AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_mla_absorb)
    absorb_list = ds_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    if qk_convention() == "split":
        if BACKEND_NAME not in absorb_list:
            absorb_list.append(BACKEND_NAME)
    elif BACKEND_NAME in absorb_list:
        absorb_list.remove(BACKEND_NAME)
    logger.info("mla-backend: registered SGLang attention backend %r", BACKEND_NAME)
