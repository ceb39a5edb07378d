"""Demo and benchmark only: make vLLM's CPU platform select AMX_MLA on a CPU without AMX.

vLLM 0.32 picks AMX_MLA only where ``torch.cpu._is_amx_tile_supported()``; elsewhere a request
for AMX_MLA silently runs CPU_MLA. On such a CPU (with AVX-512 and AVX512-BF16, which AMX_MLA's
kernels need) this shim, on ``PYTHONPATH`` of the demo's and benchmarks' engine processes only
when ``MLA_BENCH_FORCE_AMX_MLA=1`` (``integrations/_testing/vllm_backends.py``), answers True to
the CPU platform's backend selection and config checks only (``vllm/platforms/cpu.py``), so
AMX_MLA's own code runs (its kernels take their AVX-512 paths) while every other caller (the
linear layers' kernel dispatch, for one) still sees the CPU as it is: the rest of the model runs
as it does for every other backend.
"""

import os
import sys

if os.environ.get("MLA_BENCH_FORCE_AMX_MLA") == "1":
    import torch

    _real = torch.cpu._is_amx_tile_supported
    _PLATFORM = os.path.join("vllm", "platforms", "cpu.py")

    def _is_amx_tile_supported() -> bool:
        if sys._getframe(1).f_code.co_filename.endswith(_PLATFORM):
            return True
        return _real()

    torch.cpu._is_amx_tile_supported = _is_amx_tile_supported
