"""Which vLLM CPU MLA backends can run on this CPU, the environment an engine process gets for
one, which backend the engine really ran (from its log) and why an engine failed.

vLLM 0.32's CPU platform serves a request for ``AMX_MLA`` with CPU_MLA when the CPU has no AMX
tiles (it logs "Using CPU_MLA backend." and nothing else says so). The demo and the benchmarks
compare against AMX_MLA's own code where its kernels can run: on a CPU with AVX-512 and
AVX512-BF16 but no AMX they start its engine with :data:`SHIM_DIR` on ``PYTHONPATH``
(``amx_shim/sitecustomize.py``), which answers "AMX present" to vLLM's CPU platform only, so vLLM
selects and configures AMX_MLA as on an AMX CPU and its kernels take their AVX-512 paths. Where
those kernels cannot run (vLLM loads them from ``_C``, its AVX512-BF16 library, only on such a
CPU: ``vllm/platforms/cpu.py``, ``import_kernels``), AMX_MLA is "not available on this CPU".
An engine may also run on an imitated CPU with fewer instructions
(:mod:`.cpu_imitation`: an AVX2-only one on this host); AMX_MLA is then not available either.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from mla_backend.testing.host import ISA_ENV, has_amx

from . import cpu_imitation

SHIM_DIR = Path(__file__).resolve().parent / "amx_shim"
FORCE_ENV = "MLA_BENCH_FORCE_AMX_MLA"
FORCED_NOTE = (
    "AMX_MLA forced: this CPU has no AMX tiles, where vLLM would run CPU_MLA instead; vLLM's "
    "CPU platform was made to select and configure AMX_MLA as on an AMX CPU "
    "(integrations/_testing/vllm_backends.py); its kernels then run their AVX-512 code (no AMX "
    "tiles), the rest of the model as for every backend."
)
_USING = re.compile(r"Using (\w+) backend\.")
_ERROR = re.compile(r"(Error|Exception|error:|Illegal instruction|Killed|Traceback)")
# a process that died in C++ (an exception escaping an OpenMP region, an illegal instruction):
# the engine's own last error ("RuntimeError: cancelled") only says a worker vanished
_FATAL = re.compile(r"(terminate called after|what\(\):|Illegal instruction|Fatal Python error|"
                    r"Worker proc \S+ died)")  # fmt: skip
_VLLM_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]*\] ")


def amx_mla_unavailable(imitate: str | None = None) -> str | None:
    """Why AMX_MLA's kernels cannot run on this CPU (or on the CPU of level ``imitate``
    imitated here, :mod:`.cpu_imitation`), or None where they can: vLLM loads them (its ``_C``
    library) only where torch reports AVX-512 and AVX512-BF16 (``CpuPlatform.import_kernels``);
    elsewhere it loads ``_C_AVX512`` / ``_C_AVX2``, which lack them, and an AMX_MLA engine dies
    at start-up."""
    import torch

    absent = cpu_imitation.ABSENT[cpu_imitation.check_level(imitate)] if imitate else ()
    missing = [
        name
        for name, check in (
            ("AVX-512", "_is_avx512_supported"),
            ("AVX512-BF16", "_is_avx512_bf16_supported"),
        )
        if check in absent or not getattr(torch.cpu, check)()
    ]
    if missing:
        cpu = f"the imitated {imitate.upper()}-only CPU" if imitate else "this CPU"
        return f"its kernels are in vLLM's AVX512-BF16 library (_C); {cpu} lacks " + " and ".join(
            missing
        )
    return None


def unavailable_reason(backend: str, imitate: str | None = None) -> str | None:
    """Why ``backend`` cannot run on this CPU, or on the one of level ``imitate`` imitated
    here (None: it can, or it is not ours to judge)."""
    return amx_mla_unavailable(imitate) if backend == "AMX_MLA" else None


def engine_env(
    backend: str,
    env: dict[str, str] | None = None,
    isa: str | None = None,
    imitate: str | None = None,
) -> tuple[dict[str, str], bool]:
    """The environment for an engine process running ``backend`` (our kernels at ``isa`` when
    given) on this CPU or, with ``imitate``, on an imitated CPU of that level
    (:func:`.cpu_imitation.imitation_env`); second item: True when AMX_MLA is forced on a CPU
    without AMX."""
    env = dict(os.environ if env is None else env)
    if isa is not None:
        env[ISA_ENV] = isa
    if imitate is not None:
        reason = unavailable_reason(backend, imitate)
        if reason is not None:
            raise RuntimeError(f"{backend} is not available on this CPU: {reason}")
        env.pop(FORCE_ENV, None)
        return cpu_imitation.imitation_env(env, imitate), False
    if backend != "AMX_MLA" or has_amx():
        env.pop(FORCE_ENV, None)
        return env, False
    reason = amx_mla_unavailable()
    if reason is not None:
        raise RuntimeError(f"AMX_MLA is not available on this CPU: {reason}")
    env[FORCE_ENV] = "1"
    return cpu_imitation.prepend_pythonpath(env, SHIM_DIR), True


def selected_from_log(text: str) -> str | None:
    """The backend vLLM says it selected (its last "Using X backend." line), if any."""
    found = _USING.findall(text)
    return found[-1] if found else None


def failure_reason(log: str, returncode: int | None = None) -> str:
    """A one-line reason an engine process failed: where a process died in C++ (``std::terminate``,
    an illegal instruction, a worker that vanished) its first such lines, else its last error
    line (else its last line); and the signal that killed it."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    fatal = list(dict.fromkeys(_VLLM_PREFIX.sub("", ln)[:160] for ln in lines if _FATAL.search(ln)))
    hits = [i for i, ln in enumerate(lines) if _ERROR.search(ln) and not ln.startswith("Traceback")]
    if fatal:
        why = " ".join(fatal[:3])
    elif hits:  # the last error line, and the detail line after it (pydantic, torch checks)
        i = hits[-1]
        why = " ".join(lines[i : i + 2] if i + 1 < len(lines) and i + 1 not in hits else [lines[i]])
    else:
        why = lines[-1] if lines else "no output"
    why = why[-300:]
    if returncode is not None and returncode < 0:
        try:
            why += f" (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            why += f" (signal {-returncode})"
    elif returncode:
        why += f" (exit {returncode})"
    return why
