"""SGLang adapter for mla-backend: the ``mla_absorb`` attention backend (issue 4).

Installed as ``mla_backend_integrations.sglang``; SGLang loads it through the entry point
``mla_absorb = "mla_backend_integrations.sglang.plugin:register"`` (group
``sglang.srt.plugins``). Importing this package does not import SGLang.
"""

#: The ``--attention-backend`` name (the one place it is spelled).
BACKEND_NAME = "mla_absorb"

__all__ = ["BACKEND_NAME"]
