"""Scaffolding that drives an engine, for the demo (``examples/``), the benchmarks
(``python -m benchmarks``) and the engine tests; shipped as ``mla_backend_integrations._testing``
so the tests run the same against a wheel. Not used by the adapters. Engine-free test support
(the oracle, the cases, the tiny-model generator, the host description) stays in
:mod:`mla_backend.testing`.

- :mod:`.vllm_backends`, :mod:`.vllm_runner` (+ ``amx_shim/``): which vLLM CPU MLA backends run
  on this CPU, and one backend's engine run in a fresh process (the demo and ``benchmarks``).
- :mod:`.cpu_imitation` (+ ``imitate_shim/``): engine processes on an imitated CPU with fewer
  instructions (an AVX2-only one on an AVX-512/AMX host): torch capped, vLLM's CPU checks shimmed.
- :mod:`.engine_server`: an engine's server process, started and always stopped.
"""
