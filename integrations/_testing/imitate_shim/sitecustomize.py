"""Demo and benchmark only: make this process's ``torch.cpu`` feature checks answer as a CPU
with fewer instructions would.

On ``PYTHONPATH`` of an engine process imitating such a CPU
(:mod:`mla_backend_integrations._testing.cpu_imitation`, which also caps torch's own kernels
through their environment variables and says what the imitated CPU lacks), this shim reads
``MLA_BENCH_IMITATE_ABSENT`` (comma-separated: ``torch.cpu._is_*`` check names, which then
answer False for every caller, and ``torch.cpu.get_capabilities()`` keys, then reported False),
so vLLM picks its kernel library and GEMM paths as it would on that CPU. Nothing happens
without the variable.
"""

import os

_ABSENT = [n for n in os.environ.get("MLA_BENCH_IMITATE_ABSENT", "").split(",") if n]

if _ABSENT:
    import torch

    for _name in _ABSENT:
        if _name.startswith("_is_") and hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
    if hasattr(torch.cpu, "get_capabilities"):
        _real_caps = torch.cpu.get_capabilities
        _off = [n for n in _ABSENT if not n.startswith("_is_")]

        def get_capabilities() -> dict:
            caps = dict(_real_caps())
            caps.update({k: False for k in _off if k in caps})
            return caps

        torch.cpu.get_capabilities = get_capabilities
