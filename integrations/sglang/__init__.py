"""SGLang adapter for mla-backend: the ``mla_absorb`` attention backend (issue 4).

Installed as ``mla_backend_integrations.sglang``; SGLang loads it through the entry point
``mla_absorb = "mla_backend_integrations.sglang.plugin:register"`` (group
``sglang.srt.plugins``). Importing this package does not import SGLang.
"""
