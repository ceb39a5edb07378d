"""Imitating a CPU with fewer instructions than this one (an AVX2-only x86 server on an
AVX-512/AMX host) for the demo's and the benchmarks' engine processes.

Two things decide which code an engine runs, and both must be capped:

- torch's own kernels read environment variables at start-up: ``ATEN_CPU_CAPABILITY`` (ATen's
  vector code and Inductor's generated code), ``ONEDNN_MAX_CPU_ISA`` (oneDNN),
  ``MKL_ENABLE_INSTRUCTIONS`` (MKL): :data:`CAPS`;
- vLLM asks ``torch.cpu._is_avx512_supported()``, ``_is_avx512_bf16_supported()``,
  ``_is_amx_tile_supported()``, ... (the CPU's own flags, which no variable caps) to pick its
  kernel library (``_C`` / ``_C_AVX512`` / ``_C_AVX2``, ``vllm/platforms/cpu.py``) and, per
  linear layer, sgl-kernel's AMX ``weight_packed_linear`` (``check_cpu_sgl_kernel`` in
  ``vllm/model_executor/layers/utils.py``). With only the variables set, that GEMM's VNNI
  brgemm throws inside an OpenMP region once oneDNN is capped below AMX ("BFloat16 Brgemm VNNI
  format is only supported ... when `amx` is supported"), ``std::terminate`` kills the worker
  and the engine dies at start-up with "RuntimeError: cancelled". The start-up shim
  (``imitate_shim/sitecustomize.py``, on the engine's ``PYTHONPATH``, told by
  :data:`ABSENT_ENV`) makes those checks answer as the imitated CPU would: :data:`ABSENT`,
  :data:`ABSENT_CAPABILITIES`.

Our own kernels are forced to the imitated level (``MLA_BACKEND_NATIVE_ISA``) unless a lower
one is asked for. Name the real CPU next to every figure measured this way.
"""

from __future__ import annotations

import os
from pathlib import Path

from mla_backend.testing.host import ISA_ENV

SHIM_DIR = Path(__file__).resolve().parent / "imitate_shim"
#: the level an engine process imitates
IMITATE_ENV = "MLA_BENCH_IMITATE_ISA"
#: what it lacks: ``torch.cpu`` check names and capability keys (read by the shim)
ABSENT_ENV = "MLA_BENCH_IMITATE_ABSENT"

#: per native ISA level: the environment that caps torch's own kernels (ATen's vector code,
#: oneDNN, MKL) at that level
CAPS: dict[str, dict[str, str]] = {
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
               "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}  # fmt: skip

#: per imitable level: the ``torch.cpu`` checks that answer False in an imitating process
#: (what such a CPU lacks; the others keep the real answer)
ABSENT: dict[str, tuple[str, ...]] = {
    "avx2": ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
             "_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported",
               "_is_amx_fp16_supported"),
}  # fmt: skip
#: the ``torch.cpu.get_capabilities()`` keys reported False along with :data:`ABSENT`
ABSENT_CAPABILITIES: dict[str, tuple[str, ...]] = {
    "avx2": ("avx512_f", "avx512_cd", "avx512_dq", "avx512_bw", "avx512_vl", "avx512_ifma",
             "avx512_vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512_vp2intersect",
             "avx512_4vnniw", "avx512_4fmaps", "avx_vnni", "avx_vnni_int8", "avx_vnni_int16",
             "avx_ne_convert", "avx10_1", "avx10_2", "amx_tile", "amx_bf16", "amx_int8",
             "amx_fp16"),
    "avx512": ("avx512_bf16", "avx512_fp16", "avx10_1", "avx10_2", "amx_tile", "amx_bf16",
               "amx_int8", "amx_fp16"),
}  # fmt: skip
IMITABLE = tuple(ABSENT)


def check_level(level: str) -> str:
    """``level`` if this module can imitate it, else a ValueError naming the supported ones."""
    if level not in ABSENT:
        raise ValueError(f"cannot imitate a CPU at level {level!r}; supported: {IMITABLE}")
    return level


def imitation_env(env: dict[str, str], level: str) -> dict[str, str]:
    """A copy of ``env`` for an engine process imitating a CPU of ``level`` on this one: torch
    capped (:data:`CAPS`), the shim first on ``PYTHONPATH``, our kernels at ``level`` unless
    ``env`` already forces a level (a lower one, for a comparison)."""
    check_level(level)
    out = dict(env, **CAPS[level])
    out[IMITATE_ENV] = level
    out[ABSENT_ENV] = ",".join(ABSENT[level] + ABSENT_CAPABILITIES[level])
    out.setdefault(ISA_ENV, level)
    return prepend_pythonpath(out, SHIM_DIR)


def prepend_pythonpath(env: dict[str, str], path: Path) -> dict[str, str]:
    """``env`` (changed in place and returned) with ``path`` first on ``PYTHONPATH`` (how a
    start-up shim's ``sitecustomize`` reaches an engine process)."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    return env


def note(level: str) -> str:
    """The line every result measured under an imitation carries (next to the real CPU)."""
    caps = " ".join(f"{k}={v}" for k, v in CAPS[check_level(level)].items())
    return (
        f"an {level.upper()}-only CPU imitated on the CPU named above: every engine process "
        f"runs with {caps} and torch.cpu's {', '.join(ABSENT[level])} answering False "
        "(integrations/_testing/cpu_imitation.py), so vLLM loads and dispatches as on such a CPU; "
        f"our kernels at {ISA_ENV} (default: {level})"
    )
