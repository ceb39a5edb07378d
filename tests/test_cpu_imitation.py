"""The imitated-CPU environment of the demo's and benchmarks' engine processes
(``mla_backend_integrations._testing.cpu_imitation`` + ``imitate_shim``), the AMX_MLA refusal on
an imitated CPU, and the failure reason of an engine whose worker died in C++ (the AVX2-imitation
start-up failure: sgl-kernel's AMX GEMM throwing once oneDNN was capped, seen as "cancelled")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mla_backend_integrations._testing import cpu_imitation
from mla_backend_integrations._testing.vllm_backends import (
    FORCE_ENV,
    engine_env,
    failure_reason,
    unavailable_reason,
)
from mla_backend_integrations._testing.vllm_runner import _process_tree

from mla_backend.testing.host import ISA_ENV

_PROBE = """
import json, torch
checks = {n: bool(getattr(torch.cpu, n)()) for n in dir(torch.cpu) if n.startswith("_is_")}
caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
print(json.dumps({"checks": checks, "caps": {k: v for k, v in caps.items() if v in (True, False)},
                  "capability": str(torch.backends.cpu.get_cpu_capability())}))
"""


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def real() -> dict:
    return _probe(dict(os.environ))


@pytest.mark.parametrize("level", cpu_imitation.IMITABLE)
def test_shim_answers_as_the_imitated_cpu(level: str, real: dict) -> None:
    env = cpu_imitation.imitation_env(dict(os.environ), level)
    got = _probe(env)
    absent = set(cpu_imitation.ABSENT[level])
    for name, ok in real["checks"].items():
        assert got["checks"][name] == (False if name in absent else ok), name
    off = set(cpu_imitation.ABSENT_CAPABILITIES[level])
    for key, ok in real["caps"].items():
        assert got["caps"][key] == (False if key in off else ok), key
    if real["checks"].get(f"_is_{level}_supported"):  # the host runs the level: torch capped
        assert got["capability"] == level.upper()


def test_shim_does_nothing_without_its_variable(real: dict) -> None:
    env = cpu_imitation.imitation_env(dict(os.environ), "avx2")
    for k in (cpu_imitation.ABSENT_ENV, *cpu_imitation.CAPS["avx2"]):
        env.pop(k)
    assert _probe(env) == real


def test_imitation_env() -> None:
    base = {"PYTHONPATH": "/somewhere", FORCE_ENV: "1"}
    env, forced = engine_env("CPU_MLA", env=base, imitate="avx2")
    assert not forced and FORCE_ENV not in env
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cpu_imitation.SHIM_DIR), "/somewhere"]
    assert {k: env[k] for k in cpu_imitation.CAPS["avx2"]} == cpu_imitation.CAPS["avx2"]
    assert env[ISA_ENV] == "avx2" and env[cpu_imitation.IMITATE_ENV] == "avx2"
    assert set(env[cpu_imitation.ABSENT_ENV].split(",")) >= {"_is_avx512_supported",
                                                             "_is_amx_tile_supported"}  # fmt: skip
    # a lower level of ours, asked for, is kept
    assert engine_env("MLA_ABSORB", env=base, isa="scalar", imitate="avx2")[0][ISA_ENV] == "scalar"
    assert base == {"PYTHONPATH": "/somewhere", FORCE_ENV: "1"}  # not changed in place


def test_amx_mla_refused_on_an_imitated_cpu() -> None:
    why = unavailable_reason("AMX_MLA", "avx2")
    assert why is not None and "AVX2-only" in why and "AVX512-BF16" in why
    with pytest.raises(RuntimeError, match="AMX_MLA is not available"):
        engine_env("AMX_MLA", env={}, imitate="avx2")
    assert unavailable_reason("CPU_MLA", "avx2") is None
    assert unavailable_reason("MLA_ABSORB", "avx2") is None


@pytest.mark.parametrize("level", ["avx512_bf16", "amx", "neon", ""])
def test_unknown_level_is_named(level: str) -> None:
    with pytest.raises(ValueError, match=f"level {level!r}.*supported"):
        cpu_imitation.imitation_env({}, level)


def test_failure_reason_names_the_worker_that_died_in_cpp() -> None:
    log = "\n".join([
        "(Worker pid=27175) INFO 11-24 11:47:37 [cpu_model_runner.py:87] Warming up model",
        "terminate called recursively",
        "terminate called after throwing an instance of 'c10::Error'",
        "  what():  BFloat16 Brgemm VNNI format is only supported on X64 when oneDNN ukernel",
        "(EngineCore pid=27079) ERROR 11-24 11:47:59 [multiproc_executor.py:315] Worker proc "
        "VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.",
        "Traceback (most recent call last):",
        "RuntimeError: cancelled",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])  # fmt: skip
    why = failure_reason(log, 1)
    assert why.startswith("terminate called after throwing an instance of 'c10::Error'")
    assert "Brgemm VNNI" in why and "VllmWorker-0 died unexpectedly" in why
    assert "cancelled" not in why and "(EngineCore" not in why and why.endswith("(exit 1)")
    # without a fatal line: still the last error line
    assert failure_reason("ok\nValueError: bad block size\n").startswith("ValueError: bad")


def test_process_tree_includes_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = _process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
    finally:
        child.kill()
        child.wait()
