"""vLLM on an imitated AVX2-only CPU (``mla_backend_integrations._testing.cpu_imitation``),
without an engine: its CPU platform loads ``_C_AVX2`` and its linear-layer dispatch keeps away
from sgl-kernel's AMX ``weight_packed_linear``, whose brgemm throws inside an OpenMP region once
oneDNN is capped at AVX2 (the worker dies in ``std::terminate`` and the engine start-up fails
"cancelled")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from mla_backend_integrations._testing import cpu_imitation

_PROBE = """
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
from mla_backend_integrations._testing.vllm_runner import loaded_vllm_kernels
print(json.dumps({"sgl": check_cpu_sgl_kernel(576, 256, torch.bfloat16),
                  "kernels": loaded_vllm_kernels(),
                  "capability": str(torch.backends.cpu.get_cpu_capability())}))
"""


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=600, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_loads_and_dispatches_as_on_an_avx2_cpu() -> None:
    got = _probe(cpu_imitation.imitation_env(dict(os.environ), "avx2"))
    assert got == {"sgl": False, "kernels": "_C_AVX2", "capability": "AVX2"}


def test_the_caps_alone_would_keep_the_amx_gemm() -> None:
    # the cause of the start-up failure: with the variables but without the shim, vLLM still
    # sees this CPU's AMX tiles and picks the AVX512-BF16 library and the AMX GEMM
    env = dict(os.environ, **cpu_imitation.CAPS["avx2"])
    got = _probe(env)
    avx512, bf16 = torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported()
    lib = ("_C" if bf16 else "_C_AVX512") if avx512 else "_C_AVX2"
    assert got["capability"] == "AVX2" and got["sgl"] == torch.cpu._is_amx_tile_supported()
    assert got["kernels"] == lib
