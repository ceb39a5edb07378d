"""SGLang general plugin (entry point group ``sglang.srt.plugins``): registers ``mla_absorb``.

``register()`` runs in every SGLang process before argument parsing (``load_plugins``). It is
idempotent and:

1. registers the backend factory under ``mla_absorb`` (``register_attention_backend``);
2. adds ``mla_absorb`` to the attention-backend choices (``--attention-backend``,
   ``--prefill-attention-backend``, ``--decode-attention-backend``) and to the draft backends
   speculative decoding accepts, through SGLang's extension points
   (``add_attention_backend_choices``, ``add_draft_attention_backend_choices``);
3. registers the DeepSeek forward-method handler (``AttentionBackendRegistry.register``);
4. chooses the absorbed calling convention: by default the model passes ``q_rope``/``k_rope``
   separately (no concatenated copies of q and k); ``MLA_BACKEND_SGLANG_QK=concat`` keeps the
   concatenated ``[q_lat ; q_pe]`` convention. The backend serves both. SGLang has no call for
   this choice: it is a version-guarded workaround (``compat.SPLIT_QK_BACKENDS``).
"""

from __future__ import annotations

import logging
from typing import Any

from mla_backend_integrations.sglang import BACKEND_NAME, compat

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


def register_dsa() -> None:
    """DSA models on the CPU platform: the argument hook's CUDA capability query answered, the
    KV cache in the model's dtype, and SGLang's DSA ``Indexer`` given a CPU forward
    (``compat.DSA_CPU_CAPABILITY``, ``compat.DSA_CPU_KV_DTYPE``, ``compat.DSA_INDEXER_CPU``);
    idempotent."""
    from mla_backend_integrations.sglang.sparse import indexer_forward
    from sglang.srt.arg_groups import model_hook
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    compat.answer_cpu_capability(model_hook, BACKEND_NAME)
    compat.serve_indexer_on_cpu(Indexer, indexer_forward)


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
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices([BACKEND_NAME])
    AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_mla_absorb)
    compat.use_split_qk(
        ds_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS, BACKEND_NAME, qk_convention() == "split"
    )
    register_dsa()
    logger.info("mla-backend: registered SGLang attention backend %r", BACKEND_NAME)
