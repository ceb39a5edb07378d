"""The torch-free attention core (``mla_backend/ops/native/csrc/attention_core.h``) built and
run without torch: ``tests/native_core/core_selftest.cpp`` compiled with each host ISA level's
flags (build.level_flags) and no torch include path (so any ATen / c10 include fails the build),
then run: its random decode / extend / empty-request batches over shuffled pages, every cache
layout, against its own float64 reference; exit status 0 only if all cases pass."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mla_backend.ops.native import build, host_isas

HERE = Path(__file__).resolve().parent
SRC = HERE / "native_core" / "core_selftest.cpp"
CXX = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(
    CXX is None or not host_isas(), reason="needs a C++ compiler and an x86-64 ISA level"
)


@pytest.mark.parametrize("level", host_isas() or ["scalar"])
def test_core_builds_without_torch_and_matches_reference(level, tmp_path):
    exe = tmp_path / f"core_selftest_{level}"
    cmd = [CXX, "-std=c++17", "-O2", *build.level_flags(level), f"-I{build._CSRC}", str(SRC)]
    res = subprocess.run([*cmd, "-o", str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout[-4000:]
