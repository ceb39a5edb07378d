"""vLLM adapter of mla-backend: the ``MLA_ABSORB`` attention backend.

Selected with ``--attention-backend mla_absorb`` or ``LLM(..., attention_backend="mla_absorb")``.
Importing this package does not import vLLM. The plugin entry points live in
:mod:`mla_backend_integrations.vllm.plugin`; the backend in
:mod:`mla_backend_integrations.vllm.backend`; a CPU launcher for the ``vllm`` CLI in
:mod:`mla_backend_integrations.vllm.cli`; every engine workaround in
:mod:`mla_backend_integrations.vllm.compat`.
"""

#: The backend name (``--attention-backend mla_absorb``, upper-cased by vLLM); the one place
#: it is spelled.
BACKEND_NAME = "MLA_ABSORB"

__all__ = ["BACKEND_NAME", "is_selected"]


def is_selected(vllm_config: object) -> bool:
    """True when a vLLM engine config selects ``MLA_ABSORB`` as its attention backend."""
    attn_cfg = getattr(vllm_config, "attention_config", None)
    backend = getattr(attn_cfg, "backend", None)
    return backend is not None and getattr(backend, "name", str(backend)) == BACKEND_NAME
